// SPDX-License-Identifier: MPL-2.0
// Kernels of the cuda engine, compiled by NVRTC when an engine is built. `T` is the
// storage type (`unsigned short` holding fp16, or `float`); arithmetic is in f32. No
// headers: fp16 conversions are single PTX instructions, so NVRTC needs no include path.

#ifdef HALF
typedef unsigned short T;
__device__ __forceinline__ float ld(T h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ T st(float f) { T h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
#else
typedef float T;
__device__ __forceinline__ float ld(T v) { return v; }
__device__ __forceinline__ T st(float v) { return v; }
#endif

#define MAX_RANK 6

// Activation ids: the order of `Act` in ir.rs.
__device__ __forceinline__ float act(int id, float x, float p0, float p1) {
    switch (id) {
    case 0: return x;
    case 1: return fmaxf(x, 0.f);
    case 2: return x < 0.f ? p0 * x : x;
    case 3: return fminf(fmaxf(x, p0), p1);
    case 4: return 1.f / (1.f + __expf(-x));
    case 5: return fminf(fmaxf(p0 * x + p1, 0.f), 1.f);
    case 6: return x * fminf(fmaxf(x / 6.f + 0.5f, 0.f), 1.f);
    case 7: return x / (1.f + __expf(-x));
    case 8: return tanhf(x);
    case 9: return erff(x);
    case 10: return 0.5f * x * (1.f + erff(x * 0.70710678f));
    case 11: return __expf(x);
    case 12: return sqrtf(x);
    case 13: return -x;
    case 14: return fabsf(x);
    case 15: return 1.f / x;
    case 16: return log1pf(__expf(x));
    case 17: return x < 0.f ? p0 * (__expf(x) - 1.f) : x;
    }
    return x;
}

// Binary ids: the order of `BinOp` in ir.rs; -1 for none.
__device__ __forceinline__ float binop(int id, float a, float b) {
    switch (id) {
    case 0: return a + b;
    case 1: return a - b;
    case 2: return a * b;
    case 3: return a / b;
    case 4: return powf(a, b);
    case 5: return fmaxf(a, b);
    case 6: return fminf(a, b);
    }
    return a;
}

struct Ew {
    long long n;
    int rank;
    int op;
    int act;
    float p0, p1;
    int dims[MAX_RANK];
    long long so[MAX_RANK];
    long long sa[MAX_RANK];
    long long sb[MAX_RANK];
};

template <typename O, typename A>
__device__ __forceinline__ void ew_body(const Ew &p, O *out, const A *a, const T *b,
                                        float (*lda)(A), O (*sto)(float)) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n;
         i += (long long)gridDim.x * blockDim.x) {
        long long rest = i, oo = 0, oa = 0, ob = 0;
        for (int d = p.rank - 1; d >= 0; --d) {
            long long c = rest % p.dims[d];
            rest /= p.dims[d];
            oo += c * p.so[d];
            oa += c * p.sa[d];
            ob += c * p.sb[d];
        }
        float v = lda(a[oa]);
        if (p.op >= 0) v = binop(p.op, v, ld(b[ob]));
        out[oo] = sto(act(p.act, v, p.p0, p.p1));
    }
}

__device__ float ld_f32(float v) { return v; }
__device__ float st_f32(float v) { return v; }
__device__ float ld_t(T v) { return ld(v); }
__device__ T st_t(float v) { return st(v); }

extern "C" __global__ void ew(const Ew p, T *out, const T *a, const T *b) {
    ew_body<T, T>(p, out, a, b, ld_t, st_t);
}
extern "C" __global__ void ew_from_f32(const Ew p, T *out, const float *a, const T *b) {
    ew_body<T, float>(p, out, a, b, ld_f32, st_t);
}
extern "C" __global__ void ew_to_f32(const Ew p, float *out, const T *a, const T *b) {
    ew_body<float, T>(p, out, a, b, ld_t, st_f32);
}

// y = act(y + bias[c] + z) over an NHWC tensor with c channels: the epilogue of a
// convolution that cuDNN's fused call cannot do.
extern "C" __global__ void bias_act(T *y, const T *bias, const T *z, long long n, int c,
                                    int act_id, float p0, float p1) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = ld(y[i]) + ld(bias[i % c]);
        if (z) v += ld(z[i]);
        y[i] = st(act(act_id, v, p0, p1));
    }
}

struct Pool {
    int n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl, pb, pr, max, include_pad;
};

extern "C" __global__ void pool_nhwc(const Pool p, const T *x, T *y) {
    long long total = (long long)p.n * p.oh * p.ow * p.c;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int ch = i % p.c;
        long long r = i / p.c;
        int ox = r % p.ow;
        r /= p.ow;
        int oy = r % p.oh;
        int b = r / p.oh;
        float acc = 0.f, best = -3.402823466e38f;
        int count = 0, padded = 0;
        for (int ky = 0; ky < p.kh; ++ky) {
            int yy = oy * p.sh + ky - p.pt;
            for (int kx = 0; kx < p.kw; ++kx) {
                int xx = ox * p.sw + kx - p.pl;
                if (yy < 0 || xx < 0 || yy >= p.h || xx >= p.w) {
                    padded += (yy < p.h + p.pb && xx < p.w + p.pr);
                    continue;
                }
                float v = ld(x[(((long long)b * p.h + yy) * p.w + xx) * p.c + ch]);
                acc += v;
                best = fmaxf(best, v);
                ++count;
            }
        }
        float v = p.max ? best : acc / (float)(p.include_pad ? count + padded : count);
        y[i] = st(v);
    }
}

// One thread per (image, channel): consecutive threads read consecutive channels.
extern "C" __global__ void global_avg_nhwc(const T *x, T *y, int n, int hw, int c) {
    long long total = (long long)n * c;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int ch = i % c;
        long long b = i / c;
        const T *src = x + b * hw * c + ch;
        float acc = 0.f;
        for (int p = 0; p < hw; ++p) acc += ld(src[(long long)p * c]);
        y[i] = st(acc / hw);
    }
}

__device__ __forceinline__ float block_sum(float v, float *shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < blockDim.x / 32; ++w) total += shared[w];
    return total;
}

__device__ __forceinline__ float block_max(float v, float *shared) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float m = shared[0];
    for (int w = 1; w < blockDim.x / 32; ++w) m = fmaxf(m, shared[w]);
    return m;
}

// One block per row.
extern "C" __global__ void softmax_rows(const T *x, T *y, int len) {
    __shared__ float shared[32];
    const T *row = x + (long long)blockIdx.x * len;
    T *out = y + (long long)blockIdx.x * len;
    float m = -3.402823466e38f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) m = fmaxf(m, ld(row[i]));
    m = block_max(m, shared);
    float s = 0.f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) s += __expf(ld(row[i]) - m);
    s = block_sum(s, shared);
    for (int i = threadIdx.x; i < len; i += blockDim.x) out[i] = st(__expf(ld(row[i]) - m) / s);
}

extern "C" __global__ void layernorm_rows(const T *x, T *y, const T *scale, const T *bias,
                                          int len, float eps) {
    __shared__ float shared[32];
    const T *row = x + (long long)blockIdx.x * len;
    T *out = y + (long long)blockIdx.x * len;
    float s = 0.f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) s += ld(row[i]);
    float mean = block_sum(s, shared) / len;
    float v = 0.f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        float d = ld(row[i]) - mean;
        v += d * d;
    }
    float inv = rsqrtf(block_sum(v, shared) / len + eps);
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        float o = (ld(row[i]) - mean) * inv * ld(scale[i]);
        if (bias) o += ld(bias[i]);
        out[i] = st(o);
    }
}

extern "C" __global__ void mean_rows(const T *x, T *y, int len) {
    __shared__ float shared[32];
    const T *row = x + (long long)blockIdx.x * len;
    float s = 0.f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) s += ld(row[i]);
    s = block_sum(s, shared);
    if (threadIdx.x == 0) y[blockIdx.x] = st(s / len);
}

extern "C" __global__ void lrn_nhwc(const T *x, T *y, long long pixels, int c, int size,
                                    float alpha, float beta, float bias) {
    long long total = pixels * c;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int ch = i % c;
        long long base = i - ch;
        int lo = max(0, ch - (size - 1) / 2), hi = min(c - 1, ch + size / 2);
        float sq = 0.f;
        for (int k = lo; k <= hi; ++k) {
            float v = ld(x[base + k]);
            sq += v * v;
        }
        y[i] = st(ld(x[i]) / powf(bias + alpha / size * sq, beta));
    }
}
