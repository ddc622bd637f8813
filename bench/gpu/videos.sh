#!/usr/bin/env bash
# Encodes the benchmark videos on the development machine (the GPU host has NVDEC but no
# encoder), into DIR (default .gpu-videos): bench1080.mp4 (H.264 1920x1080 30 fps, 600
# frames), bench1080-h265.mp4 (the same, H.265) and bench2160-h265.mp4 (3840x2160, 300 frames,
# H.265: openh264 refuses 4K). Needs gst-plugins-bad (openh264enc, x265enc, h26xparse) and
# gst-plugins-good (mp4mux). Pack them with ../shared/gpu-host/pack.sh DIR/*.mp4.
set -euo pipefail
dir=${1:-.gpu-videos}
mkdir -p "$dir"
src() { echo "videotestsrc pattern=ball num-buffers=$1 ! video/x-raw,width=$2,height=$3,framerate=30/1,format=I420"; }
# shellcheck disable=SC2046
gst-launch-1.0 -q $(src 600 1920 1080) ! openh264enc bitrate=2000000 rate-control=bitrate ! \
    h264parse ! mp4mux ! filesink location="$dir/bench1080.mp4"
# shellcheck disable=SC2046
gst-launch-1.0 -q $(src 600 1920 1080) ! x265enc speed-preset=ultrafast bitrate=2000 ! \
    h265parse ! mp4mux ! filesink location="$dir/bench1080-h265.mp4"
# shellcheck disable=SC2046
gst-launch-1.0 -q $(src 300 3840 2160) ! x265enc speed-preset=ultrafast bitrate=8000 ! \
    h265parse ! mp4mux ! filesink location="$dir/bench2160-h265.mp4"
ls -l "$dir"
