// SPDX-License-Identifier: MPL-2.0
// A network's first convolution, over an image's few channels (1 to 4): ResNet's 7×7/2 stem,
// MobileNet's and EfficientNet's 3×3/2, ConvNeXt's and Swin's 4×4/4; with its bias and
// activation, on the tensor cores (mma.sync m16n8k16, fp16 into f32 sums, sm_80 on). cuDNN's
// kernels want channels by the 8 and run ResNet-50's stem at about a tenth of the GPU's rate
// (docs/benchmarks.md). Launched by stem.rs where the build's timing finds it faster than
// cuDNN (`Tuned::OWN_STEM`).
//
// A block of STEM_THREADS takes tiles of 8 × 16 output pixels in turn, each warp two rows of
// 16 (an mma's 16 rows of A). For a tile it copies the input the tile reads into shared
// memory, each pixel as 4 channels (zeros past c and outside the image), so that two
// neighbouring pixels are 16 bytes: with an even stride across, the 16 rows of an A fragment
// (the same 2 taps × 4 channels for 16 output pixels) are 16 aligned bytes each, and
// ldmatrix reads them from the copy as they lie, with no patches written anywhere. The
// summed dimension is walked as (tap row, 4 taps across) in steps of 16: 4 taps × 4
// channels, taps past the kernel's width with zero weights. The weights, laid out that way
// once, stay in shared memory for all of a block's tiles. The output channels go by passes
// of NB (64 or 32); a pass's results go through shared memory so that each pixel's channels
// are stored as whole 16-byte vectors.

struct StemConv {
    int n, h, w, c;      // input, NHWC, c ≤ 4
    int k, oh, ow;       // output channels and size, NHWC
    int r, s;            // kernel height and width
    int sh, sw, ph, pw;  // strides (sw even) and pads
    int act_id;
    float p0, p1;
};

// The shared memory a block of the kernel uses, as stem.rs computes it (`StemLaunch`).
struct StemLayout {
    int groups;  // steps of 4 taps across a tap row: (s + 3) / 4
    int ksteps;  // steps of 16 along the summed dimension: r · groups
    int patch_h, patch_w;
    int weights_bytes, patch_bytes;
};

__device__ __forceinline__ StemLayout stem_layout(const StemConv &p) {
    StemLayout l;
    l.groups = (p.s + 3) / 4;
    l.ksteps = p.r * l.groups;
    l.patch_h = (STEM_TILE_H - 1) * p.sh + p.r;
    l.patch_w = (STEM_TILE_W - 1) * p.sw + 4 * l.groups;
    l.weights_bytes = l.ksteps * p.k * 32;
    l.patch_bytes = (l.patch_h * l.patch_w * 8 + 15) / 16 * 16;
    return l;
}

// ACT: the activation, an `ACT_*` id, fixed at compile time so that the epilogue's 64
// values a pass inline that one function (the 18-way switch inlined for each of them was
// 360 KB of machine code, past what the SM's instruction cache holds); -1 for `p.act_id`'s
// at run time, for activations a stem rarely has.
template <int NB, int ACT>
__device__ __forceinline__ void stem_conv_body(const StemConv &p, const T *x, const T *weight,
                                               const T *bias, T *y) {
#if defined(HALF)
    static_assert(STEM_THREADS == 128, "four warps, two rows of 16 output pixels each");
    static_assert(STEM_TILE_H == 8 && STEM_TILE_W == 16, "a warp's rows of an mma's 16");
    constexpr int NT = NB / 8;  // tiles of 8 channels in a pass
    constexpr int PITCH = NB + 8;  // a staged pixel's channels and padding, in values
    const StemLayout l = stem_layout(p);
    unsigned char *smem = dynamic_shared();
    T *ws = reinterpret_cast<T *>(smem);
    unsigned char *patch = smem + l.weights_bytes;
    T *stage = reinterpret_cast<T *>(patch + l.patch_bytes);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // The weights (KRSC) as [kstep][k][16]: value j of a row is tap 4·(kstep % groups) + j / 4
    // of tap row kstep / groups, channel j % 4. A row's two 16-byte halves trade places where
    // bit 2 of its channel is set, so that ldmatrix's 8 rows fall on different banks. A
    // thread has 16 loads in flight before it stores any: one at a time, a 7×7 stem's 112
    // loads a thread were most of its time at batch 1.
    constexpr int LOADS = 16;
    const int values = l.ksteps * p.k * 16;
    for (int first = threadIdx.x; first < values; first += LOADS * blockDim.x) {
        T v[LOADS];
        int to[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int i = first + u * blockDim.x;
            const int j = i % 16, row = i / 16;
            const int n = row % p.k, kstep = row / p.k;
            const int ky = kstep / l.groups, kx = kstep % l.groups * 4 + j / 4, ch = j % 4;
            const bool tap = i < values && kx < p.s && ch < p.c;
            v[u] = tap ? weight[((n * p.r + ky) * p.s + kx) * p.c + ch] : T(0);
            to[u] = i < values ? row * 16 + ((j / 8) ^ (n >> 2 & 1)) * 8 + j % 8 : -1;
        }
#pragma unroll
        for (int u = 0; u < LOADS; ++u)
            if (to[u] >= 0) ws[to[u]] = v[u];
    }

    const int tiles_x = (p.ow + STEM_TILE_W - 1) / STEM_TILE_W;
    const int tiles_y = (p.oh + STEM_TILE_H - 1) / STEM_TILE_H;
    const int tiles = p.n * tiles_y * tiles_x;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int img = tile / (tiles_y * tiles_x);
        const int oy0 = tile / tiles_x % tiles_y * STEM_TILE_H, ox0 = tile % tiles_x * STEM_TILE_W;
        const int iy0 = oy0 * p.sh - p.ph, ix0 = ox0 * p.sw - p.pw;
        __syncthreads();  // the tile before is read from the patch and stored
        for (int i = threadIdx.x; i < l.patch_h * l.patch_w; i += blockDim.x) {
            const int iy = iy0 + i / l.patch_w, ix = ix0 + i % l.patch_w;
            uint2 packed = make_uint2(0, 0);
            if (iy >= 0 && iy < p.h && ix >= 0 && ix < p.w) {
                const T *px = x + ((long long)(img * p.h + iy) * p.w + ix) * p.c;
                packed.x = unsigned(px[0]) | (p.c > 1 ? unsigned(px[1]) << 16 : 0u);
                packed.y = (p.c > 2 ? unsigned(px[2]) : 0u) | (p.c > 3 ? unsigned(px[3]) << 16 : 0u);
            }
            reinterpret_cast<uint2 *>(patch)[i] = packed;
        }
        __syncthreads();

        // A fragments: lanes 8j to 8j + 7 name the rows of matrix j, output pixels
        // lane % 8 (+ 8 for matrices 1 and 3) of the warp's row, taps 0-1 (matrices 0 and 1)
        // or 2-3 (2 and 3) of the step's four.
        const int a_px = (lane % 8 + (lane >> 3 & 1) * 8) * p.sw + (lane >> 4) * 2;
        // B fragments: lanes 8j to 8j + 7 name channels lane % 8 (+ 8 for matrices 2 and 3),
        // values 0-7 (matrices 0 and 2) or 8-15 (1 and 3) of their row.
        const int b_n = lane % 8 + (lane >> 4) * 8, b_half = lane >> 3 & 1;
        for (int pass = 0; pass < p.k / NB; ++pass) {
            float acc[2][NT][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
            for (int kstep = 0; kstep < l.ksteps; ++kstep) {
                const int ky = kstep / l.groups, kx0 = kstep % l.groups * 4;
                unsigned a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    const int py = (2 * warp + mt) * p.sh + ky;
                    ldmatrix4(a[mt], patch + (py * l.patch_w + kx0 + a_px) * 8);
                }
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    const int n = pass * NB + np * 16 + b_n;
                    unsigned b[4];
                    ldmatrix4(b, ws + (kstep * p.k + n) * 16 + (b_half ^ (n >> 2 & 1)) * 8);
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        mma_16816(acc[mt][2 * np], a[mt], b[0], b[1]);
                        mma_16816(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
                }
            }

            // The epilogue: each sum with its bias and activation, as fp16, into the stage
            // (lane l holds rows l / 4 and l / 4 + 8, channels 2·(l % 4) and the next).
            __syncthreads();  // the pass before is stored
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int pix = (2 * warp + mt) * 16 + lane / 4 + half * 8;
                        const int ch = nt * 8 + lane % 4 * 2;
                        const T *b = bias + pass * NB + ch;
                        const T v0 = st(act(ACT < 0 ? p.act_id : ACT, acc[mt][nt][2 * half] + ld(b[0]), p.p0, p.p1));
                        const T v1 = st(act(ACT < 0 ? p.act_id : ACT, acc[mt][nt][2 * half + 1] + ld(b[1]), p.p0, p.p1));
                        *reinterpret_cast<unsigned *>(stage + pix * PITCH + ch) =
                            unsigned(v0) | unsigned(v1) << 16;
                    }
            __syncthreads();
            for (int i = threadIdx.x; i < STEM_TILE_H * STEM_TILE_W * NB / 8; i += blockDim.x) {
                const int pix = i / (NB / 8), v = i % (NB / 8);
                const int oy = oy0 + pix / STEM_TILE_W, ox = ox0 + pix % STEM_TILE_W;
                if (oy >= p.oh || ox >= p.ow) continue;
                T *out = y + ((long long)(img * p.oh + oy) * p.ow + ox) * p.k + pass * NB + v * 8;
                WROTE(out);
                *reinterpret_cast<Vec16 *>(out) =
                    *reinterpret_cast<const Vec16 *>(stage + pix * PITCH + v * 8);
            }
        }
    }
#endif
}

// The body for `p.act_id`: its own instance for the activations stems have.
template <int NB>
__device__ __forceinline__ void stem_conv(const StemConv &p, const T *x, const T *weight,
                                          const T *bias, T *y) {
    switch (p.act_id) {
    case ACT_NONE: return stem_conv_body<NB, ACT_NONE>(p, x, weight, bias, y);
    case ACT_RELU: return stem_conv_body<NB, ACT_RELU>(p, x, weight, bias, y);
    case ACT_CLIP: return stem_conv_body<NB, ACT_CLIP>(p, x, weight, bias, y);
    case ACT_SILU: return stem_conv_body<NB, ACT_SILU>(p, x, weight, bias, y);
    default: return stem_conv_body<NB, -1>(p, x, weight, bias, y);
    }
}

// 64 output channels a pass (k a multiple of 64).
extern "C" __global__ void __launch_bounds__(STEM_THREADS)
    stem_conv64(const StemConv p, const T *x, const T *weight, const T *bias, T *y) {
    stem_conv<64>(p, x, weight, bias, y);
}

// 32 output channels a pass (k a multiple of 32).
extern "C" __global__ void __launch_bounds__(STEM_THREADS)
    stem_conv32(const StemConv p, const T *x, const T *weight, const T *bias, T *y) {
    stem_conv<32>(p, x, weight, bias, y);
}
