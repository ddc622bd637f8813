// SPDX-License-Identifier: MPL-2.0
#![warn(missing_docs)]
//! trtclassify's inference engines, usable without GStreamer: an ONNX image classifier built
//! once for a backend (the embedded CPU engine, our CUDA engine, or a KServe v2 server), fed
//! video frames (`frame::FrameView`, with their crops), returning one score vector per crop.
//!
//! An engine is built once per model and options, takes a batch of frames, and returns one
//! score vector per frame. Each backend does its own preprocessing (`preprocess` on the CPU)
//! so that a GPU backend can do it on the GPU. The GStreamer element (`gsttrtclassify`)
//! shares engines between its streams; `examples/classify_image.rs` uses one directly.

/// The model compiler (its own crate).
pub use trtclassify_compiler as compiler;
pub mod calibration;
pub mod cpu;
pub mod cuda;
pub mod kserve;
pub mod preprocess;

pub use compiler::{LOG_TARGET, class_count, external_data, frame, onnx, panic_message};

use std::path::PathBuf;

use crate::preprocess::{Crop, InputSpec, PreprocessError, PreprocessOptions};
use frame::{FrameFormat, FrameView};
pub use onnx::{Dim, ModelError, OnnxModel};

/// The inference backend: the element's `backend` property.
#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, Default)]
#[repr(u32)]
pub enum Backend {
    /// The CUDA engine where a GPU can build it, else the CPU.
    #[default]
    Auto = 0,
    /// The embedded CPU engine, always fp32.
    Cpu = 1,
    /// Our own CUDA engine (cuDNN, cuBLASLt and compiled kernels) on an NVIDIA GPU.
    Cuda = 2,
    /// TensorRT; this build lacks it, so asking for it is an error.
    Tensorrt = 3,
    /// A remote server speaking the KServe v2 protocol over gRPC (Triton, KServe, MLServer).
    Kserve = 4,
}

/// The number type an engine computes in: the element's `precision` property.
#[derive(Debug, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, Default)]
#[repr(u32)]
pub enum Precision {
    /// Half precision on GPUs; the CPU backend runs fp32 anyway.
    #[default]
    Fp16 = 0,
    /// Single precision everywhere.
    Fp32 = 1,
    /// Products and dense convolutions with int8 operands on GPUs (compute capability 7.5+),
    /// their input scales from a calibration table (`EngineOptions::calibration`); the rest,
    /// and the layers the table marks as losing too much, in fp16.
    Int8 = 2,
    /// As `Int8`, in FP8 E4M3 (compute capability 8.9+: Ada, Hopper, Blackwell).
    Fp8 = 3,
}

impl Precision {
    /// The 8-bit format of the quantized precisions; `None` for fp16 and fp32.
    pub fn quant_format(self) -> Option<compiler::quant::QuantFormat> {
        match self {
            Precision::Int8 => Some(compiler::quant::QuantFormat::Int8),
            Precision::Fp8 => Some(compiler::quant::QuantFormat::Fp8),
            Precision::Fp16 | Precision::Fp32 => None,
        }
    }
}

/// `EngineOptions::min_agreement`'s default: of the 32 frames a calibration holds out at
/// most, one may change its top class.
pub const DEFAULT_MIN_AGREEMENT: f64 = 0.95;

/// Everything that shapes an engine; a change of any of it means another engine. Elements
/// whose options are equal can share one engine (the plugin's engine instances).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineOptions {
    /// The ONNX file.
    pub model: PathBuf,
    /// The most frames run at once.
    pub batch_size: usize,
    /// Height and width for models whose spatial axes are dynamic.
    pub input_size: Option<(usize, usize)>,
    /// The precision asked of a GPU backend; the CPU backend ignores it.
    pub precision: Precision,
    /// The calibration table of `Precision::Int8` and `Precision::Fp8` (written by
    /// `trtclassify-engine calibrate`); the other precisions ignore it.
    pub calibration: Option<PathBuf>,
    /// The least top-1 agreement with fp32, 0 to 1, that an int8 or FP8 engine must show on
    /// the calibration's held-out frames; below it the engine is built in fp16 instead.
    pub min_agreement: f64,
    /// Whether every layer an int8 or FP8 engine quantizes runs in 8 bits, even where fp16 is
    /// faster on the GPU (TensorRT's obey-precision-constraints). By default the build times
    /// each both ways and keeps the faster.
    pub strict_precision: bool,
    /// The CUDA device ordinal a GPU backend runs on.
    pub gpu_id: u32,
    /// Threads of the CPU backend's shared pool one engine may use; 0: all cores.
    pub threads: usize,
    /// Where the GPU engine is saved and loaded; `None`: the per-user cache folder.
    pub engine_location: Option<PathBuf>,
    /// How frames become the model's input.
    pub preprocess: PreprocessOptions,
    /// Hears what a long engine build is doing.
    pub progress: Progress,
    /// The server of `backend=kserve`; unused by the other backends.
    pub server: kserve::ServerOptions,
}

impl EngineOptions {
    /// The options for `model` with the element's defaults: one frame a batch, the model's own
    /// input size, fp16 on GPUs, GPU 0, every core, the per-user engine cache and ImageNet's
    /// normalisation (`PreprocessOptions::default()`).
    pub fn new(model: impl Into<PathBuf>) -> Self {
        EngineOptions {
            model: model.into(),
            batch_size: 1,
            input_size: None,
            precision: Precision::default(),
            calibration: None,
            min_agreement: DEFAULT_MIN_AGREEMENT,
            strict_precision: false,
            gpu_id: 0,
            threads: 0,
            engine_location: None,
            preprocess: PreprocessOptions::default(),
            progress: Progress::default(),
            server: kserve::ServerOptions::default(),
        }
    }
}

/// A callback for progress messages while an engine builds.
#[derive(Clone, Default)]
pub struct Progress(Option<std::sync::Arc<ProgressFn>>);

type ProgressFn = dyn Fn(&str) + Send + Sync;

impl Progress {
    /// Calls `f` with every message.
    pub fn new(f: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Self(Some(std::sync::Arc::new(f)))
    }

    /// Passes `message` to the callback, if there is one.
    pub fn report(&self, message: &str) {
        if let Some(f) = &self.0 {
            f(message);
        }
    }
}

/// A listener is not part of what an engine is: options that differ only in it are equal.
impl PartialEq for Progress {
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Progress(..)"
        } else {
            "Progress(none)"
        })
    }
}

/// What the element needs to know of a built engine.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The model's input, its spatial size settled.
    pub input: InputSpec,
    /// Scores per frame.
    pub num_classes: usize,
    /// Frames run in one call of the model: the backend's choice within what the model allows.
    pub model_batch: usize,
    /// Whether the model's own last operator makes probabilities (Softmax, Sigmoid).
    pub outputs_probabilities: bool,
    /// The backend that runs it; never `Auto`.
    pub backend: Backend,
    /// The precision it runs in: `Fp32` on the CPU, whatever was asked.
    pub precision: Precision,
    /// Why `precision` is not the one asked for (fp16 overflowed on sample frames), for the
    /// element to say; `None` where it is.
    pub precision_note: Option<String>,
    /// What an int8 or FP8 build measured of its engine on the held-out frames and which
    /// layers it kept in fp16, for the element to post; `None` for the other precisions.
    pub quant_report: Option<String>,
    /// Whether `Engine::push_device` reads frames in GPU memory where they are; frames in
    /// CUDA memory are otherwise mapped to system memory (a copy) before `push`.
    pub reads_device_frames: bool,
    /// How many full batches the engine may hold sent and unanswered before the streams wait
    /// for their scores: 1 for engines that run a batch where they are; more for a remote
    /// server, whose answers come back while the next batches gather, so that the network's
    /// round trip does not idle the server, and for a GPU, whose batches run while the next
    /// gather (the batches running and the one gathering; it hands finished ones out with
    /// `Engine::take_ready`).
    pub batches_in_flight: usize,
    /// Where a run's values first became infinite or NaN (the step and the ONNX node), once
    /// the engine has looked: the first time its scores were not finite. Shared by every
    /// copy of this info, and set before those scores leave the engine, so that the element
    /// can name the node in its warning.
    pub non_finite: std::sync::Arc<std::sync::OnceLock<String>>,
    /// The engine file this engine was loaded from or saved to (GPU backends); `None` for
    /// engines that keep none (the CPU backend).
    pub engine_file: Option<EngineFileUse>,
}

/// How an engine used its engine file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFileUse {
    /// The file.
    pub path: PathBuf,
    /// Whether the engine came from it (a cache hit), rather than being built (and saved).
    pub loaded: bool,
}

/// A video frame whose planes are in GPU memory (GStreamer's CUDA memory), mapped as device
/// pointers for the duration of a `push_device`.
#[derive(Debug)]
pub struct DevicePlanes {
    /// Format, size and colorimetry.
    pub format: FrameFormat,
    /// The device address of each plane.
    pub ptrs: Vec<u64>,
    /// Bytes between rows, one per plane.
    pub strides: Vec<i32>,
    /// The CUDA context (`CUcontext`) the memory belongs to.
    pub context: usize,
}

/// Why an engine cannot be built or a frame cannot be classified.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model file cannot be used.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The backend cannot run here: not built in, no GPU, no driver.
    #[error("backend={backend} is not available: {reason}")]
    Unavailable {
        /// The backend's nick, as the `backend` property spells it.
        backend: &'static str,
        /// Why, for the message.
        reason: String,
    },
    /// The model uses operators the backend does not implement.
    #[error("{}: the {backend} backend does not support the operator(s) {}", path.display(), ops.join(", "))]
    UnsupportedOps {
        /// The model file.
        path: PathBuf,
        /// The backend's nick, as the `backend` property spells it.
        backend: &'static str,
        /// The operator types it lacks, by their ONNX names.
        ops: Vec<String>,
    },
    /// Building the engine failed, or panicked.
    #[error("{}: {reason}", path.display())]
    Build {
        /// The model file.
        path: PathBuf,
        /// What went wrong, for the message.
        reason: String,
    },
    /// A run failed; the text says how.
    #[error("inference failed: {0}")]
    Inference(String),
    /// A frame could not be turned into the model's input.
    #[error(transparent)]
    Preprocess(#[from] PreprocessError),
}

/// A model built for one backend and set of options: frames in, one score vector per frame out.
pub trait Engine: Send {
    /// The model's input, classes and batch as built; the same for the engine's lifetime.
    fn info(&self) -> &ModelInfo;

    /// Runs `n` preprocessed frames laid out as the model's input, one after the other.
    fn infer(&mut self, input: &[f32], n: usize) -> Result<Vec<Vec<f32>>, EngineError>;

    /// Takes the next items of the batch being gathered, one per crop of `frame` (the whole
    /// frame, or regions of it), as soon as the frame arrives: they are preprocessed (on a
    /// GPU: the frame uploaded once, then each crop preprocessed there) while their
    /// batch-mates are awaited, and a full model batch runs at once. The frame may be
    /// released on return.
    fn push(&mut self, frame: &FrameView, crops: &[Crop]) -> Result<(), EngineError>;

    /// As `push`, for a frame in GPU memory; only called where `info().reads_device_frames`.
    fn push_device(&mut self, _frame: &DevicePlanes, _crops: &[Crop]) -> Result<(), EngineError> {
        Err(EngineError::Inference(format!(
            "the {:?} backend reads frames from system memory only",
            self.info().backend
        )))
    }

    /// Runs what is left of the items pushed since the last `run_pushed` or `discard`, and
    /// returns one score vector per pushed item, in order. The items are forgotten
    /// afterwards, even on error.
    fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError>;

    /// The scores of the oldest pushed items whose model batches have finished, in push
    /// order, without waiting; they are forgotten as by `run_pushed`. For engines that run
    /// batches while the next gather (`ModelInfo::batches_in_flight` above 1), so that their
    /// streams get scores as each batch finishes, not when `run_pushed` waits for all. An
    /// error (a batch in flight failed) loses every pushed item, as a failed `run_pushed`.
    /// Engines that answer only in `run_pushed` have none ready.
    fn take_ready(&mut self) -> Result<Ready, EngineError> {
        Ok(Ready::default())
    }

    /// Gives an engine whose batches finish while the next gather the `signal` to call when
    /// one has (from a thread of its own: the signal must only signal), for its caller to
    /// `take_ready` the scores; `true` where it will call it. The others never do.
    fn on_batch_done(&mut self, _signal: BatchDone) -> bool {
        false
    }

    /// Forgets the frames pushed since the last `run_pushed` (a flush dropped them). Once it
    /// returns, nothing reads a frame pushed with `push_device` any more: it may be released.
    fn discard(&mut self);

    /// How many items pushed since the last `run_pushed`, `take_ready` or `discard` the
    /// engine holds (their input, their batch in flight, or their scores where it has run). A push refused for its own
    /// frame (one it cannot read or preprocess) leaves this as it was: the items pushed
    /// before it, of other streams too, are kept. A failure that loses them (a model batch
    /// that failed inside the push) leaves it lower, so that a shared engine can tell the two
    /// apart.
    fn pending(&self) -> usize;

    /// Pushes and runs `frames`.
    fn classify(&mut self, frames: &[FrameView]) -> Result<Vec<Vec<f32>>, EngineError> {
        for frame in frames {
            if let Err(e) = self.push(frame, &[Crop::Whole]) {
                self.discard();
                return Err(e);
            }
        }
        self.run_pushed()
    }
}

/// The scores of pushed frames whose model batch has run, kept until `run_pushed`.
#[derive(Debug, Default)]
pub(crate) struct Ran(Vec<Vec<f32>>);

/// `Engine::on_batch_done`'s signal.
pub type BatchDone = std::sync::Arc<dyn Fn() + Send + Sync>;

/// What `Engine::take_ready` found finished.
#[derive(Debug, Default)]
pub struct Ready {
    /// One score vector per item, the oldest pushed first.
    pub scores: Vec<Vec<f32>>,
    /// The model batches they ran in.
    pub batches: usize,
    /// The longest any of those batches took from its launch to its scores.
    pub took: std::time::Duration,
}

impl Ran {
    /// Keeps a model batch's scores; an error forgets those of every pushed frame.
    pub(crate) fn keep(
        &mut self,
        scores: Result<impl IntoIterator<Item = Vec<f32>>, EngineError>,
    ) -> Result<(), EngineError> {
        match scores {
            Ok(scores) => {
                self.0.extend(scores);
                Ok(())
            }
            Err(e) => {
                self.0.clear();
                Err(e)
            }
        }
    }

    /// `run_pushed`'s answer once its last model batch `last` has run: every kept score.
    pub(crate) fn take(
        &mut self,
        last: Result<(), EngineError>,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let scores = std::mem::take(&mut self.0);
        last.map(|()| scores)
    }

    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }

    /// How many scores are kept.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Keeps the first `n` scores only (a push refused part-way forgets its own items).
    pub(crate) fn truncate(&mut self, n: usize) {
        self.0.truncate(n);
    }
}

/// Runs `n` frames of `input` in calls of at most `batch` frames; `call` gets each chunk
/// with its frame count and returns one score vector per frame.
pub(crate) fn infer_in_calls(
    input: &[f32],
    n: usize,
    frame_len: usize,
    batch: usize,
    mut call: impl FnMut(&[f32], usize) -> Result<Vec<Vec<f32>>, EngineError>,
) -> Result<Vec<Vec<f32>>, EngineError> {
    assert_eq!(input.len(), n * frame_len, "input holds {n} frames");
    let mut scores = Vec::with_capacity(n);
    for chunk in input.chunks(batch * frame_len) {
        scores.extend(call(chunk, chunk.len() / frame_len)?);
    }
    Ok(scores)
}

/// Builds the engine for `backend`. `Auto` takes the first of the GPU backends that is built in
/// and usable, else the CPU; an explicit backend that is not usable is an error, never a
/// silent fallback. A panic while building (a bug, or a model no check foresaw) is a build
/// error naming the model, like any other: it fails this start only, and `Auto` falls back.
pub fn build(backend: Backend, options: &EngineOptions) -> Result<Box<dyn Engine>, EngineError> {
    let guarded = |name: &str, build: &dyn Fn() -> Result<Box<dyn Engine>, EngineError>| {
        unpanic(build, |panic| EngineError::Build {
            path: options.model.clone(),
            reason: format!("internal error in the {name} engine build: {panic}"),
        })
    };
    let cuda = || guarded("cuda", &|| Ok(Box::new(cuda::CudaEngine::build(options)?)));
    let cpu = || guarded("cpu", &|| Ok(Box::new(cpu::CpuEngine::build(options)?)));
    let kserve = || {
        guarded("kserve", &|| {
            Ok(Box::new(kserve::KserveEngine::build(options)?))
        })
    };
    match backend {
        Backend::Auto => {
            match cuda() {
                Ok(engine) => return Ok(engine),
                // No GPU is the normal case of auto; a GPU that fails to build this model
                // is worth a warning.
                Err(EngineError::Unavailable { reason, .. }) => {
                    log::info!(target: crate::LOG_TARGET, "backend=auto: using cpu: {reason}")
                }
                Err(e) => {
                    log::warn!(target: crate::LOG_TARGET, "backend=auto: the cuda engine failed, using cpu: {e}")
                }
            }
            cpu()
        }
        Backend::Cpu => cpu(),
        Backend::Cuda => cuda(),
        Backend::Kserve => kserve(),
        Backend::Tensorrt => Err(EngineError::Unavailable {
            backend: "tensorrt",
            reason: "this plugin was built without TensorRT support".into(),
        }),
    }
}

/// Runs `f`, turning a panic inside it into the error `on_panic` makes of the panic's
/// message, so that a bug in an engine fails one start or one batch instead of unwinding
/// into GStreamer (which marks the element as panicked for good) or a timer thread.
pub fn unpanic<T>(
    f: impl FnOnce() -> Result<T, EngineError>,
    on_panic: impl FnOnce(String) -> EngineError,
) -> Result<T, EngineError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|panic| Err(on_panic(panic_message(&*panic))))
}
