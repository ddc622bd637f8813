// SPDX-License-Identifier: MPL-2.0
/**
 * element-trtclassify:
 *
 * Classifies video frames with an ONNX image classifier and attaches the top-k classes to
 * every buffer as a `TrtClassifyMeta` custom meta. Pixels are never changed.
 *
 * Frames go to the engine `batch-size` at a time; every frame leaves exactly once, in order,
 * with its own result. `results-location` writes one JSON line per frame.
 *
 * ## Example launch line
 *
 * ```bash
 * gst-launch-1.0 videotestsrc num-buffers=3 pattern=red ! \
 *     trtclassify onnx-location=models/colors.onnx labels-location=models/colors.txt \
 *     top-k=1 results-location=- ! fakesink
 * ```
 */
use gst::glib;
use gst::prelude::*;

mod imp;
mod timer;

pub use imp::CAT;

glib::wrapper! {
    pub struct TrtClassify(ObjectSubclass<imp::TrtClassify>) @extends gst_base::BaseTransform, gst::Element, gst::Object;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    use crate::engine::{Backend, Precision};
    use crate::postprocess::Softmax;
    use crate::preprocess::{ChannelOrder, ResizeMode};
    Backend::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    Precision::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    Softmax::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    ChannelOrder::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    ResizeMode::static_type().mark_as_plugin_api(gst::PluginAPIFlags::empty());
    gst::Element::register(
        Some(plugin),
        "trtclassify",
        gst::Rank::NONE,
        TrtClassify::static_type(),
    )
}
