#!/usr/bin/env python3
"""PyTorch's kernels for one forward pass (fp16, batch 1 by default), as torch.profiler sees them.

    python3 bench/gpu/kernel_profile.py vit_b_16 [batch]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "bench/gpu")
import torch_models  # noqa: E402

name = sys.argv[1]
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
model = torch_models.build_model(name, calibrate=False).eval().half().cuda()
model = model.to(memory_format=torch.channels_last)
x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
with torch.no_grad():
    for _ in range(20):
        model(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            model(x)
        torch.cuda.synchronize()
events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
total = sum(e.device_time for e in events) / 10 / 1000
print(f"{name} batch {batch}: {len(events) // 10} kernels, {total:.3f} ms of GPU time a pass")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))
