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


// Squeeze-and-excitation's gate (`Step::Gate`), one block of GATE_THREADS an image: from
// the image's pooled channels x, y = act2(act1(x · w1 + b1) · w2 + b2), the hidden values in
// f32. Launched by pool.rs's `gate`. One block reads the gate's weights (0.1-0.2 MB in
// EfficientNet-B0's last gates), so it reads them 8 values a load (16 bytes in fp16) and
// issues a thread's loads of a product before it needs them: read a value at a time, the
// block would wait on memory once a value. Sums are taken in a fixed order: the same scores
// on every run.
struct Gate {
    int n, c, r;   // images, channels (by the 8), hidden values
    int period;    // runs of 8 weights of w1 after which a run's hidden values repeat
    int act1;      // the hidden values' activation, and its parameters
    float p0, p1;
    int act2;      // the gate's
    float q0, q1;
};
static_assert(sizeof(Gate) == 40, "abi.rs's GateParams");

// 8 values from `p` (16-byte aligned) in f32: one 16-byte load in fp16, two in f32.
__device__ __forceinline__ void load8(const T *p, float *v) {
    Vec16 raw[sizeof(T) / 2];
#pragma unroll
    for (int k = 0; k < (int)sizeof(T) / 2; ++k) raw[k] = reinterpret_cast<const Vec16 *>(p)[k];
    const T *e = reinterpret_cast<const T *>(raw);
#pragma unroll
    for (int l = 0; l < 8; ++l) v[l] = ld(e[l]);
}

extern "C" __global__ void __launch_bounds__(GATE_THREADS)
    se_gate(const Gate g, const T *x, const T *w1, const T *b1, const T *w2, const T *b2, T *y) {
    float *const pooled = reinterpret_cast<float *>(dynamic_shared());  // c
    float *const hidden = pooled + g.c;                                  // r
    float *const part = hidden + g.r;                                    // 8 a thread
    const int t = threadIdx.x;
    const long long image = (long long)blockIdx.x * g.c;
    for (int i = t; i < g.c; i += GATE_THREADS) pooled[i] = ld(x[image + i]);
    __syncthreads();

    // The first product, w1 ([c, r]) in runs of 8 in memory order: thread t takes runs t,
    // t + active, t + 2·active, ...; `active` being a multiple of `period`, lane l of each of
    // its runs meets the same hidden value, (8t + l) mod r, at rows `step` apart.
    const int active = GATE_THREADS / g.period * g.period;
    const int step = 8 * active / g.r;
    const int runs = g.c / 8 * g.r;
    float acc[8];
#pragma unroll
    for (int l = 0; l < 8; ++l) acc[l] = 0.f;
    if (t < active) {
        int row[8];
#pragma unroll
        for (int l = 0; l < 8; ++l) row[l] = (8 * t + l) / g.r;
#pragma unroll 4
        for (int q = t, k = 0; q < runs; q += active, k += step) {
            float w[8];
            load8(w1 + 8LL * q, w);
#pragma unroll
            for (int l = 0; l < 8; ++l) acc[l] += pooled[row[l] + k] * w[l];
        }
    }
#pragma unroll
    for (int l = 0; l < 8; ++l) part[8 * t + l] = acc[l];
    __syncthreads();
    // Hidden value j is the sum of the parts j, j + r, ... below 8·active: a warp's.
    const int warp = t / 32, lane = t % 32;
    for (int j = warp; j < g.r; j += GATE_THREADS / 32) {
        float s = 0.f;
        for (int p = j + lane * g.r; p < 8 * active; p += 32 * g.r) s += part[p];
#pragma unroll
        for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) hidden[j] = act(g.act1, s + (b1 ? ld(b1[j]) : 0.f), g.p0, g.p1);
    }
    __syncthreads();

    // The second, w2 ([r, c]): a thread takes 8 outputs (a run of each row) and a slice of
    // the hidden values, `width` runs of outputs at a time; the slices' sums are added in order.
    const int vectors = g.c / 8;
    const int width = min(vectors, GATE_THREADS);
    const int slices = min(GATE_THREADS / width, g.r);
    const int per = (g.r + slices - 1) / slices;
    const int v = t % width, s = t / width;
    for (int v0 = 0; v0 < vectors; v0 += width) {
        float out[8];
#pragma unroll
        for (int l = 0; l < 8; ++l) out[l] = 0.f;
        if (s < slices && v0 + v < vectors) {
            const int end = min((s + 1) * per, g.r);
#pragma unroll 4
            for (int j = s * per; j < end; ++j) {
                float w[8];
                load8(w2 + (long long)j * g.c + 8 * (v0 + v), w);
#pragma unroll
                for (int l = 0; l < 8; ++l) out[l] += hidden[j] * w[l];
            }
        }
#pragma unroll
        for (int l = 0; l < 8; ++l) part[8 * t + l] = out[l];
        __syncthreads();
        if (t < width && v0 + t < vectors) {
#pragma unroll
            for (int l = 0; l < 8; ++l) {
                const int i = 8 * (v0 + t) + l;
                float sum = 0.f;
                for (int k = 0; k < slices; ++k) sum += part[8 * (k * width + t) + l];
                T *at = y + image + i;
                WROTE(at);
                *at = st(act(g.act2, sum + (b2 ? ld(b2[i]) : 0.f), g.q0, g.q1));
            }
        }
        __syncthreads();
    }
}
