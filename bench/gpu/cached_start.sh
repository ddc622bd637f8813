#!/usr/bin/env bash
# Cached start on the GPU host, from the repository root, after pack.sh (see
# bench/gpu/README.md): `trtclassify-engine build MODEL --batch-size 64 --engine FILE` with
# the engine file present, the whole process timed, after one start that builds the file.
#
#   bench/gpu/cached_start.sh [MODEL.onnx...]        default: /tmp/tv/{resnet50,vit_b_16}.onnx
#
# ROUNDS (default 5) timed starts per model; LEVEL=5 logs where each start's time goes
# (`GST_DEBUG=trtclassify-engine:5`, in the logs under $GPU_OUT/cached-start).
# BEFORE=OTHER_BINARY alternates each round with another build of trtclassify-engine (an
# earlier commit's), each with engine files and an engine cache (its remembered model
# digests) of its own, in a folder of this run. Prints
# each binary's median for each model, and the engine's own log lines of its last start
# (`loaded engine file` and `ready`, from the start of the engine's build: the model digest and
# the engine file read and checked; then the runtime).
set -uo pipefail
. .gpu/gpu-env.sh >/dev/null
out=${GPU_OUT:-/tmp/gpu-out}/cached-start
rm -rf "$out"
mkdir -p "$out"
. "$(dirname "$0")/models.sh"
bins=(trtclassify-engine)
[ -n "${BEFORE:-}" ] && bins+=("$BEFORE")
for round in $(seq 0 "${ROUNDS:-5}"); do
    for b in "${!bins[@]}"; do
        for m in "${models[@]}"; do
            name=$(basename "$m" .onnx)
            log=$out/$b-$name-$round.log
            s=$(date +%s%N)
            XDG_CACHE_HOME=$out/cache-$b GST_DEBUG=trtclassify-engine:${LEVEL:-4} GST_DEBUG_NO_COLOR=1 \
                "${bins[$b]}" build "$m" \
                --batch-size 64 --engine "$out/$b-$name.engine" >"$log" 2>&1 ||
                echo "${bins[$b]} build $m failed: $log" >&2
            e=$(date +%s%N)
            # Round 0 builds the engine file; a later round that saves one rebuilt it.
            if [ "$round" -gt 0 ]; then
                grep -q "saved engine file" "$log" && echo "round $round, ${bins[$b]}, $name: rebuilt" >&2
                echo "$b $name $(( (e - s) / 1000000 ))" >> "$out/starts.txt"
            fi
        done
    done
done
# Each binary's median for each model, with the engine's own lines of its last start.
echo "cached start, the whole process, median of ${ROUNDS:-5} (ms); the last start's engine lines:"
for b in "${!bins[@]}"; do
    for m in "${models[@]}"; do
        name=$(basename "$m" .onnx)
        vals=$(awk -v b="$b" -v m="$name" '$1 == b && $2 == m { print $3 }' "$out/starts.txt" | sort -n)
        median=$(awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }' <<<"$vals")
        echo "  ${bins[$b]} $name: $median ($(echo $vals))"
        echo "    $(grep -oE '(loaded engine file [^ ]+ \([^)]*\)|ready in [0-9.]+m?s)' \
            "$out/$b-$name-${ROUNDS:-5}.log" | tr '\n' ' ')"
    done
done
