// SPDX-License-Identifier: MPL-2.0
//! Launching the steps of a plan on the stream: each kind of step implements `GpuStep` in
//! the module of its family, beside the kernels it launches (`<family>.cu`) and the set that
//! loads them (`<Family>Kernels`, a field of `Kernels`).

use cudarc::driver::{LaunchArgs, LaunchConfig};

use super::kernels::{Kernels, grid};
use super::{Prepared, Runtime};
use crate::error::{Error, Result};
use trtclassify_compiler::plan::{DType, Loc, Step};

mod attention;
mod conv;
mod depthwise;
mod elementwise;
#[cfg(test)]
mod emulated;
mod gemm;
mod pool;
mod quant;
mod rows;
mod stem;

pub(super) use attention::Attention;
pub(super) use conv::ConvKernels;
pub(super) use depthwise::DepthwiseKernels;
pub(super) use elementwise::ElementwiseKernels;
pub(super) use pool::PoolKernels;
pub(super) use quant::{EightBit, OwnStep, QuantKernels};
pub(super) use rows::RowKernels;
pub(super) use stem::StemKernels;

/// A kind of step as the GPU runs it. Every kind implements it (`Runtime::step` dispatches
/// with `with_step!`), so a new kind does not build until it runs here.
trait GpuStep {
    /// Enqueues the step on the runtime's stream, with the descriptors `prepared` for it
    /// (`Prepared::None` for the kinds that need none).
    fn enqueue(&self, rt: &Runtime, prepared: &Prepared) -> Result<()>;
}

/// Launches a kernel whose arguments `args` holds.
fn launch(mut args: LaunchArgs, cfg: LaunchConfig) -> Result<()> {
    // SAFETY: argument types match the kernel's signature (steps/*.cu).
    unsafe { args.launch(cfg) }
        .map(drop)
        .map_err(Error::driver("kernel launch"))
}

impl Runtime {
    /// Enqueues every step of plan `i` on the stream.
    pub(super) fn enqueue(&self, i: usize) -> Result<()> {
        let bp = &self.plans[i];
        for (step, prepared) in bp.plan.steps.iter().zip(&bp.prepared) {
            self.step(step, prepared)?;
        }
        Ok(())
    }

    /// Enqueues `step`, with the descriptors `prepared` for it.
    pub(super) fn step(&self, step: &Step, prepared: &Prepared) -> Result<()> {
        trtclassify_compiler::with_step!(step, s => s.enqueue(self, prepared))
    }

    /// The kernels and the type of a step that writes `y`: f32 for the values of a node kept
    /// in f32 (`Loc::Wide`), else the plan's. (The scores, f32 in every plan, are written by
    /// the casts and kernels of the plan's type made for them.)
    pub(super) fn writes(&self, y: Loc) -> (Result<&Kernels>, DType) {
        match y {
            Loc::Wide(_) => (self.wide_kernels(), DType::F32),
            _ => (Ok(&self.kernels), self.dtype),
        }
    }

    /// The f32 kernels of a mixed-precision engine.
    fn wide_kernels(&self) -> Result<&Kernels> {
        self.wide_kernels
            .as_ref()
            .ok_or(Error::Plan("values kept in f32 without their kernels"))
    }

    /// The threads of a grid-stride launch over `n` elements.
    pub(super) fn launch_cfg(&self, n: usize) -> LaunchConfig {
        grid(self.sm_count, n)
    }
}
