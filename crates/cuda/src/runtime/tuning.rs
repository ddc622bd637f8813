// SPDX-License-Identifier: MPL-2.0
//! Preparing a plan: each step's library descriptors, and for each convolution not tuned yet
//! the fastest of cuDNN's algorithms, timed on its real shapes as it will run.

use std::ffi::c_void;

use cudarc::cudnn::sys as dnn;
use cudarc::driver::{DevicePtr, sys as drv};

use super::cublaslt::{GemmDescs, GemmShape, ScaledEpilogue};
use super::cudnn::{self, ConvDescs};
use super::steps::EightBit;
use super::{BatchPlan, OwnStep, Prepared, Runtime};
use crate::error::{Error, Result};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{
    ConvStep, EightBitKernel, Loc, Plan, Quant, QuantFormat, Step, StepKind, Tuned,
};

/// How much faster than the plan's type an 8-bit step must time, alone, to run in 8 bits.
/// A step timed alone finds its input in the GPU's cache; in ResNet-50 at batch 64 the
/// engine whose 8 layers had timed faster in FP8 than in fp16 ran slower than the fp16
/// engine (28,000 against 31,200 images/s on an H200), so 8 bits must win clearly. (That was
/// measured when steps were timed by direct launches, not in graphs as now.)
const EIGHT_BIT_MARGIN: f32 = 1.1;

/// The algorithm chosen for each shape of product a plan holds (`GemmDescs::algo_words`).
type Tunings = std::collections::HashMap<String, [u64; 8]>;

/// How each shape of int8 step a plan holds runs (`EightBit::kernel_key`).
type KernelChoices = std::collections::HashMap<String, EightBitKernel>;

/// Runs of a step in the graph that times it: enough that a small step's time is not lost
/// in the replay's own start.
const TIMED_RUNS: usize = 5;

impl Runtime {
    /// The descriptors of every step of `plan`; convolutions and products without an
    /// algorithm are tuned.
    ///
    /// Where `time_eight_bit` (a fresh build), each 8-bit step is timed as it is and in the
    /// plan's type, and runs in 8 bits only where that is faster by `EIGHT_BIT_MARGIN`:
    /// through cuBLASLt an 8-bit step rounds its input in a pass of its own (into patches,
    /// nine times the input for a 3×3 convolution) and, without per-channel scales in
    /// cuBLASLt's epilogue, writes sums that a second pass scales back, which can cost more
    /// than the 8-bit product saves; the engine's own int8 kernel, where it is faster, does
    /// both in one launch, but its products are not cuDNN's. The choice is the plan's (the
    /// step's quantization dropped), so an engine file holds it and its loads do not time
    /// again. The steps moved to the plan's type are listed in `unquantized`. Then the int8
    /// steps of the own kernel pass values to each other in int8 where they can
    /// (`chain_int8`).
    pub(super) fn prepare(&mut self, mut plan: Plan, time_eight_bit: bool) -> Result<BatchPlan> {
        let mut prepared = Vec::with_capacity(plan.steps.len());
        let mut unquantized = Vec::new();
        let mut tuned = Tunings::new();
        let mut kernels = KernelChoices::new();
        for (step, origin) in plan.steps.iter_mut().zip(&plan.origins) {
            let Some(e) = EightBit::of(step) else {
                prepared.push(self.prepare_step(step, &mut tuned)?);
                continue;
            };
            let (quantized, timed) = self.prepare_eight_bit(step, &e, &mut tuned, &mut kernels)?;
            if !time_eight_bit {
                prepared.push(quantized);
                continue;
            }
            let mut plain = step.clone();
            match &mut plain {
                Step::Gemm(g) => g.quant = None,
                Step::Conv(c) => c.quant = None,
                _ => unreachable!("8-bit steps are products and convolutions"),
            }
            let plain_prepared = self.prepare_step(&mut plain, &mut tuned)?;
            let eight_bit_ms = match timed {
                Some(ms) => ms,
                None => self.time(|| self.step(step, &quantized))?,
            };
            let plain_ms = self.time(|| self.step(&plain, &plain_prepared))?;
            if plain_ms < eight_bit_ms * EIGHT_BIT_MARGIN {
                *step = plain;
                prepared.push(plain_prepared);
                unquantized.push(origin.clone());
                continue;
            }
            if let (Step::Conv(c), Step::Conv(tuned)) = (step, &plain) {
                // Tuned: a load of the engine file then neither tunes it nor takes the
                // tuning workspace for it.
                c.algo = tuned.algo;
            }
            prepared.push(quantized);
        }
        if !unquantized.is_empty() {
            self.unquantized.push((plan.batch, unquantized));
        }
        let passed = self.chain_int8(&plan.steps, &mut prepared);
        let own = (prepared.iter())
            .filter(|p| matches!(p, Prepared::OwnEightBit(_)))
            .count();
        if own > 0 {
            log::debug!(target: trtclassify_compiler::LOG_TARGET,
                "batch size {}: {own} int8 steps in the engine's own kernel, {passed} values passed between them in int8 (alone or beside the plan's type)",
                plan.batch);
        }
        self.int8_passes += passed;
        Ok(BatchPlan {
            plan,
            prepared,
            graph: None,
        })
    }

    /// The descriptors of `step` in the plan's type; a convolution or product without an
    /// algorithm is tuned (a product as one of the same shape in `tuned` was, if any).
    fn prepare_step(&mut self, step: &mut Step, tuned: &mut Tunings) -> Result<Prepared> {
        Ok(match step {
            Step::Conv(c) => {
                let descs = ConvDescs::new(c, self.writes(c.y).1)?;
                if c.algo.is_none() {
                    c.algo = Some(self.tune(c, &descs)?);
                }
                Prepared::Conv(Box::new(descs))
            }
            Step::Gemm(g) => {
                let shape = GemmShape {
                    batch: g.batch,
                    rows: g.rows,
                    n: g.n,
                    k: g.k,
                    x_batch: g.x_batch,
                    y_batch: g.y_batch,
                    w_transposed: g.w_transposed,
                    y_f32: matches!(g.y, Loc::Output(_)),
                };
                let dtype = self.writes(g.y).1;
                let bias = g.bias.map(|b| self.ptr(b));
                let workspace = self.lt_workspace.len();
                let key = memo_key(
                    (&shape, dtype),
                    g.act,
                    g.bias.is_some(),
                    g.residual.is_some(),
                );
                let loaded = g.algo.is_some();
                let stored = g.algo.or_else(|| tuned.get(&key).copied());
                let descs = GemmDescs::new(
                    &self.cublaslt,
                    dtype,
                    &shape,
                    bias,
                    g.act,
                    workspace,
                    stored,
                )?;
                let mut prepared = Prepared::Gemm(Box::new(descs));
                let algo = self.product_algo(step, &mut prepared, loaded, key, tuned)?;
                if let Step::Gemm(g) = step {
                    g.algo = Some(algo);
                }
                prepared
            }
            _ => Prepared::None,
        })
    }

    /// How the 8-bit step `e` (`step`) runs, and where its rounded weights are: as the
    /// engine's own kernel where the plan says so (`Quant::kernel`), else as patches and
    /// cuBLASLt's product, FP8 with the scales in cuBLASLt's epilogue where it has them, else
    /// into sums. Its product's algorithm is chosen as a product's in the plan's type is
    /// (`product_algo`) and stored in the step's `Quant`; an int8 step tuned now whose own
    /// kernel fits the GPU is then timed that way and in each of the kernel's ways
    /// (`EightBitKernel::OWN`: blocks of two widths, the input rounded as read or first, and
    /// warps of 64 × 64),
    /// and runs the fastest (as the step of the same shape before it in `chosen`, if any),
    /// whose time is returned.
    fn prepare_eight_bit(
        &self,
        step: &mut Step,
        e: &EightBit,
        tuned: &mut Tunings,
        chosen: &mut KernelChoices,
    ) -> Result<(Prepared, Option<f32>)> {
        let format = e.quant.format;
        let weights = (self.eight_bit_weights.iter())
            .find(|(key, _)| *key == (e.w, format))
            .map(|(_, w)| self.ptr_u8(w))
            .ok_or(Error::Plan("an 8-bit step without its rounded weights"))?;
        let own_fits = e.own_kernel_fits(self.arch);
        let own = |kernel| Prepared::OwnEightBit(OwnStep::new(weights, kernel));
        if let Some(kernel) = e.quant.kernel
            && kernel.is_own()
            && e.own_way_fits(kernel, self.arch, self.shared_optin)
        {
            return Ok((own(kernel), None));
        }
        let shape = [e.rows, e.summed(), e.n];
        let workspace = self.lt_workspace.len();
        let key = memo_key(
            (format, shape),
            e.act,
            e.bias.is_some(),
            e.residual.is_some(),
        );
        let stored = e.quant.algo.or_else(|| tuned.get(&key).copied());
        let scaled = match format {
            QuantFormat::Fp8 => {
                let epilogue = ScaledEpilogue {
                    w_scales: self.ptr(e.quant.w_scales),
                    ones: self.ones.device_ptr(&self.stream).0,
                    bias: e.bias.map(|b| self.ptr(b)),
                    act: e.act,
                    out: self.writes(e.y).1,
                };
                GemmDescs::scaled_fp8(&self.cublaslt, shape, &epilogue, workspace, stored)?
            }
            QuantFormat::Int8 => None,
        };
        let descs = match scaled {
            Some(descs) => descs,
            None => GemmDescs::eight_bit(&self.cublaslt, format, shape, workspace, stored)?,
        };
        let mut prepared = Prepared::EightBit(Box::new(descs), weights);
        let loaded = e.quant.algo.is_some();
        let algo = self.product_algo(step, &mut prepared, loaded, key, tuned)?;
        set_eight_bit_algo(step, algo);
        if e.quant.kernel.is_some() || !own_fits {
            return Ok((prepared, None));
        }
        // A step of a shape timed before (a network's blocks repeat theirs) runs as it did.
        let key = e.kernel_key();
        if let Some(&kernel) = chosen.get(&key) {
            set_kernel(step, kernel);
            return Ok(match kernel {
                EightBitKernel::Library => (prepared, None),
                _ => (own(kernel), None),
            });
        }
        let library_ms = self.time(|| self.step(step, &prepared))?;
        let mut fastest = (library_ms, EightBitKernel::Library);
        let per_run = |ms: f32| ms * 1e3 / TIMED_RUNS as f32;
        let mut times = vec![format!(
            "as patches and cuBLASLt's product {:.1} µs",
            per_run(library_ms)
        )];
        // Blocks no wider than the output channels (a wider one computes zeros), and whose
        // shared memory this GPU has.
        let ways = (EightBitKernel::OWN.iter()).filter(|&&k| {
            k.cols() <= e.n.max(64) && e.own_way_fits(k, self.arch, self.shared_optin)
        });
        for &kernel in ways {
            let how = format!(
                "in the engine's own kernel, {} channels a block, {}",
                kernel.cols(),
                match kernel {
                    EightBitKernel::OwnWide(tile) => format!(
                        "{} rows, warps of 64 × 64, the input rounded first",
                        tile.rows()
                    ),
                    k if k.reads_int8() => "the input rounded first".into(),
                    _ => "rounding as it reads".into(),
                }
            );
            match self.time(|| self.step(step, &own(kernel))) {
                Ok(ms) => {
                    times.push(format!("{how} {:.1} µs", per_run(ms)));
                    if ms < fastest.0 {
                        fastest = (ms, kernel);
                    }
                }
                Err(err) => log::warn!(target: trtclassify_compiler::LOG_TARGET,
                    "{}: {how}: does not run ({err})", step.describe()),
            }
        }
        log::debug!(target: trtclassify_compiler::LOG_TARGET,
            "{}: int8 {}", step.describe(), times.join(", "));
        let (ms, kernel) = fastest;
        chosen.insert(key, kernel);
        set_kernel(step, kernel);
        Ok(match kernel {
            EightBitKernel::Library => (prepared, Some(ms)),
            _ => (own(kernel), Some(ms)),
        })
    }

    /// The algorithm of the product `step`, whose descriptors (`prepared`) were made with its
    /// stored or memoised choice, if any: that choice where cuBLASLt takes it. A loaded
    /// plan's algorithm that cuBLASLt refuses here (logged) is replaced by its heuristic's
    /// first (`loaded`: loads do not time); a build times the candidates where the choice
    /// for its shape is refused, or where there is none yet, and memoises the fastest under
    /// `key`.
    fn product_algo(
        &self,
        step: &Step,
        prepared: &mut Prepared,
        loaded: bool,
        key: String,
        tuned: &mut Tunings,
    ) -> Result<[u64; 8]> {
        let (Prepared::Gemm(d) | Prepared::EightBit(d, _)) = &*prepared else {
            unreachable!("a product's descriptors")
        };
        if loaded || d.runs_stored() {
            return Ok(d.algo_words());
        }
        let candidates = d.candidates();
        let algo = self.tune_gemm(step, prepared, candidates)?;
        tuned.insert(key, algo);
        Ok(algo)
    }

    /// Times cuBLASLt's `candidates` for the product `step` (`prepared` its descriptors, in
    /// the plan's type or in 8 bits) as it will run, and leaves the fastest chosen: returned
    /// as the words the plan stores. A candidate that fails to run is passed over; the error
    /// is returned where none runs.
    fn tune_gemm(
        &self,
        step: &Step,
        prepared: &mut Prepared,
        candidates: usize,
    ) -> Result<[u64; 8]> {
        let choose = |prepared: &mut Prepared, rank: usize| {
            if let Prepared::Gemm(d) | Prepared::EightBit(d, _) = prepared {
                d.choose(rank);
            }
        };
        let mut best: Option<(f32, usize)> = None;
        let mut first_ms = None;
        let mut failed = None;
        for rank in 0..candidates {
            choose(prepared, rank);
            match self.time(|| self.step(step, prepared)) {
                Ok(ms) => {
                    first_ms.get_or_insert(ms);
                    if best.is_none_or(|(fastest, _)| ms < fastest) {
                        best = Some((ms, rank));
                    }
                }
                Err(e) => {
                    log::debug!(target: trtclassify_compiler::LOG_TARGET,
                        "cuBLASLt's algorithm of rank {rank} for {} does not run: {e}", step.describe());
                    failed.get_or_insert(e);
                }
            }
        }
        let (ms, rank) = match (best, failed) {
            (Some(best), _) => best,
            (None, Some(e)) => return Err(e),
            (None, None) => return Err(Error::Plan("a product without candidate algorithms")),
        };
        choose(prepared, rank);
        let (Prepared::Gemm(d) | Prepared::EightBit(d, _)) = prepared else {
            unreachable!("a product's descriptors")
        };
        if rank > 0 {
            log::debug!(target: trtclassify_compiler::LOG_TARGET,
                "{}: cuBLASLt's algorithm of rank {rank} of {candidates}, {:.1} µs against its first's {:.1}",
                step.describe(), ms * 1e3 / TIMED_RUNS as f32,
                first_ms.unwrap_or(ms) * 1e3 / TIMED_RUNS as f32);
        }
        Ok(d.algo_words())
    }

    /// Times cuDNN's algorithms for `c` on its real shapes and keeps the fastest that fits
    /// the workspace. A search that finds none is tried again a few times: with other
    /// engines busy on the GPU, one was seen to come back empty where the next finds
    /// several; the error says what each search found.
    fn tune(&mut self, c: &ConvStep, d: &ConvDescs) -> Result<Tuned> {
        const SEARCHES: u64 = 3;
        let mut found = Vec::new();
        for search in 1..=SEARCHES {
            match self.search(c, d)? {
                Ok(tuned) => return Ok(tuned),
                Err(why) => found.push(format!("search {search}: {why}")),
            }
            std::thread::sleep(std::time::Duration::from_millis(20 * search));
        }
        Err(Error::NoConvAlgorithm(found.join("; ")))
    }

    /// One search for `tune`: the fastest algorithm, or what the search found instead.
    fn search(
        &mut self,
        c: &ConvStep,
        d: &ConvDescs,
    ) -> Result<std::result::Result<Tuned, String>> {
        let mut perf: [dnn::cudnnConvolutionFwdAlgoPerf_t; 8] =
            // SAFETY: a plain C struct for cuDNN to fill.
            unsafe { std::mem::zeroed() };
        let mut returned = 0;
        let ws = self.ptr_u8(&self.workspace);
        // SAFETY: the pointers are live device buffers of the sizes the descriptors state.
        unsafe {
            cudnn::check(
                dnn::cudnnFindConvolutionForwardAlgorithmEx(
                    self.cudnn.raw(),
                    d.x.raw(),
                    self.ptr(c.x) as *const c_void,
                    d.w.raw(),
                    self.ptr(c.weight) as *const c_void,
                    d.conv.raw(),
                    d.y.raw(),
                    self.ptr(c.y) as *mut c_void,
                    perf.len() as i32,
                    &mut returned,
                    perf.as_mut_ptr(),
                    ws as *mut c_void,
                    self.workspace.len(),
                ),
                "algorithm search",
            )?;
        }
        // cuDNN ranks the algorithms by its own timing of the plain convolution; what runs is
        // that convolution followed by our bias + activation kernel, or cuDNN's fused call,
        // whose speed can differ a lot. So the leading candidates are timed as they will run.
        let offered = &perf[..returned as usize];
        let candidates = offered
            .iter()
            .filter(|p| {
                p.status == dnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS
                    && p.memory <= self.workspace.len()
            })
            .take(3)
            .flat_map(|p| {
                [false, true].map(|fused| Tuned {
                    algo: p.algo as i32,
                    math: p.mathType as i32,
                    workspace: p.memory,
                    fused,
                })
            })
            // The fused call applies ReLU or nothing; other activations need our kernel.
            .filter(|t| !t.fused || matches!(c.act, Act::Relu | Act::None))
            // A stem over an image's few channels, which cuDNN runs slowly, may be faster
            // in the engine's own kernel; so may a depthwise convolution, which cuDNN's
            // fused call cannot give the clip or SiLU that MobileNet and EfficientNet have.
            .chain(self.stem_params(c).map(|_| Tuned::own_stem()))
            .chain(self.depthwise_params(c).map(|_| Tuned::own_depthwise()));
        let mut best: Option<(f32, Tuned)> = None;
        let (mut own, mut cudnn_best) = (None::<String>, None::<f32>);
        let mut refused = Vec::new();
        for tuned in candidates {
            // The fused call refuses some algorithms and activations: those are skipped.
            let ms = match self.time_conv(c, d, &tuned) {
                Ok(ms) => ms,
                Err(e) => {
                    if tuned.is_own() {
                        own = Some(format!("does not run ({e})"));
                    }
                    refused.push(format!(
                        "algorithm {} (fused: {}): {e}",
                        tuned.algo, tuned.fused
                    ));
                    continue;
                }
            };
            if best.is_none_or(|(fastest, _)| ms < fastest) {
                best = Some((ms, tuned));
            }
            match tuned.is_own() {
                true => own = Some(format!("{:.1} µs", 1e3 * ms / TIMED_RUNS as f32)),
                false => cudnn_best = Some(cudnn_best.map_or(ms, |b| b.min(ms))),
            }
        }
        if let Some(own) = own {
            let chosen = best.is_some_and(|(_, t)| t.is_own());
            let kernel = match self.stem_params(c) {
                Some(_) => "stem",
                None => "depthwise",
            };
            log::debug!(target: trtclassify_compiler::LOG_TARGET,
                "{}: the engine's own {kernel} kernel {own}{}, cuDNN's fastest {}",
                c.describe(), if chosen { " (chosen)" } else { "" },
                cudnn_best.map_or("none".into(), |ms| format!("{:.1} µs", 1e3 * ms / TIMED_RUNS as f32)));
        }
        Ok(best.map(|(_, tuned)| tuned).ok_or_else(|| {
            let offered: Vec<String> = offered
                .iter()
                .map(|p| format!("{} {:?} {} B", p.algo as i32, p.status, p.memory))
                .collect();
            format!(
                "offered [{}] for a workspace of {} B; timing refused [{}]",
                offered.join(", "),
                self.workspace.len(),
                refused.join(", ")
            )
        }))
    }

    /// GPU milliseconds of `TIMED_RUNS` runs of the convolution `c` as `tuned` says.
    fn time_conv(&self, c: &ConvStep, d: &ConvDescs, tuned: &Tuned) -> Result<f32> {
        self.time(|| self.conv(c, d, tuned))
    }

    /// GPU milliseconds of `TIMED_RUNS` runs of what `enqueue` enqueues, as the engine runs
    /// them: after one run to warm up (which also says whether it runs at all), the runs
    /// are captured as a CUDA graph, and the median of three replays is taken. Launched one
    /// by one instead, a small step times the host's work to issue it: cuDNN's fused call
    /// takes longer to issue than a batch-1 convolution takes to run, which had the tuning
    /// pick a convolution and a bias kernel where the fused call is faster in the graph.
    fn time(&self, enqueue: impl Fn() -> Result<()>) -> Result<f32> {
        let ran = enqueue();
        self.stream
            .synchronize()
            .map_err(Error::driver("synchronize"))?;
        ran?;
        let graph = self.record(|| (0..TIMED_RUNS).try_for_each(|_| enqueue()))?;
        graph.launch().map_err(Error::driver("timed graph"))?;
        let timing = Some(drv::CUevent_flags::CU_EVENT_DEFAULT);
        let mut replays = Vec::with_capacity(3);
        for _ in 0..3 {
            let start = (self.stream.record_event(timing)).map_err(Error::driver("event"))?;
            graph.launch().map_err(Error::driver("timed graph"))?;
            let end = (self.stream.record_event(timing)).map_err(Error::driver("event"))?;
            replays.push(start.elapsed_ms(&end).map_err(Error::driver("event"))?);
        }
        replays.sort_by(f32::total_cmp);
        Ok(replays[1])
    }
}

/// The key under which a plan's products of one shape and epilogue share their tuning
/// (`Tunings`): the blocks of a network repeat them, and each is timed once.
fn memo_key(shape: impl std::fmt::Debug, act: Act, bias: bool, residual: bool) -> String {
    format!("{shape:?} {act:?} bias {bias} residual {residual}")
}

/// Stores `kernel` as how the GPU runs `step`, an int8 step.
fn set_kernel(step: &mut Step, kernel: EightBitKernel) {
    if let Some(q) = quant_of(step) {
        q.kernel = Some(kernel);
    }
}

/// Stores `algo` as the 8-bit product's algorithm of `step`, a quantized step.
fn set_eight_bit_algo(step: &mut Step, algo: [u64; 8]) {
    if let Some(q) = quant_of(step) {
        q.algo = Some(algo);
    }
}

/// The quantization of `step`, where it is quantized.
fn quant_of(step: &mut Step) -> Option<&mut Quant> {
    match step {
        Step::Gemm(g) => g.quant.as_mut(),
        Step::Conv(c) => c.quant.as_mut(),
        _ => None,
    }
}
