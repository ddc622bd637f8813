// SPDX-License-Identifier: MPL-2.0
//! The squeeze-and-excitation gate of EfficientNet, MobileNetV3 and RegNetY: the two small
//! products after a global average pool, and their activations, as one step.

use serde::{Deserialize, Serialize};

use super::{Loc, Span, StepKind};
use crate::check::{self, Types};
use crate::ir::Act;

/// The most channels a gate takes: the GPU kernel holds an image's pooled channels in shared
/// memory (16 KB of f32). EfficientNet-B7's widest gate has 3,840.
pub const GATE_MAX_CHANNELS: usize = 4096;

/// The most hidden values a gate takes: the GPU kernel's first product gives each of its
/// threads' runs of 8 weights the same hidden values, which takes threads by the `r` (at
/// most one of its 512 threads each).
pub const GATE_MAX_HIDDEN: usize = 512;

/// `y = act2(act1(x · w1 + b1) · w2 + b2)` for each of `n` images' pooled channels, `[n, c]`
/// in and out through `r` hidden values, the hidden ones kept in f32. Where a plan had the
/// two products (each a launch with its activation a launch of its own, cuBLASLt's epilogue
/// taking neither SiLU nor the sigmoid), six launches of tiny work at batch 1, the GPU's
/// plans have this (`lower::gate`): one block an image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GateStep {
    /// Images.
    pub n: usize,
    /// Channels in and out, by the 8 (the GPU reads the weights 8 values a load).
    pub c: usize,
    /// Hidden values.
    pub r: usize,
    /// The pooled channels, `[n, c]`.
    pub x: Loc,
    /// Row-major `[c, r]`.
    pub w1: Loc,
    /// `r` values, if any.
    pub b1: Option<Loc>,
    /// The hidden values' activation.
    pub act1: Act,
    /// Row-major `[r, c]`.
    pub w2: Loc,
    /// `c` values, if any.
    pub b2: Option<Loc>,
    /// The gate's activation (a sigmoid or a hard one).
    pub act2: Act,
    /// The gate, `[n, c]`; may be `x`.
    pub y: Loc,
}

impl StepKind for GateStep {
    fn describe(&self) -> String {
        let act = |a: Act| match a {
            Act::None => String::new(),
            a => format!(" {a:?}"),
        };
        format!(
            "gate {}x{} -> {}{} -> {}{}",
            self.n,
            self.c,
            self.r,
            act(self.act1),
            self.c,
            act(self.act2)
        )
    }

    fn spans(&self) -> Vec<Span> {
        let mut spans = vec![
            Span::dense(self.x, &[self.n, self.c]),
            Span::dense(self.w1, &[self.c, self.r]),
            Span::dense(self.w2, &[self.r, self.c]),
            self.written(),
        ];
        spans.extend(self.b1.map(|b| Span::dense(b, &[self.r])));
        spans.extend(self.b2.map(|b| Span::dense(b, &[self.c])));
        spans
    }

    fn written(&self) -> Span {
        Span::dense(self.y, &[self.n, self.c])
    }

    fn writes_all(&self) -> bool {
        true
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        let mut locs = vec![&mut self.x, &mut self.w1, &mut self.w2, &mut self.y];
        locs.extend(self.b1.as_mut());
        locs.extend(self.b2.as_mut());
        locs
    }

    fn sizes_fit(&self) -> bool {
        let positive = |v: usize| v >= 1 && i32::try_from(v).is_ok();
        [self.n, self.c, self.r, self.n * self.c, self.c * self.r]
            .into_iter()
            .all(positive)
            && self.c.is_multiple_of(8)
            && self.c <= GATE_MAX_CHANNELS
            && self.r <= GATE_MAX_HIDDEN
    }

    fn types_fit(&self, t: &Types) -> bool {
        t.uniform(self)
    }

    /// In the plan's type only: the GPU has no f32 kernel for a gate in an fp16 plan.
    fn check(&self, t: &Types) -> Result<(), String> {
        if self.is_wide() {
            return Err("a gate kept in f32".into());
        }
        check::sizes_and_types(self, t)
    }
}

impl GateStep {
    /// One image's gate from its pooled channels, with the step's weights and biases as
    /// values: the step's definition, which the simulator and the CPU runner compute.
    pub fn gate(
        &self,
        pooled: &[f32],
        w1: &[f32],
        b1: Option<&[f32]>,
        w2: &[f32],
        b2: Option<&[f32]>,
    ) -> Vec<f32> {
        let start = |bias: Option<&[f32]>, len| bias.map_or(vec![0.0; len], <[f32]>::to_vec);
        let mut hidden = start(b1, self.r);
        for (&p, row) in pooled.iter().zip(w1.chunks_exact(self.r)) {
            hidden.iter_mut().zip(row).for_each(|(h, &w)| *h += p * w);
        }
        let mut gate = start(b2, self.c);
        for (h, row) in hidden.iter().zip(w2.chunks_exact(self.c)) {
            let h = self.act1.apply(*h);
            gate.iter_mut().zip(row).for_each(|(g, &w)| *g += h * w);
        }
        gate.iter_mut().for_each(|g| *g = self.act2.apply(*g));
        gate
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for GateStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        let (n, c, r) = (self.n, self.c, self.r);
        let values = |m: &crate::sim::Memory, loc: Loc, len| -> Vec<f32> {
            (0..len).map(|i| m.read(loc, i)).collect()
        };
        let (w1, w2) = (values(m, self.w1, c * r), values(m, self.w2, r * c));
        let b1 = self.b1.map(|b| values(m, b, r));
        let b2 = self.b2.map(|b| values(m, b, c));
        for b in 0..n {
            let pooled = values(m, self.x.offset(b * c), c);
            let gate = self.gate(&pooled, &w1, b1.as_deref(), &w2, b2.as_deref());
            for (i, g) in gate.into_iter().enumerate() {
                m.write(self.y, b * c + i, g);
            }
        }
    }
}
