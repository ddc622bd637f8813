// SPDX-License-Identifier: MPL-2.0
//! The scores of an fp16 plan in f32. A classifier's last matrix product gives logits, the
//! values of a model most likely to pass fp16's range (a random-weight EfficientNet-B0 or
//! RegNet does on a white frame); in fp16 they become infinite and the scores NaN. Where the
//! plan ends with that product, perhaps a softmax over its rows, and a plain copy into the
//! scores, the product writes the scores itself, in f32 (cuBLASLt accumulates in f32
//! anyway), the softmax runs on the scores in place, and the copy goes. The product's bias
//! and activation follow as a step of their own in f32, except a bias alone before a
//! softmax, which the softmax adds as it reads each row (a launch fewer: at batch 1 the
//! launches are most of the time).

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
        batch,
        rows,
        n,
        bias,
        act,
        y,
        ..
    }) = &mut steps[product]
    else {
        return;
    };
    *y = scores;
    let (batch, rows, n) = (*batch, *rows, *n);
    let (mut bias, act) = (bias.take(), std::mem::replace(act, Act::None));
    steps.truncate(copy);
    origins.truncate(copy);
    if let Some(s) = softmax {
        let Step::Softmax(softmax) = &mut steps[s] else {
            return;
        };
        (softmax.x, softmax.y) = (scores, scores);
        // The softmax's bias is one row's, as a single product's is.
        if act == Act::None && batch == 1 {
            softmax.bias = bias.take();
        }
    }
    if bias.is_some() || act != Act::None {
        // `[batch, rows, n]`, each product's bias the same for all its rows: a single
        // product's as rows of `n` only.
        let (dims, strides, bias_strides) = match batch {
            1 => (vec![rows, n], vec![n as i64, 1], vec![0, 1]),
            _ => (
                vec![batch, rows, n],
                vec![(rows * n) as i64, n as i64, 1],
                vec![n as i64, 0, 1],
            ),
        };
        let scores_of = |loc| Strided {
            loc,
            strides: strides.clone(),
        };
        let epilogue = Step::Ew(EwStep {
            op: bias.map(|_| BinOp::Add),
            act,
            cast: Cast::F32,
            dims,
            out: scores_of(scores),
            a: scores_of(scores),
            b: bias.map(|loc: Loc| Strided {
                loc,
                strides: bias_strides,
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
        Step::Softmax(SoftmaxStep {
            rows, len: l, x, y, ..
        }) if *y == a.loc && rows * l == len => (copy.checked_sub(2)?, Some((copy - 1, *l)), *x),
        _ => (copy - 1, None, a.loc),
    };
    let Step::Gemm(GemmStep {
        batch,
        rows,
        n,
        residual: None,
        y,
        y_batch,
        ..
    }) = &steps[product]
    else {
        return None;
    };
    let rows_match = softmax.is_none_or(|(_, l)| l == *n);
    // Several products write the scores only back to back, as the copy reads them.
    let packed = *batch == 1 || *y_batch == rows * n;
    (*y == copied && batch * rows * n == len && rows_match && packed)
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::plan::{Plan, Weights};
    use crate::testing::assert_close;

    /// An fp16 plan's end as the lowering leaves it: `batch` products of 2 rows each, with
    /// the bias of each and `act`, perhaps a softmax over the rows of their 4 columns, then
    /// the copy into the scores.
    fn plan(batch: usize, act: Act, softmax: bool, weights: &mut Weights) -> Plan {
        let (rows, k, n) = (2, 3, 4);
        let ramp = |len: usize, scale: f32| -> Arc<Vec<f32>> {
            Arc::new((0..len).map(|i| (i % 7) as f32 * scale - 0.5).collect())
        };
        let w = weights.add(&format!("w{batch}"), &ramp(batch * k * n, 0.3), false);
        let bias = weights.add(&format!("b{batch}"), &ramp(batch * n, 0.9), false);
        let weight = |index| Loc::Weight { index, offset: 0 };
        let len = batch * rows * n;
        let mut steps = vec![Step::Gemm(GemmStep {
            batch,
            alpha: 1.0,
            rows,
            n,
            k,
            x: Loc::Input(0),
            x_batch: rows * k,
            w: weight(w),
            w_transposed: false,
            bias: Some(weight(bias)),
            residual: None,
            act,
            y: Loc::Arena(0),
            y_batch: rows * n,
            quant: None,
            algo: None,
        })];
        if softmax {
            steps.push(Step::Softmax(SoftmaxStep {
                rows: batch * rows,
                len: n,
                x: Loc::Arena(0),
                bias: None,
                y: Loc::Arena(len),
            }));
        }
        let last = if softmax {
            Loc::Arena(len)
        } else {
            Loc::Arena(0)
        };
        let contiguous = |loc| Strided {
            loc,
            strides: vec![1],
        };
        steps.push(Step::Ew(EwStep {
            op: None,
            act: Act::None,
            cast: Cast::ToF32,
            dims: vec![len],
            out: contiguous(Loc::Output(0)),
            a: contiguous(last),
            b: None,
        }));
        Plan {
            batch: 1,
            dtype: DType::F16,
            arena_len: 2 * len,
            wide_len: 0,
            input_len: batch * rows * k,
            output_len: len,
            origins: (0..steps.len()).map(|i| format!("node {i}")).collect(),
            steps,
        }
    }

    #[test]
    fn the_scores_keep_each_products_bias_and_activation() {
        for (batch, act, softmax) in [
            (1, Act::None, true),
            (1, Act::None, false),
            (1, Act::Relu, true),
            (2, Act::None, true),
            (2, Act::Relu, false),
        ] {
            let case = format!("batch {batch}, {act:?}, softmax {softmax}");
            let mut weights = Weights::default();
            let mut plan = plan(batch, act, softmax, &mut weights);
            let input: Vec<f32> = (0..plan.input_len).map(|i| i as f32 * 0.25 - 1.0).collect();
            let want = crate::sim::run(&plan, &weights, &input);
            in_f32(DType::F16, &mut plan.steps, &mut plan.origins);
            assert_eq!(plan.steps.len(), plan.origins.len(), "{case}");
            // The product writes the scores; a softmax alone after a single product adds
            // its bias, else a step of its own adds the bias and the activation.
            let folded = softmax && batch == 1 && act == Act::None;
            let bias_step = (plan.steps.iter()).any(|s| matches!(s, Step::Ew(e) if e.b.is_some()));
            let softmax_bias = (plan.steps.iter())
                .any(|s| matches!(s, Step::Softmax(SoftmaxStep { bias: Some(_), .. })));
            assert_eq!((softmax_bias, bias_step), (folded, !folded), "{case}");
            assert!(
                matches!(&plan.steps[0], Step::Gemm(g) if g.y == Loc::Output(0) && g.bias.is_none()),
                "{case}"
            );
            // The same scores, less the rounding of the product's output to fp16 before.
            assert_close(&crate::sim::run(&plan, &weights, &input), &want, 1e-2);
        }
    }

    #[test]
    fn products_not_back_to_back_are_left() {
        let mut weights = Weights::default();
        let mut plan = plan(2, Act::None, true, &mut weights);
        let Step::Gemm(g) = &mut plan.steps[0] else {
            unreachable!()
        };
        g.y_batch += 8;
        let before = plan.steps.clone();
        in_f32(DType::F16, &mut plan.steps, &mut plan.origins);
        assert_eq!(plan.steps, before);
    }
}
