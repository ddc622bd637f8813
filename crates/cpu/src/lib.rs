// SPDX-License-Identifier: MPL-2.0
#![warn(missing_docs)]
//! trtclassify's CPU runtime: runs the compiler's plan in fp32 with its own kernels
//! (AVX-512, AVX2 and NEON chosen at run time), on a shared team of threads. No GStreamer:
//! the engine crate puts preprocessing and the element's seam around it.
//!
//! `plan_runner` holds a compiled model and runs batches of it; `calibration` runs it step
//! by step for the quantized GPU engines' calibration; `kernels/` the steps' kernels;
//! `batched_tail` runs the classifier head of several threads' frames at once;
//! `vector` the vector activations.

mod batched_tail;
mod calibration;
mod kernels;
mod plan_runner;
#[cfg(test)]
mod tests;
mod vector;

pub use calibration::CalibrationRunner;
pub use plan_runner::{PlanRunner, cores};
