// SPDX-License-Identifier: MPL-2.0
//! The kernels' source, put together from the family files (`prelude.cu`, `preprocess.cu`,
//! `steps/*.cu`) and what abi.rs generates; compiled by NVRTC for the GPU at hand, loaded
//! into the context; and the launch shapes the kernels expect.

use std::sync::{Arc, LazyLock};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};

use crate::abi;
use crate::error::{Error, Result};
use trtclassify_compiler::plan::{ATTENTION_HEAD_DIMS, DType, attention_takes};

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
            include_str!("steps/pool.cu"),
            include_str!("steps/rows.cu"),
            include_str!("preprocess.cu"),
            include_str!("steps/attention.cu"),
        ]
        .join("\n")
    });
    &SOURCE
}

/// Compiles the kernels for `dtype` and the compute capability `arch` (major, minor).
pub fn compile(dtype: DType, arch: (i32, i32)) -> Result<String> {
    let mut options = vec![format!("--gpu-architecture=compute_{}{}", arch.0, arch.1)];
    if dtype == DType::F16 {
        options.push("-DHALF".into());
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options,
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(source(), opts)
        .map(|ptx| ptx.to_src())
        .map_err(Error::Nvrtc)
}

/// The kernels, loaded.
pub(super) struct Kernels {
    pub(super) ew: CudaFunction,
    pub(super) ew_from_f32: CudaFunction,
    pub(super) ew_to_f32: CudaFunction,
    pub(super) ew_f32: CudaFunction,
    pub(super) ew_vec: CudaFunction,
    pub(super) bias_act: CudaFunction,
    pub(super) bias_act_vec: CudaFunction,
    pub(super) pool: CudaFunction,
    pub(super) pool_vec: CudaFunction,
    pub(super) global_avg: CudaFunction,
    pub(super) softmax: CudaFunction,
    pub(super) softmax_warp: CudaFunction,
    pub(super) softmax_f32: CudaFunction,
    pub(super) softmax_warp_f32: CudaFunction,
    pub(super) layernorm: CudaFunction,
    pub(super) layernorm_warp: CudaFunction,
    pub(super) layernorm_warp_vec: CudaFunction,
    pub(super) mean: CudaFunction,
    pub(super) mean_warp: CudaFunction,
    pub(super) lrn: CudaFunction,
    pub(super) preprocess_rows: CudaFunction,
    pub(super) preprocess_cols: CudaFunction,
    /// Fused attention (fp16 only): on tensor cores by head sizes (dk, dv) from sm_80 on,
    /// else a warp per query.
    pub(super) attention: Attention,
}

/// The fused attention kernels a context has.
pub(super) enum Attention {
    /// fp32 kernels: none (`check_plan` keeps attention steps out of fp32 plans).
    None,
    /// A GPU without mma.sync's fp16 m16n8k16 (before sm_80).
    Rows(CudaFunction),
    /// Tensor-core kernels by (dk, dv), and the row kernel.
    TensorCores(Vec<((usize, usize), CudaFunction)>),
}

impl Kernels {
    /// Loads the compiled kernels `ptx` into `ctx`.
    pub(super) fn load(ctx: &Arc<CudaContext>, ptx: &str, dtype: DType) -> Result<Self> {
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(Error::driver("module load"))?;
        let f = |name: &str| module.load_function(name).map_err(Error::driver("kernel"));
        let major = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(Error::driver("attribute"))?;
        let attention = match (dtype, major >= 8) {
            (DType::F32, _) => Attention::None,
            (DType::F16, false) => Attention::Rows(f("attention_rows")?),
            (DType::F16, true) => {
                let dims = ATTENTION_HEAD_DIMS;
                let pairs = dims
                    .iter()
                    .flat_map(|&dk| dims.iter().map(move |&dv| (dk, dv)))
                    .filter(|&(dk, dv)| attention_takes(dk, dv));
                Attention::TensorCores(
                    pairs
                        .map(|(dk, dv)| Ok(((dk, dv), f(&format!("attention_{dk}_{dv}"))?)))
                        .collect::<Result<_>>()?,
                )
            }
        };
        Ok(Kernels {
            ew: f("ew")?,
            ew_from_f32: f("ew_from_f32")?,
            ew_to_f32: f("ew_to_f32")?,
            ew_f32: f("ew_f32")?,
            ew_vec: f("ew_vec")?,
            bias_act: f("bias_act")?,
            bias_act_vec: f("bias_act_vec")?,
            pool: f("pool_nhwc")?,
            pool_vec: f("pool_nhwc_vec")?,
            global_avg: f("global_avg_nhwc")?,
            softmax: f("softmax_rows")?,
            softmax_warp: f("softmax_warp")?,
            softmax_f32: f("softmax_rows_f32")?,
            softmax_warp_f32: f("softmax_warp_f32")?,
            layernorm: f("layernorm_rows")?,
            layernorm_warp: f("layernorm_warp")?,
            layernorm_warp_vec: f("layernorm_warp_vec")?,
            mean: f("mean_rows")?,
            mean_warp: f("mean_warp")?,
            lrn: f("lrn_nhwc")?,
            preprocess_rows: f("preprocess_rows")?,
            preprocess_cols: f("preprocess_cols")?,
            attention,
        })
    }
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

/// One block of 256 threads per row (`softmax_rows`, `layernorm_rows`, `mean_rows`).
pub(super) fn block_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}
