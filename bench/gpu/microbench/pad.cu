// SPDX-License-Identifier: MPL-2.0
// Code that is loaded and never run: 256 kernels of about 8 KB each.
template <int K> __device__ void body(float *y) {
    float v = y[threadIdx.x];
#pragma unroll
    for (int j = 0; j < 400; ++j) v = fmaf(v, 1.0001f + K * 1e-6f + j * 1e-7f, 1e-7f * (j ^ K));
    y[threadIdx.x] = v;
}
#define P(K) extern "C" __global__ void pad_##K(float *y) { body<K>(y); }
#define P8(B) P(B##0) P(B##1) P(B##2) P(B##3) P(B##4) P(B##5) P(B##6) P(B##7)
#define P64(B) P8(B##1) P8(B##2) P8(B##3) P8(B##4) P8(B##5) P8(B##6) P8(B##7) P8(B##8)
P64(1) P64(2) P64(3) P64(4)
