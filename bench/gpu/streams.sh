#!/usr/bin/env bash
# Many cameras on one GPU, on the GPU host after pack.sh (see bench/gpu/README.md): N streams
# of a video file in one gst-launch-1.0, decode only (NVDEC) and decode + trtclassify (frames
# read in CUDA memory, one engine shared by all elements), side by side in one run. One table
# row per pipeline: frames/s, GPU, decoder and CPU busy, GPU memory, and the time frames spend in
# trtclassify (buffer in to buffer out): p50, p99 and the slowest frame.
#
#   bench/gpu/streams.sh MODE STREAMS...
#
# MODE: decode | MODEL (a name of /tmp/tv/MODEL.onnx, exported by torch_models.py) |
#       download:MODEL (the old path: cudadownload to system memory before trtclassify) |
#       own:MODEL (each element an engine of its own: model-instance-id per stream)
# Environment: VIDEO (default .gpu/files/bench1080.mp4), FRAMES (frames in VIDEO, 600),
# PARSE/DEC (h264parse/nvh264dec), BATCH (64), TIMEOUT (batch-timeout ms, 50), LABEL,
# LIVE=1 (frames reach trtclassify at the video's 30 fps per stream, as from a live camera:
# `identity sync=true` after the decoder keeps each frame until its time, each stream at
# another phase of the frame period; the time in
# trtclassify is then what a CCTV user sees, where without it every stream decodes as fast as
# it can and frames queue for the saturated GPU).
# GPUS=N spreads the streams over N GPUs: stream i is decoded by GPU (i mod N)'s decoder
# (nvh264dec for GPU 0, nvh264device1dec, ... for the others) and classified where its frames
# are (trtclassify's gpu-id=-1, the default); STREAMS then counts all streams. PROCS=gpu runs
# one gst-launch-1.0 per GPU side by side instead of one for all (frames/s: all frames over
# the slowest process's time). With several GPUs the GPU columns are the means over the GPUs'
# samples and the memory column the GPU that grew most.
# Logs go to $GPU_OUT (or /tmp/gpu-out); rows are appended to streams.md there. Exits 1 if
# any pipeline failed (its row's exit column says which), after running them all.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${GPU_OUT:-/tmp/gpu-out}
mkdir -p "$out"
video=${VIDEO:-$PWD/.gpu/files/bench1080.mp4}
frames=${FRAMES:-600}
parse=${PARSE:-h264parse}
dec=${DEC:-nvh264dec}
batch=${BATCH:-64}
timeout=${TIMEOUT:-50}
pace=""
mode=$1
shift
status=0

element() { # MODEL [INSTANCE]
  local engine=/tmp/engines/$1-b$batch.engine
  if [ ! -e "$engine" ]; then
    mkdir -p /tmp/engines
    trtclassify-engine build "/tmp/tv/$1.onnx" --engine "$engine" --batch-size "$batch" \
      >>"$out/engine-build.log" 2>&1
  fi
  echo "trtclassify onnx-location=/tmp/tv/$1.onnx backend=cuda engine-location=$engine" \
    "batch-size=$batch batch-timeout=$timeout ${2:+model-instance-id=$2}"
}

gpus=${GPUS:-1}
# The decoder of GPU $1: nvh264dec, nvh264device1dec, ...
decoder_of() {
  if [ "$1" -eq 0 ]; then echo "$dec"; else echo "${dec%dec}device$1dec"; fi
}

for n in "$@"; do
  branches=""
  declare -A per_gpu=()
  for i in $(seq "$n"); do
    gpu=$(( (i - 1) % gpus ))
    # Cameras do not tick together: stream i's frames come i/n of a frame period early.
    [ -n "${LIVE:-}" ] && pace="identity sync=true ts-offset=-$((i * 33333333 / n)) !"
    case $mode in
      decode) tail="" ;;
      download:*) tail="cudadownload ! video/x-raw,format=NV12 ! $(element "${mode#download:}") !" ;;
      own:*) tail="$(element "${mode#own:}" "stream$i") !" ;;
      *) tail="$(element "$mode") !" ;;
    esac
    branch=" filesrc location=$video ! qtdemux ! $parse ! $(decoder_of "$gpu") ! $pace $tail fakesink sync=false async=false"
    branches+=$branch
    per_gpu[$gpu]+=$branch
  done
  name="${LABEL:-$mode}-$n"
  name=${name//[:\/]/_}
  idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -1)
  nvidia-smi --query-gpu=utilization.gpu,utilization.decoder,memory.used \
    --format=csv,noheader,nounits -lms 200 >"$out/smi-$name.csv" 2>/dev/null &
  smi=$!
  cpu_before=$(head -1 /proc/stat)
  # No segfault handler: it would wait for a debugger forever (NVDEC's teardown of 128
  # decoders has crashed once after EOS); a run that hangs is stopped after 5 minutes.
  if [ "${PROCS:-one}" = gpu ]; then
    # One process per GPU; the row takes the slowest one's time and every process's log.
    pids=()
    for g in "${!per_gpu[@]}"; do
      # shellcheck disable=SC2086
      GST_DEBUG="trtclassify:4${GST_DEBUG:+,$GST_DEBUG}" GST_DEBUG_NO_COLOR=1 timeout 300 gst-launch-1.0 --gst-disable-segtrap -e ${per_gpu[$g]} \
        >"$out/run-$name-gpu$g.txt" 2>"$out/run-$name-gpu$g.log" &
      pids+=($!)
    done
    rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    cat "$out"/run-"$name"-gpu*.log >"$out/run-$name.log"
    grep -h "Execution ended after" "$out"/run-"$name"-gpu*.txt | sort -k4 | tail -1 >"$out/run-$name.txt"
  else
    # shellcheck disable=SC2086
    GST_DEBUG="trtclassify:4${GST_DEBUG:+,$GST_DEBUG}" GST_DEBUG_NO_COLOR=1 timeout 300 gst-launch-1.0 --gst-disable-segtrap -e $branches \
      >"$out/run-$name.txt" 2>"$out/run-$name.log"
    rc=$?
  fi
  [ "$rc" -eq 0 ] || status=1
  cpu_after=$(head -1 /proc/stat)
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  python3 "$here/streams_row.py" --label "${LABEL:-$mode}" --streams "$n" --frames "$frames" \
    --idle-mib "$idle" --rc "$rc" --launch "$out/run-$name.txt" --log "$out/run-$name.log" \
    --smi "$out/smi-$name.csv" --cpu "$cpu_before" "$cpu_after" | tee -a "$out/streams.md"
done
exit $status
