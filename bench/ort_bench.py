#!/usr/bin/env python3
"""onnxruntime (CPU provider) on the same models and inputs as examples/bench_cpu.rs: the median
time per frame at batch 1 and 8, with 1 thread and with all cores.
    bench/ort_bench.py RUNS MODEL.onnx...
    bench/ort_bench.py check MODEL.onnx SCORES   (SCORES: `bench_cpu 0 --scores MODEL.onnx`)"""
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort



def pattern(batch, shape):
    n = batch * int(np.prod(shape))
    x = ((np.arange(n) * 7919) % 1000).astype(np.float32) / 500.0 - 1.0
    return x.reshape([batch] + shape)


if sys.argv[1] == "check":
    # Our scores for two frames beside onnxruntime's: the largest difference, and top-1.
    model, ours = sys.argv[2], np.loadtxt(sys.argv[3], dtype=np.float32, ndmin=2)
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    want = sess.run(None, {inp.name: pattern(2, list(inp.shape[1:]))})[0].reshape(2, -1)
    name = os.path.splitext(os.path.basename(model))[0]
    print(f"check_{name}_max_abs {np.abs(ours - want).max():.2e}")
    print(f"check_{name}_top1_same {int((ours.argmax(1) == want.argmax(1)).all())}")
    sys.exit(0)

runs, models = int(sys.argv[1]), sys.argv[2:]
for model in models:
    name = os.path.splitext(os.path.basename(model))[0]
    # The cores this process may use (taskset), as the Rust side counts them.
    for threads in sorted({1, len(os.sched_getaffinity(0))}):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        inp = sess.get_inputs()[0]
        shape = [d if isinstance(d, int) else 1 for d in inp.shape[1:]]
        for batch in (1, 8):
            x = pattern(batch, shape)
            for _ in range(3):
                sess.run(None, {inp.name: x})
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                sess.run(None, {inp.name: x})
                times.append((time.perf_counter() - t) * 1e3)
            print(f"ort_{name}_t{threads}_b{batch}_ms {statistics.median(times) / batch:.2f}")
