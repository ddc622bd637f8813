// SPDX-License-Identifier: MPL-2.0
//! The embedded CPU backend, pure Rust, nothing to install: the model compiler's plan (the
//! one the CUDA engine runs too, here in fp32), run by our own kernels (`plan_runner`), for
//! every model the compiler takes; tract (`tract`) for the others.

mod tract;

use std::panic::{AssertUnwindSafe, catch_unwind};

use super::{Backend, Dim, Engine, EngineError, EngineOptions, ModelInfo, OnnxModel, Precision};
use crate::preprocess::{Crop, InputSpec, Layout, Preprocessor};
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
    /// The frames as the runner takes them: the plan's, channels-last where the model's
    /// input is channels-first (its convolutions' layout, which the preprocessing writes as
    /// cheaply as the model's); tract's, as the model's.
    runner_input: InputSpec,
    preprocessor: Preprocessor,
    /// Room for the preprocessed frames of a model batch, the first `pushed` of them pushed
    /// and not yet run; the preprocessing writes every value of a frame, so that the room
    /// is kept, not cleared, from one batch to the next.
    input: Vec<f32>,
    pushed: usize,
    /// Frames given to `infer` in the model's layout, in the runner's.
    relaid: Vec<f32>,
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
        let channels_last = match input.layout {
            Layout::Nchw => InputSpec {
                layout: Layout::Nhwc,
                ..input
            },
            Layout::Nhwc => input,
        };
        let (runner, model_batch, runner_input) = match plan_runner(
            model,
            channels_last,
            fixed,
            frames,
            threads,
        ) {
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
                (Runner::Plan(plan), model_batch, channels_last)
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
                (Runner::Tract(tract), model_batch, input)
            }
        };
        let num_classes = runner.num_classes();

        let preprocessor =
            Preprocessor::new(options.preprocess.clone(), runner_input).map_err(fail)?;
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
            runner_input,
            preprocessor,
            input: Vec::new(),
            pushed: 0,
            relaid: Vec::new(),
            ran: Default::default(),
        })
    }

    /// The scores of the `n` frames of `input` (at most one model batch, in the runner's
    /// layout), one vector each.
    fn score_frames(
        runner: &Runner,
        num_classes: usize,
        input: &[f32],
        n: usize,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let scores = runner.run(input, n)?;
        Ok(scores.chunks(num_classes).map(<[f32]>::to_vec).collect())
    }
}

impl CpuEngine {
    /// Each step's time over one frame (given in the model's layout), where the plan runs
    /// the model; for benchmarks.
    pub fn profile(&mut self, input: &[f32]) -> Option<Vec<(String, std::time::Duration)>> {
        let frame_len = self.info.input.frame_len();
        let Runner::Plan(plan) = &self.runner else {
            return None;
        };
        if input.len() != plan.batch() * frame_len {
            return None;
        }
        let input = relay(self.info.input, self.runner_input, input, &mut self.relaid);
        Some(plan.profile(input))
    }

    /// `infer` for frames laid out as the runner takes them (channels-last for the plan of
    /// a channels-first model), as pushed frames are run; for benchmarks of the engine's
    /// time without the relaying of `infer`'s frames.
    pub fn infer_in_runner_layout(
        &mut self,
        input: &[f32],
        n: usize,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let (frame_len, batch) = (self.info.input.frame_len(), self.info.model_batch);
        let (runner, classes) = (&self.runner, self.info.num_classes);
        super::infer_in_calls(input, n, frame_len, batch, |chunk, frames| {
            Self::score_frames(runner, classes, chunk, frames)
        })
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
        let mut relaid = std::mem::take(&mut self.relaid);
        let frames = relay(self.info.input, self.runner_input, input, &mut relaid);
        let scores = self.infer_in_runner_layout(frames, n);
        self.relaid = relaid;
        scores
    }

    fn push(&mut self, frame: &crate::frame::FrameView, crops: &[Crop]) -> Result<(), EngineError> {
        let (frame_len, batch) = (self.info.input.frame_len(), self.info.model_batch);
        let before = self.pending();
        let mut crops = crops;
        while !crops.is_empty() {
            // As many crops as the model batch has room for; a full batch runs at once.
            let n = self.pushed;
            let (now, rest) = crops.split_at(crops.len().min(batch - n));
            // Grown as frames come (a fixed batch may be large), never zeroed again.
            let end = (n + now.len()) * frame_len;
            if self.input.len() < end {
                self.input.resize(end, 0.0);
            }
            let room = &mut self.input[n * frame_len..end];
            if let Err(e) = self.preprocessor.run(frame, now, room) {
                self.keep_first(before);
                return Err(e.into());
            }
            self.pushed += now.len();
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
        self.pushed = 0;
        self.ran.clear();
    }

    fn pending(&self) -> usize {
        self.ran.len() + self.pushed
    }
}

impl CpuEngine {
    /// Forgets every item pushed after the first `n` (a push refused part-way): the scores of
    /// a model batch that ran inside the push, and the input waiting for the next.
    fn keep_first(&mut self, n: usize) {
        let ran = self.ran.len();
        if ran >= n {
            self.ran.truncate(n);
            self.pushed = 0;
        } else {
            self.pushed = n - ran;
        }
    }

    /// Runs the pushed frames waiting in `input` (at most one model batch) into `ran`.
    fn score_pushed_frames(&mut self) -> Result<(), EngineError> {
        let n = std::mem::take(&mut self.pushed);
        if n == 0 {
            return Ok(());
        }
        let input = &self.input[..n * self.info.input.frame_len()];
        let scores = Self::score_frames(&self.runner, self.info.num_classes, input, n);
        self.ran.keep(scores)
    }
}

/// Frames of `input`, laid out as the model's input `from`, as the runner takes them (`to`):
/// `input` itself where the layouts are the same, else (an NCHW model's plan, which takes
/// them channels-last, the one way they differ) relaid into `relaid`.
fn relay<'a>(
    from: InputSpec,
    to: InputSpec,
    input: &'a [f32],
    relaid: &'a mut Vec<f32>,
) -> &'a [f32] {
    if from.layout == to.layout {
        return input;
    }
    debug_assert_eq!((from.layout, to.layout), (Layout::Nchw, Layout::Nhwc));
    let (c, plane) = (from.channels, from.height * from.width);
    relaid.resize(input.len(), 0.0);
    for (planes, pixels) in input
        .chunks_exact(c * plane)
        .zip(relaid.chunks_exact_mut(c * plane))
    {
        for (p, pixel) in pixels.chunks_exact_mut(c).enumerate() {
            for (ch, v) in pixel.iter_mut().enumerate() {
                *v = planes[ch * plane + p];
            }
        }
    }
    relaid
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
