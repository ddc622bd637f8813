// SPDX-License-Identifier: MPL-2.0
//! What this machine offers the runtime: the libraries it loads, their versions, and the GPU.

use std::sync::Arc;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::{CudaContext, sys as drv};

use crate::engine::cuda::error::{Error, Result};

/// The shared libraries the engine loads, by the names cudarc looks for.
pub(crate) fn missing_libraries() -> Vec<&'static str> {
    // SAFETY: each call only tries to dlopen the library and closes it again.
    let present = unsafe {
        [
            (
                "libcuda (the NVIDIA driver)",
                cudarc::driver::sys::is_culib_present(),
            ),
            ("libnvrtc", cudarc::nvrtc::sys::is_culib_present()),
            ("libcublasLt", cudarc::cublaslt::sys::is_culib_present()),
            ("libcudnn", cudarc::cudnn::sys::is_culib_present()),
        ]
    };
    present
        .into_iter()
        .filter(|(_, ok)| !ok)
        .map(|(name, _)| name)
        .collect()
}

/// A GPU that answers: its context, name and compute capability.
pub struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) name: String,
    pub(crate) arch: (i32, i32),
}

/// Opens the GPU of CUDA ordinal `ordinal` (the `gpu-id` property).
pub fn open_gpu(ordinal: u32) -> Result<Gpu> {
    let count = CudaContext::device_count().map_err(Error::driver("device count"))?;
    if ordinal as i32 >= count {
        return Err(Error::NoSuchGpu { ordinal, count });
    }
    let ctx = CudaContext::new(ordinal as usize).map_err(Error::driver("context"))?;
    let name = ctx.name().map_err(Error::driver("device name"))?;
    let arch = ctx
        .compute_capability()
        .map_err(Error::driver("compute capability"))?;
    Ok(Gpu { ctx, name, arch })
}

/// The versions that an engine file must match.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Versions {
    pub(crate) driver: i32,
    pub(crate) cudnn: usize,
    pub(crate) cublaslt: usize,
}

impl std::fmt::Display for Versions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CUDA driver {}, cuDNN {}, cuBLASLt {}",
            self.driver, self.cudnn, self.cublaslt
        )
    }
}

/// The versions of the driver, cuDNN and cuBLASLt loaded.
pub(crate) fn library_versions() -> Versions {
    let mut driver = 0;
    // SAFETY: writes one int.
    unsafe { drv::cuDriverGetVersion(&mut driver) };
    Versions {
        driver,
        cudnn: cudarc::cudnn::result::get_version(),
        // SAFETY: no arguments.
        cublaslt: unsafe { lt::cublasLtGetVersion() },
    }
}
