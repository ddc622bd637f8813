// SPDX-License-Identifier: MPL-2.0
// The fused attention kernels (attention.cu) on the CPU emulator, fp16: each case of
// `cases.h` (written by emulated.rs, each launched with the kernel and blocks the runtime
// gives it) reads its heads in place from a projection of q, k and v, as the
// engine does, and runs with its blocks in both orders. Each output must match the
// definition, softmax(alpha·q·kᵀ + bias)·v worked in double from the same fp16 inputs, within
// the rounding of the weights and the output to fp16; nothing outside the heads' outputs may
// be written.
#include "emu.h"
#include "kernels.cu"

#include <algorithm>
#include <cmath>

typedef void (*AttnKernel)(const Attn, const T *, const T *, const T *, const T *, T *);
struct AttnCase {
    const char *name;
    AttnKernel kernel;
    int images, heads, tokens, dk, dv;
    bool bias;
    // A row of the projection that is not a multiple of 8 values: no 16-byte loads.
    bool unaligned;
    // Scores up to about 100, whose exponentials overflow f32 unless the row's maximum is
    // taken off first.
    bool large;
    unsigned blocks_y, threads;
};
#include "cases.h"

T *buffer(long long n) {
    T *p = reinterpret_cast<T *>(new Vec16[(n * sizeof(T) + 15) / 16 + 1]);
    emu::device_memory.push_back({reinterpret_cast<unsigned char *>(p), size_t(n * sizeof(T))});
    std::fill(p, p + n, T(0xffff));
    return p;
}
// Multiples of `step` from -period/2 to period/2, hashed so that no row of keys repeats
// another (keys that repeat with a short period would hold the running maximum still from
// the first tile of keys on, and so hide a rescale gone wrong).
float wave(long long i, int period, float step) {
    uint32_t h = uint32_t(i) * 2654435761u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    return float(int(h % unsigned(period)) - period / 2) * step;
}

bool run(const AttnCase &c) {
    emu::device_memory.clear();  // only this case's buffers may be read
    const int heads = c.heads, n = c.tokens;
    // The projection: each token's q of every head, then its k, then its v (and one value
    // more where the rows are to be unaligned).
    const long long width = (long long)heads * (2 * c.dk + c.dv) + (c.unaligned ? 1 : 0);
    // 8 values (9 where the rows are unaligned: every other row's outputs start at an odd
    // value) that no head writes.
    const long long out_width = (long long)heads * c.dv + (c.unaligned ? 9 : 8);
    T *qkv = buffer(c.images * n * width);
    T *y = buffer(c.images * n * out_width);
    T *bias = c.bias ? buffer((long long)heads * n * n) : nullptr;
    const float qk_step = c.large ? 0.125f : 0.03125f;
    for (long long i = 0; i < c.images * n * width; ++i) {
        const long long col = i % width;
        qkv[i] = st(col < 2LL * heads * c.dk ? wave(i, 61, qk_step) : wave(i, 67, 0.0625f));
    }
    for (long long i = 0; bias && i < (long long)heads * n * n; ++i) bias[i] = st(wave(i, 41, 0.125f));

    Attn p{};
    p.batch[0] = 1;
    p.batch[1] = c.images;
    p.batch[2] = heads;
    p.queries = p.keys = n;
    p.dk = c.dk;
    p.dv = c.dv;
    p.alpha = 1.f / std::sqrt(float(c.dk));
    const long long qs[4] = {0, n * width, c.dk, width}, vs[4] = {0, n * width, c.dv, width};
    const long long ys[4] = {0, n * out_width, c.dv, out_width}, bs[4] = {0, 0, (long long)n * n, n};
    std::memcpy(p.q, qs, sizeof qs);
    std::memcpy(p.k, qs, sizeof qs);
    std::memcpy(p.v, vs, sizeof vs);
    std::memcpy(p.y, ys, sizeof ys);
    if (bias) std::memcpy(p.bias, bs, sizeof bs);
    p.vec = width % 8 == 0;  // as attention.rs decides: the pointers below are 16-byte aligned
    const T *q = qkv, *k = qkv + (long long)heads * c.dk, *v = qkv + 2LL * heads * c.dk;

    bool same = true;
    for (emu::Order order : {emu::Order::Early, emu::Order::Late}) {
        std::fill(y, y + c.images * n * out_width, T(0xffff));
        // What the kernel's shared array holds on a GPU: attn_stages tiles of each.
        const size_t shared = (c.dk + c.dv <= 128 ? 2 : 1) * 64 * (c.dk + c.dv + 16) * sizeof(T);
        emu::launch({unsigned(c.images * heads), c.blocks_y, 1}, {c.threads, 1, 1}, shared, order,
                    [&] { c.kernel(p, q, k, v, bias, y); });
        double worst = 0;
        long long wrong = 0, outside = 0;
        for (int b = 0; b < c.images; ++b)
            for (int h = 0; h < heads; ++h)
                for (int i = 0; i < n; ++i) {
                    const T *qi = q + (long long)b * n * width + (long long)i * width + h * c.dk;
                    std::vector<double> w(n);
                    double m = -1e300, sum = 0, vmax = 0;
                    for (int j = 0; j < n; ++j) {
                        const T *kj = k + (long long)b * n * width + (long long)j * width + h * c.dk;
                        double dot = 0;
                        for (int d = 0; d < c.dk; ++d) dot += double(ld(qi[d])) * ld(kj[d]);
                        w[j] = dot * p.alpha + (bias ? double(ld(bias[((long long)h * n + i) * n + j])) : 0.0);
                        m = std::max(m, w[j]);
                    }
                    for (int j = 0; j < n; ++j) sum += w[j] = std::exp(w[j] - m);
                    for (int d = 0; d < c.dv; ++d) {
                        double want = 0;
                        for (int j = 0; j < n; ++j) {
                            const double vj = ld(v[(long long)b * n * width + (long long)j * width + h * c.dv + d]);
                            want += w[j] / sum * vj;
                            vmax = std::max(vmax, std::fabs(vj));
                        }
                        const double got = ld(y[(long long)b * n * out_width + (long long)i * out_width + h * c.dv + d]);
                        // The weights rounded to fp16 (2^-11 of each, so of their sum with v),
                        // and the output rounded to fp16.
                        const double err = std::fabs(got - want);
                        if (!(err <= 1e-3 * vmax + 1e-3 * std::fabs(want) + 1e-4)) {
                            worst = std::max(worst, std::isnan(err) ? 1e30 : err);
                            ++wrong;
                        }
                    }
                }
        for (long long r = 0; r < c.images * n; ++r)
            for (int e = heads * c.dv; e < out_width; ++e) outside += y[r * out_width + e] != T(0xffff);
        if (wrong || outside) {
            std::printf("  %s (%s): %lld outputs off, largest error %g; %lld values written outside\n",
                        c.name, order == emu::Order::Early ? "early" : "late", wrong, worst, outside);
            same = false;
        }
    }
    return same;
}

int main() {
    int differ = 0, cases = 0;
    for (const AttnCase &c : ATTN_CASES) {
        const bool same = run(c);
        std::printf("%s: %s\n", c.name, same ? "within rounding" : "DIFFERS");
        differ += !same;
        ++cases;
    }
    std::printf("emulated: %d attention cases, %d differ\n", cases, differ);
    return 0;
}
