// SPDX-License-Identifier: MPL-2.0
//! `backend=cuda`: our own fp16 engine on NVIDIA GPUs.
//!
//! The ONNX model is imported into a small graph IR (`ir`, `import`), rewritten (`passes`:
//! batch norm folded, activations and residual adds fused), lowered to a plan of GPU steps
//! (`plan`), tuned and captured as one CUDA graph per batch size (`runtime`), and cached on
//! disk (`cache`). Everything up to the plan runs on the CPU and is checked there against
//! `reference`; the GPU part only needs the driver, NVRTC, cuBLASLt and cuDNN, which are
//! loaded when the engine is built, so the plugin loads where there is no CUDA at all.

pub mod import;
pub mod ir;
pub mod lower;
pub mod passes;
pub mod plan;
pub mod reference;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
