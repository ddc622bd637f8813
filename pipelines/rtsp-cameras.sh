#!/bin/sh
# Classify many live RTSP cameras (H.264) with one shared engine, results to standard output
# (one JSON line per frame; the "model" is the same for all, so the lines of each camera are
# told apart by the file: RESULTS_DIR/cameraN.jsonl when RESULTS_DIR is set).
# Usage: pipelines/rtsp-cameras.sh MODEL.onnx LABELS.txt rtsp://cam1/stream rtsp://cam2/stream ...
# With nvh264dec (gst-plugins-bad's nvcodec, an NVIDIA GPU) frames are decoded by NVDEC and
# classified in CUDA memory, never copied to host memory; otherwise the software decoder
# (decodebin: gst-libav's avdec_h264 or openh264dec) feeds the element system memory.
# On a machine of several GPUs the cameras are spread over them, camera i on GPU i mod N
# (GStreamer names the decoders of GPU 1 and up nvh264device1dec, nvh264device2dec, ...), and
# each element classifies on its decoder's GPU (gpu-id=-1, the default). The elements on one
# GPU have the same settings, so they share one engine and fill its batches together;
# batch-timeout bounds how long a frame waits when cameras hiccup.
set -e
[ $# -ge 3 ] || { echo "usage: $0 MODEL.onnx LABELS.txt RTSP-URL..." >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
export GST_PLUGIN_PATH="${GST_PLUGIN_PATH:-$here/target/release}"
model=$1 labels=$2
shift 2
# The NVDEC decoders, one per GPU: nvh264dec (GPU 0), nvh264device1dec, ...
decoders=""
if gst-inspect-1.0 nvh264dec >/dev/null 2>&1; then
    decoders="nvh264dec"
    n=1
    while gst-inspect-1.0 "nvh264device${n}dec" >/dev/null 2>&1; do
        decoders="$decoders nvh264device${n}dec"
        n=$((n + 1))
    done
fi
gpus=$(echo $decoders | wc -w)
branches=""
i=0
for url in "$@"; do
    if [ "$gpus" -gt 0 ]; then
        # Camera i on GPU i mod N.
        decode=$(echo $decoders | cut -d' ' -f$((i % gpus + 1)))
    else
        decode="decodebin ! videoconvert"
    fi
    i=$((i + 1))
    results="-"
    [ -n "${RESULTS_DIR:-}" ] && results="$RESULTS_DIR/camera$i.jsonl"
    branches="$branches rtspsrc location=$url latency=200 ! rtph264depay ! h264parse ! $decode ! \
        trtclassify onnx-location=$model labels-location=$labels batch-size=${BATCH:-16} \
            batch-timeout=${TIMEOUT:-40} interval=${INTERVAL:-1} results-location=$results ! \
        fakesink sync=true"
done
# shellcheck disable=SC2086
exec gst-launch-1.0 -e $branches
