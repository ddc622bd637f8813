#!/usr/bin/env python3
"""Generate the ONNX test models used by the trtclassify tests and benchmarks.

Usage:
    python3 models/generate.py [--out DIR] [--bench]

Without --bench the small, committed test models are written to DIR (default:
the folder of this script):

    colors*.onnx        hand-built colour classifiers whose right answer is known
    cnn.onnx            small random-weight CNN (ResNet / MobileNet style layers)
    ops.onnx            random-weight op-coverage CNN: the ops of PyTorch exports of the
                        common CNN classifiers (opset 17), ends in Softmax
    big_activations.onnx  a small CNN whose activations overflow fp16 on any frame (the GPU
                        engine must build it in fp32 when asked for fp16)
    big_logits.onnx     a small CNN whose logits alone pass fp16's range (its last product
                        writes the scores in f32, so the GPU engine stays in fp16)
    big_middle.onnx     a small CNN whose first two convolutions' values pass fp16's range
                        and the rest stays within it (the GPU engine keeps those two in f32)
    ops_rare.onnx       a small random-weight CNN with the supported operators that no other
                        committed model has (Abs, Elu, LeakyRelu, Neg, Reciprocal, Softplus,
                        Max, Min, GlobalMaxPool, GatherND on its shape), so that every declared
                        operator runs end to end against onnxruntime
    *_reference.json    onnxruntime outputs for fixed random inputs
    bad/*               broken or unsupported models for the error-handling tests

With --bench the (large, not committed) benchmark models are written
as well, e.g. `python3 models/generate.py --out target/bench --bench`.

All models are float32, opset 13 (ops.onnx: opset 17, for LayerNormalization),
IR version 8 (so older runtimes such as tract load them), with the input named
"image" and the output named "scores". Every random number comes from a seeded
numpy Generator, so running the script twice produces byte-identical files (the
head BatchNorm statistics of ops.onnx are measured with onnxruntime and rounded
to 3 digits). After writing, every valid model is loaded and run once in
onnxruntime, the colour classifiers are checked to classify solid-colour frames
correctly, and ops.onnx is checked for its op coverage and its reference outputs.
"""

import argparse
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPSET = 13
IR_VERSION = 8
PRODUCER = "trtclassify models/generate.py"
INPUT = "image"
OUTPUT = "scores"

# ImageNet normalisation the colour classifier expects: x = (pixel/255 - mean)/std, RGB order.
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

# Colour classes, in output order, with their RGB (0-255) prototypes.
COLOR_CLASSES = [
    ("black", (0, 0, 0)),
    ("white", (255, 255, 255)),
    ("red", (255, 0, 0)),
    ("green", (0, 255, 0)),
    ("blue", (0, 0, 255)),
    ("yellow", (255, 255, 0)),
]
COLOR_ALPHA = 2.0  # logits = -alpha * ||x - p_k||^2 (up to a per-image constant)

# One seed per random thing, so that changing one model never shifts another.
SEED_CNN_WEIGHTS = 1
SEED_CNN_REFERENCE = 2
SEED_COLORS_REFERENCE = 3
SEED_RANDOM_BIN = 4
SEED_MOBILENET = 5
SEED_RESNET50 = 6
SEED_EFFICIENTNET = 7
SEED_OPS_WEIGHTS = 6
SEED_OPS_REFERENCE = 7
SEED_OPS_CALIBRATION = 8
SEED_BIG_WEIGHTS = 9
SEED_BIG_REFERENCE = 10
BIG_GAIN = 1e5  # the first convolution's outputs reach ~1e5-1e6: past fp16's 65504
SEED_BIG_LOGITS_WEIGHTS = 11
SEED_BIG_LOGITS_REFERENCE = 12
SEED_BIG_MIDDLE_WEIGHTS = 13
SEED_BIG_MIDDLE_REFERENCE = 14
SEED_OPS_RARE_WEIGHTS = 15
SEED_OPS_RARE_REFERENCE = 16
BIG_LOGITS_GAIN = 2e4  # the classifier's weights: logits of ~1e5, each weight within fp16

# Concrete sizes substituted for symbolic dims when the models are run.
CONCRETE_DIMS = {"N": 2, "H": 24, "W": 20}


# --------------------------------------------------------------------------
# Graph building helpers
# --------------------------------------------------------------------------


class GraphBuilder:
    """Accumulates nodes and initializers; names every tensor uniquely and deterministically."""

    def __init__(self, rng=None):
        self.rng = rng
        self.nodes = []
        self.initializers = []
        self._counts = {}
        self._relu6_bounds = None

    def unique(self, prefix):
        n = self._counts.get(prefix, 0)
        self._counts[prefix] = n + 1
        return f"{prefix}_{n}"

    def const(self, prefix, array):
        """Adds an initializer and returns its name."""
        name = self.unique(prefix)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type, inputs, output=None, domain=None, **attrs):
        """Adds a node with a single output and returns the output name."""
        name = self.unique(op_type.lower())
        output = output or name
        self.nodes.append(
            helper.make_node(op_type, inputs, [output], name=name, domain=domain, **attrs)
        )
        return output

    # --- layers with random weights (need self.rng) ---

    def conv(self, x, cin, cout, kernel, stride=1, group=1, bias=False, dilation=1, pads=None, gain=1.0):
        """Conv with He-normal weights (std = gain * sqrt(2 / fan_in)).

        Padding is 'same' for odd kernels (dilation * (kernel // 2) per side) unless pads
        ([top, left, bottom, right]) is given. The dilations attribute is only written when
        dilation != 1, so the older models keep their bytes.
        """
        fan_in = cin // group * kernel * kernel
        w = self.rng.normal(0.0, gain * np.sqrt(2.0 / fan_in), (cout, cin // group, kernel, kernel))
        inputs = [x, self.const("conv_w", w.astype(np.float32))]
        if bias:
            inputs.append(self.const("conv_b", self.rng.normal(0.0, 0.1, cout).astype(np.float32)))
        pad = dilation * (kernel // 2)
        attrs = {}
        if dilation != 1:
            attrs["dilations"] = [dilation, dilation]
        return self.op(
            "Conv",
            inputs,
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=list(pads) if pads is not None else [pad, pad, pad, pad],
            group=group,
            **attrs,
        )

    def batchnorm(self, x, channels):
        """BatchNormalization (inference form) with random but sane statistics."""
        rng = self.rng
        gamma = rng.uniform(0.5, 1.5, channels)
        beta = rng.normal(0.0, 0.1, channels)
        mean = rng.normal(0.0, 0.1, channels)
        var = rng.uniform(0.5, 1.5, channels)
        params = [
            self.const(prefix, value.astype(np.float32))
            for prefix, value in [("bn_gamma", gamma), ("bn_beta", beta), ("bn_mean", mean), ("bn_var", var)]
        ]
        return self.op("BatchNormalization", [x] + params, epsilon=1e-5)

    def gemm(self, x, cin, cout, output=None):
        """Fully connected layer, weight stored as [cout, cin] (transB=1) like a PyTorch export."""
        w = self.rng.normal(0.0, np.sqrt(1.0 / cin), (cout, cin)).astype(np.float32)
        b = self.rng.normal(0.0, 0.1, cout).astype(np.float32)
        return self.op("Gemm", [x, self.const("fc_w", w), self.const("fc_b", b)], output=output, transB=1)

    # --- parameter-free layers ---

    def relu6(self, x):
        """ReLU6 as an opset-13 Clip, min/max given as (shared) constant inputs."""
        if self._relu6_bounds is None:
            self._relu6_bounds = (
                self.const("clip_min", np.array(0.0, dtype=np.float32)),
                self.const("clip_max", np.array(6.0, dtype=np.float32)),
            )
        return self.op("Clip", [x, *self._relu6_bounds])

    def model(self, graph_name, inputs, outputs, extra_opsets=(), opset=OPSET):
        graph = helper.make_graph(self.nodes, graph_name, inputs, outputs, self.initializers)
        opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in extra_opsets]
        return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name=PRODUCER)


def float_input(shape, name=INPUT):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def float_output(shape, name=OUTPUT):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


# --------------------------------------------------------------------------
# Colour classifiers
# --------------------------------------------------------------------------


def normalize_rgb(rgb):
    """RGB 0-255 -> ImageNet-normalised float32 (what the model sees)."""
    return ((np.asarray(rgb, dtype=np.float32) / 255.0 - IMAGENET_MEAN) / IMAGENET_STD).astype(np.float32)


def color_gemm_params():
    """W = 2*alpha*P, b_k = -alpha*||p_k||^2: logits = -alpha*||x - p_k||^2 + alpha*||x||^2."""
    prototypes = np.stack([normalize_rgb(rgb) for _, rgb in COLOR_CLASSES])  # [6, 3]
    weight = (2.0 * COLOR_ALPHA * prototypes).astype(np.float32)
    bias = (-COLOR_ALPHA * np.sum(prototypes**2, axis=1)).astype(np.float32)
    return weight, bias


def build_colors(batch="N", height=16, width=16, nhwc=False, softmax=True):
    """GlobalAveragePool -> Flatten -> Gemm [-> Softmax]: nearest normalised colour prototype."""
    b = GraphBuilder()
    x = INPUT
    if nhwc:
        x = b.op("Transpose", [x], perm=[0, 3, 1, 2])
    x = b.op("GlobalAveragePool", [x])
    x = b.op("Flatten", [x], axis=1)
    weight, bias = color_gemm_params()
    gemm_out = None if softmax else OUTPUT
    x = b.op("Gemm", [x, b.const("color_w", weight), b.const("color_b", bias)], output=gemm_out, transB=1)
    if softmax:
        b.op("Softmax", [x], output=OUTPUT, axis=1)
    in_shape = [batch, height, width, 3] if nhwc else [batch, 3, height, width]
    return b.model("colors", [float_input(in_shape)], [float_output([batch, len(COLOR_CLASSES)])])


# --------------------------------------------------------------------------
# Small random CNN
# --------------------------------------------------------------------------


def build_cnn():
    """Small CNN with random weights using ResNet / MobileNet style layers; [N,3,32,32] -> [N,10] logits."""
    b = GraphBuilder(np.random.default_rng(SEED_CNN_WEIGHTS))
    # Stem: Conv 3x3/2 (with bias) -> BN -> ReLU.            [N,16,16,16]
    x = b.op("Relu", [b.batchnorm(b.conv(INPUT, 3, 16, 3, stride=2, bias=True), 16)])
    block_input = x
    # Residual block: depthwise 3x3 -> BN -> ReLU6 -> pointwise 1x1 -> BN, + skip, ReLU.
    x = b.relu6(b.batchnorm(b.conv(x, 16, 16, 3, group=16), 16))
    x = b.batchnorm(b.conv(x, 16, 16, 1), 16)
    x = b.op("Relu", [b.op("Add", [x, block_input])])
    x = b.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])  # [N,16,8,8]
    x = b.op("Relu", [b.batchnorm(b.conv(x, 16, 32, 3), 32)])  # [N,32,8,8]
    x = b.op("AveragePool", [x], kernel_shape=[2, 2], strides=[2, 2])  # [N,32,4,4]
    x = b.op("GlobalAveragePool", [x])
    x = b.op("Flatten", [x], axis=1)
    b.gemm(x, 32, 10, output=OUTPUT)
    return b.model("cnn", [float_input(["N", 3, 32, 32])], [float_output(["N", 10])])


def build_big_activations():
    """A classifier whose activations overflow fp16 on any frame: Conv 3x3 with weights
    BIG_GAIN times He-normal -> ReLU -> GlobalAveragePool -> Gemm with weights 1/BIG_GAIN as
    large, so that its scores are ordinary logits; [N,3,16,16] -> [N,4].
    fp32 holds it: built for fp16, the GPU engine must notice and build it in fp32."""
    b = GraphBuilder(np.random.default_rng(SEED_BIG_WEIGHTS))
    x = b.op("Relu", [b.conv(INPUT, 3, 8, 3, bias=True, gain=BIG_GAIN)])
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    w = (b.rng.normal(0.0, 1.0, (4, 8)) / BIG_GAIN).astype(np.float32)
    bias = b.rng.normal(0.0, 0.1, 4).astype(np.float32)
    b.op("Gemm", [x, b.const("fc_w", w), b.const("fc_b", bias)], output=OUTPUT, transB=1)
    return b.model("big_activations", [float_input(["N", 3, 16, 16])], [float_output(["N", 4])])


def build_big_logits():
    """A classifier whose logits, and only they, pass fp16's range: Conv 3x3 -> ReLU ->
    GlobalAveragePool -> Gemm with weights BIG_LOGITS_GAIN times normal; [N,3,16,16] -> [N,4]
    logits of about 1e5. In fp16 only its last product overflows, and that product writes the
    scores in f32: the GPU engine keeps it in fp16."""
    b = GraphBuilder(np.random.default_rng(SEED_BIG_LOGITS_WEIGHTS))
    x = b.op("Relu", [b.conv(INPUT, 3, 8, 3, bias=True, gain=4.0)])
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    w = (b.rng.normal(0.0, 1.0, (4, 8)) * BIG_LOGITS_GAIN).astype(np.float32)
    assert np.abs(w).max() < 65504, "every weight within fp16"
    bias = b.rng.normal(0.0, 0.1, 4).astype(np.float32)
    b.op("Gemm", [x, b.const("fc_w", w), b.const("fc_b", bias)], output=OUTPUT, transB=1)
    return b.model("big_logits", [float_input(["N", 3, 16, 16])], [float_output(["N", 4])])


def build_big_middle():
    """A classifier whose values pass fp16's range in its first layers only: Conv 3x3 with
    weights BIG_GAIN times He-normal -> ReLU -> Conv 1x1 with weights 1/BIG_GAIN as large ->
    ReLU -> Conv 3x3 -> ReLU -> GlobalAveragePool -> Gemm; [N,3,16,16] -> [N,4]. Built for
    fp16, the GPU engine keeps the first convolution (past the range) and the second (which
    reads its values) in f32 and the rest in fp16."""
    b = GraphBuilder(np.random.default_rng(SEED_BIG_MIDDLE_WEIGHTS))
    x = b.op("Relu", [b.conv(INPUT, 3, 8, 3, bias=True, gain=BIG_GAIN)])
    x = b.op("Relu", [b.conv(x, 8, 16, 1, bias=True, gain=1.0 / BIG_GAIN)])
    x = b.op("Relu", [b.conv(x, 16, 16, 3, bias=True)])
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    w = b.rng.normal(0.0, 1.0, (4, 16)).astype(np.float32)
    bias = b.rng.normal(0.0, 0.1, 4).astype(np.float32)
    b.op("Gemm", [x, b.const("fc_w", w), b.const("fc_b", bias)], output=OUTPUT, transB=1)
    return b.model("big_middle", [float_input(["N", 3, 16, 16])], [float_output(["N", 4])])


# --------------------------------------------------------------------------
# Op-coverage model
# --------------------------------------------------------------------------

OPS_OPSET = 17  # LayerNormalization needs 17
OPS_LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
OPS_LOGIT_GAIN = 2.0  # scales the last Gemm so the softmax is neither flat nor one-hot


def build_ops():
    """Random-weight CNN that uses, once or more, the ops that PyTorch (legacy exporter, opset 17)
    exports of the common CNN classifiers contain, written the way the exporter writes them;
    [N,3,32,32] -> [N,10] probabilities.

    Sizes along the way: 32x32 -> 16x16 (stem) -> 8x8 (max pool) -> 4x4 (last conv).
    """
    b = GraphBuilder(np.random.default_rng(SEED_OPS_WEIGHTS))
    rng = b.rng

    def f32(array):
        return np.asarray(array, dtype=np.float32)

    def i64(array):
        return np.asarray(array, dtype=np.int64)

    def silu(x):
        return b.op("Mul", [x, b.op("Sigmoid", [x])])

    def squeeze_excite(x, channels, squeezed, pool="GlobalAveragePool", gate="Sigmoid"):
        """GAP (or ReduceMean over H,W) -> 1x1 -> ReLU -> 1x1 -> gate, times the block input."""
        if pool == "GlobalAveragePool":
            s = b.op("GlobalAveragePool", [x])
        else:
            s = b.op("ReduceMean", [x], axes=[2, 3], keepdims=1)  # axes an attribute up to opset 17
        s = b.op("Relu", [b.conv(s, channels, squeezed, 1, bias=True)])
        s = b.conv(s, squeezed, channels, 1, bias=True)
        if gate == "HardSigmoid":
            s = b.op("HardSigmoid", [s], alpha=1.0 / 6.0, beta=0.5)  # F.hardsigmoid
        else:
            s = b.op(gate, [s])
        return b.op("Mul", [x, s])  # [N,C,H,W] * [N,C,1,1]

    # Normalisation inside the model: (x - mean) / std, constants shaped [1,3,1,1].
    x = b.op("Sub", [INPUT, b.const("norm_mean", f32([0.1, -0.05, 0.0]).reshape(1, 3, 1, 1))])
    x = b.op("Div", [x, b.const("norm_std", f32([1.1, 0.9, 1.0]).reshape(1, 3, 1, 1))])

    # Stem: Conv 3x3/2 with bias, TF-style asymmetric 'same' pads -> BN -> ReLU.   [N,16,16,16]
    x = b.conv(x, 3, 16, 3, stride=2, bias=True, pads=[0, 0, 1, 1])
    x = b.op("Relu", [b.batchnorm(x, 16)])
    # ResNet max pool 3x3/2, pads 1.                                               [N,16,8,8]
    x = b.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])

    # SE-ResNet basic block: conv-BN-ReLU-conv-BN-SE, + skip, ReLU.
    skip = x
    h = b.op("Relu", [b.batchnorm(b.conv(x, 16, 16, 3, gain=0.5), 16)])
    h = b.batchnorm(b.conv(h, 16, 16, 3, gain=0.5), 16)
    h = squeeze_excite(h, 16, 4)
    x = b.op("Relu", [b.op("Add", [h, skip])])

    # EfficientNet MBConv: 1x1 expand -> BN -> SiLU -> dw 3x3 -> BN -> SiLU -> SE (ReduceMean)
    # -> 1x1 project -> BN -> Dropout (identity at inference) -> + skip.
    skip = x
    h = silu(b.batchnorm(b.conv(x, 16, 32, 1, gain=0.5), 32))
    h = silu(b.batchnorm(b.conv(h, 32, 32, 3, group=32, gain=0.6), 32))
    h = squeeze_excite(h, 32, 8, pool="ReduceMean")
    h = b.batchnorm(b.conv(h, 32, 16, 1, gain=0.5), 16)
    h = b.op("Dropout", [h])
    x = b.op("Add", [h, skip])

    # MobileNetV2/V3 block: 1x1 -> BN -> ReLU6 (Clip) -> dw 3x3 -> BN -> HardSwish
    # -> SE with a hard-sigmoid gate -> 1x1 -> BN -> + skip.
    skip = x
    h = b.relu6(b.batchnorm(b.conv(x, 16, 32, 1, gain=0.5), 32))
    h = b.op("HardSwish", [b.batchnorm(b.conv(h, 32, 32, 3, group=32), 32)])
    h = squeeze_excite(h, 32, 8, gate="HardSigmoid")
    h = b.batchnorm(b.conv(h, 32, 16, 1, gain=0.5), 16)
    x = b.op("Add", [h, skip])

    # ASPP-like block: 1x1 | grouped 3x3 (4 groups) | dilated 3x3 (d=2), Sum of the three -> BN -> Tanh.
    third = 0.5 / np.sqrt(3.0)
    branches = [
        b.conv(x, 16, 16, 1, gain=third),
        b.conv(x, 16, 16, 3, group=4, gain=third),
        b.conv(x, 16, 16, 3, dilation=2, gain=third),
    ]
    x = b.op("Tanh", [b.batchnorm(b.op("Sum", branches), 16)])

    # Fire / Inception module: squeeze 1x1 -> [1x1 | 3x3 | avg pool 3x3 (count_include_pad=1) -> 1x1],
    # Concat along channels.                                                       [N,24,8,8]
    s = b.op("Relu", [b.conv(x, 16, 8, 1, bias=True)])
    e1 = b.op("Relu", [b.conv(s, 8, 8, 1, bias=True)])
    e3 = b.op("Relu", [b.conv(s, 8, 8, 3, bias=True)])
    pool = b.op("AveragePool", [s], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=1)
    ep = b.op("Relu", [b.conv(pool, 8, 8, 1, bias=True)])
    x = b.op("Concat", [e1, e3, ep], axis=1)

    # ShuffleNet channel shuffle, groups 2, as the legacy exporter writes x.view(n, g, C/g, h, w):
    # the batch size comes from Shape -> Gather(0) -> Unsqueeze, the rest are constants.
    groups, channels, height, width = 2, 24, 8, 8
    n = b.op("Gather", [b.op("Shape", [x]), b.const("gather_index", i64(0))], axis=0)
    n = b.op("Unsqueeze", [n, b.const("unsqueeze_axes", i64([0]))])
    split_shape = b.op(
        "Concat", [n] + [b.const("shape_part", i64([d])) for d in (groups, channels // groups, height, width)], axis=0
    )
    x = b.op("Reshape", [x, split_shape])
    x = b.op("Transpose", [x], perm=[0, 2, 1, 3, 4])
    merged_shape = b.op("Concat", [n] + [b.const("shape_part", i64([d])) for d in (channels, height, width)], axis=0)
    x = b.op("Reshape", [x, merged_shape])

    # AlexNet / GoogLeNet local response normalisation.
    x = b.op("LRN", [x], size=5, alpha=1e-4, beta=0.75, bias=1.0)

    # DenseNet layer: BN -> ReLU -> 3x3 (growth 8), Concat with its input.        [N,32,8,8]
    y = b.conv(b.op("Relu", [b.batchnorm(x, 24)]), 24, 8, 3)
    x = b.op("Concat", [x, y], axis=1)

    # PoolFormer token mixer: x + (avg pool 3x3 (count_include_pad=0) - x).
    pool = b.op("AveragePool", [x], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=0)
    x = b.op("Add", [x, b.op("Sub", [pool, x])])

    # ConvNeXt block: dw 7x7 -> NHWC -> LayerNorm -> Linear 4C -> GELU (erf) -> Linear C -> NCHW
    # -> layer scale [C,1,1] -> + skip.
    c = 32
    skip = x
    h = b.conv(x, c, c, 7, group=c, bias=True)
    h = b.op("Transpose", [h], perm=[0, 2, 3, 1])
    ln_scale = b.const("ln_scale", f32(rng.uniform(0.8, 1.2, c)))
    ln_bias = b.const("ln_bias", f32(rng.normal(0.0, 0.1, c)))
    h = b.op("LayerNormalization", [h, ln_scale, ln_bias], axis=-1, epsilon=1e-6)
    w1 = b.const("mlp_w", f32(rng.normal(0.0, np.sqrt(2.0 / c), (c, 4 * c))))
    b1 = b.const("mlp_b", f32(rng.normal(0.0, 0.1, 4 * c)))
    h = b.op("Add", [b.op("MatMul", [h, w1]), b1])
    # GELU as the exporter writes it before opset 20: x * (erf(x / sqrt(2)) + 1) * 0.5
    erf = b.op("Erf", [b.op("Div", [h, b.const("gelu_sqrt2", f32(np.sqrt(2.0)))])])
    h = b.op("Mul", [b.op("Mul", [h, b.op("Add", [erf, b.const("gelu_one", f32(1.0))])]), b.const("gelu_half", f32(0.5))])
    w2 = b.const("mlp_w", f32(rng.normal(0.0, np.sqrt(1.0 / (4 * c)), (4 * c, c))))
    b2 = b.const("mlp_b", f32(rng.normal(0.0, 0.1, c)))
    h = b.op("Add", [b.op("MatMul", [h, w2]), b2])
    h = b.op("Transpose", [h], perm=[0, 3, 1, 2])
    h = b.op("Mul", [h, b.const("layer_scale", f32(rng.uniform(0.2, 0.5, (c, 1, 1))))])
    x = b.op("Add", [h, skip])

    # Downsample: Conv 3x3/2 -> BN -> ReLU.                                         [N,32,4,4]
    x = b.op("Relu", [b.batchnorm(b.conv(x, c, c, 3, stride=2), c)])

    # Head: GAP -> Flatten -> BatchNorm1d, some no-ops (Unsqueeze/Squeeze, Identity, + zeros
    # from ConstantOfShape), Gemm (transB=1) -> ReLU -> Dropout -> Gemm (transB=0) -> Softmax.
    x = b.op("GlobalAveragePool", [x])
    x = b.op("Flatten", [x], axis=1)  # [N,32]
    # BatchNorm1d (on [N,C]) whose running statistics are "trained": measured with onnxruntime on
    # seeded calibration frames and rounded to 3 digits, so that last-bit differences between
    # runtimes or machines (almost) never change the file. Random frames differ little after
    # global pooling; this spreads them so that they get different top-1 classes, as real images
    # would.
    probe = b.model("ops_probe", [float_input(["N", 3, 32, 32])], [float_output(["N", c], name=x)], opset=OPS_OPSET)
    calibration = np.random.default_rng(SEED_OPS_CALIBRATION).standard_normal((64, 3, 32, 32)).astype(np.float32)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    (features,) = session.run([x], {INPUT: calibration})
    mean = [float(f"{v:.3g}") for v in features.mean(axis=0)]
    var = [float(f"{v:.3g}") for v in features.var(axis=0)]
    bn_params = [f32(np.ones(c)), f32(np.zeros(c)), f32(mean), f32(var)]
    x = b.op(
        "BatchNormalization",
        [x] + [b.const(prefix, v) for prefix, v in zip(["bn_gamma", "bn_beta", "bn_mean", "bn_var"], bn_params)],
        epsilon=1e-5,
    )
    x = b.op("Unsqueeze", [x, b.const("unsqueeze_axes", i64([2]))])  # [N,32,1]
    x = b.op("Squeeze", [x, b.const("squeeze_axes", i64([2]))])  # [N,32]
    x = b.op("Identity", [x])
    zeros = b.op(
        "ConstantOfShape",
        [b.const("zeros_shape", i64([1]))],
        value=numpy_helper.from_array(f32([0.0]), "value"),
    )
    x = b.op("Add", [x, zeros])
    hidden = 64
    x = b.op("Relu", [b.gemm(x, c, hidden)])
    x = b.op("Dropout", [x])
    w = rng.normal(0.0, OPS_LOGIT_GAIN * np.sqrt(1.0 / hidden), (hidden, 10))
    x = b.op("Gemm", [x, b.const("fc_w", f32(w)), b.const("fc_b", f32(rng.normal(0.0, 0.1, 10)))], transB=0)
    b.op("Softmax", [x], output=OUTPUT, axis=1)
    return b.model("ops", [float_input(["N", 3, 32, 32])], [float_output(["N", 10])], opset=OPS_OPSET)


def build_ops_rare():
    """The supported operators that the other committed models lack, each on the image's path
    (GatherND on its shape, which the import evaluates), ending in Softmax."""
    rng = np.random.default_rng(SEED_OPS_RARE_WEIGHTS)
    b = GraphBuilder(rng)
    c = 8
    x = b.conv(INPUT, 3, c, 3, bias=True)  # [N,8,16,16]
    x = b.op("Elu", [x], alpha=0.7)
    y = b.op("LeakyRelu", [b.conv(x, c, c, 3, group=c, bias=True)], alpha=0.2)
    z = b.op("Neg", [b.op("Abs", [b.conv(x, c, c, 1, bias=True)])])
    x = b.op("Add", [b.op("Max", [x, y]), b.op("Min", [y, z])])
    # Reciprocal of a value kept away from zero: 1 / (1 + softplus(x)).
    one = b.const("one", np.array(1.0, dtype=np.float32))
    x = b.op("Mul", [x, b.op("Reciprocal", [b.op("Add", [b.op("Softplus", [x]), one])])])
    x = b.op("Relu", [b.conv(x, c, 2 * c, 3, stride=2, bias=True)])  # [N,16,8,8]
    x = b.op("GlobalMaxPool", [x])  # [N,16,1,1]
    # Flatten through the batch size read from the shape: GatherND picks it.
    batch = b.op("GatherND", [b.op("Shape", [x]), b.const("batch_index", np.array([[0]], dtype=np.int64))])
    target = b.op("Concat", [batch, b.const("minus_one", np.array([-1], dtype=np.int64))], axis=0)
    x = b.op("Reshape", [x, target])  # [N,16]
    w = rng.normal(0.0, 2.0 * np.sqrt(1.0 / (2 * c)), (6, 2 * c)).astype(np.float32)
    bias = rng.normal(0.0, 0.1, 6).astype(np.float32)
    x = b.op("Gemm", [x, b.const("fc_w", w), b.const("fc_b", bias)], transB=1)
    b.op("Softmax", [x], output=OUTPUT, axis=1)
    return b.model("ops_rare", [float_input(["N", 3, 16, 16])], [float_output(["N", 6])])


# --------------------------------------------------------------------------
# MobileNetV2 benchmark model
# --------------------------------------------------------------------------

# (expansion t, output channels c, repeats n, first stride s), width multiplier 1.0.
MOBILENET_V2_SETTINGS = [
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
]


def inverted_residual(b, x, cin, cout, stride, expansion):
    """MobileNetV2 block: [1x1 expand -> BN -> ReLU6] -> 3x3 depthwise -> BN -> ReLU6 -> 1x1 project -> BN [+ skip]."""
    hidden = cin * expansion
    h = x
    if expansion != 1:
        h = b.relu6(b.batchnorm(b.conv(h, cin, hidden, 1), hidden))
    h = b.relu6(b.batchnorm(b.conv(h, hidden, hidden, 3, stride=stride, group=hidden), hidden))
    h = b.batchnorm(b.conv(h, hidden, cout, 1), cout)
    if stride == 1 and cin == cout:
        h = b.op("Add", [x, h])
    return h


def build_mobilenet_v2():
    """MobileNetV2 (1.0, 224) as an unfolded PyTorch export would look, with random He-scaled weights."""
    b = GraphBuilder(np.random.default_rng(SEED_MOBILENET))
    x = b.relu6(b.batchnorm(b.conv(INPUT, 3, 32, 3, stride=2), 32))
    cin = 32
    for expansion, cout, repeats, first_stride in MOBILENET_V2_SETTINGS:
        for i in range(repeats):
            x = inverted_residual(b, x, cin, cout, first_stride if i == 0 else 1, expansion)
            cin = cout
    x = b.relu6(b.batchnorm(b.conv(x, cin, 1280, 1), 1280))
    x = b.op("GlobalAveragePool", [x])
    x = b.op("Flatten", [x], axis=1)
    b.gemm(x, 1280, 1000, output=OUTPUT)
    return b.model("mobilenet_v2", [float_input(["N", 3, 224, 224])], [float_output(["N", 1000])])


def bottleneck(b, x, cin, width, stride):
    """ResNet-50 v1.5 bottleneck: 1x1 -> 3x3 (stride) -> 1x1 (4x width), projection shortcut where the shape changes."""
    cout = width * 4
    h = b.op("Relu", [b.batchnorm(b.conv(x, cin, width, 1), width)])
    h = b.op("Relu", [b.batchnorm(b.conv(h, width, width, 3, stride=stride), width)])
    h = b.batchnorm(b.conv(h, width, cout, 1, gain=0.5), cout)
    if stride != 1 or cin != cout:
        x = b.batchnorm(b.conv(x, cin, cout, 1, stride=stride), cout)
    return b.op("Relu", [b.op("Add", [x, h])])


def build_resnet50():
    """ResNet-50 (224) as torchvision exports it, with random He-scaled weights."""
    b = GraphBuilder(np.random.default_rng(SEED_RESNET50))
    x = b.op("Relu", [b.batchnorm(b.conv(INPUT, 3, 64, 7, stride=2), 64)])
    x = b.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for width, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
        for i in range(blocks):
            x = bottleneck(b, x, cin, width, stride if i == 0 else 1)
            cin = width * 4
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    b.gemm(x, 2048, 1000, output=OUTPUT)
    return b.model("resnet50", [float_input(["N", 3, 224, 224])], [float_output(["N", 1000])])


def swish(b, x):
    """SiLU as PyTorch exports it: Sigmoid then Mul."""
    return b.op("Mul", [x, b.op("Sigmoid", [x])])


# (expansion, kernel, stride, output channels, repeats) of EfficientNet-B0.
EFFICIENTNET_B0_SETTINGS = [
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
]


def mbconv(b, x, cin, cout, kernel, stride, expansion):
    """EfficientNet MBConv: 1x1 expand -> depthwise -> squeeze-and-excitation -> 1x1 project [+ skip]."""
    hidden = cin * expansion
    h = x
    if expansion != 1:
        h = swish(b, b.batchnorm(b.conv(h, cin, hidden, 1), hidden))
    h = swish(b, b.batchnorm(b.conv(h, hidden, hidden, kernel, stride=stride, group=hidden), hidden))
    squeeze = max(1, cin // 4)
    s = b.op("GlobalAveragePool", [h])
    s = swish(b, b.conv(s, hidden, squeeze, 1, bias=True))
    s = b.op("Sigmoid", [b.conv(s, squeeze, hidden, 1, bias=True)])
    h = b.op("Mul", [h, s])
    h = b.batchnorm(b.conv(h, hidden, cout, 1, gain=0.5), cout)
    if stride == 1 and cin == cout:
        h = b.op("Add", [x, h])
    return h


def build_efficientnet_b0():
    """EfficientNet-B0 (224) as torchvision exports it, with random He-scaled weights."""
    b = GraphBuilder(np.random.default_rng(SEED_EFFICIENTNET))
    x = swish(b, b.batchnorm(b.conv(INPUT, 3, 32, 3, stride=2), 32))
    cin = 32
    for expansion, kernel, stride, cout, repeats in EFFICIENTNET_B0_SETTINGS:
        for i in range(repeats):
            x = mbconv(b, x, cin, cout, kernel, stride if i == 0 else 1, expansion)
            cin = cout
    x = swish(b, b.batchnorm(b.conv(x, cin, 1280, 1), 1280))
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    b.gemm(x, 1280, 1000, output=OUTPUT)
    return b.model("efficientnet_b0", [float_input(["N", 3, 224, 224])], [float_output(["N", 1000])])


# --------------------------------------------------------------------------
# Bad models (error-handling tests)
# --------------------------------------------------------------------------


def build_two_inputs():
    """Two 4-D float inputs added together."""
    b = GraphBuilder()
    x = b.op("Add", ["image_a", "image_b"])
    b.op("Flatten", [b.op("GlobalAveragePool", [x])], output=OUTPUT, axis=1)
    inputs = [float_input([1, 3, 16, 16], "image_a"), float_input([1, 3, 16, 16], "image_b")]
    return b.model("two_inputs", inputs, [float_output([1, 3])])


def build_int_input():
    """int64 image input, cast to float inside the graph."""
    b = GraphBuilder()
    x = b.op("Cast", [INPUT], to=TensorProto.FLOAT)
    b.op("Flatten", [b.op("GlobalAveragePool", [x])], output=OUTPUT, axis=1)
    image = helper.make_tensor_value_info(INPUT, TensorProto.INT64, [1, 3, 16, 16])
    return b.model("int_input", [image], [float_output([1, 3])])


def build_rank3_input():
    """Rank-3 float input [1,3,16]."""
    b = GraphBuilder()
    b.op("ReduceMean", [INPUT], output=OUTPUT, axes=[2], keepdims=0)
    return b.model("rank3_input", [float_input([1, 3, 16])], [float_output([1, 3])])


def build_no_output():
    """A valid-looking graph whose graph.output list is empty (not checker-valid)."""
    b = GraphBuilder()
    b.op("Flatten", [b.op("GlobalAveragePool", [INPUT])], output=OUTPUT, axis=1)
    model = b.model("no_output", [float_input([1, 3, 16, 16])], [float_output([1, 3])])
    del model.graph.output[:]
    return model


def build_unsupported_op():
    """A node of an op type no runtime knows, in a custom domain (not checker-valid)."""
    domain = "com.example.nonexistent"
    b = GraphBuilder()
    x = b.op("FrobnicateImage", [INPUT], domain=domain)
    b.op("Flatten", [b.op("GlobalAveragePool", [x])], output=OUTPUT, axis=1)
    return b.model(
        "unsupported_op", [float_input([1, 3, 16, 16])], [float_output([1, 3])], extra_opsets=[(domain, 1)]
    )


def build_huge_input():
    """A colour classifier that declares an absurd 100000x100000 input (checker-valid)."""
    return build_colors(batch=1, height=100000, width=100000)


def build_five_channels():
    """Input [1,5,16,16]: neither axis 1 nor axis 3 holds 1 or 3 channels."""
    b = GraphBuilder()
    b.op("Flatten", [b.op("GlobalAveragePool", [INPUT])], output=OUTPUT, axis=1)
    return b.model("five_channels", [float_input([1, 5, 16, 16])], [float_output([1, 5])])


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


def report(path):
    print(f"wrote {path} ({path.stat().st_size} bytes)")


def save_model(model, path, check=True):
    if check:
        onnx.checker.check_model(model, full_check=True)
    onnx.save_model(model, str(path))
    report(path)


def save_text(path, lines):
    path.write_text("".join(f"{line}\n" for line in lines))
    report(path)


def save_bytes(path, data):
    path.write_bytes(data)
    report(path)


def save_external_data_model(path):
    """colors.onnx with its tensors stored in external data, then the weights file deleted."""
    model = build_colors()
    onnx.checker.check_model(model, full_check=True)
    weights = path.parent / "external_data.weights"
    if weights.exists():
        os.remove(weights)  # onnx appends to an existing weights file; start clean
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=weights.name,
        size_threshold=0,
    )
    os.remove(weights)
    report(path)


def round7(values):
    """Rounds to 7 significant digits; returns Python floats whose repr is short (e.g. 0.1234567)."""
    return [float(f"{v:.7g}") for v in np.ravel(values)]


def save_reference(model_path, json_path, input_shape, seed):
    """Runs a model in onnxruntime on a seeded random normal input and stores input and output.

    The input is rounded to 7 significant digits *before* it is run, so the
    JSON input (parsed back to float32) is exactly the tensor that produced
    the JSON output.
    """
    raw = np.random.default_rng(seed).standard_normal(input_shape).astype(np.float32)
    rounded = round7(raw)
    x = np.array(rounded, dtype=np.float32).reshape(input_shape)
    (y,) = cpu_session(model_path).run([OUTPUT], {INPUT: x})
    reference = {
        "input_shape": list(x.shape),
        "input": rounded,
        "output_shape": list(y.shape),
        "output": round7(y),
    }
    json_path.write_text(json.dumps(reference, separators=(",", ":")) + "\n")
    report(json_path)


# --------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------


def cpu_session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def run_once(path):
    """Loads a model, feeds ones of a concrete shape, checks the output is finite; returns the shapes."""
    session = cpu_session(path)
    feeds = {}
    for inp in session.get_inputs():
        shape = [CONCRETE_DIMS[d] if isinstance(d, str) else d for d in inp.shape]
        dtype = np.int64 if inp.type == "tensor(int64)" else np.float32
        feeds[inp.name] = np.ones(shape, dtype=dtype)
    outputs = session.run(None, feeds)
    for out in outputs:
        assert np.all(np.isfinite(out)), f"{path}: non-finite output"
    return [i.shape for i in session.get_inputs()], [o.shape for o in session.get_outputs()]


def softmax(logits):
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def check_colors(out_dir):
    """Every colour variant must classify a solid frame of each prototype correctly with p > 0.9."""
    frames = np.stack([np.broadcast_to(normalize_rgb(rgb)[:, None, None], (3, 16, 16)) for _, rgb in COLOR_CLASSES])
    variants = {
        "colors.onnx": lambda s: s.run([OUTPUT], {INPUT: frames})[0],
        "colors_nhwc.onnx": lambda s: s.run([OUTPUT], {INPUT: frames.transpose(0, 2, 3, 1).copy()})[0],
        "colors_b1.onnx": lambda s: np.concatenate([s.run([OUTPUT], {INPUT: f[None]})[0] for f in frames]),
        "colors_dynamic.onnx": lambda s: s.run([OUTPUT], {INPUT: np.tile(frames, (1, 1, 3, 2))})[0],
        "colors_logits.onnx": lambda s: softmax(s.run([OUTPUT], {INPUT: frames})[0]),
    }
    min_prob = 1.0
    for name, run in variants.items():
        probs = run(cpu_session(out_dir / name))
        for k, (label, _) in enumerate(COLOR_CLASSES):
            assert probs[k].argmax() == k, f"{name}: solid {label} classified as {COLOR_CLASSES[probs[k].argmax()][0]}"
            assert probs[k, k] > 0.9, f"{name}: solid {label} only p={probs[k, k]:.4f}"
            min_prob = min(min_prob, float(probs[k, k]))
    print(f"self-check: {len(variants)} colour models classify all {len(COLOR_CLASSES)} solid colours correctly "
          f"(lowest p = {min_prob:.6f})")


# Ops that ops.onnx must contain (what the PyTorch exports of the common torchvision classifiers use).
OPS_REQUIRED = {
    "Add", "AveragePool", "BatchNormalization", "Clip", "Concat", "ConstantOfShape", "Conv", "Div",
    "Dropout", "Erf", "Flatten", "Gather", "Gemm", "GlobalAveragePool", "HardSigmoid", "HardSwish",
    "Identity", "LRN", "LayerNormalization", "MatMul", "MaxPool", "Mul", "ReduceMean", "Relu", "Reshape",
    "Shape", "Sigmoid", "Softmax", "Squeeze", "Sub", "Sum", "Tanh", "Transpose", "Unsqueeze",
}  # fmt: skip


def check_ops(out_dir):
    """ops.onnx: op coverage, batch 1 == batch 3, reference reproduced, non-trivial probabilities."""
    path = out_dir / "ops.onnx"
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert OPS_REQUIRED <= ops, f"ops.onnx lacks {sorted(OPS_REQUIRED - ops)}"
    reference = json.loads((out_dir / "ops_reference.json").read_text())
    x = np.array(reference["input"], dtype=np.float32).reshape(reference["input_shape"])
    expected = np.array(reference["output"], dtype=np.float32).reshape(reference["output_shape"])
    session = cpu_session(path)
    (batch,) = session.run([OUTPUT], {INPUT: x})
    singles = np.concatenate([session.run([OUTPUT], {INPUT: frame[None]})[0] for frame in x])
    assert np.allclose(batch, expected, rtol=1e-5, atol=1e-6), "ops.onnx: reference not reproduced"
    assert np.allclose(singles, batch, rtol=1e-4, atol=1e-6), "ops.onnx: batch 1 and batch 3 differ"
    assert np.allclose(batch.sum(axis=1), 1.0, atol=1e-5), "ops.onnx: rows do not sum to 1"
    top1, confidence = batch.argmax(axis=1), batch.max(axis=1)
    assert np.all((confidence > 0.2) & (confidence < 0.95)), f"ops.onnx: top-1 confidences {confidence}"
    assert len(set(top1.tolist())) > 1, f"ops.onnx: every reference frame has top-1 {top1[0]}"
    print(f"self-check: ops.onnx has {len(ops)} op types; reference top-1 {top1.tolist()} "
          f"with p = {[round(float(c), 4) for c in confidence]}; batch 1 == batch 3")


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="output folder")
    parser.add_argument("--bench", action="store_true", help="also write the benchmark models (MobileNetV2, ResNet-50, EfficientNet-B0)")
    args = parser.parse_args()
    out = args.out
    bad = out / "bad"
    bad.mkdir(parents=True, exist_ok=True)

    valid_models = {
        "colors.onnx": build_colors(),
        "colors_nhwc.onnx": build_colors(nhwc=True),
        "colors_b1.onnx": build_colors(batch=1),
        "colors_dynamic.onnx": build_colors(height="H", width="W"),
        "colors_logits.onnx": build_colors(softmax=False),
        "cnn.onnx": build_cnn(),
        "ops.onnx": build_ops(),
        "big_activations.onnx": build_big_activations(),
        "big_logits.onnx": build_big_logits(),
        "big_middle.onnx": build_big_middle(),
        "ops_rare.onnx": build_ops_rare(),
    }
    if args.bench:
        valid_models["mobilenet_v2_224.onnx"] = build_mobilenet_v2()
        valid_models["resnet50_224.onnx"] = build_resnet50()
        valid_models["efficientnet_b0_224.onnx"] = build_efficientnet_b0()

    for name, model in valid_models.items():
        save_model(model, out / name)
    save_text(out / "colors.txt", [label for label, _ in COLOR_CLASSES])
    save_text(out / "cnn.txt", [f"class{i}" for i in range(10)])
    save_text(out / "ops.txt", OPS_LABELS)
    if args.bench:
        for name in ["mobilenet_v2_224", "resnet50_224", "efficientnet_b0_224"]:
            save_text(out / f"{name}.txt", [f"class{i}" for i in range(1000)])

    save_reference(out / "cnn.onnx", out / "cnn_reference.json", (3, 3, 32, 32), SEED_CNN_REFERENCE)
    save_reference(out / "colors.onnx", out / "colors_reference.json", (2, 3, 16, 16), SEED_COLORS_REFERENCE)
    save_reference(out / "ops.onnx", out / "ops_reference.json", (3, 3, 32, 32), SEED_OPS_REFERENCE)
    save_reference(
        out / "big_activations.onnx", out / "big_activations_reference.json", (2, 3, 16, 16), SEED_BIG_REFERENCE
    )
    save_reference(
        out / "big_logits.onnx", out / "big_logits_reference.json", (2, 3, 16, 16), SEED_BIG_LOGITS_REFERENCE
    )
    save_reference(
        out / "big_middle.onnx", out / "big_middle_reference.json", (2, 3, 16, 16), SEED_BIG_MIDDLE_REFERENCE
    )
    save_reference(out / "ops_rare.onnx", out / "ops_rare_reference.json", (3, 3, 16, 16), SEED_OPS_RARE_REFERENCE)

    # Bad models: the first three are valid ONNX, just not something the element accepts.
    save_model(build_two_inputs(), bad / "two_inputs.onnx")
    save_model(build_int_input(), bad / "int_input.onnx")
    save_model(build_rank3_input(), bad / "rank3_input.onnx")
    save_model(build_no_output(), bad / "no_output.onnx", check=False)
    save_model(build_unsupported_op(), bad / "unsupported_op.onnx", check=False)
    save_model(build_huge_input(), bad / "huge_input.onnx")
    save_model(build_five_channels(), bad / "five_channels.onnx")
    save_external_data_model(bad / "external_data.onnx")
    colors_bytes = (out / "colors.onnx").read_bytes()
    save_bytes(bad / "truncated.onnx", colors_bytes[: len(colors_bytes) // 2])
    save_bytes(bad / "random.bin", np.random.default_rng(SEED_RANDOM_BIN).bytes(4096))
    save_bytes(bad / "empty.onnx", b"")

    # Verification: every valid model loads and runs in onnxruntime.
    for name in valid_models:
        inputs, outputs = run_once(out / name)
        print(f"ok: {name} runs in onnxruntime, inputs {inputs} -> outputs {outputs}")
    for name in ["two_inputs.onnx", "int_input.onnx", "rank3_input.onnx"]:
        inputs, outputs = run_once(bad / name)
        print(f"ok: bad/{name} runs in onnxruntime, inputs {inputs} -> outputs {outputs}")
    check_colors(out)
    check_ops(out)


if __name__ == "__main__":
    main()
