#!/usr/bin/env bash
# Makes the test clips of tests/clips (committed; run again only to change them): 24 frames
# of 320x240 at 30 fps, 8 red, then 8 green, then 8 blue, in every codec that NVDEC reads and
# this machine can encode: H.264 (openh264enc), H.265 8-bit and 10-bit (x265enc; NVDEC gives
# P010 for the 10-bit one), VP9 (vp9enc) and AV1 (av1enc). The tests check each frame's
# colour after decoding (software decoders on the CPU, NVDEC on the GPU host).
set -euo pipefail
cd "$(dirname "$0")"
sources=""
for colour in red green blue; do
  sources+=" videotestsrc pattern=$colour num-buffers=8 ! video/x-raw,width=320,height=240,framerate=30/1 ! c."
done
clip() { # FILE FORMAT ENCODER... (the encoder, parser and muxer as one launch fragment)
  local file=$1 format=$2
  shift 2
  # shellcheck disable=SC2086
  gst-launch-1.0 -q concat name=c ! videoconvert ! "video/x-raw,format=$format" ! "$@" ! \
    filesink location="$file" $sources
}
clip h264.mp4 I420 openh264enc bitrate=500000 rate-control=bitrate ! h264parse ! mp4mux
clip h265.mp4 I420 x265enc speed-preset=ultrafast ! h265parse ! mp4mux
clip h265-10bit.mp4 I420_10LE x265enc speed-preset=ultrafast ! h265parse ! mp4mux
clip vp9.mkv I420 vp9enc deadline=1 ! matroskamux
clip av1.mkv I420 av1enc cpu-used=8 ! av1parse ! matroskamux
ls -l ./*.mp4 ./*.mkv
