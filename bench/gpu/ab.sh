#!/usr/bin/env bash
# Builds of the engine side by side on the GPU host, from the repository root, after
# pack.sh (see bench/gpu/README.md): `trtclassify-engine bench` of this build and of
# BEFORE=OTHER_BINARY (an earlier commit's; several, separated by spaces, for more builds,
# each named by its file's name) alternating, each with engine files of its own, so that a
# change's gain is measured in one run on one GPU.
#
#   BEFORE=/tmp/gpubin/trtclassify-engine-base bench/gpu/ab.sh [MODEL.onnx...]
#
# Default models /tmp/tv/{resnet50,vit_b_16}.onnx; BATCHES (default 1,64), ROUNDS (default 2),
# RUNS (default 500) and ARGS (more arguments to bench, e.g. `--precision int8 --calibration
# FILE`). Each round runs BEFORE first, then this build; the engine files are built before
# the first round. Prints, per model and batch, each build's median latency and images/s
# of every round, and its check against the export's reference.
set -uo pipefail
. .gpu/gpu-env.sh >/dev/null
[ -n "${BEFORE:-}" ] || { echo "BEFORE=OTHER_BINARY is required" >&2; exit 2; }
out=${GPU_OUT:-/tmp/gpu-out}/ab
rm -rf "$out"
mkdir -p "$out"
. "$(dirname "$0")/models.sh"
read -ra bins <<<"$BEFORE"
names=()
for b in "${bins[@]}"; do names+=("$(basename "$b")"); done
[ ${#bins[@]} -gt 1 ] || names=(before)
bins+=(trtclassify-engine)
names+=(this)
failed=0
for round in $(seq 0 "${ROUNDS:-2}"); do
    for b in "${!bins[@]}"; do
        log=$out/${names[$b]}-$round
        # Round 0 builds the engine files, untimed.
        runs=${RUNS:-500}
        [ "$round" -eq 0 ] && runs=5
        # shellcheck disable=SC2086
        "${bins[$b]}" bench "${models[@]}" --batches "${BATCHES:-1,64}" --runs "$runs" --check \
            --engine-dir "$out/engines-$b" ${ARGS:-} >"$log.md" 2>"$log.log" ||
            { echo "${bins[$b]} bench failed (round $round): $log.log" >&2; failed=1; }
        # The engine table's rows (9 columns), not its header or the preprocessing table's.
        [ "$round" -gt 0 ] && awk -F'|' 'NF == 11 && $2 !~ /^ *(model|-)/' "$log.md" |
            sed "s/^/${names[$b]} $round /" >>"$out/rows.txt"
    done
done
echo "| model | precision | batch | build | latency, each round | images/s, each round | check (last round) |"
echo "|---|---|---|---|---|---|---|"
awk -F'|' '
    { split($1, head, " "); build = head[1]; key = $2 "|" $3 "|" $4 "|" build
      if (!(key in lat)) order[++n] = key
      gsub(/^ +| +$/, "", $7); gsub(/^ +| +$/, "", $8); gsub(/^ +| +$/, "", $10)
      lat[key] = lat[key] (lat[key] == "" ? "" : " / ") $7
      ips[key] = ips[key] (ips[key] == "" ? "" : " / ") $8
      check[key] = $10 }
    END { for (i = 1; i <= n; ++i) { k = order[i]; split(k, f, "|")
          printf "|%s|%s|%s| %s | %s | %s | %s |\n", f[1], f[2], f[3], f[4], lat[k], ips[k], check[k] } }
' "$out/rows.txt" | sort -t'|' -k2,2 -k4,4n -k5,5
exit $failed
