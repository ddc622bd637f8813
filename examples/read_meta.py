#!/usr/bin/python3
"""Reads trtclassify's classification metadata from Python, without the Rust crate.

Run with Debian's python3 (python3-gi, python3-gst-1.0) and the plugin on GST_PLUGIN_PATH:

    GST_PLUGIN_PATH=target/debug /usr/bin/python3 examples/read_meta.py [PATTERN]

Prints one line per frame: frame index, fresh flag and the (label, confidence) pairs.
"""
import sys

import gi

gi.require_version("Gst", "1.0")
from gi.repository import Gst  # noqa: E402


def classification(buffer):
    """The result attached to a buffer as a dict, or None."""
    meta = buffer.get_custom_meta("TrtClassifyMeta")
    if meta is None:
        return None
    s = meta.get_structure()
    return {
        "model": s.get_string("model"),
        "frame": s.get_value("frame"),
        "fresh": s.get_value("fresh"),
        "class_ids": list(s.get_value("class-ids")),
        "labels": list(s.get_value("labels")),
        "confidences": list(s.get_value("confidences")),
    }


def main():
    pattern = sys.argv[1] if len(sys.argv) > 1 else "red"
    Gst.init(None)
    pipeline = Gst.parse_launch(
        f"videotestsrc num-buffers=5 pattern={pattern} ! "
        "trtclassify onnx-location=models/colors.onnx labels-location=models/colors.txt top-k=2 ! "
        "appsink name=sink emit-signals=true sync=false"
    )

    def on_sample(sink):
        sample = sink.emit("pull-sample")
        result = classification(sample.get_buffer())
        pairs = ", ".join(f"{l} {c:.3f}" for l, c in zip(result["labels"], result["confidences"]))
        print(f"frame {result['frame']} fresh={result['fresh']} {pairs}", flush=True)
        return Gst.FlowReturn.OK

    pipeline.get_by_name("sink").connect("new-sample", on_sample)
    pipeline.set_state(Gst.State.PLAYING)
    msg = pipeline.get_bus().timed_pop_filtered(
        30 * Gst.SECOND, Gst.MessageType.EOS | Gst.MessageType.ERROR
    )
    pipeline.set_state(Gst.State.NULL)
    if msg is None or msg.type == Gst.MessageType.ERROR:
        print("error:", msg.parse_error() if msg else "timeout", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
