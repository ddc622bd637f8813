#!/usr/bin/env python3
"""Small vision transformers for trtclassify's tests: the graphs torchvision's models export to,
at a size that can be committed.

Needs PyTorch, torchvision, onnx and onnxruntime (the GPU host has them; nothing is
downloaded). Each model is torchvision's own class (VisionTransformer, SwinTransformer v1 and
v2, MaxVit) with few layers and narrow widths, so the exported graph has the operators and
patterns of vit_b_16, swin_t and maxvit_t (class token Expand, shape arithmetic, window
partition with Mod/Range/ScatterND, shifted-window masks, Einsum attention, integer division
of shapes) in a few hundred KB. `hybrid` gathers what the mobile hybrids export to (MobileViT
v2's GroupNorm and summed context, MobileViT's bilinear resize of 7×7 maps to 8×8,
EfficientFormer v2's nearest upsampling, LeViT's attention-bias table, the tanh GELU), and
`hybrid.dynamo` and `swin.dynamo` are the dynamo exporter's graphs (Gelu, GatherND, Swin's
pooled features read through a flat Gather).

    python3 models/transformers/export.py OUTDIR [NAME,NAME...]

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
from torchvision.models.maxvit import MaxVit
from torchvision.models.vision_transformer import VisionTransformer

OPSET = 17
CLASSES = 10
FRAMES = 2


def reference_input():
    """x[i] = ((i * 7919) % 1000) / 500 - 1 over the NCHW elements, in float64 then float32."""
    n = FRAMES * 3 * 224 * 224
    i = np.arange(n, dtype=np.int64)
    return (((i * 7919) % 1000) / 500.0 - 1.0).astype(np.float32).reshape(FRAMES, 3, 224, 224)


class Hybrid(torch.nn.Module):
    """The patterns of the mobile hybrids, small: a convolution stem to 7×7, MobileViT v2's
    separable attention on a GroupNorm(1) (InstanceNormalization, ReduceSum), a bilinear
    resize to 8×8 and back (MobileViT), LeViT's attention with biases indexed from a table
    by relative offset (GatherND in the dynamo export), the attention's products as Einsums,
    a nearest 2× upsampling (EfficientFormer v2) and a tanh-GELU MLP."""

    def __init__(self, dim=16, classes=CLASSES):
        super().__init__()
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(3, dim, 8, stride=8), torch.nn.ReLU(), torch.nn.Conv2d(dim, dim, 4, stride=4))
        self.norm = torch.nn.GroupNorm(1, dim)
        self.qkv = torch.nn.Conv2d(dim, 1 + 2 * dim, 1)
        side = 8
        points = [(i, j) for i in range(side) for j in range(side)]
        offsets, idxs = {}, []
        for p in points:
            for q in points:
                offsets.setdefault((abs(p[0] - q[0]), abs(p[1] - q[1])), len(offsets))
                idxs.append(offsets[(abs(p[0] - q[0]), abs(p[1] - q[1]))])
        self.attention_biases = torch.nn.Parameter(torch.randn(2, len(offsets)))
        self.register_buffer("attention_bias_idxs", torch.tensor(idxs).view(side * side, side * side),
                             persistent=False)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(2 * dim, dim))
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):
        x = self.stem(x)  # [N, dim, 7, 7]
        q, k, v = self.qkv(self.norm(x)).split([1, x.shape[1], x.shape[1]], dim=1)
        scores = q.flatten(2).softmax(dim=-1)
        context = (k.flatten(2) * scores).sum(dim=-1, keepdim=True)
        x = x + (torch.relu(v.flatten(2)) * context).reshape(x.shape)
        x = torch.nn.functional.interpolate(x, size=(8, 8), mode="bilinear", align_corners=False)
        n, c = x.shape[:2]
        t = x.flatten(2).reshape(n, 2, c // 2, 64).transpose(2, 3)  # [N, heads, 64, c/2]
        attn = torch.einsum("bhid,bhjd->bhij", t, t) * (c // 2) ** -0.5
        attn = (attn + self.attention_biases[:, self.attention_bias_idxs]).softmax(dim=-1)
        t = torch.einsum("bhij,bhjd->bhid", attn, t)
        x = x + t.transpose(2, 3).reshape(n, c, 8, 8)
        x = torch.nn.functional.interpolate(x, size=(7, 7), mode="bilinear", align_corners=False)
        x = torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
        pooled = x.mean((2, 3))
        return self.head(pooled + self.mlp(pooled))


def models():
    """(name, exporter, build) of each model."""
    yield "vit", "torchscript", lambda: VisionTransformer(
        image_size=224, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=CLASSES)
    swin = dict(patch_size=[4, 4], embed_dim=8, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4],
                window_size=[7, 7], num_classes=CLASSES)
    yield "swin", "torchscript", lambda: SwinTransformer(**swin)
    yield "swin_v2", "torchscript", lambda: SwinTransformer(
        **{**swin, "window_size": [8, 8]}, block=SwinTransformerBlockV2,
        downsample_layer=PatchMergingV2)
    yield "maxvit", "torchscript", lambda: MaxVit(
        input_size=(224, 224), stem_channels=8, partition_size=7, block_channels=[8, 16],
        block_layers=[1, 1], head_dim=4, stochastic_depth_prob=0.0, num_classes=CLASSES)
    yield "hybrid", "torchscript", Hybrid
    yield "hybrid.dynamo", "dynamo", Hybrid
    yield "swin.dynamo", "dynamo", lambda: SwinTransformer(**swin)


def export(name, exporter, build, outdir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(build(), torch.nn.Softmax(dim=1)).eval()
    # BatchNorm statistics measured on the input, as training leaves them: with the defaults
    # (mean 0, variance 1) MaxViT's small random convolutions fade to nothing before the head.
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    with torch.no_grad():
        model(torch.from_numpy(reference_input()))
    for m in norms:
        m.eval()
    # Random heads give near-uniform scores; spread the logits so top-k means something.
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        head.weight.mul_(20.0)
        if head.bias is not None:
            head.bias.normal_(0.0, 1.0)
        else:  # MaxViT's head has none: its logits are spread to a std of 2 instead
            spread = float(model[0](torch.from_numpy(reference_input())).std(dim=1).mean())
            head.weight.mul_(2.0 / spread)
    path = outdir / f"{name}.onnx"
    with torch.no_grad():
        if exporter == "dynamo":
            # torch.export specialises a dimension of 1, so it traces two frames.
            program = torch.onnx.export(
                model, (torch.zeros(2, 3, 224, 224),), input_names=["image"], output_names=["probs"],
                dynamic_shapes=({0: torch.export.Dim("N", min=1, max=1024)},), dynamo=True)
            program.save(str(path))
        else:
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
        "exporter": exporter,
        "opset": next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
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
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    for name, exporter, build in models():
        if only and name not in only:
            continue
        try:
            export(name, exporter, build, outdir)
        except Exception as e:  # report every model, then fail
            print(f"{name}: export failed: {e}".splitlines()[0][:300], flush=True)
            failed.append(name)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
