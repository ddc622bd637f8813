// SPDX-License-Identifier: MPL-2.0
//! Where a network's first convolution may read the frames itself: the frames arrive in
//! f32 and a plan in fp16 casts them into its arena before the first step reads them. A
//! convolution that reads that cast, and is the only step that does, can read the f32
//! frames instead (the CUDA engine's stem kernel does, `Tuned::OWN_STEM_FROM_FRAMES`), and
//! the cast need not run.

use super::{Cast, Loc, Plan, Span, Step};
use crate::ir::Act;

/// The cast of the frames that a convolution may do itself, and how it reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FramesCast {
    /// The cast's step in the plan.
    pub step: usize,
    /// The f32 element of the frames that the convolution's input element 0 is.
    pub offset: usize,
    /// The f32 elements from one of the convolution's input elements to the next along its
    /// images, channels, rows and columns (the frames' own layout, NCHW or NHWC); 0 along
    /// an axis of one.
    pub strides: [usize; 4],
}

impl Plan {
    /// The cast of the frames that step `conv` may do itself: where `conv` is a convolution
    /// that reads, as its whole input, what a cast of the frames wrote, no step between them
    /// touches it, and no step after it reads it before it is written over.
    pub fn frames_cast(&self, conv: usize) -> Option<FramesCast> {
        let Some(Step::Conv(c)) = self.steps.get(conv) else {
            return None;
        };
        let Loc::Arena(x) = c.x else {
            return None;
        };
        let dims = [c.n, c.h, c.w, c.c];
        if dims.contains(&0) {
            return None;
        }
        let input = Span::dense(c.x, &dims);
        let overlaps = |s: &Span| match s.loc {
            Loc::Arena(o) => {
                let (start, end) = (o as i128 + s.start, o as i128 + s.end);
                start < x as i128 + input.end && end > x as i128
            }
            _ => false,
        };
        // The last step before the convolution that touches its input must be the cast.
        let step = (0..conv)
            .rev()
            .find(|&i| self.steps[i].spans().iter().any(overlaps))?;
        let Step::Ew(e) = &self.steps[step] else {
            return None;
        };
        let Loc::Input(base) = e.a.loc else {
            return None;
        };
        let cast = e.cast == Cast::FromF32 && e.op.is_none() && e.act == Act::None;
        if !(cast && self.steps[step].written() == input && self.steps[step].writes_all()) {
            return None;
        }
        // Nothing after the convolution may read the cast's values.
        for s in &self.steps[conv + 1..] {
            if s.reads().iter().any(overlaps) {
                return None;
            }
            let w = s.written();
            if s.writes_all() && w.loc == c.x && w.start <= 0 && w.end >= input.end {
                break;
            }
        }
        // The frames' element that each of the cast's outputs is: its output offset taken
        // apart along the output's strides, the largest first.
        let mut axes: Vec<(i64, usize, i64)> = (e.out.strides.iter().zip(&e.dims))
            .zip(&e.a.strides)
            .filter(|((_, d), _)| **d > 1)
            .map(|((&o, &d), &a)| (o, d, a))
            .collect();
        axes.sort_unstable_by_key(|&(o, _, _)| std::cmp::Reverse(o));
        let source = |offset: usize| -> Option<i64> {
            let (mut left, mut at) = (offset as i64, base as i64);
            for &(stride, dim, a) in &axes {
                if stride <= 0 {
                    return None;
                }
                let i = left / stride;
                if i >= dim as i64 {
                    return None;
                }
                left -= i * stride;
                at += i * a;
            }
            (left == 0).then_some(at)
        };
        // Along the convolution's images, channels, rows and columns (NHWC in the arena).
        let [n, h, w, ch] = dims;
        let units = [h * w * ch, 1, w * ch, ch];
        let sizes = [n, ch, h, w];
        let origin = source(0)?;
        let mut strides = [0usize; 4];
        for ((stride, unit), size) in strides.iter_mut().zip(units).zip(sizes) {
            if size > 1 {
                *stride = usize::try_from(source(unit)? - origin).ok()?;
            }
        }
        // A cast that is not one affine map of the frames (it never is otherwise) is left.
        let last = (n - 1) * units[0] + (ch - 1) + (h - 1) * units[2] + (w - 1) * units[3];
        let reach = (n - 1) * strides[0]
            + (ch - 1) * strides[1]
            + (h - 1) * strides[2]
            + (w - 1) * strides[3];
        (source(last)? - origin == reach as i64).then_some(FramesCast {
            step,
            offset: usize::try_from(origin).ok()?,
            strides,
        })
    }
}
