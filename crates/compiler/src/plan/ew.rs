// SPDX-License-Identifier: MPL-2.0
//! Element-wise steps: `out = act(op(a, b))` over strided operands, and the zeroing of a
//! buffer. They also make the copies that views, concatenations and padding need.

use serde::{Deserialize, Serialize};

use super::{Cast, Loc, MAX_RANK, Span, StepKind, Strided, covers_once};
use crate::check::Types;
use crate::ir::{Act, BinOp};

/// `out = act(op(a, b))`, or `act(a)`, over `dims`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EwStep {
    /// The binary operation; `None` for `act(a)`, with no `b`.
    pub op: Option<BinOp>,
    /// Applied to the result of `op`, or to `a` alone.
    pub act: Act,
    /// Whether the step reads or writes f32 instead of the plan's type.
    pub cast: Cast,
    /// Iteration extents, outermost first; at most `MAX_RANK`.
    pub dims: Vec<usize>,
    /// Where the results go.
    pub out: Strided,
    /// The first operand.
    pub a: Strided,
    /// The second operand: present when `op` is.
    pub b: Option<Strided>,
}

impl StepKind for EwStep {
    fn describe(&self) -> String {
        format!("ew {:?} {:?} {:?}", self.op, self.act, self.dims)
    }

    fn spans(&self) -> Vec<Span> {
        let mut spans = vec![
            Span::strided(&self.out, &self.dims),
            Span::strided(&self.a, &self.dims),
        ];
        spans.extend(self.b.as_ref().map(|b| Span::strided(b, &self.dims)));
        spans
    }

    fn written(&self) -> Span {
        Span::strided(&self.out, &self.dims)
    }

    /// Not so where the output strides skip some elements (a slice of a concatenation).
    fn writes_all(&self) -> bool {
        covers_once(&self.dims, &self.out.strides, self.dims.iter().product())
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        let mut locs = vec![&mut self.out.loc, &mut self.a.loc];
        locs.extend(self.b.as_mut().map(|b| &mut b.loc));
        locs
    }

    /// A cast writes the f32 arena without being a step that computes in f32.
    fn is_wide(&self) -> bool {
        self.cast == Cast::Wide
    }

    fn sizes_fit(&self) -> bool {
        let int = |v: usize| i32::try_from(v).is_ok();
        let dims = &self.dims;
        dims.len() <= MAX_RANK
            && dims.iter().all(|&d| int(d))
            && (dims.iter())
                .try_fold(1i64, |n, &d| n.checked_mul(d as i64))
                .is_some()
            && self.op.is_some() == self.b.is_some()
            && [Some(&self.out), Some(&self.a), self.b.as_ref()]
                .into_iter()
                .flatten()
                .all(|s| s.strides.len() == dims.len())
    }

    /// Each cast between f32 and the plan's type has its own rule.
    fn types_fit(&self, t: &Types) -> bool {
        let is_f32 = t.is_f32;
        let all = |want: bool, locs: &[Loc]| locs.iter().all(|&l| is_f32(l) == want);
        let b_is = |want: bool| self.b.as_ref().is_none_or(|b| is_f32(b.loc) == want);
        let (out, a) = (self.out.loc, self.a.loc);
        match self.cast {
            Cast::None => t.plain() || all(false, &[out, a]) && b_is(false),
            Cast::Wide => all(true, &[out, a]) && b_is(true),
            Cast::FromF32 => is_f32(a) && !is_f32(out) && b_is(false),
            Cast::ToF32 => is_f32(out) && !is_f32(a) && b_is(false),
            Cast::F32 => all(true, &[out, a]) && b_is(false),
        }
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for EwStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        let dims = &self.dims;
        let offset = |s: &Strided, mut i: usize| {
            let mut o = 0i64;
            for d in (0..dims.len()).rev() {
                o += (i % dims[d]) as i64 * s.strides[d];
                i /= dims[d];
            }
            o as usize
        };
        for i in 0..dims.iter().product() {
            let va = m.read(self.a.loc, offset(&self.a, i));
            let v = match (self.op, &self.b) {
                (Some(op), Some(b)) => op.apply(va, m.read(b.loc, offset(b, i))),
                _ => va,
            };
            m.write(self.out.loc, offset(&self.out, i), self.act.apply(v));
        }
    }
}

/// Sets `len` elements to zero.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ZeroStep {
    /// The first element to clear.
    pub loc: Loc,
    /// Elements of the plan's type.
    pub len: usize,
}

impl StepKind for ZeroStep {
    fn describe(&self) -> String {
        format!("zero {}", self.len)
    }

    fn spans(&self) -> Vec<Span> {
        vec![self.written()]
    }

    fn written(&self) -> Span {
        Span::dense(self.loc, &[self.len])
    }

    fn writes_all(&self) -> bool {
        true
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        vec![&mut self.loc]
    }

    fn sizes_fit(&self) -> bool {
        true
    }

    fn types_fit(&self, t: &Types) -> bool {
        t.uniform(self)
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for ZeroStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        (0..self.len).for_each(|i| m.write(self.loc, i, 0.0));
    }
}
