// SPDX-License-Identifier: MPL-2.0
// A CPU emulator of the CUDA the int8, element-wise, pooling, softmax, stem and attention
// kernels use, for their tests where there is no GPU: the kernels' own source compiled as C++
// (`TRTCLASSIFY_EMULATOR`: prelude.cu and quant.cu then call the functions here in place of
// their PTX), each thread a fiber (ucontext), switched only where threads wait for each
// other: `__syncthreads`; the warp-wide instructions (`ldmatrix`, `mma.sync`, `shfl.sync`),
// which gather their 32 lanes' operands and give each lane its part of the result as the
// PTX ISA defines it. The blocks of a tile (those that differ only in z) run side by side,
// each with its shared memory, taking turns in alternating order; the tiles one after
// another. Within a block a warp runs as far as it goes before the next, so a barrier
// missing between warps shows; and two blocks that store the same output fail. cp.async
// copies land either as they are issued (`Order::Early`, which exposes a stage overwritten
// while warps still read it) or as late as the kernel may wait for them (`Order::Late`, which
// exposes a read before the wait); blocks and warps run the other way round in each, and
// every shared memory access is checked to fall in what the launch gave.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>
#include <ucontext.h>

#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

namespace emu {

struct Dim3 {
    unsigned x = 1, y = 1, z = 1;
};

enum class Order { Early, Late };

[[noreturn]] inline void fail(const char *what) {
    std::fprintf(stderr, "emulator: %s\n", what);
    std::abort();
}

constexpr size_t SHARED_MAX = 256 * 1024;
constexpr size_t STACK = 128 * 1024;

// The device memory the kernels may read (registered by the harness's buffers): a cp.async
// from anywhere else is a read out of bounds.
struct Range {
    const unsigned char *start;
    size_t len;
};
inline std::vector<Range> device_memory;

inline void check_global(const void *p, size_t bytes) {
    auto at = static_cast<const unsigned char *>(p);
    for (const Range &r : device_memory)
        if (at >= r.start && at + bytes <= r.start + r.len) return;
    fail("cp.async reads outside device memory");
}

struct Copy {
    void *dst;
    const void *src;
    bool valid;
};

inline void land(const Copy &c) {
    if (c.valid) std::memcpy(c.dst, c.src, 16);
    else std::memset(c.dst, 0, 16);
}

struct Thread {
    ucontext_t ctx;
    Dim3 idx;
    unsigned block;  // of the tile's blocks
    bool done = false;
    std::vector<Copy> open;                  // cp.async copies not yet committed
    std::vector<std::vector<Copy>> pending;  // committed groups, oldest first
};

// What a warp's lanes pass each other at a warp-wide instruction, two sets by turns: a lane
// fills the next set only once every lane has read this one.
struct Lane {
    int op;
    const void *addr;
    unsigned a[4], b[2];
    int c[4];
    unsigned out[4];  // the lane's result, worked out as the last lane arrives
};
struct Warp {
    unsigned arrived = 0, turn = 0;
    Lane lanes[2][32];
};

// A block running: its index, its barrier, its warps and its shared memory.
struct Block {
    Dim3 idx;
    unsigned arrived = 0, turn = 0;
    std::vector<Warp> warps;
    std::unique_ptr<unsigned char[]> shared;  // 16-byte aligned (new[]), as the kernels need
};

struct State {
    Dim3 grid, block;
    size_t shared_given = 0;  // the launch's dynamic shared memory
    Order order = Order::Early;
    std::vector<Block> blocks;  // the tile's
    std::vector<Thread> threads;
    std::vector<std::unique_ptr<char[]>> stacks;
    Thread *current = nullptr;
    ucontext_t scheduler;
    unsigned long progress = 0;  // arrivals, so that a round without any is a deadlock
    const std::function<void()> *body = nullptr;
    // The outputs stored during the launch, and by which block (`wrote`: its tile and z).
    std::unordered_map<const void *, unsigned long> written;
};
inline State state;

inline void yield() { swapcontext(&state.current->ctx, &state.scheduler); }

inline unsigned threads_per_block() { return state.block.x * state.block.y * state.block.z; }
inline unsigned thread_index(const Thread *t) {
    return unsigned(t - state.threads.data()) % threads_per_block();
}
inline Block &current_block() { return state.blocks[state.current->block]; }

// The current block's dynamic shared memory.
inline unsigned char *block_shared() { return current_block().shared.get(); }

inline void check_shared(const void *p, size_t bytes, size_t align) {
    auto at = reinterpret_cast<const unsigned char *>(p);
    const unsigned char *shared = block_shared();
    if (at < shared || at + bytes > shared + state.shared_given)
        fail("shared memory out of bounds");
    if (reinterpret_cast<uintptr_t>(p) % align) fail("misaligned shared memory access");
}

inline void start() {
    (*state.body)();
    Thread &t = *state.current;
    // Copies still in flight at exit land (the hardware completes them).
    for (auto &g : t.pending)
        for (auto &c : g) land(c);
    for (auto &c : t.open) land(c);
    t.done = true;
    swapcontext(&t.ctx, &state.scheduler);
}

// `body` run by every thread of every block of `grid` × `block`, with `shared_bytes` of
// dynamic shared memory.
inline void launch(Dim3 grid, Dim3 block, size_t shared_bytes, Order order,
                   const std::function<void()> &body) {
    if (shared_bytes > SHARED_MAX) fail("more shared memory than the emulator has");
    const unsigned n = block.x * block.y * block.z, side = grid.z;
    state.grid = grid;
    state.block = block;
    state.order = order;
    state.body = &body;
    state.shared_given = shared_bytes;
    state.written.clear();
    state.blocks.clear();
    state.blocks.resize(side);
    for (Block &b : state.blocks) b.shared.reset(new unsigned char[shared_bytes + 16]);
    state.threads.assign(size_t(n) * side, Thread{});
    while (state.stacks.size() < state.threads.size())
        state.stacks.emplace_back(new char[STACK]);
    const bool early = order == Order::Early;
    const unsigned tiles = grid.x * grid.y;
    for (unsigned k = 0; k < tiles; ++k) {
        // In order for `Early`, the other way for `Late`.
        const unsigned tile = early ? k : tiles - 1 - k;
        for (unsigned z = 0; z < side; ++z) {
            Block &b = state.blocks[z];
            b.idx = {tile % grid.x, tile / grid.x, z};
            b.arrived = b.turn = 0;
            b.warps.assign((n + 31) / 32, Warp{});
            // Garbage, as the hardware's is: a kernel must not read what it did not write.
            std::memset(b.shared.get(), 0xa5, shared_bytes);
        }
        for (unsigned i = 0; i < n * side; ++i) {
            Thread &t = state.threads[i];
            t = Thread{};
            const unsigned j = i % n;
            t.block = i / n;
            t.idx = {j % block.x, j / block.x % block.y, j / (block.x * block.y)};
            getcontext(&t.ctx);
            t.ctx.uc_stack.ss_sp = state.stacks[i].get();
            t.ctx.uc_stack.ss_size = STACK;
            t.ctx.uc_link = nullptr;
            makecontext(&t.ctx, start, 0);
        }
        for (unsigned round = 0;; ++round) {
            bool all_done = true;
            const unsigned long before = state.progress;
            // The tile's blocks in turn, in alternating order from round to round (so that
            // the block that reaches a point last goes on first); in each, a warp at a time
            // as far as it goes (to a barrier of the block, or its end) before the next.
            const bool forward = early == (round % 2 == 0);
            const unsigned warps = (n + 31) / 32;
            for (unsigned kb = 0; kb < side; ++kb) {
                const unsigned bz = forward ? kb : side - 1 - kb;
                for (unsigned kw = 0; kw < warps; ++kw) {
                    const unsigned w = early ? kw : warps - 1 - kw;
                    for (unsigned long went = ~0ul; went != state.progress;) {
                        went = state.progress;
                        for (unsigned i = 32 * w; i < 32 * w + 32 && i < n; ++i) {
                            Thread &t = state.threads[bz * n + i];
                            if (t.done) continue;
                            all_done = false;
                            state.current = &t;
                            swapcontext(&state.scheduler, &t.ctx);
                            if (t.done) ++state.progress;
                        }
                    }
                }
            }
            if (all_done) break;
            if (state.progress == before) fail("deadlock: every thread waits");
        }
    }
    state.current = nullptr;
}

// Where two blocks of a launch store the same output (tiles that overlap): an error.
inline void wrote(const void *p) {
    const Dim3 b = current_block().idx;
    const unsigned long block = (b.z * state.grid.y + b.y) * (unsigned long)state.grid.x + b.x;
    const auto [at, added] = state.written.emplace(p, block);
    if (!added && at->second != block) fail("two blocks of a launch write the same output");
}

// Waits for every thread of the block (threads that have returned count as arrived).
inline void syncthreads() {
    Block &b = current_block();
    const unsigned turn = b.turn, n = threads_per_block();
    unsigned live = 0;
    for (unsigned i = 0; i < n; ++i) live += !state.threads[state.current->block * n + i].done;
    ++state.progress;
    if (++b.arrived == live) {
        b.arrived = 0;
        ++b.turn;
        return;
    }
    while (b.turn == turn) yield();
}

// This thread gives `mine` to its warp's instruction and waits for the other 31 lanes; the
// last to arrive works out every lane's result (`finish`, from all lanes' operands and, for
// ldmatrix, shared memory as it is at that moment, as the instruction reads it at once).
// Returns this lane's.
template <typename Finish>
inline const Lane &warp_exchange(const Lane &mine, Finish finish) {
    const unsigned i = thread_index(state.current);
    Warp &w = current_block().warps[i / 32];
    const unsigned turn = w.turn;
    Lane *set = w.lanes[turn & 1];
    set[i % 32] = mine;
    ++state.progress;
    if (++w.arrived == 32) {
        for (int l = 0; l < 32; ++l)
            if (set[l].op != mine.op) fail("lanes of a warp diverge at a warp-wide instruction");
        for (int l = 0; l < 32; ++l) finish(set, l, set[l].out);
        w.arrived = 0;
        ++w.turn;
    } else {
        while (w.turn == turn) yield();
    }
    return set[i % 32];
}

// fp16 as the GPU converts it (cvt.f32.f16; cvt.rn.f16.f32: to nearest even).
inline float half_to_float(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return float(v);
}
inline unsigned short float_to_half(float f) {
    const _Float16 v = _Float16(f);
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}

inline unsigned lane_id() { return thread_index(state.current) % 32; }

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8j to 8j + 7 give the rows of matrix j;
// lane l gets, of each matrix, row l / 4's bytes 4·(l % 4) to 4·(l % 4) + 3.
inline void ldmatrix_x4(unsigned (&d)[4], const void *smem) {
    check_shared(smem, 16, 16);
    Lane mine{};
    mine.op = 1;
    mine.addr = smem;
    const Lane &done = warp_exchange(mine, [](const Lane *set, int l, unsigned (&out)[4]) {
        for (int j = 0; j < 4; ++j)
            std::memcpy(&out[j],
                        static_cast<const unsigned char *>(set[8 * j + l / 4].addr) + 4 * (l % 4), 4);
    });
    std::memcpy(d, done.out, sizeof d);
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lanes 8j to 8j + 7 give the rows of matrix
// j; lane l gets, of each matrix, the 16-bit values of column l / 4 in rows 2·(l % 4) and
// 2·(l % 4) + 1.
inline void ldmatrix_x4_trans(unsigned (&d)[4], const void *smem) {
    check_shared(smem, 16, 16);
    Lane mine{};
    mine.op = 5;
    mine.addr = smem;
    const Lane &done = warp_exchange(mine, [](const Lane *set, int l, unsigned (&out)[4]) {
        for (int j = 0; j < 4; ++j) {
            unsigned short lo, hi;
            const int r = 2 * (l % 4), c = l / 4;
            std::memcpy(&lo, static_cast<const unsigned char *>(set[8 * j + r].addr) + 2 * c, 2);
            std::memcpy(&hi, static_cast<const unsigned char *>(set[8 * j + r + 1].addr) + 2 * c, 2);
            out[j] = unsigned(lo) | unsigned(hi) << 16;
        }
    });
    std::memcpy(d, done.out, sizeof d);
}

// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32: d = a · b + c, as the PTX ISA lays the
// fragments out (groupID g = lane / 4, t = lane % 4): a's registers hold A[g][4t..],
// A[g + 8][4t..], A[g][16 + 4t..], A[g + 8][16 + 4t..]; b's B[4t..][g] and B[16 + 4t..][g];
// c's and d's C[g][2t], C[g][2t + 1], C[g + 8][2t], C[g + 8][2t + 1].
inline void mma_m16n8k32_s8(int (&acc)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    Lane mine{};
    mine.op = 2;
    std::memcpy(mine.a, a, sizeof mine.a);
    mine.b[0] = b0;
    mine.b[1] = b1;
    std::memcpy(mine.c, acc, sizeof mine.c);
    const Lane &done = warp_exchange(mine, [](const Lane *set, int l, unsigned (&out)[4]) {
        auto byte = [](unsigned r, int k) { return int8_t(r >> (8 * k) & 0xff); };
        const int g = l / 4, t = l % 4;
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
            // A[row][k] and B[k][col], k < 32, from the lanes that hold them.
            int64_t sum = set[l].c[i];
            for (int k = 0; k < 32; ++k) {
                const int kg = k % 16 / 4, kb = k % 4, hi = k / 16;
                const Lane &a = set[4 * (row % 8) + kg], &b = set[4 * col + kg];
                const int8_t av = byte(a.a[2 * hi + row / 8], kb), bv = byte(b.b[hi], kb);
                sum += int(av) * int(bv);
            }
            out[i] = uint32_t(sum);  // s32 wraps, without .satfinite
        }
    });
    std::memcpy(acc, done.out, 4 * sizeof *acc);
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: d = a · b + c, fp16 values into f32
// sums (groupID g = lane / 4, t = lane % 4): a's registers hold A[g][2t..], A[g + 8][2t..],
// A[g][8 + 2t..], A[g + 8][8 + 2t..]; b's B[2t..][g] and B[8 + 2t..][g]; c's and d's as
// m16n8k32's. The products are exact in f32 and added in k's order: the tensor cores' own
// order and rounding of the sum are not the PTX ISA's to say, so a test allows for them.
inline void mma_m16n8k16_f16(float *acc, const unsigned *a, unsigned b0, unsigned b1) {
    Lane mine{};
    mine.op = 3;
    std::memcpy(mine.a, a, sizeof mine.a);
    mine.b[0] = b0;
    mine.b[1] = b1;
    std::memcpy(mine.c, acc, sizeof mine.c);
    const Lane &done = warp_exchange(mine, [](const Lane *set, int l, unsigned (&out)[4]) {
        auto half = [](unsigned r, int k) { return half_to_float((unsigned short)(r >> (16 * k))); };
        const int g = l / 4, t = l % 4;
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
            float sum;
            std::memcpy(&sum, &set[l].c[i], 4);
            for (int k = 0; k < 16; ++k) {
                // A[row][k] and B[k][col], from the lanes that hold them.
                const int kt = k % 8 / 2, kh = k % 2, hi = k / 8;
                const Lane &av = set[4 * (row % 8) + kt], &bv = set[4 * col + kt];
                sum += half(av.a[2 * hi + row / 8], kh) * half(bv.b[hi], kh);
            }
            std::memcpy(&out[i], &sum, 4);
        }
    });
    std::memcpy(acc, done.out, 4 * sizeof *acc);
}

// shfl.sync.bfly.b32 over the whole warp: lane l gets lane (l ^ lane_mask)'s value.
inline float shfl_xor(float v, int lane_mask) {
    Lane mine{};
    mine.op = 4;
    std::memcpy(&mine.a[0], &v, 4);
    mine.b[0] = unsigned(lane_mask);
    const Lane &done = warp_exchange(mine, [](const Lane *set, int l, unsigned (&out)[4]) {
        if (set[l].b[0] != set[0].b[0]) fail("lanes of a warp shuffle by different masks");
        out[0] = set[(l ^ set[l].b[0]) % 32].a[0];
    });
    float r;
    std::memcpy(&r, &done.out[0], 4);
    return r;
}

// shfl.sync.idx.b32 over the whole warp: each lane gets lane `src`'s value.
inline float shfl_idx(float v, int src) {
    Lane mine{};
    mine.op = 6;
    std::memcpy(&mine.a[0], &v, 4);
    mine.b[0] = unsigned(src);
    const Lane &done = warp_exchange(mine, [](const Lane *set, int l, unsigned (&out)[4]) {
        out[0] = set[set[l].b[0] % 32].a[0];
    });
    float r;
    std::memcpy(&r, &done.out[0], 4);
    return r;
}

// cp.async.cg.shared.global, 16 bytes (zeros where !valid).
inline void cp_async16(void *dst, const void *src, bool valid) {
    check_shared(dst, 16, 16);
    if (valid && reinterpret_cast<uintptr_t>(src) % 16) fail("misaligned cp.async source");
    if (valid) check_global(src, 16);
    const Copy c{dst, src, valid};
    if (state.order == Order::Early) land(c);
    else state.current->open.push_back(c);
}

inline void cp_async_commit() {
    auto &t = *state.current;
    t.pending.push_back(std::move(t.open));
    t.open.clear();
}

inline void cp_async_wait(int n) {
    auto &t = *state.current;
    while (t.pending.size() > size_t(n)) {
        for (auto &c : t.pending.front()) land(c);
        t.pending.erase(t.pending.begin());
    }
}

}  // namespace emu

#define threadIdx (emu::state.current->idx)
#define blockIdx (emu::current_block().idx)
#define blockDim (emu::state.block)
#define gridDim (emu::state.grid)
#define __syncthreads() emu::syncthreads()

// CUDA's vector types, as much of them as the kernels use.
struct alignas(8) uint2 {
    unsigned x, y;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
struct alignas(8) int2 {
    int x, y;
};
inline int2 make_int2(int x, int y) { return int2{x, y}; }
struct alignas(16) int4 {
    int x, y, z, w;
};


inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }
// CUDA's integer min and max.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
// Only whole warps shuffle here (the kernels' mask is every lane).
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
    if (mask != 0xffffffffu) emu::fail("a shuffle of part of a warp");
    return emu::shfl_xor(v, lane_mask);
}
inline float __shfl_sync(unsigned mask, float v, int src) {
    if (mask != 0xffffffffu) emu::fail("a shuffle of part of a warp");
    return emu::shfl_idx(v, src);
}
inline unsigned __cvta_generic_to_shared(const void *p) {
    return unsigned(static_cast<const unsigned char *>(p) - emu::block_shared());
}

