// SPDX-License-Identifier: MPL-2.0
// The element-wise and pooling kernels (elementwise.cu, pool.cu) on the CPU emulator: each
// case of `cases.h` (written by emulated.rs, launched as the runtime launches it) runs with
// its blocks in both orders, and its output must be, to the bit, what the kernel's
// definition gives element by element, with nothing written outside it.
#include "emu.h"
#include "kernels.cu"

struct EwCase {
    const char *name;
    int kernel;  // EW_*
    Ew p;
    unsigned blocks;
    long long out_len, a_len, b_len;
};
struct PoolCase {
    const char *name;
    bool vec;
    Pool p;
    unsigned blocks;
};
enum { EW_T, EW_FROM_F32, EW_TO_F32, EW_F32, EW_VEC };

inline float from_bits(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

#include "cases.h"

// 16-byte aligned storage for `n` values of type V, each `fill(i)` (bytes 0xff where none).
template <typename V> V *buffer(long long n, float (*fill)(long long), V (*to)(float)) {
    V *p = reinterpret_cast<V *>(new Vec16[(n * sizeof(V) + 15) / 16 + 1]);
    emu::device_memory.push_back({reinterpret_cast<unsigned char *>(p), size_t(n * sizeof(V))});
    for (long long i = 0; i < n; ++i) {
        if (fill) p[i] = to(fill(i));
        else std::memset(&p[i], 0xff, sizeof(V));
    }
    return p;
}
float wave(long long i) { return float((i * 7919) % 97 - 48) * 0.0625f; }
float wave2(long long i) { return float((i * 104729) % 89 - 44) * 0.03125f; }

// The definition: each element of the step's dimensions on its own.
template <typename O, typename A>
void ew_definition(const Ew &p, O *out, const A *a, const T *b, float (*lda)(A), O (*sto)(float)) {
    for (long long e = 0; e < p.n; ++e) {
        long long rest = e, o = 0, ia = 0, ib = 0;
        for (int d = p.rank - 1; d >= 0; --d) {
            const long long at = rest % p.dims[d];
            rest /= p.dims[d];
            o += at * p.so[d];
            ia += at * p.sa[d];
            ib += at * p.sb[d];
        }
        float v = lda(a[ia]);
        if (p.op >= 0) v = binop(p.op, v, ld(b[ib]));
        out[o] = sto(act(p.act, v, p.p0, p.p1));
    }
}

template <typename O, typename A>
bool run_ew(const EwCase &c, void (*kernel)(const Ew, O *, const A *, const T *),
            float (*lda)(A), O (*sto)(float), A (*sta)(float)) {
    const A *a = buffer<A>(c.a_len, wave, sta);
    const T *b = buffer<T>(c.b_len, wave2, st_t);
    O *want = buffer<O>(c.out_len, nullptr, sto);
    ew_definition(c.p, want, a, b, lda, sto);
    bool same = true;
    for (emu::Order order : {emu::Order::Early, emu::Order::Late}) {
        O *out = buffer<O>(c.out_len, nullptr, sto);
        emu::launch({c.blocks, 1, 1}, {256, 1, 1}, 0, order, [&] { kernel(c.p, out, a, b); });
        same = same && std::memcmp(out, want, c.out_len * sizeof(O)) == 0;
    }
    return same;
}

// The definition: each output of the window on its own.
void pool_definition(const Pool &p, const T *x, T *y) {
    for (long long i = 0; i < (long long)p.n * p.oh * p.ow * p.c; ++i) {
        const int ch = i % p.c, ox = i / p.c % p.ow, oy = i / p.c / p.ow % p.oh;
        const int b = i / p.c / p.ow / p.oh;
        float acc = 0.f, best = -3.402823466e38f;
        int count = 0, padded = 0;
        for (int ky = 0; ky < p.kh; ++ky)
            for (int kx = 0; kx < p.kw; ++kx) {
                const int yy = oy * p.sh + ky - p.pt, xx = ox * p.sw + kx - p.pl;
                if (yy < 0 || xx < 0 || yy >= p.h || xx >= p.w) {
                    padded += yy < p.h + p.pb && xx < p.w + p.pr;
                    continue;
                }
                const float v = ld(x[(((long long)b * p.h + yy) * p.w + xx) * p.c + ch]);
                acc += v;
                best = std::fmax(best, v);
                ++count;
            }
        y[i] = st(p.max ? best : acc / (float)(p.include_pad ? count + padded : count));
    }
}

bool run_pool(const PoolCase &c) {
    const long long in = (long long)c.p.n * c.p.h * c.p.w * c.p.c;
    const long long out_len = (long long)c.p.n * c.p.oh * c.p.ow * c.p.c;
    const T *x = buffer<T>(in, wave, st_t);
    T *want = buffer<T>(out_len, nullptr, st_t);
    pool_definition(c.p, x, want);
    bool same = true;
    for (emu::Order order : {emu::Order::Early, emu::Order::Late}) {
        T *y = buffer<T>(out_len, nullptr, st_t);
        emu::launch({c.blocks, 1, 1}, {256, 1, 1}, 0, order, [&] {
            if (c.vec) pool_nhwc_vec(c.p, x, y);
            else pool_nhwc(c.p, x, y);
        });
        same = same && std::memcmp(y, want, out_len * sizeof(T)) == 0;
    }
    return same;
}

int main() {
    int differ = 0;
    for (const EwCase &c : EW_CASES) {
        bool same = false;
        switch (c.kernel) {
        case EW_T: same = run_ew<T, T>(c, ew, ld_t, st_t, st_t); break;
        case EW_FROM_F32: same = run_ew<T, float>(c, ew_from_f32, ld_f32, st_t, st_f32); break;
        case EW_TO_F32: same = run_ew<float, T>(c, ew_to_f32, ld_t, st_f32, st_t); break;
        case EW_F32: same = run_ew<float, float>(c, ew_f32, ld_f32, st_f32, st_f32); break;
        case EW_VEC: same = run_ew<T, T>(c, ew_vec, ld_t, st_t, st_t); break;
        }
        std::printf("%s: %s\n", c.name, same ? "same" : "DIFFERS");
        differ += !same;
    }
    for (const PoolCase &c : POOL_CASES) {
        const bool same = run_pool(c);
        std::printf("%s: %s\n", c.name, same ? "same" : "DIFFERS");
        differ += !same;
    }
    std::printf("emulated: %zu element-wise and %zu pooling cases, %d differ\n",
                sizeof(EW_CASES) / sizeof(EW_CASES[0]), sizeof(POOL_CASES) / sizeof(POOL_CASES[0]),
                differ);
    return 0;
}
