// SPDX-License-Identifier: MPL-2.0
//! Launching fused attention (attention.cu): tensor cores where the heads have a kernel.

use cudarc::driver::LaunchConfig;

use cudarc::driver::PushKernelArg;

use super::super::Runtime;
use super::super::kernels::Attention;
use super::{GpuStep, launch};
use crate::abi::AttnParams;
use crate::error::{Error, Result};
use crate::runtime::Prepared;
use trtclassify_compiler::plan::{AttentionStep, Rows};

impl GpuStep for AttentionStep {
    fn enqueue(&self, rt: &Runtime, _: &Prepared) -> Result<()> {
        rt.attention(self)
    }
}

impl Runtime {
    /// Fused attention: a block per matrix and 64 queries on tensor cores, else a block per
    /// matrix and 8 queries.
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
                let func = kernels
                    .iter()
                    .find(|(dims, _)| *dims == (a.dk, a.dv))
                    .map(|(_, f)| f)
                    .ok_or(Error::Plan("attention heads without a kernel"))?;
                (func, 64, 128)
            }
            Attention::Rows(func) => (func, 8, 256),
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
