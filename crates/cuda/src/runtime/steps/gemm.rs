// SPDX-License-Identifier: MPL-2.0
//! Launching matrix products: cuBLASLt, its epilogue, and an element-wise pass for an
//! activation the epilogue cannot take.

use std::ffi::c_void;

use cudarc::cublaslt::result as ltr;

use super::super::Runtime;
use super::super::cublaslt::GemmDescs;
use super::{EightBit, GpuStep};
use crate::abi::EwParams;
use crate::error::{Error, Result};
use crate::runtime::Prepared;
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{Cast, DType, GemmStep, Loc, StepKind, Strided};

impl GpuStep for GemmStep {
    fn enqueue(&self, rt: &Runtime, prepared: &Prepared) -> Result<()> {
        if let Some(enqueued) = rt.quantized(EightBit::of_gemm(self), prepared) {
            return enqueued;
        }
        let Prepared::Gemm(g) = prepared else {
            return Err(Error::Plan("a step without its prepared descriptors"));
        };
        rt.gemm(g, self.alpha, self.x, self.w, self.residual, self.y)?;
        if g.act_after == Act::None {
            return Ok(());
        }
        // The activation cuBLASLt could not take, over each product's output in place.
        let dims = [self.batch, self.rows * self.n];
        let whole = Strided {
            loc: self.y,
            strides: vec![self.y_batch as i64, 1],
        };
        let (kind, dtype) = match self.is_wide() {
            true => (Cast::Wide, DType::F32),
            false => (Cast::None, rt.dtype),
        };
        let p = EwParams::new(None, g.act_after, dtype, &dims, &whole, &whole, None);
        rt.elementwise(&p, kind, &dims, &whole, &whole, None)
    }
}

impl Runtime {
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
        self.product(g, alpha, [self.ptr(w), self.ptr(x)], residual, y)
    }

    /// `y = alpha·a·b (+ residual)` with the operands at device addresses `a` and `b`, the
    /// residual as C, bias and activation in cuBLASLt's epilogue (`g`).
    pub(in crate::runtime) fn product(
        &self,
        g: &GemmDescs,
        alpha: f32,
        [a, b]: [u64; 2],
        residual: Option<Loc>,
        y: Loc,
    ) -> Result<()> {
        // A residual comes in as C: d = alpha·a·b + 1·c (+ bias, ReLU in the epilogue).
        let beta = if residual.is_some() { 1.0f32 } else { 0.0 };
        let d = self.ptr(y);
        let c = residual.map_or(d, |z| self.ptr(z));
        let scalars = [
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
        ];
        // SAFETY: live device buffers of the sizes the layouts state; f32 scalars, the
        // descriptors' scale type.
        unsafe { self.matmul(g, scalars, [a, b, c, d]) }
    }

    /// cuBLASLt's `d = alpha·a·b + beta·c` with the descriptors `g`, on the stream.
    ///
    /// # Safety
    /// `a`, `b`, `c` and `d` are live device buffers of the sizes `g`'s layouts state, and
    /// `alpha` and `beta` point to values of `g`'s scale type.
    pub(in crate::runtime) unsafe fn matmul(
        &self,
        g: &GemmDescs,
        [alpha, beta]: [*const c_void; 2],
        [a, b, c, d]: [u64; 4],
    ) -> Result<()> {
        // SAFETY: as the caller promises.
        let r = unsafe {
            ltr::matmul(
                self.cublaslt.raw(),
                g.desc.raw(),
                alpha,
                beta,
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
}
