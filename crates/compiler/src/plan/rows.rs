// SPDX-License-Identifier: MPL-2.0
//! Steps over the rows of a matrix: softmax, layer normalisation, the mean of each row, and
//! local response normalisation (across the channels of each pixel).

use serde::{Deserialize, Serialize};

use super::{Loc, Span, StepKind};
use crate::check::Types;

fn positive(values: &[usize]) -> bool {
    values.iter().all(|&v| v >= 1 && i32::try_from(v).is_ok())
}

/// Softmax over each row of `x` plus `bias`, `[rows, len]` in and out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SoftmaxStep {
    /// Rows, each normalised on its own.
    pub rows: usize,
    /// Elements per row: the softmax axis, innermost.
    pub len: usize,
    /// The input, `[rows, len]`.
    pub x: Loc,
    /// `len` values in the plan's type added to every row first: the bias of the product
    /// that wrote the scores (`lower::scores`), which then takes no step of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias: Option<Loc>,
    /// The output, `[rows, len]`.
    pub y: Loc,
}

impl StepKind for SoftmaxStep {
    fn describe(&self) -> String {
        let bias = if self.bias.is_some() { " +bias" } else { "" };
        format!("softmax {}x{}{bias}", self.rows, self.len)
    }

    fn spans(&self) -> Vec<Span> {
        let mut spans = vec![Span::dense(self.x, &[self.rows, self.len])];
        spans.extend(self.bias.map(|b| Span::dense(b, &[self.len])));
        spans.push(self.written());
        spans
    }

    fn written(&self) -> Span {
        Span::dense(self.y, &[self.rows, self.len])
    }

    fn writes_all(&self) -> bool {
        true
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        let mut locs = vec![&mut self.x];
        locs.extend(self.bias.as_mut());
        locs.push(&mut self.y);
        locs
    }

    fn sizes_fit(&self) -> bool {
        positive(&[self.rows, self.len])
    }

    /// A softmax of the scores reads and writes them in f32, in place, and its bias in the
    /// plan's type.
    fn types_fit(&self, t: &Types) -> bool {
        let bias_fits = || {
            (self.bias).is_none_or(|b| t.plain() || !(t.is_f32)(b) && !matches!(b, Loc::Input(_)))
        };
        match (self.x, self.y) {
            (Loc::Output(a), Loc::Output(b)) => t.plain() || a == b && bias_fits(),
            (Loc::Output(_), _) | (_, Loc::Output(_)) => t.plain(),
            _ => t.uniform(self),
        }
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for SoftmaxStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        let SoftmaxStep {
            rows,
            len,
            x,
            bias,
            y,
        } = *self;
        for r in 0..rows {
            let row: Vec<f32> = (0..len)
                .map(|i| m.read(x, r * len + i) + bias.map_or(0.0, |b| m.read(b, i)))
                .collect();
            let max = row.iter().copied().fold(f32::MIN, f32::max);
            let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
            for (i, v) in row.iter().enumerate() {
                m.write(y, r * len + i, (v - max).exp() / sum);
            }
        }
    }
}

/// Normalises each row of `x` to zero mean and unit variance, then applies `scale` and `bias`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerNormStep {
    /// Rows, each normalised on its own.
    pub rows: usize,
    /// Elements per row: the normalised axis, innermost.
    pub len: usize,
    /// Added to the variance before its square root.
    pub epsilon: f32,
    /// The input, `[rows, len]`.
    pub x: Loc,
    /// `len` values, multiplied into every row.
    pub scale: Loc,
    /// `len` values added to every row; `None` adds nothing.
    pub bias: Option<Loc>,
    /// The output, `[rows, len]`.
    pub y: Loc,
}

impl StepKind for LayerNormStep {
    fn describe(&self) -> String {
        format!("layernorm {}x{}", self.rows, self.len)
    }

    fn spans(&self) -> Vec<Span> {
        let mut spans = vec![
            Span::dense(self.x, &[self.rows, self.len]),
            Span::dense(self.scale, &[self.len]),
            self.written(),
        ];
        spans.extend(self.bias.map(|b| Span::dense(b, &[self.len])));
        spans
    }

    fn written(&self) -> Span {
        Span::dense(self.y, &[self.rows, self.len])
    }

    fn writes_all(&self) -> bool {
        true
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        let mut locs = vec![&mut self.x, &mut self.scale, &mut self.y];
        locs.extend(self.bias.as_mut());
        locs
    }

    fn sizes_fit(&self) -> bool {
        positive(&[self.rows, self.len])
    }

    fn types_fit(&self, t: &Types) -> bool {
        t.uniform(self)
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for LayerNormStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        let LayerNormStep {
            rows,
            len,
            epsilon,
            x,
            scale,
            bias,
            y,
        } = *self;
        for r in 0..rows {
            let row: Vec<f32> = (0..len).map(|i| m.read(x, r * len + i)).collect();
            let mean = row.iter().sum::<f32>() / len as f32;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / len as f32;
            for (i, v) in row.iter().enumerate() {
                let b = bias.map_or(0.0, |b| m.read(b, i));
                let out = (v - mean) / (var + epsilon).sqrt() * m.read(scale, i) + b;
                m.write(y, r * len + i, out);
            }
        }
    }
}

/// The mean of each row: `[rows, len]` to `[rows]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RowMeanStep {
    /// Rows, each averaged on its own.
    pub rows: usize,
    /// Elements averaged per row.
    pub len: usize,
    /// The input, `[rows, len]`.
    pub x: Loc,
    /// The output, `[rows]`.
    pub y: Loc,
}

impl StepKind for RowMeanStep {
    fn describe(&self) -> String {
        format!("mean {}x{}", self.rows, self.len)
    }

    fn spans(&self) -> Vec<Span> {
        vec![Span::dense(self.x, &[self.rows, self.len]), self.written()]
    }

    fn written(&self) -> Span {
        Span::dense(self.y, &[self.rows])
    }

    fn writes_all(&self) -> bool {
        true
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        vec![&mut self.x, &mut self.y]
    }

    fn sizes_fit(&self) -> bool {
        positive(&[self.rows, self.len])
    }

    fn types_fit(&self, t: &Types) -> bool {
        t.uniform(self)
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for RowMeanStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        let RowMeanStep { rows, len, x, y } = *self;
        for r in 0..rows {
            let sum: f32 = (0..len).map(|i| m.read(x, r * len + i)).sum();
            m.write(y, r, sum / len as f32);
        }
    }
}

/// Local response normalisation across the channels of an NHWC tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LrnStep {
    /// Positions normalised independently: N × H × W.
    pub pixels: usize,
    /// Channels, the innermost dimension.
    pub c: usize,
    /// Channels in the window around each channel (ONNX `size`).
    pub size: usize,
    /// Scales the window's sum of squares, divided by `size` first (ONNX `alpha`).
    pub alpha: f32,
    /// The exponent of the divisor (ONNX `beta`).
    pub beta: f32,
    /// Added to the scaled sum of squares (ONNX `bias`).
    pub bias: f32,
    /// The input, `[pixels, c]`.
    pub x: Loc,
    /// The output, `[pixels, c]`.
    pub y: Loc,
}

impl StepKind for LrnStep {
    fn describe(&self) -> String {
        format!("lrn {}x{}", self.pixels, self.c)
    }

    fn spans(&self) -> Vec<Span> {
        vec![Span::dense(self.x, &[self.pixels, self.c]), self.written()]
    }

    fn written(&self) -> Span {
        Span::dense(self.y, &[self.pixels, self.c])
    }

    fn writes_all(&self) -> bool {
        true
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        vec![&mut self.x, &mut self.y]
    }

    fn sizes_fit(&self) -> bool {
        positive(&[self.pixels, self.c, self.size])
    }

    fn types_fit(&self, t: &Types) -> bool {
        t.uniform(self)
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for LrnStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        let LrnStep {
            pixels,
            c,
            size,
            alpha,
            beta,
            bias,
            x,
            y,
        } = *self;
        for p in 0..pixels {
            for ch in 0..c {
                let lo = ch.saturating_sub((size - 1) / 2);
                let hi = (ch + size / 2).min(c - 1);
                let sq: f32 = (lo..=hi).map(|cc| m.read(x, p * c + cc).powi(2)).sum();
                let v = m.read(x, p * c + ch) / (bias + alpha / size as f32 * sq).powf(beta);
                m.write(y, p * c + ch, v);
            }
        }
    }
}
