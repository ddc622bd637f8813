// SPDX-License-Identifier: MPL-2.0
// The squeeze-and-excitation gate (pool.cu's `se_gate`) on the CPU emulator, in fp16 (`HALF`)
// or f32: each case of `cases.h` (written by emulated.rs with the runtime's `gate_params` and
// `gate_launch`) runs with its blocks in both orders, and each output must be the gate's
// definition, its sums in double, within the rounding of the output; nothing past the output
// is written. The weights are scaled by the root of the length of the sums they take part in,
// so that the sums stay near 1, where a lost or doubled term shows, rather than where the
// sigmoid is flat.
#include <cmath>
#include <vector>

#include "emu.h"
#include "kernels.cu"
#include "harness.h"

struct GateCase {
    const char *name;
    Gate p;
    bool biases;    // with b1 and b2
    bool in_place;  // the gate written over its input
    unsigned shared;
};

#include "cases.h"

// `n` weights for sums of `len` terms.
T *weights(long long n, int len) {
    T *w = buffer(n, small);
    const float scale = 6.f / std::sqrt(float(len));
    for (long long i = 0; i < n; ++i) w[i] = st(ld(w[i]) * scale);
    return w;
}

// Image b's gate, by its definition: its hidden values, then each channel's gate.
std::vector<float> definition(const Gate &p, const T *x, const T *w1, const T *b1, const T *w2,
                              const T *b2, int b) {
    std::vector<double> hidden(p.r);
    for (int j = 0; j < p.r; ++j) {
        double h = b1 ? ld(b1[j]) : 0.;
        for (int k = 0; k < p.c; ++k) h += double(ld(x[(long long)b * p.c + k])) * ld(w1[(long long)k * p.r + j]);
        hidden[j] = act(p.act1, float(h), p.p0, p.p1);
    }
    std::vector<float> gate(p.c);
    for (int i = 0; i < p.c; ++i) {
        double sum = b2 ? ld(b2[i]) : 0.;
        for (int j = 0; j < p.r; ++j) sum += hidden[j] * ld(w2[(long long)j * p.c + i]);
        gate[i] = act(p.act2, float(sum), p.q0, p.q1);
    }
    return gate;
}

bool run(const GateCase &c) {
    const Gate &p = c.p;
    emu::device_memory.clear();  // only this case's buffers may be read
    const long long len = (long long)p.n * p.c;
    const T *x = buffer(len, wave);
    const T *w1 = weights((long long)p.c * p.r, p.c);
    const T *w2 = weights((long long)p.r * p.c, p.r);
    const T *b1 = c.biases ? buffer(p.r, small) : nullptr;
    const T *b2 = c.biases ? buffer(p.c, small) : nullptr;
    std::vector<std::vector<float>> wants;
    for (int b = 0; b < p.n; ++b) wants.push_back(definition(p, x, w1, b1, w2, b2, b));
    bool ok = true;
    for (emu::Order order : {emu::Order::Early, emu::Order::Late}) {
        T *y = buffer(len, c.in_place ? wave : nullptr, 64);
        const T *in = c.in_place ? y : x;
        emu::launch({unsigned(p.n), 1, 1}, {GATE_THREADS, 1, 1}, c.shared, order,
                    [&] { se_gate(p, in, w1, b1, w2, b2, y); });
        long long wrong = 0, past = 0;
        double worst = 0;
        for (int b = 0; b < p.n; ++b)
            for (int i = 0; i < p.c; ++i) {
                const float want = wants[b][i];
                const float got = ld(y[(long long)b * p.c + i]);
                // The output's rounding (half a step of fp16, 2^-11 of the value), and the
                // f32 sums' (a lost term of a sum near 1 is 1e-3 or more).
#if defined(HALF)
                const double bound = std::fabs(want) / 2048 + 1e-5;
#else
                const double bound = std::fabs(want) * 1e-6 + 1e-5;
#endif
                const double error = std::fabs(double(got) - want);
                wrong += !(error <= bound);
                worst = std::fmax(worst, error);
            }
        for (long long i = len; i < len + 64; ++i) past += !untouched(&y[i]);
        const bool same = wrong == 0 && past == 0;
        if (!same)
            std::printf("  %s: %lld of %lld outputs differ (worst by %g), %lld written past the end\n",
                        order == emu::Order::Early ? "early" : "late", wrong, len, worst, past);
        ok = ok && same;
    }
    return ok;
}

int main() {
    int differ = 0;
    for (const GateCase &c : GATE_CASES) {
        const bool same = run(c);
        std::printf("%s: %s\n", c.name, same ? "same" : "DIFFERS");
        differ += !same;
    }
    std::printf("emulated: %zu gate cases, %d differ\n", sizeof(GATE_CASES) / sizeof(GATE_CASES[0]),
                differ);
}
