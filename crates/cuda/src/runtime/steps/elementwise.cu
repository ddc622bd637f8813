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

