// SPDX-License-Identifier: MPL-2.0
//! Launching pooling (pool.cu), and the squeeze-and-excitation gate after a global pool.

use cudarc::driver::LaunchConfig;

use cudarc::driver::PushKernelArg;

use super::super::Runtime;
use super::super::kernels::kernel_set;
use super::{GpuStep, launch};
use crate::abi::{GATE_THREADS, GateParams, PoolParams, act_params};
use crate::error::{Error, Result};
use crate::runtime::Prepared;
use trtclassify_compiler::plan::{DType, GateStep, GlobalAvgPoolStep, Loc, PoolStep};

kernel_set! {
    /// pool.cu's kernels.
    PoolKernels {
        pool: "pool_nhwc",
        /// 16 bytes a thread.
        pool_vec: "pool_nhwc_vec",
        global_avg: "global_avg_nhwc",
        gate: "se_gate",
    }
}

impl GpuStep for PoolStep {
    fn enqueue(&self, rt: &Runtime, _: &Prepared) -> Result<()> {
        rt.pool(self)
    }
}

impl GpuStep for GlobalAvgPoolStep {
    fn enqueue(&self, rt: &Runtime, _: &Prepared) -> Result<()> {
        rt.global_avg_pool(self.n, self.hw, self.c, self.x, self.y)
    }
}

impl GpuStep for GateStep {
    fn enqueue(&self, rt: &Runtime, _: &Prepared) -> Result<()> {
        rt.gate(self)
    }
}

/// The gate kernel's parameters for `g` in a plan of `dtype`.
pub(super) fn gate_params(g: &GateStep, dtype: DType) -> GateParams {
    let (act1, p0, p1) = act_params(g.act1, dtype);
    let (act2, q0, q1) = act_params(g.act2, dtype);
    // `GateStep::sizes_fit` (checked with the plan) holds these within an `int`.
    let int = |v: usize| v as i32;
    GateParams {
        n: int(g.n),
        c: int(g.c),
        r: int(g.r),
        period: int(g.r / gcd(g.r, 8)),
        act1,
        p0,
        p1,
        act2,
        q0,
        q1,
    }
}

/// The launch of the gate kernel for `p`: a block an image.
pub(super) fn gate_launch(p: &GateParams) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (p.n as u32, 1, 1),
        block_dim: (GATE_THREADS as u32, 1, 1),
        shared_mem_bytes: p.shared_bytes() as u32,
    }
}

fn gcd(a: usize, b: usize) -> usize {
    match b {
        0 => a,
        b => gcd(b, a % b),
    }
}

impl Runtime {
    /// Max or average pooling, NHWC: 16 bytes a thread where the channels allow it.
    fn pool(&self, step: &PoolStep) -> Result<()> {
        let &PoolStep {
            n,
            h,
            w,
            c,
            oh,
            ow,
            kernel,
            strides,
            pads,
            max,
            count_include_pad,
            x,
            y,
        } = step;
        let v = [
            n,
            h,
            w,
            c,
            oh,
            ow,
            kernel[0],
            kernel[1],
            strides[0],
            strides[1],
            pads[0],
            pads[1],
            pads[2],
            pads[3],
            usize::from(max),
            usize::from(count_include_pad),
        ];
        let p = PoolParams {
            v: v.map(|x| x as i32),
        };
        let (xp, yp) = (self.ptr(x), self.ptr(y));
        let (kernels, dtype) = self.writes(y);
        let vec = 16 / dtype.size();
        let outputs = n * oh * ow * c;
        let (func, threads) =
            match c.is_multiple_of(vec) && xp.is_multiple_of(16) && yp.is_multiple_of(16) {
                true => (&kernels?.pool.pool_vec, outputs / vec),
                false => (&kernels?.pool.pool, outputs),
            };
        let mut l = self.stream.launch_builder(func);
        l.arg(&p).arg(&xp).arg(&yp);
        launch(l, self.launch_cfg(threads))
    }

    /// The mean over `hw` pixels of each of `n` images' `c` channels, NHWC.
    fn global_avg_pool(&self, n: usize, hw: usize, c: usize, x: Loc, y: Loc) -> Result<()> {
        let (xp, yp) = (self.ptr(x), self.ptr(y));
        let (ni, hwi, ci) = (n as i32, hw as i32, c as i32);
        let mut l = self
            .stream
            .launch_builder(&self.writes(y).0?.pool.global_avg);
        l.arg(&xp).arg(&yp).arg(&ni).arg(&hwi).arg(&ci);
        let cfg = LaunchConfig {
            grid_dim: ((n * c.div_ceil(32)) as u32, 1, 1),
            block_dim: (32, 32, 1),
            shared_mem_bytes: 0,
        };
        launch(l, cfg)
    }

    /// The squeeze-and-excitation gate `g`, a block an image.
    fn gate(&self, g: &GateStep) -> Result<()> {
        let (kernels, dtype) = self.writes(g.y);
        let p = gate_params(g, dtype);
        let (w1, w2) = (self.ptr(g.w1), self.ptr(g.w2));
        if !(w1.is_multiple_of(16) && w2.is_multiple_of(16)) {
            return Err(Error::Plan("a gate's weights are not 16-byte aligned"));
        }
        let bias = |b: Option<Loc>| b.map_or(0, |b| self.ptr(b));
        let (x, b1, b2, y) = (self.ptr(g.x), bias(g.b1), bias(g.b2), self.ptr(g.y));
        let mut l = self.stream.launch_builder(&kernels?.pool.gate);
        l.arg(&p)
            .arg(&x)
            .arg(&w1)
            .arg(&b1)
            .arg(&w2)
            .arg(&b2)
            .arg(&y);
        launch(l, gate_launch(&p))
    }
}
