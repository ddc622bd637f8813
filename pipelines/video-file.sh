#!/bin/sh
# Classify every frame of a video file, results to a JSON-lines file.
# Usage: pipelines/video-file.sh VIDEO MODEL.onnx LABELS.txt [RESULTS.jsonl]
# Needs: GStreamer with gst-plugins-base/good and a decoder for the file (decodebin picks it:
# gst-libav or gst-plugins-bad/ugly for H.264/H.265). Runs as fast as the backend allows.
set -e
[ $# -ge 3 ] || { echo "usage: $0 VIDEO MODEL.onnx LABELS.txt [RESULTS.jsonl]" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
export GST_PLUGIN_PATH="${GST_PLUGIN_PATH:-$here/target/release}"
exec gst-launch-1.0 -e \
    filesrc location="$1" ! decodebin ! videoconvert ! \
    trtclassify onnx-location="$2" labels-location="$3" batch-size=${BATCH:-8} batch-timeout=-1 \
        results-location="${4:-results.jsonl}" ! \
    fakesink sync=false
