// SPDX-License-Identifier: MPL-2.0
//! The embedded CPU backend, pure Rust, nothing to install: the model compiler's plan (the
//! one the CUDA engine runs too, here in fp32), run by our own kernels (`plan_runner`), for
//! every model the compiler takes; tract (`tract`) for the others.

mod tract;

use std::panic::{AssertUnwindSafe, catch_unwind};

use super::{Backend, Dim, Engine, EngineError, EngineOptions, ModelInfo, OnnxModel, Precision};
use crate::preprocess::{Crop, Preprocessor};
use tract::TractRunner;
use trtclassify_cpu::PlanRunner;
pub use trtclassify_cpu::cores;

/// A fixed batch above this is taken for a broken model rather than allocated.
const MAX_MODEL_BATCH: usize = 256;

/// What runs the model.
enum Runner {
    Plan(PlanRunner),
    Tract(TractRunner),
}

impl Runner {
    fn run(&self, input: &[f32], n: usize) -> Result<Vec<f32>, EngineError> {
        match self {
            Runner::Plan(plan) => Ok(plan.run(input, n)),
            Runner::Tract(tract) => tract.run(input, n),
        }
    }

    fn num_classes(&self) -> usize {
        match self {
            Runner::Plan(plan) => plan.num_classes(),
            Runner::Tract(tract) => tract.num_classes(),
        }
    }
}

/// The CPU backend: the compiler's plan run by our kernels on the shared thread pool, or
/// tract for a model the compiler does not take.
pub struct CpuEngine {
    info: ModelInfo,
    runner: Runner,
    preprocessor: Preprocessor,
    /// The frames pushed and not yet run, preprocessed; reused.
    input: Vec<f32>,
    /// Scores of the pushed frames that have run.
    ran: super::Ran,
}

impl CpuEngine {
    /// Loads `options.model` and builds the engine for it.
    pub fn build(options: &EngineOptions) -> Result<Self, EngineError> {
        let model = OnnxModel::load(&options.model)?;
        Self::from_model(&model, options)
    }

    /// Builds the engine for a model already loaded and checked.
    pub fn from_model(model: &OnnxModel, options: &EngineOptions) -> Result<Self, EngineError> {
        let fail = |reason: String| EngineError::Build {
            path: model.path.clone(),
            reason,
        };
        if options.precision != Precision::Fp32 {
            log::info!(target: crate::LOG_TARGET, "the cpu backend runs fp32 (precision={} applies to GPU backends)",
                format!("{:?}", options.precision).to_lowercase()
            );
        }
        let input = model.input_spec(options.input_size).map_err(fail)?;
        let fixed = match model.input.batch {
            Dim::Fixed(n) if n > MAX_MODEL_BATCH => {
                return Err(fail(format!(
                    "the model fixes its batch at {n}; at most {MAX_MODEL_BATCH} is supported"
                )));
            }
            Dim::Fixed(n) => Some(n),
            Dim::Dynamic(_) => None,
        };
        let threads = match options.threads {
            0 => cores(),
            n => n.min(cores()),
        };
        let frames = options.batch_size.max(1);
        let (runner, model_batch) = match plan_runner(model, input, fixed, frames, threads) {
            Ok(plan) => {
                // Frames run one per plan run; as many at once as there are threads, so a
                // full model batch keeps them all busy, and a single thread runs each frame
                // as it comes. Where each thread's share of the batch runs its last steps
                // together, the whole batch runs in one call.
                let model_batch = match plan.batched_tail() {
                    Some(_) => frames,
                    None => fixed.unwrap_or(frames.min(threads)),
                };
                log::info!(target: crate::LOG_TARGET, "{}: cpu engine: {} steps of {} frame(s), {threads} thread(s){}",
                    model.path.display(),
                    plan.steps(),
                    plan.batch(),
                    plan.batched_tail()
                        .map_or(String::new(), |(steps, frames)| format!(
                            ", the last {steps} steps on {frames} frames of a thread at once"
                        ))
                );
                (Runner::Plan(plan), model_batch)
            }
            Err(reason) => {
                log::info!(target: crate::LOG_TARGET, "{}: the cpu engine runs it with tract, on one thread: {reason}",
                    model.path.display()
                );
                // tract runs one thread per call; measured on MobileNetV2
                // (docs/benchmarks.md), a batch of 8 in one call costs twice the time per
                // frame of 8 single-frame calls (the activations leave the cache). So frames
                // run one per call unless the model fixes a larger batch.
                let model_batch = fixed.unwrap_or(1);
                let tract = TractRunner::new(model, input, model_batch)?;
                (Runner::Tract(tract), model_batch)
            }
        };
        let num_classes = runner.num_classes();

        let preprocessor = Preprocessor::new(options.preprocess.clone(), input).map_err(fail)?;
        let info = ModelInfo {
            input,
            num_classes,
            model_batch,
            outputs_probabilities: model.outputs_probabilities(),
            backend: Backend::Cpu,
            precision: Precision::Fp32,
            precision_note: None,
            quant_report: None,
            reads_device_frames: false,
            batches_in_flight: 1,
            non_finite: Default::default(),
            engine_file: None,
        };
        log::info!(target: crate::LOG_TARGET, "{}: cpu engine ready: input {:?} {}x{}x{}, {} classes, {} frame(s) per call",
            model.path.display(),
            input.layout,
            input.channels,
            input.height,
            input.width,
            num_classes,
            model_batch
        );
        Ok(CpuEngine {
            info,
            runner,
            preprocessor,
            input: Vec::new(),
            ran: Default::default(),
        })
    }

    /// The scores of the `n` frames of `input` (at most one model batch), one vector each.
    fn score_frames(&self, input: &[f32], n: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let scores = self.runner.run(input, n)?;
        Ok(scores
            .chunks(self.info.num_classes)
            .map(<[f32]>::to_vec)
            .collect())
    }
}

impl CpuEngine {
    /// Each step's time over one frame, where the plan runs the model; for benchmarks.
    pub fn profile(&self, input: &[f32]) -> Option<Vec<(String, std::time::Duration)>> {
        match &self.runner {
            Runner::Plan(plan) if input.len() == plan.batch() * self.info.input.frame_len() => {
                Some(plan.profile(input))
            }
            _ => None,
        }
    }

    /// How many of the plan's last steps run on several frames of a thread at once, and on
    /// how many frames (`batched_tail`); `None` where all run frame by frame.
    pub fn batched_tail(&self) -> Option<(usize, usize)> {
        match &self.runner {
            Runner::Plan(plan) => plan.batched_tail(),
            Runner::Tract(_) => None,
        }
    }
}

impl Engine for CpuEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn infer(&mut self, input: &[f32], n: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let (frame_len, batch) = (self.info.input.frame_len(), self.info.model_batch);
        super::infer_in_calls(input, n, frame_len, batch, |chunk, frames| {
            self.score_frames(chunk, frames)
        })
    }

    fn push(&mut self, frame: &crate::frame::FrameView, crops: &[Crop]) -> Result<(), EngineError> {
        let (frame_len, batch) = (self.info.input.frame_len(), self.info.model_batch);
        let before = self.pending();
        let mut crops = crops;
        while !crops.is_empty() {
            // As many crops as the model batch has room for; a full batch runs at once.
            let n = self.input.len() / frame_len;
            let (now, rest) = crops.split_at(crops.len().min(batch - n));
            self.input.resize((n + now.len()) * frame_len, 0.0);
            if let Err(e) = self
                .preprocessor
                .run(frame, now, &mut self.input[n * frame_len..])
            {
                self.keep_first(before);
                return Err(e.into());
            }
            if n + now.len() == batch {
                self.score_pushed_frames()?;
            }
            crops = rest;
        }
        Ok(())
    }

    fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        let last = self.score_pushed_frames();
        self.ran.take(last)
    }

    fn discard(&mut self) {
        self.input.clear();
        self.ran.clear();
    }

    fn pending(&self) -> usize {
        self.ran.len() + self.input.len() / self.info.input.frame_len()
    }
}

impl CpuEngine {
    /// Forgets every item pushed after the first `n` (a push refused part-way): the scores of
    /// a model batch that ran inside the push, and the input waiting for the next.
    fn keep_first(&mut self, n: usize) {
        let ran = self.ran.len();
        if ran >= n {
            self.ran.truncate(n);
            self.input.clear();
        } else {
            self.input.truncate((n - ran) * self.info.input.frame_len());
        }
    }

    /// Runs the pushed frames waiting in `input` (at most one model batch) into `ran`.
    fn score_pushed_frames(&mut self) -> Result<(), EngineError> {
        let n = self.input.len() / self.info.input.frame_len();
        if n == 0 {
            return Ok(());
        }
        let scores = self.score_frames(&self.input, n);
        self.input.clear();
        self.ran.keep(scores)
    }
}

/// The fast path for `model`, or why it does not take it. A panic in the importer (a bug) is
/// a reason like another, for tract to run the model instead; `TRTCLASSIFY_CPU=tract` in
/// the environment sends every model to tract (to compare, or to work around a fault).
fn plan_runner(
    model: &OnnxModel,
    input: crate::preprocess::InputSpec,
    fixed: Option<usize>,
    frames: usize,
    threads: usize,
) -> Result<PlanRunner, String> {
    if std::env::var_os("TRTCLASSIFY_CPU").is_some_and(|v| v == "tract") {
        return Err("TRTCLASSIFY_CPU=tract is set".into());
    }
    let unsupported = crate::compiler::import::unsupported_ops(model);
    if !unsupported.is_empty() {
        return Err(format!("no kernels for {}", unsupported.join(", ")));
    }
    catch_unwind(AssertUnwindSafe(|| {
        // A model that fixes its batch runs it whole: its shapes may hold it.
        let frames = if fixed.is_some() { 1 } else { frames };
        PlanRunner::new(model, input, fixed.unwrap_or(1), frames, threads)
            .map_err(|e| e.to_string())
    }))
    .unwrap_or_else(|panic| {
        Err(format!(
            "internal error in the plan importer: {}",
            super::panic_message(&*panic)
        ))
    })
}
