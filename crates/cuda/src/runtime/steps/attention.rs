// SPDX-License-Identifier: MPL-2.0
//! Launching fused attention (attention.cu): tensor cores where the heads have a kernel.

use cudarc::driver::{CudaFunction, LaunchConfig};

use cudarc::driver::PushKernelArg;

use super::super::Runtime;
use super::super::kernels::KernelModule;
use super::{GpuStep, launch};
use crate::abi::AttnParams;
use crate::error::{Error, Result};
use crate::runtime::Prepared;
use trtclassify_compiler::plan::{
    ATTENTION_HEAD_DIMS, AttentionStep, DType, Rows, attention_takes,
};

/// The fused attention kernels a context has (attention.cu's): not a `kernel_set!`, since
/// which it loads depends on the type and the GPU.
pub(in crate::runtime) enum Attention {
    /// fp32 kernels: none (`check_plan` keeps attention steps out of fp32 plans).
    None,
    /// A GPU without mma.sync's fp16 m16n8k16 (before sm_80).
    Rows(CudaFunction),
    /// Tensor-core kernels by their shape.
    TensorCores(Vec<(AttentionLaunch, CudaFunction)>),
}

/// A tensor-core kernel of attention.cu, as a step launches it: its heads' sizes (dk, dv)
/// and the warps of its block, each taking 16 queries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::runtime) struct AttentionLaunch {
    pub dk: usize,
    pub dv: usize,
    pub warps: u32,
}

impl AttentionLaunch {
    /// The kernel for heads of `dk` and `dv` elements, `queries` queries against as many
    /// keys in each of `matrices` heads, on a GPU of `sm_count` SMs. 8 warps a block share
    /// each tile of keys and values where the queries are many (a ViT's 197 at batch 64 on an
    /// H100: 74 µs against 82 with 4, `bench/gpu/attention.py`); 4 where fewer blocks would
    /// leave the GPU idle (batch 1) or idle warps would hold the block (Swin's windows of
    /// 49).
    pub fn of(
        dk: usize,
        dv: usize,
        matrices: usize,
        queries: usize,
        sm_count: usize,
    ) -> AttentionLaunch {
        let wide = queries > 64 && matrices * queries.div_ceil(128) >= 2 * sm_count;
        AttentionLaunch {
            dk,
            dv,
            warps: if wide { 8 } else { 4 },
        }
    }

    /// The queries a block takes.
    pub fn queries(self) -> usize {
        16 * self.warps as usize
    }

    /// attention.cu's name for it.
    pub fn kernel(self) -> String {
        let AttentionLaunch { dk, dv, warps } = self;
        format!("attention_{dk}_{dv}_{warps}w")
    }
}

impl Attention {
    /// The kernel a warp per query, for GPUs without tensor cores' fp16 products.
    pub(in crate::runtime) const ROWS: &str = "attention_rows";

    /// The row kernel's queries and threads a block: a warp a query.
    pub(in crate::runtime) const ROWS_BLOCK: (usize, u32) = (8, 256);

    /// The sizes of block, in warps of 16 queries, that the tensor-core kernels come in.
    const WARPS: [u32; 2] = [4, 8];

    /// The tensor-core kernels: attention.cu's `ATTENTION(dk, dv, warps, min_blocks)`.
    fn shapes() -> impl Iterator<Item = AttentionLaunch> {
        let dims = ATTENTION_HEAD_DIMS;
        dims.into_iter()
            .flat_map(move |dk| dims.into_iter().map(move |dv| (dk, dv)))
            .filter(|&(dk, dv)| attention_takes(dk, dv))
            .flat_map(|(dk, dv)| Self::WARPS.map(|warps| AttentionLaunch { dk, dv, warps }))
    }

    /// Takes from `module` the kernels its type and GPU run: none in fp32 (attention.cu is
    /// fp16's only), the tensor-core kernels from sm_80 on, else the row kernel.
    pub(in crate::runtime) fn load(module: &KernelModule) -> Result<Self> {
        Ok(match (module.dtype, module.major >= 8) {
            (DType::F32, _) => Attention::None,
            (DType::F16, false) => Attention::Rows(module.function(Self::ROWS)?),
            (DType::F16, true) => Attention::TensorCores(
                Self::shapes()
                    .map(|shape| Ok((shape, module.function(&shape.kernel())?)))
                    .collect::<Result<_>>()?,
            ),
        })
    }

    /// Every kernel of attention.cu that a context of `dtype` may load, whatever its GPU.
    #[cfg(test)]
    pub(in crate::runtime) fn names(dtype: DType) -> Vec<String> {
        match dtype {
            DType::F32 => Vec::new(),
            DType::F16 => std::iter::once(Self::ROWS.to_string())
                .chain(Self::shapes().map(AttentionLaunch::kernel))
                .collect(),
        }
    }
}

impl GpuStep for AttentionStep {
    fn enqueue(&self, rt: &Runtime, _: &Prepared) -> Result<()> {
        rt.attention(self)
    }
}

impl Runtime {
    /// Fused attention: a block per matrix and 64 or 128 queries (`AttentionLaunch::of`) on tensor
    /// cores, else a block per matrix and 8 queries.
    fn attention(&self, a: &AttentionStep) -> Result<()> {
        let (q, k, v, y) = (
            self.ptr(a.q.loc),
            self.ptr(a.k.loc),
            self.ptr(a.v.loc),
            self.ptr(a.y.loc),
        );
        let bias = a.bias.map_or(0, |b| self.ptr(b.loc));
        let strides = |r: &Rows| {
            let [b0, b1, b2] = r.batch;
            [b0, b1, b2, r.row].map(|s| s as i64)
        };
        // 16-byte loads where every row of q, k and v starts on a 16-byte boundary.
        let vec = 16 / self.dtype.size();
        let aligned = |r: &Rows, ptr: u64| {
            ptr.is_multiple_of(16) && strides(r).iter().all(|s| s % vec as i64 == 0)
        };
        let vectorised = aligned(&a.q, q) && aligned(&a.k, k) && aligned(&a.v, v);
        let p = AttnParams {
            batch: a.batch.map(|b| b as i32),
            queries: a.queries as i32,
            keys: a.keys as i32,
            dk: a.dk as i32,
            dv: a.dv as i32,
            vec: i32::from(vectorised),
            alpha: a.alpha,
            pad: 0,
            q: strides(&a.q),
            k: strides(&a.k),
            v: strides(&a.v),
            bias: a.bias.as_ref().map_or([0; 4], strides),
            y: strides(&a.y),
        };
        let matrices = a.batch.iter().product::<usize>() as u32;
        let (func, queries_per_block, threads) = match &self.kernels.attention {
            Attention::TensorCores(kernels) => {
                let shape = AttentionLaunch::of(
                    a.dk,
                    a.dv,
                    matrices as usize,
                    a.queries,
                    self.sm_count as usize,
                );
                let func = kernels
                    .iter()
                    .find(|(s, _)| *s == shape)
                    .map(|(_, f)| f)
                    .ok_or(Error::Plan("attention heads without a kernel"))?;
                (func, shape.queries(), 32 * shape.warps)
            }
            Attention::Rows(func) => (func, Attention::ROWS_BLOCK.0, Attention::ROWS_BLOCK.1),
            Attention::None => return Err(Error::Plan("fused attention in an fp32 engine")),
        };
        let mut l = self.stream.launch_builder(func);
        l.arg(&p).arg(&q).arg(&k).arg(&v).arg(&bias).arg(&y);
        let cfg = LaunchConfig {
            grid_dim: (matrices, a.queries.div_ceil(queries_per_block) as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        launch(l, cfg)
    }
}
