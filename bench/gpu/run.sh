#!/usr/bin/env bash
# The whole GPU run, on the GPU host, from the repository root, after pack.sh (see
# bench/gpu/README.md): exports the torchvision models, runs the cuda correctness tests,
# benchmarks our engine and PyTorch side by side, and prints the tables last.
set -uo pipefail
. .gpu/gpu-env.sh >/dev/null
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out" /tmp/tv
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
models=${MODELS:-resnet50,mobilenet_v2,efficientnet_b0,mobilenet_v3_small,squeezenet1_0,shufflenet_v2_x1_0,regnet_y_400mf,densenet121,convnext_tiny}
python3 bench/gpu/torch_models.py export /tmp/tv --models "$models" 2>&1 | tail -12
cuda_test=$(ls /tmp/gpubin/cuda-* | head -1)
TRTCLASSIFY_MODELS_DIR=$PWD/models TRTCLASSIFY_TORCHVISION_DIR=/tmp/tv GST_DEBUG=trtclassify:4 \
  "$cuda_test" --nocapture --test-threads=1 2>"$out/cuda-test.log" | tee "$out/cuda-test.txt"
grep -E "cuda engine built|error|Error" "$out/cuda-test.log" | head -20
bench_cuda /tmp/tv/resnet50.onnx /tmp/tv/mobilenet_v2.onnx /tmp/tv/efficientnet_b0.onnx \
  2>"$out/bench.log" | tee "$out/bench_cuda.md"
python3 bench/gpu/torch_models.py bench --models resnet50,mobilenet_v2,efficientnet_b0 \
  --json "$out/torch_bench.json" 2>&1 | tail -25
