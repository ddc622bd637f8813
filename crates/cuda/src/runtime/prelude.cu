// SPDX-License-Identifier: MPL-2.0
// What every kernel file uses. The kernels of the cuda engine are compiled by NVRTC when an
// engine is built, as one source that `runtime::kernels::source` puts together: the
// constants and ids generated from the Rust side (abi.rs's `prelude`), this file, the
// activations, then each family's file (steps/*.cu, preprocess.cu). `T` is the storage type
// (`unsigned short` holding fp16, or `float`); arithmetic is in f32. No headers: fp16
// conversions are single PTX instructions, so NVRTC needs no include path. Where
// `TRTCLASSIFY_EMULATOR` is defined, the source is C++ for the CPU emulator of the tests
// (crates/cuda/emulator/emu.h), which stands in for the PTX.

#if defined(HALF) && defined(TRTCLASSIFY_EMULATOR)
typedef unsigned short T;
__device__ __forceinline__ float ld(T h) { return emu::half_to_float(h); }
__device__ __forceinline__ T st(float f) { return emu::float_to_half(f); }
#elif defined(HALF)
typedef unsigned short T;
__device__ __forceinline__ float ld(T h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ T st(float f) { T h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
#else
typedef float T;
__device__ __forceinline__ float ld(T v) { return v; }
__device__ __forceinline__ T st(float v) { return v; }
#endif

// 16 bytes, moved by one vector load or store; VEC elements.
struct alignas(16) Vec16 {
    unsigned int x, y, z, w;
};
#define VEC (16 / (int)sizeof(T))

// n / d for n < 2^31, with the multiplier and shift of d from abi.rs's `divider`: a
// multiply-high and a shift where a division instruction sequence costs about twenty.
__device__ __forceinline__ unsigned fast_div(unsigned n, unsigned mul, unsigned shift) {
    return (__umulhi(n, mul) + n) >> shift;
}

// The emulator's record of a store to the output at `p`, so that it fails where two blocks of
// a launch write the same outputs; nothing on a GPU.
#if defined(TRTCLASSIFY_EMULATOR)
#define WROTE(p) emu::wrote(p)
#else
#define WROTE(p)
#endif

// The block's dynamic shared memory (as much as its launch gave).
__device__ __forceinline__ unsigned char *dynamic_shared() {
#if defined(TRTCLASSIFY_EMULATOR)
    return emu::block_shared();
#else
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    return shared_bytes;
#endif
}

// A block's array of N floats in shared memory: in the emulator, whose threads are fibers
// each with a stack of its own, the block's dynamic shared memory (the launch gives it).
#if defined(TRTCLASSIFY_EMULATOR)
#define SHARED_FLOATS(name, n) float *name = reinterpret_cast<float *>(dynamic_shared())
#else
#define SHARED_FLOATS(name, n) __shared__ float name[n]
#endif

// 16 bytes from global to shared memory without passing through registers (cp.async, sm_80
// on), zeros where `valid` is false (then nothing is read: `src` need only be an address).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
#if defined(TRTCLASSIFY_EMULATOR)
    emu::cp_async16(dst, src, valid);
#elif __CUDA_ARCH__ >= 800
    unsigned addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :
                 : "r"(addr), "l"(src), "r"(valid ? 16 : 0));
#endif
}

// Closes this thread's group of copies issued since the last one.
__device__ __forceinline__ void cp_async_commit() {
#if defined(TRTCLASSIFY_EMULATOR)
    emu::cp_async_commit();
#elif __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}

// Waits until at most N of this thread's committed groups of copies are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if defined(TRTCLASSIFY_EMULATOR)
    emu::cp_async_wait(N);
#elif __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" : : "n"(N));
#endif
}

// The tensor cores' instructions of the kernels that use them (quant.cu, stem.cu,
// attention.cu), sm_80 on; below it they compile empty, and those kernels are never launched.
// Four 8×8 matrices of 16-bit values from shared memory, each lane giving one row's address
// (16 aligned bytes): lanes 8j to 8j + 7 name matrix j's rows, and lane l gets, of each
// matrix, row l / 4's values 2·(l % 4) and 2·(l % 4) + 1.
__device__ __forceinline__ void ldmatrix4(unsigned (&d)[4], const void *smem) {
#if defined(TRTCLASSIFY_EMULATOR)
    emu::ldmatrix_x4(d, smem);
#elif __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(s));
#endif
}

// The same four matrices transposed: lane l gets, of each matrix, column l / 4's values in
// rows 2·(l % 4) and 2·(l % 4) + 1 (a B fragment of m16n8k16 from a row-major tile).
__device__ __forceinline__ void ldmatrix4_trans(unsigned (&d)[4], const void *smem) {
#if defined(TRTCLASSIFY_EMULATOR)
    emu::ldmatrix_x4_trans(d, smem);
#elif __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(s));
#endif
}

// D += A·B for a 16×16 A (row-major fragments), a 16×8 B (column-major), fp16 values into
// f32 accumulators.
__device__ __forceinline__ void mma_16816(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
#if defined(TRTCLASSIFY_EMULATOR)
    emu::mma_m16n8k16_f16(d, a, b0, b1);
#elif __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
