// SPDX-License-Identifier: MPL-2.0
//! Runs plans on the GPU: weights uploaded once, one activation arena shared by the plans of
//! every batch size (one runs at a time, on one stream), cuDNN convolutions with the
//! algorithm timed fastest, cuBLASLt matrix products with the bias in the epilogue, NVRTC
//! kernels for the rest, and each plan captured as a CUDA graph so a batch is one launch.
//!
//! This module holds the `Runtime` and its life: made (`Runtime::new`), fed a batch and run
//! (`run`), or launched on staged frames without waiting (`launch_staged`, `collect`): up to
//! `IN_FLIGHT` batches run on the GPU while the host stages the next. Its other parts, one `impl Runtime` each where they need it:
//! - `device`: the libraries and the GPU found, their versions;
//! - `kernels`: the kernels' source (`prelude.cu`, `preprocess.cu`, `steps/*.cu`) compiled by NVRTC and loaded, one set per family (defined beside its launches), and their launch shapes;
//! - `cudnn`, `cublaslt`: owners of the libraries' handles and descriptors;
//! - `tuning`: each step's descriptors, and the convolution algorithms timed;
//! - `steps`: launching one step of a plan; `capture`: a plan as a CUDA graph;
//! - `staging`: frames into the model input (uploaded, copied, preprocessed on the GPU);
//! - `overflow`: a plan run step by step to find where its values leave fp16's range;
//! - `timing`: graph replays, latencies and step profiles, for the bench binary.

mod capture;
mod cublaslt;
mod cudnn;
mod device;
mod kernels;
mod overflow;
mod staging;
mod steps;
mod timing;
mod tuning;
mod warmup;

use std::collections::VecDeque;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaGraph, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice,
    sys as drv,
};

use super::error::{Error, Result};
pub use device::{Gpu, open_gpu};
pub use device::{library_versions, missing_libraries};
use kernels::Kernels;
#[cfg(test)]
pub(crate) use kernels::kernel_families;
pub use kernels::{Compiled, compile, source};
use steps::{EightBit, OwnStep};
use trtclassify_compiler::plan::{
    ConvStep, DType, EightBitKernel, GemmStep, Loc, MAX_WORKSPACE, Plan, QuantFormat, Step,
    scale_weights, weight_type,
};
pub use warmup::{Warmup, warm_libraries};

/// What a step needs prepared before it runs: its library descriptors.
/// The part of a mixed-precision engine kept in f32: its kernels (the kernels compiled for
/// f32) and whether each weight is f32.
pub struct Wide<'a> {
    /// The f32 kernels (`Compiled::cubin`).
    pub cubin: &'a [u8],
    /// Parallel to the weights: true where a weight was uploaded in f32.
    pub weights: &'a [bool],
}

enum Prepared {
    Conv(Box<cudnn::ConvDescs>),
    Gemm(Box<cublaslt::GemmDescs>),
    /// An 8-bit product or convolution: its product's descriptors and the device address of
    /// its rounded weights.
    EightBit(Box<cublaslt::GemmDescs>, u64),
    /// An int8 step run by the engine's own kernel (`Quant::kernel`).
    OwnEightBit(steps::OwnStep),
    None,
}

/// The most batches launched on staged frames and not yet collected: while they run, the
/// host stages the next (a batch's frames are queued behind them on the one stream, so the
/// single input buffer is never written while a graph reads it). Two keep the GPU busy
/// while the host stages a batch faster than the GPU runs one; more only add latency.
pub const IN_FLIGHT: usize = 2;

/// Called from the GPU driver's thread when a launched batch has finished: it must only
/// signal (it may not call CUDA, and the stream waits for it).
pub type DoneSignal = Arc<dyn Fn() + Send + Sync>;

/// `cuLaunchHostFunc`'s callback: calls the runtime's signal.
unsafe extern "C" fn signal_done(data: *mut std::ffi::c_void) {
    // SAFETY: `data` is the runtime's boxed signal, which it frees only once its stream has
    // nothing left to run (`set_done_signal`, `Drop`), or where waiting for the stream
    // failed: an error in the context, behind which the driver calls no host function.
    let signal = unsafe { &*data.cast::<DoneSignal>() };
    // Unwinding out of the driver's thread would abort; a panicking signal only loses its
    // wake-up (the scores are still collected at the next push or run).
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&**signal));
}

/// What of the page-locked staging (frames, inputs preprocessed on the host) may be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HostStaging {
    /// All of it: nothing staged there is still to be read.
    Free,
    /// All of it once `staged_read` completes: the last launched batch's uploads read it.
    AfterLaunch,
    /// What the batch being staged has not written: it is in use.
    InUse,
}

/// A batch launched and not yet collected.
struct Launched {
    /// Its frames, and where its scores land in `host_out`.
    n: usize,
    out: std::ops::Range<usize>,
    /// Recorded after its scores' download.
    done: CudaEvent,
}

/// A plan of one batch size, its steps' descriptors and its captured graph.
struct BatchPlan {
    plan: Plan,
    prepared: Vec<Prepared>,
    graph: Option<CudaGraph>,
}

/// The engine's state on the GPU: buffers, library handles, and a captured plan per batch
/// size.
pub struct Runtime {
    // Fields drop in order: the graphs and descriptors go before the handles they were made
    // with, and the handles before the context's other resources.
    plans: Vec<BatchPlan>,
    cudnn: cudnn::Handle,
    cublaslt: cublaslt::Handle,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    dtype: DType,
    kernels: Kernels,
    /// The f32 kernels of a mixed-precision engine, for the nodes kept in f32.
    wide_kernels: Option<Kernels>,
    arena: CudaSlice<u8>,
    /// The f32 values of the nodes kept in f32 (`Loc::Wide`).
    wide_arena: CudaSlice<u8>,
    weights: Vec<CudaSlice<u8>>,
    /// Each weight's type on the device: the plans' or, read by a node kept in f32 or the
    /// scales of 8-bit steps, f32.
    weight_types: Vec<DType>,
    /// The weights of 8-bit steps, rounded: by the plan's weights and the format.
    eight_bit_weights: Vec<((Loc, QuantFormat), CudaSlice<u8>)>,
    /// The input of the 8-bit step running, rounded into patches; and its product's sums.
    /// Sized for the largest 8-bit step (1 byte where there is none).
    patches: CudaSlice<u8>,
    sums: CudaSlice<u8>,
    /// Two slots for the int8 copies of values that several steps read (`int8_copies` in
    /// steps/quant.rs), sized once every plan is prepared, each to what its copies need
    /// (`int8_copy_bytes`; 1 byte where none uses it).
    int8_copies: [CudaSlice<u8>; 2],
    int8_copy_bytes: [usize; 2],
    /// Ones, one per row of the largest FP8 step: the scales of its patches in products
    /// whose epilogue scales each output channel (`GemmDescs::scaled_fp8`).
    ones: CudaSlice<f32>,
    /// The 8-bit steps a fresh build moved to the plan's type, where that was faster: the
    /// batch size of their plan and their nodes (`prepare`).
    unquantized: Vec<(usize, Vec<String>)>,
    input: CudaSlice<f32>,
    output: CudaSlice<f32>,
    workspace: CudaSlice<u8>,
    lt_workspace: CudaSlice<u8>,
    sm_count: u32,
    /// The GPU's compute capability.
    arch: (i32, i32),
    /// The most shared memory a block may ask for here (`Gpu::shared_optin`).
    shared_optin: usize,
    /// The values its int8 steps pass to each other in int8, over all plans (`chain_int8`).
    int8_passes: usize,
    /// Page-locked staging buffers, so that copies run at full speed and asynchronously.
    host_in: PinnedHostSlice<f32>,
    /// Scores of `IN_FLIGHT + 1` batches: those launched and one run by `run`.
    host_out: PinnedHostSlice<f32>,
    /// Batches launched on staged frames, oldest first; and events for the next.
    in_flight: VecDeque<Launched>,
    spare_events: Vec<CudaEvent>,
    /// Recorded by the last launch after its frames' uploads and preprocessing, before its
    /// graph: once complete, the page-locked staging may be written again from its start,
    /// while the graph still runs. And what of the staging may be written (`staging_free`).
    staged_read: Option<CudaEvent>,
    host_staging: HostStaging,
    /// Raw frames: staged in page-locked memory, uploaded, preprocessed on the GPU; sized
    /// for a full batch of the largest frames seen.
    raw_host: Option<PinnedHostSlice<u8>>,
    raw: Option<CudaSlice<u8>>,
    /// Kernels read staged frames from page-locked host memory where they are, with no
    /// upload into `raw`: on integrated GPUs (Jetson), whose memory is the host's, the upload
    /// would only copy within the same memory. `TRTCLASSIFY_ZERO_COPY=1` forces it on a
    /// discrete GPU too, where the kernels then read over PCIe (for tests).
    zero_copy: bool,
    /// Bytes of `raw_host` holding frames whose copies may still be in flight.
    raw_used: usize,
    /// Frames in GPU memory of another CUDA context, copied here slot by slot before the
    /// preprocessing kernel reads them; and the bytes each slot holds.
    peer: Option<(CudaSlice<u8>, usize)>,
    /// The GPU preprocessing queued for its launch.
    pre: staging::PreQueue,
    /// Called by the driver after each launched batch (`set_done_signal`). One box for the
    /// runtime's life, not one a launch: the driver does not call a host function queued
    /// behind an error in the context, so a box it was to free would leak.
    done_signal: Option<Box<DoneSignal>>,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Batches in flight still write the page-locked output and call the done signal:
        // both must be done before the buffers and the signal go.
        let _ = self.stream.synchronize();
    }
}

// SAFETY: the cuDNN and cuBLASLt handles may be used from any thread, one at a time; the
// engine is only used through `&mut self`, and every call binds the context first.
unsafe impl Send for Runtime {}

impl Runtime {
    /// Uploads the weights, loads the kernels and prepares every plan; plans without tuned
    /// algorithms are tuned now, and where `time_eight_bit`, their 8-bit steps run in the
    /// faster of 8 bits and the plan's type (`prepare`). `progress` hears about each plan
    /// tuned.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        cubin: &[u8],
        dtype: DType,
        weights: &[Vec<u8>],
        plans: Vec<Plan>,
        wide: Option<Wide>,
        time_eight_bit: bool,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Self> {
        let eight_bit: Vec<EightBit> = (plans.iter().flat_map(|p| &p.steps))
            .filter_map(EightBit::of)
            .collect();
        check_eight_bit(&eight_bit, gpu)?;
        let _setup = device::setup_lock(gpu.ctx.ordinal());
        // Where a start's time goes, in the debug log (GST_DEBUG=trtclassify-engine:5).
        let started = std::time::Instant::now();
        let phase = |what: &str| {
            let at = started.elapsed();
            log::debug!(target: trtclassify_compiler::LOG_TARGET, "runtime: {what} ({at:.1?})");
        };
        let ctx = gpu.ctx.clone();
        // One stream, one user: cudarc's cross-stream event tracking is not needed, and
        // its events would end up in the captured graphs.
        // SAFETY: no other stream touches these buffers.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(Error::driver("stream"))?;
        let kernels = Kernels::load(&ctx, cubin, dtype)?;
        let wide_kernels = match &wide {
            Some(w) => Some(Kernels::load(&ctx, w.cubin, DType::F32)?),
            None => None,
        };
        phase("kernels loaded");
        let wide_weights = wide.as_ref().map_or(&[][..], |w| w.weights);
        let mut weight_types: Vec<DType> = (0..weights.len())
            .map(|i| weight_type(wide_weights, i, dtype))
            .collect();
        for index in scale_weights(&plans) {
            if let Some(t) = weight_types.get_mut(index) {
                *t = DType::F32;
            }
        }
        let sm_count = ctx
            .attribute(drv::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(Error::driver("attribute"))? as u32;
        let integrated = ctx
            .attribute(drv::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)
            .map_err(Error::driver("attribute"))?
            != 0;
        let zero_copy =
            integrated || std::env::var_os("TRTCLASSIFY_ZERO_COPY").is_some_and(|v| v == "1");
        if zero_copy {
            log::info!(target: trtclassify_compiler::LOG_TARGET, "{}: the preprocessing reads frames from page-locked host memory, with no upload",
                if integrated {
                    "an integrated GPU"
                } else {
                    "TRTCLASSIFY_ZERO_COPY=1"
                }
            );
        }

        let mut eight_bit_weights = Vec::new();
        for e in &eight_bit {
            let key = (e.w, e.quant.format);
            if eight_bit_weights.iter().any(|(k, _)| *k == key) {
                continue;
            }
            let (Loc::Weight { index, .. }, Loc::Weight { index: s, offset }) =
                (e.w, e.quant.w_scales)
            else {
                return Err(Error::Plan("an 8-bit step without constant weights"));
            };
            let scales: Vec<f32> = (weights[s].chunks_exact(4))
                .skip(offset)
                .take(e.n)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect();
            let rows = e.rounded_weights(&weights[index], weight_types[index], &scales);
            let rows = stream
                .clone_htod(&rows)
                .map_err(Error::driver("weight upload"))?;
            eight_bit_weights.push((key, rows));
        }
        let weights = weights
            .iter()
            .map(|w| stream.clone_htod(w).map_err(Error::driver("weight upload")))
            .collect::<Result<Vec<_>>>()?;
        let max = |f: fn(&Plan) -> usize| plans.iter().map(f).max().unwrap_or(1).max(1);
        // As much as each step needs, run as a loaded plan says (the steps the engine's own
        // kernel runs need no sums, and patches only to round their input first; a step it
        // does not fit here runs as patches and cuBLASLt's product whatever the plan says),
        // or any way for a build to time.
        let most = |i: usize| {
            (eight_bit.iter())
                .map(|e| {
                    let kernel = match e.quant.kernel {
                        Some(k) if k.is_own() && !e.own_way_fits(k, gpu.arch, gpu.shared_optin) => {
                            Some(EightBitKernel::Library)
                        }
                        kernel => kernel,
                    };
                    e.scratch_bytes(kernel)[i]
                })
                .max()
                .unwrap_or(1)
                .max(1)
        };
        let patches = stream
            .alloc_zeros::<u8>(most(0))
            .map_err(Error::driver("8-bit patches allocation"))?;
        let sums = stream
            .alloc_zeros::<u8>(most(1))
            .map_err(Error::driver("8-bit sums allocation"))?;
        let fp8_rows = (eight_bit.iter())
            .filter(|e| e.quant.format == QuantFormat::Fp8)
            .map(|e| e.rows)
            .max()
            .unwrap_or(1);
        let ones = stream
            .clone_htod(&vec![1.0f32; fp8_rows])
            .map_err(Error::driver("8-bit scales upload"))?;
        let arena = stream
            .alloc_zeros::<u8>(max(|p| p.arena_len) * dtype.size())
            .map_err(Error::driver("arena allocation"))?;
        let wide_arena = stream
            .alloc_zeros::<u8>(max(|p| p.wide_len) * 4)
            .map_err(Error::driver("arena allocation"))?;
        let input = stream
            .alloc_zeros::<f32>(max(|p| p.input_len))
            .map_err(Error::driver("input allocation"))?;
        let output = stream
            .alloc_zeros::<f32>(max(|p| p.output_len))
            .map_err(Error::driver("output allocation"))?;
        let lt_workspace = stream
            .alloc_zeros::<u8>(32 << 20)
            .map_err(Error::driver("workspace allocation"))?;
        phase("weights uploaded, buffers allocated");
        // Owned from here on: an error below destroys them.
        let cudnn = cudnn::Handle::new(&stream)?;
        let cublaslt = cublaslt::Handle::new()?;
        phase("cuDNN and cuBLASLt handles made");
        let ctx_for_pinned = ctx.clone();
        let mut rt = Runtime {
            plans: Vec::new(),
            cudnn,
            cublaslt,
            ctx,
            stream: stream.clone(),
            dtype,
            kernels,
            wide_kernels,
            arena,
            wide_arena,
            weights,
            weight_types,
            eight_bit_weights,
            patches,
            sums,
            int8_copies: [alloc_bytes(&stream, 1)?, alloc_bytes(&stream, 1)?],
            int8_copy_bytes: [0; 2],
            ones,
            unquantized: Vec::new(),
            input,
            output,
            workspace: stream
                .alloc_zeros::<u8>(1)
                .map_err(Error::driver("allocation"))?,
            lt_workspace,
            sm_count,
            arch: gpu.arch,
            shared_optin: gpu.shared_optin,
            int8_passes: 0,
            // SAFETY: both are written before they are read (`run`). The input is only written
            // by the host, so write-combined memory suits it; the output is read by the host.
            host_in: unsafe { ctx_for_pinned.alloc_pinned::<f32>(max(|p| p.input_len)) }
                .map_err(Error::driver("pinned allocation"))?,
            host_out: unsafe {
                ctx_for_pinned
                    .alloc_pinned_with_flags::<f32>(max(|p| p.output_len) * (IN_FLIGHT + 1), 0)
            }
            .map_err(Error::driver("pinned allocation"))?,
            in_flight: VecDeque::new(),
            spare_events: Vec::new(),
            staged_read: None,
            host_staging: HostStaging::Free,
            raw_host: None,
            raw: None,
            zero_copy,
            raw_used: 0,
            peer: None,
            pre: Default::default(),
            done_signal: None,
        };
        // Where the buffers lie, for the debug log: two builds whose code differs only in
        // kernels a plan does not run have run it 6-7 % apart at batch 1 (docs/benchmarks.md,
        // "what the two states are not"), and the buffers' places are what is left to compare.
        let weights_at = (rt.weights.iter()).map(|w| rt.ptr_u8(w));
        let (first, last) = (weights_at.clone().min(), weights_at.max());
        let (arena, arena_bytes) = (rt.ptr_u8(&rt.arena), rt.arena.len());
        let (input, output) = (rt.ptr(Loc::Input(0)), rt.ptr(Loc::Output(0)));
        log::debug!(
            target: trtclassify_compiler::LOG_TARGET,
            "runtime: arena at {arena:#x} ({arena_bytes} bytes), weights from {:#x} to {:#x}, \
             input at {input:#x}, output at {output:#x}",
            first.unwrap_or(0),
            last.unwrap_or(0)
        );
        let untuned = |f: fn(&Step) -> bool| plans.iter().any(|p| p.steps.iter().any(f));
        let tune_convs = untuned(|s| matches!(s, Step::Conv(c) if c.algo.is_none()));
        let tune = tune_convs || untuned(untuned_product);
        if tune_convs {
            rt.workspace = stream
                .alloc_zeros::<u8>(MAX_WORKSPACE)
                .map_err(Error::driver("tuning workspace allocation"))?;
        }
        // Preparing calls into cuBLASLt and cuDNN, and tuning captures graphs: the first
        // calls made ahead must be done.
        warmup::wait();
        for plan in plans {
            let batch = plan.batch;
            let prepared = rt.prepare(plan, time_eight_bit)?;
            rt.plans.push(prepared);
            if tune {
                progress(&format!("tuned batch size {batch}"));
            }
            phase(&format!("batch size {batch} prepared"));
        }
        // Keep only the workspace the chosen algorithms need.
        let needed = rt
            .plans
            .iter()
            .flat_map(|p| &p.plan.steps)
            .filter_map(|s| match s {
                Step::Conv(c) => c.algo.map(|a| a.workspace),
                _ => None,
            })
            .max()
            .unwrap_or(0)
            .max(1);
        if needed != rt.workspace.len() {
            rt.workspace = stream
                .alloc_zeros::<u8>(needed)
                .map_err(Error::driver("workspace allocation"))?;
        }
        // And only the patches and sums that the 8-bit steps need, as they were prepared.
        let [patches, sums] = rt.eight_bit_scratch_bytes();
        if patches < rt.patches.len() {
            rt.patches = stream
                .alloc_zeros::<u8>(patches)
                .map_err(Error::driver("8-bit patches allocation"))?;
        }
        if sums < rt.sums.len() {
            rt.sums = stream
                .alloc_zeros::<u8>(sums)
                .map_err(Error::driver("8-bit sums allocation"))?;
        }
        for (slot, bytes) in rt.int8_copy_bytes.into_iter().enumerate() {
            if bytes > 0 {
                rt.int8_copies[slot] = alloc_bytes(&stream, bytes)?;
            }
        }
        for i in 0..rt.plans.len() {
            rt.capture(i)?;
            phase(&format!("batch size {} captured", rt.plans[i].plan.batch));
        }
        Ok(rt)
    }

    /// The device address of `loc`.
    fn ptr(&self, loc: Loc) -> u64 {
        let base = |s: &CudaSlice<u8>| s.device_ptr(&self.stream).0;
        let size = self.dtype.size() as u64;
        match loc {
            Loc::Arena(o) => base(&self.arena) + o as u64 * size,
            Loc::Wide(o) => base(&self.wide_arena) + o as u64 * 4,
            Loc::Weight { index, offset } => {
                base(&self.weights[index]) + offset as u64 * self.weight_types[index].size() as u64
            }
            Loc::Input(o) => self.input.device_ptr(&self.stream).0 + o as u64 * 4,
            Loc::Output(o) => self.output.device_ptr(&self.stream).0 + o as u64 * 4,
            Loc::Temp { .. } => unreachable!("plans hold placed buffers only"),
        }
    }

    /// The device address of a byte buffer.
    fn ptr_u8(&self, s: &CudaSlice<u8>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    /// Runs `n` frames (f32, the model's input layout, one after the other) through the
    /// smallest plan that holds them; returns the scores, `n` times the output per frame.
    pub fn run(&mut self, input: &[f32], n: usize) -> Result<&[f32]> {
        let i = self.plan_holding(n)?;
        let plan = &self.plans[i].plan;
        let len_in = n * plan.input_len / plan.batch;
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("context"))?;
        self.staging_free()?;
        let input_ptr = self.input.device_ptr(&self.stream).0;
        let host_in = self
            .host_in
            .as_mut_slice()
            .map_err(Error::driver("staging"))?;
        host_in[..len_in].copy_from_slice(&input[..len_in]);
        // SAFETY: the device buffer holds the plan's input; the pinned buffer lives as long
        // as the runtime, and the stream is synchronised before it is written again.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                input_ptr,
                &host_in[..len_in],
                self.stream.cu_stream(),
            )
        }
        .map_err(Error::driver("upload"))?;
        let out = self.launch_and_download(i, n)?;
        self.stream
            .synchronize()
            .map_err(Error::driver("inference"))?;
        let host_out = self.host_out.as_slice().map_err(Error::driver("staging"))?;
        Ok(&host_out[out])
    }

    /// Has the driver call `signal` each time a batch launched by `launch_staged` has its
    /// scores; waits for the batches in flight first, which may still call the signal it
    /// replaces.
    pub fn set_done_signal(&mut self, signal: DoneSignal) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(Error::driver("inference"))?;
        self.done_signal = Some(Box::new(signal));
        Ok(())
    }

    /// Launches the first `n` staged frames through the smallest plan that holds them and
    /// returns at once; `collect` gives their scores, and the done signal (where set) is
    /// called once they are there. Fails where `IN_FLIGHT` batches are launched and not
    /// collected.
    pub fn launch_staged(&mut self, n: usize) -> Result<()> {
        if self.in_flight.len() >= IN_FLIGHT {
            return Err(Error::Plan("too many batches in flight"));
        }
        let i = self.plan_holding(n)?;
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("context"))?;
        // Slots from `n` on hold nothing of this batch (a push refused part-way left them).
        self.restage_from(n);
        self.flush_preprocess()?;
        if self.staged_read.is_none() {
            self.staged_read = Some(self.ctx.new_event(None).map_err(Error::driver("event"))?);
        }
        let staged_read = self.staged_read.as_ref().expect("made above");
        staged_read
            .record(&self.stream)
            .map_err(Error::driver("event record"))?;
        self.host_staging = HostStaging::AfterLaunch;
        let out = self.launch_and_download(i, n)?;
        let done = match self.spare_events.pop() {
            Some(event) => event,
            None => self.ctx.new_event(None).map_err(Error::driver("event"))?,
        };
        done.record(&self.stream)
            .map_err(Error::driver("event record"))?;
        self.in_flight.push_back(Launched { n, out, done });
        if let Some(signal) = &self.done_signal {
            let data: *const DoneSignal = &**signal;
            // SAFETY: the callback only reads the signal, which outlives the stream's work
            // (see `done_signal`), and calls no CUDA.
            unsafe {
                cudarc::driver::result::stream::launch_host_function(
                    self.stream.cu_stream(),
                    signal_done,
                    data.cast_mut().cast(),
                )
            }
            .map_err(Error::driver("host callback launch"))?;
        }
        Ok(())
    }

    /// Batches launched and not yet collected.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The scores of the oldest batch launched and not yet collected, `n` times the output
    /// per frame as `run` gives them: waits for it where `wait`; `None` while it runs (or
    /// where none is in flight).
    pub fn collect(&mut self, wait: bool) -> Result<Option<&[f32]>> {
        let Some(oldest) = self.in_flight.front() else {
            return Ok(None);
        };
        let ready = match wait {
            true => oldest
                .done
                .synchronize()
                .map(|()| true)
                .map_err(Error::driver("inference"))?,
            false => oldest
                .done
                .try_is_complete()
                .map_err(Error::driver("inference"))?,
        };
        if !ready {
            return Ok(None);
        }
        let Launched { n, out, done } = self.in_flight.pop_front().expect("looked at above");
        self.spare_events.push(done);
        let host_out = self.host_out.as_slice().map_err(Error::driver("staging"))?;
        debug_assert_eq!(out.len() % n.max(1), 0);
        Ok(Some(&host_out[out]))
    }

    /// Forgets the batches in flight and what is staged: their scores are not wanted (a
    /// discarded batch); waits for them, so that their frames may be released.
    pub fn forget_in_flight(&mut self) {
        let forgotten = self.in_flight.drain(..).map(|l| l.done);
        self.spare_events.extend(forgotten);
        // Their frames (and those staged since) may be released once this returns: frames
        // in GPU memory go back to their decoder's pool. A discard is rare (a flush, or a
        // failure), so it waits.
        self.restage_from(0);
        let _ = self.stream.synchronize();
        self.host_staging = HostStaging::Free;
    }

    /// The index of the smallest plan that runs `n` frames at once.
    fn plan_holding(&self, n: usize) -> Result<usize> {
        self.plans
            .iter()
            .position(|p| p.plan.batch >= n)
            .ok_or(Error::NoPlanHolding(n))
    }

    /// Launches plan `i` on the input buffer and the download of its first `n` frames'
    /// scores into a part of `host_out` no batch in flight uses, which it returns; waits for
    /// nothing.
    fn launch_and_download(&mut self, i: usize, n: usize) -> Result<std::ops::Range<usize>> {
        let plan = &self.plans[i].plan;
        let len_out = n * plan.output_len / plan.batch;
        let part = self.host_out.len() / (IN_FLIGHT + 1);
        let free = (0..=IN_FLIGHT)
            .find(|k| self.in_flight.iter().all(|l| l.out.start != k * part))
            .expect("IN_FLIGHT + 1 parts for at most IN_FLIGHT batches and this one");
        let out = free * part..free * part + len_out;
        let output_ptr = self.output.device_ptr(&self.stream).0;
        let host_out = self
            .host_out
            .as_mut_slice()
            .map_err(Error::driver("staging"))?;
        // SAFETY: the device buffer holds the plan's output; the pinned range is read only
        // after the event recorded behind this copy, and no other batch in flight writes it.
        unsafe {
            self.plans[i]
                .graph
                .as_ref()
                .ok_or(Error::Plan("the plan has no graph"))?
                .launch()
                .map_err(Error::driver("graph launch"))?;
            cudarc::driver::result::memcpy_dtoh_async(
                &mut host_out[out.clone()],
                output_ptr,
                self.stream.cu_stream(),
            )
            .map_err(Error::driver("download"))?;
        }
        Ok(out)
    }

    /// The plans, tuned.
    pub fn plans(&self) -> impl Iterator<Item = &Plan> {
        self.plans.iter().map(|p| &p.plan)
    }

    /// How many values the plans' int8 steps pass to each other in int8, where the engine's
    /// own kernel runs the step that writes one and the steps that read it as their input:
    /// in place of the plan's type where one step reads it, beside it where others read it
    /// too.
    pub fn int8_passes(&self) -> usize {
        self.int8_passes
    }

    /// How many steps of the plans the engine's own int8 kernel runs.
    pub fn own_int8_steps(&self) -> usize {
        (self.plans.iter().flat_map(|p| &p.prepared))
            .filter(|p| matches!(p, Prepared::OwnEightBit(_)))
            .count()
    }

    /// The 8-bit steps that this build runs in the plan's type, as faster on this GPU: for
    /// each plan that has any, its batch size and their nodes.
    pub fn unquantized(&self) -> &[(usize, Vec<String>)] {
        &self.unquantized
    }

    /// The most frames one call runs.
    pub fn max_batch(&self) -> usize {
        self.plans.iter().map(|p| p.plan.batch).max().unwrap_or(1)
    }
}

/// Whether `s` is a product whose cuBLASLt algorithm is not chosen yet: in the plan's type,
/// or in 8 bits (a quantized convolution's product included).
fn untuned_product(s: &Step) -> bool {
    match s {
        Step::Gemm(GemmStep { quant: Some(q), .. })
        | Step::Conv(ConvStep { quant: Some(q), .. }) => q.algo.is_none(),
        Step::Gemm(g) => g.algo.is_none(),
        _ => false,
    }
}

/// Checks that `gpu` runs the 8-bit steps `steps`: FP8 products from Ada and Hopper on
/// (compute capability 8.9), int8 on tensor cores from Turing on (7.5); and that their
/// sizes suit the patches kernel (16 channels at a time).
fn check_eight_bit(steps: &[EightBit], gpu: &Gpu) -> Result<()> {
    for e in steps {
        let needs = match e.quant.format {
            QuantFormat::Fp8 => (8, 9),
            QuantFormat::Int8 => (7, 5),
        };
        if gpu.arch < needs {
            return Err(Error::Unsupported(format!(
                "{} products need a GPU of compute capability {}.{} or newer; {} is {}.{}",
                e.quant.format, needs.0, needs.1, gpu.name, gpu.arch.0, gpu.arch.1
            )));
        }
        if !e.summed().is_multiple_of(16) || !e.n.is_multiple_of(8) {
            return Err(Error::Plan(
                "an 8-bit step whose sizes are not multiples of 16 and 8",
            ));
        }
    }
    Ok(())
}

/// Constants as the plan's type, little-endian, ready to upload.
pub fn to_bytes(data: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => data
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

/// `bytes` of device memory for int8 values, zeroed.
fn alloc_bytes(stream: &Arc<CudaStream>, bytes: usize) -> Result<CudaSlice<u8>> {
    stream
        .alloc_zeros::<u8>(bytes)
        .map_err(Error::driver("8-bit copies allocation"))
}
