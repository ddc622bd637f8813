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
extern "C" __global__ void quantize_patches(const T *x, unsigned char *patches, long long rows,
                                            int h, int w, int c, int oh, int ow, int kh, int kw,
                                            int ph, int pw, int sh, int sw, int dh, int dw,
                                            float scale, int fp8) {
    const int groups = c / 8;
    const long long per_row = (long long)kh * kw * groups;
    const long long total = rows * per_row;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long p = i / per_row;
        const int tap = (int)(i - p * per_row);
        const int g = tap % groups, s = (tap / groups) % kw, r = tap / groups / kw;
        const int ox = (int)(p % ow), oy = (int)((p / ow) % oh);
        const long long img = p / ow / oh;
        const int iy = oy * sh - ph + r * dh, ix = ox * sw - pw + s * dw;
        unsigned int lo = 0, hi = 0;
        // A scale of 0 (an input that was all zeros in calibration) reads 0, as `fake` does.
        if (iy >= 0 && iy < h && ix >= 0 && ix < w && scale > 0.f) {
            const T *src = x + ((img * h + iy) * w + ix) * (long long)c + g * 8;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                // Divided, not multiplied by the inverse: the same rounding as `fake`.
                const float v = ld(src[k]) / scale;
                const unsigned int b = fp8 ? round_fp8(v) : round_int8(v);
                if (k < 4) lo |= b << (8 * k);
                else hi |= b << (8 * (k - 4));
            }
        }
        reinterpret_cast<uint2 *>(patches)[i] = make_uint2(lo, hi);
    }
}

// y[p, j] = act(sums[p, j] · scale · w_scales[j] + bias[j] + z[p, j]) over `len` values in
// rows of n: an 8-bit product's sums scaled back (`scale`: the input's scale times the
// product's alpha), then its bias, residual and activation.
template <typename S>
__device__ __forceinline__ void dequantize(const S *sums, T *y, const float *w_scales,
                                           const T *bias, const T *z, long long len, int n,
                                           float scale, int act_id, float p0, float p1) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(i % n);
        float v = (float)sums[i] * (scale * w_scales[j]);
        if (bias) v += ld(bias[j]);
        if (z) v += ld(z[i]);
        y[i] = st(act(act_id, v, p0, p1));
    }
}

// `dequantize` of int8 products' exact int32 sums.
extern "C" __global__ void dequantize_int32(const int *sums, T *y, const float *w_scales,
                                            const T *bias, const T *z, long long len, int n,
                                            float scale, int act_id, float p0, float p1) {
    dequantize(sums, y, w_scales, bias, z, len, n, scale, act_id, p0, p1);
}

// `dequantize` of FP8 products' f32 sums.
extern "C" __global__ void dequantize_f32(const float *sums, T *y, const float *w_scales,
                                          const T *bias, const T *z, long long len, int n,
                                          float scale, int act_id, float p0, float p1) {
    dequantize(sums, y, w_scales, bias, z, len, n, scale, act_id, p0, p1);
}
