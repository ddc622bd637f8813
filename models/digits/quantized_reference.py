#!/usr/bin/env python3
"""onnxruntime's scores for the digits classifier quantized as trtclassify quantizes it, the
reference the compiler's quantized plans are checked against.

Usage:
    pip install numpy onnx onnxruntime
    python3 models/digits/quantized_reference.py

Reads digits.onnx and digits_calibration.txt (the calibration table trtclassify makes from
digits_calibration.json: `TRTCLASSIFY_BLESS=1 cargo test -p trtclassify-compiler --lib
calibration_makes_the_committed_digits_table`), and for int8 and fp8 builds a QDQ model:
every convolution the table names reads its input through QuantizeLinear/DequantizeLinear
with one scale (int8: its entropy range / 127; fp8: its largest value / 448) and its
weights with one scale per filter (the filter's largest magnitude / 127 or / 448),
symmetric, rounded to nearest even, saturating (fp8: E4M3FN, opset 19). The session runs
without graph optimisations: the QDQ nodes evaluated as written (onnxruntime 1.32's
optimiser fuses the fp8 ones into something that classifies 11 % right). Writes
digits_quantized_reference.json: each format's scores on digits_heldout.json's frames, and
its held-out accuracy.
"""

import json
import pathlib

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

HERE = pathlib.Path(__file__).parent
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
FORMATS = {
    # name: (zero point type, largest value, table column of the input's range)
    "int8": (TensorProto.INT8, np.float32(127.0), 1),
    "fp8": (TensorProto.FLOAT8E4M3FN, np.float32(448.0), 0),
}


def read_table(path):
    lines = path.read_text().splitlines()
    assert lines[0] == "trtclassify-calibration 1", lines[0]
    table = {}
    for line in lines[2:]:
        if line.startswith("#") or not line:
            continue
        name, *values = line.split("\t")
        table[name] = [np.float32(v) for v in values]
    return table


def quantized(model, table, fmt):
    zp_type, largest, column = FORMATS[fmt]
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    nodes = []
    for node in graph.node:
        if node.name in table:
            x, w = node.input[0], node.input[1]
            x_scale = np.float32(table[node.name][column] / largest)
            weights = numpy_helper.to_array(inits[w])
            w_scale = (np.abs(weights).reshape(len(weights), -1).max(axis=1) / largest).astype(np.float32)
            extra = [
                numpy_helper.from_array(np.array(x_scale, np.float32), f"{x}_scale"),
                helper.make_tensor(f"{x}_zero", zp_type, [], [0]),
                numpy_helper.from_array(w_scale, f"{w}_scale"),
                helper.make_tensor(f"{w}_zero", zp_type, [len(w_scale)], [0] * len(w_scale)),
            ]
            graph.initializer.extend(extra)
            nodes += [
                helper.make_node("QuantizeLinear", [x, f"{x}_scale", f"{x}_zero"], [f"{x}_q"]),
                helper.make_node("DequantizeLinear", [f"{x}_q", f"{x}_scale", f"{x}_zero"], [f"{x}_dq"]),
                helper.make_node("QuantizeLinear", [w, f"{w}_scale", f"{w}_zero"], [f"{w}_q"], axis=0),
                helper.make_node("DequantizeLinear", [f"{w}_q", f"{w}_scale", f"{w}_zero"], [f"{w}_dq"], axis=0),
            ]
            node.input[0], node.input[1] = f"{x}_dq", f"{w}_dq"
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    del model.opset_import[:]
    model.opset_import.extend([helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def main():
    table = read_table(HERE / "digits_calibration.txt")
    heldout = json.loads((HERE / "digits_heldout.json").read_text())
    values = np.array(heldout["values"], np.float32)
    labels = np.array(heldout["labels"])
    pixels = np.rint(values.reshape(-1, 8, 8) * 255.0 / 16.0).astype(np.uint8).repeat(4, axis=1).repeat(4, axis=2)
    x = pixels.astype(np.float32)[:, None, :, :] / 255.0
    x = ((x - MEAN[None, :, None, None]) / STD[None, :, None, None]).astype(np.float32)
    out = {
        "about": "onnxruntime's scores for models/digits/digits.onnx quantized as "
        "digits_calibration.txt says, on digits_heldout.json (quantized_reference.py)",
        "nodes": sorted(table),
    }
    for fmt in FORMATS:
        model = quantized(onnx.load(HERE / "digits.onnx"), table, fmt)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        scores = session.run(None, {"image": x})[0]
        accuracy = float((scores.argmax(axis=1) == labels).mean())
        print(f"{fmt}: held-out accuracy {accuracy:.4f}")
        out[fmt] = {
            "accuracy": accuracy,
            "scores": [float(f"{v:.6g}") for v in scores.reshape(-1)],
        }
    path = HERE / "digits_quantized_reference.json"
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
