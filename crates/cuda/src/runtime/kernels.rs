// SPDX-License-Identifier: MPL-2.0
//! The kernels' source, put together from the family files (`prelude.cu`, `preprocess.cu`,
//! `steps/*.cu`) and what abi.rs generates; compiled by NVRTC for the GPU at hand; loaded
//! into the context as one set per family (each defined beside its launches, with
//! `kernel_set!`); and the launch shapes the kernels expect.

use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, LaunchConfig};
use cudarc::nvrtc::{self, CompileError};

use super::staging::PreprocessKernels;
use super::steps::{
    Attention, ConvKernels, DepthwiseKernels, ElementwiseKernels, PoolKernels, QuantKernels,
    RowKernels, StemKernels,
};
use crate::abi;
use crate::error::{Error, Result};
use trtclassify_compiler::plan::DType;

/// The kernels' source, compiled by NVRTC for the GPU at hand (and hashed into engine files:
/// a change to it rebuilds their kernels). The order matters: each file uses what the ones
/// before it define (`Vec16` of the prelude, the reductions of rows.cu in attention.cu).
pub fn source() -> &'static str {
    static SOURCE: LazyLock<String> = LazyLock::new(|| {
        [
            abi::prelude().as_str(),
            include_str!("prelude.cu"),
            include_str!("steps/activations.cu"),
            abi::dispatchers().as_str(),
            include_str!("steps/elementwise.cu"),
            include_str!("steps/conv.cu"),
            include_str!("steps/stem.cu"),
            include_str!("steps/depthwise.cu"),
            include_str!("steps/quant.cu"),
            include_str!("steps/pool.cu"),
            include_str!("steps/rows.cu"),
            include_str!("preprocess.cu"),
            include_str!("steps/attention.cu"),
        ]
        .join("\n")
    });
    &SOURCE
}

/// The kernels compiled for one GPU.
#[derive(Clone)]
pub struct Compiled {
    /// Machine code for the GPU's own architecture, which the driver loads as it is: from
    /// PTX it would compile the whole set again at every start where its cache is empty or
    /// off (a new container, a read-only home), 6-8 s on an H200.
    pub cubin: Vec<u8>,
    /// The PTX NVRTC made on the way (for the tests, which look for each kernel in it).
    pub ptx: String,
}

/// The kernels for `dtype` and the compute capability `arch` (major, minor), compiled once a
/// process: engines built together, or rebuilt with some nodes in f32, share them.
pub fn compile(dtype: DType, arch: (i32, i32)) -> Result<Compiled> {
    type Done = Vec<((DType, (i32, i32)), Compiled)>;
    static COMPILED: Mutex<Done> = Mutex::new(Vec::new());
    // Held while compiling: a second engine of the same setup waits for the first's.
    let mut done = COMPILED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, c)) = done.iter().find(|(k, _)| *k == (dtype, arch)) {
        return Ok(c.clone());
    }
    let compiled = nvrtc_compile(dtype, arch)?;
    done.push(((dtype, arch), compiled.clone()));
    Ok(compiled)
}

/// One NVRTC compilation of the kernels for `dtype`, to machine code for `arch`.
fn nvrtc_compile(dtype: DType, arch: (i32, i32)) -> Result<Compiled> {
    let mut options = vec![format!("--gpu-architecture=sm_{}{}", arch.0, arch.1)];
    if dtype == DType::F16 {
        options.push("-DHALF".into());
    }
    let failed = |nvrtc| {
        Error::Nvrtc(CompileError::CompileError {
            nvrtc,
            options: options.clone(),
            log: std::ffi::CString::default(),
        })
    };
    let source = std::ffi::CString::new(source()).expect("the kernels' source has no NUL");
    let prog = nvrtc::result::create_program(&source, None)
        .map_err(|e| Error::Nvrtc(CompileError::CreationError(e)))?;
    // SAFETY: `prog` is live until the `destroy_program` below, which every path reaches.
    unsafe {
        let compiled = match nvrtc::result::compile_program(prog, &options) {
            Ok(()) => take_output(prog).map_err(failed),
            Err(nvrtc) => Err(Error::Nvrtc(CompileError::CompileError {
                nvrtc,
                options: options.clone(),
                log: nvrtc::result::get_program_log(prog)
                    .map(|log| std::ffi::CStr::from_ptr(log.as_ptr()).to_owned())
                    .unwrap_or_default(),
            })),
        };
        let _ = nvrtc::result::destroy_program(prog);
        compiled
    }
}

/// The CUBIN and PTX of a compiled program.
///
/// # Safety
/// `prog` is a live program, compiled for a real architecture (`sm_XY`).
unsafe fn take_output(
    prog: nvrtc::sys::nvrtcProgram,
) -> std::result::Result<Compiled, nvrtc::result::NvrtcError> {
    // SAFETY: the caller's; each buffer is as long as NVRTC says its output is.
    unsafe {
        let ptx = nvrtc::result::get_ptx(prog)?;
        let mut len = 0usize;
        nvrtc::sys::nvrtcGetCUBINSize(prog, &mut len).result()?;
        if len == 0 {
            // No machine code: the architecture given was a virtual one.
            return Err(nvrtc::result::NvrtcError(
                nvrtc::sys::nvrtcResult::NVRTC_ERROR_INVALID_OPTION,
            ));
        }
        let mut cubin = vec![0u8; len];
        nvrtc::sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()).result()?;
        Ok(Compiled {
            cubin,
            ptx: std::ffi::CStr::from_ptr(ptx.as_ptr())
                .to_string_lossy()
                .into_owned(),
        })
    }
}

/// The kernels, loaded: each family's set, defined beside its launches (`steps/<family>.rs`,
/// `staging.rs` for the preprocessing), so that a new kernel touches its family's files only.
pub(super) struct Kernels {
    pub(super) ew: ElementwiseKernels,
    pub(super) conv: ConvKernels,
    pub(super) stem: StemKernels,
    pub(super) depthwise: DepthwiseKernels,
    pub(super) quant: QuantKernels,
    pub(super) pool: PoolKernels,
    pub(super) rows: RowKernels,
    pub(super) preprocess: PreprocessKernels,
    /// Fused attention (fp16 only): on tensor cores by head sizes (dk, dv) from sm_80 on,
    /// else a warp per query.
    pub(super) attention: Attention,
}

impl Kernels {
    /// Loads the compiled kernels `cubin` (`Compiled::cubin`) into `ctx`.
    pub(super) fn load(ctx: &Arc<CudaContext>, cubin: &[u8], dtype: DType) -> Result<Self> {
        let module = ctx
            .load_module(nvrtc::Ptx::from_binary(cubin.to_vec()))
            .map_err(Error::driver("module load"))?;
        let major = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(Error::driver("attribute"))?;
        let module = KernelModule {
            module,
            dtype,
            major,
        };
        let quant = QuantKernels::load(&module)?;
        let stem = StemKernels::load(&module)?;
        if major >= 8 {
            let shared_optin = ctx
                .attribute(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )
                .map_err(Error::driver("attribute"))?;
            quant.allow_own_shared_memory(shared_optin as usize)?;
            stem.allow_shared_memory(shared_optin as usize)?;
        }
        Ok(Kernels {
            ew: ElementwiseKernels::load(&module)?,
            conv: ConvKernels::load(&module)?,
            stem,
            depthwise: DepthwiseKernels::load(&module)?,
            quant,
            pool: PoolKernels::load(&module)?,
            rows: RowKernels::load(&module)?,
            preprocess: PreprocessKernels::load(&module)?,
            attention: Attention::load(&module)?,
        })
    }
}

/// The compiled kernels loaded into a context, from which each family's `load` takes its own.
pub(super) struct KernelModule {
    module: Arc<CudaModule>,
    /// The type the kernels were compiled for.
    pub(super) dtype: DType,
    /// The GPU's compute capability (major).
    pub(super) major: i32,
}

impl KernelModule {
    /// The kernel `name` (an `extern "C" __global__` function of the source).
    pub(super) fn function(&self, name: &str) -> Result<CudaFunction> {
        self.module
            .load_function(name)
            .map_err(Error::driver("kernel"))
    }
}

/// A family's set of kernels: a struct of them, each field loaded (`load`) by the kernel name
/// written beside it, and those names (`NAMES`) for the tests, which find each in the
/// family's `.cu` file and in the compiled PTX. One list, so the two cannot disagree.
macro_rules! kernel_set {
    (
        $(#[$attr:meta])*
        $name:ident {
            $($(#[$field_attr:meta])* $field:ident: $kernel:literal,)*
        }
    ) => {
        $(#[$attr])*
        pub(in crate::runtime) struct $name {
            $($(#[$field_attr])* pub(in crate::runtime) $field: cudarc::driver::CudaFunction,)*
        }

        impl $name {
            /// The family's kernels, by the names of their `extern "C" __global__` functions.
            #[cfg(test)]
            pub(in crate::runtime) const NAMES: &[&str] = &[$($kernel),*];

            /// Takes the family's kernels from `module`.
            pub(in crate::runtime) fn load(
                module: &crate::runtime::kernels::KernelModule,
            ) -> crate::error::Result<Self> {
                Ok(Self {
                    $($field: module.function($kernel)?,)*
                })
            }
        }
    };
}
pub(super) use kernel_set;

/// Each family's file, and the kernels its set loads in a context of `dtype` (fused
/// attention's in fp16 only): for the tests, which find each kernel defined in that file and
/// as an entry of the PTX.
#[cfg(test)]
pub(crate) fn kernel_families(dtype: DType) -> [(&'static str, &'static str, Vec<String>); 9] {
    let names = |names: &[&str]| names.iter().map(|n| n.to_string()).collect();
    [
        (
            "steps/elementwise.cu",
            include_str!("steps/elementwise.cu"),
            names(ElementwiseKernels::NAMES),
        ),
        (
            "steps/conv.cu",
            include_str!("steps/conv.cu"),
            names(ConvKernels::NAMES),
        ),
        (
            "steps/stem.cu",
            include_str!("steps/stem.cu"),
            names(StemKernels::NAMES),
        ),
        (
            "steps/depthwise.cu",
            include_str!("steps/depthwise.cu"),
            names(DepthwiseKernels::NAMES),
        ),
        (
            "steps/quant.cu",
            include_str!("steps/quant.cu"),
            names(QuantKernels::NAMES),
        ),
        (
            "steps/pool.cu",
            include_str!("steps/pool.cu"),
            names(PoolKernels::NAMES),
        ),
        (
            "steps/rows.cu",
            include_str!("steps/rows.cu"),
            names(RowKernels::NAMES),
        ),
        (
            "preprocess.cu",
            include_str!("preprocess.cu"),
            names(PreprocessKernels::NAMES),
        ),
        (
            "steps/attention.cu",
            include_str!("steps/attention.cu"),
            Attention::names(dtype),
        ),
    ]
}

/// A grid-stride launch over `n` elements: blocks of 256 threads, at most 16 per SM.
pub(super) fn grid(sm_count: u32, n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, sm_count as usize * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row, 8 rows a block (the `*_warp` kernels).
pub(super) fn warp_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `ROW_BLOCK` threads per row (`softmax_block`, `softmax_rows`,
/// `layernorm_rows`, `mean_rows`).
pub(super) fn block_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (crate::abi::ROW_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}
