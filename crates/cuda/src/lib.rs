// SPDX-License-Identifier: MPL-2.0
#![warn(missing_docs)]
//! trtclassify's CUDA runtime: the compiler's plans on NVIDIA GPUs, without GStreamer.
//!
//! `runtime` tunes each plan's convolutions, captures it as one CUDA graph and runs it on
//! batches; `frames` describes video frames for the GPU preprocessing kernel; `engine_file`
//! stores a built engine on disk (and checks every plan it loads), `cache` keeps those files
//! (where, written how, one builder at a time, cleaned); `fp16_range` finds where fp16 would
//! overflow; `abi` is what the Rust side and the kernels (`runtime/*.cu`, `runtime/steps/*.cu`) must agree on; `error` what can
//! fail. The GPU part only needs the driver, NVRTC, cuBLASLt and cuDNN, which are loaded when
//! an engine is built, so a program linking this crate starts where there is no CUDA at all.

mod abi;
pub mod cache;
mod checksum;
pub mod digests;
pub mod engine_file;
mod error;
pub mod fp16_range;
pub mod frames;
pub mod runtime;

pub use error::Error;

#[cfg(test)]
mod tests;

/// Why the CUDA runtime cannot run here, or `None` when the libraries it needs load.
pub fn unavailable_reason() -> Option<String> {
    let missing = runtime::missing_libraries();
    (!missing.is_empty()).then(|| {
        format!(
            "the CUDA engine needs {} and cannot load {}",
            "the NVIDIA driver, NVRTC, cuBLASLt and cuDNN",
            missing.join(", ")
        )
    })
}

/// The CUDA devices of this machine; 0 where the driver is missing or finds none.
pub fn gpu_count() -> usize {
    // SAFETY: only tries to dlopen the driver and closes it again.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}
