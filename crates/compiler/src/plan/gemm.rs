// SPDX-License-Identifier: MPL-2.0
//! The matrix product step: cuBLASLt on the GPU, packed panels on the CPU. It also runs 1×1
//! convolutions and attention's products.

use serde::{Deserialize, Serialize};

use super::{DType, Loc, Quant, Span, StepKind, batched, residual_note};
use crate::check::{self, Types};
use crate::ir::Act;

/// `y[rows, n] = act(x[rows, k] · w[k, n] + bias + residual)`, act being None, Relu or,
/// in fp16 plans, Gelu (cuBLASLt's epilogue). Also runs 1×1 convolutions, NHWC being
/// `[pixels, channels]`.
/// With `batch` above 1, that many products of consecutive `w` matrices, each with its
/// own `x` and `y` (attention, where `w` is computed too) or all of one `x` (the query,
/// key and value of one input, `ops::matmul`'s `products_of_one_x`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GemmStep {
    /// Products run; 1 for a single product.
    pub batch: usize,
    /// Scales the product (not the bias or the residual).
    pub alpha: f32,
    /// Rows of `x` and `y` (pixels for a 1×1 convolution).
    pub rows: usize,
    /// Columns of `w` and `y` (output channels for a 1×1 convolution).
    pub n: usize,
    /// Columns of `x` and rows of `w`: the dimension summed over.
    pub k: usize,
    /// Row-major `[rows, k]` matrices, `x_batch` elements apart.
    pub x: Loc,
    /// Elements from one product's `x` to the next's: `rows · k`, or 0 where every
    /// product reads the same `x`.
    pub x_batch: usize,
    /// Row-major `[batch, k, n]`, or `[batch, n, k]` where `w_transposed`.
    pub w: Loc,
    /// Whether `w` holds the transpose of each matrix the product reads (attention's
    /// keys, `q · kᵀ`), read in place instead of copied into `[k, n]` order.
    pub w_transposed: bool,
    /// `n` values added to every row; with `batch` above 1, `[batch, n]`: each product's
    /// own.
    pub bias: Option<Loc>,
    /// Laid out as `y`, added after the scaling by `alpha`.
    pub residual: Option<Loc>,
    /// The activation that follows: `Act::None`, `Act::Relu`, or `Act::Gelu` in fp16
    /// plans, which the GPU applies in cuBLASLt's tanh form: it differs from the erf form
    /// by at most 4.7e-4 (at x ≈ 2.7, where fp16's step is 2e-3), so that the fp16 results
    /// differ by one step at most.
    pub act: Act,
    /// Row-major `[rows, n]` matrices, `y_batch` elements apart; in f32 where it is the
    /// output buffer (the scores of an fp16 plan, computed in f32 so that they cannot
    /// overflow fp16).
    pub y: Loc,
    /// Elements from one product's `y` to the next's: at least `rows · n` (more where
    /// each starts aligned as a buffer of its own would).
    pub y_batch: usize,
    /// Whether `x` and `w` are read rounded to 8 bits (`crate::quant`); `w_scales` holds
    /// `[batch, n]` scales. Absent from engine files of unquantized plans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quant: Option<Quant>,
    /// The algorithm the GPU runs it with, chosen by timing at build: cuBLASLt's
    /// `cublasLtMatmulAlgo_t` as its 8 words, which cuBLASLt documents as stored and used
    /// again with the same library version (an engine file is keyed to it). `None` until
    /// tuned, and on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algo: Option<[u64; 8]>,
}

impl StepKind for GemmStep {
    fn describe(&self) -> String {
        let g = self;
        format!(
            "gemm {}x{} {}x{} · {}x{}{}{}{}{}{}{}",
            g.batch,
            if g.batch > 1 && g.x_batch == 0 {
                " of one x"
            } else {
                ""
            },
            g.rows,
            g.k,
            g.k,
            g.n,
            if g.w_transposed { "ᵀ" } else { "" },
            if g.alpha == 1.0 {
                String::new()
            } else {
                format!(" ×{}", g.alpha)
            },
            match g.act {
                Act::None => String::new(),
                act => format!(" {act:?}"),
            },
            residual_note(g.residual, g.y),
            if matches!(g.y, Loc::Output(_)) {
                " -> f32 scores"
            } else {
                ""
            },
            super::quant_note(g.quant)
        )
    }

    fn spans(&self) -> Vec<Span> {
        let g = self;
        let mut spans = vec![
            batched(g.x, g.batch, g.x_batch, g.rows * g.k),
            Span::dense(g.w, &[g.batch, g.k, g.n]),
            self.written(),
        ];
        spans.extend(g.bias.map(|b| Span::dense(b, &[g.batch, g.n])));
        spans.extend((g.residual).map(|r| batched(r, g.batch, g.y_batch, g.rows * g.n)));
        spans.extend((g.quant).map(|q| Span::dense(q.w_scales, &[g.batch, g.n])));
        spans
    }

    fn written(&self) -> Span {
        batched(self.y, self.batch, self.y_batch, self.rows * self.n)
    }

    /// Products of several matrices may leave gaps between their outputs.
    fn writes_all(&self) -> bool {
        self.batch == 1
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        let mut locs = vec![&mut self.x, &mut self.w, &mut self.y];
        locs.extend(self.bias.as_mut());
        locs.extend(self.residual.as_mut());
        locs.extend(self.quant.as_mut().map(|q| &mut q.w_scales));
        locs
    }

    /// The activations cuBLASLt's epilogue applies come first, and a quantized product's
    /// own rules (`super::check_quant`).
    fn check(&self, t: &Types) -> Result<(), String> {
        super::check_quant(self, self.quant, t)?;
        let epilogue = match self.act {
            Act::None | Act::Relu => true,
            Act::Gelu => t.dtype == DType::F16 && !self.is_wide(),
            _ => false,
        };
        if !epilogue {
            return Err(format!(
                "{:?} in a matrix product's epilogue in {:?}",
                self.act, t.dtype
            ));
        }
        check::sizes_and_types(self, t)
    }

    fn sizes_fit(&self) -> bool {
        let positive = |v: usize| v >= 1 && i32::try_from(v).is_ok();
        // The products' outputs do not overlap.
        [self.batch, self.rows, self.n, self.k]
            .into_iter()
            .all(positive)
            && (self.batch == 1 || self.y_batch >= self.rows * self.n)
    }

    /// A product may write the scores in f32 (`lower::scores`), with neither a bias nor a
    /// residual in the plan's type beside them in cuBLASLt's epilogue.
    fn types_fit(&self, t: &Types) -> bool {
        let is_f32 = t.is_f32;
        match self {
            GemmStep {
                x,
                w,
                bias: None,
                residual: None,
                y: y @ Loc::Output(_),
                ..
            } if !t.plain() && !is_f32(*x) => !is_f32(*w) && is_f32(*y),
            // The scales are f32 constants beside operands of the plan's type.
            GemmStep { quant: Some(_), .. } => t.uniform(&GemmStep {
                quant: None,
                ..self.clone()
            }),
            _ => t.uniform(self),
        }
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for GemmStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        let GemmStep {
            batch,
            alpha,
            rows,
            n,
            k,
            x,
            x_batch,
            w,
            bias,
            residual,
            act,
            y,
            y_batch,
            w_transposed,
            quant,
            algo: _,
        } = *self;
        let (w_row, w_col) = if w_transposed { (1, k) } else { (n, 1) };
        // What the kernel reads: the operands as they are, or rounded to 8 bits.
        let read_x = |m: &crate::sim::Memory, i| match quant {
            Some(q) => q.format.fake(m.read(x, i), q.x_scale),
            None => m.read(x, i),
        };
        let read_w = |m: &crate::sim::Memory, i, column| match quant {
            Some(q) => q.format.fake(m.read(w, i), m.read(q.w_scales, column)),
            None => m.read(w, i),
        };
        for p in 0..batch {
            let (xo, wo, yo) = (p * x_batch, p * k * n, p * y_batch);
            for r in 0..rows {
                for j in 0..n {
                    let mut dot = 0.0;
                    for i in 0..k {
                        dot += read_x(m, xo + r * k + i)
                            * read_w(m, wo + i * w_row + j * w_col, p * n + j);
                    }
                    let mut acc = alpha * dot + bias.map_or(0.0, |b| m.read(b, p * n + j));
                    if let Some(z) = residual {
                        acc += m.read(z, yo + r * n + j);
                    }
                    m.write(y, yo + r * n + j, act.apply(acc));
                }
            }
        }
    }
}
