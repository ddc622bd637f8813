#!/usr/bin/env bash
# CPU benchmark: trtclassify's CPU backend (tract) beside onnxruntime, same model, same
# machine, same run. Needs python3 with onnx, onnxruntime and numpy (pip install).
#   bench/cpu.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-30}
model=target/bench/mobilenet_v2_224.onnx
[ -f "$model" ] || python3 models/generate.py --out target/bench --bench >/dev/null
cargo build --release --example bench_cpu 2>&1 | tail -1
out=$(mktemp)
target/release/examples/bench_cpu "$model" "$runs" | tee "$out"
python3 bench/ort_bench.py "$model" "$runs" | tee -a "$out"
get() { awk -v k="$1" '$1 == k { print $2 }' "$out"; }
echo
echo "MobileNetV2 224x224 fp32 (random weights), medians of $runs runs, $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo
echo "| runtime | batch 1 latency | batch 1 img/s | batch 8 img/s |"
echo "|---|---|---|---|"
echo "| trtclassify cpu (tract, 1 thread) | $(get tract_b1_ms) ms | $(get tract_b1_img_s) | $(get tract_b8_img_s) |"
echo "| onnxruntime, 1 thread | $(get ort1t_b1_ms) ms | $(get ort1t_b1_img_s) | $(get ort1t_b8_img_s) |"
echo "| onnxruntime, default threads | $(get ortmt_b1_ms) ms | $(get ortmt_b1_img_s) | $(get ortmt_b8_img_s) |"
echo
echo "Preprocessing a 1280x720 I420 frame to 224x224 float: $(get preprocess_720p_ms) ms"
echo "Whole pipeline (videotestsrc 720p I420 ! trtclassify ! fakesink): $(get pipeline_720p_b1_fps) fps at batch 1, $(get pipeline_720p_b8_fps) fps at batch 8"
rm -f "$out"
