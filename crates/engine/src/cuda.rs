// SPDX-License-Identifier: MPL-2.0
//! `backend=cuda`: our own fp16 engine on NVIDIA GPUs.
//!
//! The compiler turns the ONNX model into a plan of GPU steps per batch size, on the CPU;
//! the CUDA runtime (`trtclassify-cuda`) tunes and runs them, preprocesses frames on the GPU
//! and keeps the engine files. This module puts the engine seam around them: frames pushed
//! in batches, the CPU preprocessing where the GPU cannot read a frame, the engine file
//! looked up or built.

pub use trtclassify_cuda::{
    Error, cache, engine_file, fp16_range, gpu_count, runtime, unavailable_reason,
};
use trtclassify_cuda::{digests, frames};

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{Backend, Engine, EngineError, EngineOptions, ModelInfo, OnnxModel, Precision};
use crate::compiler::plan::{DType, QuantFormat};
use crate::compiler::quant::{self, Agreement, CalibrationTable, HeldOut};
use crate::compiler::{batch_sizes, compile_mixed, import};
use crate::frame::{FrameFormat, FrameView};
use crate::preprocess::{Crop, Preprocessor};
use engine_file::{EngineFile, Key};

/// The cuda backend's engine: a `runtime::Runtime` fed frames preprocessed on the GPU, or on
/// the CPU where the GPU cannot read them.
pub struct CudaEngine {
    info: ModelInfo,
    runtime: runtime::Runtime,
    preprocessor: Preprocessor,
    /// Preprocessing on the GPU, where the model takes three channels.
    frame_pre: Option<frames::FramePreprocess>,
    /// One frame preprocessed on the CPU, for frames the GPU kernel does not read.
    input: Vec<f32>,
    /// Frames pushed into the runtime's input and not yet launched.
    pushed: usize,
    /// Batches launched and not yet collected, oldest first: their frames and launch time.
    launched: VecDeque<(usize, Instant)>,
    /// Scores of the pushed frames that have run; the batches they ran in since the last
    /// `take_ready`, and the longest any took from its launch.
    ran: super::Ran,
    finished: usize,
    took: Duration,
    /// The most batches that run while the next gathers (`in_flight`).
    in_flight: usize,
    /// Whether frames from another CUDA context were seen (and said so once).
    foreign_frames: bool,
}

impl CudaEngine {
    /// Fails with `Unavailable` before reading the model where the CUDA libraries are missing
    /// or no GPU opens, so that `backend=auto` costs nothing on machines without a GPU.
    pub fn build(options: &EngineOptions) -> Result<Self, EngineError> {
        if let Some(reason) = unavailable_reason() {
            return Err(EngineError::Unavailable {
                backend: "cuda",
                reason,
            });
        }
        let gpu = runtime::open_gpu(options.gpu_id).map_err(|e| EngineError::Unavailable {
            backend: "cuda",
            reason: e.to_string(),
        })?;
        // cuBLASLt's and cuDNN's first calls, slow, made while the engine file or the model
        // is read; waited for before this returns.
        let _warmup = runtime::warm_libraries(&gpu);
        let fail = |reason: String| EngineError::Build {
            path: options.model.clone(),
            reason,
        };
        // A model unchanged since an engine was built from it is known by what was
        // remembered of it (its digest, the facts of its graph): the model itself, hundreds
        // of megabytes, is read only where the engine is built.
        let (digest, facts, loaded) = match digests::remembered_model(&options.model) {
            Some((digest, facts)) => (digest, facts, None),
            None => {
                let model = load_model(&options.model)?;
                let facts = model.facts();
                let digest = digests::model_digest(&model.path, &model.external_files(), &facts)
                    .map_err(|e| fail(e.to_string()))?;
                (digest, facts, Some(model))
            }
        };
        let spec = facts.input.spec(options.input_size).map_err(fail)?;
        let dtype = match options.precision {
            Precision::Fp16 | Precision::Int8 | Precision::Fp8 => DType::F16,
            Precision::Fp32 => DType::F32,
        };
        let quant = quantization(options).map_err(fail)?;
        let started = Instant::now();
        let versions = runtime::library_versions();
        let key = Key {
            format: engine_file::FORMAT_VERSION,
            plugin_version: env!("CARGO_PKG_VERSION").into(),
            kernels_sha256: engine_file::sha256_hex(runtime::source()),
            onnx_sha256: digest,
            gpu: gpu.name.clone(),
            compute_capability: gpu.arch,
            cuda_driver: versions.driver,
            nvrtc: versions.nvrtc,
            cudnn: versions.cudnn,
            cublaslt: versions.cublaslt,
            precision: dtype,
            batch_sizes: batch_sizes(options.batch_size, facts.input.batch.fixed()),
            input: (spec.height, spec.width),
            quantized: quant.as_ref().map(|q| q.key.clone()),
        };
        let quant = quant.as_ref();
        let (path, place) = match &options.engine_location {
            Some(path) => (path.clone(), cache::Place::Elsewhere),
            None => (
                cache::dir().join(key.file_name(&options.model)),
                cache::Place::Cache,
            ),
        };
        let mut progress = |msg: &str| {
            log::info!(target: crate::LOG_TARGET, "{}: {msg} ({:.1?})",
                options.model.display(),
                started.elapsed()
            );
            options.progress.report(msg);
        };

        // Plans without tuned algorithms are tuned here; a loaded file's are used as they are.
        // A fresh build (`built`) also times each 8-bit step both ways, unless strict.
        let open = |file: &mut EngineFile, built: bool, progress: &mut dyn FnMut(&str)| {
            let plans = std::mem::take(&mut file.plans);
            let wide = file.kept_f32.as_ref().map(|k| runtime::Wide {
                cubin: &k.kernels,
                weights: &k.weights,
            });
            runtime::Runtime::new(
                &gpu,
                &file.kernels,
                file.dtype(),
                &file.weights,
                plans,
                wide,
                built && !file.key.quantized.as_ref().is_some_and(|q| q.strict),
                progress,
            )
            .map_err(|e| fail(e.to_string()))
        };
        let build = |progress: &mut dyn FnMut(&str)| {
            let model = match loaded {
                Some(model) => model,
                None => {
                    let model = load_model(&options.model)?;
                    // The key holds the digest remembered for the files as they were before
                    // this read: they must still be those, with the same facts.
                    let now = digests::remembered_model(&options.model);
                    if now != Some((key.onnx_sha256.clone(), model.facts())) {
                        return Err(fail(
                            "the model changed while it was read; start again".into(),
                        ));
                    }
                    model
                }
            };
            let model = &model;
            let mut file =
                build_engine(model, &gpu, key.clone(), dtype, spec, &[], quant, progress)
                    .map_err(fail)?;
            let mut runtime = open(&mut file, true, progress)?;
            let mut kept: Vec<String> = Vec::new();
            if dtype == DType::F16 {
                // Where the sample frames pass fp16's range, the nodes that do (and those
                // reading their values) are built again in f32, the rest staying fp16, until
                // the samples fit; a few rounds at most, then the whole engine in fp32.
                let samples = fp16_range::sample_frames(spec, &options.preprocess).map_err(fail)?;
                let mut found: Vec<String> = Vec::new();
                loop {
                    let overflow = fp16_range::check(&mut runtime, &samples, spec.frame_len())
                        .map_err(|e| fail(e.to_string()))?;
                    let Some(overflow) = overflow else {
                        break;
                    };
                    let because = format!(
                        "{overflow} on sample frames, past fp16's largest value, {}",
                        fp16_range::LIMIT
                    );
                    // Its GPU memory goes before the next build's is taken.
                    drop(runtime);
                    if kept.contains(&overflow.node) || found.len() == fp16_range::ROUNDS {
                        log::warn!(target: crate::LOG_TARGET, "{}: precision=fp16: {because}; the engine is built in fp32",
                            model.path.display()
                        );
                        progress(&format!("{because}: building the engine in fp32"));
                        file = build_engine(
                            model,
                            &gpu,
                            key.clone(),
                            DType::F32,
                            spec,
                            &[],
                            quant,
                            progress,
                        )
                        .map_err(fail)?;
                        file.fp32_because = Some(because);
                        runtime = open(&mut file, true, progress)?;
                        break;
                    }
                    progress(&format!("{because}: building that node in f32"));
                    found.push(because);
                    kept.push(overflow.node);
                    file = build_engine(
                        model,
                        &gpu,
                        key.clone(),
                        dtype,
                        spec,
                        &kept,
                        quant,
                        progress,
                    )
                    .map_err(fail)?;
                    if let Some(k) = &mut file.kept_f32 {
                        k.because = found.clone();
                    }
                    runtime = open(&mut file, true, progress)?;
                }
                if let Some(k) = file
                    .kept_f32
                    .as_ref()
                    .filter(|_| file.fp32_because.is_none())
                {
                    log::warn!(target: crate::LOG_TARGET, "{}: {}", model.path.display(), mixed_note(k));
                }
            }
            if let Some(q) = quant {
                // The accuracy guard: below the agreement asked, the same engine unquantized.
                let checked =
                    check_quantized(&mut runtime, &mut file, q, spec.frame_len()).map_err(fail)?;
                progress(&checked.report);
                if checked.fell_back {
                    log::warn!(target: crate::LOG_TARGET, "{}: {}", model.path.display(), checked.report);
                    drop(runtime);
                    let (fp32_because, kept_f32) = (file.fp32_because.take(), file.kept_f32.take());
                    file = build_engine(
                        model,
                        &gpu,
                        key.clone(),
                        file.dtype(),
                        spec,
                        &kept,
                        None,
                        progress,
                    )
                    .map_err(fail)?;
                    (file.fp32_because, file.quant_check) = (fp32_because, Some(checked));
                    if let (Some(old), Some(new)) = (kept_f32, &mut file.kept_f32) {
                        new.because = old.because;
                    }
                    runtime = open(&mut file, true, progress)?;
                } else {
                    file.quant_check = Some(checked);
                }
            }
            // What is saved: the plans with the algorithms tuned for them.
            file.plans = runtime.plans().cloned().collect();
            Ok::<_, EngineError>((file, runtime))
        };
        // Of processes (and engines) starting together, one builds and the others load.
        let (mut file, built) =
            cache::load_or_build(&path, place, &key, spec.frame_len(), &mut progress, build)?;
        let fresh = built.is_some();
        let runtime = match built {
            Some(runtime) => runtime,
            None => open(&mut file, false, &mut progress)?,
        };
        let num_classes = file.num_classes;
        log::info!(target: crate::LOG_TARGET, "{}: cuda engine ready in {:.1?} on {} (sm_{}{}, {versions}), {:?}",
            options.model.display(),
            started.elapsed(),
            gpu.name,
            gpu.arch.0,
            gpu.arch.1,
            file.dtype(),
        );
        let preprocessor = Preprocessor::new(options.preprocess.clone(), spec).map_err(fail)?;
        let frame_pre = frames::FramePreprocess::new(&options.preprocess, spec).map_err(fail)?;
        let info = ModelInfo {
            input: spec,
            num_classes,
            model_batch: runtime.max_batch(),
            outputs_probabilities: facts.outputs_probabilities(),
            backend: Backend::Cuda,
            precision: match (&file.key.quantized, &file.quant_check, file.dtype()) {
                (Some(q), Some(c), _) if !c.fell_back && q.format == QuantFormat::Int8 => {
                    Precision::Int8
                }
                (Some(_), Some(c), _) if !c.fell_back => Precision::Fp8,
                (_, _, DType::F16) => Precision::Fp16,
                (_, _, DType::F32) => Precision::Fp32,
            },
            quant_report: (file.quant_check.as_ref())
                .filter(|c| !c.fell_back)
                .map(|c| c.report.clone()),
            precision_note: match (&file.fp32_because, &file.kept_f32) {
                _ if file.quant_check.as_ref().is_some_and(|c| c.fell_back) => {
                    file.quant_check.as_ref().map(|c| c.report.clone())
                }
                (Some(because), _) => Some(format!(
                    "precision=fp16: {because}; the engine runs in fp32"
                )),
                (None, Some(kept)) => Some(mixed_note(kept)),
                (None, None) => None,
            },
            reads_device_frames: frame_pre.is_some(),
            // The batches running and the one gathering: a push that fills a batch waits for
            // the oldest, and streams get scores as batches finish (`take_ready`). Without
            // batches in flight, 1: the instance runs each full batch.
            batches_in_flight: match in_flight(options.batch_size) {
                0 => 1,
                n => n + 1,
            },
            non_finite: Default::default(),
            engine_file: Some(super::EngineFileUse {
                path: path.clone(),
                loaded: !fresh,
            }),
        };
        Ok(CudaEngine {
            info,
            runtime,
            preprocessor,
            frame_pre,
            input: Vec::new(),
            pushed: 0,
            launched: VecDeque::new(),
            ran: Default::default(),
            finished: 0,
            took: Duration::ZERO,
            in_flight: in_flight(options.batch_size),
            foreign_frames: false,
        })
    }

    /// The mean time of preprocessing one frame of `info` already in GPU memory into the
    /// model input, over `runs` full batches; for benchmarks.
    pub fn time_device_preprocess(
        &mut self,
        format: &FrameFormat,
        offsets: &[i64],
        strides: &[i32],
        runs: usize,
    ) -> Result<f64, EngineError> {
        let params = self
            .frame_pre
            .as_ref()
            .and_then(|pre| pre.params_at(format, offsets, strides, Crop::Whole))
            .ok_or_else(|| EngineError::Inference("no GPU preprocessing for this model".into()))?;
        self.runtime
            .time_device_preprocess(&params, runs)
            .map_err(inference)
    }

    /// The runtime, for benchmarks and profiles.
    pub fn runtime(&self) -> &runtime::Runtime {
        &self.runtime
    }
}

/// The engine of `model` for `key` with its plans in `dtype` (the key's precision, or fp32
/// where fp16 overflowed), not tuned yet.
/// What a mixed-precision engine says of itself: why, and which nodes run in f32.
fn mixed_note(kept: &engine_file::KeptF32) -> String {
    format!(
        "precision=fp16: {}; {} node(s) run in f32 ({}), the rest in fp16",
        kept.because.join("; "),
        kept.nodes.len(),
        kept.nodes.join(", ")
    )
}

/// What an int8 or FP8 engine is quantized with.
struct Quantization {
    key: engine_file::QuantKey,
    table: CalibrationTable,
    path: std::path::PathBuf,
    /// The frames calibration held out, beside the table, with their f32 scores.
    held_out: Option<HeldOut>,
}

/// The accuracy guard of an int8 or FP8 build: `runtime`'s scores on the held-out frames
/// against their f32 scores, added to the build's report in `file`, and whether they agree
/// on less than `q.key.min_agreement` of the frames.
fn check_quantized(
    runtime: &mut runtime::Runtime,
    file: &mut EngineFile,
    q: &Quantization,
    frame_len: usize,
) -> Result<engine_file::QuantCheck, String> {
    let mut built = file
        .quant_check
        .take()
        .map(|c| c.report)
        .unwrap_or_default();
    for (batch, nodes) in runtime.unquantized() {
        built += &format!(
            "; at batch size {batch}, {} quantized layer(s) run in fp16, faster on this GPU \
             than in 8 bits: {}",
            nodes.len(),
            nodes.join(", ")
        );
    }
    let held_path = HeldOut::beside(&q.path);
    let Some(held) = &q.held_out else {
        return Ok(engine_file::QuantCheck {
            report: format!(
                "{built}; agreement with fp32 not measured: no held-out frames beside the table \
                 ({}, written by trtclassify-engine calibrate)",
                held_path.display()
            ),
            fell_back: false,
        });
    };
    let classes = file.num_classes;
    if (held.frame_len, held.classes) != (frame_len, classes) {
        return Err(format!(
            "{}: held-out frames of {} values and {} scores, where the model takes {frame_len} \
             and scores {classes}: a calibration of another model or input size",
            held_path.display(),
            held.frame_len,
            held.classes
        ));
    }
    let batch = runtime.max_batch();
    let mut agreement = Agreement::default();
    let frames = (held.inputs.chunks(batch * frame_len)).zip(held.scores.chunks(batch * classes));
    for (inputs, want) in frames {
        let got = runtime
            .run(inputs, want.len() / classes)
            .map_err(|e| e.to_string())?;
        agreement.add(want, got, classes);
    }
    let report = format!("{built}; against fp32 on the held-out frames: {agreement}");
    let fell_back = agreement.top1() < q.key.min_agreement;
    Ok(engine_file::QuantCheck {
        report: match fell_back {
            true => format!(
                "{report}, below min-agreement {:.2}: the engine is built in fp16 instead",
                q.key.min_agreement
            ),
            false => report,
        },
        fell_back,
    })
}

/// The calibration of `options`' quantized precision, read; `None` for fp16 and fp32.
fn quantization(options: &EngineOptions) -> Result<Option<Quantization>, String> {
    let Some(format) = options.precision.quant_format() else {
        return Ok(None);
    };
    let Some(path) = &options.calibration else {
        return Err(format!(
            "precision={format} needs a calibration table (calibration-location): write one with \
             `trtclassify-engine calibrate MODEL.onnx IMAGES-OR-VIDEOS... --table FILE`"
        ));
    };
    let bytes =
        std::fs::read(path).map_err(|e| format!("calibration table {}: {e}", path.display()))?;
    let table = CalibrationTable::load(path).map_err(|e| e.to_string())?;
    let held_path = HeldOut::beside(path);
    let (held_out, held_out_sha256) = match std::fs::read(&held_path) {
        Ok(held) => {
            let shown = held_path.display().to_string();
            let parsed = HeldOut::parse(&held, &shown).map_err(|e| e.to_string())?;
            (Some(parsed), Some(engine_file::sha256_hex(&held)))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, None),
        Err(e) => return Err(format!("{}: {e}", held_path.display())),
    };
    if !(0.0..=1.0).contains(&options.min_agreement) {
        return Err(format!(
            "min-agreement {}: a share of frames, from 0 to 1",
            options.min_agreement
        ));
    }
    Ok(Some(Quantization {
        key: engine_file::QuantKey {
            format,
            table_sha256: engine_file::sha256_hex(&bytes),
            held_out_sha256,
            min_agreement: options.min_agreement,
            strict: options.strict_precision,
        },
        table,
        path: path.clone(),
        held_out,
    }))
}

/// Compiles `model` for `key`'s batch sizes in `dtype`, the nodes named in `kept` (and those
/// reading their values) in f32 where `dtype` is fp16, and quantizes its products and
/// convolutions as `quant` says.
#[allow(clippy::too_many_arguments)]
fn build_engine(
    model: &OnnxModel,
    gpu: &runtime::Gpu,
    key: Key,
    dtype: DType,
    spec: crate::preprocess::InputSpec,
    kept: &[String],
    quant: Option<&Quantization>,
    progress: &mut dyn FnMut(&str),
) -> Result<EngineFile, String> {
    let (mut plans, mut weights) =
        compile_mixed(model, &key.batch_sizes, spec, dtype, kept).map_err(|e| e.to_string())?;
    progress(&format!(
        "imported a graph of {} steps for batch sizes {:?}",
        plans[0].steps.len(),
        key.batch_sizes
    ));
    let mut quant_check = None;
    if let Some(q) = quant {
        let mut done = Vec::new();
        for plan in &mut plans {
            done.push(quant::quantize(
                plan,
                &mut weights,
                &q.table,
                q.key.format,
                &[],
            ));
        }
        let report = quantized_note(&done[0], q);
        progress(&report);
        quant_check = Some(engine_file::QuantCheck {
            report,
            fell_back: false,
        });
    }
    let kernels = runtime::compile(dtype, gpu.arch).map_err(|e| e.to_string())?;
    let kept_f32 = match plans.iter().any(|p| p.wide_len > 0) {
        true => Some(engine_file::KeptF32 {
            because: Vec::new(),
            nodes: plans[0].wide_nodes(),
            kernels: (runtime::compile(DType::F32, gpu.arch).map_err(|e| e.to_string())?).cubin,
            weights: weights.wide.clone(),
        }),
        false => None,
    };
    Ok(EngineFile {
        num_classes: plans[0].output_len / plans[0].batch,
        kernels: kernels.cubin,
        weights: (0..weights.data.len())
            .map(|i| runtime::to_bytes(&weights.data[i], weights.dtype(i, dtype)))
            .collect(),
        plans,
        key,
        fp32_because: None,
        kept_f32,
        quant_check,
    })
}

/// What the build quantized, and which layers stay fp16 and why: for the log.
fn quantized_note(done: &quant::Quantized, q: &Quantization) -> String {
    let kept: Vec<String> = (done.kept.iter())
        .map(|(node, why)| format!("{node} ({why})"))
        .collect();
    format!(
        "precision={}: {} product(s) and convolution(s) quantized with {}; {}",
        q.key.format,
        done.nodes.len(),
        q.path.display(),
        match kept.is_empty() {
            true => "none that could be stays in fp16".to_owned(),
            false => format!("in fp16: {}", kept.join(", ")),
        }
    )
}

fn inference(e: Error) -> EngineError {
    EngineError::Inference(e.to_string())
}

/// The most batches that run while the next gathers, at `batch-size`: `runtime::IN_FLIGHT`,
/// or `TRTCLASSIFY_BATCHES_IN_FLIGHT` below it; 0 waits for each batch in the push that
/// fills it (for comparisons). Batches of one frame are waited for: an element that does not
/// batch hands each frame on once its push returns (it has no thread to be woken by).
fn in_flight(batch_size: usize) -> usize {
    static IN_FLIGHT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let n = *IN_FLIGHT.get_or_init(|| {
        std::env::var("TRTCLASSIFY_BATCHES_IN_FLIGHT")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(runtime::IN_FLIGHT, |n: usize| n.min(runtime::IN_FLIGHT))
    });
    if batch_size > 1 { n } else { 0 }
}

/// A frame's planes and the preprocessing parameters of each crop of it.
type CroppedFrame<'a> = (Vec<frames::Pre>, Vec<&'a [u8]>);

impl CudaEngine {
    /// The frame's planes and the preprocessing parameters of each of `crops` when the GPU
    /// can preprocess it; `None` sends it through the CPU preprocessing.
    fn gpu_frame<'a>(
        &self,
        frame: &FrameView<'a>,
        crops: &[Crop],
    ) -> Result<Option<CroppedFrame<'a>>, EngineError> {
        let Some(pre) = &self.frame_pre else {
            return Ok(None);
        };
        let lens: Vec<usize> = frame.planes.iter().map(|p| p.len()).collect();
        Ok(crops
            .iter()
            .map(|&crop| pre.params(&frame.format, &frame.strides, &lens, crop))
            .collect::<Option<Vec<_>>>()
            .map(|params| (params, frame.planes.clone())))
    }

    /// The model input the GPU makes of each of `crops` of each of `frames` (frame by frame,
    /// all in one preprocessing launch), or `None` where the CPU would make it; for tests
    /// that compare the two.
    pub fn gpu_preprocess(
        &mut self,
        frames: &[FrameView],
        crops: &[Crop],
    ) -> Result<Option<Vec<f32>>, EngineError> {
        let mut raw = Vec::with_capacity(frames.len() * crops.len());
        for frame in frames {
            match self.gpu_frame(frame, crops)? {
                Some((pres, planes)) => raw.extend(pres.into_iter().map(|p| (p, planes.clone()))),
                None => return Ok(None),
            }
        }
        self.runtime
            .preprocess_frames(&raw)
            .map(Some)
            .map_err(inference)
    }

    /// Forgets every item pushed after the first `n` (a push refused part-way): the scores of
    /// model batches that ran inside the push (waited for, where in flight), and the staged
    /// input of the next (its staging is written again from there).
    /// A failure waiting for a batch in flight loses every item pushed: its error.
    fn keep_first(&mut self, n: usize) -> Result<(), EngineError> {
        let launched = |e: &Self| e.launched.iter().map(|l| l.0).sum::<usize>();
        let within_launched = n > self.ran.len() && n < self.ran.len() + launched(self);
        if within_launched {
            self.collect_all()?;
        }
        let ran = self.ran.len();
        if ran >= n {
            self.ran.truncate(n);
            self.forget_launched();
            self.pushed = 0;
        } else {
            self.pushed = n - ran - launched(self);
        }
        Ok(())
    }

    /// Launches the frames pushed into the runtime's input as a model batch, which runs while
    /// the next gathers; where `in_flight` batches run, waits for the oldest first (with none
    /// in flight, for this one).
    fn launch_pushed(&mut self) -> Result<(), EngineError> {
        if self.pushed == 0 {
            return Ok(());
        }
        if self.launched.len() >= self.in_flight.max(1) {
            self.collect(true)?;
        }
        let n = std::mem::take(&mut self.pushed);
        if let Err(e) = self.runtime.launch_staged(n) {
            return self.lose_all(inference(e));
        }
        self.launched.push_back((n, Instant::now()));
        if self.in_flight == 0 {
            self.collect(true)?;
        }
        Ok(())
    }

    /// Moves the scores of the oldest launched batch into `ran`: waits for them where `wait`;
    /// `false` where none was ready. A failure loses every pushed item.
    fn collect(&mut self, wait: bool) -> Result<bool, EngineError> {
        let Some(&(n, launched_at)) = self.launched.front() else {
            return Ok(false);
        };
        let classes = self.info.num_classes;
        let scores = match self.runtime.collect(wait) {
            Ok(None) => return Ok(false),
            Ok(Some(out)) => out.chunks(classes).map(<[f32]>::to_vec).collect::<Vec<_>>(),
            Err(e) => return self.lose_all(inference(e)).map(|()| false),
        };
        self.launched.pop_front();
        self.finished += 1;
        self.took = self.took.max(launched_at.elapsed());
        // Its input is still in the input buffer only while nothing was staged after it.
        if self.launched.is_empty() && self.pushed == 0 {
            self.look_for_non_finite(&scores, n);
        }
        self.ran.keep(Ok(scores))?;
        Ok(true)
    }

    /// Collects every launched batch, waiting for each.
    fn collect_all(&mut self) -> Result<(), EngineError> {
        while self.collect(true)? {}
        Ok(())
    }

    /// Forgets the batches in flight; they still run, unwanted.
    fn forget_launched(&mut self) {
        self.launched.clear();
        self.runtime.forget_in_flight();
    }

    /// Forgets every pushed item after a failure that lost some of them, and returns it.
    fn lose_all(&mut self, e: EngineError) -> Result<(), EngineError> {
        self.discard();
        Err(e)
    }

    /// The first time `scores` (of a run of `n` frames, whose input is still in the input
    /// buffer) hold NaN or infinity, runs those frames again step by step to find the node
    /// where the values went, and keeps that in the model info for the element's warning.
    fn look_for_non_finite(&mut self, scores: &[Vec<f32>], n: usize) {
        let seen = scores.iter().flatten().any(|v| !v.is_finite());
        if !seen || self.info.non_finite.get().is_some() {
            return;
        }
        let found = match self.runtime.first_overflow(n, f32::MAX) {
            Ok(Some(overflow)) => format!("the first such values came from {overflow}"),
            Ok(None) => "run again step by step, the frames gave finite values".into(),
            Err(e) => format!("looking for the step that made them failed: {e}"),
        };
        log::warn!(target: crate::LOG_TARGET, "scores that are not finite: {found}");
        let _ = self.info.non_finite.set(found);
    }
}

impl Engine for CudaEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn infer(&mut self, input: &[f32], n: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let (frame_len, batch) = (self.info.input.frame_len(), self.info.model_batch);
        let classes = self.info.num_classes;
        super::infer_in_calls(input, n, frame_len, batch, |chunk, frames| {
            let out = self.runtime.run(chunk, frames).map_err(inference)?;
            let scores: Vec<Vec<f32>> = out.chunks(classes).map(<[f32]>::to_vec).collect();
            self.look_for_non_finite(&scores, frames);
            Ok(scores)
        })
    }

    fn push(&mut self, frame: &FrameView, crops: &[Crop]) -> Result<(), EngineError> {
        let gpu = self.gpu_frame(frame, crops)?;
        let (frame_len, batch) = (self.info.input.frame_len(), self.info.model_batch);
        let before = self.pending();
        let mut done = 0;
        while done < crops.len() {
            // As many crops as the model batch has room for; a full batch runs at once.
            let now = (crops.len() - done).min(batch - self.pushed);
            let staged = match &gpu {
                Some((pres, planes)) => {
                    self.runtime
                        .stage_frame(self.pushed, &pres[done..done + now], planes)
                }
                None => {
                    self.input.resize(now * frame_len, 0.0);
                    if let Err(e) =
                        self.preprocessor
                            .run(frame, &crops[done..done + now], &mut self.input)
                    {
                        self.keep_first(before)?;
                        return Err(e.into());
                    }
                    self.input
                        .chunks_exact(frame_len)
                        .enumerate()
                        .try_for_each(|(i, input)| self.runtime.stage_input(self.pushed + i, input))
                }
            };
            if let Err(e) = staged {
                self.keep_first(before)?;
                return Err(inference(e));
            }
            self.pushed += now;
            done += now;
            if self.pushed == batch {
                self.launch_pushed()?;
            }
        }
        Ok(())
    }

    fn push_device(
        &mut self,
        frame: &super::DevicePlanes,
        crops: &[Crop],
    ) -> Result<(), EngineError> {
        let unreadable = || {
            EngineError::Inference(format!(
                "the GPU preprocessing cannot read {:?} frames",
                frame.format.format
            ))
        };
        let pre = self.frame_pre.as_ref().ok_or_else(unreadable)?;
        // Plane offsets from the first plane's address: the planes of a CUDA buffer lie in
        // one allocation, in any order.
        let base = frame.ptrs.iter().copied().min().ok_or_else(unreadable)?;
        let offsets: Vec<i64> = frame.ptrs.iter().map(|p| (p - base) as i64).collect();
        let mut params = Vec::with_capacity(crops.len());
        for &crop in crops {
            if crop
                .within(frame.format.width, frame.format.height)
                .is_none()
            {
                return Err(EngineError::Inference(format!(
                    "{crop:?} lies outside the {}x{} frame",
                    frame.format.width, frame.format.height
                )));
            }
            params.push(
                pre.params_at(&frame.format, &offsets, &frame.strides, crop)
                    .ok_or_else(unreadable)?,
            );
        }
        if frame.context != self.runtime.context_handle() && !self.foreign_frames {
            self.foreign_frames = true;
            log::info!(target: crate::LOG_TARGET, "frames in CUDA memory of another CUDA context (a decoder that made its own, \
                 or one of another GPU): each is copied into the engine's context first \
                 (with gpu-id=-1, the engine follows the frames' GPU)"
            );
        }
        let before = self.pending();
        for params in &params {
            if let Err(e) =
                self.runtime
                    .stage_device_frame(self.pushed, params, base, frame.context)
            {
                self.keep_first(before)?;
                return Err(inference(e));
            }
            self.pushed += 1;
            if self.pushed == self.info.model_batch {
                self.launch_pushed()?;
            }
        }
        Ok(())
    }

    fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        let last = self.launch_pushed().and_then(|()| self.collect_all());
        (self.finished, self.took) = (0, Duration::ZERO);
        self.ran.take(last)
    }

    fn take_ready(&mut self) -> Result<super::Ready, EngineError> {
        while self.collect(false)? {}
        Ok(super::Ready {
            scores: self.ran.take(Ok(()))?,
            batches: std::mem::take(&mut self.finished),
            took: std::mem::take(&mut self.took),
        })
    }

    fn on_batch_done(&mut self, signal: runtime::DoneSignal) -> bool {
        // A runtime that cannot wait for its batches (a failed context) fails its next
        // launch as well; until then its scores are collected at each push.
        self.in_flight > 0 && self.runtime.set_done_signal(signal).is_ok()
    }

    fn discard(&mut self) {
        self.pushed = 0;
        self.forget_launched();
        // The runtime reuses the staging from the start of the next batch.
        self.ran.clear();
        (self.finished, self.took) = (0, Duration::ZERO);
    }

    fn pending(&self) -> usize {
        self.ran.len() + self.launched.iter().map(|l| l.0).sum::<usize>() + self.pushed
    }
}

/// Reads `path`, and checks that this backend runs every operator of it.
fn load_model(path: &std::path::Path) -> Result<OnnxModel, EngineError> {
    let model = OnnxModel::load(path)?;
    let unsupported = import::unsupported_ops(&model);
    if !unsupported.is_empty() {
        return Err(EngineError::UnsupportedOps {
            path: model.path.clone(),
            backend: "cuda",
            ops: unsupported,
        });
    }
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The quantized precisions say what they need, and a table that cannot be read is named
    /// with its line: before any GPU is looked for, so these hold on machines without one.
    #[test]
    fn quantized_precisions_name_their_missing_or_broken_table() {
        let mut options = EngineOptions::new("model.onnx");
        assert!(quantization(&options).expect("fp16").is_none());
        options.precision = Precision::Int8;
        let missing = quantization(&options).err().expect("no table");
        assert!(
            missing.contains("precision=int8 needs a calibration table")
                && missing.contains("trtclassify-engine calibrate"),
            "{missing}"
        );
        let dir = tempfile::tempdir().expect("temp dir");
        let absent = dir.path().join("absent.txt");
        options.calibration = Some(absent.clone());
        let e = quantization(&options).err().expect("an absent table");
        assert!(e.contains(&absent.display().to_string()), "{e}");
        let broken = dir.path().join("broken.txt");
        std::fs::write(
            &broken,
            "trtclassify-calibration 1\nframes 3\nconv1\tnot a number\n",
        )
        .expect("written");
        options.calibration = Some(broken.clone());
        let e = quantization(&options).err().expect("a broken table");
        assert!(
            e.contains(&broken.display().to_string()) && e.contains("line 3"),
            "{e}"
        );
        let table = crate::compiler::testing::models().join("digits/digits_calibration.txt");
        options.precision = Precision::Fp8;
        options.calibration = Some(table);
        let q = quantization(&options)
            .expect("the digits table")
            .expect("quantized");
        assert_eq!(q.key.format, QuantFormat::Fp8);
        assert_eq!(q.key.table_sha256.len(), 64);
        assert!(q.table.get("conv2").is_some());
        // No held-out frames beside the committed table: the guard will say it did not run.
        assert_eq!((q.held_out, q.key.held_out_sha256), (None, None));
        options.min_agreement = 1.5;
        let e = quantization(&options).err().expect("an agreement past 1");
        assert!(e.contains("min-agreement 1.5"), "{e}");
        // Held-out frames beside a table are read; damaged ones are named.
        let copy = dir.path().join("digits.txt");
        std::fs::copy(options.calibration.as_ref().unwrap(), &copy).expect("copied");
        let mut held = HeldOut::new(4, 2);
        held.push(&[0.0, 1.0, 2.0, 3.0], &[0.25, 0.75]);
        held.save(&HeldOut::beside(&copy)).expect("written");
        options.calibration = Some(copy.clone());
        options.min_agreement = 0.9;
        let q = quantization(&options).expect("read").expect("quantized");
        assert_eq!(q.held_out.as_ref().map(HeldOut::frames), Some(1));
        assert_eq!(q.key.min_agreement, 0.9);
        std::fs::write(HeldOut::beside(&copy), b"TRTCHELD").expect("written");
        let e = quantization(&options)
            .err()
            .expect("damaged held-out frames");
        assert!(e.contains("digits.txt.heldout"), "{e}");
    }
}
