// SPDX-License-Identifier: MPL-2.0
//! Squeeze-and-excitation's two products after a global average pool, with their
//! activations, as one `GateStep`: EfficientNet-B0 has 16 such gates, each two products of
//! one row an image and the SiLU and sigmoid passes that cuBLASLt's epilogue cannot take,
//! four launches of almost no work where the latency of a launch is what a batch of one
//! waits for. For the GPU's plans, before the arena is placed.

use super::arena::Storage;
use crate::ir::Act;
use crate::plan::{
    Cast, EwStep, GateStep, GemmStep, GlobalAvgPoolStep, Loc, Step, StepKind, covers_once,
};

/// Replaces each such gate of `steps` (with their `origins`) by its `GateStep`, the
/// buffers' lifetimes in `storages` following.
pub(super) fn gates(steps: &mut Vec<Step>, origins: &mut Vec<String>, storages: &mut [Storage]) {
    let mut i = 1;
    while i < steps.len() {
        let Some((gate, end, hidden)) = gate_at(steps, storages, i) else {
            i += 1;
            continue;
        };
        steps[i] = Step::Gate(gate);
        steps.drain(i + 1..=end);
        origins.drain(i + 1..=end);
        // The steps the gate took are its; those after it move up.
        let moved = |s: usize| match s {
            s if s > end => s - (end - i),
            s if s > i => i,
            s => s,
        };
        for s in storages.iter_mut() {
            (s.first, s.last) = (moved(s.first), moved(s.last));
        }
        // Written by nothing now: no place beside the gate's buffers.
        storages[hidden].len = 1;
        i += 1;
    }
}

/// Where step `i` is the first product of a gate (the global average pool before it): the
/// gate, the index of its last step, and the buffer of the hidden values, which nothing
/// else reads.
fn gate_at(steps: &[Step], storages: &[Storage], i: usize) -> Option<(GateStep, usize, usize)> {
    let Step::GlobalAvgPool(GlobalAvgPoolStep {
        n, c, y: pooled, ..
    }) = steps[i - 1]
    else {
        return None;
    };
    let first = plain(&steps[i])?;
    let (act1, second) = match activation_of(steps.get(i + 1)?, first) {
        Some(act) if first.act.is_none() => (act, i + 2),
        _ => (first.act, i + 1),
    };
    let last = plain(steps.get(second)?)?;
    let (act2, end) = match steps.get(second + 1).and_then(|s| activation_of(s, last)) {
        Some(act) if last.act.is_none() => (act, second + 1),
        _ => (last.act, second),
    };
    let r = first.n;
    let (
        Loc::Temp {
            id: hidden,
            offset: 0,
        },
        Loc::Temp { id: out, offset: 0 },
    ) = (first.y, last.y)
    else {
        return None;
    };
    let Loc::Temp { id: x, .. } = pooled else {
        return None;
    };
    let hs = &storages[hidden];
    let shapes = first.x == pooled
        && (first.rows, first.k) == (n, c)
        && last.x == first.y
        && (last.rows, last.k, last.n) == (n, r, c);
    let alone = hs.first == i && hs.last == second && hs.len == n * r;
    let narrow = ![x, hidden, out].iter().any(|&id| storages[id].wide);
    let gate = GateStep {
        n,
        c,
        r,
        x: pooled,
        w1: first.w,
        b1: first.bias,
        act1,
        w2: last.w,
        b2: last.bias,
        act2,
        y: last.y,
    };
    (shapes && alone && narrow && gate.sizes_fit()).then_some((gate, end, hidden))
}

/// `step` as a gate's product: a single one of constant weights in `[k, n]` order, with
/// nothing but a bias and an activation after it.
fn plain(step: &Step) -> Option<&GemmStep> {
    let Step::Gemm(g) = step else {
        return None;
    };
    let constant = |l: Option<Loc>| l.is_none_or(|l| matches!(l, Loc::Weight { .. }));
    (g.batch == 1
        && g.alpha == 1.0
        && !g.w_transposed
        && g.residual.is_none()
        && g.quant.is_none()
        && constant(Some(g.w))
        && constant(g.bias))
    .then_some(g)
}

/// The activation `step` applies to all of `product`'s output in place, if that is what
/// it does.
fn activation_of(step: &Step, product: &GemmStep) -> Option<Act> {
    let Step::Ew(EwStep {
        op: None,
        act,
        cast: Cast::None,
        dims,
        out,
        a,
        b: None,
    }) = step
    else {
        return None;
    };
    let whole =
        a.strides == out.strides && covers_once(dims, &out.strides, product.rows * product.n);
    (a.loc == product.y && out.loc == product.y && whole && !act.is_none()).then_some(*act)
}
