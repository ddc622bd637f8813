// SPDX-License-Identifier: MPL-2.0
//! Launching the steps of a plan on the stream: one function per kind of step.

use std::ffi::c_void;

use cudarc::cublaslt::result as ltr;
use cudarc::cudnn::sys as dnn;
use cudarc::driver::{CudaFunction, LaunchArgs, LaunchConfig, PushKernelArg};

use super::cublaslt::GemmDescs;
use super::cudnn::{self, ConvDescs};
use super::kernels::{Attention, Kernels, block_rows, grid, warp_rows};
use super::{Prepared, Runtime};
use crate::abi::{AttnParams, EwParams, PoolParams, WARP_ROW_MAX, act_params};
use crate::error::{Error, Result};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{
    AttentionStep, Cast, ConvStep, DType, EwStep, GemmStep, GlobalAvgPoolStep, LayerNormStep, Loc,
    LrnStep, PoolStep, RowMeanStep, Rows, SoftmaxStep, Step, Strided, Tuned, ZeroStep,
};

/// Launches a kernel whose arguments `args` holds.
fn launch(mut args: LaunchArgs, cfg: LaunchConfig) -> Result<()> {
    // SAFETY: argument types match the kernel's signature (steps/*.cu).
    unsafe { args.launch(cfg) }
        .map(drop)
        .map_err(Error::driver("kernel launch"))
}

impl Runtime {
    /// Enqueues every step of plan `i` on the stream.
    pub(super) fn enqueue(&self, i: usize) -> Result<()> {
        let bp = &self.plans[i];
        for (step, prepared) in bp.plan.steps.iter().zip(&bp.prepared) {
            self.step(step, prepared)?;
        }
        Ok(())
    }

    /// Enqueues `step`, with the descriptors `prepared` for it.
    pub(super) fn step(&self, step: &Step, prepared: &Prepared) -> Result<()> {
        match (step, prepared) {
            (
                Step::Ew(EwStep {
                    op,
                    act,
                    cast,
                    dims,
                    out,
                    a,
                    b,
                }),
                _,
            ) => {
                let dtype = match cast {
                    Cast::Wide => DType::F32,
                    _ => self.dtype,
                };
                let p = EwParams::new(*op, *act, dtype, dims, out, a, b.as_ref());
                self.elementwise(&p, *cast, dims, out, a, b.as_ref())
            }
            (Step::Zero(ZeroStep { loc, len }), _) => self.zero(*loc, *len),
            (Step::Conv(c), Prepared::Conv(d)) => {
                let tuned = c.algo.ok_or(Error::Plan("an untuned convolution"))?;
                self.conv(c, d, &tuned)
            }
            (
                Step::Gemm(GemmStep {
                    batch,
                    alpha,
                    rows,
                    n,
                    x,
                    w,
                    residual,
                    y,
                    y_batch,
                    ..
                }),
                Prepared::Gemm(g),
            ) => {
                self.gemm(g, *alpha, *x, *w, *residual, *y)?;
                if g.act_after == Act::None {
                    return Ok(());
                }
                // The activation cuBLASLt could not take, over each product's output in place.
                let dims = [*batch, rows * n];
                let whole = Strided {
                    loc: *y,
                    strides: vec![*y_batch as i64, 1],
                };
                let (kind, dtype) = match step.is_wide() {
                    true => (Cast::Wide, DType::F32),
                    false => (Cast::None, self.dtype),
                };
                let p = EwParams::new(None, g.act_after, dtype, &dims, &whole, &whole, None);
                self.elementwise(&p, kind, &dims, &whole, &whole, None)
            }
            (Step::Pool(_), _) => self.pool(step),
            (Step::GlobalAvgPool(GlobalAvgPoolStep { n, hw, c, x, y }), _) => {
                self.global_avg_pool(*n, *hw, *c, *x, *y)
            }
            (Step::Softmax(SoftmaxStep { rows, len, x, y }), _) => {
                self.softmax(*rows, *len, *x, *y)
            }
            (Step::RowMean(RowMeanStep { rows, len, x, y }), _) => {
                self.row_mean(*rows, *len, *x, *y)
            }
            (Step::LayerNorm(_), _) => self.layer_norm(step),
            (Step::Lrn(_), _) => self.lrn(step),
            (Step::Attention(a), _) => self.attention(a),
            // No catch-all: a new kind of step fails to compile here until it runs.
            (Step::Conv(_) | Step::Gemm(_), _) => {
                Err(Error::Plan("a step without its prepared descriptors"))
            }
        }
    }

    /// The kernels and the type of a step that writes `y`: f32 for the values of a node kept
    /// in f32 (`Loc::Wide`), else the plan's. (The scores, f32 in every plan, are written by
    /// the casts and kernels of the plan's type made for them.)
    pub(super) fn writes(&self, y: Loc) -> (Result<&Kernels>, DType) {
        match y {
            Loc::Wide(_) => (self.wide_kernels(), DType::F32),
            _ => (Ok(&self.kernels), self.dtype),
        }
    }

    /// The f32 kernels of a mixed-precision engine.
    fn wide_kernels(&self) -> Result<&Kernels> {
        self.wide_kernels
            .as_ref()
            .ok_or(Error::Plan("values kept in f32 without their kernels"))
    }

    /// The threads of a grid-stride launch over `n` elements.
    fn launch_cfg(&self, n: usize) -> LaunchConfig {
        grid(self.sm_count, n)
    }

    /// `out = act(op(a, b))`: 16 bytes a thread where the operands allow it.
    fn elementwise(
        &self,
        p: &EwParams,
        cast: Cast,
        dims: &[usize],
        out: &Strided,
        a: &Strided,
        b: Option<&Strided>,
    ) -> Result<()> {
        let (o, x, y) = (
            self.ptr(out.loc),
            self.ptr(a.loc),
            b.map_or(0, |b| self.ptr(b.loc)),
        );
        let (k, dtype) = match cast {
            Cast::Wide => (self.wide_kernels()?, DType::F32),
            _ => (&self.kernels, self.dtype),
        };
        let vec = 16 / dtype.size();
        let vectorised = matches!(cast, Cast::None | Cast::Wide)
            && vectorisable(
                dims,
                vec,
                &[(&out.strides, o), (&a.strides, x)],
                b.map(|b| (&b.strides[..], y)),
            );
        let (func, threads) = match cast {
            Cast::None | Cast::Wide if vectorised => (&k.ew_vec, p.n as usize / vec),
            Cast::None | Cast::Wide => (&k.ew, p.n as usize),
            Cast::FromF32 => (&self.kernels.ew_from_f32, p.n as usize),
            Cast::ToF32 => (&self.kernels.ew_to_f32, p.n as usize),
            Cast::F32 => (&self.kernels.ew_f32, p.n as usize),
        };
        let mut l = self.stream.launch_builder(func);
        l.arg(p).arg(&o).arg(&x).arg(&y);
        launch(l, self.launch_cfg(threads))
    }

    /// Sets `len` elements at `loc` to zero.
    fn zero(&self, loc: Loc, len: usize) -> Result<()> {
        // SAFETY: a live region of the arena.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.ptr(loc),
                0,
                len * self.writes(loc).1.size(),
                self.stream.cu_stream(),
            )
        }
        .map_err(Error::driver("memset"))
    }

    /// The convolution `c` as `tuned` says: cuDNN's fused call, or cuDNN's convolution then
    /// our bias + activation (+ residual) kernel.
    pub(super) fn conv(&self, c: &ConvStep, d: &ConvDescs, tuned: &Tuned) -> Result<()> {
        let (one, zero) = (1.0f32, 0.0f32);
        let ws = self.ptr_u8(&self.workspace) as *mut c_void;
        let (x, w, y) = (
            self.ptr(c.x) as *const c_void,
            self.ptr(c.weight) as *const c_void,
            self.ptr(c.y) as *mut c_void,
        );
        let algo = cudnn::algo_from(tuned.algo);
        d.set_math(cudnn::math_from(tuned.math), "math type")?;
        // SAFETY: live device buffers of the sizes the descriptors state.
        unsafe {
            if tuned.fused {
                let (z, alpha2) = match c.residual {
                    Some(z) => (self.ptr(z) as *const c_void, 1.0f32),
                    None => (y as *const c_void, 0.0f32),
                };
                return cudnn::check(
                    dnn::cudnnConvolutionBiasActivationForward(
                        self.cudnn.raw(),
                        &one as *const f32 as *const c_void,
                        d.x.raw(),
                        x,
                        d.w.raw(),
                        w,
                        d.conv.raw(),
                        algo,
                        ws,
                        tuned.workspace,
                        &alpha2 as *const f32 as *const c_void,
                        d.y.raw(),
                        z,
                        d.bias.raw(),
                        self.ptr(c.bias) as *const c_void,
                        d.act.raw(),
                        d.y.raw(),
                        y,
                    ),
                    "fused convolution",
                );
            }
            cudnn::check(
                dnn::cudnnConvolutionForward(
                    self.cudnn.raw(),
                    &one as *const f32 as *const c_void,
                    d.x.raw(),
                    x,
                    d.w.raw(),
                    w,
                    d.conv.raw(),
                    algo,
                    ws,
                    tuned.workspace,
                    &zero as *const f32 as *const c_void,
                    d.y.raw(),
                    y,
                ),
                "convolution",
            )?;
        }
        self.bias_act(c)
    }

    /// The bias, activation and residual of the convolution `c`, after cuDNN's unfused call.
    fn bias_act(&self, c: &ConvStep) -> Result<()> {
        let n = c.n * c.k * c.oh * c.ow;
        let (kernels, dtype) = self.writes(c.y);
        let (id, p0, p1) = act_params(c.act, dtype);
        let z = c.residual.map_or(0u64, |z| self.ptr(z));
        let (y, bias) = (self.ptr(c.y), self.ptr(c.bias));
        let (len, channels) = (n as i64, c.k as i32);
        let vec = 16 / dtype.size();
        let (func, threads) =
            match c.k.is_multiple_of(vec) && [y, bias, z].iter().all(|p| p.is_multiple_of(16)) {
                true => (&kernels?.bias_act_vec, n / vec),
                false => (&kernels?.bias_act, n),
            };
        let mut b = self.stream.launch_builder(func);
        b.arg(&y).arg(&bias).arg(&z).arg(&len).arg(&channels);
        b.arg(&id).arg(&p0).arg(&p1);
        launch(b, self.launch_cfg(threads))
    }

    /// `y = alpha·w·x (+ residual)`, bias and activation in cuBLASLt's epilogue (`g`).
    fn gemm(
        &self,
        g: &GemmDescs,
        alpha: f32,
        x: Loc,
        w: Loc,
        residual: Option<Loc>,
        y: Loc,
    ) -> Result<()> {
        // A residual comes in as C: d = alpha·a·b + 1·c (+ bias, ReLU in the epilogue).
        let beta = if residual.is_some() { 1.0f32 } else { 0.0 };
        let (a, b, d) = (self.ptr(w), self.ptr(x), self.ptr(y));
        let c = residual.map_or(d, |z| self.ptr(z));
        // SAFETY: live device buffers of the sizes the layouts state.
        let r = unsafe {
            ltr::matmul(
                self.cublaslt.raw(),
                g.desc.raw(),
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                a as *const c_void,
                g.a.raw(),
                b as *const c_void,
                g.b.raw(),
                c as *const c_void,
                g.c.raw(),
                d as *mut c_void,
                g.c.raw(),
                &g.algo,
                self.ptr_u8(&self.lt_workspace) as *mut c_void,
                self.lt_workspace.len(),
                self.stream.cu_stream() as *mut _,
            )
        };
        r.map_err(Error::cublas("matmul"))
    }

    /// Max or average pooling, NHWC: 16 bytes a thread where the channels allow it.
    fn pool(&self, step: &Step) -> Result<()> {
        let &Step::Pool(PoolStep {
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
        }) = step
        else {
            unreachable!("dispatched by `step`")
        };
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
                true => (&kernels?.pool_vec, outputs / vec),
                false => (&kernels?.pool, outputs),
            };
        let mut l = self.stream.launch_builder(func);
        l.arg(&p).arg(&xp).arg(&yp);
        launch(l, self.launch_cfg(threads))
    }

    /// The mean over `hw` pixels of each of `n` images' `c` channels, NHWC.
    fn global_avg_pool(&self, n: usize, hw: usize, c: usize, x: Loc, y: Loc) -> Result<()> {
        let (xp, yp) = (self.ptr(x), self.ptr(y));
        let (ni, hwi, ci) = (n as i32, hw as i32, c as i32);
        let mut l = self.stream.launch_builder(&self.writes(y).0?.global_avg);
        l.arg(&xp).arg(&yp).arg(&ni).arg(&hwi).arg(&ci);
        let cfg = LaunchConfig {
            grid_dim: ((n * c.div_ceil(32)) as u32, 1, 1),
            block_dim: (32, 32, 1),
            shared_mem_bytes: 0,
        };
        launch(l, cfg)
    }

    /// Softmax along rows of `len`: a warp a row where it fits in registers, else a block.
    fn softmax(&self, rows: usize, len: usize, x: Loc, y: Loc) -> Result<()> {
        // On the scores, in place, the softmax reads and writes f32 (`lower::scores`).
        let k = self.writes(y).0?;
        let (warp, block) = match y {
            Loc::Output(_) => (&k.softmax_warp_f32, &k.softmax_f32),
            _ => (&k.softmax_warp, &k.softmax),
        };
        if len <= WARP_ROW_MAX {
            let (xp, yp) = (self.ptr(x), self.ptr(y));
            let (rowsi, leni) = (rows as i32, len as i32);
            let mut l = self.stream.launch_builder(warp);
            l.arg(&xp).arg(&yp).arg(&rowsi).arg(&leni);
            return launch(l, warp_rows(rows));
        }
        self.block_per_row(block, rows, len, x, y)
    }

    /// The mean of each row of `len`: a warp a row for rows as short as those `softmax` gives
    /// a warp, else a block.
    fn row_mean(&self, rows: usize, len: usize, x: Loc, y: Loc) -> Result<()> {
        let k = self.writes(y).0?;
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
    fn layer_norm(&self, step: &Step) -> Result<()> {
        let Step::LayerNorm(LayerNormStep {
            rows,
            len,
            epsilon,
            x,
            scale,
            bias,
            y,
        }) = step
        else {
            unreachable!("dispatched by `step`")
        };
        let (xp, yp, sp) = (self.ptr(*x), self.ptr(*y), self.ptr(*scale));
        let bp = bias.map_or(0, |b| self.ptr(b));
        let (rowsi, leni) = (*rows as i32, *len as i32);
        let (k, dtype) = self.writes(*y);
        let k = k?;
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

    /// Local response normalisation across the channels of an NHWC tensor.
    fn lrn(&self, step: &Step) -> Result<()> {
        let Step::Lrn(LrnStep {
            pixels,
            c,
            size,
            alpha,
            beta,
            bias,
            x,
            y,
        }) = step
        else {
            unreachable!("dispatched by `step`")
        };
        let (xp, yp) = (self.ptr(*x), self.ptr(*y));
        let (pi, ci, si) = (*pixels as i64, *c as i32, *size as i32);
        let mut l = self.stream.launch_builder(&self.writes(*y).0?.lrn);
        l.arg(&xp).arg(&yp).arg(&pi).arg(&ci).arg(&si);
        l.arg(alpha).arg(beta).arg(bias);
        launch(l, self.launch_cfg(pixels * c))
    }
}

/// Whether the `ew_vec` kernel can run an element-wise step over `dims`: `vec` elements
/// (16 bytes) per thread along the last dimension, which must be a multiple of `vec`,
/// contiguous and 16-byte aligned in each operand (strides, device address), except that
/// `b` may instead be constant along it.
fn vectorisable(
    dims: &[usize],
    vec: usize,
    operands: &[(&[i64], u64)],
    b: Option<(&[i64], u64)>,
) -> bool {
    let Some(&last) = dims.last() else {
        return false;
    };
    let aligned = |(strides, ptr): (&[i64], u64)| {
        matches!(strides.split_last(), Some((1, outer))
            if ptr.is_multiple_of(16) && outer.iter().all(|s| s % vec as i64 == 0))
    };
    last.is_multiple_of(vec)
        && operands.iter().all(|&o| aligned(o))
        && b.is_none_or(|b| b.0.last() == Some(&0) || aligned(b))
}

#[cfg(test)]
mod tests {
    use super::vectorisable;

    #[test]
    fn vector_kernel_needs_a_contiguous_aligned_last_dimension() {
        // SiLU over a whole tensor, fp16 (8 elements in 16 bytes).
        let flat: &[i64] = &[1];
        assert!(vectorisable(
            &[77_070_336],
            8,
            &[(flat, 256), (flat, 512)],
            None
        ));
        assert!(!vectorisable(
            &[77_070_335],
            8,
            &[(flat, 256), (flat, 512)],
            None
        ));
        assert!(!vectorisable(&[64], 8, &[(flat, 256), (flat, 514)], None));
        // A squeeze-excitation scale: [n, hw, c] times [n, 1, c].
        let x: &[i64] = &[3136 * 144, 144, 1];
        let se: &[i64] = &[144, 0, 1];
        assert!(vectorisable(
            &[64, 3136, 144],
            8,
            &[(x, 0), (x, 4096)],
            Some((se, 32))
        ));
        // 20 channels: rows of 20 halves start off 16-byte boundaries.
        let odd: &[i64] = &[3136 * 20, 20, 1];
        assert!(!vectorisable(
            &[64, 3136, 16],
            8,
            &[(odd, 0), (odd, 0)],
            None
        ));
        // b constant along the last dimension (one value per row): read as a scalar.
        let row: &[i64] = &[1, 0];
        let m: &[i64] = &[16, 1];
        assert!(vectorisable(&[4, 16], 8, &[(m, 0), (m, 0)], Some((row, 2))));
        // b strided along the last dimension, or a transposed operand: scalar kernel.
        assert!(!vectorisable(
            &[4, 16],
            8,
            &[(m, 0), (m, 0)],
            Some((&[1, 4], 0))
        ));
        assert!(!vectorisable(&[16, 16], 8, &[(m, 0), (&[1, 16], 0)], None));
        // fp32: 4 elements.
        assert!(vectorisable(
            &[4, 12],
            4,
            &[(&[12, 1], 0), (&[12, 1], 16)],
            None
        ));
        assert!(!vectorisable(&[], 8, &[], None));
    }
}
