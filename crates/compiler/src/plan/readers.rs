// SPDX-License-Identifier: MPL-2.0
//! Who reads a value a step writes in the arena, and how: what decides where an int8 output
//! may stand for the value (`quant::round_outputs`, and the GPU's passing of values in int8).

use super::{Loc, Span, Step};

/// The elements of the arena that `span` covers, where it is in the arena.
pub fn arena_range(span: Span) -> Option<(i128, i128)> {
    match span.loc {
        Loc::Arena(at) => Some((at as i128 + span.start, at as i128 + span.end)),
        _ => None,
    }
}

/// Whether two ranges of the arena share an element.
pub fn overlaps(a: Option<(i128, i128)>, b: (i128, i128)) -> bool {
    a.is_some_and(|a| a.0 < b.1 && b.0 < a.1)
}

/// The steps after `w` that read any of `out` (its output's place in the arena) before it is
/// written over: the arena places nothing over a value before its last read, so the first
/// step that writes over any of it comes after every reader.
pub fn readers_of(steps: &[Step], w: usize, out: (i128, i128)) -> Vec<usize> {
    let mut readers = Vec::new();
    for (r, step) in steps.iter().enumerate().skip(w + 1) {
        if (step.reads().into_iter()).any(|s| overlaps(arena_range(s), out)) {
            readers.push(r);
        }
        if overlaps(arena_range(step.written()), out) {
            break;
        }
    }
    readers
}

/// The one span of `step`'s reads that touches `out`, where one does.
fn only_read_of(step: &Step, out: (i128, i128)) -> Option<Span> {
    let mut of_it = (step.reads().into_iter()).filter(|s| overlaps(arena_range(*s), out));
    match (of_it.next(), of_it.next()) {
        (Some(span), None) => Some(span),
        _ => None,
    }
}

/// Whether `step` reads all of `out` as its input and nothing else of it (not as its
/// residual). A product's and a convolution's first span is their input (`StepKind::spans`).
pub fn takes_as_input(step: &Step, out: (i128, i128)) -> bool {
    only_read_of(step, out).is_some()
        && step.spans().first().and_then(|s| arena_range(*s)) == Some(out)
}

/// Whether `step` reads all of `out` as its residual and nothing else of it.
pub fn takes_as_residual(step: &Step, out: (i128, i128)) -> bool {
    only_read_of(step, out)
        .is_some_and(|s| Some(s.loc) == step.residual() && arena_range(s) == Some(out))
}
