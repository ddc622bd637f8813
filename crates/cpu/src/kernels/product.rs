// SPDX-License-Identifier: MPL-2.0
//! Matrix products: on packed weights (`panels`), or through the `gemm` crate with the
//! epilogue (bias, residual, activation) in one pass over the output; their threads; and the
//! fusion of a following activation into them.

use super::panels::{self, Panels, run_panels};
use super::{Buffers, CpuStep, Out, Packed, Scratch, Threads, activate_with};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{Cast, EwStep, GemmStep, Step, covers_once};

/// Moves an activation that follows a matrix product in place (the lowering's form of
/// everything but ReLU, which cuBLASLt's epilogue takes) into the product's own epilogue.
pub fn fuse_activations(steps: &[Step], packed: &mut [Packed]) {
    for i in 1..steps.len() {
        let (
            Step::Gemm(GemmStep {
                batch, rows, n, y, ..
            }),
            Step::Ew(EwStep {
                op: None,
                act,
                cast: Cast::None,
                dims,
                out,
                a,
                b: None,
            }),
        ) = (&steps[i - 1], &steps[i])
        else {
            continue;
        };
        let in_place = out == a && out.loc == *y;
        if !in_place || !covers_once(dims, &out.strides, batch * rows * n) {
            continue;
        }
        match &mut packed[i - 1] {
            Packed::None => packed[i - 1] = Packed::Activated(*act),
            Packed::Panels(_, fused @ None) => *fused = Some(*act),
            _ => continue,
        }
        packed[i] = Packed::Skip;
    }
}

/// `y = act(alpha · x·w + bias + residual)`, `x` being `rows × k` and `w` `k × n` (rows
/// `n` apart); the epilogue runs over the output once, after the product.
#[derive(Clone, Copy)]
pub(super) struct Product {
    pub(super) rows: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) x: *const f32,
    pub(super) x_stride: usize,
    /// A convolution's taps, read where they lie: then `x` is the image (and `x_stride` 0).
    pub(super) taps: Option<super::conv::Taps>,
    pub(super) w: Weights,
    pub(super) y: *mut f32,
    pub(super) y_stride: usize,
    pub(super) alpha: f32,
    pub(super) bias: Option<*const f32>,
    pub(super) residual: Option<*const f32>,
    pub(super) act: Act,
}

/// The right-hand matrix of a product.
#[derive(Clone, Copy)]
pub(super) enum Weights {
    /// Constant weights packed once, when the plan was loaded (`alpha` in them).
    Panels(*const Panels),
    /// Read as it lies: `ptr` with the elements between consecutive values along k and
    /// along n, `(n, 1)` for a row-major `k × n`, `(1, k)` for one stored transposed.
    Strided {
        ptr: *const f32,
        strides: (usize, usize),
    },
}

// SAFETY: the pointers are into buffers checked for the whole product; the threads of
// `run` each write their own rows (or columns) of the output.
unsafe impl Sync for Product {}

impl Product {
    /// With several threads, each takes a share of the rows, or, with packed weights larger
    /// than the activations (a network's late layers: 49 rows, 2048 columns), a share of
    /// the columns, so that each reads only its part of the weights. (`gemm`'s own split
    /// leaves those small products on one thread.)
    pub(super) fn run(&self, threads: Threads) {
        // Handing out work costs microseconds (tens where the pool's threads sleep): a
        // product smaller than about that (squeeze-and-excitation's) runs on one.
        const SHARED_MIN: usize = 1 << 17;
        let threads = match self.rows * self.k * self.n {
            ..SHARED_MIN => threads.single(),
            _ => threads,
        };
        let t = threads.count;
        if let Weights::Panels(panels) = self.w {
            // SAFETY: the panels outlive the run (the runner holds them).
            let panels = unsafe { &*panels };
            if t < 2 {
                return run_panels(self, panels, 0..self.n, threads);
            }
            if self.n > self.rows {
                let shares = panels::column_shares(self.n, t);
                return threads.for_each(shares.len(), |i| {
                    run_panels(self, panels, shares[i].clone(), threads)
                });
            }
        } else if t < 2 || self.rows < 64 {
            return run_product(self, threads);
        }
        let share = self.rows.div_ceil(t);
        threads.for_each(self.rows.div_ceil(share), |i| {
            let start = i * share;
            // SAFETY: rows `start..start + share` of the same checked buffers.
            let part = unsafe {
                Product {
                    rows: share.min(self.rows - start),
                    x: self.x.add(start * self.x_stride),
                    taps: self.taps.map(|t| t.skip_rows(start)),
                    y: self.y.add(start * self.y_stride),
                    residual: self.residual.map(|z| z.add(start * self.y_stride)),
                    ..*self
                }
            };
            run_product(&part, threads.single());
        });
    }
}

wide! {
    /// The epilogue (an activation such as SiLU over every output) is worth the wide SIMD.
    fn run_product(product: &Product, threads: Threads) => run_product_with
}

#[inline(always)]
fn run_product_with<const FMA: bool>(p: &Product, threads: Threads) {
    let (w, strides) = match p.w {
        // SAFETY: the panels outlive the run (the runner holds them).
        Weights::Panels(panels) => return run_panels(p, unsafe { &*panels }, 0..p.n, threads),
        Weights::Strided { ptr, strides } => (ptr, strides),
    };
    debug_assert!(p.taps.is_none(), "taps are read from packed panels only");
    let n = p.n;
    // A residual that is the output itself is added before the product, which then adds to
    // it; otherwise the product writes and the epilogue adds.
    let in_place = p.residual == Some(p.y as *const f32);
    // SAFETY (all of it): the caller's spans hold `rows` rows of each operand.
    unsafe {
        if in_place {
            epilogue_init(p.y, p.rows, n, p.y_stride, p.bias, Some(p.y));
        }
        if p.rows == 1 && strides.1 == 1 {
            // A vector times a matrix (squeeze-and-excitation, a classifier at batch 1):
            // rows of `w` added up along `n`, where `gemm` spends more on setting up than on
            // the arithmetic.
            let out = std::slice::from_raw_parts_mut(p.y, n);
            if !in_place {
                out.fill(0.0);
            }
            for i in 0..p.k {
                let xi = p.alpha * *p.x.add(i);
                let w = std::slice::from_raw_parts(w.add(i * n), n);
                out.iter_mut().zip(w).for_each(|(o, &w)| *o += xi * w);
            }
        } else {
            gemm::gemm(
                p.rows,
                n,
                p.k,
                p.y,
                1,
                p.y_stride as isize,
                in_place,
                p.x,
                1,
                p.x_stride as isize,
                w,
                strides.1 as isize,
                strides.0 as isize,
                1.0,
                p.alpha,
                false,
                false,
                false,
                threads.gemm(),
            );
        }
        for r in 0..p.rows {
            let out = std::slice::from_raw_parts_mut(p.y.add(r * p.y_stride), n);
            if !in_place {
                if let Some(b) = p.bias {
                    let b = std::slice::from_raw_parts(b, n);
                    out.iter_mut().zip(b).for_each(|(o, &b)| *o += b);
                }
                if let Some(z) = p.residual {
                    let z = std::slice::from_raw_parts(z.add(r * p.y_stride), n);
                    out.iter_mut().zip(z).for_each(|(o, &z)| *o += z);
                }
            }
            activate_with::<FMA>(p.act, out);
        }
    }
}

/// Fills the `rows × n` output (row stride `stride`) with the bias and the residual, which
/// the product is then added to; returns whether there was anything to add to.
pub(super) fn epilogue_init(
    y: *mut f32,
    rows: usize,
    n: usize,
    stride: usize,
    bias: Option<*const f32>,
    residual: Option<*const f32>,
) -> bool {
    if bias.is_none() && residual.is_none() {
        return false;
    }
    for r in 0..rows {
        // SAFETY: checked spans. The residual may be the output itself (added in place).
        unsafe {
            let out = y.add(r * stride);
            for j in 0..n {
                let z = residual.map_or(0.0, |z| *z.add(r * stride + j));
                *out.add(j) = z + bias.map_or(0.0, |b| *b.add(j));
            }
        }
    }
    true
}

impl CpuStep for GemmStep {
    #[inline(always)]
    fn run<const FMA: bool>(
        &self,
        packed: &Packed,
        buf: &Buffers,
        scratch: &mut Scratch,
        threads: Threads,
    ) {
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
            // `PlanRunner::from_plans` refuses quantized plans.
            quant: _,
            // cuBLASLt's algorithm: the GPU's.
            algo: _,
        } = self;
        let mut unscaled = *x;
        let (packed, out) = Out::of(packed, *y, *n);
        debug_assert!(out.stride == *n || (*batch == 1 && residual.is_none()));
        let act = match packed {
            Packed::Activated(act)
            | Packed::Panels(_, Some(act))
            | Packed::ScaledInput { act: Some(act), .. } => *act,
            _ => *act,
        };
        let panels = match packed {
            Packed::Panels(panels, _) => Some(panels),
            Packed::ScaledInput {
                panels, x, scale, ..
            } => {
                // SAFETY: checked span: the scaling step's operand, one value per row
                // of the weights.
                let scale = unsafe { std::slice::from_raw_parts(buf.at(*scale), *k) };
                panels.scale_rows(scale, &mut scratch.scaled);
                unscaled = *x;
                Some(&scratch.scaled)
            }
            _ => None,
        };
        let (x, w, y) = (buf.at(unscaled), buf.at(*w), buf.at_mut(out.y));
        for p in 0..*batch {
            // SAFETY: checked spans of `batch` matrices each.
            let product = unsafe {
                Product {
                    rows: *rows,
                    n: *n,
                    k: *k,
                    x: x.add(p * x_batch),
                    x_stride: *k,
                    taps: None,
                    w: match panels {
                        Some(panels) => Weights::Panels(panels),
                        // Strides along k and along n.
                        None => Weights::Strided {
                            ptr: w.add(p * k * n),
                            strides: if *w_transposed { (1, *k) } else { (*n, 1) },
                        },
                    },
                    y: y.add(p * y_batch),
                    y_stride: out.stride,
                    // Packed weights hold alpha.
                    alpha: if panels.is_some() { 1.0 } else { *alpha },
                    bias: bias.map(|b| buf.at(b).add(p * n)),
                    residual: residual.map(|z| buf.at(z).add(p * y_batch)),
                    act,
                }
            };
            product.run(threads);
        }
    }
}
