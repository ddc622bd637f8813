// SPDX-License-Identifier: MPL-2.0
// The softmax kernels (rows.cu) on the CPU emulator: each case of `cases.h` (written by
// emulated.rs, launched as the runtime launches it), on rows of the plan's type and on f32
// scores, with and without a bias, in place and not, with its blocks in both orders. Its
// output must match the definition, worked in double from the same stored inputs, within
// the storage type's rounding, with nothing written outside the rows.
#include "emu.h"
#include "kernels.cu"

#include <cmath>

enum { SOFTMAX_WARP_KERNEL, SOFTMAX_BLOCK_KERNEL, SOFTMAX_ROWS_KERNEL };
struct SoftmaxCase {
    const char *name;
    int kernel;
    int rows, len;
    unsigned blocks, threads;
};
#include "cases.h"

template <typename V> V *buffer(long long n) {
    V *p = reinterpret_cast<V *>(new Vec16[(n * sizeof(V) + 15) / 16 + 1]);
    emu::device_memory.push_back({reinterpret_cast<unsigned char *>(p), size_t(n * sizeof(V))});
    std::memset(p, 0xff, n * sizeof(V));
    return p;
}
// Values from -4 to 4 (so that most outputs are far from underflow, and a wrong one shows);
// each third row lifted by 1000, which overflows exp without the row's maximum taken off first.
float value(long long i, int len) {
    return float((i * 7919) % 257) / 32.f - 4.f + (i / len % 3 == 2 ? 1000.f : 0.f);
}
float bias_value(long long i) { return float((i * 104729) % 97 - 48) / 32.f; }

template <typename S>
bool run(const SoftmaxCase &c, void (*kernel)(const S *, const T *, S *, int, int),
         S (*to)(float), float (*from)(S), bool with_bias, bool in_place, double tolerance,
         double floor) {
    const long long n = (long long)c.rows * c.len, guard = 64;
    S *x = buffer<S>(n);  // never written: in place runs on a copy
    T *bias = with_bias ? buffer<T>(c.len) : nullptr;
    for (long long i = 0; i < n; ++i) x[i] = to(value(i, c.len));
    for (int i = 0; with_bias && i < c.len; ++i) bias[i] = st(bias_value(i));
    std::vector<double> want(n);
    for (int r = 0; r < c.rows; ++r) {
        double m = -1e300, s = 0;
        std::vector<double> v(c.len);
        for (int i = 0; i < c.len; ++i) {
            v[i] = double(from(x[(long long)r * c.len + i])) + (with_bias ? double(ld(bias[i])) : 0.0);
            m = std::max(m, v[i]);
        }
        for (int i = 0; i < c.len; ++i) s += std::exp(v[i] - m);
        for (int i = 0; i < c.len; ++i) want[(long long)r * c.len + i] = std::exp(v[i] - m) / s;
    }
    bool same = true;
    for (emu::Order order : {emu::Order::Early, emu::Order::Late}) {
        S *y = buffer<S>(n + guard);
        const S *in = x;
        if (in_place) {
            std::memcpy(y, x, n * sizeof(S));
            in = y;
        }
        emu::launch({c.blocks, 1, 1}, {c.threads, 1, 1}, 32 * sizeof(float), order,
                    [&] { kernel(in, bias, y, c.rows, c.len); });
        // Relative to each value, down to where the storage type keeps no digit of it
        // (fp16's smallest subnormal, 6e-8; f32's smallest normal).
        double worst = 0;
        for (long long i = 0; i < n; ++i) {
            const double got = from(y[i]), err = std::fabs(got - want[i]);
            if (!(err <= tolerance * want[i] + floor)) worst = std::max(worst, std::isnan(err) ? 1e30 : err);
        }
        unsigned char sentinel[sizeof(S)];
        std::memset(sentinel, 0xff, sizeof(S));
        bool guarded = true;
        for (long long i = n; i < n + guard; ++i)
            guarded = guarded && std::memcmp(&y[i], sentinel, sizeof(S)) == 0;
        if (worst > 0 || !guarded) {
            std::printf("  %s: largest error %g, %s\n", c.name, worst,
                        guarded ? "nothing written past the rows" : "WROTE PAST THE ROWS");
            same = false;
        }
    }
    return same;
}

// The kernels with one signature: the warp kernel's rows, which the block kernels take
// from the grid.
template <typename S, void (*K)(const S *, const T *, S *, int)>
void by_block(const S *x, const T *b, S *y, int, int len) { K(x, b, y, len); }

float from_t(T v) { return ld(v); }
T to_t(float f) { return st(f); }
float from_f32(float v) { return v; }
float to_f32(float f) { return f; }

int main() {
    int differ = 0, runs = 0;
#ifdef HALF
    const double type_tolerance = 2e-3, type_floor = 6e-8;  // fp16's rounding, 2^-11 relative
#else
    const double type_tolerance = 1e-5, type_floor = 1.2e-38;
#endif
    for (const SoftmaxCase &c : SOFTMAX_CASES) {
        for (bool with_bias : {false, true})
            for (bool in_place : {false, true}) {
                bool same = true;
                switch (c.kernel) {
                case SOFTMAX_WARP_KERNEL:
                    same = run<T>(c, softmax_warp, to_t, from_t, with_bias, in_place, type_tolerance, type_floor) &&
                           run<float>(c, softmax_warp_f32, to_f32, from_f32, with_bias, in_place, 1e-5, 1.2e-38);
                    break;
                case SOFTMAX_BLOCK_KERNEL:
                    same = run<T>(c, by_block<T, softmax_block>, to_t, from_t, with_bias, in_place, type_tolerance, type_floor) &&
                           run<float>(c, by_block<float, softmax_block_f32>, to_f32, from_f32, with_bias, in_place, 1e-5, 1.2e-38);
                    break;
                case SOFTMAX_ROWS_KERNEL:
                    same = run<T>(c, by_block<T, softmax_rows>, to_t, from_t, with_bias, in_place, type_tolerance, type_floor) &&
                           run<float>(c, by_block<float, softmax_rows_f32>, to_f32, from_f32, with_bias, in_place, 1e-5, 1.2e-38);
                    break;
                }
                std::printf("%s%s%s: %s\n", c.name, with_bias ? ", bias" : "", in_place ? ", in place" : "",
                            same ? "within rounding" : "DIFFERS");
                differ += !same;
                ++runs;
            }
    }
    std::printf("emulated: %d softmax runs, %d differ\n", runs, differ);
    return 0;
}
