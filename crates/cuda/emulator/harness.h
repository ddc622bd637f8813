// SPDX-License-Identifier: MPL-2.0
// What the convolution and gate harnesses share (stem_test.cpp, depthwise_test.cpp,
// gate_test.cpp): floats by their bits (as emulated.rs writes a case's parameters), device
// buffers of test values with a guard past them, and the test values. After emu.h and
// kernels.cu, which give `T`, `st` and `Vec16`.
#pragma once

#include <cstring>

inline float from_bits(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// 16-byte aligned device storage for `n` values, each `fill(i)` (every bit set, a NaN, where
// none), and `slack` more of that past them.
inline T *buffer(long long n, float (*fill)(long long), long long slack = 0) {
    T *p = reinterpret_cast<T *>(new Vec16[((n + slack) * sizeof(T) + 15) / 16 + 1]);
    emu::device_memory.push_back({reinterpret_cast<unsigned char *>(p), size_t(n * sizeof(T))});
    std::memset(p, 0xff, (n + slack) * sizeof(T));
    for (long long i = 0; i < n && fill; ++i) p[i] = st(fill(i));
    return p;
}

// Whether the value at `p` still has every bit set (nothing wrote it).
inline bool untouched(const T *p) {
    const unsigned char *b = reinterpret_cast<const unsigned char *>(p);
    for (size_t i = 0; i < sizeof(T); ++i)
        if (b[i] != 0xff) return false;
    return true;
}

// Inputs: multiples of 1/16 within ±3. Weights: multiples of 1/256 within ±0.17. Their
// products are exact in fp16's range and f32, and so are sums of thousands of them in any
// order.
inline float wave(long long i) { return float((i * 7919) % 97 - 48) * 0.0625f; }
inline float small(long long i) { return float((i * 104729) % 89 - 44) * 0.00390625f; }
