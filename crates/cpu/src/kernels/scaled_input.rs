// SPDX-License-Identifier: MPL-2.0
//! A per-channel scale of a 1×1 convolution's input (squeeze-and-excitation's
//! `x · sigmoid(fc(pool(x)))` before a block's projection, EfficientNet's and MobileNet v3's)
//! folded into the convolution's packed weights for each frame instead of written out:
//! `(x ⊙ s)·W = x·(diag(s)·W)`, `k × n` products instead of a pass over the `pixels × k`
//! input, where the weights are the smaller of the two (fewer columns than pixels).

use std::ops::Range;

use super::Packed;
use trtclassify_compiler::ir::{Act, BinOp};
use trtclassify_compiler::plan::{Cast, EwStep, GemmStep, Loc, Span, Step, Strided, covers_once};

/// Marks each product by a per-channel scale whose only reader is the 1×1 convolution (a
/// matrix product of constant weights, NHWC pixels being its rows) right after it: the
/// scaling skipped, the product reading its unscaled input (`Packed::ScaledInput`).
pub fn fuse_scales(steps: &[Step], packed: &mut [Packed]) {
    for i in 1..steps.len() {
        let (
            Step::Ew(EwStep {
                op: Some(BinOp::Mul),
                act: Act::None,
                cast: Cast::None,
                dims,
                out,
                a,
                b: Some(b),
            }),
            Step::Gemm(GemmStep {
                batch: 1,
                rows,
                n,
                k,
                x: product_x,
                w,
                bias,
                residual,
                ..
            }),
        ) = (&steps[i - 1], &steps[i])
        else {
            continue;
        };
        if n >= rows
            || out.loc != *product_x
            || !matches!(packed[i - 1], Packed::None)
            || !matches!(packed[i], Packed::Panels(..))
            || !covers_once(dims, &out.strides, rows * k)
        {
            continue;
        }
        let Some((x, scale)) = [(a, b), (b, a)]
            .into_iter()
            .find(|(x, s)| x.strides == out.strides && per_channel(dims, out, s, *k))
        else {
            continue;
        };
        let span = |loc, len: usize| Span {
            loc,
            start: 0,
            end: len as i128,
        };
        // The unscaled input must outlive the product, which the arena may have placed
        // over it (its last reader was the scaling).
        if overlap(&span(x.loc, rows * k), &steps[i].written()) {
            continue;
        }
        // Nothing but the product's `x` may read the scaled values (its residual could).
        let scaled = steps[i - 1].written();
        let operands = [
            Some(span(*w, k * n)),
            bias.map(|b| span(b, *n)),
            residual.map(|z| span(z, rows * n)),
        ];
        let read = operands.iter().flatten().any(|o| overlap(o, &scaled));
        if read || read_from(&steps[i + 1..], scaled) {
            continue;
        }
        let Packed::Panels(panels, act) = std::mem::replace(&mut packed[i], Packed::Skip) else {
            unreachable!("matched above");
        };
        packed[i] = Packed::ScaledInput {
            panels,
            act,
            x: x.loc,
            scale: scale.loc,
        };
        packed[i - 1] = Packed::Skip;
    }
}

/// Whether `s` holds one value per channel, contiguous, for the output `out` of `dims`
/// whose channels (`channels` of them) are its innermost, contiguous axis.
fn per_channel(dims: &[usize], out: &Strided, s: &Strided, channels: usize) -> bool {
    let mut along_channels = false;
    for ((&d, &so), &ss) in dims.iter().zip(&out.strides).zip(&s.strides) {
        if d == 1 || ss == 0 {
            continue;
        }
        if (so, ss, d) != (1, 1, channels) {
            return false;
        }
        along_channels = true;
    }
    along_channels
}

/// Whether any of `steps` reads some of `span` before a step writes all of it; a span
/// outside the arena counts as read (the scores are the caller's).
pub(super) fn read_from(steps: &[Step], span: Span) -> bool {
    let Some(target) = in_arena(&span) else {
        return true;
    };
    let overlaps = |r: &Range<i128>| r.start < target.end && target.start < r.end;
    for step in steps {
        if step
            .reads()
            .iter()
            .filter_map(in_arena)
            .any(|r| overlaps(&r))
        {
            return true;
        }
        if in_arena(&step.written()).is_some_and(|w| w.start <= target.start && target.end <= w.end)
        {
            return false;
        }
    }
    false
}

/// Whether two spans share arena elements.
fn overlap(a: &Span, b: &Span) -> bool {
    match (in_arena(a), in_arena(b)) {
        (Some(a), Some(b)) => a.start < b.end && b.start < a.end,
        _ => false,
    }
}

/// The arena elements of `span`, absolutely.
pub(super) fn in_arena(span: &Span) -> Option<Range<i128>> {
    match span.loc {
        Loc::Arena(o) => Some(o as i128 + span.start..o as i128 + span.end),
        _ => None,
    }
}
