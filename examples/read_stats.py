#!/usr/bin/python3
"""Reads trtclassify's `stats` property from Python: what the element did, while it runs.

Run with Debian's python3 (python3-gi, python3-gst-1.0) and the plugin on GST_PLUGIN_PATH:

    GST_PLUGIN_PATH=target/debug /usr/bin/python3 examples/read_stats.py [FRAMES]

Runs FRAMES frames (default 20) of a test source through the element in batches of 4, then
prints each field of the element's stats structure as `name=value`, one per line.
"""
import sys

import gi

gi.require_version("Gst", "1.0")
from gi.repository import Gst  # noqa: E402


def main():
    frames = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    Gst.init(None)
    pipeline = Gst.parse_launch(
        f"videotestsrc num-buffers={frames} pattern=red ! "
        "trtclassify name=classify onnx-location=models/colors.onnx batch-size=4 ! "
        "fakesink"
    )
    pipeline.set_state(Gst.State.PLAYING)
    msg = pipeline.get_bus().timed_pop_filtered(
        60 * Gst.SECOND, Gst.MessageType.EOS | Gst.MessageType.ERROR
    )
    if msg is None or msg.type == Gst.MessageType.ERROR:
        print(msg.parse_error() if msg else "timed out", file=sys.stderr)
        return 1
    # Read while the element still runs (PLAYING, at EOS): a monitoring application reads
    # it on a timer.
    stats = pipeline.get_by_name("classify").get_property("stats")
    pipeline.set_state(Gst.State.NULL)
    print(f"name={stats.get_name()}")
    for i in range(stats.n_fields()):
        field = stats.nth_field_name(i)
        print(f"{field}={stats.get_value(field)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
