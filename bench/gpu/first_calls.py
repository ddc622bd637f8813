#!/usr/bin/env python3
"""How long a process's first cuBLASLt heuristic query and first cuDNN convolution query take,
against the next ones: what the first plan of a cached start waits for (docs/benchmarks.md,
"where a cached start goes"). On the GPU host, ctypes on its own libraries:

    python3 bench/gpu/first_calls.py
"""
import ctypes, glob, time
cu = ctypes.CDLL("libcuda.so.1")
cu.cuInit(0)
dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), 0)
ctx = ctypes.c_void_p(); cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev); cu.cuCtxSetCurrent(ctx)
def ms(t): return f"{(time.time() - t) * 1e3:.1f} ms"
out = []
lt = ctypes.CDLL(sorted(glob.glob('/usr/local/cuda/lib64/libcublasLt.so*'))[0])
h = ctypes.c_void_p(); t = time.time(); lt.cublasLtCreate(ctypes.byref(h)); out.append("cublasLtCreate " + ms(t))
def heuristic(m, n, k):
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
out.append("first " + heuristic(64, 1000, 2048))
out.append("second " + heuristic(1, 1000, 2048))
out.append("third " + heuristic(197, 2304, 768))
dnn = ctypes.CDLL(sorted(glob.glob('/usr/lib/x86_64-linux-gnu/libcudnn.so*') + glob.glob('/usr/local/cuda/lib64/libcudnn.so*'))[0])
hd = ctypes.c_void_p(); t = time.time(); dnn.cudnnCreate(ctypes.byref(hd)); out.append("cudnnCreate " + ms(t))
def conv(n):
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
out.append("first " + conv(1))
out.append("second " + conv(2))
print("; ".join(out))
