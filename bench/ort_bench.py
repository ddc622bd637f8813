#!/usr/bin/env python3
"""onnxruntime (CPU) on the same model and inputs as examples/bench_cpu.rs: median latency at
batch 1 and images/s at batch 8, with 1 thread and with onnxruntime's default threads."""
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort

model, runs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
for threads, tag in [(1, "ort1t"), (0, "ortmt")]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    for batch in (1, 8):
        x = ((np.arange(batch * 3 * 224 * 224) * 7919) % 1000).astype(np.float32) / 500.0 - 1.0
        x = x.reshape(batch, 3, 224, 224)
        for _ in range(3):
            sess.run(None, {name: x})
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            sess.run(None, {name: x})
            times.append((time.perf_counter() - t) * 1e3)
        ms = statistics.median(times)
        print(f"{tag}_b{batch}_ms {ms:.2f}")
        print(f"{tag}_b{batch}_img_s {batch * 1e3 / ms:.1f}")
