#!/usr/bin/env bash
# The two batch-1 states (docs/benchmarks.md, "what the two states are not") on the GPU
# host, from the repository root, after pack.sh: what puts one process of this build in the
# faster state and another in the slower. Each line is one `trtclassify-engine bench MODEL
# --batches 1 --runs RUNS --check` process, with the engine's debug log (where its arena and
# weights lie) kept under $GPU_OUT/states:
#   1. the timed choice of algorithms: FOLDERS fresh engine folders (default 4), each built
#      once and run twice: bimodal across folders and stable within one means the build's
#      choices decide the state;
#   2. placement: the first folder's engine again, with `--hold-gpu-memory MIB` for each of
#      HOLDS (default 1 2 4 32 256 600): the weights and buffers moved, the plan the same;
#   3. every library kernel loaded up front (`CUDA_MODULE_LOADING=EAGER`), the slower state
#      in every run so far;
# with the SM and memory clocks sampled throughout (`nvidia-smi dmon -s pc`; the range of
# each is printed at the end).
#
#   bench/gpu/states.sh [MODEL.onnx]        default: /tmp/tv/resnet50.onnx
set -uo pipefail
. .gpu/gpu-env.sh >/dev/null
out=${GPU_OUT:-/tmp/gpu-out}/states
rm -rf "$out"
mkdir -p "$out"
model=${1:-/tmp/tv/resnet50.onnx}
[ -e "$model" ] || { echo "$model: no such model (bench/gpu/torch_models.py export /tmp/tv)" >&2; exit 2; }
nvidia-smi dmon -s pc -d 1 >"$out/clocks.txt" 2>&1 &
dmon=$!
failed=0
echo "| process | latency | images/s | check | arena | weights from |"
echo "|---|---|---|---|---|---|"
# run NAME [ENV=VALUE...] -- [BENCH ARGUMENTS...]: one bench process and its table row.
run() {
    local name=$1 log=$out/$1
    shift
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    env "${envs[@]}" GST_DEBUG=trtclassify-engine:5 GST_DEBUG_NO_COLOR=1 trtclassify-engine bench \
        "$model" --batches 1 --runs "${RUNS:-500}" --check "$@" >"$log.md" 2>"$log.log" ||
        { echo "$name: bench failed: $log.log" >&2; failed=1; return; }
    awk -F'|' -v name="$name" \
        -v arena="$(grep -o 'arena at 0x[0-9a-f]*' "$log.log" | tail -1 | cut -d' ' -f3)" \
        -v weights="$(grep -o 'weights from 0x[0-9a-f]*' "$log.log" | tail -1 | cut -d' ' -f3)" \
        'NF == 11 && $2 !~ /^ *(model|-)/ { printf "| %s |%s|%s|%s| %s | %s |\n", name, $7, $8, $10, arena, weights }' \
        "$log.md"
}
for i in $(seq 1 "${FOLDERS:-4}"); do
    for r in 1 2; do
        run "folder $i, run $r" -- --engine-dir "$out/engines-$i"
    done
done
for mib in ${HOLDS:-1 2 4 32 256 600}; do
    run "folder 1, $mib MiB held" -- --engine-dir "$out/engines-1" --hold-gpu-memory "$mib"
done
run "folder 1, eager loading" CUDA_MODULE_LOADING=EAGER -- --engine-dir "$out/engines-1"
kill "$dmon"
# dmon's columns: gpu pwr gtemp mtemp mclk pclk (MHz).
awk '$1 ~ /^[0-9]+$/ { m = $5; p = $6; if (!n++) { mlo = mhi = m; plo = phi = p }
        if (m < mlo) mlo = m; if (m > mhi) mhi = m; if (p < plo) plo = p; if (p > phi) phi = p }
     END { if (n) printf "clocks over %d samples: SM %d-%d MHz, memory %d-%d MHz\n", n, plo, phi, mlo, mhi }' \
    "$out/clocks.txt"
exit $failed
