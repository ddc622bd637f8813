// SPDX-License-Identifier: MPL-2.0
// Steps over rows (`Step::Softmax`, `Step::LayerNorm`, `Step::RowMean`, `Step::Lrn`), a block
// or a warp per row, and the block and warp reductions that attention.cu uses too; launched
// by rows.rs's `softmax`, `layer_norm`, `row_mean` and `lrn`.

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

// A row's element i plus the bias's (null: none), in f32.
template <typename S>
__device__ __forceinline__ float biased(const S *row, const T *bias, int i) {
    return bias ? load(row[i]) + ld(bias[i]) : load(row[i]);
}

// Rows longer than WARP_ROW_MAX: one block per row, reading the row once a pass; in place
// is safe: each thread writes only the elements it read last.
template <typename S> __device__ void softmax_rows_body(const S *x, const T *bias, S *y, int len) {
    SHARED_FLOATS(shared, 32);
    const S *row = x + (long long)blockIdx.x * len;
    S *out = y + (long long)blockIdx.x * len;
    float m = -3.402823466e38f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) m = fmaxf(m, biased(row, bias, i));
    m = block_max(m, shared);
    float s = 0.f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) s += __expf(biased(row, bias, i) - m);
    s = block_sum(s, shared);
    for (int i = threadIdx.x; i < len; i += blockDim.x)
        store(out + i, __expf(biased(row, bias, i) - m) / s);
}
extern "C" __global__ void softmax_rows(const T *x, const T *bias, T *y, int len) {
    softmax_rows_body(x, bias, y, len);
}
extern "C" __global__ void softmax_rows_f32(const float *x, const T *bias, float *y, int len) {
    softmax_rows_body(x, bias, y, len);
}

// Rows of SOFTMAX_WARP_MAX to WARP_ROW_MAX (a classifier's scores): one block of ROW_BLOCK
// threads per row, which holds it in registers: read once, written once. The row is read
// whole before the first barrier: in place is safe.
template <typename S>
__device__ void softmax_block_body(const S *x, const T *bias, S *y, int len) {
    SHARED_FLOATS(shared, 32);
    const S *in = x + (long long)blockIdx.x * len;
    S *out = y + (long long)blockIdx.x * len;
    float v[WARP_ROW_MAX / ROW_BLOCK];
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / ROW_BLOCK; ++k) {
        const int i = k * ROW_BLOCK + threadIdx.x;
        v[k] = i < len ? biased(in, bias, i) : -3.402823466e38f;
    }
    float m = v[0];
#pragma unroll
    for (int k = 1; k < WARP_ROW_MAX / ROW_BLOCK; ++k) m = fmaxf(m, v[k]);
    m = block_max(m, shared);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / ROW_BLOCK; ++k) {
        v[k] = k * ROW_BLOCK + threadIdx.x < len ? __expf(v[k] - m) : 0.f;
        s += v[k];
    }
    const float inv = 1.f / block_sum(s, shared);
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / ROW_BLOCK; ++k) {
        const int i = k * ROW_BLOCK + threadIdx.x;
        if (i < len) store(out + i, v[k] * inv);
    }
}
extern "C" __global__ void softmax_block(const T *x, const T *bias, T *y, int len) {
    softmax_block_body(x, bias, y, len);
}
extern "C" __global__ void softmax_block_f32(const float *x, const T *bias, float *y, int len) {
    softmax_block_body(x, bias, y, len);
}

extern "C" __global__ void layernorm_rows(const T *x, T *y, const T *scale, const T *bias,
                                          int len, float eps) {
    SHARED_FLOATS(shared, 32);
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

// Rows of up to WARP_ROW_MAX elements (SOFTMAX_WARP_MAX for the softmax) take one warp
// each, held in registers: read once, written once, reduced with shuffles. Attention rows
// (197 in ViT-B/16, 49 in Swin's windows) and LayerNorm over channels are this short; a
// block of 256 threads per such row leaves most of them idle and pays two block-wide
// synchronisations per reduction. WARP_ROW_MAX, SOFTMAX_WARP_MAX, ROW_BLOCK: abi.rs's,
// generated.

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// Rows of up to SOFTMAX_WARP_MAX (attention's, ViT-B/16's 197 and Swin's 49): a warp a
// row, held in registers. Every load is issued before the first value is used, so that a
// lane waits for the row once, not once a load. The row is read whole before it is
// written: in place is safe.
template <typename S>
__device__ void softmax_warp_body(const S *x, const T *bias, S *y, int rows, int len) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const S *in = x + (long long)row * len;
    S *out = y + (long long)row * len;
    float v[SOFTMAX_WARP_MAX / 32];
#pragma unroll
    for (int k = 0; k < SOFTMAX_WARP_MAX / 32; ++k) {
        const int i = k * 32 + lane;
        v[k] = i < len ? biased(in, bias, i) : -3.402823466e38f;
    }
    float m = v[0];
#pragma unroll
    for (int k = 1; k < SOFTMAX_WARP_MAX / 32; ++k) m = fmaxf(m, v[k]);
    m = warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < SOFTMAX_WARP_MAX / 32; ++k) {
        v[k] = k * 32 + lane < len ? __expf(v[k] - m) : 0.f;
        s += v[k];
    }
    const float inv = 1.f / warp_sum(s);
#pragma unroll
    for (int k = 0; k < SOFTMAX_WARP_MAX / 32; ++k) {
        const int i = k * 32 + lane;
        if (i < len) store(out + i, v[k] * inv);
    }
}
extern "C" __global__ void softmax_warp(const T *x, const T *bias, T *y, int rows, int len) {
    softmax_warp_body(x, bias, y, rows, len);
}
extern "C" __global__ void softmax_warp_f32(const float *x, const T *bias, float *y, int rows,
                                            int len) {
    softmax_warp_body(x, bias, y, rows, len);
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
    SHARED_FLOATS(shared, 32);
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


// A CNN classifier's head (`Step::Head`): y = softmax(mean(act(x)) · w + bias) for each of n ≤
// HEAD_MAX_BATCH images, x `[n, hw, c]`, w `[c, classes]`, the scores f32. Launched by
// rows.rs's `head` on a grid of (class tiles of HEAD_TILE, channel slices of `chunk`): a
// block pools its slice of the channels, multiplies it by that slice of the weights for its
// tile of classes (a lane 8 classes, a warp every 8th channel), and leaves the sums in
// `partial` ([slices, n, classes]); the last block to finish (counted in `done`, which it
// sets back to 0 for the next launch) adds the slices in order, the bias, and takes the
// softmax. At batch 1 this is the launch of the pool, the product and the softmax in one:
// the weights, most of what the head reads, are read once, by a hundred blocks at a time.
struct Head {
    int n, hw, c, classes;  // images, pixels an image, channels (by the 8), classes
    int chunk;              // channels a block takes: by the 8, at most HEAD_CHUNK
    int softmax;            // whether the scores are a softmax of the logits
    int act;                // the activation of each input value as it is read
    float p0, p1;
};
static_assert(sizeof(Head) == 36, "abi.rs's HeadParams");
static_assert(HEAD_TILE == 8 * 32 && HEAD_THREADS == HEAD_TILE, "a lane's 8 classes, a thread a class");

// 8 consecutive weights of a row from `p`, those from `valid` on 0: one 16-byte load where
// the row's runs are aligned.
__device__ __forceinline__ void head_run(const T *p, int valid, bool aligned, float *v) {
    if (aligned && valid >= 8) {
        load8(p, v);
        return;
    }
#pragma unroll
    for (int l = 0; l < 8; ++l) v[l] = l < valid ? ld(p[l]) : 0.f;
}

extern "C" __global__ void __launch_bounds__(HEAD_THREADS)
    head(const Head h, const T *x, const T *w, const T *bias, float *y, float *partial,
         unsigned *done) {
    float *const pooled = reinterpret_cast<float *>(dynamic_shared());  // [n][chunk]
    float *const part = pooled + HEAD_MAX_BATCH * HEAD_CHUNK;            // 8 a thread
    float *const shared = part + 8 * HEAD_THREADS;                       // 32, and a flag
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int c0 = blockIdx.y * h.chunk, width = min(h.chunk, h.c - c0);

    // The pool: thread t sums run t % runs of the slice's channels over the pixels t / runs,
    // t / runs + lanes, ...; the lanes' sums meet in `part`, [lanes][chunk], added in order.
    const int runs = h.chunk / 8, lanes = HEAD_THREADS / runs;
    const int r = t % runs, p0 = t / runs;
    for (int b = 0; b < h.n; ++b) {
        float s[8];
#pragma unroll
        for (int l = 0; l < 8; ++l) s[l] = 0.f;
        if (p0 < lanes && 8 * r < width) {
            const T *src = x + (long long)b * h.hw * h.c + c0 + 8 * r;
#pragma unroll 4
            for (int p = p0; p < h.hw; p += lanes) {
                float v[8];
                load8(src + (long long)p * h.c, v);
#pragma unroll
                for (int l = 0; l < 8; ++l) s[l] += act(h.act, v[l], h.p0, h.p1);
            }
        }
        if (p0 < lanes) {
#pragma unroll
            for (int l = 0; l < 8; ++l) part[p0 * h.chunk + 8 * r + l] = s[l];
        }
        __syncthreads();
        if (t < h.chunk) {
            float sum = 0.f;
            for (int q = 0; q < lanes; ++q) sum += part[q * h.chunk + t];
            pooled[b * h.chunk + t] = sum / h.hw;
        }
        __syncthreads();
    }

    // The products: lane `lane` takes classes j to j + 7 of the tile, warp `warp` the
    // slice's channels warp, warp + 8, ...; the images' sums stay in registers.
    const int j = blockIdx.x * HEAD_TILE + 8 * lane;
    const int valid = h.classes - j;
    const bool aligned = h.classes % 8 == 0 && reinterpret_cast<unsigned long long>(w) % 16 == 0;
    float acc[HEAD_MAX_BATCH][8];
#pragma unroll
    for (int b = 0; b < HEAD_MAX_BATCH; ++b)
#pragma unroll
        for (int l = 0; l < 8; ++l) acc[b][l] = 0.f;
    if (valid > 0) {
#pragma unroll 4
        for (int k = warp; k < width; k += HEAD_THREADS / 32) {
            float v[8];
            head_run(w + (long long)(c0 + k) * h.classes + j, valid, aligned, v);
#pragma unroll
            for (int b = 0; b < HEAD_MAX_BATCH; ++b) {
                if (b < h.n) {
                    const float p = pooled[b * h.chunk + k];
#pragma unroll
                    for (int l = 0; l < 8; ++l) acc[b][l] += p * v[l];
                }
            }
        }
    }
    // The warps' sums, in order: thread t's is class t of the tile.
    const int i = blockIdx.x * HEAD_TILE + t;
#pragma unroll
    for (int b = 0; b < HEAD_MAX_BATCH; ++b) {
        if (b < h.n) {
#pragma unroll
            for (int l = 0; l < 8; ++l) part[warp * HEAD_TILE + 8 * lane + l] = acc[b][l];
            __syncthreads();
            if (i < h.classes) {
                float s = 0.f;
                for (int q = 0; q < HEAD_THREADS / 32; ++q) s += part[q * HEAD_TILE + t];
                partial[((long long)blockIdx.y * h.n + b) * h.classes + i] = s;
            }
            __syncthreads();
        }
    }

    // The last block to finish sees every block's sums (each made them visible before
    // counting itself done) and adds them; the others are done.
    __threadfence();
    __syncthreads();
    unsigned *const last = reinterpret_cast<unsigned *>(shared + 32);
    if (t == 0) *last = atomicAdd(done, 1u) == gridDim.x * gridDim.y - 1;
    __syncthreads();
    if (!*last) return;
    __threadfence();
    for (int b = 0; b < h.n; ++b) {
        // The logits over the first slice's sums: a thread's classes are its own. Four
        // classes a thread at a time, so that four chains of loads are in flight.
        float *const logits = partial + (long long)b * h.classes;
        float m = -3.402823466e38f;
        for (int k0 = t; k0 < h.classes; k0 += 4 * HEAD_THREADS) {
            float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
            for (int q = 0; q < (int)gridDim.y; ++q) {
                const float *const slice = partial + ((long long)q * h.n + b) * h.classes;
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int k = k0 + u * HEAD_THREADS;
                    if (k < h.classes) v[u] += __ldcg(slice + k);
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int k = k0 + u * HEAD_THREADS;
                if (k < h.classes) {
                    if (bias) v[u] += ld(bias[k]);
                    logits[k] = v[u];
                    m = fmaxf(m, v[u]);
                }
            }
        }
        float inv = 1.f;
        if (h.softmax) {
            m = block_max(m, shared);
            float s = 0.f;
            for (int k = t; k < h.classes; k += HEAD_THREADS) {
                const float e = __expf(logits[k] - m);
                logits[k] = e;
                s += e;
            }
            inv = 1.f / block_sum(s, shared);
        }
        for (int k = t; k < h.classes; k += HEAD_THREADS) {
            float *const at = y + (long long)b * h.classes + k;
            WROTE(at);
            *at = h.softmax ? logits[k] * inv : logits[k];
        }
        __syncthreads();
    }
    if (t == 0) *done = 0;
}
