// SPDX-License-Identifier: MPL-2.0
// The own depthwise convolution (depthwise.cu) on the CPU emulator, in fp16 (`HALF`) or f32:
// each case of `cases.h` (written by emulated.rs with the runtime's `depthwise_params` and
// `depthwise_launch`, for a GPU of one SM so that blocks take several slots of pixels in turn)
// runs with its blocks in both orders, and each output must be, to the bit, the convolution's
// definition: each channel's taps, its input's activation applied to each value read (not
// to the padding), summed in f32 tap by tap (the kernel's order, so that inexact values such
// as SiLU's round alike), with the bias and the output's activation, rounded to the plan's
// type; nothing past the output is written. The inputs are multiples of 1/16 and the
// weights of 1/256 and small, so that sums of exact values are exact in any order.
#include "emu.h"
#include "kernels.cu"
#include "harness.h"

struct DepthwiseCase {
    const char *name;
    DepthwiseConv p;
    emu::Dim3 grid;
    unsigned shared;
};

#include "cases.h"

// The definition, one output at a time, with the activations and the bias.
float definition(const DepthwiseConv &p, const T *x, const T *w, const T *bias, long long i) {
    const int ch = i % p.c, ox = i / p.c % p.ow, oy = i / p.c / p.ow % p.oh;
    const int b = i / p.c / p.ow / p.oh;
    float sum = 0;
    for (int ky = 0; ky < p.r; ++ky)
        for (int kx = 0; kx < p.s; ++kx) {
            const int yy = oy * p.sh + ky - p.ph, xx = ox * p.sw + kx - p.pw;
            if (yy < 0 || xx < 0 || yy >= p.h || xx >= p.w) continue;
            const float in = ld(x[(((long long)b * p.h + yy) * p.w + xx) * p.c + ch]);
            sum += act(p.act_in_id, in, p.q0, p.q1) * ld(w[(ch * p.r + ky) * p.s + kx]);
        }
    return act(p.act_id, sum + ld(bias[ch]), p.p0, p.p1);
}

bool run(const DepthwiseCase &c) {
    const DepthwiseConv &p = c.p;
    const long long in = (long long)p.n * p.h * p.w * p.c, out = (long long)p.n * p.oh * p.ow * p.c;
    const T *x = buffer(in, wave);
    const T *w = buffer((long long)p.c * p.r * p.s, small);
    const T *bias = buffer(p.c, small);
    bool ok = true;
    for (emu::Order order : {emu::Order::Early, emu::Order::Late}) {
        T *y = buffer(out, nullptr, 64);
        emu::launch(c.grid, {DW_THREADS, 1, 1}, c.shared, order,
                    [&] { depthwise_conv(p, x, w, bias, y); });
        long long wrong = 0, past = 0;
        for (long long i = 0; i < out; ++i) {
            const T want = st(definition(p, x, w, bias, i));
            wrong += std::memcmp(&y[i], &want, sizeof(T)) != 0;
        }
        for (long long i = out; i < out + 64; ++i) past += !untouched(&y[i]);
        const bool same = wrong == 0 && past == 0;
        if (!same)
            std::printf("  %s: %lld of %lld outputs differ, %lld written past the end\n",
                        order == emu::Order::Early ? "early" : "late", wrong, out, past);
        ok = ok && same;
    }
    return ok;
}

int main() {
    int differ = 0;
    for (const DepthwiseCase &c : DEPTHWISE_CASES) {
        const bool same = run(c);
        std::printf("%s: %s\n", c.name, same ? "same" : "DIFFERS");
        differ += !same;
    }
    std::printf("emulated: %zu depthwise cases, %d differ\n",
                sizeof(DEPTHWISE_CASES) / sizeof(DEPTHWISE_CASES[0]), differ);
}
