// SPDX-License-Identifier: MPL-2.0
// Softmax of rows of `len` f32 scores in place, `bias` (f16) added first: copies of the
// engine's warp kernel (rows.cu's softmax_warp) and block kernel (softmax_rows) as main had
// them on 2026-12-06, each with the bias added, kept frozen so that the ways compare in one
// file; the warp kernel with its loads issued first; and a block that holds the row in
// registers (the branch `tail`'s softmax_block).
typedef unsigned short __half;  // fp16 bits, without cuda_fp16.h
__device__ __forceinline__ float __half2float(__half h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ float warp_sum(float v) { for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o); return v; }
__device__ __forceinline__ float warp_max(float v) { for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o)); return v; }
__device__ __forceinline__ float block_sum(float v, float *shared) {
    v = warp_sum(v); int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads(); if (lane == 0) shared[warp] = v; __syncthreads();
    float t = 0.f; for (int w = 0; w < blockDim.x / 32; ++w) t += shared[w]; return t; }
__device__ __forceinline__ float block_max(float v, float *shared) {
    v = warp_max(v); int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads(); if (lane == 0) shared[warp] = v; __syncthreads();
    float m = shared[0]; for (int w = 1; w < blockDim.x / 32; ++w) m = fmaxf(m, shared[w]); return m; }
#define WARP_ROW_MAX 1024
extern "C" __global__ void sm_warp(float *x, const __half *bias, float *y, int rows, int len) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float *in = x + (long long)row * len; float *out = y + (long long)row * len;
    float v[WARP_ROW_MAX / 32]; float m = -3.4e38f;
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) { if (k * 32 >= len) break; int i = k * 32 + lane;
        v[k] = i < len ? in[i] + (bias ? __half2float(bias[i]) : 0.f) : -3.4e38f; m = fmaxf(m, v[k]); }
    m = warp_max(m); float s = 0.f;
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) { if (k * 32 >= len) break; v[k] = k * 32 + lane < len ? __expf(v[k] - m) : 0.f; s += v[k]; }
    float inv = 1.f / warp_sum(s);
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) { if (k * 32 >= len) break; int i = k * 32 + lane; if (i < len) out[i] = v[k] * inv; }
}
// The engine's warp kernel with every load issued before the first is used.
extern "C" __global__ void sm_warp2(float *x, const __half *bias, float *y, int rows, int len) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float *in = x + (long long)row * len; float *out = y + (long long)row * len;
    float v[WARP_ROW_MAX / 32];
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) { int i = k * 32 + lane; v[k] = i < len ? in[i] + (bias ? __half2float(bias[i]) : 0.f) : -3.4e38f; }
    float m = -3.4e38f;
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) m = fmaxf(m, v[k]);
    m = warp_max(m); float s = 0.f;
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) { v[k] = k * 32 + lane < len ? __expf(v[k] - m) : 0.f; s += v[k]; }
    float inv = 1.f / warp_sum(s);
#pragma unroll
    for (int k = 0; k < WARP_ROW_MAX / 32; ++k) { int i = k * 32 + lane; if (i < len) out[i] = v[k] * inv; }
}
extern "C" __global__ void sm_block(float *x, const __half *bias, float *y, int len) {
    __shared__ float shared[32];
    const float *row = x + (long long)blockIdx.x * len; float *out = y + (long long)blockIdx.x * len;
    auto at = [&](int i) { return row[i] + (bias ? __half2float(bias[i]) : 0.f); };
    float m = -3.4e38f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) m = fmaxf(m, at(i));
    m = block_max(m, shared); float s = 0.f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) s += __expf(at(i) - m);
    s = block_sum(s, shared);
    for (int i = threadIdx.x; i < len; i += blockDim.x) out[i] = __expf(at(i) - m) / s;
}
// The row held in registers, 4 elements a thread at most: one read, one write.
extern "C" __global__ void sm_reg(float *x, const __half *bias, float *y, int len) {
    __shared__ float shared[32];
    const float *row = x + (long long)blockIdx.x * len; float *out = y + (long long)blockIdx.x * len;
    float v[4]; float m = -3.4e38f;
#pragma unroll
    for (int k = 0; k < 4; ++k) { int i = threadIdx.x + k * blockDim.x;
        v[k] = i < len ? row[i] + (bias ? __half2float(bias[i]) : 0.f) : -3.4e38f; m = fmaxf(m, v[k]); }
    m = block_max(m, shared); float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) { int i = threadIdx.x + k * blockDim.x; v[k] = i < len ? __expf(v[k] - m) : 0.f; s += v[k]; }
    float inv = 1.f / block_sum(s, shared);
#pragma unroll
    for (int k = 0; k < 4; ++k) { int i = threadIdx.x + k * blockDim.x; if (i < len) out[i] = v[k] * inv; }
}
// The bias as a step of its own, over all `n` scores (rows of `len`).
extern "C" __global__ void add_bias(float *x, const __half *bias, int n, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += __half2float(bias[i % len]); }
extern "C" __global__ void empty(float *x) {}
