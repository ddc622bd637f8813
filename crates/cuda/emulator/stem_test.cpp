// SPDX-License-Identifier: MPL-2.0
// The own stem convolution (stem.cu) on the CPU emulator, fp16: each case of `cases.h`
// (written by emulated.rs with the runtime's `stem_params`, on fewer blocks than tiles so
// that blocks take several tiles in turn) runs with its blocks in both orders, and each
// output must be, to the bit, the convolution's definition: the same fp16 values summed,
// with the bias and activation, rounded to fp16; nothing past the output is written. The
// inputs are multiples of 1/16 and the weights of 1/256 and small, so that every sum is exact
// in f32 whatever its order: a difference is the kernel's, not the rounding's.
#include "emu.h"
#include "kernels.cu"
#include "harness.h"

struct StemCase {
    const char *name;
    StemConv p;
    unsigned blocks;
    unsigned shared;
};

#include "cases.h"

// The definition, one output at a time, summed in double, with the bias and activation.
float definition(const StemConv &p, const T *x, const T *w, const T *bias, long long i) {
    const int ch = i % p.k, ox = i / p.k % p.ow, oy = i / p.k / p.ow % p.oh;
    const int b = i / p.k / p.ow / p.oh;
    double sum = 0;
    for (int ky = 0; ky < p.r; ++ky)
        for (int kx = 0; kx < p.s; ++kx) {
            const int yy = oy * p.sh + ky - p.ph, xx = ox * p.sw + kx - p.pw;
            if (yy < 0 || xx < 0 || yy >= p.h || xx >= p.w) continue;
            for (int c = 0; c < p.c; ++c)
                sum += double(ld(x[(((long long)b * p.h + yy) * p.w + xx) * p.c + c])) *
                       ld(w[((ch * p.r + ky) * p.s + kx) * p.c + c]);
        }
    return act(p.act_id, float(sum + ld(bias[ch])), p.p0, p.p1);
}

bool run(const StemCase &c) {
    const StemConv &p = c.p;
    const long long in = (long long)p.n * p.h * p.w * p.c, out = (long long)p.n * p.oh * p.ow * p.k;
    const T *x = buffer(in, wave);
    const T *w = buffer((long long)p.k * p.r * p.s * p.c, small);
    const T *bias = buffer(p.k, small);
    bool ok = true;
    for (emu::Order order : {emu::Order::Early, emu::Order::Late}) {
        T *y = buffer(out, nullptr, 64);
        emu::launch({c.blocks, 1, 1}, {STEM_THREADS, 1, 1}, c.shared, order, [&] {
            if (p.k % 64 == 0) stem_conv64(p, x, w, bias, y);
            else stem_conv32(p, x, w, bias, y);
        });
        long long wrong = 0, past = 0;
        for (long long i = 0; i < out; ++i) wrong += y[i] != st(definition(p, x, w, bias, i));
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
    for (const StemCase &c : STEM_CASES) {
        const bool same = run(c);
        std::printf("%s: %s\n", c.name, same ? "same" : "DIFFERS");
        differ += !same;
    }
    std::printf("emulated: %zu stem cases, %d differ\n", sizeof(STEM_CASES) / sizeof(STEM_CASES[0]),
                differ);
}
