#!/usr/bin/env bash
# The whole GPU run, on the GPU host, from the repository root, after pack.sh (see
# bench/gpu/README.md): exports the torchvision models, runs the cuda correctness tests,
# benchmarks our engine and PyTorch side by side, runs the NVDEC pipelines, and prints the
# tables last. Logs go to $OUT (or /tmp/gpu-out).
set -uo pipefail
. .gpu/gpu-env.sh >/dev/null
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out" /tmp/tv
video=$PWD/.gpu/files/bench1080.mp4
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
models=${MODELS:-resnet50,mobilenet_v2,efficientnet_b0,mobilenet_v3_small,squeezenet1_0,shufflenet_v2_x1_0,regnet_y_400mf,densenet121,convnext_tiny}
python3 bench/gpu/torch_models.py export /tmp/tv --models "$models" > "$out/export.txt" 2>&1
cut -c1-140 "$out/export.txt" | tail -9

# Correctness: the test binary packed as cuda-*.
cuda_test=$(ls /tmp/gpubin/cuda-* | head -1)
TRTCLASSIFY_MODELS_DIR=$PWD/models TRTCLASSIFY_TORCHVISION_DIR=/tmp/tv \
  "$cuda_test" --nocapture --test-threads=1 >"$out/cuda-test.txt" 2>"$out/cuda-test.log"
echo "cuda tests: exit $?"
grep -E "^test |largest|cached start|failed|panicked" "$out/cuda-test.txt" "$out/cuda-test.log" | cut -c1-300 | head -60

# Our engine: build, cached start, latency, throughput, a check against onnxruntime, profiles.
bench_models=(/tmp/tv/resnet50.onnx /tmp/tv/mobilenet_v2.onnx /tmp/tv/efficientnet_b0.onnx)
trtclassify-engine bench "${bench_models[@]}" --batches 1,8,64 --check --profile \
  >"$out/bench.md" 2>"$out/bench.log"
echo "trtclassify-engine bench: exit $?"
python3 bench/gpu/torch_models.py bench --models resnet50,mobilenet_v2,efficientnet_b0 \
  --json "$out/torch_bench.json" >"$out/torch_bench.txt" 2>&1
echo "torch bench: exit $?"

# GStreamer: NVDEC decode of 1080p H.264 into trtclassify, 1 and 8 streams in one process.
engine=/tmp/resnet50-b8.engine
trtclassify-engine build /tmp/tv/resnet50.onnx --engine "$engine" --batch-size 8 2>>"$out/bench.log" |
  tee -a "$out/pipeline.txt"
frames=600  # bench1080.mp4: 600 frames of 1920x1080 at 30 fps
for streams in 1 8; do
  branches=""
  for i in $(seq "$streams"); do
    branches+=" filesrc location=$video ! qtdemux ! h264parse ! nvh264dec ! cudadownload !"
    branches+=" video/x-raw,format=NV12 ! trtclassify onnx-location=/tmp/tv/resnet50.onnx"
    branches+=" backend=cuda engine-location=$engine batch-size=8 batch-timeout=-1 ! fakesink sync=false"
  done
  start=$(date +%s.%N)
  # shellcheck disable=SC2086
  gst-launch-1.0 -e $branches >"$out/pipeline-$streams.txt" 2>&1
  rc=$?
  end=$(date +%s.%N)
  played=$(grep -o "Execution ended after [0-9:.]*" "$out/pipeline-$streams.txt" | awk '{print $4}')
  python3 - "$streams" "$frames" "$start" "$end" "$played" "$rc" <<'EOF' | tee -a "$out/pipeline.txt"
import sys
streams, frames, start, end, played, rc = sys.argv[1:]
h, m, s = played.split(":") if played else ("0", "0", "0")
playing = int(h) * 3600 + int(m) * 60 + float(s)
total = int(streams) * int(frames)
fps = total / playing if playing else 0.0
print(f"| {streams} | {total} | {float(end) - float(start):.2f} s | {playing:.2f} s | {fps:.0f} | {fps / int(streams):.0f} | exit {rc} |")
EOF
done

echo
echo "== our engine (fp16) =="
grep "^|" "$out/bench.md"
echo
echo "== PyTorch fp16 =="
tail -22 "$out/torch_bench.txt"
echo
echo "== pipelines: nvh264dec 1080p -> trtclassify resnet50 fp16 batch 8 =="
echo "| streams | frames | wall | playing | frames/s | per stream |"
grep "^|" "$out/pipeline.txt"
