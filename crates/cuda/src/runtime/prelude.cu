// SPDX-License-Identifier: MPL-2.0
// What every kernel file uses. The kernels of the cuda engine are compiled by NVRTC when an
// engine is built, as one source that `runtime::kernels::source` puts together: the
// constants and ids generated from the Rust side (abi.rs's `prelude`), this file, the
// activations, then each family's file (steps/*.cu, preprocess.cu). `T` is the storage type
// (`unsigned short` holding fp16, or `float`); arithmetic is in f32. No headers: fp16
// conversions are single PTX instructions, so NVRTC needs no include path.

#ifdef HALF
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
