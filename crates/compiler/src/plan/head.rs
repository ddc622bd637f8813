// SPDX-License-Identifier: MPL-2.0
//! A CNN classifier's head: the global average pool, the classifier's product with its bias,
//! and the softmax, as one step at small batches.

use serde::{Deserialize, Serialize};

use super::{Loc, Span, StepKind};
use crate::check::Types;
use crate::ir::Act;

/// The most images a head takes: the GPU kernel keeps 8 sums a thread for each image, and
/// reads the weights once for all of them. Larger batches keep the product in cuBLASLt,
/// where the weights' reads are shared by more work.
pub const HEAD_MAX_BATCH: usize = 8;

/// `y = softmax(mean(act_in(x)) · w + bias)` (no softmax where the model has none) for each
/// of `n` images, its `hw` pixels of `c` channels averaged in f32, the scores in f32. At
/// batch 1 a classifier's pool, product and softmax are three launches of almost no work,
/// each of which the image waits for (ResNet-50: 3 of its 59), four with the activation
/// before the pool that cuBLASLt's epilogue lacks (MobileNetV2's clip, EfficientNet's SiLU);
/// the GPU's plans have this instead (`lower::head`): one launch, its blocks each taking a
/// slice of the channels and of the classes, the last block to finish adding the slices'
/// sums.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadStep {
    /// Images, at most `HEAD_MAX_BATCH`.
    pub n: usize,
    /// Pixels an image.
    pub hw: usize,
    /// Channels, by the 8 (the GPU reads 8 values a load).
    pub c: usize,
    /// Classes.
    pub classes: usize,
    /// The last convolution's output, `[n, hw, c]`.
    pub x: Loc,
    /// Applied to each value of `x` as it is read, in f32: the activation of the step
    /// before, taken into the head. Absent from engine files where it is `Act::None`.
    #[serde(default, skip_serializing_if = "Act::is_none")]
    pub act_in: Act,
    /// Row-major `[c, classes]`.
    pub w: Loc,
    /// `classes` values, if any.
    pub bias: Option<Loc>,
    /// Whether each image's scores are a softmax of its logits.
    pub softmax: bool,
    /// The scores, f32, `[n, classes]`.
    pub y: Loc,
}

impl StepKind for HeadStep {
    fn describe(&self) -> String {
        format!(
            "head {}{}x{}x{} -> {}{}{}",
            match self.act_in {
                Act::None => String::new(),
                a => format!("{a:?} "),
            },
            self.n,
            self.hw,
            self.c,
            self.classes,
            if self.bias.is_some() { " +bias" } else { "" },
            if self.softmax { " softmax" } else { "" },
        )
    }

    fn spans(&self) -> Vec<Span> {
        let mut spans = vec![
            Span::dense(self.x, &[self.n, self.hw, self.c]),
            Span::dense(self.w, &[self.c, self.classes]),
            self.written(),
        ];
        spans.extend(self.bias.map(|b| Span::dense(b, &[self.classes])));
        spans
    }

    fn written(&self) -> Span {
        Span::dense(self.y, &[self.n, self.classes])
    }

    fn writes_all(&self) -> bool {
        true
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        let mut locs = vec![&mut self.x, &mut self.w, &mut self.y];
        locs.extend(self.bias.as_mut());
        locs
    }

    fn sizes_fit(&self) -> bool {
        let positive = |v: usize| v >= 1 && i32::try_from(v).is_ok();
        [
            self.n,
            self.hw,
            self.c,
            self.classes,
            self.n * self.hw * self.c,
            self.c * self.classes,
        ]
        .into_iter()
        .all(positive)
            && self.n <= HEAD_MAX_BATCH
            && self.c.is_multiple_of(8)
    }

    /// Reads the plan's type (its weights too) and writes the scores, f32.
    fn types_fit(&self, t: &Types) -> bool {
        let narrow = |l: Loc| t.plain() || !(t.is_f32)(l) && !matches!(l, Loc::Input(_));
        matches!(self.y, Loc::Output(_))
            && narrow(self.x)
            && narrow(self.w)
            && self.bias.is_none_or(narrow)
    }
}

impl HeadStep {
    /// One image's scores from its `[hw, c]` pixels, with the step's weights and bias as
    /// values: the step's definition, which the simulator and the CPU runner compute.
    pub fn scores(&self, pixels: &[f32], w: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
        let mut pooled = vec![0.0f32; self.c];
        for pixel in pixels.chunks_exact(self.c) {
            (pooled.iter_mut().zip(pixel)).for_each(|(p, &v)| *p += self.act_in.apply(v));
        }
        let mut y = bias.map_or(vec![0.0; self.classes], <[f32]>::to_vec);
        for (p, row) in pooled.iter().zip(w.chunks_exact(self.classes)) {
            let p = p / self.hw as f32;
            y.iter_mut().zip(row).for_each(|(y, &w)| *y += p * w);
        }
        if self.softmax {
            let max = y.iter().copied().fold(f32::MIN, f32::max);
            y.iter_mut().for_each(|v| *v = (*v - max).exp());
            let sum: f32 = y.iter().sum();
            y.iter_mut().for_each(|v| *v /= sum);
        }
        y
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for HeadStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        let (n, hw, c, classes) = (self.n, self.hw, self.c, self.classes);
        let values = |m: &crate::sim::Memory, loc: Loc, len| -> Vec<f32> {
            (0..len).map(|i| m.read(loc, i)).collect()
        };
        let w = values(m, self.w, c * classes);
        let bias = self.bias.map(|b| values(m, b, classes));
        for b in 0..n {
            let pixels = values(m, self.x.offset(b * hw * c), hw * c);
            let scores = self.scores(&pixels, &w, bias.as_deref());
            for (i, s) in scores.into_iter().enumerate() {
                m.write(self.y, b * classes + i, s);
            }
        }
    }
}
