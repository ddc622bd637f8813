// SPDX-License-Identifier: MPL-2.0
//! Launching pooling (pool.cu).

use cudarc::driver::LaunchConfig;

use cudarc::driver::PushKernelArg;

use super::super::Runtime;
use super::super::kernels::kernel_set;
use super::{GpuStep, launch};
use crate::abi::PoolParams;
use crate::error::Result;
use crate::runtime::Prepared;
use trtclassify_compiler::plan::{GlobalAvgPoolStep, Loc, PoolStep};

kernel_set! {
    /// pool.cu's kernels.
    PoolKernels {
        pool: "pool_nhwc",
        /// 16 bytes a thread.
        pool_vec: "pool_nhwc_vec",
        global_avg: "global_avg_nhwc",
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
}
