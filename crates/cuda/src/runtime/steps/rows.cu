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

