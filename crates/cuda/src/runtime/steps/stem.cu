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
// of NB (64 or 32); each warp stages a row's results in shared memory of its own so that
// each pixel's channels are stored as whole 16-byte vectors, without waiting for the others.
//
// The `stem_frames` kernels read the f32 frames instead of their cast into the arena, which
// then does not run (`Plan::frames_cast`): the next tile's input is copied (cp.async, 4
// bytes a value, in the frames' own layout) while the warps multiply this one's, and rounded
// to fp16 into the tile's copy as the cast would round it.

struct StemConv {
    int n, h, w, c;      // input, NHWC, c ≤ 4
    int k, oh, ow;       // output channels and size, NHWC
    int r, s;            // kernel height and width
    int sh, sw, ph, pw;  // strides (sw even) and pads
    int act_id;
    float p0, p1;
    int fs[4];  // the frames' strides along images, channels, rows and columns (f32 values)
};

// The shared memory a block of the kernel uses, as stem.rs computes it (`StemLaunch`).
struct StemLayout {
    int groups;  // steps of 4 taps across a tap row: (s + 3) / 4
    int ksteps;  // steps of 16 along the summed dimension: r · groups
    int patch_h, patch_w;
    int weights_bytes, patch_bytes, stage_bytes;
};

template <int NB> __device__ __forceinline__ StemLayout stem_layout(const StemConv &p) {
    StemLayout l;
    l.groups = (p.s + 3) / 4;
    l.ksteps = p.r * l.groups;
    l.patch_h = (STEM_TILE_H - 1) * p.sh + p.r;
    l.patch_w = (STEM_TILE_W - 1) * p.sw + 4 * l.groups;
    l.weights_bytes = l.ksteps * p.k * 32;
    l.patch_bytes = (l.patch_h * l.patch_w * 8 + 15) / 16 * 16;
    l.stage_bytes = STEM_THREADS / 32 * STEM_TILE_W * (NB + 8) * 2;
    return l;
}

// Copies tile `tile`'s input from the f32 frames into `raw` ([channel][row][column], zeros
// outside the image), as one group of cp.async copies.
__device__ __forceinline__ void stem_fetch(const StemConv &p, const StemLayout &l,
                                           const float *x, float *raw, int tile) {
    const int tiles_x = (p.ow + STEM_TILE_W - 1) / STEM_TILE_W;
    const int tiles_y = (p.oh + STEM_TILE_H - 1) / STEM_TILE_H;
    if (tile < p.n * tiles_y * tiles_x) {
        const int img = tile / (tiles_y * tiles_x);
        const int iy0 = tile / tiles_x % tiles_y * STEM_TILE_H * p.sh - p.ph;
        const int ix0 = tile % tiles_x * STEM_TILE_W * p.sw - p.pw;
        const float *frame = x + (long long)img * p.fs[0];
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        for (int row = warp; row < p.c * l.patch_h; row += STEM_THREADS / 32) {
            const int ch = row / l.patch_h, iy = iy0 + row % l.patch_h;
            const bool in_y = iy >= 0 && iy < p.h;
            for (int px = lane; px < l.patch_w; px += 32) {
                const int ix = ix0 + px;
                const bool valid = in_y && ix >= 0 && ix < p.w;
                const float *src = valid ? frame + ch * p.fs[1] + iy * p.fs[2] + ix * p.fs[3] : x;
                cp_async4(raw + row * l.patch_w + px, src, valid);
            }
        }
    }
    cp_async_commit();
}

// Any other activation, called rather than inlined: its dispatch is large.
__device__ __noinline__ float stem_act(int id, float v, float p0, float p1) {
    return act(id, v, p0, p1);
}

// A pass's sums (`acc`, a warp's two rows of 16 pixels), with their bias and activation `f`,
// stored a row at a time through the warp's `stage` (lane l holds pixels l / 4 and l / 4 + 8,
// channels 2·(l % 4) and the next), as 16-byte vectors.
template <int NB, typename F>
__device__ __forceinline__ void stem_store(const StemConv &p, const float (&acc)[2][NB / 8][4],
                                           const T *bias, T *y, int img, int oy0, int ox0,
                                           int pass, T *stage, F f) {
#if defined(HALF)
    constexpr int PITCH = NB + 8;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < NB / 8; ++nt) {
            const int ch = nt * 8 + lane % 4 * 2;
            const float b0 = ld(bias[pass * NB + ch]), b1 = ld(bias[pass * NB + ch + 1]);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int pix = lane / 4 + half * 8;
                const T v0 = st(f(acc[mt][nt][2 * half] + b0));
                const T v1 = st(f(acc[mt][nt][2 * half + 1] + b1));
                *reinterpret_cast<unsigned *>(stage + pix * PITCH + ch) = unsigned(v0) | unsigned(v1) << 16;
            }
        }
        __syncwarp();
        const int oy = oy0 + 2 * warp + mt;
        for (int i = lane; i < STEM_TILE_W * NB / 8; i += 32) {
            const int pix = i / (NB / 8), v = i % (NB / 8), ox = ox0 + pix;
            if (oy >= p.oh || ox >= p.ow) continue;
            T *out = y + ((long long)(img * p.oh + oy) * p.ow + ox) * p.k + pass * NB + v * 8;
            WROTE(out);
            *reinterpret_cast<Vec16 *>(out) = *reinterpret_cast<const Vec16 *>(stage + pix * PITCH + v * 8);
        }
        __syncwarp();  // the row is stored before the next is staged
    }
#endif
}

template <int NB, bool FRAMES, typename X>
__device__ __forceinline__ void stem_conv_body(const StemConv &p, const X *x, const T *weight,
                                               const T *bias, T *y) {
#if defined(HALF)
    static_assert(STEM_THREADS == 128, "four warps, two rows of 16 output pixels each");
    static_assert(STEM_TILE_H == 8 && STEM_TILE_W == 16, "a warp's rows of an mma's 16");
    constexpr int NT = NB / 8;  // tiles of 8 channels in a pass
    constexpr int PITCH = NB + 8;  // a staged pixel's channels and padding, in values
    const StemLayout l = stem_layout<NB>(p);
    unsigned char *smem = dynamic_shared();
    T *ws = reinterpret_cast<T *>(smem);
    unsigned char *patch = smem + l.weights_bytes;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    T *stage = reinterpret_cast<T *>(patch + l.patch_bytes) + warp * STEM_TILE_W * PITCH;
    float *raw = reinterpret_cast<float *>(patch + l.patch_bytes + l.stage_bytes);

    // The first tile's input is on its way while the weights are laid out.
    if constexpr (FRAMES) stem_fetch(p, l, x, raw, blockIdx.x);

    // The weights (KRSC) as [kstep][k][16]: value j of a row is tap 4·(kstep % groups) + j / 4
    // of tap row kstep / groups, channel j % 4. A row's two 16-byte halves trade places where
    // bit 2 of its channel is set, so that ldmatrix's 8 rows fall on different banks. Each
    // thread has 16 loads in flight before it stores them: one at a time, a 7×7 stem's 112
    // a thread took 40 µs, more than the rest of a batch-1 convolution.
    constexpr int LOADS = 16;
    const int values = l.ksteps * p.k * 16;
    for (int first = threadIdx.x; first < values; first += LOADS * blockDim.x) {
        T v[LOADS];
        int at[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int i = first + u * blockDim.x;
            const int j = i % 16, row = i / 16;
            const int n = row % p.k, kstep = row / p.k;
            const int ky = kstep / l.groups, kx = kstep % l.groups * 4 + j / 4, ch = j % 4;
            const bool tap = i < values && kx < p.s && ch < p.c;
            v[u] = tap ? weight[((n * p.r + ky) * p.s + kx) * p.c + ch] : T(0);
            at[u] = i < values ? row * 16 + ((j / 8) ^ (n >> 2 & 1)) * 8 + j % 8 : -1;
        }
#pragma unroll
        for (int u = 0; u < LOADS; ++u)
            if (at[u] >= 0) ws[at[u]] = v[u];
    }

    const int tiles_x = (p.ow + STEM_TILE_W - 1) / STEM_TILE_W;
    const int tiles_y = (p.oh + STEM_TILE_H - 1) / STEM_TILE_H;
    const int tiles = p.n * tiles_y * tiles_x;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int img = tile / (tiles_y * tiles_x);
        const int oy0 = tile / tiles_x % tiles_y * STEM_TILE_H, ox0 = tile % tiles_x * STEM_TILE_W;
        if constexpr (FRAMES) {
            cp_async_wait<0>();
            __syncthreads();  // the tile's input has landed; the tile before is read
            const int plane = l.patch_h * l.patch_w;
            for (int i = threadIdx.x; i < plane; i += blockDim.x) {
                unsigned v[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                for (int ch = 0; ch < 4; ++ch)
                    if (ch < p.c) v[ch] = unsigned(st(raw[ch * plane + i]));
                reinterpret_cast<uint2 *>(patch)[i] = make_uint2(v[0] | v[1] << 16, v[2] | v[3] << 16);
            }
            __syncthreads();  // the tile's copy is whole, and `raw` free for the next
            stem_fetch(p, l, x, raw, tile + gridDim.x);
        } else {
            const int iy0 = oy0 * p.sh - p.ph, ix0 = ox0 * p.sw - p.pw;
            // 8 pixels' loads in flight a thread before any is stored (a 7×7 stem's tile
            // reads 798 pixels: one round).
            constexpr int PIXELS = 8;
            const int pixels = l.patch_h * l.patch_w;
            __syncthreads();  // the tile before is read from the patch
            for (int first = threadIdx.x; first < pixels; first += PIXELS * blockDim.x) {
                uint2 packed[PIXELS];
#pragma unroll
                for (int u = 0; u < PIXELS; ++u) {
                    const int i = first + u * blockDim.x;
                    const int iy = iy0 + i / l.patch_w, ix = ix0 + i % l.patch_w;
                    packed[u] = make_uint2(0, 0);
                    if (i < pixels && iy >= 0 && iy < p.h && ix >= 0 && ix < p.w) {
                        const X *px = x + ((long long)(img * p.h + iy) * p.w + ix) * p.c;
                        packed[u].x = unsigned(px[0]) | (p.c > 1 ? unsigned(px[1]) << 16 : 0u);
                        packed[u].y = (p.c > 2 ? unsigned(px[2]) : 0u) | (p.c > 3 ? unsigned(px[3]) << 16 : 0u);
                    }
                }
#pragma unroll
                for (int u = 0; u < PIXELS; ++u)
                    if (first + u * blockDim.x < pixels)
                        reinterpret_cast<uint2 *>(patch)[first + u * blockDim.x] = packed[u];
            }
            __syncthreads();
        }

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

            // The epilogue, its activation chosen once: the generic dispatch inlined for
            // each of a pass's 128 values made the kernel 360 KB of machine code, which the
            // SM's instruction cache could not hold.
            switch (p.act_id) {
            case ACT_NONE:
                stem_store<NB>(p, acc, bias, y, img, oy0, ox0, pass, stage, [](float v) { return v; });
                break;
            case ACT_RELU:
                stem_store<NB>(p, acc, bias, y, img, oy0, ox0, pass, stage,
                               [](float v) { return act_relu(v, 0.f, 0.f); });
                break;
            case ACT_CLIP:
                stem_store<NB>(p, acc, bias, y, img, oy0, ox0, pass, stage,
                               [&](float v) { return act_clip(v, p.p0, p.p1); });
                break;
            default:
                stem_store<NB>(p, acc, bias, y, img, oy0, ox0, pass, stage,
                               [&](float v) { return stem_act(p.act_id, v, p.p0, p.p1); });
            }
        }
    }
#endif
}

// Four blocks of the 64-channel kernels fit an SM's shared memory (a 7×7 stem's 53 KB) and,
// held to 128 registers, its registers: left alone, the compiler took 167 for
// stem_frames64, and three blocks. The 32-channel ones take fewer (80 to 94) left alone.

// 64 output channels a pass (k a multiple of 64).
extern "C" __global__ void __launch_bounds__(STEM_THREADS, 4)
    stem_conv64(const StemConv p, const T *x, const T *weight, const T *bias, T *y) {
    stem_conv_body<64, false>(p, x, weight, bias, y);
}

// 32 output channels a pass (k a multiple of 32).
extern "C" __global__ void __launch_bounds__(STEM_THREADS)
    stem_conv32(const StemConv p, const T *x, const T *weight, const T *bias, T *y) {
    stem_conv_body<32, false>(p, x, weight, bias, y);
}

// stem_conv64, reading the f32 frames.
extern "C" __global__ void __launch_bounds__(STEM_THREADS, 4)
    stem_frames64(const StemConv p, const float *x, const T *weight, const T *bias, T *y) {
    stem_conv_body<64, true>(p, x, weight, bias, y);
}

// stem_conv32, reading the f32 frames.
extern "C" __global__ void __launch_bounds__(STEM_THREADS)
    stem_frames32(const StemConv p, const float *x, const T *weight, const T *bias, T *y) {
    stem_conv_body<32, true>(p, x, weight, bias, y);
}
