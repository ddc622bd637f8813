// SPDX-License-Identifier: MPL-2.0
//! What this machine offers the runtime: the libraries it loads, their versions, and the GPU.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, sys as drv};

use crate::error::{Error, Result};

/// The shared libraries the engine loads, by the names cudarc looks for.
pub fn missing_libraries() -> Vec<&'static str> {
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

/// The setup lock of the GPU of `ordinal`, held while an engine is set up on it.
///
/// The engines of a process share each GPU's primary context, and a CUDA graph being captured
/// is invalidated when another thread of the context makes a call that synchronises it (a
/// memory free, cuDNN's algorithm search, a module load): engines built together would fail
/// with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. So one engine at a time is set up per GPU;
/// running engines do not take the lock (their launches and copies are stream-ordered).
pub fn setup_lock(ordinal: usize) -> MutexGuard<'static, ()> {
    static LOCKS: Mutex<BTreeMap<usize, &'static Mutex<()>>> = Mutex::new(BTreeMap::new());
    let lock: &'static Mutex<()> = LOCKS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(ordinal)
        .or_insert_with(|| Box::leak(Box::default()));
    // A panic while setting up leaves nothing the lock protects half-done.
    lock.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A GPU that answers: its context, name and compute capability.
pub struct Gpu {
    /// Its primary context.
    pub ctx: Arc<CudaContext>,
    /// Its name, as the driver gives it.
    pub name: String,
    /// Compute capability: major, minor.
    pub arch: (i32, i32),
    /// The most shared memory a block may ask for (99 KiB on sm_86 and sm_89, 163 on sm_80
    /// and sm_87, 227 on sm_90): which ways of the own int8 kernel run here.
    pub shared_optin: usize,
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
    let shared_optin = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(Error::driver("shared memory per block"))? as usize;
    Ok(Gpu {
        ctx,
        name,
        arch,
        shared_optin,
    })
}

/// The versions that an engine file must match.
#[derive(Debug, Clone, Copy)]
pub struct Versions {
    pub driver: i32,
    /// NVRTC's, as major * 1000 + minor * 10 (the driver's style): the kernels are its
    /// machine code.
    pub nvrtc: i32,
    pub cudnn: usize,
    pub cublaslt: usize,
}

impl std::fmt::Display for Versions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CUDA driver {}, NVRTC {}, cuDNN {}, cuBLASLt {}",
            self.driver, self.nvrtc, self.cudnn, self.cublaslt
        )
    }
}

/// The versions of the driver, cuDNN and cuBLASLt loaded.
pub fn library_versions() -> Versions {
    let mut driver = 0;
    // SAFETY: writes one int.
    unsafe { drv::cuDriverGetVersion(&mut driver) };
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    Versions {
        driver,
        nvrtc: major * 1000 + minor * 10,
        cudnn: cudarc::cudnn::result::get_version(),
        // SAFETY: no arguments.
        cublaslt: unsafe { lt::cublasLtGetVersion() },
    }
}
