// SPDX-License-Identifier: MPL-2.0
// Microbenchmarks (run.sh builds and runs them): (1) does the spread of loaded code in GPU
// memory slow a graph of small kernels (the engine's two batch-1 states)? (2) the scores'
// softmax with its bias, each way of running it as a kernel.
#include <cuda.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>
#define CK(x) do { CUresult r_ = (x); if (r_) { const char *s_; cuGetErrorString(r_, &s_); \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); exit(1); } } while (0)

static std::vector<char> readf(const char *p) {
    std::ifstream f(p, std::ios::binary);
    std::vector<char> v((std::istreambuf_iterator<char>(f)), {});
    if (v.empty()) { fprintf(stderr, "cannot read %s\n", p); exit(1); }
    return v;
}
static CUstream s;
// Median over 15 rounds of 40 replays, in µs a replay.
static double time_graph(const std::function<void()> &launches) {
    CUgraph g; CUgraphExec ge;
    CK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    launches();
    CK(cuStreamEndCapture(s, &g));
    CK(cuGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 50; ++i) CK(cuGraphLaunch(ge, s));
    CUevent a, b; CK(cuEventCreate(&a, 0)); CK(cuEventCreate(&b, 0));
    std::vector<double> t;
    for (int r = 0; r < 15; ++r) {
        CK(cuEventRecord(a, s));
        for (int i = 0; i < 40; ++i) CK(cuGraphLaunch(ge, s));
        CK(cuEventRecord(b, s)); CK(cuEventSynchronize(b));
        float ms; CK(cuEventElapsedTime(&ms, a, b)); t.push_back(ms * 1000.0 / 40);
    }
    std::sort(t.begin(), t.end());
    CK(cuEventDestroy(a)); CK(cuEventDestroy(b));
    CK(cuGraphExecDestroy(ge)); CK(cuGraphDestroy(g));
    return t[t.size() / 2];
}
static std::vector<std::string> hot_names() {
    std::vector<std::string> n;
    for (int b = 1; b <= 8; ++b) for (int k = 0; k < 8; ++k) n.push_back("hot_" + std::to_string(b * 10 + k));
    return n;
}
static std::vector<std::string> pad_names() {
    std::vector<std::string> n;
    for (int a = 1; a <= 4; ++a) for (int b = 1; b <= 8; ++b) for (int k = 0; k < 8; ++k)
        n.push_back("pad_" + std::to_string(a * 100 + b * 10 + k));
    return n;
}
static CUfunction get(CUmodule m, const std::string &name) {
    CUfunction f; CK(cuModuleGetFunction(&f, m, name.c_str())); CK(cuFuncLoad(f)); return f;
}
static void load_pad(const std::vector<char> &pad) {
    CUmodule m; CK(cuModuleLoadData(&m, pad.data()));
    for (auto &n : pad_names()) get(m, n);
}

int main(int argc, char **argv) {
    CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    std::string what = argc > 1 ? argv[1] : "";
    if (what == "spread") {
        // spread PADS: PADS modules of pad.cu (3.4 MB of code each) loaded before each hot
        // kernel's own module; PADS -1: the 64 hot kernels from one module.
        int pads = atoi(argv[2]);
        auto hot = readf("hot.cubin"), pad = readf("pad.cubin");
        auto names = hot_names();
        std::vector<CUfunction> f;
        if (pads < 0) {  // all in one module
            CUmodule m; CK(cuModuleLoadData(&m, hot.data()));
            for (auto &n : names) f.push_back(get(m, n));
        } else {
            for (auto &n : names) {
                for (int p = 0; p < pads; ++p) load_pad(pad);
                CUmodule m; CK(cuModuleLoadData(&m, hot.data()));
                f.push_back(get(m, n));
            }
        }
        int n = 1 << 16; CUdeviceptr x, y; CK(cuMemAlloc(&x, n * 4)); CK(cuMemAlloc(&y, n * 4));
        CK(cuMemsetD32(x, 0, n)); CK(cuMemsetD32(y, 0, n));
        size_t fr, tot; CK(cuMemGetInfo(&fr, &tot));
        double t = time_graph([&] {
            for (size_t i = 0; i < f.size(); ++i) {
                CUdeviceptr in = i % 2 ? y : x, out = i % 2 ? x : y;
                void *args[] = {&in, &out, &n};
                CK(cuLaunchKernel(f[i], n / 256, 1, 1, 256, 1, 1, 0, s, args, nullptr));
            }
        });
        double e = time_graph([&] {
            for (size_t i = 0; i < f.size(); ++i) {
                int zero = 0; CUdeviceptr in = x, out = y;
                void *args[] = {&in, &out, &zero};
                CK(cuLaunchKernel(f[i], 1, 1, 1, 32, 1, 1, 0, s, args, nullptr));
            }
        });
        printf("spread pads %d: %zu kernels, %.2f us a replay (%.3f a kernel); empty launches %.2f us (%.3f); GPU memory used %zu MiB\n",
               pads, f.size(), t, t / f.size(), e, e / f.size(), (tot - fr) >> 20);
        return 0;
    }
    if (what == "softmax") {
        auto img = readf("sm.cubin"); CUmodule m; CK(cuModuleLoadData(&m, img.data()));
        CUfunction warp = get(m, "sm_warp"), warp2 = get(m, "sm_warp2"), block = get(m, "sm_block"), reg = get(m, "sm_reg"),
                   bias = get(m, "add_bias"), empty = get(m, "empty");
        for (int len : {1000, 197}) for (int rows : {1, 8, 64, 2364}) {
            CUdeviceptr x, b; CK(cuMemAlloc(&x, rows * len * 4)); CK(cuMemAlloc(&b, len * 2));
            CK(cuMemsetD32(x, 0, rows * len)); CK(cuMemsetD16(b, 0x3c00, len));
            auto rep = [&](const std::function<void()> &one) { return time_graph([&] { for (int i = 0; i < 20; ++i) one(); }) / 20; };
            CUdeviceptr nb = 0;
            auto L = [&](CUfunction f, int grid, int threads, std::vector<void *> args) {
                CK(cuLaunchKernel(f, grid, 1, 1, threads, 1, 1, 0, s, args.data(), nullptr)); };
            double te = rep([&] { L(empty, 1, 32, {&x}); });
            double tw = rep([&] { L(warp, (rows + 7) / 8, 256, {&x, &b, &x, &rows, &len}); });
            int n = rows * len;
            double tbw = rep([&] { L(bias, (n + 255) / 256, 256, {&x, &b, &n, &len});
                                   L(warp, (rows + 7) / 8, 256, {&x, &nb, &x, &rows, &len}); });
            double tw2 = rep([&] { L(warp2, (rows + 7) / 8, 256, {&x, &b, &x, &rows, &len}); });
            double tb256 = rep([&] { L(block, rows, 256, {&x, &b, &x, &len}); });
            double tb1024 = rep([&] { L(block, rows, 1024, {&x, &b, &x, &len}); });
            double tr256 = rep([&] { L(reg, rows, 256, {&x, &b, &x, &len}); });
            double tr512 = rep([&] { L(reg, rows, 512, {&x, &b, &x, &len}); });
            printf("softmax rows %d len %d (us a launch): empty %.2f | warp+bias %.2f | add_bias then warp %.2f | warp, loads first %.2f | block256 %.2f | block1024 %.2f | reg256 %.2f | reg512 %.2f\n",
                   rows, len, te, tw, tbw, tw2, tb256, tb1024, tr256, tr512);
            CK(cuMemFree(x)); CK(cuMemFree(b));
        }
        return 0;
    }
    fprintf(stderr, "usage: mb spread PADS | mb softmax\n");
    return 2;
}
