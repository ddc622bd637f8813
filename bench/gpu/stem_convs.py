#!/usr/bin/env python3
"""What a CNN's stem costs in cuDNN, as written and rewritten: the first convolution of an
image classifier reads 3 channels, too few for cuDNN's tensor-core kernels. Timed as the
engine runs it (cuDNN's fused call with bias and ReLU, fp16 NHWC, each of cuDNN's ranked
algorithms, the fastest kept; calls captured in a CUDA graph, the graph replayed):

- as written: 3 channels, 7×7 stride 2 (ResNet) or 3×3 stride 2 (MobileNet, EfficientNet);
- the input padded with zero channels to 4 or 8;
- space to depth: each 2×2 block of pixels as one pixel of 12 channels (padded to 16), the
  convolution then 4×4 (or 2×2) with stride 1 over a 115×115 (113×113) grid that holds the
  padding, the same sums.

On the GPU host, ctypes on its own libraries (no build, no PyTorch):

    python3 bench/gpu/stem_convs.py [BATCH ...] [-v]
"""
import ctypes, sys

from int8_convs import (CROSS_CORRELATION, FLOAT, HALF, NCHW, NHWC, RELU, TENSOR_OP, alloc, cu, dnn,
                        fastest_fused, name, ok, ranked_algorithms, tensor)


def conv(n, c, h, k, r, stride, pad):
    """The fastest of cuDNN's ranked algorithms for one fp16 NHWC convolution, in ms (else
    why none ran: `fastest_fused`)."""
    oh = (h + 2 * pad - r) // stride + 1
    x, y = tensor(NHWC, HALF, n, c, h, h), tensor(NHWC, HALF, n, k, oh, oh)
    bias = tensor(NCHW, HALF, 1, k, 1, 1)
    w = ctypes.c_void_p()
    dnn.cudnnCreateFilterDescriptor(ctypes.byref(w))
    ok(dnn.cudnnSetFilter4dDescriptor(w, HALF, NHWC, k, c, r, r), "filter descriptor")
    cd = ctypes.c_void_p()
    dnn.cudnnCreateConvolutionDescriptor(ctypes.byref(cd))
    ok(dnn.cudnnSetConvolution2dDescriptor(cd, pad, pad, stride, stride, 1, 1, CROSS_CORRELATION, FLOAT),
       "conv descriptor")
    dnn.cudnnSetConvolutionMathType(cd, TENSOR_OP)
    act = ctypes.c_void_p()
    dnn.cudnnCreateActivationDescriptor(ctypes.byref(act))
    dnn.cudnnSetActivationDescriptor(act, RELU, 0, ctypes.c_double(0.0))
    px, pw, py = alloc(n * c * h * h * 2), alloc(k * c * r * r * 2), alloc(n * k * oh * oh * 2)
    pb = alloc(k * 2)
    best = fastest_fused(ranked_algorithms(x, w, cd, y), (x, px), (w, pw), cd, (y, py), (bias, pb), act,
                         f"n{n} {h}x{h}x{c}->{k} {r}x{r}/{stride} pad {pad}")
    for p in (px, pw, py, pb):
        cu.cuMemFree_v2(ctypes.c_uint64(p))
    return best


# (stem, form, channels, input size, output channels, kernel, stride, padding)
FORMS = [
    ("ResNet 7×7/2, 64", "as written", 3, 224, 64, 7, 2, 3),
    ("ResNet 7×7/2, 64", "8 channels", 8, 224, 64, 7, 2, 3),
    ("ResNet 7×7/2, 64", "space to depth, 12 channels, 4×4 over 115² (zero border)", 12, 115, 64, 4, 1, 0),
    ("ResNet 7×7/2, 64", "space to depth, 16 channels, 4×4 over 115² (zero border)", 16, 115, 64, 4, 1, 0),
    ("ResNet 7×7/2, 64", "space to depth, 12 channels, 5×5 pad 2 over 112²", 12, 112, 64, 5, 1, 2),
    ("ResNet 7×7/2, 64", "space to depth, 16 channels, 5×5 pad 2 over 112²", 16, 112, 64, 5, 1, 2),
    ("MobileNet 3×3/2, 32", "as written", 3, 224, 32, 3, 2, 1),
    ("MobileNet 3×3/2, 32", "8 channels", 8, 224, 32, 3, 2, 1),
    ("MobileNet 3×3/2, 32", "space to depth, 12 channels, 2×2 over 113² (zero border)", 12, 113, 32, 2, 1, 0),
    ("MobileNet 3×3/2, 32", "space to depth, 16 channels, 2×2 over 113² (zero border)", 16, 113, 32, 2, 1, 0),
    ("MobileNet 3×3/2, 32", "space to depth, 12 channels, 3×3 pad 1 over 112²", 12, 112, 32, 3, 1, 1),
    ("MobileNet 3×3/2, 32", "space to depth, 16 channels, 3×3 pad 1 over 112²", 16, 112, 32, 3, 1, 1),
]


def main():
    batches = [int(b) for b in sys.argv[1:] if b != "-v"] or [64, 1]
    print(f"{name.value.decode()}, cuDNN {dnn.cudnnGetVersion()}")
    print("| stem | form | " + " | ".join(f"batch {n}" for n in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for stem, form, c, h, k, r, stride, pad in FORMS:
        times = []
        for n in batches:
            t = conv(n, c, h, k, r, stride, pad)
            times.append(f"{t * 1e3:.1f} µs" if isinstance(t, float) else "refused")
        print(f"| {stem} | {form} | " + " | ".join(times) + " |")


if __name__ == "__main__":
    main()
