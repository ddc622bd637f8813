// SPDX-License-Identifier: MPL-2.0
// The own int8 kernels (quant.cu's `conv8_*`) against the way the engine runs an int8 step
// through cuBLASLt (`quantize_patches`, the int8 product, `dequantize_int32`), emulated on the
// CPU (emu.h) and compared to the bit, as the GPU test
// `the_own_int8_kernel_gives_cublaslts_scores_to_the_bit` compares them on a GPU: every way
// (`EightBitKernel::OWN`: block widths, the input rounded as read or by a pass first, warps of
// 64 × 64), the output in the plan's type or in int8, over shapes that leave blocks, chunks and channels partly filled. The product between
// the two passes is summed here in int32, as cuBLASLt sums it. Built and run by the test
// `emulated::the_own_int8_kernels_match_cublaslts_path` with the kernels' source (kernels.cu)
// for fp16 (`-DHALF`) or f32; it prints a line a case and exits 1 where any differ.
#include "emu.h"
#include "kernels.cu"

#include <random>
#include <string>
#include <sys/mman.h>

namespace {

// abi.rs's `divider`.
void divider(unsigned d, unsigned &mul, unsigned &shift) {
    const uint64_t dd = d ? d : 1;
    shift = 0;
    while (shift < 32 && (uint64_t(1) << shift) < dd) ++shift;
    mul = unsigned(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - dd)) / dd + 1);
}

// A device buffer, `offset` bytes past 16-byte alignment, that ends at most 15 bytes (plus
// the offset) before a page the process may not touch: a kernel that reads or writes past its
// end faults. The bytes around it are filled, so that `guards_intact` sees writes just outside.
struct Buffer {
    static constexpr size_t PAGE = 4096, GUARD = 64;
    unsigned char *region;
    size_t region_len, offset, len;
    unsigned char *start;
    Buffer(size_t len, size_t offset = 0, unsigned char fill = 0xcd) : offset(offset), len(len) {
        const size_t pages = (len + offset + GUARD + PAGE - 1) / PAGE + 1;
        region_len = (pages + 1) * PAGE;
        region = static_cast<unsigned char *>(
            mmap(nullptr, region_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
        if (region == MAP_FAILED) emu::fail("mmap");
        unsigned char *end = region + region_len - PAGE;
        if (mprotect(end, PAGE, PROT_NONE)) emu::fail("mprotect");
        std::memset(region, 0xcd, region_len - PAGE);
        start = reinterpret_cast<unsigned char *>(
                    (reinterpret_cast<uintptr_t>(end) - len - offset) / 16 * 16) +
                offset;
        std::memset(start, fill, len);
        emu::device_memory.push_back({start, len});
    }
    ~Buffer() {
        for (size_t i = 0; i < emu::device_memory.size(); ++i)
            if (emu::device_memory[i].start == start) {
                emu::device_memory.erase(emu::device_memory.begin() + i);
                break;
            }
        munmap(region, region_len);
    }
    Buffer(const Buffer &) = delete;
    Buffer &operator=(const Buffer &) = delete;
    unsigned char *data() { return start; }
    template <typename U> U *as() { return reinterpret_cast<U *>(data()); }
    bool guards_intact() {
        const unsigned char *end = region + region_len - PAGE;
        for (const unsigned char *b = start - GUARD; b < start; ++b)
            if (*b != 0xcd) return false;
        for (const unsigned char *b = start + len; b < end; ++b)
            if (*b != 0xcd) return false;
        return true;
    }
};

struct Case {
    std::string name;
    int images, h, w, c, n, kh, kw, ph, pw, sh, sw, dh, dw;
    float alpha;
    int act;
    bool bias, residual, y_int8, misaligned;
    bool zero_pixels = false;  // every third input pixel 0, so that whole sums are 0
    bool copy = false;         // y also written in int8 (`Conv8::y8`), beside the plan's type
    bool zero_y_scale = false;  // the int8 output's scale 0 (all zeros in calibration): 0s
    int oh() const { return (h + 2 * ph - dh * (kh - 1) - 1) / sh + 1; }
    int ow() const { return (w + 2 * pw - dw * (kw - 1) - 1) / sw + 1; }
    long long rows() const { return (long long)images * oh() * ow(); }
    int summed() const { return kh * kw * c; }
    ConvShape shape() const {
        return ConvShape{rows(), h, w, c, oh(), ow(), kh, kw, ph, pw, sh, sw, dh, dw};
    }
    // The input as a 1×1 product over all its pixels (`EightBit::input_shape`).
    ConvShape input_shape() const {
        const int pixels = images * h * w;
        return ConvShape{pixels, 1, pixels, c, 1, pixels, 1, 1, 0, 0, 1, 1, 1, 1};
    }
};

constexpr emu::Order ORDERS[] = {emu::Order::Early, emu::Order::Late};

// `Runtime::round_patches`: x as the patches of `s`, rounded by `scale`.
void round_patches(const ConvShape &s, float scale, const T *x, unsigned char *patches,
                   emu::Order order) {
    Patches p{};
    p.s = s;
    p.scale = scale;
    p.fp8 = 0;
    const unsigned groups = s.c / 8, per_row = s.kh * s.kw * groups;
    const unsigned by[5] = {per_row, groups, unsigned(s.kw), unsigned(s.ow), unsigned(s.oh)};
    for (int j = 0; j < 5; ++j) divider(by[j], p.div_mul[j], p.div_shift[j]);
    p.narrow = 1;
    p.vec = sizeof(T) == 2 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    const long long total = s.rows * per_row;
    const unsigned blocks = unsigned(std::min<long long>((total + 255) / 256, 16));
    emu::launch({blocks}, {256}, 0, order, [&] { quantize_patches(p, x, patches); });
}

// A way of the engine's own kernel (`EightBitKernel::OWN`) as the runtime launches it
// (`OwnLaunch`): WAYS, generated from it.
struct Way {
    const char *name, *kernel;
    int rows, cols, threads;
    size_t shared;
    bool rounded_first;
};
#include "ways.h"

// y (of the plan's type, or int8 by `y_scale`) as the engine's own kernel writes it.
void own(const Case &k, const Way &way, emu::Order order, const T *x, float x_scale,
         const unsigned char *wq, const float *w_scales, const T *bias, const T *z,
         float y_scale, void *y, unsigned char *y8) {
    Buffer rounded(size_t(k.images) * k.h * k.w * k.c);
    const void *input = x;
    if (way.rounded_first) {
        round_patches(k.input_shape(), x_scale, x, rounded.data(), order);
        input = rounded.data();
    }
    Conv8 p{};
    p.s = k.shape();
    p.n = k.n;
    p.summed = k.summed();
    p.x_scale = x_scale;
    p.scale = k.alpha * x_scale;
    p.act_id = k.act;
    p.p0 = 0.f;
    p.p1 = 0.f;
    p.vec = sizeof(T) == 2 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
    p.y_int8 = k.y_int8;
    p.y_scale = k.y_int8 || k.copy ? y_scale : 0.f;
    p.y8 = k.copy ? reinterpret_cast<unsigned long long>(y8) : 0;
    const unsigned row_blocks = unsigned((k.rows() + way.rows - 1) / way.rows);
    const unsigned col_blocks = unsigned((k.n + way.cols - 1) / way.cols);
    const auto *x8 = static_cast<const unsigned char *>(input);
    const auto *xt = static_cast<const T *>(input);
    const std::string kernel = way.kernel;
    emu::launch({row_blocks, col_blocks}, {unsigned(way.threads)}, way.shared, order, [&] {
                    if (kernel == "conv8_wide_256x64")
                        conv8_wide_256x64(p, x8, wq, w_scales, bias, z, y);
                    else if (kernel == "conv8_wide_128x128")
                        conv8_wide_128x128(p, x8, wq, w_scales, bias, z, y);
                    else if (kernel == "conv8_64_int8_input")
                        conv8_64_int8_input(p, x8, wq, w_scales, bias, z, y);
                    else if (kernel == "conv8_64") conv8_64(p, xt, wq, w_scales, bias, z, y);
                    else if (kernel == "conv8_128_int8_input")
                        conv8_128_int8_input(p, x8, wq, w_scales, bias, z, y);
                    else if (kernel == "conv8_128") conv8_128(p, xt, wq, w_scales, bias, z, y);
                    else emu::fail("a way names a kernel the harness does not know");
                });
}

std::mt19937 rng(48);
float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

T to_t(float v) {
#ifdef HALF
    return emu::float_to_half(v);
#else
    return v;
#endif
}

// One case: every way of the own kernel against cuBLASLt's, both orders. Returns how many ways differ.
int run(const Case &k, int &ways) {
    const long long rows = k.rows();
    const size_t inputs = size_t(k.images) * k.h * k.w * k.c, outputs = size_t(rows) * k.n;
    const size_t el = k.misaligned ? sizeof(T) : 0;  // one value off the allocation's alignment
    Buffer x(inputs * sizeof(T), el), wq(size_t(k.n) * k.summed()), w_scales(k.n * 4),
        bias(k.n * sizeof(T)), z(outputs * sizeof(T), el);
    for (size_t i = 0; i < inputs; ++i)
        x.as<T>()[i] = to_t(k.zero_pixels && i / k.c % 3 == 0 ? 0.f : uniform(-4.f, 4.f));
    for (size_t i = 0; i < size_t(k.n) * k.summed(); ++i)
        wq.data()[i] = (unsigned char)(signed char)std::uniform_int_distribution<int>(-127, 127)(rng);
    for (int j = 0; j < k.n; ++j) {
        w_scales.as<float>()[j] = uniform(0.0005f, 0.004f);
        bias.as<T>()[j] = to_t(uniform(-1.f, 1.f));
    }
    for (size_t i = 0; i < outputs; ++i) z.as<T>()[i] = to_t(uniform(-2.f, 2.f));
    const float x_scale = 3.f / 127.f, y_scale = k.zero_y_scale ? 0.f : 2.5f / 127.f;
    const T *bias_p = k.bias ? bias.as<T>() : nullptr;
    const T *z_p = k.residual ? z.as<T>() : nullptr;

    // cuBLASLt's way: patches, the product in int32, the epilogue; then, where the output
    // passes in int8, the next step's rounding of it.
    Buffer patches(size_t(rows) * k.summed()), sums(outputs * 4), ref(outputs * sizeof(T), el);
    round_patches(k.shape(), x_scale, x.as<T>(), patches.data(), emu::Order::Early);
    for (long long r = 0; r < rows; ++r)
        for (int j = 0; j < k.n; ++j) {
            int sum = 0;
            for (int i = 0; i < k.summed(); ++i)
                sum += int8_t(patches.data()[r * k.summed() + i]) *
                       int8_t(wq.data()[size_t(j) * k.summed() + i]);
            sums.as<int>()[r * k.n + j] = sum;
        }
    const long long len = (long long)outputs;
    unsigned n_mul, n_shift;
    divider(k.n, n_mul, n_shift);
    emu::launch({8}, {256}, 0, emu::Order::Early, [&] {
        dequantize_int32(sums.as<int>(), ref.as<T>(), w_scales.as<float>(), bias_p, z_p, len,
                         k.n, n_mul, n_shift, k.alpha * x_scale, k.act, 0.f, 0.f);
    });
    Buffer ref8(outputs);
    if (k.y_int8 || k.copy) {
        const ConvShape s{rows, 1, int(rows), k.n, 1, int(rows), 1, 1, 0, 0, 1, 1, 1, 1};
        round_patches(s, y_scale, ref.as<T>(), ref8.data(), emu::Order::Early);
    }
    const unsigned char *expected = k.y_int8 ? ref8.data() : ref.data();
    const size_t out_bytes = k.y_int8 ? outputs : outputs * sizeof(T);

    int differ = 0;
    for (const Way &way : WAYS)
        for (emu::Order order : ORDERS) {
            Buffer y(out_bytes, k.y_int8 ? (k.misaligned ? 1 : 0) : el), y8(outputs);
            own(k, way, order, x.as<T>(), x_scale, wq.data(), w_scales.as<float>(), bias_p, z_p,
                y_scale, y.data(), y8.data());
            ++ways;
            size_t first = out_bytes;
            for (size_t i = 0; i < out_bytes && first == out_bytes; ++i)
                if (y.data()[i] != expected[i]) first = i;
            // The int8 copy, where there is one, as the readers would round y.
            for (size_t i = 0; k.copy && i < outputs && first == out_bytes; ++i)
                if (y8.data()[i] != ref8.data()[i]) first = out_bytes + i;
            const bool guards = y.guards_intact() && y8.guards_intact();
            if (first != out_bytes || !guards) {
                ++differ;
                std::printf("  DIFFER: %s, copies landing %s: %s\n", way.name,
                            order == emu::Order::Early ? "early" : "late",
                            guards ? ("byte " + std::to_string(first)).c_str()
                                   : "written out of bounds");
            }
        }
    return differ;
}

}  // namespace

int main() {
    // name, images, h, w, c, n, kh, kw, ph, pw, sh, sw, dh, dw, alpha, act, bias, residual,
    // y_int8, misaligned, zero_pixels, copy
    const Case cases[] = {
        {"3x3 32->24, pad 1, 2 images of 9x9", 2, 9, 9, 32, 24, 3, 3, 1, 1, 1, 1, 1, 1, 1.f,
         ACT_RELU, true, false, false, false},
        {"3x3 16->72 stride 2, residual, int8 out", 1, 11, 11, 16, 72, 3, 3, 1, 1, 2, 2, 1, 1,
         1.f, ACT_NONE, true, true, true, false},
        {"1x1 80->136 (a chunk and a block partly filled), silu", 3, 7, 6, 80, 136, 1, 1, 0, 0,
         1, 1, 1, 1, 1.f, ACT_SILU, true, false, false, false},
        {"product 200x192 by 40, alpha 0.7, no bias, residual", 1, 1, 200, 192, 40, 1, 1, 0, 0,
         1, 1, 1, 1, 0.7f, ACT_NONE, false, true, false, false},
        {"5x3 dilated 2, pads 2 and 1, 48->16, hard swish", 2, 8, 7, 48, 16, 5, 3, 2, 1, 1, 1,
         2, 2, 1.f, ACT_HARD_SWISH, true, false, false, false},
        {"7x7 stride 2 stem 16->64, relu, int8 out", 1, 20, 18, 16, 64, 7, 7, 3, 3, 2, 2, 1, 1,
         1.f, ACT_RELU, true, false, true, false},
        {"1x1 512->64, many chunks, residual, relu, an int8 copy", 1, 13, 10, 512, 64, 1, 1, 0,
         0, 1, 1, 1, 1, 1.f, ACT_RELU, true, true, false, false, false, true},
        {"3x3 32->40, misaligned input, residual and output, an int8 copy", 1, 6, 23, 32, 40, 3,
         3, 1, 1, 1, 1, 1, 1, 1.f, ACT_RELU, true, true, false, true, false, true},
        {"3x3 96->128, pad 1 (chunks across taps), residual, int8 out", 1, 10, 10, 96, 128, 3,
         3, 1, 1, 1, 1, 1, 1, 1.f, ACT_RELU, true, true, true, false},
        {"1x1 32->48, alpha -1.5, no bias: sums of 0 give -0", 1, 5, 30, 32, 48, 1, 1, 0, 0, 1,
         1, 1, 1, -1.5f, ACT_NONE, false, false, false, false, true},
        {"1x1 16->136, 24x24 (several blocks of 256 rows), residual", 1, 24, 24, 16, 136, 1, 1,
         0, 0, 1, 1, 1, 1, 1.f, ACT_RELU, true, true, false, false},
        {"3x3 48->72, int8 out at a scale of 0", 1, 7, 9, 48, 72, 3, 3, 1, 1, 1,
         1, 1, 1, 1.f, ACT_NONE, true, false, true, false, false, false, true},
        {"1x1 32->40, residual, an int8 copy at a scale of 0", 2, 5, 7, 32, 40, 1, 1, 0, 0, 1,
         1, 1, 1, 1.f, ACT_RELU, true, true, false, false, false, true, true},
        {"1x1 64->56, misaligned int8 output", 1, 9, 15, 64, 56, 1, 1, 0, 0, 1, 1, 1, 1, 1.f,
         ACT_NONE, true, false, true, true},
    };
    int ways = 0, differ = 0;
    for (const Case &k : cases) {
        const int before = ways;
        const int d = run(k, ways);
        std::printf("%s: %d ways, %d differ\n", k.name.c_str(), ways - before, d);
        differ += d;
    }
    std::printf("emulated: %zu cases, %d ways, %d differ\n", sizeof cases / sizeof cases[0],
                ways, differ);
    return differ ? 1 : 0;
}
