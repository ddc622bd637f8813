// SPDX-License-Identifier: MPL-2.0
//! The scores of an fp16 plan in f32. A classifier's last matrix product gives logits, the
//! values of a model most likely to pass fp16's range (a random-weight EfficientNet-B0 or
//! RegNet does on a white frame); in fp16 they become infinite and the scores NaN. Where the
//! plan ends with that product, perhaps a softmax over its rows, and a plain copy into the
//! scores, the product writes the scores itself, in f32 (cuBLASLt accumulates in f32
//! anyway); its bias and activation follow as a step of their own in f32, the softmax runs
//! on the scores in place, and the copy goes.

use super::super::ir::{Act, BinOp};
use super::super::plan::{Cast, DType, EwStep, GemmStep, Loc, SoftmaxStep, Step, Strided};

/// Rewrites the end of `steps` (with their `origins`) as above where it has that form;
/// otherwise leaves it.
pub(super) fn in_f32(dtype: DType, steps: &mut Vec<Step>, origins: &mut Vec<String>) {
    if dtype != DType::F16 {
        return;
    }
    let Some((product, softmax)) = product_before_the_copy(steps) else {
        return;
    };
    let copy = steps.len() - 1;
    let Step::Ew(EwStep { out, .. }) = &steps[copy] else {
        return;
    };
    let scores = out.loc;
    let Step::Gemm(GemmStep {
        n, bias, act, y, ..
    }) = &mut steps[product]
    else {
        return;
    };
    *y = scores;
    let (n, bias, act) = (*n, bias.take(), std::mem::replace(act, Act::None));
    let len = steps[product].written().end as usize;
    steps.truncate(copy);
    origins.truncate(copy);
    if let Some(s) = softmax {
        let Step::Softmax(SoftmaxStep { x, y, .. }) = &mut steps[s] else {
            return;
        };
        (*x, *y) = (scores, scores);
    }
    if bias.is_some() || act != Act::None {
        // One row of `n` scores per product row; the bias the same for every row.
        let rows_of = |loc| Strided {
            loc,
            strides: vec![n as i64, 1],
        };
        let epilogue = Step::Ew(EwStep {
            op: bias.map(|_| BinOp::Add),
            act,
            cast: Cast::F32,
            dims: vec![len / n, n],
            out: rows_of(scores),
            a: rows_of(scores),
            b: bias.map(|loc: Loc| Strided {
                loc,
                strides: vec![0, 1],
            }),
        });
        steps.insert(product + 1, epilogue);
        origins.insert(product + 1, origins[product].clone());
    }
}

/// Where `steps` ends with a product without a residual, perhaps a softmax over rows of its
/// columns, and a contiguous copy of the result into the scores: the product's index and
/// the softmax's.
fn product_before_the_copy(steps: &[Step]) -> Option<(usize, Option<usize>)> {
    let copy = steps.len().checked_sub(1)?;
    let Step::Ew(EwStep {
        op: None,
        act: Act::None,
        cast: Cast::ToF32,
        dims,
        out,
        a,
        b: None,
    }) = &steps[copy]
    else {
        return None;
    };
    let len: usize = dims.iter().product();
    let contiguous = |s: &Strided| s.strides == contiguous_strides(dims);
    if !contiguous(a) || !contiguous(out) {
        return None;
    }
    let (product, softmax, copied) = match &steps[copy.checked_sub(1)?] {
        Step::Softmax(SoftmaxStep { rows, len: l, x, y }) if *y == a.loc && rows * l == len => {
            (copy.checked_sub(2)?, Some((copy - 1, *l)), *x)
        }
        _ => (copy - 1, None, a.loc),
    };
    let Step::Gemm(GemmStep {
        batch,
        rows,
        n,
        residual: None,
        y,
        ..
    }) = &steps[product]
    else {
        return None;
    };
    let rows_match = softmax.is_none_or(|(_, l)| l == *n);
    (*y == copied && batch * rows * n == len && rows_match)
        .then_some((product, softmax.map(|(s, _)| s)))
}

/// Row-major strides of `dims`, in elements.
fn contiguous_strides(dims: &[usize]) -> Vec<i64> {
    let mut strides = vec![1i64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1] as i64;
    }
    strides
}
