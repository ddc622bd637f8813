#!/usr/bin/env python3
"""What FP8 buys the products of ResNet-50 and ViT-B/16 at batch 64 on this GPU: cuBLASLt
through PyTorch, fp16 against FP8 E4M3 with one scale per tensor and with a scale per row
of the activations and per column of the weights (the per-channel weight scales of
trtclassify's quantized plans), each with cuBLASLt's fast accumulation (the sums kept in the
tensor cores' accumulators, as trtclassify's FP8 products run) and without, and what rounding the activations to FP8 in a pass of its
own costs beside the product. Medians of CUDA-event timings, each side in the same run.

Usage (on the GPU host): python3 bench/gpu/fp8_gemm.py
"""

import statistics

import torch

# (name, rows M, summed K, columns N): the products of batch 64.
SHAPES = [
    ("resnet50 layer1 1x1 64->256", 64 * 56 * 56, 64, 256),
    ("resnet50 layer1 1x1 256->64", 64 * 56 * 56, 256, 64),
    ("resnet50 layer3 1x1 1024->256", 64 * 14 * 14, 1024, 256),
    ("resnet50 layer3 3x3 as product (im2col)", 64 * 14 * 14, 256 * 9, 256),
    ("resnet50 layer4 1x1 512->2048", 64 * 7 * 7, 512, 2048),
    ("vit_b_16 qkv 768->2304", 64 * 197, 768, 2304),
    ("vit_b_16 mlp 768->3072", 64 * 197, 768, 3072),
    ("vit_b_16 mlp 3072->768", 64 * 197, 3072, 768),
    ("vit_b_16 proj 768->768", 64 * 197, 768, 768),
]


def timed(f, runs=50):
    for _ in range(5):
        f()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main():
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} (PyTorch {torch.__version__})")
    rows = [
        "| product (batch 64) | fp16 | fp8 per tensor | fp8 per row/column | fp8 per tensor, fast | fp8 per row/column, fast | quantize pass |",
        "|---|---|---|---|---|---|---|",
    ]
    total = {"fp16": 0.0, "fp8": 0.0, "fp8rc": 0.0, "fast": 0.0, "fastrc": 0.0, "q": 0.0}
    for name, m, k, n in SHAPES:
        a = torch.randn(m, k, device=dev, dtype=torch.float16)
        b = torch.randn(n, k, device=dev, dtype=torch.float16)
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        sa = torch.ones(m, 1, device=dev)
        sb = torch.ones(1, n, device=dev)
        inv = torch.tensor(0.5, device=dev, dtype=torch.float16)
        flop = 2 * m * n * k
        def fp8(fast, scales, out):
            return timed(lambda: torch._scaled_mm(a8, b8.t(), scale_a=scales[0], scale_b=scales[1], out_dtype=out, use_fast_accum=fast))

        def fp8_rc(fast):
            try:
                return fp8(fast, (sa, sb), torch.bfloat16)
            except RuntimeError as e:
                print(f"{name}: per row/column scales: {e}")
                return float("nan")

        t = {
            "fp16": timed(lambda: a @ b.t()),
            "fp8": fp8(False, (one, one), torch.float16),
            "fp8rc": fp8_rc(False),
            "fast": fp8(True, (one, one), torch.float16),
            "fastrc": fp8_rc(True),
            "q": timed(lambda: (a * inv).to(torch.float8_e4m3fn)),
        }
        for key in total:
            total[key] += t[key]
        tf = lambda t: f"{flop / t / 1e12:,.0f} TFLOP/s ({t * 1e6:,.0f} µs)"
        products = " | ".join(tf(t[key]) for key in ["fp16", "fp8", "fp8rc", "fast", "fastrc"])
        rows.append(f"| {name} | {products} | {t['q'] * 1e6:,.0f} µs |")
    rows.append("| all | " + " | ".join(f"{total[key] * 1e6:,.0f} µs" for key in total) + " |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
