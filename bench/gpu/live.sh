#!/usr/bin/env bash
# The camera server under real operation, on the GPU host after pack.sh (see
# bench/gpu/README.md): live NVDEC cameras into trtclassify with `examples/live_cameras`
# (packed as `live_cameras`). Each camera is the benchmark video, decoded by NVDEC and handed
# on at its 30 fps by `identity sync=true` (which answers the latency query as live, as a
# camera source does), played again from the start at its end for as long as the run lasts.
#
#   bench/gpu/live.sh capacity   the engine's capacity: 16 cameras not live (as fast as they
#                                decode) for 20 s, frames classified a second
#   bench/gpu/live.sh wait       CAMERAS cameras (default: twice what the engine classifies,
#                                from `capacity`) for SECONDS_RUN (60) with max-lateness=-1:
#                                every frame waits for its result, as before the overload policy
#   bench/gpu/live.sh overload   the same with the policy, for SECONDS_RUN (300); a long run is
#                                the soak test too (GPU memory and RSS at the first minute and
#                                at the end)
#   bench/gpu/live.sh update     CAMERAS (64) cameras for SECONDS_RUN (180), the model swapped
#                                between MODELS every EVERY (30) seconds
#   bench/gpu/live.sh soak       CAMERAS (64) cameras within capacity for SECONDS_RUN (600):
#                                GPU memory and RSS at the first minute and at the end
#   bench/gpu/live.sh regions    secondary classification: CAMERAS (64) cameras not live, each
#                                frame with REGIONS (8) boxes of 48 to 328 pixels, the
#                                video played once as fast as it decodes (at most
#                                SECONDS_RUN, 120): decode only, then MODEL (resnet18) on every
#                                box (`roi=regions`, PRECISION fp16) with batches in flight and
#                                with each batch waited for, then decode only again; a row
#                                each: frames/s beside decode only, share, crops/s
#
# Environment: MODEL (vit_b_16), PRECISION (fp32), MODELS (update: resnet50,mobilenet_v2, in
# fp16), BATCH (64), TIMEOUT (batch-timeout, 50), VIDEO (.gpu/files/bench1080.mp4), DEC
# (nvh264dec), BACKEND (cuda; with another, engines are not built ahead), SOURCE (video; `test`:
# GStreamer's live test source in system memory, WIDTHxHEIGHT NV12, 1280x720, in place of the
# decoded video, where NVDEC does not work). Models are
# exported into /tmp/tv when missing; engines are built ahead into the element's default cache
# ($XDG_CACHE_HOME, /tmp/trtcache) so that runs start without a build. Rows are appended to
# $GPU_OUT/live.md (default /tmp/gpu-out); `capacity` leaves its figure in
# $GPU_OUT/capacity-MODEL-PRECISION.txt. Exits non-zero when a run fails.
set -uo pipefail
out=${GPU_OUT:-/tmp/gpu-out}
mkdir -p "$out" /tmp/tv
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/trtcache}
video=${VIDEO:-$PWD/.gpu/files/bench1080.mp4}
batch=${BATCH:-64}
dec=${DEC:-nvh264dec}
backend=${BACKEND:-cuda}
timeout=${TIMEOUT:-50}
mode=${1:?usage: live.sh capacity|wait|overload|update|soak|regions}
status=0

export_models() { # NAME...
  local missing=()
  for m in "$@"; do [ -e "/tmp/tv/$m.onnx" ] || missing+=("$m"); done
  [ ${#missing[@]} -eq 0 ] && return
  python3 bench/gpu/torch_models.py export /tmp/tv --models "$(IFS=,; echo "${missing[*]}")" \
    >>"$out/live-export.txt" 2>&1 || { echo "export of ${missing[*]} failed"; status=1; }
}

build() { # NAME PRECISION
  [ "$backend" = cuda ] || return 0
  trtclassify-engine build "/tmp/tv/$1.onnx" --batch-size "$batch" --precision "$2" \
    >>"$out/live-build.log" 2>&1 || { echo "engine build of $1 failed: $(tail -1 "$out/live-build.log")"; status=1; }
}

source_of() { # live|file
  if [ "${SOURCE:-video}" = test ]; then
    # GStreamer's test source, each camera at another phase of the frame period.
    local live=false
    [ "$1" = live ] && live=true
    echo "videotestsrc is-live=$live pattern=ball timestamp-offset={offset} ! video/x-raw,format=NV12,width=${WIDTH:-1280},height=${HEIGHT:-720},framerate=30/1"
    return
  fi
  local pace=""
  [ "$1" = live ] && pace=" ! identity sync=true ts-offset=-{offset}"
  echo "filesrc location=$video ! qtdemux name=demux{i} ! h264parse ! $dec$pace"
}

run() { # LABEL CAMERAS SECONDS live|file ELEMENT-PROPERTIES [live_cameras options...]
  local label=$1 cameras=$2 seconds=$3 kind=$4 props=$5
  shift 5
  echo "== $label: $cameras cameras, $seconds s ($kind)"
  local loop=--loop
  [ "${SOURCE:-video}" = test ] || [ -n "${ONCE:-}" ] && loop=""
  # shellcheck disable=SC2086
  GST_DEBUG="trtclassify:3${GST_DEBUG:+,$GST_DEBUG}" timeout $((seconds + 240)) live_cameras \
    --streams "$cameras" --seconds "$seconds" $loop --label "$label" \
    --source "$(source_of "$kind")" --element "backend=$backend batch-size=$batch batch-timeout=$timeout $props" \
    "$@" >"$out/live-$label.txt" 2>"$out/live-$label.log"
  local rc=$?
  [ $rc -eq 0 ] || { echo "$label: exit $rc: $(tail -2 "$out/live-$label.log")"; status=1; }
  head -2 "$out/live-$label.txt"
  grep '^| ' "$out/live-$label.txt" | tail -1 | tee -a "$out/live.md"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
  tee "$out/gpu.txt"
model=${MODEL:-vit_b_16} precision=${PRECISION:-fp32}
props="onnx-location=/tmp/tv/$model.onnx precision=$precision"
capacity_file=$out/capacity-$model-$precision.txt
cameras() { # twice what the engine classifies, at 30 fps a camera, 2 to 128
  local c=${CAMERAS:-$(( (2 * $(cat "$capacity_file" 2>/dev/null || echo 960) + 15) / 30 ))}
  [ "$c" -gt 128 ] && c=128
  [ "$c" -lt 2 ] && c=2
  echo "$c"
}
case $mode in
  capacity)
    export_models "$model"
    build "$model" "$precision"
    run "$model-$precision-capacity" 16 "${SECONDS_RUN:-20}" file "$props"
    grep -oE 'classified \([0-9]+ a second' "$out/live-$model-$precision-capacity.txt" |
      grep -oE '[0-9]+' | tee "$capacity_file"
    ;;
  wait)
    run "$model-$precision-wait" "$(cameras)" "${SECONDS_RUN:-60}" live "$props max-lateness=-1"
    ;;
  overload)
    run "$model-$precision-overload" "$(cameras)" "${SECONDS_RUN:-300}" live "$props"
    ;;
  soak)
    export_models "$model"
    build "$model" "$precision"
    run "$model-$precision-soak" "${CAMERAS:-64}" "${SECONDS_RUN:-600}" live "$props"
    ;;
  update)
    IFS=, read -r a b <<<"${MODELS:-resnet50,mobilenet_v2}"
    export_models "$a" "$b"
    build "$a" fp16
    build "$b" fp16
    run "update-$a-$b" "${CAMERAS:-64}" "${SECONDS_RUN:-180}" live "onnx-location=/tmp/tv/$a.onnx" \
      --swap "/tmp/tv/$a.onnx,/tmp/tv/$b.onnx" --every "${EVERY:-30}"
    ;;
  regions)
    model=${MODEL:-resnet18} precision=${PRECISION:-fp16}
    cams=${CAMERAS:-64} k=${REGIONS:-8} secs=${SECONDS_RUN:-120}
    # Each camera plays the video once, as fast as it decodes (segment seeks on NVDEC's
    # output fail to negotiate with this GStreamer): frames/s over PLAYING to EOS.
    export ONCE=1
    export_models "$model"
    build "$model" "$precision"
    props="onnx-location=/tmp/tv/$model.onnx precision=$precision roi=regions"
    # Decode only before and after; the engine with batches in flight (the default) and
    # with each batch waited for in the push that fills it (TRTCLASSIFY_BATCHES_IN_FLIGHT=0).
    run "decode-$cams-regions" "$cams" "$secs" file "" --decode-only --regions "$k"
    run "$model-$precision-$cams-regions" "$cams" "$secs" file "$props" --regions "$k"
    TRTCLASSIFY_BATCHES_IN_FLIGHT=0 run "$model-$precision-$cams-regions-sync" "$cams" "$secs" \
      file "$props" --regions "$k"
    run "decode-$cams-regions-after" "$cams" "$secs" file "" --decode-only --regions "$k"
    # "regions: K a frame attached, N classified (C a second), F frames a second out"
    fps() { grep -oE '[0-9.]+ frames a second out' "$out/live-$1.txt" | grep -oE '^[0-9.]+'; }
    crops() { grep -oE 'classified \([0-9]+ a second' "$out/live-$1.txt" | tail -1 | grep -oE '[0-9]+'; }
    decode=$(fps "decode-$cams-regions") after=$(fps "decode-$cams-regions-after")
    echo "decode only: ${decode:-?} frames/s before, ${after:-?} after" | tee -a "$out/live.md"
    echo "| classifier on the boxes | batches | cameras | boxes a frame | decode-only frames/s | with it frames/s | share | crops/s |" | tee -a "$out/live.md"
    echo "|---|---|---|---|---|---|---|---|" | tee -a "$out/live.md"
    for variant in "in flight:$model-$precision-$cams-regions" "waited for:$model-$precision-$cams-regions-sync"; do
      how=${variant%%:*} label=${variant#*:} classify=$(fps "${variant#*:}")
      echo "| $model $precision | $how | $cams | $k | ${decode:-?} | ${classify:-?} | $(python3 -c "print(f'{100*${classify:-0}/max(${decode:-0},1):.1f}%')") | $(crops "$label") |" |
        tee -a "$out/live.md"
    done
    ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
exit $status
