// SPDX-License-Identifier: MPL-2.0
// Products and convolutions with 8-bit operands (`plan::Quant`): the input rounded to int8 or
// FP8 E4M3 into rows of patches (a convolution's im2col, a product's own rows), which
// cuBLASLt multiplies by the 8-bit weights into int32 or f32 sums; then the epilogue that
// scales the sums back and adds the bias and the residual. Or, for int8, `conv8_*`: all of
// it in one kernel. Launched by quant.rs.

// v rounded as `QuantFormat::Int8` rounds: to nearest, ties to even, saturated at ±127.
__device__ __forceinline__ unsigned int round_int8(float v) {
    return (unsigned int)(unsigned char)(signed char)(int)fminf(fmaxf(rintf(v), -127.f), 127.f);
}

// v / s rounded as `QuantFormat::Int8` rounds it, `inv` being 1 / s (IEEE, computed once by the
// caller; s a normal number, as `QuantFormat::scale` makes every scale but 0, which the callers
// read as 0). The quotient is the IEEE division's to the bit without its check for rare ranges and
// branch to a slow path: Markstein's correction of v · inv, exact where s and the quotient are
// normal numbers (checked against v / s for every finite fp16 v times 20,000 scales from 2⁻³⁰
// to 2¹⁵, and 4·10⁸ random f32 pairs). v is first held to ±128·s, which rounds as anything
// beyond it does (to ±127) and keeps an infinite v from giving NaN (a NaN v gives −127, as
// `round_int8(v / s)` does).
__device__ __forceinline__ unsigned int quantize_int8(float v, float s, float inv) {
    const float held = fminf(fmaxf(v, -128.f * s), 128.f * s);
    const float q = __fmul_rn(held, inv);
    return round_int8(__fmaf_rn(__fmaf_rn(-q, s, held), inv, q));
}

// v rounded as `QuantFormat::Fp8` rounds: E4M3, to nearest even, saturated at ±448.
__device__ __forceinline__ unsigned int round_fp8(float v) {
#if __CUDA_ARCH__ >= 890
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(v));
    return pair & 0xffu;
#else
    return 0u;  // never launched: the runtime refuses FP8 steps below sm_89
#endif
}

// The patches an 8-bit product reads: row p = (img·oh + oy)·ow + ox holds, for each kernel
// tap (r, s) and channel ch, x[img, oy·sh − ph + r·dh, ox·sw − pw + s·dw, ch] / scale rounded
// to 8 bits (0 in the padding), in the weights' KRSC order. A product is the 1×1 case over
// one image of 1×rows pixels. 8 channels a thread: the host checked that c is a multiple of
// 16, so rows of patches and their 8-byte groups are aligned.
// An 8-bit step's shape as a convolution's (a product: 1×1 over one image of 1×rows pixels).
struct ConvShape {
    long long rows;  // output pixels (a product's rows)
    int h, w, c, oh, ow, kh, kw, ph, pw, sh, sw, dh, dw;
};
static_assert(sizeof(ConvShape) == 64, "struct ConvShape no longer matches abi.rs's");

struct Patches {
    ConvShape s;
    float scale;
    int fp8;
    int narrow;  // 1 where every index and offset fits in an int (the host checked)
    int vec;     // 1 where a thread's 8 channels are 16 aligned bytes
    // abi.rs's `divider` of: a row's groups of 8 channels, c / 8, kw, ow, oh.
    unsigned div_mul[5];
    unsigned div_shift[5];
};
static_assert(sizeof(Patches) == 120, "struct Patches no longer matches PatchParams (abi.rs)");

// n / by: with the `which`th divider in 32 bits, by division in 64.
template <typename I>
__device__ __forceinline__ I patch_div(const Patches &p, I n, int which, I by) {
    return sizeof(I) == 4 ? (I)fast_div((unsigned)n, p.div_mul[which], p.div_shift[which])
                          : n / by;
}

template <typename I>
__device__ __forceinline__ void patches_body(const Patches &p, const T *x,
                                             unsigned char *patches) {
    const int groups = p.s.c / 8;
    const I per_row = (I)p.s.kh * p.s.kw * groups;
    const long long total = p.s.rows * (long long)per_row;
    const float inv = 1.f / p.scale;
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < total;
         j += (long long)gridDim.x * blockDim.x) {
        const I i = (I)j;
        const I row = patch_div<I>(p, i, 0, per_row);
        // A tap's index is below kh·kw·c/8, always 32 bits.
        const int tap = (int)(i - row * per_row);
        const int rs = (int)fast_div(tap, p.div_mul[1], p.div_shift[1]);
        const int g = tap - rs * groups;
        const int r = (int)fast_div(rs, p.div_mul[2], p.div_shift[2]);
        const int s = rs - r * p.s.kw;
        const I pix = patch_div<I>(p, row, 3, (I)p.s.ow);
        const int ox = (int)(row - pix * p.s.ow);
        const I img = patch_div<I>(p, pix, 4, (I)p.s.oh);
        const int oy = (int)(pix - img * p.s.oh);
        const int iy = oy * p.s.sh - p.s.ph + r * p.s.dh, ix = ox * p.s.sw - p.s.pw + s * p.s.dw;
        unsigned int lo = 0, hi = 0;
        // A scale of 0 (an input that was all zeros in calibration) reads 0, as `fake` does.
        if (iy >= 0 && iy < p.s.h && ix >= 0 && ix < p.s.w && p.scale > 0.f) {
            const T *src = x + ((img * p.s.h + iy) * p.s.w + ix) * (I)p.s.c + g * 8;
            Vec16 raw[sizeof(T) / 2];  // 8 values: 16 bytes in fp16, 32 in fp32
            T *v8 = reinterpret_cast<T *>(raw);
            if (p.vec) {
                raw[0] = *reinterpret_cast<const Vec16 *>(src);  // fp16 only (the host)
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) v8[k] = src[k];
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                // As `fake` rounds: its division, to the bit (`quantize_int8`).
                const unsigned int b = p.fp8 ? round_fp8(ld(v8[k]) / p.scale)
                                             : quantize_int8(ld(v8[k]), p.scale, inv);
                if (k < 4) lo |= b << (8 * k);
                else hi |= b << (8 * (k - 4));
            }
        }
        reinterpret_cast<uint2 *>(patches)[i] = make_uint2(lo, hi);
    }
}

extern "C" __global__ void quantize_patches(const Patches p, const T *x, unsigned char *patches) {
    if (p.narrow)
        patches_body<int>(p, x, patches);
    else
        patches_body<long long>(p, x, patches);
}

// y[p, j] = act(sums[p, j] · scale · w_scales[j] + bias[j] + z[p, j]) over `len` values in
// rows of n: an 8-bit product's sums scaled back (`scale`: the input's scale times the
// product's alpha), then its bias, residual and activation.
// `n_mul` and `n_shift`: abi.rs's `divider` of n, used where len fits in 31 bits.
template <typename S>
__device__ __forceinline__ void dequantize(const S *sums, T *y, const float *w_scales,
                                           const T *bias, const T *z, long long len, int n,
                                           unsigned n_mul, unsigned n_shift, float scale,
                                           int act_id, float p0, float p1) {
    const bool narrow = len <= 0x7fffffffLL;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        const int j = narrow ? (int)i - (int)fast_div((unsigned)i, n_mul, n_shift) * n
                             : (int)(i % n);
        // Not contracted into a fused multiply-add with the bias, so that `conv8_*` write the
        // same bits.
        float v = __fmul_rn((float)sums[i], scale * w_scales[j]);
        if (bias) v += ld(bias[j]);
        if (z) v += ld(z[i]);
        y[i] = st(act(act_id, v, p0, p1));
    }
}

// `dequantize` of int8 products' exact int32 sums.
extern "C" __global__ void dequantize_int32(const int *sums, T *y, const float *w_scales,
                                            const T *bias, const T *z, long long len, int n,
                                            unsigned n_mul, unsigned n_shift, float scale,
                                            int act_id, float p0, float p1) {
    dequantize(sums, y, w_scales, bias, z, len, n, n_mul, n_shift, scale, act_id, p0, p1);
}

// `dequantize` of FP8 products' f32 sums.
extern "C" __global__ void dequantize_f32(const float *sums, T *y, const float *w_scales,
                                          const T *bias, const T *z, long long len, int n,
                                          unsigned n_mul, unsigned n_shift, float scale,
                                          int act_id, float p0, float p1) {
    dequantize(sums, y, w_scales, bias, z, len, n, n_mul, n_shift, scale, act_id, p0, p1);
}

// An int8 convolution or product in one kernel (implicit GEMM): each block reads its rows'
// input of the plan's type straight from x, rounds it to int8 as `quantize_patches` does
// (`quantize_int8`, so the same bytes), multiplies it by the int8 weights on the tensor cores
// (mma.sync m16n8k32 into exact int32 sums, sm_80 on), and writes y as `dequantize` does: no
// patches and no sums in memory, one launch instead of three (two where a pass rounds the
// input first), and the same output to the bit. The summed dimension (KRSC: a tap's
// channels, tap after tap) is walked in chunks of 64, a thread taking 8 or 16 channels of
// one tap (the host checked that c is a multiple of 16, so that they never straddle two
// taps), the last chunk padded with zeros; a 3×3 convolution reads its input from the cache
// nine times instead of writing it out nine times as patches.
//
// Where such a step's output is read only by later such steps, each as its input at one
// scale, it passes in int8 (`Runtime::chain_int8`): the first writes y as they would round it
// (rounded to the plan's type, then by their input scale, `quantize_int8`: the same bytes
// again), into the start of its buffer, and they (`conv8_*_int8_input`, `conv8_wide_*`) copy
// it into shared memory as it is, with nothing to round.
//
// A block of 256 threads computes 128 rows × COLS output channels (64 or 128, timed at
// build), each of its 8 warps 32 rows × COLS / 2. An int8 input (passed by the step before,
// or rounded by a pass before it: `EightBitKernel::OwnRoundedFirst`) and the weights come by
// cp.async, in four stages of shared memory: three chunks in flight while the warps multiply
// one. An input of the plan's type comes in two: the next chunk's weights by cp.async and its
// input into registers while the warps multiply one, the input rounded into shared memory
// after the products.
struct Conv8 {
    ConvShape s;
    int n;          // output channels
    int summed;     // kh·kw·c: a row of the weights
    float x_scale;  // the input's scale: the int8 input is x / x_scale rounded
    float scale;    // the sums' scale before the channels' (the product's alpha · x_scale)
    int act_id;
    float p0, p1;
    int vec;        // 1 where a thread's 8 channels of x are 16 aligned bytes (fp16)
    int y_int8;     // 1: y is written in int8, as the next step rounds its input
    float y_scale;  // that step's input scale
    // Where y is also written in int8, as the steps that read it as their input round it
    // (by y_scale), beside y in the plan's type for its other readers (0: nowhere).
    unsigned long long y8;
};
static_assert(sizeof(Conv8) == 112, "struct Conv8 no longer matches Conv8Params (abi.rs)");

// C8_ROWS and C8_THREADS come from abi.rs: the launch's grid and block.
static_assert(C8_THREADS == 256, "conv8_body has 8 warps: 4 down the rows, 2 across");
// C8_STRIDE (abi.rs): a row of a chunk in shared memory, 64 bytes and 16 of padding, so that
// the 8 rows an ldmatrix reads fall on 8 different 16-byte groups of banks.
static_assert(C8_STRIDE == C8_CHUNK + 16, "a chunk's row and its padding");

// The sm_80 instructions the kernel is made of (prelude.cu's `ldmatrix4` and cp.async, and
// mma.sync below); below sm_80 it compiles empty and is never launched
// (`EightBit::own_kernel_fits`).
// acc += a · b over 32 of the summed dimension, int8 into int32.
__device__ __forceinline__ void c8_mma(int (&acc)[4], const unsigned (&a)[4], unsigned b0,
                                       unsigned b1) {
#if defined(TRTCLASSIFY_EMULATOR)
    emu::mma_m16n8k32_s8(acc, a, b0, b1);
#elif __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(acc[0]), "+r"(acc[1]), "+r"(acc[2]), "+r"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// A warp's two tiles of 8 output channels from col0 on, for k-step `ks` of the chunk's
// weights in shared memory `bs`: bytes 0-15 then 16-31 of each (m16n8k32's b0-b7), by one
// ldmatrix.x4.
__device__ __forceinline__ void c8_weight_tiles(unsigned (&b0)[2], unsigned (&b1)[2],
                                                const unsigned char *bs, int col0, int ks,
                                                int lane) {
    const int col = col0 + (lane & 7) + ((lane >> 4) << 3);
    unsigned d[4];
    ldmatrix4(d, bs + col * C8_STRIDE + ks + ((lane >> 3) & 1) * 16);
    b0[0] = d[0];
    b0[1] = d[1];
    b1[0] = d[2];
    b1[1] = d[3];
}

// The chunks of an int8 input, all copied by cp.async (`start(stage, chunk)` issues and
// commits one chunk's copies) in STAGES stages of shared memory, STAGES − 1 chunks in flight
// while the warps multiply one (`multiply(stage)`).
template <int STAGES, typename Start, typename Multiply>
__device__ __forceinline__ void c8_pipeline(int chunks, Start start, Multiply multiply) {
#pragma unroll
    for (int chunk = 0; chunk < STAGES - 1; ++chunk) {
        if (chunk < chunks) start(chunk, chunk);
        else cp_async_commit();  // an empty group, so that the waits below count alike
    }
    for (int chunk = 0; chunk < chunks; ++chunk) {
        // This thread's copies of the chunk are in; after the barrier, every thread's, and
        // no warp still multiplies the stage the chunk STAGES − 1 on goes into.
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int ahead = chunk + STAGES - 1;
        if (ahead < chunks) start(ahead % STAGES, ahead);
        else cp_async_commit();
        multiply(chunk % STAGES);
    }
}

// v, an output of the plan's type, as the step that reads it rounds it to int8 (`y_inv`:
// 1 / p.y_scale); a scale of 0 (an input that was all zeros in calibration) reads 0, as
// `fake` does.
__device__ __forceinline__ unsigned c8_output_int8(float y_scale, float y_inv, T v) {
    return y_scale > 0.f ? quantize_int8(ld(v), y_scale, y_inv) : 0u;
}

// The activation of `p`: ReLU and none inline, the others by a call, so that the epilogue's
// many copies of it stay short (the kernel's code is otherwise too large for the instruction
// cache).
__device__ __noinline__ float c8_act_call(int id, float v, float p0, float p1) {
    return act(id, v, p0, p1);
}
__device__ __forceinline__ float c8_act(const Conv8 &p, float v) {
    if (p.act_id == ACT_NONE) return v;
    if (p.act_id == ACT_RELU) return act_relu(v, p.p0, p.p1);
    return c8_act_call(p.act_id, v, p.p0, p.p1);
}

// Two neighbouring values of the plan's type, loaded or stored at once where `pairs`.
struct __align__(2 * sizeof(T)) C8Pair {
    T v[2];
};

// y[at] and y[at + 1] (of a row, j and j + 1) from their sums, as `dequantize` writes them:
// `scale` the sums' scale times each channel's, `bias` its bias, `z` the residual's two values
// (loaded beforehand); in int8 where `y_int8`, as `quantize_patches` would round them for the
// next step (`y_inv` 1 / y_scale).
__device__ __forceinline__ void c8_store(const Conv8 &p, bool has_bias, const float (&scale)[2],
                                         const float (&bias)[2], const T *z, C8Pair zv,
                                         void *y, bool pairs, float y_inv, long long at, int s0,
                                         int s1) {
    const int sums[2] = {s0, s1};
    C8Pair out;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        // As `dequantize`: the product rounded, not fused with the bias.
        float v = __fmul_rn((float)sums[k], scale[k]);
        if (has_bias) v += bias[k];
        if (z) v += ld(zv.v[k]);
        out.v[k] = st(c8_act(p, v));
    }
    if (p.y_int8 || p.y8) {
        const unsigned b[2] = {c8_output_int8(p.y_scale, y_inv, out.v[0]),
                               c8_output_int8(p.y_scale, y_inv, out.v[1])};
        unsigned char *y8 =
            (p.y_int8 ? reinterpret_cast<unsigned char *>(y) : reinterpret_cast<unsigned char *>(p.y8)) +
            at;
        WROTE(y8);
        if (pairs) {
            *reinterpret_cast<unsigned short *>(y8) = (unsigned short)(b[0] | b[1] << 8);
        } else {
            y8[0] = (unsigned char)b[0];
            y8[1] = (unsigned char)b[1];
        }
    }
    if (!p.y_int8) {
        T *yt = reinterpret_cast<T *>(y) + at;
        WROTE(yt);
        if (pairs) {
            *reinterpret_cast<C8Pair *>(yt) = out;
        } else {
            yt[0] = out.v[0];
            yt[1] = out.v[1];
        }
    }
}

// The kernel, blocks of `COLS` output channels, `INT8_IN` where x holds int8 already (written
// by a `conv8_*` before it).
template <int COLS, bool INT8_IN>
__device__ __forceinline__ void conv8_body(const Conv8 &p, const void *x,
                                           const unsigned char *wq, const float *w_scales,
                                           const T *bias, const T *z, void *y) {
    // Dynamic shared memory (`own_shared_bytes` in abi.rs): each stage the input's chunk, then
    // the weights'.
    constexpr int STAGES = INT8_IN ? C8_STAGES_INT8_INPUT : C8_STAGES;
    constexpr int STAGE_BYTES = (C8_ROWS + COLS) * C8_STRIDE;
    unsigned char *const c8_shared = dynamic_shared();
    auto a_tile = [&](int stage) { return c8_shared + stage * STAGE_BYTES; };
    auto b_tile = [&](int stage) { return c8_shared + stage * STAGE_BYTES + C8_ROWS * C8_STRIDE; };
    // Each warp's tiles of 8 channels, and their pairs (an ldmatrix.x4 loads two).
    constexpr int NI = COLS / 16, NJ = NI / 2;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;  // 4 warps down the rows, 2 across the channels
    // Rows and their indices fit in an int (`EightBit::own_kernel_fits`).
    const int m0 = blockIdx.x * C8_ROWS;
    const int n0 = blockIdx.y * COLS;

    // The input this thread brings: of `ROWS` rows, `ROWS_APART` apart, the `WIDTH`
    // channels (16 bytes of int8, or 8 values rounded to int8) at `part`. Each row's first
    // input row in x (its image's) and the top-left input pixel of its taps, once.
    constexpr int ROWS = INT8_IN ? 2 : 4, WIDTH = INT8_IN ? 16 : 8;
    constexpr int PER_ROW = C8_CHUNK / WIDTH, ROWS_APART = C8_THREADS / PER_ROW;
    const int first = tid / PER_ROW, part = tid % PER_ROW;
    int image[ROWS], iy0[ROWS], ix0[ROWS];
    bool live[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        const int row = m0 + first + ROWS_APART * i;
        live[i] = row < p.s.rows;
        const int r = live[i] ? row : 0;
        const int pix = r / p.s.ow, img = pix / p.s.oh;
        image[i] = img * p.s.h;
        iy0[i] = (pix - img * p.s.oh) * p.s.sh - p.s.ph;
        ix0[i] = (r - pix * p.s.ow) * p.s.sw - p.s.pw;
    }
    const int chunks = (p.summed + C8_CHUNK - 1) / C8_CHUNK;

    // Where this thread's part of a chunk is in x, for each of its rows (-1 in the padding,
    // past the rows and past the summed dimension).
    long long from[ROWS];
    auto locate = [&](int chunk) {
        const int k = chunk * C8_CHUNK + part * WIDTH;
        const int tap = k / p.s.c, c0 = k - tap * p.s.c;
        const int r = tap / p.s.kw, s = tap - r * p.s.kw;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int iy = iy0[i] + r * p.s.dh, ix = ix0[i] + s * p.s.dw;
            const bool inside =
                live[i] && k < p.summed && iy >= 0 && iy < p.s.h && ix >= 0 && ix < p.s.w;
            from[i] = inside ? ((long long)(image[i] + iy) * p.s.w + ix) * p.s.c + c0 : -1;
        }
    };
    // An int8 input: copied into `stage` as it is, zeros where there is none.
    auto copy_into = [&](int stage) {
        const unsigned char *x8 = reinterpret_cast<const unsigned char *>(x);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int row = first + ROWS_APART * i;
            cp_async16(a_tile(stage) + row * C8_STRIDE + part * WIDTH,
                       from[i] < 0 ? x8 : x8 + from[i], from[i] >= 0);
        }
    };
    // An input of the plan's type: fetched into registers, then rounded into `stage`.
    Vec16 raw[ROWS][sizeof(T) / 2];
    auto fetch = [&]() {
        const T *xt = reinterpret_cast<const T *>(x);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            if (from[i] < 0) continue;
            const T *src = xt + from[i];
            if (p.vec) {
                raw[i][0] = *reinterpret_cast<const Vec16 *>(src);  // fp16 only (the host)
            } else {
                T *v8 = reinterpret_cast<T *>(raw[i]);
#pragma unroll
                for (int k = 0; k < 8; ++k) v8[k] = src[k];
            }
        }
    };
    const float x_inv = 1.f / p.x_scale;
    auto round_into = [&](int stage) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            unsigned int lo = 0, hi = 0;
            // A scale of 0 (an input that was all zeros in calibration) reads 0, as `fake` does.
            if (from[i] >= 0 && p.x_scale > 0.f) {
                const T *v8 = reinterpret_cast<const T *>(raw[i]);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const unsigned int b = quantize_int8(ld(v8[k]), p.x_scale, x_inv);
                    if (k < 4) lo |= b << (8 * k);
                    else hi |= b << (8 * (k - 4));
                }
            }
            const int row = first + ROWS_APART * i;
            *reinterpret_cast<uint2 *>(a_tile(stage) + row * C8_STRIDE + part * WIDTH) =
                make_uint2(lo, hi);
        }
    };
    // The chunk's weights into `stage`: COLS channels × 64 bytes, 16 bytes at a time, of
    // channels 64 apart; the channels past n and the bytes past a row's end read as zeros.
    auto weights_into = [&](int stage, int chunk) {
        const int k = chunk * C8_CHUNK + (tid & 3) * 16;
#pragma unroll
        for (int i = 0; i < COLS / 64; ++i) {
            const int col = (tid >> 2) + 64 * i;
            const bool in = n0 + col < p.n && k < p.summed;
            const unsigned char *src = in ? wq + (long long)(n0 + col) * p.summed + k : wq;
            cp_async16(b_tile(stage) + col * C8_STRIDE + (tid & 3) * 16, src, in);
        }
    };
    // The chunk's operands into `stage`, where they come without rounding.
    auto start_chunk = [&](int stage, int chunk) {
        locate(chunk);
        if (INT8_IN) copy_into(stage);
        else fetch();
        weights_into(stage, chunk);
        cp_async_commit();
    };

    int acc[2][NI][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[mi][ni][k] = 0;

    // acc += the chunk in `stage`.
    auto multiply = [&](int stage) {
        const unsigned char *as = a_tile(stage), *bs = b_tile(stage);
#pragma unroll
        for (int ks = 0; ks < C8_CHUNK; ks += 32) {
            // A: rows 0-7 and 8-15 of bytes 0-15, then of bytes 16-31 (m16n8k32's a0-a15).
            unsigned a[2][4], b[NI][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int row = wm * 32 + mi * 16 + (lane & 15);
                ldmatrix4(a[mi], as + row * C8_STRIDE + ks + (lane >> 4) * 16);
            }
            // B: two tiles of 8 channels at once.
#pragma unroll
            for (int nj = 0; nj < NJ; ++nj)
                c8_weight_tiles(b[2 * nj], b[2 * nj + 1], bs, wn * (COLS / 2) + nj * 16, ks, lane);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) c8_mma(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
        }
    };

    if (INT8_IN) {
        c8_pipeline<STAGES>(chunks, start_chunk, multiply);
    } else {
        // An input of the plan's type: the next chunk fetched into registers while the warps
        // multiply this one, rounded into shared memory after.
        start_chunk(0, 0);
        round_into(0);
        cp_async_wait<0>();
        __syncthreads();
        for (int chunk = 0; chunk < chunks; ++chunk) {
            const int stage = chunk & 1;
            const bool next = chunk + 1 < chunks;
            if (next) start_chunk(stage ^ 1, chunk + 1);
            multiply(stage);
            if (next) round_into(stage ^ 1);
            cp_async_wait<0>();
            __syncthreads();
        }
    }

    // The epilogue. Each thread's sums are of rows g, g + 8, g + 16 and g + 24 of its warp's
    // 32, and of channels j and j + 1 of each of its warp's tiles of 8: their scales and bias
    // once, the residual's values all loaded before the first is written.
    const int g = lane >> 2, t = lane & 3;
    const bool has_bias = bias != nullptr;
    const bool pairs =
        (reinterpret_cast<size_t>(y) % (p.y_int8 ? 2 : 2 * sizeof(T))) == 0 &&
        (reinterpret_cast<size_t>(z) % (2 * sizeof(T))) == 0;
    const float y_inv = 1.f / p.y_scale;
    C8Pair zv[NI][4];
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const int row = m0 + wm * 32 + g + 8 * h;
            const int j = n0 + wn * (COLS / 2) + ni * 8 + 2 * t;
            // n is a multiple of 8: j < n means j + 1 < n too.
            if (!z || row >= p.s.rows || j >= p.n) continue;
            const T *at = z + (long long)row * p.n + j;
            if (pairs) {
                zv[ni][h] = *reinterpret_cast<const C8Pair *>(at);
            } else {
                zv[ni][h].v[0] = at[0];
                zv[ni][h].v[1] = at[1];
            }
        }
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
        const int j = n0 + wn * (COLS / 2) + ni * 8 + 2 * t;
        if (j >= p.n) continue;
        // As `dequantize`: the sums' scale times the channel's, rounded.
        const float scale[2] = {p.scale * w_scales[j], p.scale * w_scales[j + 1]};
        const float b[2] = {has_bias ? ld(bias[j]) : 0.f, has_bias ? ld(bias[j + 1]) : 0.f};
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            // acc[mi] holds rows mi·16 + g (sums 0 and 1) and mi·16 + g + 8 (sums 2 and 3).
            const int mi = h >> 1, half = h & 1;
            const int row = m0 + wm * 32 + mi * 16 + g + 8 * half;
            if (row >= p.s.rows) continue;
            const int *s = &acc[mi][ni][2 * half];
            c8_store(p, has_bias, scale, b, z, zv[ni][h], y, pairs, y_inv,
                     (long long)row * p.n + j, s[0], s[1]);
        }
    }
}

// Launched with 256 threads, a grid of ⌈rows / 128⌉ × ⌈n / COLS⌉ blocks; y is of the plan's
// type, or int8 where `p.y_int8`. The `_int8_input` kernels read an int8 x, written by one with
// `p.y_int8` (16-byte aligned: the host checked).
#define CONV8(COLS, INPUT, X, INT8_IN)                                                          \
    extern "C" __global__ void __launch_bounds__(C8_THREADS)                                    \
        conv8_##COLS##INPUT(const Conv8 p, const X *x, const unsigned char *wq,                 \
                            const float *w_scales, const T *bias, const T *z, void *y) {        \
        conv8_body<COLS, INT8_IN>(p, x, wq, w_scales, bias, z, y);                              \
    }
CONV8(64, , T, false)
CONV8(64, _int8_input, unsigned char, true)
CONV8(128, , T, false)
CONV8(128, _int8_input, unsigned char, true)

// 8 neighbouring outputs of a row, j to j + 7, as `c8_store` writes them two at a time (the
// same arithmetic, so the same bits): their scales and bias taken once (`start`), the residual
// loaded (`load`), then written (`store`), 16 bytes at a time where the addresses allow.
struct C8Eight {
    float scale[8], bias[8];
    int j;
    bool has_bias;
    bool vec;  // y and z at 16 bytes (8 for an int8 y): whole groups of 8 at once
    float y_inv;

    __device__ __forceinline__ void start(const Conv8 &p, int j0, const float *w_scales,
                                          const T *b, const void *y, const T *z) {
        j = j0;
        has_bias = b != nullptr;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            scale[k] = p.scale * w_scales[j + k];
            bias[k] = b ? ld(b[j + k]) : 0.f;
        }
        vec = reinterpret_cast<size_t>(y) % (p.y_int8 ? 8 : 16) == 0 &&
              reinterpret_cast<size_t>(z) % 16 == 0;
        y_inv = 1.f / p.y_scale;
    }

    __device__ __forceinline__ void load(const T *z, int row, int n, T (&zv)[8]) const {
        const T *at = z + (long long)row * n + j;
        if (vec) {
#pragma unroll
            for (int k = 0; k < 8; k += VEC)
                *reinterpret_cast<Vec16 *>(zv + k) = *reinterpret_cast<const Vec16 *>(at + k);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) zv[k] = at[k];
        }
    }

    __device__ __forceinline__ void store(const Conv8 &p, int row, const int (&sums)[8],
                                          const T (&zv)[8], bool has_z, void *y) const {
        __align__(16) T out[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            // As `dequantize`: the product rounded, not fused with the bias.
            float v = __fmul_rn((float)sums[k], scale[k]);
            if (has_bias) v += bias[k];  // not + 0, which would turn −0 into +0
            if (has_z) v += ld(zv[k]);
            out[k] = st(c8_act(p, v));
        }
        const long long at = (long long)row * p.n + j;
        if (p.y_int8 || p.y8) {
            unsigned lo = 0u, hi = 0u;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const unsigned b = c8_output_int8(p.y_scale, y_inv, out[k]);
                if (k < 4) lo |= b << (8 * k);
                else hi |= b << (8 * (k - 4));
            }
            unsigned char *y8 = (p.y_int8 ? reinterpret_cast<unsigned char *>(y)
                                          : reinterpret_cast<unsigned char *>(p.y8)) +
                                at;
            WROTE(y8);
            if (vec) {
                *reinterpret_cast<uint2 *>(y8) = make_uint2(lo, hi);
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    y8[k] = (unsigned char)((k < 4 ? lo : hi) >> (8 * (k & 3)));
            }
        }
        if (!p.y_int8) {
            T *yt = reinterpret_cast<T *>(y) + at;
            WROTE(yt);
            if (vec) {
#pragma unroll
                for (int k = 0; k < 8; k += VEC)
                    *reinterpret_cast<Vec16 *>(yt + k) = *reinterpret_cast<const Vec16 *>(out + k);
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) yt[k] = out[k];
            }
        }
    }
};

// The own kernel in warps of 64 × 64 outputs (`EightBitKernel::OwnWide`): for an int8 input
// only (rounded by a pass first, or passed by the step before), WARPS_M × WARPS_N warps, so a
// block of 64·WARPS_M rows × 64·WARPS_N channels (128 × 128 or 256 × 64), with the same
// operands, products and epilogue arithmetic as `conv8_body` and so the same output to the
// bit, its epilogue through shared memory (`C8Eight`: 16-byte loads and stores). A warp
// of 64 × 64 loads a k-step's 4 tiles of input and 8 of weights by 8 ldmatrix for its 32
// mma, where `conv8_body`'s warps of 32 × 64 load 6 for 16: less traffic from shared memory
// an mma. Each thread follows its part of the summed dimension from chunk to chunk by
// counting taps, not dividing. 128 threads a block, 4 stages of 64 of the summed dimension,
// so that on sm_90 two blocks fit an SM (their registers and 80 or 100 KiB of shared memory
// each) and one's barriers hide behind the other's products; sm_80 and sm_87 hold one of
// 256 × 64, and sm_86 and sm_89 (99 KiB a block) only 128 × 128 (`OwnLaunch::fits`).
template <int WARPS_M, int WARPS_N>
__device__ __forceinline__ void conv8_wide_body(const Conv8 &p, const unsigned char *x,
                                                const unsigned char *wq, const float *w_scales,
                                                const T *bias, const T *z, void *y) {
    constexpr int THREADS = 32 * WARPS_M * WARPS_N, BM = 64 * WARPS_M, BN = 64 * WARPS_N;
    constexpr int STAGES = C8_STAGES_INT8_INPUT, STAGE_BYTES = (BM + BN) * C8_STRIDE;
    static_assert(THREADS == C8_WIDE_THREADS, "abi.rs launches the wide kernels so");
    unsigned char *const c8_shared = dynamic_shared();
    auto a_tile = [&](int stage) { return c8_shared + stage * STAGE_BYTES; };
    auto b_tile = [&](int stage) { return c8_shared + stage * STAGE_BYTES + BM * C8_STRIDE; };
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;

    // A chunk's row is 4 parts of 16 bytes: this thread copies part `part` of rows `first`,
    // first + 32, ..., of the input's BM and of the weights' BN.
    constexpr int ROWS = BM / 32, COLS = BN / 32;
    const int part = tid & 3, first = tid >> 2;
    int image[ROWS], iy0[ROWS], ix0[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        const int row = m0 + first + 32 * i;
        // -1: past the rows, never inside.
        const int r = row < p.s.rows ? row : -1;
        const int pix = r < 0 ? 0 : r / p.s.ow, img = pix / p.s.oh;
        image[i] = r < 0 ? -1 : img * p.s.h;
        iy0[i] = (pix - img * p.s.oh) * p.s.sh - p.s.ph;
        ix0[i] = (r - pix * p.s.ow) * p.s.sw - p.s.pw;
    }
    const int chunks = (p.summed + C8_CHUNK - 1) / C8_CHUNK;
    // The next chunk this thread copies: its part's place in the summed dimension, as a
    // channel of a tap (r, s), advanced a chunk at a time.
    int k = part * 16, c0 = k % p.s.c, tap = k / p.s.c;
    int tr = tap / p.s.kw, ts = tap - tr * p.s.kw;
    const unsigned char *zero = x;  // a valid address for the copies that read nothing

    auto start_chunk = [&](int stage, int chunk) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int iy = iy0[i] + tr * p.s.dh, ix = ix0[i] + ts * p.s.dw;
            const bool inside = image[i] >= 0 && k < p.summed && iy >= 0 && iy < p.s.h &&
                                ix >= 0 && ix < p.s.w;
            const long long at = ((long long)(image[i] + iy) * p.s.w + ix) * p.s.c + c0;
            cp_async16(a_tile(stage) + (first + 32 * i) * C8_STRIDE + part * 16,
                       inside ? x + at : zero, inside);
        }
#pragma unroll
        for (int i = 0; i < COLS; ++i) {
            const int col = first + 32 * i;
            const bool in = n0 + col < p.n && k < p.summed;
            const unsigned char *src = in ? wq + (long long)(n0 + col) * p.summed + k : wq;
            cp_async16(b_tile(stage) + col * C8_STRIDE + part * 16, src, in);
        }
        cp_async_commit();
        // On to the next chunk: 64 further, over as many taps as that crosses (c ≥ 16).
        k += C8_CHUNK;
        for (c0 += C8_CHUNK; c0 >= p.s.c; c0 -= p.s.c)
            if (++ts == p.s.kw) {
                ts = 0;
                ++tr;
            }
    };

    int acc[4][8][4];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0;

    // acc += the chunk in `stage`: each k-step the warp's 8 tiles of weights, then its 4 of
    // input one at a time, each by the 8.
    auto multiply = [&](int stage) {
        const unsigned char *as = a_tile(stage), *bs = b_tile(stage);
#pragma unroll
        for (int ks = 0; ks < C8_CHUNK; ks += 32) {
            unsigned b[8][2];
#pragma unroll
            for (int nj = 0; nj < 4; ++nj)
                c8_weight_tiles(b[2 * nj], b[2 * nj + 1], bs, wn * 64 + nj * 16, ks, lane);
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                unsigned a[4];
                const int row = wm * 64 + mi * 16 + (lane & 15);
                ldmatrix4(a, as + row * C8_STRIDE + ks + (lane >> 4) * 16);
#pragma unroll
                for (int ni = 0; ni < 8; ++ni) c8_mma(acc[mi][ni], a, b[ni][0], b[ni][1]);
            }
        }
    };

    c8_pipeline<STAGES>(chunks, start_chunk, multiply);

    // The epilogue, through shared memory: the warps' sums into a tile of the block's rows
    // (the stages are free once every copy is in and every warp is past its products), then
    // each thread takes 8 neighbouring channels of a row at a time, so that the residual's
    // loads and the output's stores are 16 bytes a thread and a warp's are contiguous, where
    // each thread's own sums are of 2 channels of 8 rows apart.
    cp_async_wait<0>();
    __syncthreads();
    // Ints a row of the tile: 8 of padding, so that a warp's 8 rows of sums fall on
    // different banks.
    constexpr int SUMS_STRIDE = BN + 8;
    static_assert(BM * SUMS_STRIDE * 4 <= STAGES * STAGE_BYTES, "the sums fit in the stages");
    int *sums = reinterpret_cast<int *>(c8_shared);
    {
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int ni = 0; ni < 8; ++ni) {
                // acc[mi][ni] holds rows mi·16 + g (sums 0 and 1) and mi·16 + g + 8 (2 and 3).
                int *at = sums + (wm * 64 + mi * 16 + g) * SUMS_STRIDE + wn * 64 + ni * 8 + 2 * t;
                *reinterpret_cast<int2 *>(at) = make_int2(acc[mi][ni][0], acc[mi][ni][1]);
                *reinterpret_cast<int2 *>(at + 8 * SUMS_STRIDE) =
                    make_int2(acc[mi][ni][2], acc[mi][ni][3]);
            }
    }
    __syncthreads();
    constexpr int GROUPS = BN / 8, ROW_STEP = THREADS / GROUPS;
    const int group = tid % GROUPS;
    const int j = n0 + group * 8;
    // n is a multiple of 8: j < n means j + 7 < n too.
    if (j >= p.n) return;
    C8Eight e;
    e.start(p, j, w_scales, bias, y, z);
    // Four rows at a time, their residual loaded before the first is written.
    for (int r = tid / GROUPS; r < BM; r += 4 * ROW_STEP) {
        __align__(16) T zv[4][8];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int row = m0 + r + q * ROW_STEP;
            if (z && r + q * ROW_STEP < BM && row < p.s.rows) e.load(z, row, p.n, zv[q]);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int row = m0 + r + q * ROW_STEP;
            if (r + q * ROW_STEP >= BM || row >= p.s.rows) break;
            __align__(16) int s8[8];
            const int *at = sums + (r + q * ROW_STEP) * SUMS_STRIDE + group * 8;
            *reinterpret_cast<int4 *>(s8) = *reinterpret_cast<const int4 *>(at);
            *reinterpret_cast<int4 *>(s8 + 4) = *reinterpret_cast<const int4 *>(at + 4);
            e.store(p, row, s8, zv[q], z != nullptr, y);
        }
    }
}

// Launched with C8_WIDE_THREADS threads, a grid of ⌈rows / ROWS⌉ × ⌈n / COLS⌉ blocks; x is
// int8 (16-byte aligned), y as `conv8_*`'s.
#define CONV8_WIDE(ROWS, COLS)                                                                  \
    extern "C" __global__ void __launch_bounds__(C8_WIDE_THREADS, 2)                           \
        conv8_wide_##ROWS##x##COLS(const Conv8 p, const unsigned char *x,                       \
                                   const unsigned char *wq, const float *w_scales,              \
                                   const T *bias, const T *z, void *y) {                        \
        conv8_wide_body<ROWS / 64, COLS / 64>(p, x, wq, w_scales, bias, z, y);                  \
    }
CONV8_WIDE(256, 64)
CONV8_WIDE(128, 128)
