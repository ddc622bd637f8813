#!/bin/sh
# Classify a live RTSP camera (H.264), results to standard output.
# Usage: pipelines/rtsp-camera.sh rtsp://camera/stream MODEL.onnx LABELS.txt
# Needs: gst-plugins-good (rtspsrc, rtph264depay), gst-plugins-bad (h264parse) and an H.264
# decoder (gst-libav's avdec_h264; on NVIDIA, nvh264dec from gst-plugins-bad).
# batch-timeout bounds how long a frame waits for batch-mates when the camera hiccups, and
# the added latency is reported to the pipeline.
set -e
[ $# -ge 3 ] || { echo "usage: $0 RTSP-URL MODEL.onnx LABELS.txt" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
export GST_PLUGIN_PATH="${GST_PLUGIN_PATH:-$here/target/release}"
exec gst-launch-1.0 -e \
    rtspsrc location="$1" latency=200 ! rtph264depay ! h264parse ! decodebin ! videoconvert ! \
    trtclassify onnx-location="$2" labels-location="$3" batch-size=4 batch-timeout=40 \
        interval=${INTERVAL:-1} results-location=- ! \
    fakesink sync=true
