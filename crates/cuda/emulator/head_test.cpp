// SPDX-License-Identifier: MPL-2.0
// The classifier's head (rows.cu's `head`) on the CPU emulator, in fp16 (`HALF`) or f32:
// each case of `cases.h` (written by emulated.rs with the runtime's `head_params` and
// `head_launch`) runs with its blocks in both orders, so that a different block is the last
// to finish and adds the others' sums; each score must be the head's definition, its sums
// in double, within the f32 sums' rounding; nothing past the scores is written, and the
// count of blocks done is back at 0 for the next launch.
#include <cmath>
#include <vector>

#include "emu.h"
#include "kernels.cu"
#include "harness.h"

struct HeadCase {
    const char *name;
    Head p;
    bool bias;
    bool misaligned;  // the weights start 2 bytes past a 16-byte boundary
    unsigned tiles, slices, shared;
};

#include "cases.h"

// Image b's scores by the definition, and for each the sum of its terms' sizes, which
// bounds the f32 sums' rounding.
void definition(const Head &p, const T *x, const T *w, const T *bias, int b, std::vector<double> &want,
                std::vector<double> &size) {
    std::vector<double> pooled(p.c);
    for (int ch = 0; ch < p.c; ++ch) {
        double s = 0;
        for (int q = 0; q < p.hw; ++q)
            s += act(p.act, ld(x[((long long)b * p.hw + q) * p.c + ch]), p.p0, p.p1);
        pooled[ch] = s / p.hw;
    }
    want.assign(p.classes, 0.);
    size.assign(p.classes, 0.);
    for (int i = 0; i < p.classes; ++i) {
        double s = bias ? ld(bias[i]) : 0.;
        double a = std::fabs(s);
        for (int ch = 0; ch < p.c; ++ch) {
            const double term = pooled[ch] * ld(w[(long long)ch * p.classes + i]);
            s += term;
            a += std::fabs(term);
        }
        want[i] = s;
        size[i] = a;
    }
    if (!p.softmax) return;
    double m = want[0], sum = 0;
    for (double v : want) m = std::fmax(m, v);
    for (double &v : want) sum += v = std::exp(v - m);
    for (double &v : want) v /= sum;
}

bool run(const HeadCase &c) {
    const Head &p = c.p;
    emu::device_memory.clear();  // only this case's buffers may be read
    const T *x = buffer((long long)p.n * p.hw * p.c, wave);
    // Weights scaled by the root of the sums' length: logits near 1, where the softmax is
    // not flat.
    T *w = buffer((long long)p.c * p.classes + 1, small) + (c.misaligned ? 1 : 0);
    const float scale = 6.f / std::sqrt(float(p.c));
    for (long long i = 0; i < (long long)p.c * p.classes; ++i) w[i] = st(ld(w[i]) * scale);
    const T *bias = c.bias ? buffer(p.classes, small) : nullptr;
    const long long len = (long long)p.n * p.classes;
    std::vector<float> partial(size_t(c.slices) * p.n * p.classes);
    emu::device_memory.push_back({reinterpret_cast<unsigned char *>(partial.data()), partial.size() * 4});
    unsigned done = 0;
    emu::device_memory.push_back({reinterpret_cast<unsigned char *>(&done), 4});
    bool ok = true;
    for (emu::Order order : {emu::Order::Early, emu::Order::Late}) {
        std::vector<float> y(len + 64, -1.f);
        emu::device_memory.push_back({reinterpret_cast<unsigned char *>(y.data()), size_t(len * 4)});
        emu::launch({c.tiles, c.slices, 1}, {HEAD_THREADS, 1, 1}, c.shared, order,
                    [&] { head(p, x, w, bias, y.data(), partial.data(), &done); });
        long long wrong = 0, past = 0;
        double worst = 0;
        std::vector<double> want, size;
        for (int b = 0; b < p.n; ++b) {
            definition(p, x, w, bias, b, want, size);
            double largest = 0;
            for (double s : size) largest = std::fmax(largest, s);
            for (int i = 0; i < p.classes; ++i) {
                // f32 sums of `c` terms: a few ulps of the terms' sizes; a probability moves
                // by its own size times its logit's error, and the largest's through the sum.
                const double bound = p.softmax ? want[i] * 1e-5 * (1 + largest) + 1e-7 : 2e-6 * size[i] + 1e-6;
                const double error = std::fabs(double(y[(long long)b * p.classes + i]) - want[i]);
                wrong += !(error <= bound);
                worst = std::fmax(worst, error);
            }
        }
        for (long long i = len; i < len + 64; ++i) past += y[i] != -1.f;
        const bool same = wrong == 0 && past == 0 && done == 0;
        if (!same)
            std::printf("  %s: %lld of %lld scores differ (worst by %g), %lld written past the end, %u blocks counted\n",
                        order == emu::Order::Early ? "early" : "late", wrong, len, worst, past, done);
        ok = ok && same;
    }
    return ok;
}

int main() {
    int differ = 0;
    for (const HeadCase &c : HEAD_CASES) {
        const bool same = run(c);
        std::printf("%s: %s\n", c.name, same ? "same" : "DIFFERS");
        differ += !same;
    }
    std::printf("emulated: %zu head cases, %d differ\n", sizeof(HEAD_CASES) / sizeof(HEAD_CASES[0]),
                differ);
}
