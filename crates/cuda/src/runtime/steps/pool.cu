// SPDX-License-Identifier: MPL-2.0
// Pooling over NHWC tensors (`Step::Pool`, `Step::GlobalAvgPool`); launched by pool.rs's
// `pool` and `global_avg_pool`.

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
// multiple of VEC and that x and y are 16-byte aligned. KH, KW: the window where it is known
// when compiling (0: p.kh, p.kw), so that its loads unroll and are issued together, waiting
// for memory once instead of once a pixel of the window (ResNet's 3×3 max pool after its
// stem ran at half the memory's speed).
template <int KH, int KW> __device__ __forceinline__ void pool_vec_body(const Pool &p, const T *x, T *y) {
    const int cv = p.c / VEC;
    const int kh = KH ? KH : p.kh, kw = KW ? KW : p.kw;
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
        const T *image = x + (long long)b * p.h * p.w * p.c + cg * VEC;
#pragma unroll
        for (int ky = 0; ky < kh; ++ky) {
            int yy = oy * p.sh + ky - p.pt;
#pragma unroll
            for (int kx = 0; kx < kw; ++kx) {
                int xx = ox * p.sw + kx - p.pl;
                if (yy < 0 || xx < 0 || yy >= p.h || xx >= p.w) {
                    padded += (yy < p.h + p.pb && xx < p.w + p.pr);
                    continue;
                }
                const Vec16 v = *reinterpret_cast<const Vec16 *>(image + ((long long)yy * p.w + xx) * p.c);
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

extern "C" __global__ void pool_nhwc_vec(const Pool p, const T *x, T *y) {
    if (p.kh == 3 && p.kw == 3)
        pool_vec_body<3, 3>(p, x, y);
    else if (p.kh == 2 && p.kw == 2)
        pool_vec_body<2, 2>(p, x, y);
    else
        pool_vec_body<0, 0>(p, x, y);
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

