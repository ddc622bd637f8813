// SPDX-License-Identifier: MPL-2.0
//! A process's first calls into cuBLASLt and cuDNN, made ahead on threads of their own.
//!
//! The first cuBLASLt heuristic query of a process takes 73-140 ms and its first cuDNN
//! convolution query 51-146 ms on an H200, the next ones under a millisecond, on any handle
//! and thread (`bench/gpu/first_calls.py`): the libraries set themselves up then. Started as
//! the GPU opens (`warm_libraries`), they overlap what comes before the first plan is
//! prepared: the engine file's read, the kernels' load and the weights' upload on a cached
//! start, the model's import on a build. `Runtime::new` waits for them before it prepares the
//! plans, so that nothing else runs in the context while it captures graphs, and the engine's
//! build before it returns (`Warmup`).

use std::sync::{Condvar, Mutex, PoisonError};

use cudarc::cudnn::sys as dnn;

use super::cublaslt::{self, GemmDescs, GemmShape};
use super::cudnn::{self, ConvDescs};
use super::device::Gpu;
use crate::error::{Error, Result};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{ConvStep, DType, Loc};

/// A library's first call.
type FirstCall = fn() -> Result<()>;

/// `None` until `warm_libraries` runs; then how many of its threads are still running.
static RUNNING: Mutex<Option<usize>> = Mutex::new(None);
static DONE: Condvar = Condvar::new();

/// Waits, as it is dropped, for the calls `warm_libraries` started: whatever becomes of the
/// engine's build, no thread is left inside a library's set-up (a process that exits on a
/// build's error could otherwise tear CUDA down under it).
#[must_use = "dropped, it waits for the first calls"]
pub struct Warmup(());

impl Drop for Warmup {
    fn drop(&mut self) {
        wait();
    }
}

/// Starts the first calls into cuBLASLt and into cuDNN, each on a thread of its own, once
/// per process. A failure there is only logged: the engine's own calls then meet it and say
/// what it is.
pub fn warm_libraries(gpu: &Gpu) -> Warmup {
    let mut running = RUNNING.lock().unwrap_or_else(PoisonError::into_inner);
    if running.is_some() {
        return Warmup(());
    }
    let calls: [(&str, FirstCall); 2] = [("cuBLASLt", first_product), ("cuDNN", first_convolution)];
    let mut started = 0;
    for (library, call) in calls {
        let ctx = gpu.ctx.clone();
        let spawned = std::thread::Builder::new()
            .name("trtclassify-warmup".into())
            .spawn(move || {
                // Counts the thread out however it ends, a panic included.
                let _done = Finished;
                let since = std::time::Instant::now();
                let called = ctx.bind_to_thread().map_err(Error::driver("context"));
                match called.and_then(|()| call()) {
                    Ok(()) => log::debug!(target: trtclassify_compiler::LOG_TARGET,
                        "{library} set up ahead in {:.1?}", since.elapsed()),
                    Err(e) => log::debug!(target: trtclassify_compiler::LOG_TARGET,
                        "setting up {library} ahead: {e}"),
                }
            });
        started += usize::from(spawned.is_ok());
    }
    // The threads count themselves out under this lock, so only after this.
    *running = Some(started);
    Warmup(())
}

/// Waits for the calls `warm_libraries` started, if any.
pub(super) fn wait() {
    let mut running = RUNNING.lock().unwrap_or_else(PoisonError::into_inner);
    while running.is_some_and(|n| n > 0) {
        running = DONE.wait(running).unwrap_or_else(PoisonError::into_inner);
    }
}

struct Finished;

impl Drop for Finished {
    fn drop(&mut self) {
        let mut running = RUNNING.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = running.as_mut() {
            *n = n.saturating_sub(1);
        }
        DONE.notify_all();
    }
}

/// A heuristic query for a small fp16 product: what sets cuBLASLt up.
fn first_product() -> Result<()> {
    let lt = cublaslt::Handle::new()?;
    let shape = GemmShape {
        batch: 1,
        rows: 64,
        n: 64,
        k: 64,
        x_batch: 0,
        y_batch: 0,
        w_transposed: false,
        y_f32: false,
    };
    GemmDescs::new(&lt, DType::F16, &shape, None, Act::None, 32 << 20, None).map(drop)
}

/// A workspace query for a 3×3 fp16 convolution: what sets cuDNN up.
fn first_convolution() -> Result<()> {
    let handle = cudnn::Handle::unbound()?;
    let conv = ConvStep {
        n: 1,
        c: 64,
        h: 56,
        w: 56,
        k: 64,
        oh: 56,
        ow: 56,
        kernel: [3, 3],
        pads: [1, 1],
        strides: [1, 1],
        dilations: [1, 1],
        group: 1,
        act: Act::Relu,
        act_in: Act::None,
        x: Loc::Arena(0),
        weight: Loc::Arena(0),
        bias: Loc::Arena(0),
        residual: None,
        y: Loc::Arena(0),
        algo: None,
        quant: None,
    };
    let d = ConvDescs::new(&conv, DType::F16)?;
    let mut size = 0;
    // SAFETY: live handle and descriptors; writes one size.
    cudnn::check(
        unsafe {
            dnn::cudnnGetConvolutionForwardWorkspaceSize(
                handle.raw(),
                d.x.raw(),
                d.w.raw(),
                d.conv.raw(),
                d.y.raw(),
                cudnn::algo_from(1),
                &mut size,
            )
        },
        "workspace size",
    )
}
