// SPDX-License-Identifier: MPL-2.0
//! Launching element-wise steps (elementwise.cu) and zeroing.

use cudarc::driver::PushKernelArg;

use super::super::Runtime;
use super::super::kernels::kernel_set;
use super::{GpuStep, launch};
use crate::abi::{EW_SCALAR_CHUNK, EwParams};
use crate::error::{Error, Result};
use crate::runtime::Prepared;
use trtclassify_compiler::plan::{Cast, DType, EwStep, Loc, Strided, ZeroStep};

kernel_set! {
    /// elementwise.cu's kernels: on operands of the plan's type (of the step's, f32, for a
    /// node kept in f32), and the casts in and out of f32.
    ElementwiseKernels {
        ew: "ew",
        ew_from_f32: "ew_from_f32",
        ew_to_f32: "ew_to_f32",
        ew_f32: "ew_f32",
        /// 16 bytes a thread.
        ew_vec: "ew_vec",
    }
}

impl GpuStep for EwStep {
    fn enqueue(&self, rt: &Runtime, _: &Prepared) -> Result<()> {
        let dtype = match self.cast {
            Cast::Wide => DType::F32,
            _ => rt.dtype,
        };
        let b = self.b.as_ref();
        let p = EwParams::new(self.op, self.act, dtype, &self.dims, &self.out, &self.a, b);
        rt.elementwise(&p, self.cast, &self.dims, &self.out, &self.a, b)
    }
}

impl GpuStep for ZeroStep {
    fn enqueue(&self, rt: &Runtime, _: &Prepared) -> Result<()> {
        rt.zero(self.loc, self.len)
    }
}

impl Runtime {
    /// `out = act(op(a, b))`: 16 bytes a thread where the operands allow it.
    pub(super) fn elementwise(
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
        let func = match cast {
            Cast::None | Cast::Wide if vectorised => &k.ew.ew_vec,
            Cast::None | Cast::Wide => &k.ew.ew,
            Cast::FromF32 => &self.kernels.ew.ew_from_f32,
            Cast::ToF32 => &self.kernels.ew.ew_to_f32,
            Cast::F32 => &self.kernels.ew.ew_f32,
        };
        let p = p.chunked(if vectorised { vec } else { EW_SCALAR_CHUNK });
        let mut l = self.stream.launch_builder(func);
        l.arg(&p).arg(&o).arg(&x).arg(&y);
        launch(l, self.launch_cfg(p.items as usize))
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
