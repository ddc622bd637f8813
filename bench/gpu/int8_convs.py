#!/usr/bin/env python3
"""What cuDNN's own 8-bit convolutions would give ResNet-50, beside its fp16 ones: every
convolution of ResNet-50 after the stem, at a batch size, timed as cuDNN's fused call
(convolution, per-tensor scale, bias, ReLU; the output in the input's type) in three forms:

- fp16 NHWC, the best of cuDNN's ranked algorithms (what the engine runs today);
- int8 NHWC (cuDNN's INT8_CONFIG: int8 in and out, int32 sums);
- int8 NC/32HW32 (INT8x32_CONFIG, the layout of TensorRT's int8 kernels).

Each is timed as the engine runs it: calls captured in a CUDA graph, the graph replayed.

On the GPU host, ctypes on its own libraries (no build, no PyTorch):

    python3 bench/gpu/int8_convs.py [BATCH ...]

Prints, per batch size, each form's summed time and the images a second that it alone would
allow; a form cuDNN refuses for a shape says so with its status.
"""
import ctypes, glob, statistics, sys

cu = ctypes.CDLL("libcuda.so.1")
dnn = ctypes.CDLL(sorted(glob.glob("/usr/lib/x86_64-linux-gnu/libcudnn.so.9*")
                         + glob.glob("/usr/local/cuda/lib64/libcudnn.so.9*"))[0])
c_int, c_size_t, c_void_p, c_float = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_float


def ok(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: status {rc}")


ok(cu.cuInit(0), "cuInit")
dev = c_int()
ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = c_void_p()
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "context")
ok(cu.cuCtxSetCurrent(ctx), "current")
name = ctypes.create_string_buffer(100)
cu.cuDeviceGetName(name, 100, dev)
handle = c_void_p()
ok(dnn.cudnnCreate(ctypes.byref(handle)), "cudnnCreate")
dnn.cudnnGetVersion.restype = c_size_t
stream = c_void_p()
ok(cu.cuStreamCreate(ctypes.byref(stream), 1), "stream")
ok(dnn.cudnnSetStream(handle, stream), "cudnnSetStream")


def alloc(size):
    p = ctypes.c_uint64()
    ok(cu.cuMemAlloc_v2(ctypes.byref(p), c_size_t(max(size, 256))), f"cuMemAlloc {size}")
    ok(cu.cuMemsetD8_v2(p, 1, c_size_t(max(size, 256))), "memset")
    return p.value


VERBOSE = "-v" in sys.argv
WORKSPACE = 512 << 20
ws = alloc(WORKSPACE)

FLOAT, HALF, INT8, INT32, INT8x32 = 0, 2, 3, 4, 8
NCHW, NHWC, VECT_C = 0, 1, 2
RELU, CROSS_CORRELATION, TENSOR_OP = 1, 1, 1
IMPLICIT_PRECOMP_GEMM = 1

# ResNet-50 (torchvision, stride on the 3×3) after the stem: (count, H, C, K, R, stride).
RESNET50 = []
for blocks, h, cin, mid, out in ((3, 56, 64, 64, 256), (4, 56, 256, 128, 512),
                                 (6, 28, 512, 256, 1024), (3, 14, 1024, 512, 2048)):
    first_stride = 1 if h == 56 and cin == 64 else 2
    hh = h // first_stride
    RESNET50 += [(1, h, cin, mid, 1, 1), (1, h, mid, mid, 3, first_stride),
                 (1, hh, mid, out, 1, 1), (1, h, cin, out, 1, first_stride)]
    RESNET50 += [(blocks - 1, hh, out, mid, 1, 1), (blocks - 1, hh, mid, mid, 3, 1),
                 (blocks - 1, hh, mid, out, 1, 1)]


def tensor(fmt, dtype, n, c, h, w):
    d = c_void_p()
    dnn.cudnnCreateTensorDescriptor(ctypes.byref(d))
    ok(dnn.cudnnSetTensor4dDescriptor(d, fmt, dtype, n, c, h, w), "tensor descriptor")
    return d


def timed(call, reps=20):
    """The median GPU time of one `call`, from a CUDA graph of `reps` calls replayed: cuDNN's
    legacy calls take longer to issue than small convolutions take to run."""
    for _ in range(3):
        ok(call(), "warm-up")
    graph, exec_ = c_void_p(), c_void_p()
    ok(cu.cuStreamBeginCapture_v2(stream, 1), "begin capture")
    for _ in range(reps):
        call()
    ok(cu.cuStreamEndCapture(stream, ctypes.byref(graph)), "end capture")
    ok(cu.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, ctypes.c_ulonglong(0)), "instantiate")
    start, end = c_void_p(), c_void_p()
    cu.cuEventCreate(ctypes.byref(start), 0)
    cu.cuEventCreate(ctypes.byref(end), 0)
    ok(cu.cuGraphLaunch(exec_, stream), "launch")
    samples = []
    for _ in range(5):
        cu.cuEventRecord(start, stream)
        cu.cuGraphLaunch(exec_, stream)
        cu.cuEventRecord(end, stream)
        ok(cu.cuEventSynchronize(end), "replay")
        ms = c_float()
        cu.cuEventElapsedTime(ctypes.byref(ms), start, end)
        samples.append(ms.value / reps)
    cu.cuGraphExecDestroy(exec_)
    cu.cuGraphDestroy(graph)
    return statistics.median(samples)


def ranked_algorithms(x, w, cd, y):
    """cuDNN's ranked forward algorithms for these descriptors, those it supports (status 0)."""
    perf = (ctypes.c_ubyte * 48 * 8)()
    count = c_int()
    ok(dnn.cudnnGetConvolutionForwardAlgorithm_v7(handle, x, w, cd, y, 8, ctypes.byref(count), perf),
       "ranked algorithms")
    field = lambda i, at: int.from_bytes(bytes(perf[i][at:at + 4]), "little")
    return [field(i, 0) for i in range(count.value) if field(i, 4) == 0]


def fastest_fused(algos, x, w, cd, y, bias, act, label):
    """The fastest of `algos` in cuDNN's fused call (convolution, bias, ReLU) on x, w, y and
    bias (each a descriptor and a device address), in ms, each `timed`; where none ran, the
    status of a refused call, or None where none fits the workspace."""
    one, zero = c_float(1.0), c_float(0.0)
    best = None
    for algo in algos:
        need = c_size_t()
        if dnn.cudnnGetConvolutionForwardWorkspaceSize(handle, x[0], w[0], cd, y[0], algo, ctypes.byref(need)) != 0:
            continue
        if need.value > WORKSPACE:
            continue

        def call():
            return dnn.cudnnConvolutionBiasActivationForward(
                handle, ctypes.byref(one), x[0], c_void_p(x[1]), w[0], c_void_p(w[1]), cd, algo,
                c_void_p(ws), need, ctypes.byref(zero), y[0], c_void_p(y[1]), bias[0],
                c_void_p(bias[1]), act, y[0], c_void_p(y[1]))

        rc = call()
        if rc != 0:
            best = best or f"status {rc}"
            continue
        t = timed(call)
        if VERBOSE:
            print(f"    {label} algo {algo}: {t * 1e3:.1f} us")
        best = t if not isinstance(best, float) or t < best else best
    return best


def conv(form, n, h, c, k, r, stride):
    pad = r // 2
    oh = (h + 2 * pad - r) // stride + 1
    if form == "fp16":
        fmt, dt, size, compute = NHWC, HALF, 2, FLOAT
    elif form == "int8":
        fmt, dt, size, compute = NHWC, INT8, 1, INT32
    else:
        fmt, dt, size, compute = VECT_C, INT8x32, 1, INT32
    x = tensor(fmt, dt, n, c, h, h)
    y = tensor(fmt, dt, n, k, oh, oh)
    bias = tensor(NCHW, HALF if form == "fp16" else FLOAT, 1, k, 1, 1)
    w = c_void_p()
    dnn.cudnnCreateFilterDescriptor(ctypes.byref(w))
    ok(dnn.cudnnSetFilter4dDescriptor(w, dt, fmt, k, c, r, r), "filter descriptor")
    cd = c_void_p()
    dnn.cudnnCreateConvolutionDescriptor(ctypes.byref(cd))
    ok(dnn.cudnnSetConvolution2dDescriptor(cd, pad, pad, stride, stride, 1, 1,
                                           CROSS_CORRELATION, compute), "conv descriptor")
    dnn.cudnnSetConvolutionMathType(cd, TENSOR_OP)
    act = c_void_p()
    dnn.cudnnCreateActivationDescriptor(ctypes.byref(act))
    dnn.cudnnSetActivationDescriptor(act, RELU, 0, ctypes.c_double(0.0))
    px, pw, py = alloc(n * c * h * h * size), alloc(k * c * r * r * size), alloc(n * k * oh * oh * size)
    pb = alloc(k * 4)

    if form == "fp16":
        # Less FFT and direct, which the engine never picks.
        algos = [a for a in ranked_algorithms(x, w, cd, y) if a not in (3, 4, 5)][:3]
        algos = algos or [IMPLICIT_PRECOMP_GEMM]
    else:
        algos = [IMPLICIT_PRECOMP_GEMM]
    best = fastest_fused(algos, (x, px), (w, pw), cd, (y, py), (bias, pb), act,
                         f"{form} n{n} {h}x{h}x{c}->{k} {r}x{r}/{stride}")
    for p in (px, pw, py, pb):
        cu.cuMemFree_v2(ctypes.c_uint64(p))
    return best


def main():
    batches = [int(b) for b in sys.argv[1:] if b != "-v"] or [64, 1]
    print(f"{name.value.decode()}, cuDNN {dnn.cudnnGetVersion()}")
    for n in batches:
        totals, refused = {}, {}
        for form in ("fp16", "int8", "int8x32"):
            total = 0.0
            for count, h, c, k, r, stride in RESNET50:
                try:
                    t = conv(form, n, h, c, k, r, stride)
                except RuntimeError as e:
                    t = str(e)
                if isinstance(t, float):
                    total += count * t
                else:
                    refused.setdefault(form, []).append(f"{h}x{h}x{c}->{k} {r}x{r}/{stride}: {t}")
            totals[form] = total
        print(f"\nbatch {n}: ResNet-50's convolutions after the stem, summed (ms; img/s by them alone)")
        for form, total in totals.items():
            note = f"; refused: {refused[form][:3]}" if form in refused else ""
            print(f"  {form:8} {total:8.3f} ms  {n / total * 1e3:10,.0f} img/s{note}")


if __name__ == "__main__":
    main()
