#!/usr/bin/env bash
# Single-kernel microbenchmarks on the GPU host (CUDA 12.4 or later: nvcc, the driver API).
#   bench/gpu/microbench/run.sh softmax   the scores' softmax kernels, rows of 1000 and 197
#   bench/gpu/microbench/run.sh spread    64 small kernels in one graph, their code in one
#                                         module or spread over GPU memory by other code
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${TMPDIR:-/tmp}/trtclassify-microbench
mkdir -p "$out"
for k in hot pad sm; do nvcc -arch=native -cubin -o "$out/$k.cubin" "$here/$k.cu"; done
g++ -O2 -o "$out/mb" "$here/mb.cpp" -I/usr/local/cuda/include -L/usr/local/cuda/lib64/stubs -lcuda
cd "$out"
case ${1:-softmax} in
  softmax) ./mb softmax ;;
  spread)
    for mode in EAGER LAZY; do
      for pads in -1 0 4 16; do CUDA_MODULE_LOADING=$mode ./mb spread $pads | sed "s/^/$mode /"; done
    done ;;
  *) echo "usage: $0 softmax|spread" >&2; exit 2 ;;
esac
