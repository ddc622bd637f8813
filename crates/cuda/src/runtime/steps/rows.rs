// SPDX-License-Identifier: MPL-2.0
//! Launching the steps over rows (rows.cu): a warp a row where the row fits in a warp's
//! registers, else a block.

use cudarc::driver::{CudaFunction, LaunchConfig};

use cudarc::driver::PushKernelArg;

use super::super::Runtime;
use super::super::kernels::{block_rows, kernel_set, warp_rows};
use super::{GpuStep, launch};
use crate::abi::{SOFTMAX_WARP_MAX, WARP_ROW_MAX};
use crate::error::Result;
use crate::runtime::Prepared;
use trtclassify_compiler::plan::{LayerNormStep, Loc, LrnStep, RowMeanStep, SoftmaxStep};

kernel_set! {
    /// rows.cu's kernels: `*_warp` a warp a row, `*_block` and `*_rows` a block a row, the
    /// row in registers or read again a pass (`warp_rows`, `block_rows`); `*_f32` the softmax
    /// in place on the scores, f32 in every plan.
    RowKernels {
        softmax: "softmax_rows",
        softmax_block: "softmax_block",
        softmax_warp: "softmax_warp",
        softmax_f32: "softmax_rows_f32",
        softmax_block_f32: "softmax_block_f32",
        softmax_warp_f32: "softmax_warp_f32",
        layernorm: "layernorm_rows",
        layernorm_warp: "layernorm_warp",
        /// 16 bytes a load.
        layernorm_warp_vec: "layernorm_warp_vec",
        mean: "mean_rows",
        mean_warp: "mean_warp",
        lrn: "lrn_nhwc",
    }
}

/// The kernel that takes a softmax's rows of a length (rows.cu's `softmax_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SoftmaxKernel {
    /// `softmax_warp`: a warp a row, held in registers.
    Warp,
    /// `softmax_block`: a block a row, held in registers.
    Block,
    /// `softmax_rows`: a block a row, read again for each pass.
    Rows,
}

impl SoftmaxKernel {
    /// The kernel for rows of `len`.
    pub(crate) fn of(len: usize) -> Self {
        if len <= SOFTMAX_WARP_MAX {
            Self::Warp
        } else if len <= WARP_ROW_MAX {
            Self::Block
        } else {
            Self::Rows
        }
    }

    /// Its launch over `rows` rows.
    pub(crate) fn launch(self, rows: usize) -> LaunchConfig {
        match self {
            Self::Warp => warp_rows(rows),
            Self::Block | Self::Rows => block_rows(rows),
        }
    }
}

impl GpuStep for SoftmaxStep {
    fn enqueue(&self, rt: &Runtime, _: &Prepared) -> Result<()> {
        rt.softmax(self)
    }
}

impl GpuStep for RowMeanStep {
    fn enqueue(&self, rt: &Runtime, _: &Prepared) -> Result<()> {
        rt.row_mean(self.rows, self.len, self.x, self.y)
    }
}

impl GpuStep for LayerNormStep {
    fn enqueue(&self, rt: &Runtime, _: &Prepared) -> Result<()> {
        rt.layer_norm(self)
    }
}

impl GpuStep for LrnStep {
    fn enqueue(&self, rt: &Runtime, _: &Prepared) -> Result<()> {
        rt.lrn(self)
    }
}

impl Runtime {
    /// Softmax along rows of `len`: a warp a row where it fits in a warp's registers, a block
    /// holding the row where it fits in the block's, else a block reading it a pass.
    fn softmax(&self, step: &SoftmaxStep) -> Result<()> {
        let SoftmaxStep {
            rows,
            len,
            x,
            bias,
            y,
        } = *step;
        // On the scores, in place, the softmax reads and writes f32 (`lower::scores`).
        let k = &self.writes(y).0?.rows;
        let (warp, block, rows_kernel) = match y {
            Loc::Output(_) => (&k.softmax_warp_f32, &k.softmax_block_f32, &k.softmax_f32),
            _ => (&k.softmax_warp, &k.softmax_block, &k.softmax),
        };
        let (xp, yp, bp) = (self.ptr(x), self.ptr(y), bias.map_or(0, |b| self.ptr(b)));
        let (rowsi, leni) = (rows as i32, len as i32);
        let kernel = SoftmaxKernel::of(len);
        let mut l = self.stream.launch_builder(match kernel {
            SoftmaxKernel::Warp => warp,
            SoftmaxKernel::Block => block,
            SoftmaxKernel::Rows => rows_kernel,
        });
        l.arg(&xp).arg(&bp).arg(&yp);
        if kernel == SoftmaxKernel::Warp {
            l.arg(&rowsi);
        }
        l.arg(&leni);
        launch(l, kernel.launch(rows))
    }

    /// The mean of each row of `len`: a warp a row for rows of up to `WARP_ROW_MAX`, else a
    /// block.
    fn row_mean(&self, rows: usize, len: usize, x: Loc, y: Loc) -> Result<()> {
        let k = &self.writes(y).0?.rows;
        if len <= WARP_ROW_MAX {
            let (xp, yp) = (self.ptr(x), self.ptr(y));
            let (rowsi, leni) = (rows as i32, len as i32);
            let mut l = self.stream.launch_builder(&k.mean_warp);
            l.arg(&xp).arg(&yp).arg(&rowsi).arg(&leni);
            return launch(l, warp_rows(rows));
        }
        self.block_per_row(&k.mean, rows, len, x, y)
    }

    /// A kernel `func(x, y, len)` that takes a block per row.
    fn block_per_row(
        &self,
        func: &CudaFunction,
        rows: usize,
        len: usize,
        x: Loc,
        y: Loc,
    ) -> Result<()> {
        let (xp, yp, leni) = (self.ptr(x), self.ptr(y), len as i32);
        let mut l = self.stream.launch_builder(func);
        l.arg(&xp).arg(&yp).arg(&leni);
        launch(l, block_rows(rows))
    }

    /// Layer normalisation along rows: a warp a row where it fits in registers, else a block.
    fn layer_norm(&self, step: &LayerNormStep) -> Result<()> {
        let LayerNormStep {
            rows,
            len,
            epsilon,
            x,
            scale,
            bias,
            y,
        } = step;
        let (xp, yp, sp) = (self.ptr(*x), self.ptr(*y), self.ptr(*scale));
        let bp = bias.map_or(0, |b| self.ptr(b));
        let (rowsi, leni) = (*rows as i32, *len as i32);
        let (k, dtype) = self.writes(*y);
        let k = &k?.rows;
        if *len <= WARP_ROW_MAX {
            // 16-byte loads where every row and the scale and bias start 16-byte aligned.
            let vec = 16 / dtype.size();
            let aligned =
                len.is_multiple_of(vec) && [xp, yp, sp, bp].iter().all(|p| p.is_multiple_of(16));
            let kernel = match aligned {
                true => &k.layernorm_warp_vec,
                false => &k.layernorm_warp,
            };
            let mut l = self.stream.launch_builder(kernel);
            l.arg(&xp)
                .arg(&yp)
                .arg(&sp)
                .arg(&bp)
                .arg(&rowsi)
                .arg(&leni)
                .arg(epsilon);
            return launch(l, warp_rows(*rows));
        }
        let mut l = self.stream.launch_builder(&k.layernorm);
        l.arg(&xp)
            .arg(&yp)
            .arg(&sp)
            .arg(&bp)
            .arg(&leni)
            .arg(epsilon);
        launch(l, block_rows(*rows))
    }

    /// Local response normalisation across the channels of an NHWC tensor.
    fn lrn(&self, step: &LrnStep) -> Result<()> {
        let LrnStep {
            pixels,
            c,
            size,
            alpha,
            beta,
            bias,
            x,
            y,
        } = step;
        let (xp, yp) = (self.ptr(*x), self.ptr(*y));
        let (pi, ci, si) = (*pixels as i64, *c as i32, *size as i32);
        let mut l = self.stream.launch_builder(&self.writes(*y).0?.rows.lrn);
        l.arg(&xp).arg(&yp).arg(&pi).arg(&ci).arg(&si);
        l.arg(alpha).arg(beta).arg(bias);
        launch(l, self.launch_cfg(pixels * c))
    }
}
