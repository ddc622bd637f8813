// SPDX-License-Identifier: MPL-2.0
// Element-wise steps (`Step::Ew`): `out = act(op(a, b))` over up to MAX_RANK strided
// dimensions, with the casts between the plan's type and f32; launched by elementwise.rs's
// `elementwise`.

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
    // A thread takes `chunk` elements of the last dimension at a time, `parts` chunks a row,
    // `items` in all: a row's offsets are worked out once for the chunk's elements.
    long long items;
    int chunk, parts;
    // 1 where n (so every index) and every offset fit in an int (the host checked): 32 bits.
    int narrow;
    // abi.rs's `divider` of each dimension but the last, and of `parts` in the last's place.
    unsigned div_mul[MAX_RANK];
    unsigned div_shift[MAX_RANK];
};
// The size that abi.rs's `EwParams` asserts too, with the offsets this layout gives its
// fields (NVRTC has no offsetof): a field changed on one side only stops a build.
static_assert(sizeof(Ew) == 272, "struct Ew no longer matches EwParams (abi.rs)");

// One chunk: its first element's offsets in out, a and b, the operands' strides along the
// last dimension, and how many elements it has (fewer at the end of a row).
template <typename I> struct Chunk {
    I o, a, b;
    I so, sa, sb;
    int len;
};

// Chunk `j`. The loop is unrolled over MAX_RANK so that every field is read at a fixed
// offset; in 32 bits (I = int, p.narrow) without division instructions.
template <typename I> __device__ __forceinline__ Chunk<I> ew_chunk(const Ew &p, I j) {
    Chunk<I> c = {0, 0, 0, 0, 0, 0, 0};
    const int r = p.rank - 1;
    I rest = j;
#pragma unroll
    for (int d = MAX_RANK - 1; d >= 0; --d) {
        if (d > r) continue;
        const I by = d == r ? p.parts : p.dims[d];
        const I q = sizeof(I) == 4 ? (I)fast_div((unsigned)rest, p.div_mul[d], p.div_shift[d])
                                   : rest / by;
        I at = rest - q * by;
        rest = q;
        if (d == r) {
            at *= p.chunk;
            c.len = min(p.chunk, p.dims[d] - (int)at);
            c.so = (I)p.so[d];
            c.sa = (I)p.sa[d];
            c.sb = (I)p.sb[d];
        }
        c.o += at * (I)p.so[d];
        c.a += at * (I)p.sa[d];
        c.b += at * (I)p.sb[d];
    }
    return c;
}

// A chunk's loads all come before its stores, unrolled over the most elements a chunk has
// (the host's `EW_SCALAR_CHUNK`): issued together, they wait for memory once, where a loop
// of load-then-store waited once an element (the frames' cast from f32 NCHW into NHWC,
// three channels a pixel, ran at a third of the memory's speed).
template <typename I, typename O, typename A>
__device__ __forceinline__ void ew_chunks(const Ew &p, O *out, const A *a, const T *b,
                                          float (*lda)(A), O (*sto)(float)) {
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < p.items;
         j += (long long)gridDim.x * blockDim.x) {
        const Chunk<I> c = ew_chunk<I>(p, (I)j);
        float va[EW_SCALAR_CHUNK], vb[EW_SCALAR_CHUNK];
#pragma unroll
        for (int k = 0; k < EW_SCALAR_CHUNK; ++k) {
            if (k >= c.len) break;
            va[k] = lda(a[c.a + k * c.sa]);
            if (p.op >= 0) vb[k] = ld(b[c.b + k * c.sb]);
        }
#pragma unroll
        for (int k = 0; k < EW_SCALAR_CHUNK; ++k) {
            if (k >= c.len) break;
            float v = va[k];
            if (p.op >= 0) v = binop(p.op, v, vb[k]);
            out[c.o + k * c.so] = sto(act(p.act, v, p.p0, p.p1));
        }
    }
}

template <typename O, typename A>
__device__ __forceinline__ void ew_body(const Ew &p, O *out, const A *a, const T *b,
                                        float (*lda)(A), O (*sto)(float)) {
    if (p.narrow)
        ew_chunks<int, O, A>(p, out, a, b, lda, sto);
    else
        ew_chunks<long long, O, A>(p, out, a, b, lda, sto);
}

// `ew` with 16-byte loads and stores: chunks of VEC elements (the host set p.chunk = VEC).
// The host checked that the last dimension is a multiple of VEC, contiguous and 16-byte
// aligned in out and a, and in b unless b is constant along it.
template <typename I>
__device__ __forceinline__ void ew_vec_chunks(const Ew &p, T *out, const T *a, const T *b) {
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < p.items;
         j += (long long)gridDim.x * blockDim.x) {
        const Chunk<I> c = ew_chunk<I>(p, (I)j);
        const bool bvec = p.op >= 0 && c.sb != 0;
        const Vec16 va = *reinterpret_cast<const Vec16 *>(a + c.a);
        Vec16 vb = {0, 0, 0, 0};
        if (bvec) vb = *reinterpret_cast<const Vec16 *>(b + c.b);
        const float bs = p.op >= 0 && !bvec ? ld(b[c.b]) : 0.f;
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
        *reinterpret_cast<Vec16 *>(out + c.o) = vo;
    }
}

extern "C" __global__ void ew_vec(const Ew p, T *out, const T *a, const T *b) {
    if (p.narrow)
        ew_vec_chunks<int>(p, out, a, b);
    else
        ew_vec_chunks<long long>(p, out, a, b);
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

