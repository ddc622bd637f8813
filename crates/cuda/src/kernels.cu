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

// Activation ids: `act_params` in abi.rs.
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

// Binary ids: `binop_id` in abi.rs; -1 for none.
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
// The size that abi.rs's `EwParams` asserts too, with the offsets this layout gives its
// fields (NVRTC has no offsetof): a field changed on one side only stops a build.
static_assert(sizeof(Ew) == 200, "struct Ew no longer matches EwParams (abi.rs)");

// The offsets in out, a and b of element `i` of `dims`. 32-bit division where the index fits:
// 64-bit division costs several times as much, and this runs once per element.
__device__ __forceinline__ void ew_offsets(const Ew &p, long long i, long long &oo,
                                           long long &oa, long long &ob) {
    oo = oa = ob = 0;
    if (p.n <= 0x7fffffffLL) {
        int rest = (int)i;
        for (int d = p.rank - 1; d >= 0; --d) {
            int c = rest % p.dims[d];
            rest /= p.dims[d];
            oo += c * p.so[d];
            oa += c * p.sa[d];
            ob += c * p.sb[d];
        }
        return;
    }
    long long rest = i;
    for (int d = p.rank - 1; d >= 0; --d) {
        long long c = rest % p.dims[d];
        rest /= p.dims[d];
        oo += c * p.so[d];
        oa += c * p.sa[d];
        ob += c * p.sb[d];
    }
}

template <typename O, typename A>
__device__ __forceinline__ void ew_body(const Ew &p, O *out, const A *a, const T *b,
                                        float (*lda)(A), O (*sto)(float)) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n;
         i += (long long)gridDim.x * blockDim.x) {
        long long oo, oa, ob;
        ew_offsets(p, i, oo, oa, ob);
        float v = lda(a[oa]);
        if (p.op >= 0) v = binop(p.op, v, ld(b[ob]));
        out[oo] = sto(act(p.act, v, p.p0, p.p1));
    }
}

// 16 bytes, moved by one vector load or store; VEC elements.
struct alignas(16) Vec16 {
    unsigned int x, y, z, w;
};
#define VEC (16 / (int)sizeof(T))

// `ew` with 16-byte loads and stores, VEC consecutive elements of the last dimension per
// thread. The host checked that the last dimension is a multiple of VEC, contiguous and
// 16-byte aligned in out and a, and in b unless b is constant along it.
extern "C" __global__ void ew_vec(const Ew p, T *out, const T *a, const T *b) {
    const bool bvec = p.op >= 0 && p.sb[p.rank - 1] != 0;
    const long long nv = p.n / VEC;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < nv;
         i += (long long)gridDim.x * blockDim.x) {
        long long oo, oa, ob;
        ew_offsets(p, i * VEC, oo, oa, ob);
        const Vec16 va = *reinterpret_cast<const Vec16 *>(a + oa);
        Vec16 vb = {0, 0, 0, 0};
        if (bvec) vb = *reinterpret_cast<const Vec16 *>(b + ob);
        const float bs = p.op >= 0 && !bvec ? ld(b[ob]) : 0.f;
        const T *ea = reinterpret_cast<const T *>(&va);
        const T *eb = reinterpret_cast<const T *>(&vb);
        Vec16 vo;
        T *eo = reinterpret_cast<T *>(&vo);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            float v = ld(ea[k]);
            if (p.op >= 0) v = binop(p.op, v, bvec ? ld(eb[k]) : bs);
            eo[k] = st(act(p.act, v, p.p0, p.p1));
        }
        *reinterpret_cast<Vec16 *>(out + oo) = vo;
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
// The scores that a product wrote in f32, with its bias (in T) and activation.
extern "C" __global__ void ew_f32(const Ew p, float *out, const float *a, const T *b) {
    ew_body<float, float>(p, out, a, b, ld_f32, st_f32);
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

// `bias_act` with 16-byte loads and stores, VEC channels per thread; the host checked that
// c is a multiple of VEC and that y, bias and z are 16-byte aligned.
extern "C" __global__ void bias_act_vec(T *y, const T *bias, const T *z, long long n, int c,
                                        int act_id, float p0, float p1) {
    const long long nv = n / VEC;
    const int cv = c / VEC;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < nv;
         i += (long long)gridDim.x * blockDim.x) {
        const int ch = (nv <= 0x7fffffffLL ? (int)i % cv : (int)(i % cv)) * VEC;
        Vec16 vy = reinterpret_cast<Vec16 *>(y)[i];
        const Vec16 vbias = *reinterpret_cast<const Vec16 *>(bias + ch);
        Vec16 vz = {0, 0, 0, 0};
        if (z) vz = reinterpret_cast<const Vec16 *>(z)[i];
        T *ey = reinterpret_cast<T *>(&vy);
        const T *eb = reinterpret_cast<const T *>(&vbias);
        const T *ez = reinterpret_cast<const T *>(&vz);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            float v = ld(ey[k]) + ld(eb[k]);
            if (z) v += ld(ez[k]);
            ey[k] = st(act(act_id, v, p0, p1));
        }
        reinterpret_cast<Vec16 *>(y)[i] = vy;
    }
}

struct Pool {
    int n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl, pb, pr, max, include_pad;
};
static_assert(sizeof(Pool) == 64, "struct Pool no longer matches PoolParams (abi.rs)");

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

// `pool_nhwc` with VEC channels per thread and 16-byte loads; the host checked that c is a
// multiple of VEC and that x and y are 16-byte aligned.
extern "C" __global__ void pool_nhwc_vec(const Pool p, const T *x, T *y) {
    const int cv = p.c / VEC;
    const long long total = (long long)p.n * p.oh * p.ow * cv;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int cg, ox, oy, b;
        if (total <= 0x7fffffffLL) {
            int r = (int)i;
            cg = r % cv;
            r /= cv;
            ox = r % p.ow;
            r /= p.ow;
            oy = r % p.oh;
            b = r / p.oh;
        } else {
            long long r = i;
            cg = r % cv;
            r /= cv;
            ox = r % p.ow;
            r /= p.ow;
            oy = r % p.oh;
            b = r / p.oh;
        }
        float acc[VEC], best[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            acc[k] = 0.f;
            best[k] = -3.402823466e38f;
        }
        int count = 0, padded = 0;
        for (int ky = 0; ky < p.kh; ++ky) {
            int yy = oy * p.sh + ky - p.pt;
            for (int kx = 0; kx < p.kw; ++kx) {
                int xx = ox * p.sw + kx - p.pl;
                if (yy < 0 || xx < 0 || yy >= p.h || xx >= p.w) {
                    padded += (yy < p.h + p.pb && xx < p.w + p.pr);
                    continue;
                }
                const Vec16 v = *reinterpret_cast<const Vec16 *>(
                    x + (((long long)b * p.h + yy) * p.w + xx) * p.c + cg * VEC);
                const T *e = reinterpret_cast<const T *>(&v);
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    float f = ld(e[k]);
                    acc[k] += f;
                    best[k] = fmaxf(best[k], f);
                }
                ++count;
            }
        }
        const float div = (float)(p.include_pad ? count + padded : count);
        Vec16 o;
        T *eo = reinterpret_cast<T *>(&o);
#pragma unroll
        for (int k = 0; k < VEC; ++k) eo[k] = st(p.max ? best[k] : acc[k] / div);
        reinterpret_cast<Vec16 *>(y)[i] = o;
    }
}

// One block of 32×32 threads per (image, 32 channels): threadIdx.x picks the channel, so a
// warp reads 32 consecutive channels of one pixel; the 32 rows of threads split the pixels
// and their sums meet in shared memory. (One thread per channel summing every pixel alone
// made the squeeze-excitation blocks of EfficientNet take milliseconds.)
extern "C" __global__ void global_avg_nhwc(const T *x, T *y, int n, int hw, int c) {
    __shared__ float partial[32][33];
    int chunks = (c + 31) / 32;
    int b = blockIdx.x / chunks, ch = (blockIdx.x % chunks) * 32 + threadIdx.x;
    float acc = 0.f;
    if (ch < c) {
        const T *src = x + (long long)b * hw * c + ch;
#pragma unroll 4
        for (int p = threadIdx.y; p < hw; p += 32) acc += ld(src[(long long)p * c]);
    }
    partial[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && ch < c) {
        float s = 0.f;
        for (int r = 0; r < 32; ++r) s += partial[r][threadIdx.x];
        y[(long long)b * c + ch] = st(s / hw);
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

// Loads and stores of either storage type, for the kernels that also run on the f32 scores
// of an fp16 plan (its softmax after the product that wrote them in f32).
__device__ __forceinline__ float load(float v) { return v; }
__device__ __forceinline__ void store(float *p, float v) { *p = v; }
#ifdef HALF
__device__ __forceinline__ float load(T v) { return ld(v); }
__device__ __forceinline__ void store(T *p, float v) { *p = st(v); }
#endif

// One block per row; in place is safe: each thread writes only the elements it read last.
template <typename S> __device__ void softmax_rows_body(const S *x, S *y, int len) {
    __shared__ float shared[32];
    const S *row = x + (long long)blockIdx.x * len;
    S *out = y + (long long)blockIdx.x * len;
    float m = -3.402823466e38f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) m = fmaxf(m, load(row[i]));
    m = block_max(m, shared);
    float s = 0.f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) s += __expf(load(row[i]) - m);
    s = block_sum(s, shared);
    for (int i = threadIdx.x; i < len; i += blockDim.x) store(out + i, __expf(load(row[i]) - m) / s);
}
extern "C" __global__ void softmax_rows(const T *x, T *y, int len) { softmax_rows_body(x, y, len); }
extern "C" __global__ void softmax_rows_f32(const float *x, float *y, int len) {
    softmax_rows_body(x, y, len);
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

// Rows of up to WARP_ROW_MAX elements take one warp each, held in registers: read once,
// written once, reduced with shuffles. Attention rows (197 in ViT-B/16, 49 in Swin's windows)
// and LayerNorm over channels are this short; a block of 256 threads per such row leaves
// most of them idle and pays two block-wide synchronisations per reduction.
#define WARP_ROW_MAX 1024

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// The row is read whole into registers before it is written: in place is safe.
template <typename S> __device__ void softmax_warp_body(const S *x, S *y, int rows, int len) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const S *in = x + (long long)row * len;
    S *out = y + (long long)row * len;
    float v[WARP_ROW_MAX / 32];
    float m = -3.402823466e38f;
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) {
        if (k * 32 >= len) break;  // the same for the whole warp
        int i = k * 32 + lane;
        v[k] = i < len ? load(in[i]) : -3.402823466e38f;
        m = fmaxf(m, v[k]);
    }
    m = warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) {
        if (k * 32 >= len) break;
        v[k] = k * 32 + lane < len ? __expf(v[k] - m) : 0.f;
        s += v[k];
    }
    float inv = 1.f / warp_sum(s);
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) {
        if (k * 32 >= len) break;
        int i = k * 32 + lane;
        if (i < len) store(out + i, v[k] * inv);
    }
}
extern "C" __global__ void softmax_warp(const T *x, T *y, int rows, int len) {
    softmax_warp_body(x, y, rows, len);
}
extern "C" __global__ void softmax_warp_f32(const float *x, float *y, int rows, int len) {
    softmax_warp_body(x, y, rows, len);
}

extern "C" __global__ void layernorm_warp(const T *x, T *y, const T *scale, const T *bias,
                                          int rows, int len, float eps) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const T *in = x + (long long)row * len;
    T *out = y + (long long)row * len;
    float v[WARP_ROW_MAX / 32];
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) {
        if (k * 32 >= len) break;
        int i = k * 32 + lane;
        v[k] = i < len ? ld(in[i]) : 0.f;
        s += v[k];
    }
    float mean = warp_sum(s) / len;
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) {
        if (k * 32 >= len) break;
        float d = k * 32 + lane < len ? v[k] - mean : 0.f;
        q += d * d;
    }
    float inv = rsqrtf(warp_sum(q) / len + eps);
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) {
        if (k * 32 >= len) break;
        int i = k * 32 + lane;
        if (i < len) {
            float o = (v[k] - mean) * inv * ld(scale[i]);
            if (bias) o += ld(bias[i]);
            out[i] = st(o);
        }
    }
}

// `layernorm_warp` with 16-byte loads and stores, VEC consecutive values of the row per lane
// and load (three loads a lane for ViT's 768 fp16 channels, where 2-byte loads took 24 and
// reached a third of the memory's bandwidth). The host checked that len is a multiple of VEC
// and that x, y, scale and bias are 16-byte aligned, so that every row is.
extern "C" __global__ void layernorm_warp_vec(const T *x, T *y, const T *scale, const T *bias,
                                              int rows, int len, float eps) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const Vec16 *in = reinterpret_cast<const Vec16 *>(x + (long long)row * len);
    Vec16 *out = reinterpret_cast<Vec16 *>(y + (long long)row * len);
    const Vec16 *sv = reinterpret_cast<const Vec16 *>(scale);
    const Vec16 *bv = reinterpret_cast<const Vec16 *>(bias);
    const int chunks = len / VEC;
    // Chunk k * 32 + lane of the row in v[k * VEC ...]; zeros past the row's end.
    float v[WARP_ROW_MAX / 32];
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32 / VEC; ++k) {
        if (k * 32 >= chunks) break;  // the same for the whole warp
        const int c = k * 32 + lane;
        Vec16 raw = {0, 0, 0, 0};
        if (c < chunks) raw = in[c];
        const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            v[k * VEC + j] = ld(e[j]);
            s += v[k * VEC + j];
        }
    }
    const float mean = warp_sum(s) / len;
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32 / VEC; ++k) {
        if (k * 32 >= chunks) break;
        if (k * 32 + lane >= chunks) continue;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float d = v[k * VEC + j] - mean;
            q += d * d;
        }
    }
    const float inv = rsqrtf(warp_sum(q) / len + eps);
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32 / VEC; ++k) {
        if (k * 32 >= chunks) break;
        const int c = k * 32 + lane;
        if (c >= chunks) continue;
        const Vec16 rs = sv[c];
        Vec16 rb = {0, 0, 0, 0};
        if (bias) rb = bv[c];
        const T *es = reinterpret_cast<const T *>(&rs);
        const T *eb = reinterpret_cast<const T *>(&rb);
        Vec16 o;
        T *eo = reinterpret_cast<T *>(&o);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            eo[j] = st((v[k * VEC + j] - mean) * inv * ld(es[j]) + ld(eb[j]));
        }
        out[c] = o;
    }
}

// Swin v2's cosine attention takes the norm of rows of 32 values (hundreds of thousands of
// them): a warp per row reads each in one coalesced load, where a block per row would leave
// 224 of its 256 threads idle.
extern "C" __global__ void mean_warp(const T *x, T *y, int rows, int len) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const T *in = x + (long long)row * len;
    float s = 0.f;
    for (int i = lane; i < len; i += 32) s += ld(in[i]);
    s = warp_sum(s);
    if (lane == 0) y[row] = st(s / len);
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

// Frame preprocessing: one raw video frame to the model's normalised f32 input: colour
// conversion, antialiased bilinear resampling (the triangle filter widened by the downscale
// factor, as PIL, torchvision and the CPU backend resize), crop or letterbox, normalisation,
// channel order and layout. The filter is separable, so it runs in two passes: the source
// rows to the destination's width (`preprocess_rows`), then those to its height
// (`preprocess_cols`); each source pixel is converted to RGB once.
struct Pre {
    int format;                 // 0: packed RGB-like, 1: NV12, 2: I420, 3: P010 (NV12, 16 bits)
    int pixel_stride;           // bytes per pixel (packed)
    int off[3];                 // byte offsets of R, G, B in a pixel (packed)
    long long plane[3];         // byte offsets of the planes in the frame's data
    int stride[3];              // row strides of the planes
    int size[2];                // frame width and height
    int cosited[2];             // chroma sited on luma horizontally, vertically (else between)
    int crop[4];                // source rectangle: x, y, w, h
    int dst[4];                 // where it lands in the model input: x, y, w, h
    int out_w, out_h, nchw, bgr;
    float m[12];                // YUV to RGB (0..255): rgb = m[4c..4c+3] · (y, u, v, 1)
    float scale;
    float mean[3], std[3];
    float border[3];            // the normalised letterbox colour
};
// The size that frames.rs's `Pre` asserts too, with its fields' offsets.
static_assert(sizeof(Pre) == 216, "struct Pre no longer matches Pre (frames.rs)");

// A 16-bit little-endian sample (P010: ten bits at the top) on the 8-bit scale: a 10-bit
// value v is 8-bit v / 4, as the standards (and GStreamer's converter, within half a level)
// read it. Read byte by byte: a frame in the staging buffer may start at an odd address.
__device__ __forceinline__ float sample16(const unsigned char *s) {
    return (float)(s[0] | (s[1] << 8)) * (1.f / 256.f);
}

__device__ __forceinline__ float sample(const unsigned char *s, bool wide) {
    return wide ? sample16(s) : (float)s[0];
}

// RGB in 0..255 from Y, U, V on the 8-bit scale, with the frame's matrix.
__device__ __forceinline__ void yuv_rgb(const Pre &p, float Y, float U, float V, float *rgb) {
    for (int c = 0; c < 3; c++) {
        float v = p.m[4 * c] * Y + p.m[4 * c + 1] * U + p.m[4 * c + 2] * V + p.m[4 * c + 3];
        rgb[c] = fminf(fmaxf(v, 0.f), 255.f);
    }
}

// Where a luma position falls among the chroma samples of 4:2:0 (sited on luma, or between).
__device__ __forceinline__ float chroma_pos(int v, int cosited) {
    return cosited ? v * 0.5f : (v - 0.5f) * 0.5f;
}

// The U and V samples of chroma column `cx` in chroma row `cy` (both clamped by the caller).
__device__ __forceinline__ void chroma_at(const Pre &p, const unsigned char *src, int cx, int cy,
                                          float *u, float *v) {
    if (p.format == 2) {
        *u = src[p.plane[1] + (long long)cy * p.stride[1] + cx];
        *v = src[p.plane[2] + (long long)cy * p.stride[2] + cx];
    } else {
        bool wide = p.format == 3;
        const unsigned char *uv = src + p.plane[1] + (long long)cy * p.stride[1] + cx * (wide ? 4 : 2);
        *u = sample(uv, wide);
        *v = sample(uv + (wide ? 2 : 1), wide);
    }
}

// The RGB of one pixel, read on its own (packed formats, and taps beyond what a block of
// `preprocess_rows` keeps).
__device__ __forceinline__ void rgb_at(const Pre &p, const unsigned char *src, int x, int y,
                                       float *rgb) {
    if (p.format == 0) {
        const unsigned char *px = src + p.plane[0] + (long long)y * p.stride[0] + x * p.pixel_stride;
        rgb[0] = px[p.off[0]];
        rgb[1] = px[p.off[1]];
        rgb[2] = px[p.off[2]];
        return;
    }
    bool wide = p.format == 3;
    float Y = sample(src + p.plane[0] + (long long)y * p.stride[0] + x * (wide ? 2 : 1), wide);
    // 4:2:0 chroma interpolated linearly at the luma position, as GStreamer's converter does.
    float cx = chroma_pos(x, p.cosited[0]), cy = chroma_pos(y, p.cosited[1]);
    int cw = (p.size[0] + 1) / 2, chh = (p.size[1] + 1) / 2;
    int x0 = (int)floorf(cx), y0 = (int)floorf(cy);
    float fx = cx - x0, fy = cy - y0;
    float U = 0.f, V = 0.f;
    for (int j = 0; j < 2; j++) {
        for (int i = 0; i < 2; i++) {
            float w = (j ? fy : 1.f - fy) * (i ? fx : 1.f - fx), u, v;
            chroma_at(p, src, min(max(x0 + i, 0), cw - 1), min(max(y0 + j, 0), chh - 1), &u, &v);
            U += w * u;
            V += w * v;
        }
    }
    yuv_rgb(p, Y, U, V, rgb);
}

// Taps of the filter for output position `i` (0-based in the destination rectangle): the
// first source index, how many, and the filter's half-width in source pixels.
__device__ __forceinline__ void taps(int i, int in_size, int out_size, float *center,
                                     float *support, int *first, int *count) {
    float scale = (float)in_size / out_size;
    float fs = fmaxf(scale, 1.f);
    *center = (i + 0.5f) * scale;
    *support = fs;
    int lo = max((int)floorf(*center - fs + 0.5f), 0);
    int hi = min((int)floorf(*center + fs + 0.5f), in_size);
    *first = lo;
    *count = hi - lo;
}

// The pixels of a source row that one block of `preprocess_rows` converts once and keeps:
// 24 KiB, a whole 1920-pixel row; wider rows are split over blocks by columns (see
// `Runtime::launch_preprocess`), and a tap outside what was kept is read directly.
#define PRE_SPAN 2048

// Converts pixels x0 .. x0 + n - 1 of source row y to RGB into `px`, all threads of the block
// together. For YUV the row's chroma is first interpolated vertically into `uv` (U, V pairs,
// one per chroma column), so that each pixel then reads one luma sample from the frame.
__device__ void convert_span(const Pre &p, const unsigned char *__restrict__ src, int x0, int n,
                             int y, float *px, float *uv) {
    if (p.format == 0) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) rgb_at(p, src, x0 + i, y, &px[3 * i]);
        return;
    }
    int cw = (p.size[0] + 1) / 2, chh = (p.size[1] + 1) / 2;
    float cy = chroma_pos(y, p.cosited[1]);
    int cy0 = (int)floorf(cy);
    float fy = cy - cy0;
    int rows[2] = {min(max(cy0, 0), chh - 1), min(max(cy0 + 1, 0), chh - 1)};
    // Chroma columns from the left neighbour of the first pixel to the right one of the last.
    int c0 = (int)floorf(chroma_pos(x0, p.cosited[0]));
    int nc = (int)floorf(chroma_pos(x0 + n - 1, p.cosited[0])) + 2 - c0;
    for (int k = threadIdx.x; k < nc; k += blockDim.x) {
        int cx = min(max(c0 + k, 0), cw - 1);
        float u0, v0, u1, v1;
        chroma_at(p, src, cx, rows[0], &u0, &v0);
        chroma_at(p, src, cx, rows[1], &u1, &v1);
        uv[2 * k] = (1.f - fy) * u0 + fy * u1;
        uv[2 * k + 1] = (1.f - fy) * v0 + fy * v1;
    }
    __syncthreads();
    bool wide = p.format == 3;
    const unsigned char *luma = src + p.plane[0] + (long long)y * p.stride[0];
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        int x = x0 + i;
        float cx = chroma_pos(x, p.cosited[0]);
        int k = (int)floorf(cx);
        float fx = cx - k;
        k -= c0;
        float U = (1.f - fx) * uv[2 * k] + fx * uv[2 * k + 2];
        float V = (1.f - fx) * uv[2 * k + 1] + fx * uv[2 * k + 3];
        yuv_rgb(p, sample(luma + x * (wide ? 2 : 1), wide), U, V, &px[3 * i]);
    }
}

// Pass 1: each source row of the crop filtered horizontally into the destination rectangle's
// columns, as RGB in 0..255, into `rows` ([crop h][dst w][3]). A block takes `cols` columns
// of one row at a time: its threads convert the pixels those columns read into shared memory,
// then each thread filters one column.
extern "C" __global__ void preprocess_rows(const Pre p, const unsigned char *__restrict__ src,
                                           float *__restrict__ rows, int cols) {
    __shared__ float px[PRE_SPAN * 3];
    __shared__ float uv[PRE_SPAN + 8];
    int c0 = blockIdx.x * cols, c1 = min(c0 + cols, p.dst[2]);
    if (c0 >= c1) return;
    float cx, sx;
    int lo, n, last, last_n;
    taps(c0, p.crop[2], p.dst[2], &cx, &sx, &lo, &n);
    taps(c1 - 1, p.crop[2], p.dst[2], &cx, &sx, &last, &last_n);
    int span = min(last + last_n - lo, PRE_SPAN);
    for (int row = blockIdx.y; row < p.crop[3]; row += gridDim.y) {
        int y = p.crop[1] + row;
        __syncthreads();  // the last row's pixels are no longer read
        convert_span(p, src, p.crop[0] + lo, span, y, px, uv);
        __syncthreads();
        for (int dx = c0 + threadIdx.x; dx < c1; dx += blockDim.x) {
            int x0, nx;
            taps(dx, p.crop[2], p.dst[2], &cx, &sx, &x0, &nx);
            float acc[3] = {0.f, 0.f, 0.f}, wsum = 0.f, inv = 1.f / sx;
            for (int x = x0; x < x0 + nx; x++) {
                float w = fmaxf(1.f - fabsf((x + 0.5f - cx) * inv), 0.f);
                if (w == 0.f) continue;
                float direct[3];
                const float *rgb = &px[3 * (x - lo)];
                if (x - lo >= span) {
                    rgb_at(p, src, p.crop[0] + x, y, direct);
                    rgb = direct;
                }
                for (int c = 0; c < 3; c++) acc[c] += w * rgb[c];
                wsum += w;
            }
            float *o = rows + ((long long)row * p.dst[2] + dx) * 3;
            for (int c = 0; c < 3; c++) o[c] = acc[c] / wsum;
        }
    }
}

// Pass 2: the filtered rows filtered vertically into each output pixel, normalised, in the
// model's channel order and layout; the letterbox colour around the destination rectangle.
// One thread per output pixel.
extern "C" __global__ void preprocess_cols(const Pre p, const float *rows, float *out) {
    int n = p.out_w * p.out_h;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int dx = i % p.out_w - p.dst[0], dy = i / p.out_w - p.dst[1];
        bool inside = dx >= 0 && dy >= 0 && dx < p.dst[2] && dy < p.dst[3];
        float acc[3] = {0.f, 0.f, 0.f};
        if (inside) {
            float cy, sy;
            int y0, ny;
            taps(dy, p.crop[3], p.dst[3], &cy, &sy, &y0, &ny);
            float wsum = 0.f;
            for (int y = y0; y < y0 + ny; y++) {
                float w = fmaxf(1.f - fabsf((y + 0.5f - cy) / sy), 0.f);
                if (w == 0.f) continue;
                const float *r = rows + ((long long)y * p.dst[2] + dx) * 3;
                for (int c = 0; c < 3; c++) acc[c] += w * r[c];
                wsum += w;
            }
            for (int c = 0; c < 3; c++) acc[c] /= wsum;
        }
        for (int c = 0; c < 3; c++) {
            float v = inside ? (acc[p.bgr ? 2 - c : c] * p.scale - p.mean[c]) / p.std[c] : p.border[c];
            long long o = p.nchw ? (long long)c * n + i : (long long)i * 3 + c;
            out[o] = v;
        }
    }
}

#ifdef HALF
// Fused attention (`Step::Attention`): for each batch index, y = softmax(alpha·q·kᵀ + bias)·v
// over rows of keys. The scores stay in registers, in f32, with a running maximum and sum
// per row (the online softmax of FlashAttention), so they are never written to memory; the
// operands are read through their strides, so the heads need not be copied out of the
// projections first. On tensor cores (mma.sync, sm_80 and newer): a block takes 64 queries,
// a warp 16 of them, against tiles of 64 keys held in shared memory. `attention_rows` is the
// same computation without tensor cores, a warp per query, for older GPUs.
struct Attn {
    int batch[3];
    int queries, keys, dk, dv;
    // Whether every row of q, k and v starts 16-byte aligned (loads of 8 values).
    int vec;
    float alpha;
    int pad;
    // Strides (in elements) of the three batch axes, then of the rows.
    long long q[4], k[4], v[4], bias[4], y[4];
};
static_assert(sizeof(Attn) == 200, "struct Attn no longer matches AttnParams (abi.rs)");

#define ATTN_ROWS 64
#define ATTN_KEYS 64
#define LOG2E 1.4426950408889634f
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    return (unsigned)st(lo) | ((unsigned)st(hi) << 16);
}

// Matrix number `m` of the grid as its three batch indices, and the offset of its operand
// with batch strides `s`.
__device__ __forceinline__ long long batch_offset(const Attn &p, const long long *s, int m) {
    int i2 = m % p.batch[2], rest = m / p.batch[2];
    int i1 = rest % p.batch[1], i0 = rest / p.batch[1];
    return i0 * s[0] + i1 * s[1] + i2 * s[2];
}

// D += A·B for a 16×16 A (row-major fragments), a 16×8 B (column-major), f32 accumulators.
__device__ __forceinline__ void mma_16816(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// 64 rows of WIDTH values (row stride `stride`) into shared memory rows of WIDTH + 8 (the
// padding spreads the fragments' reads over the banks); zeros past `valid` rows.
template <int WIDTH>
__device__ __forceinline__ void attn_rows_in(T *dst, const T *src, long long stride, int valid, bool vec) {
    const int pitch = WIDTH + 8;
    if (vec) {
        for (int i = threadIdx.x; i < 64 * WIDTH / 8; i += blockDim.x) {
            int r = i / (WIDTH / 8), c = i % (WIDTH / 8) * 8;
            uint4 x = make_uint4(0, 0, 0, 0);
            if (r < valid) x = *(const uint4 *)(src + r * stride + c);
            *(uint4 *)(dst + r * pitch + c) = x;
        }
        return;
    }
    for (int i = threadIdx.x; i < 64 * WIDTH; i += blockDim.x) {
        int r = i / WIDTH, c = i % WIDTH;
        dst[r * pitch + c] = r < valid ? src[r * stride + c] : (T)0;
    }
}

// 16 bytes from global to shared memory without passing through registers (cp.async, sm_80
// on), zeros where `valid` is false (then nothing is read: `src` need only be an address).
__device__ __forceinline__ void cp_async16(T *dst, const T *src, bool valid) {
#if __CUDA_ARCH__ >= 800
    unsigned addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :
                 : "r"(addr), "l"(src), "r"(valid ? 16 : 0));
#endif
}

// Waits until at most N of this thread's committed groups of copies are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" : : "n"(N));
#endif
}

// One tile of keys and of values (rows t0 .. t0 + 64, zeros past the last key) into shared
// memory: as one group of asynchronous copies where rows are 16-byte aligned, so that the
// next tile arrives while this one is used; else by plain loads.
template <int DK, int DV>
__device__ __forceinline__ void attn_tile_in(T *kd, T *vd, const T *k, const T *v, const Attn &p,
                                             int t0, bool vec) {
    const int valid = min(ATTN_KEYS, p.keys - t0);
    k += t0 * p.k[3];
    v += t0 * p.v[3];
    if (!vec) {
        attn_rows_in<DK>(kd, k, p.k[3], valid, false);
        attn_rows_in<DV>(vd, v, p.v[3], valid, false);
        return;
    }
    for (int i = threadIdx.x; i < ATTN_KEYS * DK / 8; i += blockDim.x) {
        int r = i / (DK / 8), c = i % (DK / 8) * 8;
        cp_async16(kd + r * (DK + 8) + c, r < valid ? k + r * p.k[3] + c : k, r < valid);
    }
    for (int i = threadIdx.x; i < ATTN_KEYS * DV / 8; i += blockDim.x) {
        int r = i / (DV / 8), c = i % (DV / 8) * 8;
        cp_async16(vd + r * (DV + 8) + c, r < valid ? v + r * p.v[3] + c : v, r < valid);
    }
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}

// The B fragment of m16n8k16 for 16 rows (k) × 8 columns (n) of a row-major matrix in
// shared memory, `row0` pointing at its first element: ldmatrix's transposing load, each
// lane naming one of the 16 rows.
__device__ __forceinline__ void ldmatrix_b_trans(unsigned &b0, unsigned &b1, const T *row0, int pitch) {
#if __CUDA_ARCH__ >= 800
    const T *row = row0 + (threadIdx.x % 16) * pitch;
    unsigned addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(b0), "=r"(b1)
                 : "r"(addr));
#endif
}

template <int DK, int DV>
__device__ void attention_body(const Attn &p, const T *q, const T *k, const T *v, const T *bias, T *y) {
#if __CUDA_ARCH__ >= 800
    // Tiles of keys and values, two of each where they fit in static shared memory (48 KB):
    // one in use while the next arrives. The queries pass through the last key tile first.
    constexpr int STAGES = DK + DV <= 128 ? 2 : 1;
    __shared__ __align__(16) T ks[STAGES][ATTN_KEYS * (DK + 8)];
    __shared__ __align__(16) T vs[STAGES][ATTN_KEYS * (DV + 8)];
    static_assert(ATTN_ROWS == ATTN_KEYS, "the queries pass through a key tile");
    const int m = blockIdx.x, q0 = blockIdx.y * ATTN_ROWS;
    q += batch_offset(p, p.q, m);
    k += batch_offset(p, p.k, m);
    v += batch_offset(p, p.v, m);
    y += batch_offset(p, p.y, m);
    if (bias) bias += batch_offset(p, p.bias, m);
    const bool vec = p.vec;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;

    const int tiles = (p.keys + ATTN_KEYS - 1) / ATTN_KEYS;
    if (STAGES == 2) attn_tile_in<DK, DV>(ks[0], vs[0], k, v, p, 0, vec);
    attn_rows_in<DK>(ks[STAGES - 1], q + q0 * p.q[3], p.q[3], p.queries - q0, vec);
    __syncthreads();
    // This warp's 16 queries as the A fragments of m16n8k16, kept for every tile.
    unsigned qa[DK / 16][4];
    const T *qw = ks[STAGES - 1] + warp * 16 * (DK + 8);
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
        const T *r0 = qw + g * (DK + 8) + kk * 16 + tg * 2, *r1 = r0 + 8 * (DK + 8);
        qa[kk][0] = *(const unsigned *)r0;
        qa[kk][1] = *(const unsigned *)r1;
        qa[kk][2] = *(const unsigned *)(r0 + 8);
        qa[kk][3] = *(const unsigned *)(r1 + 8);
    }
    // Rows g and g + 8 of the warp's 16: running maximum (log2 units) and sum, and output.
    float o[DV / 8][4];
#pragma unroll
    for (int dn = 0; dn < DV / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
    float mx[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const int row0 = q0 + warp * 16 + g;
    const float scale = p.alpha * LOG2E;

    for (int t = 0; t < tiles; ++t) {
        const int t0 = t * ATTN_KEYS, stage = STAGES == 2 ? t & 1 : 0;
        // Every warp is done with the stage about to be filled (tile t - 1, or the queries).
        __syncthreads();
        if (STAGES == 1) {
            attn_tile_in<DK, DV>(ks[0], vs[0], k, v, p, t0, vec);
            cp_async_wait<0>();
        } else if (t + 1 < tiles) {
            attn_tile_in<DK, DV>(ks[stage ^ 1], vs[stage ^ 1], k, v, p, t0 + ATTN_KEYS, vec);
            cp_async_wait<1>();  // tile t is in, tile t + 1 may still be on its way
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const T *kt = ks[stage], *vt = vs[stage];

        float s[ATTN_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < ATTN_KEYS / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < DK / 16; ++kk) {
                const T *kr = kt + (nt * 8 + g) * (DK + 8) + kk * 16 + tg * 2;
                mma_16816(s[nt], qa[kk], *(const unsigned *)kr, *(const unsigned *)(kr + 8));
            }
        }
        float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < ATTN_KEYS / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int col = t0 + nt * 8 + tg * 2 + (e & 1), row = row0 + (e >> 1) * 8;
                float x = s[nt][e] * scale;
                if (col >= p.keys) x = NEG_INF;
                else if (bias && row < p.queries) x += ld(bias[row * p.bias[3] + col]) * LOG2E;
                s[nt][e] = x;
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
            }
        }
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float t = tile_max[r];
            t = fmaxf(t, __shfl_xor_sync(0xffffffff, t, 1));
            t = fmaxf(t, __shfl_xor_sync(0xffffffff, t, 2));
            float next = fmaxf(mx[r], t);
            // A row with no finite score yet keeps weights of 0 rather than NaN.
            base[r] = next == NEG_INF ? 0.f : next;
            float correction = fast_exp2(mx[r] - base[r]);
            mx[r] = next;
            l[r] *= correction;
#pragma unroll
            for (int dn = 0; dn < DV / 8; ++dn) {
                o[dn][2 * r] *= correction;
                o[dn][2 * r + 1] *= correction;
            }
        }
#pragma unroll
        for (int nt = 0; nt < ATTN_KEYS / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = fast_exp2(s[nt][e] - base[e >> 1]);
                l[e >> 1] += s[nt][e];
            }
        }
        // The weights, in fp16, are the A fragments of the product with the values: the
        // accumulators of two neighbouring 8-key tiles make one 16-key fragment.
#pragma unroll
        for (int kk = 0; kk < ATTN_KEYS / 16; ++kk) {
            unsigned pa[4] = {
                pack_half2(s[2 * kk][0], s[2 * kk][1]),
                pack_half2(s[2 * kk][2], s[2 * kk][3]),
                pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3]),
            };
#pragma unroll
            for (int dn = 0; dn < DV / 8; ++dn) {
                unsigned b0, b1;
                ldmatrix_b_trans(b0, b1, vt + kk * 16 * (DV + 8) + dn * 8, DV + 8);
                mma_16816(o[dn], pa, b0, b1);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        int row = row0 + r * 8;
        if (row >= p.queries) continue;
        float inv = 1.f / sum;
        T *out = y + row * p.y[3];
#pragma unroll
        for (int dn = 0; dn < DV / 8; ++dn) {
            out[dn * 8 + tg * 2] = st(o[dn][2 * r] * inv);
            out[dn * 8 + tg * 2 + 1] = st(o[dn][2 * r + 1] * inv);
        }
    }
#endif
}

#define ATTENTION(DK, DV)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) attention_##DK##_##DV(                   \
        const Attn p, const T *q, const T *k, const T *v, const T *bias, T *y) {               \
        attention_body<DK, DV>(p, q, k, v, bias, y);                                            \
    }
// `ATTENTION_HEAD_DIMS` in the compiler's plan/attention.rs: every pair with dk ≤ dv.
ATTENTION(16, 16)
ATTENTION(16, 32)
ATTENTION(16, 64)
ATTENTION(16, 128)
ATTENTION(32, 32)
ATTENTION(32, 64)
ATTENTION(32, 128)
ATTENTION(64, 64)
ATTENTION(64, 128)
ATTENTION(128, 128)

// Without tensor cores: a warp per query (8 a block), a key per lane at a time; the lanes
// then hold the value dimensions d, d + 32, ... (up to 128).
extern "C" __global__ void attention_rows(const Attn p, const T *q, const T *k, const T *v,
                                          const T *bias, T *y) {
    const int m = blockIdx.x, row = blockIdx.y * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= p.queries) return;
    q += batch_offset(p, p.q, m) + row * p.q[3];
    k += batch_offset(p, p.k, m);
    v += batch_offset(p, p.v, m);
    y += batch_offset(p, p.y, m) + row * p.y[3];
    if (bias) bias += batch_offset(p, p.bias, m) + row * p.bias[3];
    float mx = NEG_INF, l = 0.f, o[4] = {0.f, 0.f, 0.f, 0.f};
    for (int t0 = 0; t0 < p.keys; t0 += 32) {
        int t = t0 + lane;
        float x = NEG_INF;
        if (t < p.keys) {
            float dot = 0.f;
            for (int d = 0; d < p.dk; ++d) dot += ld(q[d]) * ld(k[t * p.k[3] + d]);
            x = (dot * p.alpha + (bias ? ld(bias[t]) : 0.f)) * LOG2E;
        }
        float next = fmaxf(mx, warp_max(x));
        float base = next == NEG_INF ? 0.f : next;
        float correction = fast_exp2(mx - base);
        mx = next;
        float w = fast_exp2(x - base);
        l = l * correction + w;
        for (int i = 0; i < 4; ++i) o[i] *= correction;
        for (int j = 0; j < 32 && t0 + j < p.keys; ++j) {
            float wj = __shfl_sync(0xffffffff, w, j);
            const T *vr = v + (t0 + j) * p.v[3];
            for (int i = 0; i < 4; ++i) {
                int d = lane + 32 * i;
                if (d < p.dv) o[i] += wj * ld(vr[d]);
            }
        }
    }
    float inv = 1.f / warp_sum(l);
    for (int i = 0; i < 4; ++i) {
        int d = lane + 32 * i;
        if (d < p.dv) y[d] = st(o[i] * inv);
    }
}
#endif
