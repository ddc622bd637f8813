#!/usr/bin/env bash
# CPU benchmark: trtclassify's CPU backend beside onnxruntime (CPU provider), same models,
# inputs, thread counts and machine, in one run: the engine's time per frame, and the whole
# element's (224x224 RGB frames through `trtclassify backend=cpu`, its source's time taken
# off); then tract (the path for models the plan importer does not take), preprocessing and
# the element on 720p/1080p video.
#
# Models: 18 torchvision architectures from 12 families (bench/gpu/torch_models.py export,
# random weights; needs torch and torchvision) where python3 has torch, else the three that
# models/generate.py builds as ONNX graphs (MobileNetV2, ResNet-50, EfficientNet-B0).
# Needs python3 with onnx, onnxruntime and numpy (pip install onnx onnxruntime numpy).
#   bench/cpu.sh [RUNS]      (ROUNDS=3: each side's RUNS calls in that many turns;
#                             MODELS="a b": only those of the set)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-30}
rounds=${ROUNDS:-3}
per=$(((runs + rounds - 1) / rounds))
set_names=(shufflenet_v2_x0_5 shufflenet_v2_x1_0 shufflenet_v2_x1_5 squeezenet1_0
    squeezenet1_1 mobilenet_v3_small mobilenet_v3_large mnasnet0_5 regnet_x_400mf
    regnet_y_400mf googlenet densenet121 resnet18 resnet50 mobilenet_v2 efficientnet_b0
    convnext_tiny vit_ti_16)
if python3 -c 'import torch, torchvision' 2>/dev/null; then
    dir=target/bench/cpu
    read -ra names <<< "${MODELS:-${set_names[*]}}"
    missing=()
    for n in "${names[@]}"; do [ -f "$dir/$n.onnx" ] || missing+=("$n"); done
    if [ ${#missing[@]} -gt 0 ]; then
        list=$(IFS=,; echo "${missing[*]}")
        python3 bench/gpu/torch_models.py export "$dir" --models "$list" >/dev/null
    fi
else
    echo "python3 has no torch: the three generated models only" >&2
    dir=target/bench
    names=(mobilenet_v2_224 resnet50_224 efficientnet_b0_224)
    [ -f "$dir/${names[-1]}.onnx" ] || python3 models/generate.py --out "$dir" --bench >/dev/null
fi
cargo build --release --example bench_cpu 2>&1 | tail -1
out=$(mktemp)
# The time the machine's host took from this one's cores (steal) while it ran: on a shared
# virtual machine, a run with much of it is too noisy to compare.
steal() { awk '/^cpu / { t = 0; for (i = 2; i <= 9; i++) t += $i; print $9, t }' /proc/stat; }
read -r steal0 total0 < <(steal)
# Interleaved in turns, so that a change in the machine's speed during the run (a shared
# machine's other tenants) touches both sides alike; each figure is the median of the turns'
# medians.
for n in "${names[@]}"; do
    m="$dir/$n.onnx"
    target/release/examples/bench_cpu 0 --scores "$m" > "$out.scores"
    python3 bench/ort_bench.py check "$m" "$out.scores" | tee -a "$out"
    for _ in $(seq "$rounds"); do
        target/release/examples/bench_cpu "$per" "$m" | tee -a "$out"
        python3 bench/ort_bench.py "$per" "$m" | tee -a "$out"
    done
done
tracted=$dir/${names[0]}.onnx
TRTCLASSIFY_CPU=tract target/release/examples/bench_cpu "$runs" "$tracted" | grep '^tract_.*_t1_' | tee -a "$out"
TRTCLASSIFY_CPU=tract target/release/examples/bench_cpu "$runs" --element "$tracted" | grep pipeline_720p | tee -a "$out"
target/release/examples/bench_cpu "$runs" --element "$tracted" | tee -a "$out"
get() {
    awk -v k="$1" '$1 == k { print $2 }' "$out" | sort -g |
        awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
read -r steal1 total1 < <(steal)
stolen=$(awk -v s=$((steal1 - steal0)) -v t=$((total1 - total0)) 'BEGIN { printf "%.1f", t ? 100 * s / t : 0 }')
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
echo
echo "Per-frame time, median of $rounds turns' medians of $per calls each side, fp32, random weights, 224x224; $(nproc) cores: $cpu"
echo "element: 224x224 RGB videotestsrc ! trtclassify backend=cpu ! fakesink, less the source alone (median time between batches)"
echo "The host took ${stolen}% of the cores' time during the run (steal)"
echo
echo "| model | threads | batch | element | engine | onnxruntime | element / onnxruntime | engine / onnxruntime | largest score difference (top-1 same) |"
echo "|---|---|---|---|---|---|---|---|---|"
for n in "${names[@]}"; do
    for t in 1 "$(nproc)"; do
        for b in 1 8; do
            elem=$(get "elem_${n}_t${t}_b${b}_ms")
            ours=$(get "ours_${n}_t${t}_b${b}_ms")
            ort=$(get "ort_${n}_t${t}_b${b}_ms")
            echo "| $n | $t | $b | $elem ms | $ours ms | $ort ms | $(ratio "$elem" "$ort")× | $(ratio "$ours" "$ort")× | $(get "check_${n}_max_abs") ($(get "check_${n}_top1_same")) |"
        done
    done
done
echo
echo "tract on ${names[0]}, 1 thread: $(get "tract_${names[0]}_t1_b1_ms") ms per frame at batch 1, $(get "tract_${names[0]}_t1_b8_ms") at batch 8"
echo "Preprocessing to 224x224 float: a 224x224 RGB frame (the element rows' input) $(get preprocess_224_rgb_ms) ms; an I420 frame 720p $(get preprocess_720p_ms) ms, 1080p $(get preprocess_1080p_ms) ms"
echo
echo "Whole element (videotestsrc I420 ! trtclassify ${names[0]} ! fakesink, all cores), frames/s:"
echo
echo "| | 720p batch 1 | 720p batch 8 | 1080p batch 1 | 1080p batch 8 |"
echo "|---|---|---|---|---|"
echo "| trtclassify cpu | $(get ours_pipeline_720p_b1_fps) | $(get ours_pipeline_720p_b8_fps) | $(get ours_pipeline_1080p_b1_fps) | $(get ours_pipeline_1080p_b8_fps) |"
echo "| tract path | $(get tract_pipeline_720p_b1_fps) | $(get tract_pipeline_720p_b8_fps) | | |"
rm -f "$out" "$out.scores"
