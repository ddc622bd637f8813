// SPDX-License-Identifier: MPL-2.0
//! `backend=cuda`: our own fp16 engine on NVIDIA GPUs.
//!
//! The compiler turns the ONNX model into a plan of GPU steps per batch size, on the CPU;
//! the CUDA runtime (`trtclassify-cuda`) tunes and runs them, preprocesses frames on the GPU
//! and keeps the engine files. This module puts the engine seam around them: frames pushed
//! in batches, the CPU preprocessing where the GPU cannot read a frame, the engine file
//! looked up or built.

pub use trtclassify_cuda::{
    Error, engine_file, fp16_range, gpu_count, runtime, unavailable_reason,
};
use trtclassify_cuda::{cache, digests, frames};

use std::time::Instant;

use super::{Backend, Engine, EngineError, EngineOptions, ModelInfo, OnnxModel, Precision};
use crate::compiler::plan::DType;
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
    /// Frames pushed into the runtime's input and not yet run.
    pushed: usize,
    /// Scores of the pushed frames that have run.
    ran: super::Ran,
    /// Whether frames from another CUDA context were seen (and said so once).
    foreign_frames: bool,
}

impl CudaEngine {
    /// Fails with `Unavailable` before reading the model where the CUDA libraries are missing,
    /// so that `backend=auto` costs nothing on machines without a GPU.
    pub fn build(options: &EngineOptions) -> Result<Self, EngineError> {
        if let Some(reason) = unavailable_reason() {
            return Err(EngineError::Unavailable {
                backend: "cuda",
                reason,
            });
        }
        let model = OnnxModel::load(&options.model)?;
        Self::from_model(&model, options)
    }

    /// Builds the engine of an already loaded `model`, from its engine file where one fits.
    pub(crate) fn from_model(
        model: &OnnxModel,
        options: &EngineOptions,
    ) -> Result<Self, EngineError> {
        let fail = |reason: String| EngineError::Build {
            path: model.path.clone(),
            reason,
        };
        let unsupported = import::unsupported_ops(model);
        if !unsupported.is_empty() {
            return Err(EngineError::UnsupportedOps {
                path: model.path.clone(),
                backend: "cuda",
                ops: unsupported,
            });
        }
        let spec = model.input_spec(options.input_size).map_err(fail)?;
        let gpu = runtime::open_gpu(options.gpu_id).map_err(|e| EngineError::Unavailable {
            backend: "cuda",
            reason: e.to_string(),
        })?;
        let dtype = match options.precision {
            Precision::Fp16 => DType::F16,
            Precision::Fp32 => DType::F32,
        };
        let started = Instant::now();
        let versions = runtime::library_versions();
        let key = Key {
            format: engine_file::FORMAT_VERSION,
            plugin_version: env!("CARGO_PKG_VERSION").into(),
            kernels_sha256: engine_file::sha256_hex(runtime::source()),
            onnx_sha256: digests::model_digest(&model.path, &model.external_files())
                .map_err(|e| fail(e.to_string()))?,
            gpu: gpu.name.clone(),
            compute_capability: gpu.arch,
            cuda_driver: versions.driver,
            cudnn: versions.cudnn,
            cublaslt: versions.cublaslt,
            precision: dtype,
            batch_sizes: batch_sizes(options.batch_size, model.input.batch.fixed()),
            input: (spec.height, spec.width),
        };
        let (path, place) = match &options.engine_location {
            Some(path) => (path.clone(), cache::Place::Elsewhere),
            None => (
                cache::dir().join(key.file_name(&model.path)),
                cache::Place::Cache,
            ),
        };
        let mut progress = |msg: &str| {
            log::info!(target: crate::LOG_TARGET, "{}: {msg} ({:.1?})",
                model.path.display(),
                started.elapsed()
            );
            options.progress.report(msg);
        };

        // Plans without tuned algorithms are tuned here; a loaded file's are used as they are.
        let open = |file: &mut EngineFile, progress: &mut dyn FnMut(&str)| {
            let plans = std::mem::take(&mut file.plans);
            let wide = file.kept_f32.as_ref().map(|k| runtime::Wide {
                ptx: &k.ptx,
                weights: &k.weights,
            });
            runtime::Runtime::new(
                &gpu,
                &file.ptx,
                file.dtype(),
                &file.weights,
                plans,
                wide,
                progress,
            )
            .map_err(|e| fail(e.to_string()))
        };
        let build = |progress: &mut dyn FnMut(&str)| {
            let mut file =
                build_engine(model, &gpu, key.clone(), dtype, spec, &[], progress).map_err(fail)?;
            let mut runtime = open(&mut file, progress)?;
            if dtype == DType::F16 {
                // Where the sample frames pass fp16's range, the nodes that do (and those
                // reading their values) are built again in f32, the rest staying fp16, until
                // the samples fit; a few rounds at most, then the whole engine in fp32.
                let samples = fp16_range::sample_frames(spec, &options.preprocess).map_err(fail)?;
                let mut found: Vec<String> = Vec::new();
                let mut kept: Vec<String> = Vec::new();
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
                        file =
                            build_engine(model, &gpu, key.clone(), DType::F32, spec, &[], progress)
                                .map_err(fail)?;
                        file.fp32_because = Some(because);
                        runtime = open(&mut file, progress)?;
                        break;
                    }
                    progress(&format!("{because}: building that node in f32"));
                    found.push(because);
                    kept.push(overflow.node);
                    file = build_engine(model, &gpu, key.clone(), dtype, spec, &kept, progress)
                        .map_err(fail)?;
                    if let Some(k) = &mut file.kept_f32 {
                        k.because = found.clone();
                    }
                    runtime = open(&mut file, progress)?;
                }
                if let Some(k) = file
                    .kept_f32
                    .as_ref()
                    .filter(|_| file.fp32_because.is_none())
                {
                    log::warn!(target: crate::LOG_TARGET, "{}: {}", model.path.display(), mixed_note(k));
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
            None => open(&mut file, &mut progress)?,
        };
        let num_classes = file.num_classes;
        log::info!(target: crate::LOG_TARGET, "{}: cuda engine ready in {:.1?} on {} (sm_{}{}, {versions}), {:?}",
            model.path.display(),
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
            outputs_probabilities: model.outputs_probabilities(),
            backend: Backend::Cuda,
            precision: match file.dtype() {
                DType::F16 => Precision::Fp16,
                DType::F32 => Precision::Fp32,
            },
            precision_note: match (&file.fp32_because, &file.kept_f32) {
                (Some(because), _) => Some(format!(
                    "precision=fp16: {because}; the engine runs in fp32"
                )),
                (None, Some(kept)) => Some(mixed_note(kept)),
                (None, None) => None,
            },
            reads_device_frames: frame_pre.is_some(),
            batches_in_flight: 1,
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
            ran: Default::default(),
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

/// Compiles `model` for `key`'s batch sizes in `dtype`, the nodes named in `kept` (and those
/// reading their values) in f32 where `dtype` is fp16.
fn build_engine(
    model: &OnnxModel,
    gpu: &runtime::Gpu,
    key: Key,
    dtype: DType,
    spec: crate::preprocess::InputSpec,
    kept: &[String],
    progress: &mut dyn FnMut(&str),
) -> Result<EngineFile, String> {
    let (plans, weights) =
        compile_mixed(model, &key.batch_sizes, spec, dtype, kept).map_err(|e| e.to_string())?;
    progress(&format!(
        "imported a graph of {} steps for batch sizes {:?}",
        plans[0].steps.len(),
        key.batch_sizes
    ));
    let ptx = runtime::compile(dtype, gpu.arch).map_err(|e| e.to_string())?;
    let kept_f32 = match plans.iter().any(|p| p.wide_len > 0) {
        true => Some(engine_file::KeptF32 {
            because: Vec::new(),
            nodes: plans[0].wide_nodes(),
            ptx: runtime::compile(DType::F32, gpu.arch).map_err(|e| e.to_string())?,
            weights: weights.wide.clone(),
        }),
        false => None,
    };
    Ok(EngineFile {
        num_classes: plans[0].output_len / plans[0].batch,
        ptx,
        weights: (0..weights.data.len())
            .map(|i| runtime::to_bytes(&weights.data[i], weights.dtype(i, dtype)))
            .collect(),
        plans,
        key,
        fp32_because: None,
        kept_f32,
    })
}

fn inference(e: Error) -> EngineError {
    EngineError::Inference(e.to_string())
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

    /// The model input the GPU makes of `crop` of each of `frames`, or `None` where the CPU
    /// would make it; for tests that compare the two.
    pub fn gpu_preprocess(
        &mut self,
        frames: &[FrameView],
        crop: Crop,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        let mut raw = Vec::with_capacity(frames.len());
        for frame in frames {
            match self.gpu_frame(frame, &[crop])? {
                Some((mut pre, planes)) => raw.push((pre.remove(0), planes)),
                None => return Ok(None),
            }
        }
        self.runtime
            .preprocess_frames(&raw)
            .map(Some)
            .map_err(inference)
    }

    /// Forgets every item pushed after the first `n` (a push refused part-way): the scores of
    /// a model batch that ran inside the push, and the staged input of the next (its staging
    /// is written again from there).
    fn keep_first(&mut self, n: usize) {
        let ran = self.ran.len();
        if ran >= n {
            self.ran.truncate(n);
            self.pushed = 0;
        } else {
            self.pushed = n - ran;
        }
    }

    /// Runs the frames pushed into the runtime's input into `ran`.
    fn score_pushed_frames(&mut self) -> Result<(), EngineError> {
        let n = std::mem::take(&mut self.pushed);
        if n == 0 {
            return Ok(());
        }
        let classes = self.info.num_classes;
        let scores = self
            .runtime
            .run_staged(n)
            .map(|out| out.chunks(classes).map(<[f32]>::to_vec).collect::<Vec<_>>())
            .map_err(inference);
        if let Ok(scores) = &scores {
            self.look_for_non_finite(scores, n);
        }
        self.ran.keep(scores)
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
                        self.keep_first(before);
                        return Err(e.into());
                    }
                    self.input
                        .chunks_exact(frame_len)
                        .enumerate()
                        .try_for_each(|(i, input)| self.runtime.stage_input(self.pushed + i, input))
                }
            };
            if let Err(e) = staged {
                self.keep_first(before);
                return Err(inference(e));
            }
            self.pushed += now;
            done += now;
            if self.pushed == batch {
                self.score_pushed_frames()?;
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
                self.keep_first(before);
                return Err(inference(e));
            }
            self.pushed += 1;
            if self.pushed == self.info.model_batch {
                self.score_pushed_frames()?;
            }
        }
        Ok(())
    }

    fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        let last = self.score_pushed_frames();
        self.ran.take(last)
    }

    fn discard(&mut self) {
        self.pushed = 0;
        // The runtime reuses the staging from the start of the next batch.
        self.ran.clear();
    }

    fn pending(&self) -> usize {
        self.ran.len() + self.pushed
    }
}
