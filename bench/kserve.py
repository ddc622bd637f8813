#!/usr/bin/python3
"""backend=kserve against a KServe v2 server on loopback, side by side with backend=cpu.

Starts Seldon MLServer (the README's install line puts it in ~/.local/share/trtclassify/mlserver)
with models/colors_dynamic.onnx served at 224x224, then classifies FRAMES frames of a test
source at batch sizes 1, 8 and 32 with backend=cpu and backend=kserve, and prints per run
the frames per second, the time of a batch (the element's `batch-time`: for kserve, the round
trip of one request with the server's work) and the median time a frame spent in the
element. Run with Debian's python3 (python3-gi) and the plugin on GST_PLUGIN_PATH:

    GST_PLUGIN_PATH=target/release [SIDE=224] /usr/bin/python3 bench/kserve.py [FRAMES] [RUNS]

Each configuration runs RUNS times (default 3), alternating the backends; the medians are
printed.
"""
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import gi

gi.require_version("Gst", "1.0")
from gi.repository import Gst  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLSERVER = os.environ.get(
    "TRTCLASSIFY_MLSERVER",
    os.path.expanduser("~/.local/share/trtclassify/mlserver/bin/mlserver"),
)
SIDE = int(os.environ.get("SIDE", "224"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder):
    grpc, http = free_port(), free_port()
    settings = {
        "host": "127.0.0.1",
        "grpc_port": grpc,
        "http_port": http,
        "metrics_port": free_port(),
        "parallel_workers": 0,
        "grpc_max_message_length": 256 << 20,
    }
    with open(os.path.join(folder, "settings.json"), "w") as f:
        json.dump(settings, f)
    model = os.path.join(folder, "models", "colors")
    os.makedirs(model)
    shutil.copy(os.path.join(ROOT, "models", "colors_dynamic.onnx"), os.path.join(model, "model.onnx"))
    shutil.copy(os.path.join(ROOT, "tests", "kserve", "onnx_runtime.py"), model)
    with open(os.path.join(model, "model-settings.json"), "w") as f:
        json.dump(
            {
                "name": "colors",
                "implementation": "onnx_runtime.OnnxModel",
                "parameters": {"uri": "./model.onnx"},
                "inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 3, SIDE, SIDE]}],
                "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 6]}],
            },
            f,
        )
    log = open(os.path.join(folder, "log.txt"), "w")
    server = subprocess.Popen([MLSERVER, "start", folder], stdout=log, stderr=log)
    for _ in range(1200):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/colors/ready") as r:
                if r.status == 200:
                    return server, grpc
        except OSError:
            time.sleep(0.1)
    raise SystemExit("MLServer did not start; see " + log.name)


def run(frames, batch, backend):
    pipeline = Gst.parse_launch(
        f"videotestsrc num-buffers={frames} pattern=ball ! "
        "video/x-raw,format=RGB,width=640,height=480 ! "
        f"trtclassify name=c onnx-location={ROOT}/models/colors_dynamic.onnx "
        f"input-width={SIDE} input-height={SIDE} batch-size={batch} batch-timeout=-1 {backend} ! "
        "fakesink"
    )
    started = time.monotonic()
    pipeline.set_state(Gst.State.PLAYING)
    msg = pipeline.get_bus().timed_pop_filtered(
        600 * Gst.SECOND, Gst.MessageType.EOS | Gst.MessageType.ERROR
    )
    took = time.monotonic() - started
    if msg is None or msg.type == Gst.MessageType.ERROR:
        raise SystemExit(f"{backend}: {msg.parse_error() if msg else 'timed out'}")
    stats = pipeline.get_by_name("c").get_property("stats")
    pipeline.set_state(Gst.State.NULL)
    classified = stats.get_uint64("classified")[1]
    if classified != frames:
        raise SystemExit(f"{backend}: {classified} of {frames} frames classified")
    return frames / took, stats.get_uint64("batch-time")[1] / 1e6, stats.get_uint64("latency-p50")[1] / 1e6


def main():
    frames = int(sys.argv[1]) if len(sys.argv) > 1 else 640
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    Gst.init(None)
    with tempfile.TemporaryDirectory() as folder:
        server, grpc = start_server(folder)
        try:
            backends = {
                "cpu": "backend=cpu",
                "kserve": f"backend=kserve server-url=grpc://127.0.0.1:{grpc} server-model=colors",
            }
            rows = []
            for batch in (1, 8, 32):
                got = {name: [] for name in backends}
                for _ in range(runs):
                    for name, properties in backends.items():
                        got[name].append(run(frames, batch, properties))
                for name in backends:
                    fps, batch_ms, latency_ms = (statistics.median(v) for v in zip(*got[name]))
                    rows.append((name, batch, fps, batch_ms, latency_ms))
        finally:
            server.kill()
            server.wait()
    print(f"\n{frames} frames of 640x480 RGB, classified at {SIDE}x{SIDE}; medians of {runs} runs")
    print("| backend | batch | frames/s | batch time (ms) | latency p50 (ms) |")
    print("|---|---|---|---|---|")
    for name, batch, fps, batch_ms, latency_ms in rows:
        print(f"| {name} | {batch} | {fps:,.0f} | {batch_ms:.2f} | {latency_ms:.2f} |")


if __name__ == "__main__":
    main()
