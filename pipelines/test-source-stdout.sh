#!/bin/sh
# Live test source, results to standard output as JSON lines. Needs: GStreamer with
# gst-plugins-base, the plugin built (cargo build --release) and nothing else: no GPU.
# Cycles through solid colours so the colour model has something to say.
set -e
cd "$(dirname "$0")/.."
export GST_PLUGIN_PATH="${GST_PLUGIN_PATH:-$PWD/target/release}"
exec gst-launch-1.0 -q \
    videotestsrc is-live=true num-buffers=${FRAMES:-90} pattern=${PATTERN:-red} ! \
    video/x-raw,width=320,height=240,framerate=30/1 ! \
    trtclassify onnx-location=models/colors.onnx labels-location=models/colors.txt \
        top-k=${TOPK:-2} batch-size=4 batch-timeout=50 results-location=- ! \
    fakesink sync=true
