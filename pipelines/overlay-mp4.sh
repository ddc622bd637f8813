#!/bin/sh
# Draws the results on the video and writes an MP4 to watch.
# Usage: pipelines/overlay-mp4.sh [OUT.mp4] [VIDEO MODEL.onnx LABELS.txt]
# Without a video: 150 frames of a test source (a red ball on blue) and the colour model.
# Needs: gst-plugins-base/good, an H.264 encoder (x264enc from gst-plugins-ugly, or
# openh264enc from gst-plugins-bad) and, for a video, a decoder that decodebin finds.
set -e
here=$(cd "$(dirname "$0")/.." && pwd)
export GST_PLUGIN_PATH="${GST_PLUGIN_PATH:-$here/target/release}"
out=${1:-classified.mp4}
if [ $# -ge 4 ]; then
    source="filesrc location=$2 ! decodebin ! videoconvert"
    model="onnx-location=$3 labels-location=$4"
else
    source="videotestsrc num-buffers=150 pattern=ball foreground-color=0xffff0000 \
        background-color=0xff0000ff ! video/x-raw,width=640,height=360,framerate=30/1"
    model="onnx-location=$here/models/colors.onnx labels-location=$here/models/colors.txt"
fi
for encoder in x264enc openh264enc; do
    gst-inspect-1.0 --exists $encoder && break
done
gst-inspect-1.0 --exists $encoder || { echo "$0: no H.264 encoder (x264enc, openh264enc)" >&2; exit 1; }
# shellcheck disable=SC2086 # the source and model are pipeline fragments
gst-launch-1.0 -e $source ! trtclassify $model batch-size=8 ! trtclassifyoverlay ! \
    videoconvert ! $encoder ! h264parse ! mp4mux ! filesink location="$out"
echo "$out"
