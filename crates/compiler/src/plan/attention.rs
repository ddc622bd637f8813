// SPDX-License-Identifier: MPL-2.0
//! Fused attention: `softmax(alpha·q·kᵀ + bias)·v` in one kernel, fp16 on tensor cores.

use serde::{Deserialize, Serialize};

use super::{DType, Loc, Span, StepKind};
use crate::check::{self, Types};

/// The head sizes (query/key and value) the fused attention kernel is built for: `dk ≤ dv`,
/// both from this list (the cuda crate's attention.cu instantiates each).
pub const ATTENTION_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Whether the fused attention kernel takes heads of `dk` query/key and `dv` value elements.
pub fn attention_takes(dk: usize, dv: usize) -> bool {
    dk <= dv && ATTENTION_HEAD_DIMS.contains(&dk) && ATTENTION_HEAD_DIMS.contains(&dv)
}

/// Rows of a matrix operand of `AttentionStep`, one matrix per batch index: the elements of a
/// row are contiguous, rows and matrices lie at any stride.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Rows {
    /// Row 0 of matrix 0.
    pub loc: Loc,
    /// The stride of each of the three batch axes, in elements; 0 broadcasts.
    pub batch: [usize; 3],
    /// From one row to the next, in elements; 0 broadcasts.
    pub row: usize,
}

impl Rows {
    /// What `rows × width` matrices over the batch `axes` touch.
    fn span(&self, axes: [usize; 3], rows: usize, width: usize) -> Span {
        let reach = |n: usize, stride: usize| (n.max(1) as i128 - 1) * stride as i128;
        let end = 1
            + axes
                .iter()
                .zip(self.batch)
                .map(|(&n, s)| reach(n, s))
                .sum::<i128>()
            + reach(rows, self.row)
            + width as i128
            - 1;
        Span {
            loc: self.loc,
            start: 0,
            end: if axes.contains(&0) || rows * width == 0 {
                0
            } else {
                end
            },
        }
    }
}

/// Scaled dot-product attention, fused: for each batch index, `y = softmax(alpha·q·kᵀ +
/// bias)·v` over rows of keys, in f32 inside the kernel; the scores are never written. On the
/// GPU it runs on tensor cores (fp16 plans only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionStep {
    /// The batch index as three axes, outermost first (1 where unused): heads, windows,
    /// images.
    pub batch: [usize; 3],
    /// Query rows per matrix (S).
    pub queries: usize,
    /// Key and value rows per matrix (T).
    pub keys: usize,
    /// Elements of a query or key row.
    pub dk: usize,
    /// Elements of a value row, and of an output row.
    pub dv: usize,
    /// Scales `q·kᵀ`, not the bias.
    pub alpha: f32,
    /// `[queries, dk]` per batch index.
    pub q: Rows,
    /// `[keys, dk]` per batch index.
    pub k: Rows,
    /// `[keys, dv]` per batch index.
    pub v: Rows,
    /// `[queries, keys]` added to the scaled scores (position biases, window masks).
    pub bias: Option<Rows>,
    /// `[queries, dv]` per batch index.
    pub y: Rows,
}

impl AttentionStep {
    /// Every operand, with its rows and row width.
    fn operands(&self) -> Vec<(Rows, usize, usize)> {
        let mut all = vec![
            (self.q, self.queries, self.dk),
            (self.k, self.keys, self.dk),
            (self.v, self.keys, self.dv),
            (self.y, self.queries, self.dv),
        ];
        all.extend(self.bias.map(|b| (b, self.queries, self.keys)));
        all
    }

    /// The step computed on the CPU in f32, reading through `read`: the values to write and
    /// where (the simulator's and the CPU runner's attention).
    pub fn run(&self, read: impl Fn(Loc) -> f32) -> Vec<(Loc, f32)> {
        let at = |r: &Rows, i: [usize; 3], row: usize, col: usize| {
            let matrix: usize = i.iter().zip(r.batch).map(|(i, s)| i * s).sum();
            r.loc.offset(matrix + row * r.row + col)
        };
        let [b0, b1, b2] = self.batch;
        let mut out = Vec::with_capacity(b0 * b1 * b2 * self.queries * self.dv);
        for i in (0..b0).flat_map(|a| (0..b1).flat_map(move |b| (0..b2).map(move |c| [a, b, c]))) {
            for s in 0..self.queries {
                let scores: Vec<f32> = (0..self.keys)
                    .map(|t| {
                        let dot: f32 = (0..self.dk)
                            .map(|d| read(at(&self.q, i, s, d)) * read(at(&self.k, i, t, d)))
                            .sum();
                        let bias = self.bias.map_or(0.0, |b| read(at(&b, i, s, t)));
                        self.alpha * dot + bias
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let weights: Vec<f32> = scores.iter().map(|v| (v - max).exp()).collect();
                let sum: f32 = weights.iter().sum();
                for d in 0..self.dv {
                    let acc: f32 = (0..self.keys)
                        .map(|t| weights[t] * read(at(&self.v, i, t, d)))
                        .sum();
                    out.push((at(&self.y, i, s, d), acc / sum));
                }
            }
        }
        out
    }
}

impl StepKind for AttentionStep {
    fn describe(&self) -> String {
        let a = self;
        format!(
            "attention {:?} {}x{} · {}x{}ᵀ · {}x{}{}",
            a.batch,
            a.queries,
            a.dk,
            a.keys,
            a.dk,
            a.keys,
            a.dv,
            if a.bias.is_some() { " +bias" } else { "" }
        )
    }

    fn spans(&self) -> Vec<Span> {
        (self.operands().into_iter())
            .map(|(r, rows, width)| r.span(self.batch, rows, width))
            .collect()
    }

    fn written(&self) -> Span {
        self.y.span(self.batch, self.queries, self.dv)
    }

    /// The outputs may leave gaps between matrices.
    fn writes_all(&self) -> bool {
        false
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        let mut locs = vec![
            &mut self.q.loc,
            &mut self.k.loc,
            &mut self.v.loc,
            &mut self.y.loc,
        ];
        locs.extend(self.bias.as_mut().map(|b| &mut b.loc));
        locs
    }

    fn check(&self, t: &Types) -> Result<(), String> {
        if t.dtype != DType::F16 {
            return Err("fused attention in an fp32 plan: its kernel runs fp16 only".into());
        }
        check::sizes_and_types(self, t)
    }

    /// One block per matrix and 64 or 128 queries: the matrices count in 31 bits (the
    /// grid's x).
    fn sizes_fit(&self) -> bool {
        let int = |v: usize| i32::try_from(v).is_ok();
        let positive = |v: usize| v >= 1 && int(v);
        (self.batch.iter())
            .try_fold(1usize, |n, &d| n.checked_mul(d).filter(|&n| int(n)))
            .is_some()
            && self.batch.into_iter().all(positive)
            && [self.queries, self.keys].into_iter().all(positive)
            && attention_takes(self.dk, self.dv)
    }

    /// The fused attention runs in fp16 only.
    fn types_fit(&self, t: &Types) -> bool {
        (self.spans().iter())
            .filter(|s| s.end > s.start)
            .all(|s| !(t.is_f32)(s.loc))
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for AttentionStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        for (loc, v) in self.run(|loc| m.read(loc, 0)) {
            m.write(loc, 0, v);
        }
    }
}
