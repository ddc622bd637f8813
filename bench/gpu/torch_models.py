#!/usr/bin/env python3
"""torchvision classifiers for trtclassify's GPU work: ONNX exports with references, and a PyTorch baseline.

Runs on the GPU host (PyTorch + torchvision + onnx + onnxruntime); nothing is downloaded:
every model is built with weights=None and seeded random initialisation.

    python3 bench/gpu/torch_models.py export OUTDIR [--models resnet50,mobilenet_v2,...]
    python3 bench/gpu/torch_models.py bench --json OUT.json [--models ...] [--batches 1,8,64] [--runs 50]

export: for each model, OUTDIR/NAME.onnx (opset 17, legacy TorchScript exporter, dynamic batch
"N", input "image" [N,3,224,224], output "probs" [N,1000] ending in Softmax, weights inline),
OUTDIR/NAME.input.bin (4 float32 little-endian NCHW images, numpy default_rng(7) standard
normal) and OUTDIR/NAME.ref.json (onnxruntime CPU outputs and top-5 for that input).

A model is a torchvision name (`vit_b_16`), `vit_ti_16` (torchvision's ViT class in DeiT-Tiny's
shape: 12 layers of width 192, 3 heads), or `timm.NAME` for timm's hybrids and DeiT (timm
only needs importing: carry its wheel to the GPU host, it is pure Python), with `@13`..`@20`
for another opset or `@dynamo` for the dynamo exporter (torch.export, its default opset);
the files are named with a dot there: `vit_b_16.opset13.onnx`, `swin_t.dynamo.onnx`.

bench: PyTorch fp16, channels_last, cudnn.benchmark, on cuda:0: median latency of single
forward passes, eager and replayed from a CUDA graph, each pass timed alone with CUDA events.

So that random weights give answers that depend on the frame (and stay well inside fp16
range), every model is calibrated on 16 seeded random frames before use: BatchNorm layers get
random affine parameters and running statistics measured on those frames, and the last layer
(export only) gets a folded feature standardisation and a scale that spreads the logits to a
std of 3. Only values change, never the architecture. All of it runs on the CPU, in fp32, and
is deterministic for a given torch/torchvision version and machine.
"""

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torchvision

EXPORT_MODELS = [
    "resnet50",
    "mobilenet_v2",
    "efficientnet_b0",
    "mobilenet_v3_small",
    "squeezenet1_0",
    "shufflenet_v2_x1_0",
    "regnet_y_400mf",
    "densenet121",
    "convnext_tiny",
    "vit_b_16",
    "swin_t",
]
# Issue 13's families: ViT-L, Swin v2, MaxViT (torchvision); DeiT and the mobile hybrids
# (timm); other opsets and the dynamo exporter.
FAMILY_MODELS = [
    "vit_l_16",
    "swin_v2_t",
    "maxvit_t",
    "timm.deit_small_distilled_patch16_224",
    "timm.mobilevit_xs",
    "timm.mobilevitv2_050",
    "timm.efficientformer_l1",
    "timm.efficientformerv2_s0",
    "timm.levit_128s",
    "vit_b_16@14",
    "swin_t@18",
    "convnext_tiny@13",
    "vit_b_16@dynamo",
    "swin_t@dynamo",
    "timm.levit_128s@dynamo",
]
BENCH_MODELS = ["resnet50", "mobilenet_v2", "efficientnet_b0", "vit_b_16", "swin_t"]
# Architectures torchvision has the class of but no name for.
CUSTOM_MODELS = {
    # DeiT-Tiny's shape: the small ViT an edge CPU runs.
    "vit_ti_16": lambda: torchvision.models.VisionTransformer(
        image_size=224, patch_size=16, num_layers=12, num_heads=3, hidden_dim=192, mlp_dim=768
    ),
}

OPSET = 17
INPUT_NAME = "image"
OUTPUT_NAME = "probs"
TORCH_SEED = 0  # torch.manual_seed before building a model: weights, then BatchNorm affine parameters
INPUT_SEED = 7  # numpy default_rng seed of the reference input
INPUT_SHAPE = (4, 3, 224, 224)
CALIBRATION_SEED = 1  # torch.Generator seed of the frames BatchNorm and the classifier are calibrated on
CALIBRATION_BATCH = 16
LOGIT_STD = 3.0  # wanted spread (std over the 1000 classes) of the logits on calibration frames
FEATURE_STD_FLOOR = 0.1  # classifier standardisation: std floor, relative to the feature's (and the mean) rms
BATCHNORM_TYPES = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


def parse_list(text, kind=str):
    return [kind(item.strip()) for item in text.split(",") if item.strip()]


def parse_model(spec):
    """`timm.levit_128s@dynamo` -> ("timm", "levit_128s", "dynamo"); `vit_b_16@13` -> ("torchvision", "vit_b_16", 13)."""
    name, _, variant = spec.partition("@")
    source, _, bare = name.rpartition(".")
    exporter = OPSET if not variant else variant if variant == "dynamo" else int(variant)
    return source or "torchvision", bare, exporter


def file_stem(spec):
    """The files' name: `vit_b_16@13` -> `vit_b_16.opset13`, `swin_t@dynamo` -> `swin_t.dynamo`."""
    name, _, variant = spec.partition("@")
    if not variant:
        return name
    return f"{name}.{variant}" if variant == "dynamo" else f"{name}.opset{variant}"


def check_model_names(specs):
    known = set(torchvision.models.list_models()) | set(CUSTOM_MODELS)
    unknown = []
    for spec in specs:
        source, name, exporter = parse_model(spec)
        if source == "timm":
            import timm

            if name not in timm.list_models():
                unknown.append(spec)
        elif source != "torchvision" or name not in known:
            unknown.append(spec)
        if exporter != "dynamo" and not 13 <= exporter <= 20:
            unknown.append(spec)
    if unknown:
        sys.exit(f"unknown model(s): {', '.join(unknown)}")


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def classifier_layer(model):
    """The layer that produces the 1000 logits: the last Linear, else (SqueezeNet) the last Conv2d."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    layer = linears[-1] if linears else [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)][-1]
    if isinstance(layer, torch.nn.Linear):
        assert layer.out_features == 1000, f"last Linear has {layer.out_features} outputs"
    else:
        assert layer.out_channels == 1000 and layer.kernel_size == (1, 1) and layer.groups == 1, layer
    return layer


def calibration_frames():
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randn(CALIBRATION_BATCH, 3, 224, 224, generator=generator)


@torch.no_grad()
def calibrate_batchnorm(model, frames):
    """Random affine parameters, then running statistics measured on the frames, as training leaves them.

    Statistics drawn at random instead (say mean ~ N(0, 0.1), var ~ U(0.5, 1.5)) do not
    match what the random convolutions produce: the activations then either drift far from
    unit scale or lose the input altogether (in MobileNetV2, EfficientNet-B0 and
    MobileNetV3 the pooled features of different random frames then agree to 1e-7, so every
    frame gets the same scores). Measured statistics keep every BatchNorm output at about
    gamma * N(0, 1) + beta, like a trained network's.
    """
    layers = [m for m in model.modules() if isinstance(m, BATCHNORM_TYPES) and m.track_running_stats]
    momenta = [m.momentum for m in layers]
    for m in layers:
        if m.affine:
            m.weight.uniform_(0.5, 1.5)
            m.bias.normal_(0.0, 0.1)
        m.reset_running_stats()
        m.momentum = None  # cumulative average: after one batch, exactly that batch's statistics
        m.train()
    try:
        model(frames)  # only the BatchNorm layers are in training mode (Dropout etc. stay in eval)
    finally:
        for m, momentum in zip(layers, momenta):
            m.momentum = momentum
            m.eval()
    for m in layers:  # a channel that was constant on the frames must not amplify others later
        m.running_var.clamp_(min=1e-3 * float(m.running_var.mean()) + 1e-12)


@torch.no_grad()
def calibrate_classifier(model, frames):
    """Makes the random classifier respond to its input like a trained one.

    Random frames give similar pooled features (a common part, plus a smaller part that
    depends on the frame), so a random last layer gives every frame the same answer. This
    folds a per-feature standardisation (mean and std over the calibration frames, as a
    BatchNorm before the classifier would; the std floored at FEATURE_STD_FLOOR times the
    feature's rms, so that the layer cancels at most a modest common part and stays well
    conditioned in fp16) into the last layer's weight and bias, then scales both so the
    logits have a std of LOGIT_STD over the classes. Everything after that layer (ReLU and
    average pooling in SqueezeNet) is positively homogeneous, so the scaling is exact. The
    architecture, and so the exported graph, does not change.
    """
    layer = classifier_layer(model)
    if not layer.weight.any():
        # torchvision's ViT starts its head at zero (fine-tuning does the rest): every frame
        # would get the same logits whatever the scaling, so give it random weights first.
        torch.nn.init.normal_(layer.weight, std=0.02)
    captured = []
    handle = layer.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    try:
        model(frames)
    finally:
        handle.remove()
    features = captured[-1].double()  # [B,C] (Linear) or [B,C,H,W] (1x1 Conv2d)
    channels = features.shape[1]
    samples = features.transpose(0, 1).reshape(channels, -1)  # [C, B(*H*W)]
    mean = samples.mean(dim=1)
    rms = samples.square().mean(dim=1).sqrt()
    # Floors: FEATURE_STD_FLOOR times the feature's own rms (bounds the common part it cancels)
    # and times the mean rms of all features (a feature that was ~0 on every calibration frame,
    # a dead ReLU channel say, must not get a huge weight: it may not be 0 on other frames).
    floor = FEATURE_STD_FLOOR * torch.maximum(rms, rms.mean()) + 1e-30
    std = torch.maximum(samples.std(dim=1), floor)
    weight = layer.weight.double().reshape(layer.weight.shape[0], channels) / std  # [1000, C]
    layer.weight.copy_(weight.reshape(layer.weight.shape).to(layer.weight.dtype))
    if layer.bias is not None:  # MaxViT's head has none: the features' mean then stays in the logits
        bias = layer.bias.double() - weight @ mean
        layer.bias.copy_(bias.to(layer.bias.dtype))
    logits = model(frames).double()
    spread = float(logits.std(dim=1).mean())
    if not np.isfinite(spread) or spread <= 0.0:
        raise RuntimeError(f"classifier calibration failed: logit std {spread}")
    layer.weight.mul_(LOGIT_STD / spread)
    if layer.bias is not None:
        layer.bias.mul_(LOGIT_STD / spread)


def build_model(spec, calibrate=True):
    """Model SPEC: seeded random weights, calibrated BatchNorm and classifier, eval mode, + Softmax(dim=1)."""
    source, name, _ = parse_model(spec)
    torch.manual_seed(TORCH_SEED)
    if source == "timm":
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=1000)
    elif name in CUSTOM_MODELS:
        model = CUSTOM_MODELS[name]()
    else:
        model = torchvision.models.get_model(name, weights=None)
    model.eval()
    frames = calibration_frames()
    calibrate_batchnorm(model, frames)
    if calibrate:
        calibrate_classifier(model, frames)
    return torch.nn.Sequential(model, torch.nn.Softmax(dim=1)).eval()


@torch.no_grad()
def forward_with_max_activation(model, x):
    """Output of model(x), and the largest |value| any leaf module produced (fp16 overflows above 65504)."""
    largest = [0.0]

    def hook(module, args, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel():
            largest[0] = max(largest[0], float(output.detach().abs().max()))

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        y = model(x)
    finally:
        for handle in handles:
            handle.remove()
    return y, largest[0]


# --------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------


def graph_op_types(graph):
    """op_type of every node, subgraphs (If/Loop bodies) included."""
    ops = set()
    for node in graph.node:
        ops.add(node.op_type)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                ops |= graph_op_types(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    ops |= graph_op_types(sub)
    return ops


def float_list(values):
    """float32 values as Python floats that print back to the same float32 (9 significant digits)."""
    return [float(f"{v:.9g}") for v in np.ravel(values)]


def export_onnx(model, x, path, exporter):
    with torch.no_grad():
        if exporter == "dynamo":
            program = torch.onnx.export(
                model,
                (x,),
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_shapes=({0: torch.export.Dim("N", min=1, max=1024)},),
                dynamo=True,
            )
            program.save(str(path))
        else:
            torch.onnx.export(
                model,
                (x,),
                str(path),
                opset_version=exporter,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_axes={INPUT_NAME: {0: "N"}, OUTPUT_NAME: {0: "N"}},
                dynamo=False,
            )


def export_one(spec, outdir):
    name = file_stem(spec)
    model = build_model(spec)
    onnx_path = outdir / f"{name}.onnx"
    # The dynamo exporter specialises a dimension of 1: it traces two frames.
    frames = 2 if parse_model(spec)[2] == "dynamo" else 1
    x = torch.randn(frames, 3, 224, 224, generator=torch.Generator().manual_seed(TORCH_SEED))
    start = time.perf_counter()
    export_onnx(model, x, onnx_path, parse_model(spec)[2])
    export_s = time.perf_counter() - start

    proto = onnx.load(str(onnx_path), load_external_data=False)
    external = [t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise RuntimeError(f"{onnx_path}: {len(external)} tensors in external data, e.g. {external[0]}")
    onnx.checker.check_model(proto)
    ops = sorted(graph_op_types(proto.graph))
    del proto

    image = np.random.default_rng(INPUT_SEED).standard_normal(INPUT_SHAPE).astype(np.float32)
    input_file = f"{name}.input.bin"
    image.astype("<f4").tofile(outdir / input_file)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (probs,) = session.run([OUTPUT_NAME], {INPUT_NAME: image})
    if probs.shape != (INPUT_SHAPE[0], 1000) or not np.all(np.isfinite(probs)):
        raise RuntimeError(f"{onnx_path}: onnxruntime output {probs.shape}, finite={np.all(np.isfinite(probs))}")
    top5 = np.argsort(-probs, axis=1, kind="stable")[:, :5]

    # The same input through PyTorch (fp32, CPU): checks the export, and measures the largest
    # activation, which says whether an fp16 engine of this model can overflow.
    torch_probs, max_activation = forward_with_max_activation(model, torch.from_numpy(image))
    torch_diff = float(np.abs(torch_probs.numpy() - probs).max())
    # PyTorch's own fp16 error on this GPU (channels_last, as in the benchmark): the yardstick
    # for the error of our fp16 engine.
    fp16 = None
    if torch.cuda.is_available():
        half = copy.deepcopy(model).half().cuda().to(memory_format=torch.channels_last)
        with torch.no_grad():
            x16 = torch.from_numpy(image).half().cuda().to(memory_format=torch.channels_last)
            fp16 = half(x16).float().cpu().numpy()
        del half

    reference = {
        "model": spec,
        "input_seed": INPUT_SEED,
        "input_shape": list(INPUT_SHAPE),
        "input_file": input_file,
        "input_name": INPUT_NAME,
        "output_name": OUTPUT_NAME,
        "output": [float_list(row) for row in probs],
        "top5": top5.tolist(),
        "torch_vs_onnxruntime_max_abs_diff": torch_diff,
        # JSON has no NaN: PyTorch's fp16 output is left out where it is not finite (swin_v2_t
        # overflows in PyTorch's fp16).
        "torch_fp16_finite": None if fp16 is None else bool(np.all(np.isfinite(fp16))),
        "torch_fp16_output": None if fp16 is None or not np.all(np.isfinite(fp16)) else [float_list(row) for row in fp16],
        "torch_fp16_max_abs_diff": None if fp16 is None or not np.all(np.isfinite(fp16)) else float(np.abs(fp16 - probs).max()),
        "max_abs_activation": max_activation,
        "opset": next(o.version for o in onnx.load(str(onnx_path), load_external_data=False).opset_import if o.domain in ("", "ai.onnx")),
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__, "onnxruntime": ort.__version__},
    }
    (outdir / f"{name}.ref.json").write_text(json.dumps(reference, separators=(",", ":"), allow_nan=False) + "\n")

    size_mb = onnx_path.stat().st_size / 1e6
    top1 = " ".join(f"{int(t[0])}:{probs[i, t[0]]:.3f}" for i, t in enumerate(top5))
    fp16_note = "" if fp16 is None else f"  torch-fp16 {np.abs(fp16 - probs).max():.1e}"
    warn = "  WARNING: activations beyond fp16 range" if max_activation > 65504 else ""
    print(
        f"{name:<20} export {export_s:6.1f} s  {size_mb:7.1f} MB  top1 {top1}  "
        f"torch-ort {torch_diff:.1e}{fp16_note}  max|act| {max_activation:.3g}{warn}  ops: {','.join(ops)}",
        flush=True,
    )


def cmd_export(args):
    # MultiheadAttention's fused inference path (ViT) has no ONNX export.
    torch.backends.mha.set_fastpath_enabled(False)
    names = parse_list(args.models)
    check_model_names(names)
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, onnx {onnx.__version__}, "
          f"onnxruntime {ort.__version__}; writing to {outdir}", flush=True)
    failed = []
    for name in names:
        try:
            export_one(name, outdir)
        except Exception as e:  # one model's failure must not hide the others'
            print(f"{name}: export failed: {type(e).__name__}: {e}", flush=True)
            failed.append(name)
    if failed:
        sys.exit(f"export failed for {', '.join(failed)}")


# --------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------


def median_ms(fn, runs):
    """Median over `runs` calls of fn, each timed alone with CUDA events after a full synchronise."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.no_grad()
def bench_one(model, batch, runs, warmup, device):
    x = torch.randn(batch, 3, 224, 224, device=device, dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)

    # Eager: the warm-up also runs cudnn.benchmark's search for these shapes.
    for _ in range(max(1, warmup)):
        eager_y = model(x)
    torch.cuda.synchronize()
    eager_ms = median_ms(lambda: model(x), runs)

    # CUDA graph, as in PyTorch's documentation: warm up on a side stream, capture, replay.
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
    for _ in range(max(3, warmup // 2)):
        graph.replay()
    torch.cuda.synchronize()
    graph_ms = median_ms(graph.replay, runs)

    finite = bool(torch.isfinite(eager_y).all())
    same = bool(torch.equal(static_y.argmax(dim=1), eager_y.argmax(dim=1)))
    del graph, static_x, static_y, eager_y, x
    torch.cuda.empty_cache()
    return eager_ms, graph_ms, finite, same


def cmd_bench(args):
    if not torch.cuda.is_available():
        sys.exit("bench needs a CUDA GPU")
    names = parse_list(args.models)
    check_model_names(names)
    batches = parse_list(args.batches, int)
    device = torch.device("cuda:0")
    torch.backends.cudnn.benchmark = True
    header = {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "gpu": torch.cuda.get_device_name(device),
        "dtype": "float16",
        "memory_format": "channels_last",
        "cudnn_benchmark": True,
        "input": [3, 224, 224],
        "runs": args.runs,
        "warmup": args.warmup,
        "timing": "median of single forward passes, each between CUDA events after torch.cuda.synchronize()",
    }
    print(f"{header['gpu']}, torch {header['torch']}, CUDA {header['cuda']}, cuDNN {header['cudnn']}; "
          f"fp16 channels_last, median of {args.runs} runs", flush=True)
    print(f"{'model':<20} {'batch':>5} {'mode':<10} {'median ms':>10} {'images/s':>10}", flush=True)
    results = []
    started = time.perf_counter()
    for name in names:
        # The classifier calibration only changes the last layer's values, not the work: skipped.
        model = build_model(name, calibrate=False)
        model = model.to(device).half().to(memory_format=torch.channels_last).eval()
        for batch in batches:
            eager_ms, graph_ms, finite, same = bench_one(model, batch, args.runs, args.warmup, device)
            for mode, ms in [("eager", eager_ms), ("cuda_graph", graph_ms)]:
                row = {"model": name, "batch": batch, "mode": mode, "median_ms": round(ms, 4),
                       "images_per_s": round(batch / (ms / 1e3), 1)}
                results.append(row)
                print(f"{name:<20} {batch:>5} {mode:<10} {row['median_ms']:>10.3f} {row['images_per_s']:>10.1f}",
                      flush=True)
            if not finite:
                print(f"  warning: {name} batch {batch}: non-finite fp16 outputs (timing still valid)", flush=True)
            if finite and not same:
                print(f"  warning: {name} batch {batch}: CUDA graph and eager top-1 differ", flush=True)
        del model
        torch.cuda.empty_cache()
    header["wall_s"] = round(time.perf_counter() - started, 1)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"header": header, "results": results}, indent=1) + "\n")
    print(f"wrote {args.json} ({len(results)} rows, {header['wall_s']} s)", flush=True)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    export = sub.add_parser("export", help="ONNX exports + onnxruntime reference outputs")
    export.add_argument("outdir", help="output folder")
    export.add_argument("--models", default=",".join(EXPORT_MODELS + FAMILY_MODELS),
                        help="comma-separated models: torchvision names, timm.NAME, @OPSET or @dynamo")
    export.set_defaults(func=cmd_export)

    bench = sub.add_parser("bench", help="PyTorch fp16 latency, eager and CUDA graph")
    bench.add_argument("--models", default=",".join(BENCH_MODELS), help="comma-separated torchvision names")
    bench.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    bench.add_argument("--runs", type=int, default=50, help="timed runs per model, batch and mode")
    bench.add_argument("--warmup", type=int, default=10, help="untimed runs first")
    bench.add_argument("--json", required=True, help="output JSON file")
    bench.set_defaults(func=cmd_bench)

    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
