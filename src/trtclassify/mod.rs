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
 * Elements of a process with the same engine settings (model, backend, precision, GPU,
 * batch size, input size, preprocessing) and the same `model-instance-id` share one engine:
 * the model is loaded once, and the frames of all their streams fill its batches together.
 *
 * With `backend=cuda`, frames in CUDA memory (`video/x-raw(memory:CUDAMemory)`, from
 * `nvh264dec`, `nvh265dec`, `nvjpegdec`, `cudaupload`, `cudaconvert`) are read on the GPU
 * where they are and passed on unchanged; the element shares its CUDA context with those
 * elements through GStreamer's context mechanism (`gst.cuda.context`).
 *
 * ## Example launch line
 *
 * ```bash
 * gst-launch-1.0 videotestsrc num-buffers=3 pattern=red ! \
 *     trtclassify onnx-location=models/colors.onnx labels-location=models/colors.txt \
 *     top-k=1 results-location=- ! fakesink
 * ```
 *
 * Many cameras on one GPU, decoded by NVDEC and classified in CUDA memory, sharing one
 * engine:
 *
 * ```bash
 * gst-launch-1.0 \
 *     rtspsrc location=rtsp://cam1/stream ! rtph264depay ! h264parse ! nvh264dec ! \
 *         trtclassify onnx-location=resnet50.onnx backend=cuda batch-size=16 ! fakesink \
 *     rtspsrc location=rtsp://cam2/stream ! rtph264depay ! h264parse ! nvh264dec ! \
 *         trtclassify onnx-location=resnet50.onnx backend=cuda batch-size=16 ! fakesink
 * ```
 */
use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;

mod batcher;
pub mod enums;
mod imp;
mod joining;
mod latency;
mod leaving;
mod overload;
mod placement;
mod settings;
mod state;
mod stats;
mod timer;

glib::wrapper! {
    /// The `trtclassify` element, which classifies video frames and attaches the results as
    /// `TrtClassifyMeta`; made with `gst::ElementFactory::make("trtclassify")` once the plugin
    /// is registered.
    pub struct TrtClassify(ObjectSubclass<imp::TrtClassify>) @extends gst_base::BaseTransform, gst::Element, gst::Object;
}

impl TrtClassify {
    /// The engine instance (`crate::instance`) this element joins when it starts, for its
    /// properties as they are now; an error where they cannot make one. An application can
    /// join that instance before the pipeline starts, to build the engine ahead of time or to
    /// supply an engine of its own (the tests supply one that fails on demand).
    pub fn instance_key(&self) -> Result<crate::instance::InstanceKey, gst::ErrorMessage> {
        self.imp().instance_key()
    }
}

/// Registers the element and the enums of its properties (documented as plugin API).
pub(crate) fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    use crate::outputs::postprocess::Softmax;
    use enums::{Backend, ChannelOrder, Precision, ResizeMode};
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
