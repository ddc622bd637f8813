// SPDX-License-Identifier: MPL-2.0
//! The CPU backend's fast path: the plan the CUDA engine is built from (imported, with batch
//! norm folded and activations and residual adds fused into the convolutions, NHWC), lowered
//! in f32 and run step by step by `kernels`.
//!
//! The plan is for one frame (or the batch a model fixes); the frames of a call run one after
//! the other on the calling thread, or in shares over it and the team's helpers (the shared
//! pool's threads where another run holds the team), each with its own activation arena; a
//! single frame spreads its products over them instead. Where a
//! thread has several frames, their last steps may run on all of them at once
//! (`batched_tail`).

use std::sync::{Arc, LazyLock, Mutex};

use rayon::prelude::*;

use super::batched_tail::Tail;
use super::kernels::{self, Buffers, Packed, Team, Threads};
use trtclassify_compiler::OnnxModel;
use trtclassify_compiler::plan::{DType, GemmStep, Loc, Plan, Step};
use trtclassify_compiler::spec::InputSpec;
use trtclassify_compiler::{self as compiler, CompileError, check::check_plan};

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

/// A compiled model ready to run: its plan, packed weights and the threads it may use.
pub struct PlanRunner {
    plan: Plan,
    weights: Vec<Arc<Vec<f32>>>,
    packed: Vec<Packed>,
    /// The last steps, for the frames of one thread's share of a call at once.
    tail: Option<Box<Batched>>,
    threads: usize,
    /// Whether the kernels may use AVX-512 (where the CPU has it).
    avx512: bool,
    /// Arenas and unfolding buffers kept between calls, one per thread that ran frames.
    scratch: Mutex<Vec<Scratch>>,
    frame_len: usize,
    num_classes: usize,
}

/// A tail and its packed weights (shared with the one-frame plan's).
struct Batched {
    tail: Tail,
    packed: Vec<Packed>,
}

#[derive(Default)]
struct Scratch {
    arena: kernels::Aligned,
    tail_arena: kernels::Aligned,
    kernels: kernels::Scratch,
}

impl PlanRunner {
    /// Imports and lowers `model` for `batch` frames per plan; fails where the importer does
    /// not take the model (an operator it lacks), for the caller to fall back on tract.
    /// Calls of `frames` frames spread over the threads leave each thread several where
    /// `frames` is above `threads`: the plan's last steps are then lowered for that many too
    /// (`batched_tail`).
    pub fn new(
        model: &OnnxModel,
        spec: InputSpec,
        batch: usize,
        frames: usize,
        threads: usize,
    ) -> Result<Self, CompileError> {
        let per_thread = frames.div_ceil(threads.clamp(1, cores()));
        // `TRTCLASSIFY_CPU_BATCHED_TAIL=0` runs every step frame by frame (to compare).
        let allowed = std::env::var("TRTCLASSIFY_CPU_BATCHED_TAIL").map_or(true, |v| v != "0");
        let both = match allowed && batch == 1 && per_thread > 1 {
            // The batch plan is a gain, not a need: the one-frame plan alone where the
            // importer takes that one only.
            true => compiler::compile_for_cpu(model, &[1, per_thread], spec).ok(),
            false => None,
        };
        let (plan, together, weights) = match both {
            Some((mut plans, weights)) => {
                let together = plans.pop();
                (
                    plans.pop().expect("a plan per batch size"),
                    together,
                    weights,
                )
            }
            None => {
                let (mut plans, weights) = compiler::compile_for_cpu(model, &[batch], spec)?;
                (plans.pop().expect("a plan per batch size"), None, weights)
            }
        };
        Self::from_plans(
            plan,
            together,
            weights.data,
            spec.frame_len(),
            threads,
            None,
        )
    }

    /// Runs `plan` (f32) for frames of `frame_len` values, once it is checked: every span
    /// of every step inside its buffer, since the kernels trust them.
    #[cfg(test)]
    pub fn from_plan(
        plan: Plan,
        weights: Vec<Arc<Vec<f32>>>,
        frame_len: usize,
        threads: usize,
    ) -> Result<Self, CompileError> {
        Self::from_plans(plan, None, weights, frame_len, threads, None)
    }

    /// `from_plan`, with the tail of `together` (the same model's plan for several frames,
    /// checked too) where it has one; `tail_at`, for tests, cuts it there (`Tail::find`).
    pub fn from_plans(
        mut plan: Plan,
        together: Option<Plan>,
        weights: Vec<Arc<Vec<f32>>>,
        frame_len: usize,
        threads: usize,
        tail_at: Option<usize>,
    ) -> Result<Self, CompileError> {
        let num_classes = plan.output_len / plan.batch.max(1);
        let weight = |i: usize| weights.get(i).map(|w| (w.len(), DType::F32));
        check_plan(&mut plan, &weight, DType::F32, frame_len, num_classes)?;
        refuse_quantized(&plan)?;
        let mut packed: Vec<Packed> = plan
            .steps
            .iter()
            .map(|s| kernels::pack(s, &weights))
            .collect();
        kernels::fuse_activations(&plan.steps, &mut packed);
        kernels::fuse_scales(&plan.steps, &mut packed);
        let joined = kernels::write_into_concats(&plan.steps, &mut packed);
        // The tail is a gain, not a need: a batch plan that fails its checks goes unused.
        let tail = together.and_then(|mut together| {
            check_plan(&mut together, &weight, DType::F32, frame_len, num_classes).ok()?;
            let fused = |i: usize| {
                joined[i] || matches!(packed[i], Packed::Skip | Packed::ScaledInput { .. })
            };
            let mut tail = Tail::find(&plan, &together, fused, tail_at)?;
            check_plan(&mut tail.plan, &weight, DType::F32, frame_len, num_classes).ok()?;
            let packed = tail_packing(&plan, &packed, &tail, &weights);
            Some(Box::new(Batched { tail, packed }))
        });
        // The steps read packed weights from their copy: a constant no step reads any more
        // is let go, so that packing does not double the model's memory.
        let mut read = vec![false; weights.len()];
        let tail_steps = tail
            .iter()
            .flat_map(|b| b.tail.plan.steps.iter().zip(&b.packed));
        for (step, packed) in plan.steps.iter().zip(&packed).chain(tail_steps) {
            let copied = kernels::packed_weight(step, packed);
            for loc in step.locs() {
                if let Loc::Weight { index, .. } = loc
                    && Some(loc) != copied
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
            tail,
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

    /// The steps that run on several frames at once, and on how many, where some do.
    pub fn batched_tail(&self) -> Option<(usize, usize)> {
        let plan = &self.tail.as_ref()?.tail.plan;
        Some((plan.steps.len(), plan.batch))
    }

    /// Scores per frame.
    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    /// Steps in the plan.
    pub fn steps(&self) -> usize {
        self.plan.steps.len()
    }

    /// The convolutions that scale their input themselves (`kernels::fuse_scales`).
    #[cfg(test)]
    pub fn scaled_inputs(&self) -> usize {
        let scaled = |p: &&Packed| matches!(p, Packed::ScaledInput { .. });
        self.packed.iter().filter(scaled).count()
    }

    /// The products and convolutions that write into a concatenation themselves
    /// (`kernels::write_into_concats`).
    #[cfg(test)]
    pub fn concat_inputs_in_place(&self) -> usize {
        let into = |p: &&Packed| matches!(p, Packed::Into(..));
        self.packed.iter().filter(into).count()
    }

    /// The convolutions computed by Winograd's F(2×2, 3×3) (`kernels::winograd`).
    #[cfg(test)]
    pub fn winograd_convolutions(&self) -> usize {
        let winograd = |p: &Packed| match p {
            Packed::Into(inner, _) => matches!(**inner, Packed::Winograd(_)),
            p => matches!(p, Packed::Winograd(_)),
        };
        self.packed.iter().filter(|p| winograd(p)).count()
    }

    /// The scores of the `n` frames of `input`, one after the other.
    pub fn run(&self, input: &[f32], n: usize) -> Vec<f32> {
        let batch = self.plan.batch;
        let calls = n.div_ceil(batch);
        let mut scores = vec![0.0; calls * batch * self.num_classes];
        if calls == 0 {
            return scores;
        }
        if self.threads > 1 && calls == 1 {
            // One call: its steps spread over the threads.
            let mut scratch = self.take_scratch();
            let threads = self.on(self.threads);
            let out = &mut scores[..];
            self.on_team(self.threads, || {
                self.run_plan(input, out, &mut scratch, threads, None)
            });
            self.keep_scratch(scratch);
        } else {
            // Each thread runs its share of the calls, single-threaded: this one and the
            // team's helpers (the pool's threads where another run holds the team). On the
            // pool alone, this thread waited while both pool threads woke for each batch:
            // the element on two threads at batch 8 spent 0.2–0.3 ms a frame more than
            // back-to-back calls in the small models.
            let per = calls.div_ceil(self.threads.min(calls));
            // In locks, for `&mut` access from a job's `Fn + Sync` items: each is taken once.
            let shares: Vec<Mutex<(&[f32], &mut [f32])>> = input
                .chunks(per * batch * self.frame_len)
                .zip(scores.chunks_mut(per * batch * self.num_classes))
                .map(Mutex::new)
                .collect();
            let run_share = |i: usize| {
                let mut share = shares[i].lock().unwrap_or_else(|e| e.into_inner());
                let (input, out) = &mut *share;
                let mut scratch = self.take_scratch();
                self.run_share(input, out, &mut scratch);
                self.keep_scratch(scratch);
            };
            // As many threads as shares (fewer than the runner's where the calls are few),
            // so that no helper is woken to wait through the batch without one.
            match shares.len() {
                1 => run_share(0),
                count => self.on_team(count, || {
                    if Team::for_each(count, &run_share).is_none() {
                        (0..count).into_par_iter().for_each(run_share);
                    }
                }),
            }
        }
        scores.truncate(n * self.num_classes);
        scores
    }

    /// The frames of `input` on this thread: together through the tail where they are as
    /// many as it takes, else a plan batch at a time.
    fn run_share(&self, input: &[f32], out: &mut [f32], scratch: &mut Scratch) {
        match self.tail.as_deref() {
            Some(Batched { tail, packed }) if input.len() == tail.plan.batch * self.frame_len => {
                self.run_with_tail(tail, packed, input, out, scratch)
            }
            _ => {
                let calls = input
                    .chunks(self.plan.batch * self.frame_len)
                    .zip(out.chunks_mut(self.plan.batch * self.num_classes));
                for (input, out) in calls {
                    self.run_plan(input, out, scratch, self.on(1), None);
                }
            }
        }
    }

    /// Each frame of `input` through the steps before the tail, its values that the tail
    /// reads copied to the tail's arena; then the tail on all of them.
    fn run_with_tail(
        &self,
        tail: &Tail,
        packed: &[Packed],
        input: &[f32],
        out: &mut [f32],
        scratch: &mut Scratch,
    ) {
        let first = tail.first;
        scratch.arena.resize(self.plan.arena_len);
        scratch.tail_arena.resize(tail.plan.arena_len);
        for (frame, carries) in input.chunks(self.frame_len).zip(&tail.carries) {
            let buffers = Buffers {
                arena: scratch.arena.as_mut_slice().as_mut_ptr(),
                input: frame.as_ptr(),
                // Not touched: `Tail::find` leaves the scores to the tail.
                output: out.as_mut_ptr(),
                weights: &self.weights,
            };
            let steps = self.plan.steps[..first].iter().zip(&self.packed[..first]);
            self.run_steps(steps, &buffers, &mut scratch.kernels, None);
            let (from, to) = (scratch.arena.as_slice(), scratch.tail_arena.as_mut_slice());
            for c in carries {
                to[c.to..c.to + c.len].copy_from_slice(&from[c.from..c.from + c.len]);
            }
        }
        let buffers = Buffers {
            arena: scratch.tail_arena.as_mut_slice().as_mut_ptr(),
            input: input.as_ptr(),
            output: out.as_mut_ptr(),
            weights: &self.weights,
        };
        let steps = tail.plan.steps.iter().zip(packed);
        self.run_steps(steps, &buffers, &mut scratch.kernels, None);
    }

    /// The time of each step over one run of `input` (one plan batch), on the runner's
    /// threads: a profile, for benchmarks.
    pub fn profile(&self, input: &[f32]) -> Vec<(String, std::time::Duration)> {
        let mut scratch = self.take_scratch();
        let mut out = vec![0.0; self.plan.output_len];
        let mut times = Vec::new();
        let threads = self.on(self.threads);
        self.on_team(self.threads, || {
            self.run_plan(input, &mut out, &mut scratch, threads, Some(&mut times))
        });
        self.keep_scratch(scratch);
        times
    }

    /// Runs `f`, whose steps spread over `threads` threads: on this thread with the team's
    /// helpers, or on the shared pool where another run holds the team. On this
    /// thread rather than a pool thread woken for each frame: on the shared 2-core VM,
    /// EfficientNet-B0 on both cores at batch 1 took 8.7–10.1 ms a frame against 10.4–12.3
    /// in the same minutes.
    fn on_team(&self, threads: usize, f: impl FnOnce() + Send) {
        if let Err(f) = Team::run(threads, f) {
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
        times: Option<&mut Vec<(String, std::time::Duration)>>,
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
        let steps = self.plan.steps.iter().zip(&self.packed);
        self.run_steps_on(steps, &buffers, &mut scratch.kernels, threads, times);
    }

    /// `steps` on this thread alone.
    fn run_steps<'a>(
        &self,
        steps: impl Iterator<Item = (&'a Step, &'a Packed)>,
        buffers: &Buffers,
        scratch: &mut kernels::Scratch,
        times: Option<&mut Vec<(String, std::time::Duration)>>,
    ) {
        self.run_steps_on(steps, buffers, scratch, self.on(1), times)
    }

    fn run_steps_on<'a>(
        &self,
        steps: impl Iterator<Item = (&'a Step, &'a Packed)>,
        buffers: &Buffers,
        scratch: &mut kernels::Scratch,
        threads: Threads,
        mut times: Option<&mut Vec<(String, std::time::Duration)>>,
    ) {
        for (step, packed) in steps {
            let started = times.is_some().then(std::time::Instant::now);
            kernels::run(step, packed, buffers, scratch, threads);
            if let (Some(times), Some(started)) = (times.as_deref_mut(), started) {
                times.push((step.describe(), started.elapsed()));
            }
        }
    }
}

/// The CPU's kernels compute in f32: a plan of int8 or FP8 steps (made for a GPU) is
/// refused rather than run unrounded, which would give other results than it stands for.
fn refuse_quantized(plan: &Plan) -> Result<(), CompileError> {
    match plan.steps.iter().any(|s| s.quant().is_some()) {
        true => Err(CompileError::Plan {
            batch: plan.batch,
            problem: "int8 or FP8 steps, which the CPU backend does not run".into(),
        }),
        false => Ok(()),
    }
}

/// The tail's packed weights: the one-frame plan's for the same step where it packed the
/// same weights (shared, not copied), and the fusions decided again among the tail's steps.
fn tail_packing(
    plan: &Plan,
    packed: &[Packed],
    tail: &Tail,
    weights: &[Arc<Vec<f32>>],
) -> Vec<Packed> {
    let steps = &plan.steps[tail.first..];
    let mut tail_packed: Vec<Packed> = tail
        .plan
        .steps
        .iter()
        .zip(steps.iter().zip(&packed[tail.first..]))
        .map(
            |(step, (same, packed))| match weight_of(step) == weight_of(same) {
                true => packed.shared(),
                false => kernels::pack(step, weights),
            },
        )
        .collect();
    kernels::fuse_activations(&tail.plan.steps, &mut tail_packed);
    kernels::fuse_scales(&tail.plan.steps, &mut tail_packed);
    // Not `write_into_concats`: the tail's copies run (the late layers seldom concatenate).
    tail_packed
}

/// The weight a step's packing is made from.
fn weight_of(step: &Step) -> Option<Loc> {
    match step {
        Step::Conv(c) => Some(c.weight),
        Step::Gemm(GemmStep { w, .. }) => Some(*w),
        _ => None,
    }
}
