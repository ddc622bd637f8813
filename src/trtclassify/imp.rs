// SPDX-License-Identifier: MPL-2.0
//! The `trtclassify` element: holds frames until a batch is full (or `batch-timeout` passes,
//! or a serialized event arrives), classifies the batch, attaches the results and sends the
//! frames on, in order. Frames of a live source that the engine cannot take in time leave
//! unclassified instead (`overload`); engine-shaping properties set while running switch to
//! a new engine between batches (`joining`).

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Instant;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;
use gst_base::subclass::base_transform::GenerateOutputSuccess;
use gst_base::subclass::prelude::*;

use super::batcher::Unscored;
use super::enums::Backend;
use super::joining::Updates;
use super::latency;
use super::overload::{self, Qos, Upstream};
use super::placement;
use super::settings::{
    DEFAULT_BACKEND, DEFAULT_BATCH_SIZE, DEFAULT_BATCH_TIMEOUT_MS, DEFAULT_CHANNEL_ORDER,
    DEFAULT_GPU_ID, DEFAULT_INTERVAL, DEFAULT_MAX_LATENESS_MS, DEFAULT_PRECISION,
    DEFAULT_RESIZE_MODE, DEFAULT_ROI, DEFAULT_SCALE, DEFAULT_SERVER_TIMEOUT_MS, DEFAULT_SOFTMAX,
    DEFAULT_THRESHOLD, DEFAULT_TOP_K, MAX_BATCH_SIZE, Settings, Tunables,
};
use super::state::{Held, State};
use super::stats::Stats;
use crate::cudamem;
use crate::engine;
use crate::instance::Pushed;
use crate::preprocess::Crop;

pub(super) static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new(
        "trtclassify",
        gst::DebugColorFlags::empty(),
        Some("ONNX image classification"),
    )
});

/// Whether the element reads frames in CUDA memory where they are: not known before
/// `start()` (then: whether it could), known once the engine is there.
const DEVICE_FRAMES_UNKNOWN: u8 = 0;
pub(super) const DEVICE_FRAMES_YES: u8 = 1;
pub(super) const DEVICE_FRAMES_NO: u8 = 2;

/// The element's implementation: its settings, and its state while started.
#[derive(Default)]
pub struct TrtClassify {
    pub(super) settings: Mutex<Settings>,
    pub(super) state: Mutex<Option<State>>,
    /// Whether the element is started: read where `state`, which is held during inference,
    /// would make the caller wait.
    running: AtomicBool,
    /// Kept apart from `state`, which is held during inference, so that queries never wait.
    framerate: Mutex<Option<gst::Fraction>>,
    pub(super) num_classes: AtomicU32,
    pub(super) device_frames: AtomicU8,
    /// The running engine's `batches_in_flight` (0 before there is one): the frames it holds.
    pub(super) batches_in_flight: AtomicU32,
    /// The CUDA context shared with CUDA elements (decoders, converters) of the pipeline.
    cuda_context: Mutex<Option<cudamem::Context>>,
    /// The GPU the element works on: the running engine's, or before the engine is there,
    /// the one its CUDA context is for (see `placement`).
    pub(super) gpu: Mutex<Option<u32>>,
    /// With `gpu-id=-1`, the GPU the frames in CUDA memory came from, where it was not the
    /// engine's (the engine moves there), and the context of the last frame looked at.
    pub(super) frames_gpu: Mutex<(Option<u32>, usize)>,
    /// What the latency query upstream said (`None`: not asked since the caps).
    upstream: Mutex<Option<Upstream>>,
    /// Downstream's QoS reports.
    pub(super) qos: Mutex<Qos>,
    /// What the element has done since it started (the `stats` property).
    pub(super) stats: Mutex<Stats>,
    /// Live updates in flight.
    pub(super) updates: Mutex<Updates>,
}

#[glib::object_subclass]
impl ObjectSubclass for TrtClassify {
    const NAME: &'static str = "GstTrtClassify";
    type Type = super::TrtClassify;
    type ParentType = gst_base::BaseTransform;
}

impl ObjectImpl for TrtClassify {
    fn constructed(&self) {
        self.parent_constructed();
        // Downstream's QoS reports are read (for live sources, see `overload`), as GStreamer's
        // video filters do.
        self.obj().set_qos(true);
    }

    fn properties() -> &'static [glib::ParamSpec] {
        static PROPERTIES: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
            let float_array = |name: &str, nick: &str, blurb: &str| {
                gst::ParamSpecArray::builder(name)
                    .nick(nick)
                    .blurb(blurb)
                    .element_spec(&glib::ParamSpecDouble::builder("value").build())
                    .mutable_playing()
                    .build()
            };
            vec![
                glib::ParamSpecString::builder("onnx-location")
                    .nick("ONNX location")
                    .blurb("Path of the ONNX image classifier (one float32 input, NCHW or NHWC). \
                            Set while running (this or any property that shapes the engine), \
                            the new engine is built in the background while the old one goes \
                            on, and frames switch to it between batches; set to the same path \
                            again, a model file replaced on disk is loaded")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("labels-location")
                    .nick("Labels location")
                    .blurb("Text file with one class label per line (line N names class N); without it, class numbers are the labels")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("results-location")
                    .nick("Results location")
                    .blurb("File that one JSON object per frame is appended to, one per line (\"-\" for standard output)")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("engine-location")
                    .nick("Engine location")
                    .blurb("File the built GPU engine is saved to and loaded from when it matches the model, GPU, libraries, precision and batch size (otherwise rebuilt and rewritten); default: a file in the per-user cache folder ($XDG_CACHE_HOME/trtclassify)")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("model-instance-id")
                    .nick("Model instance id")
                    .blurb("Elements of a process with the same engine settings and the same id share one engine and fill its batches together; default (unset): shared by all elements with the same settings. Give an element an id of its own for an engine of its own")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("backend", DEFAULT_BACKEND)
                    .nick("Backend")
                    .blurb("Inference backend; one that is not built in or not usable fails at start")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("server-url")
                    .nick("Server URL")
                    .blurb("backend=kserve: the KServe v2 / Triton gRPC server, grpc://host:port (grpcs://host:port for TLS)")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("server-model")
                    .nick("Server model")
                    .blurb("backend=kserve: the model's name on the server; onnx-location, where also set, is checked against the server's metadata, and is optional otherwise")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("server-model-version")
                    .nick("Server model version")
                    .blurb("backend=kserve: the model's version on the server; unset: the server's choice")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("server-timeout")
                    .nick("Server timeout")
                    .blurb("backend=kserve: the longest a batch waits for the server, in milliseconds, retries included; past it, its frames pass on unclassified (counted in stats as unclassified-server) and the server is tried again after a pause")
                    .minimum(1)
                    .maximum(600_000)
                    .default_value(DEFAULT_SERVER_TIMEOUT_MS)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("server-ca-location")
                    .nick("Server CA location")
                    .blurb("backend=kserve with grpcs://: PEM file of the CA that signed the server's certificate; unset: the system's CAs")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("server-cert-location")
                    .nick("Client certificate location")
                    .blurb("backend=kserve with grpcs://: PEM certificate this client presents (mutual TLS), with server-key-location")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("server-key-location")
                    .nick("Client key location")
                    .blurb("backend=kserve with grpcs://: PEM private key of server-cert-location")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("precision", DEFAULT_PRECISION)
                    .nick("Precision")
                    .blurb("Arithmetic precision of GPU backends (the CPU backend always runs fp32); int8 and fp8 calibrate on calibration-location or, without it, on the stream's first frames (fp16 until then)")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("calibration-location")
                    .nick("Calibration location")
                    .blurb("precision=int8 or fp8: the calibration table of the model (each quantized layer's input range and error), written by `trtclassify-engine calibrate MODEL.onnx IMAGES-OR-VIDEOS... --table FILE`; or an image, a video or a folder of them, on whose first calibration-frames frames the element calibrates at its first start (on the CPU; progress in the log), keeping the table in the engine cache for later starts. Unset: the element runs in fp16 while it calibrates on the stream's first calibration-frames frames (sampled as the CPU keeps up), then switches to the quantized engine without a pause, and keeps that table in the engine cache for later starts. Layers the table marks as losing over 10 % stay fp16, named in the log")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("calibration-frames")
                    .nick("Calibration frames")
                    .blurb("precision=int8 or fp8: how many frames of calibration-location, or of the stream when it is unset, the calibration runs on (every eighth, up to 32, is held out for the accuracy guard instead)")
                    .minimum(8)
                    .maximum(100_000)
                    .default_value(crate::calibrate::FRAMES as u32)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecDouble::builder("min-agreement")
                    .nick("Minimum agreement")
                    .blurb("precision=int8 or fp8: the least share of the calibration's held-out frames (written beside the table by trtclassify-engine calibrate) whose top class the quantized engine must keep; below it the engine is built in fp16, with a warning")
                    .minimum(0.0)
                    .maximum(1.0)
                    .default_value(crate::engine::DEFAULT_MIN_AGREEMENT)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecInt::builder("gpu-id")
                    .nick("GPU id")
                    .blurb("Index of the GPU that GPU backends run on, from 0; -1: chosen by \
                            the frames: the GPU of the decoder upstream (frames in CUDA \
                            memory), else the GPU with the fewest trtclassify streams of the \
                            process, so that cameras spread over the GPUs")
                    .minimum(-1)
                    .maximum(63)
                    .default_value(DEFAULT_GPU_ID)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("threads")
                    .nick("Threads")
                    .blurb("CPU cores the cpu backend may use for this model (0: all). The cores \
                            form one pool for every element of the process, so that many \
                            cameras share them; more threads run more frames of a batch at \
                            once, or one frame's layers in parallel")
                    .maximum(1024)
                    .default_value(0)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("batch-size")
                    .nick("Batch size")
                    .blurb("Frames classified together; a frame waits for its batch-mates at most \
                            batch-timeout. On the cpu backend, a batch of more frames than \
                            threads runs the model's last layers on a thread's frames at once \
                            (faster per frame)")
                    .minimum(1)
                    .maximum(MAX_BATCH_SIZE)
                    .default_value(DEFAULT_BATCH_SIZE)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecInt::builder("batch-timeout")
                    .nick("Batch timeout")
                    .blurb("Milliseconds a frame may wait for batch-mates before a partial batch runs (-1: wait for a full batch)")
                    .minimum(-1)
                    .maximum(60_000)
                    .default_value(DEFAULT_BATCH_TIMEOUT_MS)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecInt::builder("max-lateness")
                    .nick("Maximum lateness")
                    .blurb("With a live source: milliseconds past its due time (its running time \
                            plus the latency upstream), less the time of a batch, by which the \
                            engine must take a frame; a frame it cannot take (more frames than \
                            it can classify), or that downstream's QoS says is late, is passed \
                            on with the last result, not fresh, so the pipeline stays real \
                            time; a frame taken leaves once its batch has run. 0: batch-timeout \
                            plus the time of one batch; -1: never, every frame waits for its \
                            result (back-pressure, as for sources that are not live)")
                    .minimum(-1)
                    .maximum(60_000)
                    .default_value(DEFAULT_MAX_LATENESS_MS)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("top-k")
                    .nick("Top k")
                    .blurb("Number of best classes reported per frame")
                    .minimum(1)
                    .maximum(1000)
                    .default_value(DEFAULT_TOP_K)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecDouble::builder("threshold")
                    .nick("Threshold")
                    .blurb("Minimum confidence of a reported class")
                    .minimum(0.0)
                    .maximum(1.0)
                    .default_value(DEFAULT_THRESHOLD)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("softmax", DEFAULT_SOFTMAX)
                    .nick("Softmax")
                    .blurb("Turn the model's scores into probabilities")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecDouble::builder("scale")
                    .nick("Scale")
                    .blurb("Pixel scale factor: input = (pixel × scale − mean[c]) / std[c]")
                    .minimum(1.0e-9)
                    .maximum(1.0e6)
                    .default_value(DEFAULT_SCALE)
                    .mutable_playing()
                    .build(),
                float_array(
                    "mean",
                    "Mean",
                    "Per-channel mean, in the model's channel order, subtracted after scaling (1 value or 1 per channel; default <0.485, 0.456, 0.406>)",
                ),
                float_array(
                    "std",
                    "Standard deviation",
                    "Per-channel standard deviation, in the model's channel order, divided by (1 value or 1 per channel, each > 0; default <0.229, 0.224, 0.225>)",
                ),
                glib::ParamSpecEnum::builder_with_default("channel-order", DEFAULT_CHANNEL_ORDER)
                    .nick("Channel order")
                    .blurb("Order of the colour channels the model expects")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("resize-mode", DEFAULT_RESIZE_MODE)
                    .nick("Resize mode")
                    .blurb("How frames are fitted to the model's input size")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("input-width")
                    .nick("Input width")
                    .blurb("Model input width for models whose width is dynamic (0: from the model)")
                    .maximum(8192)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("input-height")
                    .nick("Input height")
                    .blurb("Model input height for models whose height is dynamic (0: from the model)")
                    .maximum(8192)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("interval")
                    .nick("Interval")
                    .blurb("Classify every Nth frame; frames in between carry the last result, marked as not fresh")
                    .minimum(1)
                    .maximum(10_000)
                    .default_value(DEFAULT_INTERVAL)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("roi", DEFAULT_ROI)
                    .nick("Regions of interest")
                    .blurb("What is classified: the whole frame, the regions of interest that a detector upstream attached (GstVideoRegionOfInterestMeta, and in builds with the analytics feature GstAnalyticsODMtd; each region's result is added to its meta as a \"classification\" param structure, or as a GstAnalyticsClsMtd related to the detection, and listed in the frame's meta), or both. Carried frames (interval) carry the whole-frame result only")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecString::builder("roi-types")
                    .nick("Region types")
                    .blurb("Comma-separated region types (the ROI meta's roi_type, a detector's label) to classify, e.g. \"car,truck\"; unset or empty: every type")
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("roi-min-width")
                    .nick("Region minimum width")
                    .blurb("Regions narrower than this many pixels (after clipping to the frame) are not classified")
                    .maximum(65_535)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("roi-min-height")
                    .nick("Region minimum height")
                    .blurb("Regions lower than this many pixels (after clipping to the frame) are not classified")
                    .maximum(65_535)
                    .mutable_playing()
                    .build(),
                glib::ParamSpecUInt::builder("num-classes")
                    .nick("Number of classes")
                    .blurb("Classes the loaded model scores (0 until the element has started)")
                    .read_only()
                    .build(),
                glib::ParamSpecBoxed::builder::<gst::Structure>("stats")
                    .nick("Statistics")
                    .blurb("What the element did since it started, as an \
                            application/x-trtclassify-stats structure: frames-in, frames-out, \
                            classified, carried (interval), unclassified-late and \
                            unclassified-qos (passed on by the overload policy), \
                            unclassified-server (backend=kserve: no answer), latency-p50, \
                            latency-p99 and latency-max (time in the element, ns), \
                            lateness-p50, lateness-p99 and lateness-max (with a live source: \
                            how long after it was due a frame left, ns), batches, \
                            mean-batch-fill (0 to 1), batch-time (ns), streams (sharing the \
                            engine), engine-rebuilds, engine-failures, model-updates, model, \
                            backend, precision, engine (built, loaded or shared), \
                            engine-ready-time (ns), engine-file, batches-in-flight (full \
                            batches the engine may hold unanswered while the next gathers; \
                            a flush drops their frames)")
                    .read_only()
                    .build(),
            ]
        });
        PROPERTIES.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        let name = pspec.name();
        self.store_property(name, value);
        // What makes the engine, the labels and the outputs is read when the engine is made:
        // while running, a change makes it again (a live update).
        if self.running.load(Ordering::SeqCst) && !Tunables::is_tunable(name) {
            self.schedule_update(name);
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        let settings = self.settings.lock().unwrap();
        let array = |values: &[f64]| gst::Array::new(values.iter().copied()).to_value();
        match pspec.name() {
            "onnx-location" => settings.onnx_location.to_value(),
            "labels-location" => settings.labels_location.to_value(),
            "engine-location" => settings.engine_location.to_value(),
            "calibration-location" => settings.calibration_location.to_value(),
            "calibration-frames" => settings.calibration_frames.to_value(),
            "min-agreement" => settings.min_agreement.to_value(),
            "model-instance-id" => settings.model_instance_id.to_value(),
            "results-location" => settings.results_location.to_value(),
            "backend" => settings.backend.to_value(),
            "server-url" => settings.server.url.to_value(),
            "server-model" => settings.server.model.to_value(),
            "server-model-version" => settings.server.version.to_value(),
            "server-timeout" => settings.server.timeout_ms.to_value(),
            "server-ca-location" => settings.server.ca.to_value(),
            "server-cert-location" => settings.server.cert.to_value(),
            "server-key-location" => settings.server.key.to_value(),
            "precision" => settings.precision.to_value(),
            "gpu-id" => settings.gpu_id.to_value(),
            "threads" => settings.threads.to_value(),
            "batch-size" => settings.batch_size.to_value(),
            "batch-timeout" => settings.tunables.batch_timeout_ms.to_value(),
            "max-lateness" => settings.tunables.max_lateness_ms.to_value(),
            "top-k" => settings.tunables.top_k.to_value(),
            "threshold" => settings.tunables.threshold.to_value(),
            "softmax" => settings.softmax.to_value(),
            "scale" => settings.scale.to_value(),
            "mean" => array(&settings.mean),
            "std" => array(&settings.std),
            "channel-order" => settings.channel_order.to_value(),
            "resize-mode" => settings.resize_mode.to_value(),
            "input-width" => settings.input_width.to_value(),
            "input-height" => settings.input_height.to_value(),
            "interval" => settings.tunables.interval.to_value(),
            "roi" => settings.roi.to_value(),
            "roi-types" => settings.roi_types().to_value(),
            "roi-min-width" => settings.roi_filter.min_width.to_value(),
            "roi-min-height" => settings.roi_filter.min_height.to_value(),
            "num-classes" => self.num_classes.load(Ordering::Relaxed).to_value(),
            "stats" => self.stats.lock().unwrap().to_structure().to_value(),
            _ => unimplemented!(),
        }
    }
}

// Property values, stored.
impl TrtClassify {
    /// Stores a property's value in the settings.
    fn store_property(&self, name: &str, value: &glib::Value) {
        let mut settings = self.settings.lock().unwrap();
        match name {
            "onnx-location" => settings.onnx_location = value.get().expect("type checked upstream"),
            "labels-location" => {
                settings.labels_location = value.get().expect("type checked upstream")
            }
            "results-location" => {
                settings.results_location = value.get().expect("type checked upstream")
            }
            "min-agreement" => settings.min_agreement = value.get().expect("type checked upstream"),
            "calibration-location" => {
                settings.calibration_location = value.get().expect("type checked upstream")
            }
            "calibration-frames" => {
                settings.calibration_frames = value.get().expect("type checked upstream")
            }
            "engine-location" => {
                settings.engine_location = value.get().expect("type checked upstream")
            }
            "model-instance-id" => {
                settings.model_instance_id = value.get().expect("type checked upstream")
            }
            "backend" => settings.backend = value.get().expect("type checked upstream"),
            "server-url" => settings.server.url = value.get().expect("type checked upstream"),
            "server-model" => settings.server.model = value.get().expect("type checked upstream"),
            "server-model-version" => {
                settings.server.version = value.get().expect("type checked upstream")
            }
            "server-timeout" => {
                settings.server.timeout_ms = value.get().expect("type checked upstream")
            }
            "server-ca-location" => {
                settings.server.ca = value.get().expect("type checked upstream")
            }
            "server-cert-location" => {
                settings.server.cert = value.get().expect("type checked upstream")
            }
            "server-key-location" => {
                settings.server.key = value.get().expect("type checked upstream")
            }
            "precision" => settings.precision = value.get().expect("type checked upstream"),
            "gpu-id" => settings.gpu_id = value.get().expect("type checked upstream"),
            "threads" => settings.threads = value.get().expect("type checked upstream"),
            "batch-size" => settings.batch_size = value.get().expect("type checked upstream"),
            "batch-timeout" => {
                settings.tunables.batch_timeout_ms = value.get().expect("type checked upstream")
            }
            "max-lateness" => {
                settings.tunables.max_lateness_ms = value.get().expect("type checked upstream")
            }
            "top-k" => settings.tunables.top_k = value.get().expect("type checked upstream"),
            "threshold" => {
                settings.tunables.threshold = value.get().expect("type checked upstream")
            }
            "softmax" => settings.softmax = value.get().expect("type checked upstream"),
            "scale" => settings.scale = value.get().expect("type checked upstream"),
            "mean" | "std" => {
                if let Err(problem) = settings.set_channel_values(name, value) {
                    gst::error!(CAT, imp = self, "refusing {problem}");
                    glib::g_warning!("trtclassify", "{}: refusing {}", self.obj().name(), problem);
                }
            }
            "channel-order" => settings.channel_order = value.get().expect("type checked upstream"),
            "resize-mode" => settings.resize_mode = value.get().expect("type checked upstream"),
            "input-width" => settings.input_width = value.get().expect("type checked upstream"),
            "input-height" => settings.input_height = value.get().expect("type checked upstream"),
            "interval" => settings.tunables.interval = value.get().expect("type checked upstream"),
            "roi" => settings.roi = value.get().expect("type checked upstream"),
            "roi-types" => {
                let list: Option<String> = value.get().expect("type checked upstream");
                settings.set_roi_types(list.as_deref());
            }
            "roi-min-width" => {
                settings.roi_filter.min_width = value.get().expect("type checked upstream")
            }
            "roi-min-height" => {
                settings.roi_filter.min_height = value.get().expect("type checked upstream")
            }
            _ => unimplemented!(),
        }
    }
}

impl GstObjectImpl for TrtClassify {}

impl ElementImpl for TrtClassify {
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static ELEMENT_METADATA: LazyLock<gst::subclass::ElementMetadata> = LazyLock::new(|| {
            gst::subclass::ElementMetadata::new(
                "Image classifier",
                "Filter/Analyzer/Video",
                "Classifies video frames with an ONNX image classifier (batched, CPU or GPU) and attaches the top-k classes as TrtClassifyMeta",
                "trtclassify developers",
            )
        });
        Some(&*ELEMENT_METADATA)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static PAD_TEMPLATES: LazyLock<Vec<gst::PadTemplate>> = LazyLock::new(|| {
            use gst_video::VideoFormat::*;
            // CUDA memory first, so that a decoder that can give it does; what the GPU
            // preprocessing reads (three colours; P010 is what NVDEC gives for 10-bit
            // video). `transform_caps` drops it where it cannot be read.
            let mut caps = gst_video::VideoCapsBuilder::new()
                .features([cudamem::CAPS_FEATURE])
                .format_list([Nv12, I420, P01010le, Rgba, Bgra, Rgbx, Bgrx, Rgb, Bgr])
                .build();
            caps.merge(
                gst_video::VideoCapsBuilder::new()
                    .format_list([
                        Rgb, Bgr, Rgba, Bgra, Rgbx, Bgrx, Xrgb, Xbgr, Nv12, I420, P01010le, Gray8,
                    ])
                    .build(),
            );
            vec![
                gst::PadTemplate::new(
                    "src",
                    gst::PadDirection::Src,
                    gst::PadPresence::Always,
                    &caps,
                )
                .unwrap(),
                gst::PadTemplate::new(
                    "sink",
                    gst::PadDirection::Sink,
                    gst::PadPresence::Always,
                    &caps,
                )
                .unwrap(),
            ]
        });
        PAD_TEMPLATES.as_ref()
    }

    fn set_context(&self, context: &gst::Context) {
        // A context of another GPU (a bin hands on the context of any element) is refused
        // once the element knows its GPU.
        let gpu = self.gpu.lock().unwrap().map_or(-1, |gpu| gpu as i32);
        cudamem::handle_set_context(
            self.obj().upcast_ref(),
            context,
            gpu,
            &mut self.cuda_context.lock().unwrap(),
        );
        self.parent_set_context(context)
    }

    fn change_state(
        &self,
        transition: gst::StateChange,
    ) -> Result<gst::StateChangeSuccess, gst::StateChangeError> {
        // Before the decoders upstream open (elements go up from the sinks), so that they
        // take the context the engine runs in.
        if transition == gst::StateChange::NullToReady && self.may_use_cuda() {
            let gpu = self.gpu_before_start();
            *self.gpu.lock().unwrap() = gpu;
            if gpu.is_some() {
                self.ensure_cuda_context(true);
            }
        }
        let result = self.parent_change_state(transition)?;
        if transition == gst::StateChange::ReadyToNull {
            *self.cuda_context.lock().unwrap() = None;
            *self.gpu.lock().unwrap() = None;
            *self.frames_gpu.lock().unwrap() = (None, 0);
        }
        Ok(result)
    }
}

// CUDA memory, and the CUDA context shared with the pipeline's CUDA elements.
impl TrtClassify {
    /// Whether a CUDA engine may run here for these settings (before `start()` tells).
    fn may_use_cuda(&self) -> bool {
        let backend = self.settings.lock().unwrap().backend;
        matches!(backend, Backend::Auto | Backend::Cuda) && cudamem::usable()
    }

    /// Whether frames in CUDA memory are read where they are.
    fn reads_cuda_memory(&self) -> bool {
        match self.device_frames.load(Ordering::Relaxed) {
            DEVICE_FRAMES_YES => true,
            DEVICE_FRAMES_NO => false,
            _ => self.may_use_cuda(),
        }
    }

    /// The GPU to offer decoders a context of, before the engine is there: `gpu-id`; with
    /// `gpu-id=-1`, the GPU of a CUDA element upstream, or GPU 0 on a machine of one GPU.
    /// `None`: not known before start (the element then offers no context, so that each
    /// decoder keeps its own GPU).
    fn gpu_before_start(&self) -> Option<u32> {
        let gpu_id = self.settings.lock().unwrap().gpu_id;
        if let Ok(gpu) = u32::try_from(gpu_id) {
            return Some(gpu);
        }
        self.gpu_upstream()
            .or_else(|| (crate::engine::cuda::gpu_count() <= 1).then_some(0))
    }

    /// The GPU a CUDA element upstream says the frames are on (see `cudamem::device_upstream`).
    fn gpu_upstream(&self) -> Option<u32> {
        let sinkpad = self.obj().static_pad("sink").expect("always there");
        cudamem::device_upstream(&sinkpad)
    }

    /// The GPU of the engine for `settings`: `gpu-id`; with `gpu-id=-1`, the GPU of the
    /// frames (seen, or said by a CUDA element upstream), else the GPU with the fewest
    /// streams (see `placement`).
    pub(super) fn choose_gpu(&self, settings: &Settings) -> u32 {
        // Engines that run on no GPU here all share the same key (GPU 0).
        if settings.gpu_id != placement::AUTOMATIC
            || matches!(settings.backend, Backend::Cpu | Backend::Kserve)
        {
            return placement::choose(settings.gpu_id, None, 0, &Default::default());
        }
        let frames_on = self
            .frames_gpu
            .lock()
            .unwrap()
            .0
            .or_else(|| self.gpu_upstream());
        let gpu = placement::choose(
            settings.gpu_id,
            frames_on,
            crate::engine::cuda::gpu_count(),
            &crate::instance::streams_per_gpu(),
        );
        gst::info!(
            CAT,
            imp = self,
            "gpu-id=-1: GPU {gpu} ({})",
            match frames_on {
                Some(on) if on == gpu => "the frames' GPU",
                _ => "the GPU with the fewest streams",
            }
        );
        gpu
    }

    /// With `gpu-id=-1`, moves the engine to the GPU of frames in CUDA memory that came from
    /// another (a decoder plugged in after start, one that kept a GPU of its own): once per
    /// GPU and context, as a live update.
    fn follow_frames(&self, frame: &cudamem::DeviceFrame) {
        let context = frame.context();
        {
            let mut seen = self.frames_gpu.lock().unwrap();
            if seen.1 == context {
                return;
            }
            seen.1 = context;
            if self.settings.lock().unwrap().gpu_id != placement::AUTOMATIC {
                return;
            }
            let Some(on) = frame.device() else { return };
            if Some(on) == *self.gpu.lock().unwrap() || seen.0 == Some(on) {
                return;
            }
            seen.0 = Some(on);
        }
        self.schedule_update("the frames' GPU");
    }

    /// The CUDA context to share: one set on us (by the application or the bin) for the
    /// element's GPU, else one wrapping the primary context of that GPU, which the cuda
    /// engine runs in.
    fn ensure_cuda_context(&self, announce: bool) -> Option<cudamem::Context> {
        let gpu = (*self.gpu.lock().unwrap())?;
        {
            let mut held = self.cuda_context.lock().unwrap();
            match held.as_ref() {
                Some(ctx) if ctx.device().is_none_or(|d| d == gpu) => return Some(ctx.clone()),
                // Taken before the element knew its GPU.
                Some(_) => *held = None,
                None => (),
            }
        }
        let obj = self.obj();
        if announce {
            // The bin or the application may answer by setting a context on us.
            let _ = obj.post_message(
                gst::message::NeedContext::builder(cudamem::CONTEXT_TYPE)
                    .src(&*obj)
                    .build(),
            );
            if let Some(ctx) = self.cuda_context.lock().unwrap().clone() {
                return Some(ctx);
            }
        }
        let gpu_id = gpu;
        let ctx = match cudamem::primary_context(gpu_id) {
            Ok(ctx) => ctx,
            Err(e) => {
                gst::info!(CAT, imp = self, "no CUDA context to share: {e}");
                return None;
            }
        };
        let ctx = self.cuda_context.lock().unwrap().get_or_insert(ctx).clone();
        if announce {
            gst::debug!(CAT, imp = self, "sharing the CUDA context of GPU {gpu_id}");
            let _ = obj.post_message(
                gst::message::HaveContext::builder(ctx.to_gst_context())
                    .src(&*obj)
                    .build(),
            );
        }
        Some(ctx)
    }
}

impl BaseTransformImpl for TrtClassify {
    const MODE: gst_base::subclass::BaseTransformMode =
        gst_base::subclass::BaseTransformMode::AlwaysInPlace;
    const PASSTHROUGH_ON_SAME_CAPS: bool = false;
    const TRANSFORM_IP_ON_PASSTHROUGH: bool = false;

    fn start(&self) -> Result<(), gst::ErrorMessage> {
        let result = self.start_engine();
        self.running.store(result.is_ok(), Ordering::SeqCst);
        let (kind, text) = match &result {
            Ok(()) => (gst::ProgressType::Complete, "engine ready"),
            Err(_) => (gst::ProgressType::Error, "engine build failed"),
        };
        self.post_progress(kind, text);
        result
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        self.running.store(false, Ordering::SeqCst);
        self.forget_updates();
        *self.upstream.lock().unwrap() = None;
        self.qos.lock().unwrap().reset();
        // Dropping the state leaves the shared engine, stops the timer thread and releases
        // held frames.
        if let Some(state) = self.state.lock().unwrap().take() {
            let stats = self.stats.lock().unwrap();
            let (l, steady) = (&stats.latency.all, &stats.latency.steady);
            gst::info!(
                CAT,
                imp = self,
                "{} frames out; time in the element (buffer in to out): p50 {:.2?}, p99 {:.2?}, max {:.2?} (frame {}); after the first {:?}: {} frames, p50 {:.2?}, p99 {:.2?}, max {:.2?} (frame {}); longest wait for the shared engine {:.2?}",
                l.frames(),
                l.quantile(0.5),
                l.quantile(0.99),
                l.max(),
                l.slowest(),
                latency::START_UP,
                steady.frames(),
                steady.quantile(0.5),
                steady.quantile(0.99),
                steady.max(),
                steady.slowest(),
                state.stream.longest_wait()
            );
            if stats.lateness.all.frames() > 0 {
                let (classified, late, qos) = stats.outcomes();
                let late_by = &stats.lateness.all;
                gst::info!(
                    CAT,
                    imp = self,
                    "live: {} frames, {classified} classified, {late} unclassified late, {qos} unclassified qos; left after they were due: p50 {:.2?}, p99 {:.2?}, max {:.2?}",
                    late_by.frames(),
                    late_by.quantile(0.5),
                    late_by.quantile(0.99),
                    late_by.max()
                );
            }
            drop(stats);
            if state.outputs.non_finite > 0 {
                gst::warning!(
                    CAT,
                    imp = self,
                    "{} frames had scores that were not all finite",
                    state.outputs.non_finite
                );
            }
        }
        *self.framerate.lock().unwrap() = None;
        self.device_frames
            .store(DEVICE_FRAMES_UNKNOWN, Ordering::Relaxed);
        Ok(())
    }

    /// Frames pass through unchanged, so each side takes what the other side takes, less CUDA
    /// memory where it cannot be read.
    fn transform_caps(
        &self,
        _direction: gst::PadDirection,
        caps: &gst::Caps,
        filter: Option<&gst::Caps>,
    ) -> Option<gst::Caps> {
        let mut caps = caps.clone();
        if !self.reads_cuda_memory() {
            caps.make_mut().filter_map_in_place(|features, _| {
                match features.contains(cudamem::CAPS_FEATURE) {
                    true => gst::CapsFilterMapAction::Remove,
                    false => gst::CapsFilterMapAction::Keep,
                }
            });
        }
        Some(match filter {
            Some(filter) => filter.intersect_with_mode(&caps, gst::CapsIntersectMode::First),
            None => caps,
        })
    }

    fn set_caps(&self, incaps: &gst::Caps, _outcaps: &gst::Caps) -> Result<(), gst::LoggableError> {
        let info = gst_video::VideoInfo::from_caps(incaps)
            .map_err(|_| gst::loggable_error!(CAT, "cannot parse caps {}", incaps))?;
        gst::debug!(
            CAT,
            imp = self,
            "input {:?} {}x{}",
            info.format(),
            info.width(),
            info.height()
        );
        *self.framerate.lock().unwrap() = Some(info.fps()).filter(|f| f.numer() > 0);
        // Another stream, perhaps from another source: whether it is live is asked again.
        *self.upstream.lock().unwrap() = None;
        if let Some(state) = self.state.lock().unwrap().as_mut() {
            state.input.info = Some(info);
        }
        Ok(())
    }

    fn sink_event(&self, event: gst::Event) -> bool {
        match event.view() {
            gst::EventView::FlushStop(_) => {
                if let Some(state) = self.state.lock().unwrap().as_mut() {
                    gst::debug!(
                        CAT,
                        imp = self,
                        "flush: dropping {} held frames",
                        state.queue.batcher.len()
                    );
                    state.queue.flush();
                    state.stream.flush();
                    state.failure = Default::default();
                    self.qos.lock().unwrap().reset();
                    // After a seek, a result from before it describes another picture.
                    state.outputs.last.clear();
                }
            }
            // Held frames go out before any serialized event (caps, segment, EOS, ...) so that
            // frames and events keep their order downstream.
            _ if event.is_serialized() => {
                let started = Instant::now();
                let finished = self.finish_batch(true);
                gst::debug!(
                    CAT,
                    imp = self,
                    "held frames out before {:?} in {:.1?}",
                    event.type_(),
                    started.elapsed()
                );
                if let Err(err) = finished {
                    gst::debug!(
                        CAT,
                        imp = self,
                        "pushing held frames before {:?}: {:?}",
                        event.type_(),
                        err
                    );
                }
                if let gst::EventView::StreamStart(_) = event.view()
                    && let Some(state) = self.state.lock().unwrap().as_mut()
                {
                    state.queue.batcher.restart();
                    state.outputs.last.clear();
                }
                if let gst::EventView::Segment(_) = event.view() {
                    // QoS reports are in the old segment's running time.
                    self.qos.lock().unwrap().reset();
                }
            }
            _ => (),
        }
        self.parent_sink_event(event)
    }

    fn query(&self, direction: gst::PadDirection, query: &mut gst::QueryRef) -> bool {
        if let gst::QueryView::Context(q) = query.view()
            && q.context_type() == cudamem::CONTEXT_TYPE
            && self.may_use_cuda()
        {
            let ctx = self.ensure_cuda_context(false);
            if cudamem::handle_context_query(self.obj().upcast_ref(), query, ctx.as_ref()) {
                return true;
            }
        }
        // A drain query asks for every held buffer back (a decoder renegotiating its pool).
        if direction == gst::PadDirection::Sink
            && let gst::QueryView::Drain(_) = query.view()
            && let Err(err) = self.finish_batch(true)
        {
            gst::debug!(CAT, imp = self, "pushing held frames on drain: {err:?}");
        }
        if direction == gst::PadDirection::Src
            && let gst::QueryViewMut::Latency(q) = query.view_mut()
        {
            if !BaseTransformImplExt::parent_query(self, direction, q.query_mut()) {
                return false;
            }
            let (live, min, max) = q.result();
            *self.upstream.lock().unwrap() = Some(Upstream { live, latency: min });
            let framerate = *self.framerate.lock().unwrap();
            let added = self.settings.lock().unwrap().added_latency(framerate);
            gst::debug!(CAT, imp = self, "adding {added} of latency");
            q.set(live, min + added, max.map(|m| m + added));
            return true;
        }
        BaseTransformImplExt::parent_query(self, direction, query)
    }

    fn src_event(&self, event: gst::Event) -> bool {
        if let gst::EventView::Qos(qos) = event.view()
            && self.obj().is_qos()
        {
            let (_, proportion, diff, timestamp) = qos.get();
            if let Some(timestamp) = timestamp {
                self.qos.lock().unwrap().update(proportion, diff, timestamp);
            }
        }
        self.parent_src_event(event)
    }

    /// Held frames come from upstream's buffer pool: ask for room for them, so that a source
    /// with a small pool (a camera, a hardware decoder) does not stall waiting for buffers
    /// that the batch holds. Frames in CUDA memory are not counted (see below).
    fn propose_allocation(
        &self,
        decide_query: Option<&gst::query::Allocation>,
        query: &mut gst::query::Allocation,
    ) -> Result<(), gst::LoggableError> {
        self.parent_propose_allocation(decide_query, query)?;
        let framerate = query
            .get()
            .0
            .and_then(|caps| gst_video::VideoInfo::from_caps(caps).ok())
            .map(|info| info.fps());
        // Never more than the frames that arrive in `batch-timeout`: the partial batch then
        // runs and they leave.
        let in_flight = match self.batches_in_flight.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        };
        let held = self
            .settings
            .lock()
            .unwrap()
            .held_frames_at(framerate, in_flight);
        // CUDA memory comes from pools that grow on demand (NVDEC copies each decoded frame
        // into one): asking for more would only preallocate GPU memory, for every camera.
        let cuda_memory = query
            .get()
            .0
            .and_then(|caps| caps.features(0))
            .is_some_and(|f| f.contains(cudamem::CAPS_FEATURE));
        if held == 0 || cuda_memory {
            return Ok(());
        }
        let pools: Vec<_> = query.allocation_pools().collect();
        if pools.is_empty() {
            let size = query
                .get()
                .0
                .and_then(|caps| gst_video::VideoInfo::from_caps(caps).ok())
                .map_or(0, |info| info.size() as u32);
            query.add_allocation_pool(None::<&gst::BufferPool>, size, held + 2, 0);
        }
        for (i, (pool, size, min, max)) in pools.into_iter().enumerate() {
            let min = min + held;
            let max = if max == 0 { 0 } else { max.max(min) };
            query.set_nth_allocation_pool(i as u32, pool.as_ref(), size, min, max);
        }
        gst::debug!(
            CAT,
            imp = self,
            "asked upstream for {held} more buffers for held frames"
        );
        Ok(())
    }

    fn submit_input_buffer(
        &self,
        _is_discont: bool,
        buffer: gst::Buffer,
    ) -> Result<gst::FlowSuccess, gst::FlowError> {
        // The time in the element counts from here: the push into a shared engine may wait
        // for another stream's batch.
        let arrived = Instant::now();
        let tunables = self.settings.lock().unwrap().tunables;
        let timing = self.timing(&buffer, arrived);
        self.stats.lock().unwrap().frame_in();
        let mut guard = self.state.lock().unwrap();
        let Some(state) = guard.as_mut() else {
            return Err(gst::FlowError::Flushing);
        };
        // A live update switches engines here, between two frames.
        self.apply_update(state)?;
        state.failure.check()?;
        let mut held = Held {
            buffer,
            regions: Vec::new(),
        };
        if !state.queue.batcher.next_is_fresh() {
            state
                .queue
                .batcher
                .admit(held, tunables.interval, (arrived, timing.due), 0, None);
        } else {
            let deadline = timing.due.and_then(|due| {
                let batch_time = state.stream.batch_time();
                overload::allowed_lateness(
                    tunables.max_lateness_ms,
                    tunables.batch_timeout(),
                    batch_time,
                )
                .map(|lateness| {
                    overload::deadline(due, lateness, batch_time, tunables.batch_timeout())
                })
            });
            let late_downstream =
                deadline.is_some() && self.qos.lock().unwrap().is_late(timing.running_time);
            // A frame that came late (its camera fell behind) and can no longer be taken in
            // time gives up at once: were it pushed, its camera's thread would run the batch
            // it fills and fall further behind, taking turn after turn from the cameras that
            // are on time.
            let behind = timing.due.is_some_and(|due| due < arrived)
                && deadline.is_some_and(|d| d.push_by <= Instant::now());
            let pushed = match late_downstream || behind {
                true => None,
                false => {
                    let crops = state.input.crops(&mut held);
                    let until = deadline.map(|d| d.push_by);
                    match self.push_to_engine(state, &held.buffer, &crops, until)? {
                        Pushed::Queued => Some(crops.len()),
                        Pushed::Busy => None,
                    }
                }
            };
            match pushed {
                Some(items) => state.queue.batcher.admit(
                    held,
                    tunables.interval,
                    (arrived, timing.due),
                    items,
                    deadline.map(|d| d.leave_by),
                ),
                None => {
                    let why = match late_downstream {
                        true => Unscored::Qos,
                        false => Unscored::Late,
                    };
                    state.queue.batcher.skip(held, (arrived, timing.due), why);
                }
            }
        }
        // A carried frame with no fresh frame ahead of it goes straight on with the last
        // result; a full batch has run in the push.
        if let Err(err) = self.collect(state, &tunables) {
            // Frames that got their results before the failure leave all the same; the
            // downstream answer does not matter, this chain fails.
            let ready = std::mem::take(&mut state.queue.ready);
            drop(guard);
            let _ = self.push_ready(ready);
            return Err(err);
        }
        state.queue.arm_timer(&tunables);
        Ok(gst::FlowSuccess::Ok)
    }

    fn generate_output(&self) -> Result<GenerateOutputSuccess, gst::FlowError> {
        let mut guard = self.state.lock().unwrap();
        match guard.as_mut().and_then(|s| s.queue.ready.pop_front()) {
            Some(buffer) => Ok(GenerateOutputSuccess::Buffer(buffer)),
            None => Ok(GenerateOutputSuccess::NoOutput),
        }
    }
}

// A frame's timing, for the overload policy.
impl TrtClassify {
    /// Whether upstream is live, and its latency: asked upstream once per caps (and taken
    /// from every latency query that passes).
    fn upstream(&self) -> Upstream {
        if let Some(upstream) = *self.upstream.lock().unwrap() {
            return upstream;
        }
        let mut query = gst::query::Latency::new();
        let upstream = match self.obj().sink_pad().peer_query(&mut query) {
            true => {
                let (live, latency, _) = query.result();
                Upstream { live, latency }
            }
            false => Upstream {
                live: false,
                latency: gst::ClockTime::ZERO,
            },
        };
        gst::debug!(CAT, imp = self, "upstream: {upstream:?}");
        *self.upstream.lock().unwrap() = Some(upstream);
        upstream
    }

    /// When a frame that arrived at `arrived` was due, for a live source; and its running
    /// time, for QoS.
    fn timing(&self, buffer: &gst::BufferRef, arrived: Instant) -> FrameTiming {
        let upstream = self.upstream();
        if !upstream.live {
            return FrameTiming::default();
        }
        let obj = self.obj();
        let running_time = obj
            .segment()
            .downcast_ref::<gst::ClockTime>()
            .and_then(|segment| segment.to_running_time(buffer.pts()));
        let by_clock = match (obj.clock(), obj.base_time(), running_time) {
            (Some(clock), Some(base), Some(running_time)) => Some(overload::instant_of(
                base + running_time + upstream.latency,
                clock.time(),
                Instant::now(),
            )),
            _ => None,
        };
        FrameTiming {
            running_time,
            due: Some(overload::due(arrived, by_clock)),
        }
    }
}

/// A frame's time, as the overload policy reads it.
#[derive(Default)]
struct FrameTiming {
    /// Its running time, for downstream's QoS.
    running_time: Option<gst::ClockTime>,
    /// When it was due; `None` for a source that is not live (no deadline).
    due: Option<Instant>,
}

// A frame's way in: its items handed to the engine.
impl TrtClassify {
    /// Hands `crops` of a fresh frame to the engine as it arrives, so that their
    /// preprocessing and upload overlap the wait for their batch-mates. A frame in CUDA
    /// memory is read where it is when the engine can; otherwise mapping it copies it to
    /// system memory. A frame with nothing to classify is not mapped at all.
    fn push_to_engine(
        &self,
        state: &mut State,
        buffer: &gst::Buffer,
        crops: &[Crop],
        until: Option<Instant>,
    ) -> Result<Pushed, gst::FlowError> {
        if let (Some(_), Some(&crop)) = (&state.calibrating, crops.first()) {
            self.calibrate_on(state, buffer, crop);
        }
        let Some(info) = state.input.info.as_ref() else {
            gst::element_imp_error!(
                self,
                gst::CoreError::Negotiation,
                ["frames arrived before caps"]
            );
            return Err(gst::FlowError::NotNegotiated);
        };
        if crops.is_empty() {
            return Ok(Pushed::Queued);
        }
        let unreadable = |problem: &str| {
            gst::element_imp_error!(self, gst::StreamError::Format, ["{}", problem]);
            gst::FlowError::Error
        };
        let pushed = if state.stream.info().reads_device_frames
            && cudamem::is_cuda_memory(buffer.as_ref())
        {
            let frame = cudamem::DeviceFrame::map(buffer.as_ref(), info)
                .map_err(|e| unreadable(&format!("a buffer in CUDA memory cannot be read: {e}")))?;
            self.follow_frames(&frame);
            let planes = frame.planes().map_err(|e| unreadable(&e))?;
            state
                .stream
                .push_device(&planes, crops, until, Arc::new(buffer.clone()))
        } else {
            let frame = gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), info)
                .map_err(|_| unreadable("a buffer does not match its caps"))?;
            let view = crate::video::view(&frame).map_err(|e| unreadable(&e))?;
            state.stream.push(&view, crops, until)
        };
        pushed.map_err(|e| {
            let problem = format!(
                "frame {} could not be given to the engine, and is dropped: {e}",
                state.queue.batcher.next_number()
            );
            self.fail(state, &problem)
        })
    }
}

// Calibration on the stream's frames (an int8 or FP8 engine without calibration-location).
impl TrtClassify {
    /// Hands `crop` of the frame to the calibration where it wants one; once it is done,
    /// says so and moves to the quantized engine (a live update).
    fn calibrate_on(&self, state: &mut State, buffer: &gst::Buffer, crop: Crop) {
        let (Some(calibration), Some(info)) = (state.calibrating.clone(), &state.input.info) else {
            return;
        };
        let offered = match calibration.outcome() {
            Some(Ok(summary)) => {
                gst::element_imp_info!(self, gst::LibraryError::Settings, ["{}", summary]);
                state.calibrating = None;
                self.schedule_update("calibration on the stream");
                return;
            }
            Some(Err(problem)) => Err(problem.clone()),
            None if calibration.wants_frame() => {
                // Frames in CUDA memory are copied to system memory by the map.
                gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), info)
                    .map_err(|_| "a buffer does not match its caps".to_owned())
                    .and_then(|frame| {
                        let view = crate::video::view(&frame)?;
                        calibration.offer(&view, crop, state.stream.info().input)
                    })
            }
            None => Ok(()),
        };
        if let Err(problem) = offered {
            gst::element_imp_warning!(
                self,
                gst::LibraryError::Settings,
                [
                    "calibration on the stream failed: {}; the engine stays in fp16",
                    problem
                ]
            );
            state.calibrating = None;
        }
    }
}

// Partial batches, pushes from outside the streaming thread, and the failure relay.
impl TrtClassify {
    /// Reports an engine failure once, with the frames it holds back (see `Failure::failed`).
    pub(super) fn fail(&self, state: &mut State, problem: &str) -> gst::FlowError {
        state.failure.failed = true;
        state.queue.disarm_timer();
        let held = match state.queue.batcher.held_range() {
            Some((first, last)) if first == last => {
                format!("frame {first} of this stream is held back")
            }
            Some((first, last)) => {
                format!("frames {first} to {last} of this stream are held back")
            }
            None => "no frame of this stream was waiting".into(),
        };
        gst::element_imp_error!(
            self,
            gst::StreamError::Failed,
            ["{}: {}; {}", state.outputs.model_name, problem, held]
        );
        gst::FlowError::Error
    }

    /// Pushes the frames whose results are in, from outside `generate_output`: before a
    /// serialized event (`all`: after running the partial batch that holds this element's
    /// frames), or from the timer thread (the partial batch runs once its oldest frame of
    /// ours has waited `batch-timeout`). The caller holds the stream lock.
    fn finish_batch(&self, all: bool) -> Result<gst::FlowSuccess, gst::FlowError> {
        let tunables = self.settings.lock().unwrap().tunables;
        let (ready, finished) = {
            let mut guard = self.state.lock().unwrap();
            let Some(state) = guard.as_mut() else {
                return Ok(gst::FlowSuccess::Ok);
            };
            let finished = self.complete_partial_batch(state, &tunables, all);
            // Frames that got their results before a failure leave all the same.
            (std::mem::take(&mut state.queue.ready), finished)
        };
        self.push_ready(ready)?;
        finished.map(|()| gst::FlowSuccess::Ok)
    }

    /// `finish_batch` under the state lock: collects, asks the shared engine to run the
    /// partial batch when it is due (or `all`), collects again.
    fn complete_partial_batch(
        &self,
        state: &mut State,
        tunables: &Tunables,
        all: bool,
    ) -> Result<(), gst::FlowError> {
        self.collect(state, tunables)?;
        let now = Instant::now();
        let expiry = state.queue.batcher.next_expiry();
        let due = all
            || state.queue.deadline(tunables).is_some_and(|d| d <= now)
            || expiry.is_some_and(|t| t <= now);
        if state.queue.batcher.unscored() > 0 && due {
            gst::debug!(CAT, imp = self, "running a partial batch");
            // A live source's frames wait for the engine only while their batch can still
            // run by their deadline; then they leave without results (see `overload`).
            let until = match (all, expiry) {
                (false, Some(expiry)) => Some(
                    expiry
                        .checked_sub(state.stream.batch_time())
                        .map_or(now, |t| t.max(now)),
                ),
                _ => None,
            };
            let ran = state.stream.run_now(until);
            gst::debug!(
                CAT,
                imp = self,
                "partial batch: ran {ran} (until {until:?}, {} items waiting)",
                state.queue.batcher.unscored()
            );
            state.queue.engine_busy = !ran;
            if !ran {
                let abandoned = state.queue.batcher.expire(Instant::now());
                if abandoned > 0 {
                    gst::debug!(
                        CAT,
                        imp = self,
                        "the engine is busy: {abandoned} items past their deadline leave unclassified"
                    );
                    state.stream.abandon(abandoned);
                }
            }
            self.collect(state, tunables)?;
        }
        if all && state.queue.batcher.unscored() > 0 {
            let problem = format!(
                "{} frames were given to the engine and never came back",
                state.queue.batcher.unscored()
            );
            return Err(self.fail(state, &problem));
        }
        state.queue.arm_timer(tunables);
        Ok(())
    }

    /// Pushes frames that have their results, outside `generate_output`.
    fn push_ready(&self, ready: VecDeque<gst::Buffer>) -> Result<gst::FlowSuccess, gst::FlowError> {
        let srcpad = self.obj().src_pad().clone();
        for buffer in ready {
            srcpad.push(buffer)?;
        }
        Ok(gst::FlowSuccess::Ok)
    }

    /// Called on the timer thread when a partial batch may have waited `batch-timeout` (or a
    /// live frame's deadline came), or when another stream's batch brought scores for this
    /// element's frames.
    ///
    /// GStreamer's panic guard covers the streaming thread, not this one: a panic here would
    /// end the thread silently (frames then wait forever) with the state locked and poisoned.
    /// It becomes an element error instead, and the next chain fails.
    pub(super) fn on_timer(&self) {
        let sinkpad = self.obj().sink_pad().clone();
        let _stream_lock = sinkpad.stream_lock();
        let finished =
            catch_unwind(AssertUnwindSafe(|| self.finish_batch(false))).unwrap_or_else(|panic| {
                self.settings.clear_poison();
                self.state.clear_poison();
                gst::element_imp_error!(
                    self,
                    gst::CoreError::Failed,
                    [
                        "internal error on the batch timer thread: {}",
                        engine::panic_message(&*panic)
                    ]
                );
                if let Some(state) = self.state.lock().unwrap().as_mut() {
                    state.failure.failed = true;
                }
                Err(gst::FlowError::Error)
            });
        if let Err(err) = finished
            && let Some(state) = self.state.lock().unwrap().as_mut()
        {
            state.failure.flow_error = Some(err);
        }
    }
}
