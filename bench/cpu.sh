#!/usr/bin/env bash
# CPU benchmark: trtclassify's CPU backend beside onnxruntime (CPU provider), same models,
# inputs, thread counts and machine, in one run; then tract (the path for models the plan
# importer does not take) on MobileNetV2, preprocessing and the whole element.
# Needs python3 with onnx, onnxruntime and numpy (pip install onnx onnxruntime numpy).
#   bench/cpu.sh [RUNS]      (ROUNDS=3: each side's RUNS calls in that many turns)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-30}
rounds=${ROUNDS:-3}
per=$(((runs + rounds - 1) / rounds))
names=(mobilenet_v2_224 resnet50_224 efficientnet_b0_224)
models=()
for n in "${names[@]}"; do models+=("target/bench/$n.onnx"); done
[ -f "${models[-1]}" ] || python3 models/generate.py --out target/bench --bench >/dev/null
cargo build --release --example bench_cpu 2>&1 | tail -1
out=$(mktemp)
# Interleaved in turns, so that a change in the machine's speed during the run (a shared
# machine's other tenants) touches both sides alike; each figure is the median of the turns'
# medians.
for m in "${models[@]}"; do
    target/release/examples/bench_cpu 0 --scores "$m" > "$out.scores"
    python3 bench/ort_bench.py check "$m" "$out.scores" | tee -a "$out"
    for _ in $(seq "$rounds"); do
        target/release/examples/bench_cpu "$per" "$m" | tee -a "$out"
        python3 bench/ort_bench.py "$per" "$m" | tee -a "$out"
    done
done
TRTCLASSIFY_CPU=tract target/release/examples/bench_cpu "$runs" "${models[0]}" | grep _t1_ | tee -a "$out"
TRTCLASSIFY_CPU=tract target/release/examples/bench_cpu "$runs" --element "${models[0]}" | grep pipeline_720p | tee -a "$out"
target/release/examples/bench_cpu "$runs" --element "${models[0]}" | tee -a "$out"
get() {
    awk -v k="$1" '$1 == k { print $2 }' "$out" | sort -g |
        awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }'
}
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
echo
echo "Per-frame time, median of $rounds turns' medians of $per calls each side, fp32, random weights, 224x224; $(nproc) cores: $cpu"
echo
echo "| model | threads | batch | trtclassify cpu | onnxruntime | ratio | largest score difference (top-1 same) |"
echo "|---|---|---|---|---|---|---|"
for n in "${names[@]}"; do
    for t in 1 "$(nproc)"; do
        for b in 1 8; do
            ours=$(get "ours_${n}_t${t}_b${b}_ms")
            ort=$(get "ort_${n}_t${t}_b${b}_ms")
            ratio=$(awk -v a="$ours" -v b="$ort" 'BEGIN { printf "%.2f", a / b }')
            echo "| $n | $t | $b | $ours ms | $ort ms | ${ratio}× | $(get "check_${n}_max_abs") ($(get "check_${n}_top1_same")) |"
        done
    done
done
echo
echo "tract on ${names[0]}, 1 thread: $(get tract_${names[0]}_t1_b1_ms) ms per frame at batch 1, $(get tract_${names[0]}_t1_b8_ms) at batch 8"
echo "Preprocessing an I420 frame to 224x224 float: 720p $(get preprocess_720p_ms) ms, 1080p $(get preprocess_1080p_ms) ms"
echo
echo "Whole element (videotestsrc I420 ! trtclassify ${names[0]} ! fakesink, all cores), frames/s:"
echo
echo "| | 720p batch 1 | 720p batch 8 | 1080p batch 1 | 1080p batch 8 |"
echo "|---|---|---|---|---|"
echo "| trtclassify cpu | $(get ours_pipeline_720p_b1_fps) | $(get ours_pipeline_720p_b8_fps) | $(get ours_pipeline_1080p_b1_fps) | $(get ours_pipeline_1080p_b8_fps) |"
echo "| tract path | $(get tract_pipeline_720p_b1_fps) | $(get tract_pipeline_720p_b8_fps) | | |"
rm -f "$out" "$out.scores"
