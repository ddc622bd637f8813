// SPDX-License-Identifier: MPL-2.0
// Products and convolutions with 8-bit operands (`plan::Quant`): the input rounded to int8 or
// FP8 E4M3 into rows of patches (a convolution's im2col, a product's own rows), which
// cuBLASLt multiplies by the 8-bit weights into int32 or f32 sums; then the epilogue that
// scales the sums back and adds the bias and the residual. Launched by quant.rs.

// v rounded as `QuantFormat::Int8` rounds: to nearest, ties to even, saturated at ±127.
__device__ __forceinline__ unsigned int round_int8(float v) {
    return (unsigned int)(unsigned char)(signed char)(int)fminf(fmaxf(rintf(v), -127.f), 127.f);
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
struct Patches {
    long long rows;
    int h, w, c, oh, ow, kh, kw, ph, pw, sh, sw, dh, dw;
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
    const int groups = p.c / 8;
    const I per_row = (I)p.kh * p.kw * groups;
    const long long total = p.rows * (long long)per_row;
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < total;
         j += (long long)gridDim.x * blockDim.x) {
        const I i = (I)j;
        const I row = patch_div<I>(p, i, 0, per_row);
        // A tap's index is below kh·kw·c/8, always 32 bits.
        const int tap = (int)(i - row * per_row);
        const int rs = (int)fast_div(tap, p.div_mul[1], p.div_shift[1]);
        const int g = tap - rs * groups;
        const int r = (int)fast_div(rs, p.div_mul[2], p.div_shift[2]);
        const int s = rs - r * p.kw;
        const I pix = patch_div<I>(p, row, 3, (I)p.ow);
        const int ox = (int)(row - pix * p.ow);
        const I img = patch_div<I>(p, pix, 4, (I)p.oh);
        const int oy = (int)(pix - img * p.oh);
        const int iy = oy * p.sh - p.ph + r * p.dh, ix = ox * p.sw - p.pw + s * p.dw;
        unsigned int lo = 0, hi = 0;
        // A scale of 0 (an input that was all zeros in calibration) reads 0, as `fake` does.
        if (iy >= 0 && iy < p.h && ix >= 0 && ix < p.w && p.scale > 0.f) {
            const T *src = x + ((img * p.h + iy) * p.w + ix) * (I)p.c + g * 8;
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
                // Divided, not multiplied by the inverse: the same rounding as `fake`.
                const float v = ld(v8[k]) / p.scale;
                const unsigned int b = p.fp8 ? round_fp8(v) : round_int8(v);
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
        float v = (float)sums[i] * (scale * w_scales[j]);
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
