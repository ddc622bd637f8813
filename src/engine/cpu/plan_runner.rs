// SPDX-License-Identifier: MPL-2.0
//! The CPU backend's fast path: the plan the CUDA engine is built from (imported, with batch
//! norm folded and activations and residual adds fused into the convolutions, NHWC), lowered
//! in f32 and run step by step by `kernels`.
//!
//! The plan is for one frame (or the batch a model fixes); the frames of a call run one after
//! the other on the calling thread, or spread over the threads of the shared pool, each with
//! its own activation arena; a single frame spreads its products over them instead.

use std::sync::{Arc, LazyLock, Mutex};

use rayon::prelude::*;

use super::kernels::{self, Buffers, Packed, Team, Threads};
use crate::engine::OnnxModel;
use crate::engine::compiler::plan::{DType, Loc, Plan};
use crate::engine::compiler::{self, CompileError, check::check_plan};
use crate::preprocess::InputSpec;

/// One pool of worker threads, as many as the machine has cores, for every CPU engine of the
/// process: elements that each ask for several threads share the cores instead of
/// oversubscribing them.
static POOL: LazyLock<rayon::ThreadPool> = LazyLock::new(|| {
    rayon::ThreadPoolBuilder::new()
        .num_threads(cores())
        .thread_name(|i| format!("trtclassify-cpu-{i}"))
        .build()
        .expect("a thread pool")
});

/// The cores this process may use.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

pub struct PlanRunner {
    plan: Plan,
    weights: Vec<Arc<Vec<f32>>>,
    packed: Vec<Packed>,
    threads: usize,
    /// Whether the kernels may use AVX-512 (where the CPU has it).
    avx512: bool,
    /// Arenas and unfolding buffers kept between calls, one per thread that ran frames.
    scratch: Mutex<Vec<Scratch>>,
    frame_len: usize,
    num_classes: usize,
}

#[derive(Default)]
struct Scratch {
    arena: kernels::Aligned,
    kernels: kernels::Scratch,
}

impl PlanRunner {
    /// Imports and lowers `model` for `batch` frames per plan; fails where the importer does
    /// not take the model (an operator it lacks), for the caller to fall back on tract.
    pub fn new(
        model: &OnnxModel,
        spec: InputSpec,
        batch: usize,
        threads: usize,
    ) -> Result<Self, CompileError> {
        let (mut plans, weights) = compiler::compile_for_cpu(model, &[batch], spec)?;
        let plan = plans.pop().expect("one plan per batch size");
        Self::from_plan(plan, weights.data, spec.frame_len(), threads)
    }

    /// Runs `plan` (f32) for frames of `frame_len` values, once it is checked: every span
    /// of every step inside its buffer, since the kernels trust them.
    pub fn from_plan(
        mut plan: Plan,
        weights: Vec<Arc<Vec<f32>>>,
        frame_len: usize,
        threads: usize,
    ) -> Result<Self, CompileError> {
        let num_classes = plan.output_len / plan.batch.max(1);
        let weight = |i: usize| weights.get(i).map(|w| (w.len(), DType::F32));
        check_plan(&mut plan, &weight, DType::F32, frame_len, num_classes)?;
        let mut packed: Vec<Packed> = plan
            .steps
            .iter()
            .map(|s| kernels::pack(s, &weights))
            .collect();
        kernels::fuse_activations(&plan.steps, &mut packed);
        kernels::fuse_scales(&plan.steps, &mut packed);
        // The steps read packed weights from their copy: a constant no step reads any more
        // is let go, so that packing does not double the model's memory.
        let mut read = vec![false; weights.len()];
        for (step, packed) in plan.steps.iter_mut().zip(&packed) {
            let copied = kernels::packed_weight(step, packed);
            for loc in step.locs_mut() {
                if let Loc::Weight { index, .. } = *loc
                    && Some(*loc) != copied
                {
                    read[index] = true;
                }
            }
        }
        let weights = weights
            .into_iter()
            .zip(read)
            .map(|(w, read)| if read { w } else { Arc::new(Vec::new()) })
            .collect();
        Ok(PlanRunner {
            weights,
            packed,
            threads: threads.clamp(1, cores()),
            avx512: true,
            scratch: Mutex::new(Vec::new()),
            frame_len,
            num_classes,
            plan,
        })
    }

    /// Frames per plan run.
    pub fn batch(&self) -> usize {
        self.plan.batch
    }

    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    pub fn steps(&self) -> usize {
        self.plan.steps.len()
    }

    /// The convolutions that scale their input themselves (`kernels::fuse_scales`).
    #[cfg(test)]
    pub fn scaled_inputs(&self) -> usize {
        let scaled = |p: &&Packed| matches!(p, Packed::ScaledInput { .. });
        self.packed.iter().filter(scaled).count()
    }

    /// The convolutions computed by Winograd's F(2×2, 3×3) (`kernels::winograd`).
    #[cfg(test)]
    pub fn winograd_convolutions(&self) -> usize {
        let winograd = |p: &&Packed| matches!(p, Packed::Winograd(_));
        self.packed.iter().filter(winograd).count()
    }

    /// The scores of the `n` frames of `input`, one after the other.
    pub fn run(&self, input: &[f32], n: usize) -> Vec<f32> {
        let batch = self.plan.batch;
        let calls = n.div_ceil(batch);
        let mut scores = vec![0.0; calls * batch * self.num_classes];
        let chunk = batch * self.frame_len;
        let jobs: Vec<(&[f32], &mut [f32])> = input
            .chunks(chunk)
            .zip(scores.chunks_mut(batch * self.num_classes))
            .collect();
        let workers = self.threads.min(jobs.len());
        if self.threads == 1 {
            let mut scratch = self.take_scratch();
            for (input, out) in jobs {
                self.run_plan(input, out, &mut scratch, self.on(1), None);
            }
            self.keep_scratch(scratch);
        } else if workers == 1 {
            // One call: its steps spread over the threads.
            let (input, out) = jobs.into_iter().next().expect("one call");
            let mut scratch = self.take_scratch();
            let threads = self.on(self.threads);
            self.on_team(|| self.run_plan(input, out, &mut scratch, threads, None));
            self.keep_scratch(scratch);
        } else {
            // Several calls: each worker runs its share one by one, single-threaded.
            let per = jobs.len().div_ceil(workers);
            let mut shares: Vec<Vec<(&[f32], &mut [f32])>> = Vec::new();
            let mut jobs = jobs.into_iter().peekable();
            while jobs.peek().is_some() {
                shares.push(jobs.by_ref().take(per).collect());
            }
            POOL.install(|| {
                shares.into_par_iter().for_each(|share| {
                    let mut scratch = self.take_scratch();
                    for (input, out) in share {
                        self.run_plan(input, out, &mut scratch, self.on(1), None);
                    }
                    self.keep_scratch(scratch);
                })
            });
        }
        scores.truncate(n * self.num_classes);
        scores
    }

    /// The time of each step over one run of `input` (one plan batch), on the runner's
    /// threads: a profile, for benchmarks.
    pub fn profile(&self, input: &[f32]) -> Vec<(String, std::time::Duration)> {
        let mut scratch = self.take_scratch();
        let mut out = vec![0.0; self.plan.output_len];
        let mut times = Vec::new();
        let threads = self.on(self.threads);
        self.on_team(|| self.run_plan(input, &mut out, &mut scratch, threads, Some(&mut times)));
        self.keep_scratch(scratch);
        times
    }

    /// Runs `f`, whose steps spread over the runner's threads: on this thread with the
    /// team's helpers, or on the shared pool where another run holds the team. On this
    /// thread rather than a pool thread woken for each frame: on the shared 2-core VM,
    /// EfficientNet-B0 on both cores at batch 1 took 8.7–10.1 ms a frame against 10.4–12.3
    /// in the same minutes.
    fn on_team(&self, f: impl FnOnce() + Send) {
        if let Err(f) = Team::run(self.threads, f) {
            POOL.install(f)
        }
    }

    /// `count` threads, with AVX-512 as the runner allows.
    fn on(&self, count: usize) -> Threads {
        Threads::new(count, self.avx512)
    }

    /// Keeps the kernels to AVX2 (`false`), for the tests to compare both paths on one
    /// machine.
    #[cfg(test)]
    pub fn allow_avx512(&mut self, allow: bool) {
        self.avx512 = allow;
    }

    fn take_scratch(&self) -> Scratch {
        self.scratch.lock().unwrap().pop().unwrap_or_default()
    }

    fn keep_scratch(&self, scratch: Scratch) {
        self.scratch.lock().unwrap().push(scratch);
    }

    /// One run of the plan; a partial batch is padded with zeros. With `times`, each step's
    /// time is kept there.
    fn run_plan(
        &self,
        input: &[f32],
        out: &mut [f32],
        scratch: &mut Scratch,
        threads: Threads,
        mut times: Option<&mut Vec<(String, std::time::Duration)>>,
    ) {
        let padded;
        let input = if input.len() == self.plan.input_len {
            input
        } else {
            let mut full = vec![0.0; self.plan.input_len];
            full[..input.len()].copy_from_slice(input);
            padded = full;
            &padded
        };
        scratch.arena.resize(self.plan.arena_len);
        let buffers = Buffers {
            arena: scratch.arena.as_mut_slice().as_mut_ptr(),
            input: input.as_ptr(),
            output: out.as_mut_ptr(),
            weights: &self.weights,
        };
        for (step, packed) in self.plan.steps.iter().zip(&self.packed) {
            let started = times.is_some().then(std::time::Instant::now);
            kernels::run(step, packed, &buffers, &mut scratch.kernels, threads);
            if let (Some(times), Some(started)) = (times.as_deref_mut(), started) {
                times.push((step.describe(), started.elapsed()));
            }
        }
    }
}
