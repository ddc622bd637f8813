// SPDX-License-Identifier: MPL-2.0
/**
 * element-trtclassifyoverlay:
 *
 * Draws what `trtclassify` found on the video, so that a person can watch it: the frame's
 * top class and confidence (from `TrtClassifyMeta`) in the top-left corner, and each
 * classified region of interest's outline with the labels of its `classification` params
 * (one line per classifier in series) at its top-left corner. Text is laid out by Pango and
 * drawn by Cairo, then blended into the frame with GStreamer's overlay composition; frames
 * without results pass untouched.
 *
 * ## Example launch line
 *
 * ```bash
 * gst-launch-1.0 videotestsrc num-buffers=90 pattern=ball ! \
 *     trtclassify onnx-location=models/colors.onnx labels-location=models/colors.txt ! \
 *     trtclassifyoverlay ! videoconvert ! openh264enc ! h264parse ! mp4mux ! \
 *     filesink location=classified.mp4
 * ```
 */
use gst::glib;
use gst::prelude::*;

mod imp;

glib::wrapper! {
    /// The element: a `GstVideoFilter` that draws the results on the frames.
    pub struct TrtClassifyOverlay(ObjectSubclass<imp::TrtClassifyOverlay>)
        @extends gst_video::VideoFilter, gst_base::BaseTransform, gst::Element, gst::Object;
}

/// Registers `trtclassifyoverlay` with the plugin.
pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    gst::Element::register(
        Some(plugin),
        "trtclassifyoverlay",
        gst::Rank::NONE,
        TrtClassifyOverlay::static_type(),
    )
}
