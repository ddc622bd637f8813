#!/usr/bin/env python3
"""The fused attention kernel (crates/cuda/src/runtime/steps/attention.cu) alone, beside
PyTorch's scaled_dot_product_attention (FlashAttention) on the same operands: the heads read
in place from a [batch, tokens, 3 x heads x dk] projection, as the engine runs them. Checks
each output against fp32 (exits 1 where one is off by more than 4 times SDPA's own fp16
error, or 2e-3) and times both (medians of CUDA-event timings, same run).

The kernel is compiled by NVRTC (-DHALF, as the engine does) from the repository's source, in
blocks of 4 warps and of 8 (64 and 128 queries; the engine takes 8 where there are many
rows: steps/attention.rs's `AttentionLaunch::of`), or from other versions given as
FILE[:WARPS[:QUERIES[:NAME]]] (each file compiled once): WARPS warps a block (4 by default)
of QUERIES queries each (16 by default), the kernel `attention_{dk}_{dv}_{WARPS}w` followed
by NAME, if given; e.g. the kernel before a change: `git show
COMMIT:crates/cuda/src/runtime/steps/attention.cu > /tmp/before.cu`. A shape without such a
kernel shows as –.

Usage (on the GPU host): python3 bench/gpu/attention.py [FILE[:WARPS[:QUERIES[:NAME]]] ...]
"""

import ctypes
import glob
import os
import statistics
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
RUNTIME = os.path.join(ROOT, "crates", "cuda", "src", "runtime")

# (name, images, tokens, heads, head dim): the transformers the GPU tests export.
SHAPES = [
    ("vit_b_16 b1", 1, 197, 12, 64),
    ("vit_b_16 b64", 64, 197, 12, 64),
    ("deit_s b64", 64, 198, 6, 64),
    ("vit_l_16 b64", 64, 197, 16, 64),
    ("swin_t b64 (window 49)", 64 * 64, 49, 3, 32),
    ("long 1024", 8, 1024, 12, 64),
]


class Attn(ctypes.Structure):
    """attention.cu's `struct Attn` (abi.rs's AttnParams)."""

    _fields_ = [
        ("batch", ctypes.c_int * 3),
        ("queries", ctypes.c_int),
        ("keys", ctypes.c_int),
        ("dk", ctypes.c_int),
        ("dv", ctypes.c_int),
        ("vec", ctypes.c_int),
        ("alpha", ctypes.c_float),
        ("pad", ctypes.c_int),
        ("q", ctypes.c_longlong * 4),
        ("k", ctypes.c_longlong * 4),
        ("v", ctypes.c_longlong * 4),
        ("bias", ctypes.c_longlong * 4),
        ("y", ctypes.c_longlong * 4),
    ]


assert ctypes.sizeof(Attn) == 200


def warp_reductions():
    """rows.cu's `warp_sum` and `warp_max`, which attention.cu's row kernel uses (the rest of
    rows.cu needs more of the engine's generated source)."""
    rows = open(os.path.join(RUNTIME, "steps", "rows.cu")).read()
    start = rows.index("__device__ __forceinline__ float warp_sum")
    end = rows.index("}\n", rows.index("float warp_max(")) + 2
    return rows[start:end]


def nvrtc_cubin(source, arch):
    """`source` compiled by NVRTC (as the engine compiles its kernels, but straight to a
    cubin for `arch`), and the compiler's log (ptxas's lines on each kernel)."""
    lib = os.environ.get("NVRTC") or sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))[0]
    nvrtc = ctypes.CDLL(lib)
    prog = ctypes.c_void_p()
    status = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None)
    check(status, "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), b"--ptxas-options=--verbose"]
    status = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    log = log.value.decode()
    if status != 0:
        raise RuntimeError(f"NVRTC: {log[:3000]}")
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    return cubin.raw, log


def resources(log, kernel):
    """ptxas's registers, spills and shared memory of `kernel`, from the compiler's log."""
    lines = log.splitlines()
    at = next((i for i, x in enumerate(lines) if f"entry function '{kernel}'" in x), None)
    if at is None:
        return "?"
    return " ".join(x.split(":", 1)[-1].strip() for x in lines[at + 2 : at + 4])


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: CUDA error {status}")


MODULES = {}


def module(path, cuda):
    """The file at `path` compiled for this GPU (once a file) and loaded into torch's
    context, and the compiler's log."""
    if path not in MODULES:
        prelude = open(os.path.join(RUNTIME, "prelude.cu")).read()
        source = "#define HALF\n" + prelude + warp_reductions() + open(path).read()
        major, minor = torch.cuda.get_device_capability()
        cubin, log = nvrtc_cubin(source, f"sm_{major}{minor}")
        torch.zeros(1, device="cuda")  # torch's context, current on this thread
        loaded = ctypes.c_void_p()
        check(cuda.cuModuleLoadData(ctypes.byref(loaded), cubin), "load")
        MODULES[path] = (loaded, log)
    return MODULES[path]


class Kernel:
    """One version of attention.cu, compiled for this GPU and loaded into torch's context."""

    def __init__(self, path, warps, queries=16, suffix=""):
        kind = f"{warps} warps of {queries} queries"
        self.label = f"{os.path.relpath(path, ROOT)} ({kind}{suffix and ', ' + suffix})"
        self.warps = warps
        self.rows, self.threads = queries * warps, 32 * warps
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.module, log = module(path, self.cuda)
        self.functions = {}
        # Kernels are named by their block's warps (`attention_64_64_8w`); before that they
        # were not (`attention_64_64`), which older versions given to compare still are.
        self.name = f"attention_{{}}_{{}}_{self.warps}w{suffix}"
        f = ctypes.c_void_p()
        if self.cuda.cuModuleGetFunction(ctypes.byref(f), self.module, b"attention_64_64") == 0:
            self.name = "attention_{}_{}"
        if self.function(64, 64) is None:
            sys.exit(f"{self.label}: no kernel {self.name.format(64, 64)}")
        self.resources = resources(log, self.name.format(64, 64))

    def function(self, dk, dv):
        """The kernel for heads of dk and dv, or None where this version has none."""
        name = self.name.format(dk, dv).encode()
        if name not in self.functions:
            f = ctypes.c_void_p()
            found = self.cuda.cuModuleGetFunction(ctypes.byref(f), self.module, name) == 0
            self.functions[name] = f if found else None
        return self.functions[name]

    def launch(self, p, q, k, v, y, matrices, queries, dk, dv):
        f = self.function(dk, dv)
        ptrs = [ctypes.c_uint64(t.data_ptr()) for t in (q, k, v)]
        ptrs += [ctypes.c_uint64(0), ctypes.c_uint64(y.data_ptr())]
        args = [ctypes.cast(ctypes.byref(p), ctypes.c_void_p)]
        args += [ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in ptrs]
        params = (ctypes.c_void_p * len(args))(*args)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        grid_y = (queries + self.rows - 1) // self.rows
        status = self.cuda.cuLaunchKernel(
            f, matrices, grid_y, 1, self.threads, 1, 1, 0, stream, params, None
        )
        check(status, "launch")


def operands(images, tokens, heads, d):
    """q, k and v as views of one projection [images, tokens, 3 * heads * d], and y."""
    width = heads * d
    qkv = torch.randn(images, tokens, 3 * width, device="cuda", dtype=torch.half)
    q, k, v = (qkv[..., i * width : (i + 1) * width] for i in range(3))
    y = torch.empty(images, tokens, width, device="cuda", dtype=torch.half)
    return q, k, v, y


def params(images, tokens, heads, d):
    """Attn for operands(): batch [1, images, heads], rows strided by the projection."""
    width = heads * d
    p = Attn()
    p.batch[:] = [1, images, heads]
    p.queries = p.keys = tokens
    p.dk = p.dv = d
    p.vec = 1
    p.alpha = d**-0.5
    for name in ("q", "k", "v"):
        getattr(p, name)[:] = [0, tokens * 3 * width, d, 3 * width]
    p.y[:] = [0, tokens * width, d, width]
    return p


def timed(f, runs=30, calls=20):
    """Milliseconds a call: `calls` calls captured in a CUDA graph (as the engine runs its
    steps, without the launches' cost on the host), the median of `runs` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            f()
    graph.replay()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main():
    here = os.path.join(RUNTIME, "steps", "attention.cu")
    specs = sys.argv[1:] or [f"{here}:4", f"{here}:8"]
    kernels = []
    for spec in specs:
        path, *rest = spec.split(":")
        warps, queries = (int(x) if x else d for x, d in zip(rest + ["", ""], (4, 16)))
        kernels.append(Kernel(path, warps, queries, rest[2] if len(rest) > 2 else ""))
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    for i, k in enumerate(kernels):
        print(f"  kernel {i}: {k.label}; {k.name.format(64, 64)}: {k.resources}")
    head = "| shape | " + " | ".join(f"kernel {i}" for i in range(len(kernels)))
    print(f"\n{head} | PyTorch SDPA | largest error (kernel / SDPA's fp16 vs fp32) |")
    print("|---" * (len(kernels) + 3) + "|")
    wrong = []
    for name, images, tokens, heads, d in SHAPES:
        q, k, v, y = operands(images, tokens, heads, d)
        p = params(images, tokens, heads, d)
        split = lambda t: t.reshape(images, tokens, heads, d).transpose(1, 2)  # noqa: E731
        qs, ks, vs = split(q), split(k), split(v)
        exact = torch.nn.functional.scaled_dot_product_attention(
            qs.float(), ks.float(), vs.float()
        )
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)  # noqa: E731
        sdpa_err = (sdpa().float() - exact).abs().max().item()
        flops = 4 * images * heads * tokens * tokens * d
        cells, errors = [], []
        for i, kern in enumerate(kernels):
            if kern.function(d, d) is None:
                cells.append("–")
                errors.append("–")
                continue
            run = lambda: kern.launch(p, q, k, v, y, images * heads, tokens, d, d)  # noqa: E731
            y.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            ours = y.reshape(images, tokens, heads, d).transpose(1, 2).float()
            error = (ours - exact).abs().max().item()
            errors.append(f"{error:.1e}")
            # fp16 outputs: a few of their units in the last place, as SDPA's own error.
            if not error <= max(2e-3, 4 * sdpa_err):
                wrong.append(f"{name}: kernel {i} off by {error:.1e} (SDPA {sdpa_err:.1e})")
            ms = timed(run)
            cells.append(f"{ms * 1000:.1f} µs ({flops / ms / 1e9:.0f} TFLOP/s)")
        ms = timed(sdpa)
        cells.append(f"{ms * 1000:.1f} µs ({flops / ms / 1e9:.0f} TFLOP/s)")
        print(f"| {name} | " + " | ".join(cells) + f" | {' / '.join(errors)} / {sdpa_err:.1e} |")
    if wrong:
        sys.exit("wrong outputs:\n" + "\n".join(wrong))


if __name__ == "__main__":
    main()
