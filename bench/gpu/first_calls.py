#!/usr/bin/env python3
"""How long a process's first cuBLASLt heuristic query and first cuDNN convolution query take,
against the next ones: what the first plan of a cached start waits for (docs/benchmarks.md,
"where a cached start goes"). On the GPU host, ctypes on its own libraries:

    python3 bench/gpu/first_calls.py          first, second and third calls on one handle,
                                              then one on a second handle
    python3 bench/gpu/first_calls.py ahead    first calls made on another thread with
                                              handles of its own (the engine's warm-up),
                                              then the main thread's first calls on its own
"""
import ctypes, glob, sys, threading, time
cu = ctypes.CDLL("libcuda.so.1")
cu.cuInit(0)
dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), 0)
ctx = ctypes.c_void_p(); cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev); cu.cuCtxSetCurrent(ctx)
def ms(t): return f"{(time.time() - t) * 1e3:.1f} ms"
out = []
lt = ctypes.CDLL(sorted(glob.glob('/usr/local/cuda/lib64/libcublasLt.so*'))[0])
dnn = ctypes.CDLL(sorted(glob.glob('/usr/lib/x86_64-linux-gnu/libcudnn.so*') + glob.glob('/usr/local/cuda/lib64/libcudnn.so*'))[0])

def lt_handle():
    h = ctypes.c_void_p(); t = time.time(); lt.cublasLtCreate(ctypes.byref(h))
    return h, ms(t)

def dnn_handle():
    h = ctypes.c_void_p(); t = time.time(); dnn.cudnnCreate(ctypes.byref(h))
    return h, ms(t)

def heuristic(h, m, n, k):
    desc = ctypes.c_void_p(); lt.cublasLtMatmulDescCreate(ctypes.byref(desc), 68, 0)
    lay = []
    for r, c in ((n, k), (k, m), (n, m)):
        l = ctypes.c_void_p(); lt.cublasLtMatrixLayoutCreate(ctypes.byref(l), 2, ctypes.c_uint64(r), ctypes.c_uint64(c), ctypes.c_int64(r)); lay.append(l)
    pref = ctypes.c_void_p(); lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref))
    ws = ctypes.c_size_t(32 << 20); lt.cublasLtMatmulPreferenceSetAttribute(pref, 1, ctypes.byref(ws), ctypes.sizeof(ws))
    res = (ctypes.c_byte * 96 * 4)(); cnt = ctypes.c_int()
    t = time.time()
    rc = lt.cublasLtMatmulAlgoGetHeuristic(h, desc, lay[0], lay[1], lay[2], lay[2], pref, 1, res, ctypes.byref(cnt))
    return f"heuristic {m}x{n}x{k}: {ms(t)} (rc {rc}, {cnt.value})"

def conv(hd, n):
    x = ctypes.c_void_p(); y = ctypes.c_void_p(); w = ctypes.c_void_p(); cd = ctypes.c_void_p()
    t = time.time()
    dnn.cudnnCreateTensorDescriptor(ctypes.byref(x)); dnn.cudnnCreateTensorDescriptor(ctypes.byref(y))
    dnn.cudnnCreateFilterDescriptor(ctypes.byref(w)); dnn.cudnnCreateConvolutionDescriptor(ctypes.byref(cd))
    NHWC, HALF, FLOAT = 1, 2, 0
    dnn.cudnnSetTensor4dDescriptor(x, NHWC, HALF, n, 64, 56, 56)
    dnn.cudnnSetTensor4dDescriptor(y, NHWC, HALF, n, 64, 56, 56)
    dnn.cudnnSetFilter4dDescriptor(w, HALF, NHWC, 64, 64, 3, 3)
    dnn.cudnnSetConvolution2dDescriptor(cd, 1, 1, 1, 1, 1, 1, 1, FLOAT)
    dnn.cudnnSetConvolutionMathType(cd, 1)
    a = "descriptors " + ms(t)
    sz = ctypes.c_size_t(); t = time.time()
    rc = dnn.cudnnGetConvolutionForwardWorkspaceSize(hd, x, w, cd, y, 1, ctypes.byref(sz))
    return f"conv n={n}: {a}, workspace size {ms(t)} (rc {rc})"

if "ahead" in sys.argv:
    def warm():
        cu.cuCtxSetCurrent(ctx)
        h, _ = lt_handle()
        out.append("thread's first " + heuristic(h, 64, 64, 64))
        hd, _ = dnn_handle()
        out.append("thread's first " + conv(hd, 1))
    thread = threading.Thread(target=warm); thread.start(); thread.join()
    h, _ = lt_handle()
    out.append("then the main thread's first " + heuristic(h, 64, 1000, 2048))
    hd, _ = dnn_handle()
    out.append("then the main thread's first " + conv(hd, 2))
else:
    h, took = lt_handle(); out.append("cublasLtCreate " + took)
    out.append("first " + heuristic(h, 64, 1000, 2048))
    out.append("second " + heuristic(h, 1, 1000, 2048))
    out.append("third " + heuristic(h, 197, 2304, 768))
    h2, _ = lt_handle()
    out.append("on a second handle " + heuristic(h2, 128, 512, 256))
    hd, took = dnn_handle(); out.append("cudnnCreate " + took)
    out.append("first " + conv(hd, 1))
    out.append("second " + conv(hd, 2))
    hd2, _ = dnn_handle()
    out.append("on a second handle " + conv(hd2, 3))
print("\n".join(out))
