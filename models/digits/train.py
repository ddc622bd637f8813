#!/usr/bin/env python3
"""Train the digits classifier: a small CNN on real data, to measure what a precision costs
in accuracy (fp32, fp16, and the quantized precisions) where random weights cannot tell.

Usage:
    pip install numpy scikit-learn onnx onnxruntime
    python3 models/digits/train.py [--out DIR]

The data is scikit-learn's bundled handwritten digits (1,797 images of 8×8 pixels, 0-16,
from UCI; they ship inside the package, so nothing is downloaded), split 80/20 with a fixed
seed, stratified by class. Each image becomes a 32×32 frame by repeating every pixel 4×4
(nearest-neighbour, so that any program can rebuild the exact frame from the 8×8 values),
grey in all three channels, pixel = round(value × 255 / 16). The model takes the element's
default preprocessing: RGB, input = (pixel / 255 − mean) / std with ImageNet's mean and
std, so `trtclassify onnx-location=models/digits/digits.onnx` needs no other property.

The network (about 7,700 parameters) is three 3×3 convolutions with ReLU (16, 16 and 32
channels, so that the second and third suit 8-bit tensor cores and are quantized in int8
and fp8; 2×2 max pooling after the first two), global average pooling, a fully connected
layer and a softmax, trained here in numpy (Adam, cross-entropy; seeded, so that a run
gives the same weights on the same numpy) in a few minutes on one core.

Writes, beside this script (or to --out):
    digits.onnx          the model (opset 13, input "image" [N, 3, 32, 32], output "scores")
    digits.txt           its labels, 0 to 9
    digits_heldout.json  the 359 held-out images (8×8 values), their labels, and the model's
                         held-out accuracy in onnxruntime (fp32), which the tests and the
                         accuracy benchmark compare each backend and precision with
    digits_calibration.json  128 training images (8×8 values), for calibrating the
                         quantized precisions on frames the held-out ones are not among
"""

import argparse
import json
import pathlib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
SIZE = 32
SEED = 7
CALIBRATION = 128


def frames(values):
    """8×8 digit values (0-16) to the 32×32 grey frames' pixels (0-255), [N, 32, 32]."""
    pixels = np.rint(values.reshape(-1, 8, 8) * 255.0 / 16.0).astype(np.uint8)
    return pixels.repeat(SIZE // 8, axis=1).repeat(SIZE // 8, axis=2)


def model_input(pixels):
    """Frames' pixels to the model's input, [N, 3, 32, 32], as the element preprocesses."""
    x = pixels.astype(np.float32)[:, None, :, :] / 255.0
    return ((x - MEAN[None, :, None, None]) / STD[None, :, None, None]).astype(np.float32)


def split(values, labels):
    """A stratified 80/20 split with a fixed seed."""
    rng = np.random.default_rng(SEED)
    train, test = [], []
    for c in range(10):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        n_test = round(len(idx) * 0.2)
        test.extend(idx[:n_test])
        train.extend(idx[n_test:])
    return np.sort(train), np.sort(test)


# The layers, forward and backward, on NCHW arrays.


def conv(x, w, b):
    """3×3 convolution, stride 1, padding 1; returns the output and the unfolded input."""
    n, c, h, wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    cols = np.stack(
        [xp[:, :, ky : ky + h, kx : kx + wd] for ky in range(3) for kx in range(3)], axis=2
    ).reshape(n, c * 9, h * wd)
    out = np.einsum("kc,ncp->nkp", w.reshape(w.shape[0], -1), cols, optimize=True)
    return (out + b[None, :, None]).reshape(n, -1, h, wd), cols


def conv_back(dout, x_shape, w, cols):
    n, c, h, wd = x_shape
    d = dout.reshape(n, w.shape[0], h * wd)
    dw = np.einsum("nkp,ncp->kc", d, cols, optimize=True).reshape(w.shape)
    db = d.sum(axis=(0, 2))
    dcols = np.einsum("kc,nkp->ncp", w.reshape(w.shape[0], -1), d, optimize=True)
    dcols = dcols.reshape(n, c, 9, h, wd)
    dxp = np.zeros((n, c, h + 2, wd + 2), np.float32)
    for ky in range(3):
        for kx in range(3):
            dxp[:, :, ky : ky + h, kx : kx + wd] += dcols[:, :, ky * 3 + kx]
    return dxp[:, :, 1:-1, 1:-1], dw, db


def pool(x):
    n, c, h, w = x.shape
    r = x.reshape(n, c, h // 2, 2, w // 2, 2)
    out = r.max(axis=(3, 5))
    mask = r == out[:, :, :, None, :, None]
    return out, mask


def pool_back(dout, mask):
    d = mask * dout[:, :, :, None, :, None]
    n, c, h2, _, w2, _ = d.shape
    return d.reshape(n, c, h2 * 2, w2 * 2)


def forward(p, x, keep=False):
    a1, cols1 = conv(x, p["w1"], p["b1"])
    r1 = np.maximum(a1, 0)
    p1, m1 = pool(r1)
    a2, cols2 = conv(p1, p["w2"], p["b2"])
    r2 = np.maximum(a2, 0)
    p2, m2 = pool(r2)
    a3, cols3 = conv(p2, p["w3"], p["b3"])
    r3 = np.maximum(a3, 0)
    g = r3.mean(axis=(2, 3))
    logits = g @ p["wf"].T + p["bf"]
    if not keep:
        return logits
    return logits, (x, a1, cols1, p1, m1, a2, cols2, p2, m2, a3, cols3, g)


def gradients(p, x, y):
    logits, (x, a1, cols1, p1, m1, a2, cols2, p2, m2, a3, cols3, g) = forward(p, x, True)
    z = logits - logits.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    n = len(y)
    loss = -np.log(prob[np.arange(n), y] + 1e-12).mean()
    dl = prob
    dl[np.arange(n), y] -= 1
    dl /= n
    grads = {"wf": dl.T @ g, "bf": dl.sum(axis=0)}
    dg = dl @ p["wf"]
    dr3 = np.broadcast_to(dg[:, :, None, None] / (a3.shape[2] * a3.shape[3]), a3.shape)
    da3 = dr3 * (a3 > 0)
    dp2, grads["w3"], grads["b3"] = conv_back(da3, p2.shape, p["w3"], cols3)
    da2 = pool_back(dp2, m2) * (a2 > 0)
    dp1, grads["w2"], grads["b2"] = conv_back(da2, p1.shape, p["w2"], cols2)
    da1 = pool_back(dp1, m1) * (a1 > 0)
    _, grads["w1"], grads["b1"] = conv_back(da1, x.shape, p["w1"], cols1)
    return loss, grads


def train(x, y, epochs=40, batch=32):
    rng = np.random.default_rng(SEED)

    def he(*shape):
        fan_in = int(np.prod(shape[1:]))
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    p = {
        "w1": he(16, 3, 3, 3),
        "b1": np.zeros(16, np.float32),
        "w2": he(16, 16, 3, 3),
        "b2": np.zeros(16, np.float32),
        "w3": he(32, 16, 3, 3),
        "b3": np.zeros(32, np.float32),
        "wf": he(10, 32),
        "bf": np.zeros(10, np.float32),
    }
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(v) for k, v in p.items()}
    step = 0
    for epoch in range(epochs):
        lr = 0.01 * 0.5 * (1 + np.cos(np.pi * epoch / epochs))
        order = rng.permutation(len(y))
        losses = []
        for i in range(0, len(y), batch):
            idx = order[i : i + batch]
            loss, grads = gradients(p, x[idx], y[idx])
            losses.append(loss)
            step += 1
            for k in p:
                m[k] = 0.9 * m[k] + 0.1 * grads[k]
                v[k] = 0.999 * v[k] + 0.001 * grads[k] ** 2
                mh = m[k] / (1 - 0.9**step)
                vh = v[k] / (1 - 0.999**step)
                p[k] = (p[k] - lr * mh / (np.sqrt(vh) + 1e-8)).astype(np.float32)
        if epoch % 10 == 9 or epoch == epochs - 1:
            print(f"epoch {epoch + 1}: loss {np.mean(losses):.4f}")
    return p


def to_onnx(p):
    inits = [numpy_helper.from_array(p[k], k) for k in ["w1", "b1", "w2", "b2", "w3", "b3", "wf", "bf"]]
    nodes = [
        helper.make_node("Conv", ["image", "w1", "b1"], ["a1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["a1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["a2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["a2"], ["r2"], name="relu2"),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2], name="pool2"),
        helper.make_node("Conv", ["p2", "w3", "b3"], ["a3"], pads=[1, 1, 1, 1], name="conv3"),
        helper.make_node("Relu", ["a3"], ["r3"], name="relu3"),
        helper.make_node("GlobalAveragePool", ["r3"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["scores"], axis=1, name="softmax"),
    ]
    graph = helper.make_graph(
        nodes,
        "digits",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main():
    from sklearn.datasets import load_digits
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent)
    args = ap.parse_args()

    digits = load_digits()
    values, labels = digits.data.astype(np.float32), digits.target.astype(np.int64)
    train_idx, test_idx = split(values, labels)
    x_train = model_input(frames(values[train_idx]))
    x_test = model_input(frames(values[test_idx]))
    p = train(x_train, labels[train_idx])
    numpy_acc = float((forward(p, x_test).argmax(axis=1) == labels[test_idx]).mean())

    model = to_onnx(p)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "digits.onnx"
    onnx.save(model, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    scores = session.run(None, {"image": x_test})[0]
    correct = int((scores.argmax(axis=1) == labels[test_idx]).sum())
    accuracy = correct / len(test_idx)
    print(f"held-out accuracy: numpy {numpy_acc:.4f}, onnxruntime {accuracy:.4f} ({correct}/{len(test_idx)})")
    assert abs(accuracy - numpy_acc) < 1e-9, "onnxruntime disagrees with the training code"
    (args.out / "digits.txt").write_text("".join(f"{d}\n" for d in range(10)))
    heldout = {
        "about": "scikit-learn's digits, held out from training (models/digits/train.py): "
        "8x8 values 0-16, each pixel repeated 4x4 into a 32x32 grey frame, "
        "pixel = round(value * 255 / 16)",
        "onnxruntime_fp32_accuracy": accuracy,
        "onnxruntime_fp32_correct": correct,
        "labels": labels[test_idx].tolist(),
        "values": values[test_idx].astype(int).tolist(),
    }
    (args.out / "digits_heldout.json").write_text(json.dumps(heldout, separators=(",", ":")) + "\n")
    # Training images, a seeded sample with every digit, for calibration.
    pick = np.random.default_rng(SEED).permutation(train_idx)[:CALIBRATION]
    calibration = {
        "about": "scikit-learn's digits, a sample of the training images (models/digits/train.py), "
        "for calibrating quantized engines; the frames are made as for digits_heldout.json",
        "labels": labels[pick].tolist(),
        "values": values[pick].astype(int).tolist(),
    }
    (args.out / "digits_calibration.json").write_text(
        json.dumps(calibration, separators=(",", ":")) + "\n"
    )
    print(f"wrote {path}, digits.txt, digits_heldout.json, digits_calibration.json")


if __name__ == "__main__":
    main()
