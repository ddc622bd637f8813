// SPDX-License-Identifier: MPL-2.0
// Fused attention (`Step::Attention`), fp16 only; launched by attention.rs's `attention`.

#ifdef HALF
// Fused attention (`Step::Attention`): for each batch index, y = softmax(alpha·q·kᵀ + bias)·v
// over rows of keys. The scores stay in registers, in f32, with a running maximum and sum
// per row (the online softmax of FlashAttention), so they are never written to memory; the
// operands are read through their strides, so the heads need not be copied out of the
// projections first. On tensor cores (mma.sync, sm_80 and newer): a warp takes 16 queries,
// a block 4 or 8 warps (attention.rs chooses), against tiles of 64 keys held in shared
// memory. `attention_rows` is the same computation without tensor cores, a warp per query,
// for older GPUs.
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

#define ATTN_KEYS 64
#define LOG2E 1.4426950408889634f
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float fast_exp2(float x) {
#if defined(TRTCLASSIFY_EMULATOR)
    return std::exp2(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
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

// 64 rows of WIDTH values (row stride `stride`) into shared memory rows of WIDTH + 8 (the
// padding spreads the fragments' reads over the banks) by plain loads, for rows not 16-byte
// aligned; zeros past `valid` rows.
template <int WIDTH>
__device__ __forceinline__ void attn_rows_in(T *dst, const T *src, long long stride, int valid) {
    for (int i = threadIdx.x; i < 64 * WIDTH; i += blockDim.x) {
        int r = i / WIDTH, c = i % WIDTH;
        dst[r * (WIDTH + 8) + c] = r < valid ? src[r * stride + c] : (T)0;
    }
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
        attn_rows_in<DK>(kd, k, p.k[3], valid);
        attn_rows_in<DV>(vd, v, p.v[3], valid);
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
    cp_async_commit();
}

// Tiles of keys and values held at once: two of each (one in use while the next arrives)
// for heads of up to 64 (36 KB), one of each for larger ones, within the 48 KB of shared
// memory a launch gets without asking.
template <int DK, int DV> __device__ constexpr int attn_stages() { return DK + DV <= 128 ? 2 : 1; }

// Two B fragments of m16n8k16 from shared memory, by one ldmatrix of four 8×8 matrices, each
// lane naming one matrix row (`row0` points at the first matrix's first element). Keys (not
// transposed): 8 keys × dimensions kk·16 … kk·16 + 31, matrix `i` `i` × 8 columns on, lane
// `l` naming row `l % 8` of matrix `l / 8`. Values (transposed): 16 keys × dimensions
// dn·8 … dn·8 + 15, matrices 1 and 3 8 rows down, 2 and 3 8 columns on, lane `l` naming
// row `l % 16` of the columns `l / 16` × 8 on.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&b)[4], const T *row0, int pitch, bool trans) {
    const int lane = threadIdx.x % 32;
    if (trans)
        ldmatrix4_trans(b, row0 + (lane % 16) * pitch + lane / 16 * 8);
    else
        ldmatrix4(b, row0 + (lane % 8) * pitch + lane / 8 * 8);
}

// Two neighbouring values as the 32 bits of a fragment: one load where `aligned`.
__device__ __forceinline__ unsigned ld_pair(const T *x, bool aligned) {
    return aligned ? *(const unsigned *)x : (unsigned)x[0] | ((unsigned)x[1] << 16);
}

// One tile of keys against a warp's 16 queries (`qa`): the scores, the running maximum `mx`
// and sum `l` of rows g and g + 8, and the output `o` rescaled and added to. PLAIN: the tile
// is whole (`valid` = 64 keys), has no bias and a positive scale, so the code is straight:
// no masks, no group of keys skipped, the scores scaled as they are raised (one fused
// multiply-add), so that the scores' instructions bound the loop as little as they can.
// Otherwise the scores past the last key are masked, their products skipped (the last tile
// of 197 keys has 5), and the bias added.
template <int DK, int DV, bool PLAIN>
__device__ __forceinline__ void attn_tile(const unsigned (&qa)[DK / 16][4], float (&o)[DV / 8][4],
                                          float (&mx)[2], float (&l)[2], const T *kt, const T *vt,
                                          const Attn &p, const T *bias, int t0, int valid, int row0,
                                          float scale) {
    const int lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
    // Scores of 8 keys at a time.
    float s[ATTN_KEYS / 8][4];
#pragma unroll
    for (int nt = 0; nt < ATTN_KEYS / 8; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        if (!PLAIN && nt * 8 >= valid) continue;
#pragma unroll
        for (int kk = 0; kk < DK / 16; kk += 2) {
            const T *kr = kt + nt * 8 * (DK + 8) + kk * 16;
            if (kk + 1 < DK / 16) {
                unsigned b[4];
                ldmatrix_x4(b, kr, DK + 8, false);
                mma_16816(s[nt], qa[kk], b[0], b[1]);
                mma_16816(s[nt], qa[kk + 1], b[2], b[3]);
            } else {
                kr += g * (DK + 8) + tg * 2;
                mma_16816(s[nt], qa[kk], *(const unsigned *)kr, *(const unsigned *)(kr + 8));
            }
        }
    }
    float tile_max[2] = {NEG_INF, NEG_INF};
    if (PLAIN) {
#pragma unroll
        for (int nt = 0; nt < ATTN_KEYS / 8; ++nt) {
            tile_max[0] = fmaxf(tile_max[0], fmaxf(s[nt][0], s[nt][1]));
            tile_max[1] = fmaxf(tile_max[1], fmaxf(s[nt][2], s[nt][3]));
        }
        tile_max[0] *= scale;
        tile_max[1] *= scale;
    } else {
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
            s[nt][e] = PLAIN ? fast_exp2(fmaf(s[nt][e], scale, -base[e >> 1]))
                             : fast_exp2(s[nt][e] - base[e >> 1]);
            l[e >> 1] += s[nt][e];
        }
    }
    // The weights, in fp16, are the A fragments of the product with the values: the
    // accumulators of two neighbouring 8-key tiles make one 16-key fragment.
#pragma unroll
    for (int kk = 0; kk < ATTN_KEYS / 16; ++kk) {
        if (!PLAIN && kk * 16 >= valid) continue;
        unsigned pa[4] = {
            pack_half2(s[2 * kk][0], s[2 * kk][1]),
            pack_half2(s[2 * kk][2], s[2 * kk][3]),
            pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
            pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3]),
        };
#pragma unroll
        for (int dn = 0; dn < DV / 8; dn += 2) {
            unsigned b[4];
            ldmatrix_x4(b, vt + kk * 16 * (DV + 8) + dn * 8, DV + 8, true);
            mma_16816(o[dn], pa, b[0], b[1]);
            mma_16816(o[dn + 1], pa, b[2], b[3]);
        }
    }
}

// A warp takes 16 queries, the block as many warps as it has, against tiles of 64 keys and
// values, `attn_stages` of each in shared memory (in the emulator, the launch's dynamic
// shared memory).
template <int DK, int DV>
__device__ void attention_body(const Attn &p, const T *q, const T *k, const T *v, const T *bias, T *y) {
#if __CUDA_ARCH__ >= 800 || defined(TRTCLASSIFY_EMULATOR)
    constexpr int STAGES = attn_stages<DK, DV>();
#if defined(TRTCLASSIFY_EMULATOR)
    T *const ks = (T *)dynamic_shared();  // each thread of the emulator has a stack of its own
#else
    __shared__ __align__(16) T ks[STAGES * ATTN_KEYS * (DK + DV + 16)];
#endif
    T *const vs = ks + STAGES * ATTN_KEYS * (DK + 8);
    const int m = blockIdx.x, q0 = blockIdx.y * (blockDim.x / 32) * 16;
    q += batch_offset(p, p.q, m);
    k += batch_offset(p, p.k, m);
    v += batch_offset(p, p.v, m);
    y += batch_offset(p, p.y, m);
    if (bias) bias += batch_offset(p, p.bias, m);
    const bool vec = p.vec;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
    const int tiles = (p.keys + ATTN_KEYS - 1) / ATTN_KEYS;
    if (STAGES == 2) attn_tile_in<DK, DV>(ks, vs, k, v, p, 0, vec);

    const int row0 = q0 + warp * 16 + g;
    // The last block's last warps may have no query: they only help load the tiles.
    const bool active = q0 + warp * 16 < p.queries;
    // This warp's 16 queries as the A fragments of m16n8k16, read once from global memory
    // (while the first tile arrives) and kept for every tile; zeros past the last query.
    unsigned qa[DK / 16][4];
    {
        const bool in0 = row0 < p.queries, in1 = row0 + 8 < p.queries;
        const T *r0 = q + (long long)min(row0, p.queries - 1) * p.q[3] + tg * 2;
        const T *r1 = q + (long long)min(row0 + 8, p.queries - 1) * p.q[3] + tg * 2;
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk) {
            qa[kk][0] = in0 ? ld_pair(r0 + kk * 16, vec) : 0u;
            qa[kk][1] = in1 ? ld_pair(r1 + kk * 16, vec) : 0u;
            qa[kk][2] = in0 ? ld_pair(r0 + kk * 16 + 8, vec) : 0u;
            qa[kk][3] = in1 ? ld_pair(r1 + kk * 16 + 8, vec) : 0u;
        }
    }
    // Rows g and g + 8 of the warp's 16: running maximum (log2 units) and sum, and output.
    float o[DV / 8][4];
#pragma unroll
    for (int dn = 0; dn < DV / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
    float mx[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const float scale = p.alpha * LOG2E;

    for (int t = 0; t < tiles; ++t) {
        const int t0 = t * ATTN_KEYS, stage = STAGES == 2 ? t & 1 : 0;
        // Every warp is done with the stage about to be filled (that of tile t - 1).
        if (t > 0) __syncthreads();
        if (STAGES == 1) {
            attn_tile_in<DK, DV>(ks, vs, k, v, p, t0, vec);
            cp_async_wait<0>();
        } else if (t + 1 < tiles) {
            attn_tile_in<DK, DV>(ks + (stage ^ 1) * ATTN_KEYS * (DK + 8), vs + (stage ^ 1) * ATTN_KEYS * (DV + 8),
                                 k, v, p, t0 + ATTN_KEYS, vec);
            cp_async_wait<1>();  // tile t is in, tile t + 1 may still be on its way
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (!active) continue;
        const T *kt = ks + stage * ATTN_KEYS * (DK + 8), *vt = vs + stage * ATTN_KEYS * (DV + 8);
        const int valid = min(ATTN_KEYS, p.keys - t0);
        // A whole tile without a bias (every tile but the last, in a ViT) runs as straight
        // code: no mask, no group of keys to skip, its scores scaled as they are raised.
        if (!bias && valid == ATTN_KEYS && scale > 0.f)
            attn_tile<DK, DV, true>(qa, o, mx, l, kt, vt, p, bias, t0, valid, row0, scale);
        else
            attn_tile<DK, DV, false>(qa, o, mx, l, kt, vt, p, bias, t0, valid, row0, scale);
    }
    if (!active) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        int row = row0 + r * 8;
        if (row >= p.queries) continue;
        float inv = 1.f / sum;
        T *out = y + row * p.y[3] + tg * 2;
        const bool aligned = ((unsigned long long)out & 3) == 0;
#pragma unroll
        for (int dn = 0; dn < DV / 8; ++dn) {
            float a = o[dn][2 * r] * inv, b = o[dn][2 * r + 1] * inv;
            WROTE(out + dn * 8);
            if (aligned) {
                *(unsigned *)(out + dn * 8) = pack_half2(a, b);
            } else {
                out[dn * 8] = st(a);
                out[dn * 8 + 1] = st(b);
            }
        }
    }
#endif
}

// Each pair of head dimensions twice: for blocks of 4 warps and of 8 (attention.rs chooses),
// with the blocks an SM should hold at least (`MIN_BLOCKS`, the launch bounds' second),
// which caps ptxas's registers: for ViT's heads of 64, 128 registers make room for 16 warps
// an SM (ViT-B/16's attention at batch 64 on an H200: 76 µs, against 108 µs with the 135
// that ptxas takes unbounded); for Swin's of 32 in windows of 49, 96 registers let 5 blocks
// of 4 warps share an SM. Others are left to ptxas (heads of 128 would spill).
#define ATTENTION(DK, DV, WARPS, MIN_BLOCKS)                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)                       \
        attention_##DK##_##DV##_##WARPS##w(const Attn p, const T *q, const T *k, const T *v,   \
                                           const T *bias, T *y) {                               \
        attention_body<DK, DV>(p, q, k, v, bias, y);                                            \
    }
// `ATTENTION_HEAD_DIMS` in the compiler's plan/attention.rs: every pair with dk ≤ dv.
ATTENTION(16, 16, 4, 1)
ATTENTION(16, 16, 8, 1)
ATTENTION(16, 32, 4, 1)
ATTENTION(16, 32, 8, 1)
ATTENTION(16, 64, 4, 1)
ATTENTION(16, 64, 8, 1)
ATTENTION(16, 128, 4, 1)
ATTENTION(16, 128, 8, 1)
ATTENTION(32, 32, 4, 5)
ATTENTION(32, 32, 8, 2)
ATTENTION(32, 64, 4, 1)
ATTENTION(32, 64, 8, 1)
ATTENTION(32, 128, 4, 1)
ATTENTION(32, 128, 8, 1)
ATTENTION(64, 64, 4, 4)
ATTENTION(64, 64, 8, 2)
ATTENTION(64, 128, 4, 1)
ATTENTION(64, 128, 8, 1)
ATTENTION(128, 128, 4, 1)
ATTENTION(128, 128, 8, 1)

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
