#!/usr/bin/env python3
"""Small vision transformers for trtclassify's tests: the graphs torchvision's models export to,
at a size that can be committed.

Needs PyTorch, torchvision, onnx and onnxruntime (the GPU host has them; nothing is
downloaded). Each model is torchvision's own class (VisionTransformer, SwinTransformer v1 and
v2) with few layers and narrow widths, so the exported graph has the operators and patterns of
vit_b_16 and swin_t (class token Expand, shape arithmetic, window partition with Mod/Range/
ScatterND, shifted-window masks) in a few hundred KB.

    python3 models/transformers/export.py OUTDIR

For each NAME: OUTDIR/NAME.onnx (opset 17, the TorchScript exporter as torchvision users run
it, dynamic batch "N", input "image" [N,3,224,224], output "probs" [N,10] after Softmax) and
OUTDIR/NAME.ref.json: onnxruntime's output for the input of `reference_input` (2 frames,
computed from the element index, so a test can make it without a file) and PyTorch's.
"""

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2
from torchvision.models.vision_transformer import VisionTransformer

OPSET = 17
CLASSES = 10
FRAMES = 2


def reference_input():
    """x[i] = ((i * 7919) % 1000) / 500 - 1 over the NCHW elements, in float64 then float32."""
    n = FRAMES * 3 * 224 * 224
    i = np.arange(n, dtype=np.int64)
    return (((i * 7919) % 1000) / 500.0 - 1.0).astype(np.float32).reshape(FRAMES, 3, 224, 224)


def models():
    yield "vit", lambda: VisionTransformer(
        image_size=224, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=CLASSES)
    swin = dict(patch_size=[4, 4], embed_dim=8, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4],
                window_size=[7, 7], num_classes=CLASSES)
    yield "swin", lambda: SwinTransformer(**swin)
    yield "swin_v2", lambda: SwinTransformer(
        **{**swin, "window_size": [8, 8]}, block=SwinTransformerBlockV2,
        downsample_layer=PatchMergingV2)


def export(name, build, outdir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(build(), torch.nn.Softmax(dim=1)).eval()
    # Random heads give near-uniform scores; spread the logits so top-k means something.
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        head.weight.mul_(20.0)
        head.bias.normal_(0.0, 1.0)
    path = outdir / f"{name}.onnx"
    with torch.no_grad():
        torch.onnx.export(model, (torch.zeros(1, 3, 224, 224),), str(path), opset_version=OPSET,
                          input_names=["image"], output_names=["probs"],
                          dynamic_axes={"image": {0: "N"}, "probs": {0: "N"}}, dynamo=False)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    ops = sorted({n.op_type for n in proto.graph.node})
    x = reference_input()
    (probs,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        ["probs"], {"image": x})
    with torch.no_grad():
        torch_probs = model(torch.from_numpy(x)).numpy()
    ref = {
        "model": name,
        "input": "reference_input(): x[i] = ((i * 7919) % 1000) / 500 - 1, NCHW [2,3,224,224]",
        "output": [[float(f"{v:.9g}") for v in row] for row in probs],
        "torch_vs_onnxruntime_max_abs_diff": float(np.abs(torch_probs - probs).max()),
        "ops": ops,
        "versions": {"torch": torch.__version__, "onnxruntime": ort.__version__},
    }
    (outdir / f"{name}.ref.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(f"{name}: {path.stat().st_size / 1e3:.0f} KB, top1 {probs.argmax(1).tolist()}, "
          f"max {probs.max(1).round(3).tolist()}, torch-ort {ref['torch_vs_onnxruntime_max_abs_diff']:.1e}, "
          f"ops {','.join(ops)}", flush=True)


def main():
    outdir = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
    outdir.mkdir(parents=True, exist_ok=True)
    # MultiheadAttention's fused inference path has no ONNX export; this is what users who
    # export torchvision's ViT get with it off (the fused op fails the export).
    torch.backends.mha.set_fastpath_enabled(False)
    failed = []
    for name, build in models():
        try:
            export(name, build, outdir)
        except Exception as e:  # report every model, then fail
            print(f"{name}: export failed: {e}".splitlines()[0][:300], flush=True)
            failed.append(name)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
