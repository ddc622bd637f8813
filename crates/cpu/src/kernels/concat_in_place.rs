// SPDX-License-Identifier: MPL-2.0
//! A concatenation's inputs written in place: a product or convolution whose output is only
//! copied into its channels of a concatenation (SqueezeNet's fire modules, Inception's
//! branches) writes its rows there, `stride` values apart, and the copy is skipped. The
//! plan's copies took 8 % of SqueezeNet 1.1's time on one thread.
//!
//! The GPU's kernels write whole tensors: the CPU runner decides this for itself, as it
//! fuses activations (`product::fuse_activations`), on the CPU plans' placement of the
//! concatenation (`early_concats` in the compiler's arena). A batched tail's steps copy
//! (`tail_packing` does not redirect them): the late layers seldom concatenate.

use std::ops::Range;

use super::scaled_input::{in_arena, read_from};
use super::{Out, Packed};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{Cast, ConvStep, EwStep, GemmStep, Loc, Span, Step};

/// Rows of `k` values `stride` apart from the arena offset `base`: a copy's destination.
#[derive(Clone, Copy, PartialEq, Debug)]
struct Rows {
    base: usize,
    rows: usize,
    k: usize,
    stride: usize,
}

impl Rows {
    fn span(&self) -> Range<i128> {
        let end = (self.rows.max(1) - 1) * self.stride + self.k;
        self.base as i128..(self.base + end) as i128
    }

    /// Whether the two share no element: apart, or columns of rows the same `stride` apart,
    /// the columns of one lying between those of the other.
    fn disjoint(&self, other: &Rows) -> bool {
        let (a, b) = match self.base <= other.base {
            true => (self, other),
            false => (other, self),
        };
        // Where `b`'s columns begin in the rows of `a`.
        let at = (b.base - a.base) % a.stride;
        let apart_columns = a.stride == b.stride && a.k <= at && at + b.k <= a.stride;
        apart_columns || !overlaps(&self.span(), &other.span())
    }
}

/// Whether `step` reads any of the arena elements `span`.
fn reads(step: &Step, span: &Range<i128>) -> bool {
    let spans = step.reads();
    spans
        .iter()
        .filter_map(in_arena)
        .any(|r| overlaps(&r, span))
}

fn overlaps(a: &Range<i128>, b: &Range<i128>) -> bool {
    a.start < b.end && b.start < a.end
}

/// Makes each product or convolution whose output a later copy alone reads (a plain
/// element-wise step into rows of a wider buffer) write there itself (`Packed::Into`), and
/// skips the copy. Returns, for each step, whether a plan may not be cut before it
/// (`batched_tail`): between such a product and its copy, the product's own output is
/// never written.
pub fn write_into_concats(steps: &[Step], packed: &mut [Packed]) -> Vec<bool> {
    let mut joined = vec![false; steps.len()];
    // Where each redirected product now writes, and which copies were skipped for it.
    let mut into: Vec<Option<Rows>> = vec![None; steps.len()];
    let mut skipped = vec![false; steps.len()];
    for i in 0..steps.len() {
        let Some((from, to)) = copy_rows(&steps[i], &packed[i]) else {
            continue;
        };

        let Some(j) = producer(steps, packed, i, &from, &to) else {
            continue;
        };
        let from_span = from.span();
        // The product's activation, fused into it (`fuse_activations`), is the one step
        // between that may touch its output.
        let fused = |s: usize| s == j + 1 && activates(&packed[j]);
        // A copy skipped already wrote nothing: its product writes instead, checked
        // against the steps between it and that copy, this product among them if it lies
        // there.
        let clear = (j + 1..i).filter(|&s| !fused(s) && !skipped[s]).all(|s| {
            let step = &steps[s];
            // What it writes: rows of a concatenation (another copy, or a product
            // redirected there), whose other columns it may write; else its span.
            let rows = into[s].or_else(|| copy_rows(step, &packed[s]).map(|(_, to)| to));
            let (writes_from, writes_to) = match rows {
                Some(rows) => (overlaps(&rows.span(), &from_span), !rows.disjoint(&to)),
                None => match in_arena(&step.written()) {
                    Some(w) => (overlaps(&w, &from_span), overlaps(&w, &to.span())),
                    None => (false, false),
                },
            };
            // The destination, now written at `j` instead of `i`, must not be read or
            // written between, nor the product's output, now not written at all.
            !reads(step, &from_span) && !reads(step, &to.span()) && !writes_from && !writes_to
        });
        // Nor may the product read it: the arena may have placed the concatenation over
        // the product's input, whose last reader it is.
        let reads_to = reads(&steps[j], &to.span());
        let span = Span {
            loc: Loc::Arena(from.base),
            start: 0,
            end: (from.rows * from.k) as i128,
        };
        if !clear || reads_to || read_from(&steps[i + 1..], span) {
            continue;
        }
        let inner = std::mem::replace(&mut packed[j], Packed::Skip);
        packed[j] = Packed::Into(
            Box::new(inner),
            Out {
                y: Loc::Arena(to.base),
                stride: to.stride,
            },
        );
        packed[i] = Packed::Skip;
        into[j] = Some(to);
        skipped[i] = true;
        joined[j + 1..=i].iter_mut().for_each(|b| *b = true);
    }
    joined
}

/// A plain copy of a dense `rows × k` arena matrix into rows of the arena `stride` apart:
/// its source and destination.
fn copy_rows(step: &Step, packed: &Packed) -> Option<(Rows, Rows)> {
    let Step::Ew(EwStep {
        op: None,
        act: Act::None,
        cast: Cast::None,
        dims,
        out,
        a,
        b: None,
    }) = step
    else {
        return None;
    };
    if !matches!(packed, Packed::None) {
        return None;
    }
    let (Loc::Arena(to), Loc::Arena(from)) = (out.loc, a.loc) else {
        return None;
    };
    // The axes of more than one element, innermost first: the innermost contiguous on both
    // sides, the others rows, dense in the source and `stride` apart in the destination.
    let axes: Vec<(usize, i64, i64)> = (dims.iter().zip(&out.strides).zip(&a.strides))
        .rev()
        .filter(|&((&d, _), _)| d > 1)
        .map(|((&d, &o), &s)| (d, o, s))
        .collect();
    let (&(k, 1, 1), outer) = axes.split_first()? else {
        return None;
    };
    let mut rows = 1;
    let mut stride = k as i64;
    for (n, &(d, o, s)) in outer.iter().enumerate() {
        if n == 0 {
            stride = o;
        }
        if s != (rows * k) as i64 || o != stride * rows as i64 {
            return None;
        }
        rows *= d;
    }
    let stride = usize::try_from(stride).ok().filter(|&s| s >= k)?;
    let rows_of = |base| Rows {
        base,
        rows,
        k,
        stride,
    };
    Some((
        Rows {
            stride: k,
            ..rows_of(from)
        },
        rows_of(to),
    ))
}

/// The step that wrote the copy `i`'s source, `from`, where it is a product or convolution
/// that can write rows `to.stride` apart (on packed weights, adding no residual, whose
/// output is all of `from`).
fn producer(steps: &[Step], packed: &[Packed], i: usize, from: &Rows, to: &Rows) -> Option<usize> {
    let span = from.span();
    let mut j = (0..i)
        .rev()
        .find(|&s| in_arena(&steps[s].written()).is_some_and(|w| overlaps(&w, &span)))?;
    // An activation fused into the product before it.
    if j > 0 && activates(&packed[j - 1]) {
        j -= 1;
    }
    let writes = |y: Loc, len: usize| y == Loc::Arena(from.base) && len == from.rows * from.k;
    let fits = match &steps[j] {
        Step::Gemm(GemmStep {
            batch: 1,
            rows,
            n,
            y,
            residual: None,
            ..
        }) => *n == to.k && writes(*y, rows * n) && matches!(packed[j], Packed::Panels(..)),
        Step::Conv(c @ ConvStep { residual: None, .. }) => {
            c.k == to.k
                && writes(c.y, c.n * c.oh * c.ow * c.k)
                && match packed[j] {
                    Packed::Groups(_) | Packed::Winograd(_) => true,
                    Packed::Panels(..) => !few_channels(c),
                    _ => false,
                }
        }
        _ => false,
    };
    fits.then_some(j)
}

/// Whether the step after the one packed so is an activation done in its epilogue, and
/// skipped (`fuse_activations`).
fn activates(packed: &Packed) -> bool {
    matches!(packed, Packed::Panels(_, Some(_)))
}

/// Whether the convolution may run in `x86_64::few_channels`, which writes whole rows.
fn few_channels(c: &ConvStep) -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::x86_64::few_channels::fits(c);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = c;
        false
    }
}
