// SPDX-License-Identifier: MPL-2.0
//! A CNN classifier's last steps at small batches, as one `HeadStep`: the global average
//! pool, the product that writes the scores in f32 (`scores`), and what follows it, the
//! softmax that adds the product's bias or the bias alone; and the activation before the
//! pool where it has one that cuBLASLt's epilogue could not take (MobileNetV2's clip,
//! EfficientNet's SiLU). Three or four launches of almost no work, which a batch of one
//! waits for one after the other. For the GPU's fp16 plans, after `scores` has settled how
//! they end.

use crate::ir::{Act, BinOp};
use crate::plan::{
    Cast, EwStep, GlobalAvgPoolStep, HEAD_MAX_BATCH, HeadStep, Loc, SoftmaxStep, Step, StepKind,
    covers_once,
};

/// Replaces the end of `steps` (with their `origins`) by a `HeadStep` where it has that form.
pub(super) fn head(steps: &mut Vec<Step>, origins: &mut Vec<String>) {
    let Some((mut head, mut first)) = head_at(steps) else {
        return;
    };
    // The product's node names the step: the classifier the head computes.
    let product = origins[first + 1].clone();
    if let Some((x, act)) = first
        .checked_sub(1)
        .and_then(|i| activation_of(&steps[i], &head))
    {
        (head.x, head.act_in) = (x, act);
        first -= 1;
    }
    steps.truncate(first);
    steps.push(Step::Head(head));
    origins.truncate(first);
    origins.push(product);
}

/// The head that ends `steps`, and the index of its pool.
fn head_at(steps: &[Step]) -> Option<(HeadStep, usize)> {
    let last = steps.len().checked_sub(1)?;
    let (bias, softmax, product) = match &steps[last] {
        Step::Softmax(SoftmaxStep {
            rows,
            len,
            x,
            bias,
            y,
        }) if x == y => (*bias, Some((*rows, *len, *y)), last.checked_sub(1)?),
        Step::Ew(e) => (bias_alone(e)?, None, last.checked_sub(1)?),
        _ => (None, None, last),
    };
    let Step::Gemm(g) = steps.get(product)? else {
        return None;
    };
    let pool = product.checked_sub(1)?;
    let Step::GlobalAvgPool(GlobalAvgPoolStep { n, hw, c, x, y }) = steps[pool] else {
        return None;
    };
    // The bias's rows are the product's.
    if let Step::Ew(e) = &steps[last]
        && !(e.dims == [g.rows, g.n] && e.a.loc == g.y && e.out.loc == g.y)
    {
        return None;
    }
    let plain = g.batch == 1
        && g.alpha == 1.0
        && !g.w_transposed
        && g.bias.is_none()
        && g.residual.is_none()
        && g.act == Act::None
        && g.quant.is_none()
        && matches!(g.w, Loc::Weight { .. });
    let shapes = g.x == y && (g.rows, g.k) == (n, c) && matches!(g.y, Loc::Output(0));
    let narrow = matches!(x, Loc::Arena(_)) && matches!(y, Loc::Arena(_));
    let scores = softmax.is_none_or(|(rows, len, s)| (rows, len, s) == (n, g.n, g.y));
    let head = HeadStep {
        n,
        hw,
        c,
        classes: g.n,
        x,
        act_in: Act::None,
        w: g.w,
        bias,
        softmax: softmax.is_some(),
        y: g.y,
    };
    (plain && shapes && narrow && scores && n <= HEAD_MAX_BATCH && head.sizes_fit())
        .then_some((head, pool))
}

/// The bias `e` adds to the scores in place, where that is all it does.
fn bias_alone(e: &EwStep) -> Option<Option<Loc>> {
    let EwStep {
        op: Some(BinOp::Add),
        act: Act::None,
        cast: Cast::F32,
        dims,
        out,
        a,
        b: Some(b),
    } = e
    else {
        return None;
    };
    // `scores` adds a single product's bias as rows of `n`: strides `[0, 1]`.
    let rows = dims.len() == 2 && b.strides == [0, 1] && a == out;
    rows.then_some(Some(b.loc))
}

/// Where `pass` applies an activation to all of `head`'s input, from a buffer of the arena
/// that nothing after it reads (the head is the plan's end): that buffer, and the
/// activation. Only activations no larger than their input, so that computing them in f32
/// without rounding them to fp16 cannot hide a value fp16 could not hold from the plan's
/// overflow check.
fn activation_of(pass: &Step, head: &HeadStep) -> Option<(Loc, Act)> {
    let Step::Ew(EwStep {
        op: None,
        act,
        cast: Cast::None,
        dims,
        out,
        a,
        b: None,
    }) = pass
    else {
        return None;
    };
    let whole = a.strides == out.strides
        && covers_once(dims, &out.strides, head.n * head.hw * head.c)
        && out.loc == head.x;
    let bounded = matches!(
        act,
        Act::Relu
            | Act::LeakyRelu(-1.0..=1.0)
            | Act::Clip(..)
            | Act::Sigmoid
            | Act::HardSigmoid(..)
            | Act::Silu
            | Act::HardSwish
    );
    (whole && bounded && matches!(a.loc, Loc::Arena(_))).then_some((a.loc, *act))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::plan::{DType, GemmStep, Plan, Strided, Weights};
    use crate::testing::assert_close;

    /// An fp16 plan's end as `scores` leaves it: `n` images of 4 pixels of 16 channels, perhaps
    /// activated by a step of their own, pooled, multiplied into 12 classes in f32, then the
    /// softmax that adds the bias, or the bias alone.
    fn plan(n: usize, act: Act, softmax: bool, weights: &mut Weights) -> Plan {
        let (hw, c, classes) = (4, 16, 12);
        let ramp = |len: usize, scale: f32| -> Arc<Vec<f32>> {
            Arc::new((0..len).map(|i| (i % 7) as f32 * scale - 0.5).collect())
        };
        let w = weights.add("w", &ramp(c * classes, 0.1), false);
        let bias = weights.add("b", &ramp(classes, 0.3), false);
        let weight = |index| Loc::Weight { index, offset: 0 };
        let dense = |loc| Strided {
            loc,
            strides: vec![1],
        };
        let len = n * hw * c;
        let (x, activated, pooled) = (Loc::Arena(0), Loc::Arena(len), Loc::Arena(2 * len));
        let mut steps = vec![Step::Ew(EwStep {
            op: None,
            act: Act::None,
            cast: Cast::FromF32,
            dims: vec![len],
            out: dense(x),
            a: dense(Loc::Input(0)),
            b: None,
        })];
        if !act.is_none() {
            steps.push(Step::Ew(EwStep {
                op: None,
                act,
                cast: Cast::None,
                dims: vec![len],
                out: dense(activated),
                a: dense(x),
                b: None,
            }));
        }
        let pool_x = if act.is_none() { x } else { activated };
        steps.push(Step::GlobalAvgPool(GlobalAvgPoolStep {
            n,
            hw,
            c,
            x: pool_x,
            y: pooled,
        }));
        steps.push(Step::Gemm(GemmStep {
            batch: 1,
            alpha: 1.0,
            rows: n,
            n: classes,
            k: c,
            x: pooled,
            x_batch: 0,
            w: weight(w),
            w_transposed: false,
            bias: None,
            residual: None,
            act: Act::None,
            y: Loc::Output(0),
            y_batch: n * classes,
            quant: None,
            algo: None,
        }));
        steps.push(match softmax {
            true => Step::Softmax(SoftmaxStep {
                rows: n,
                len: classes,
                x: Loc::Output(0),
                bias: Some(weight(bias)),
                y: Loc::Output(0),
            }),
            false => Step::Ew(EwStep {
                op: Some(BinOp::Add),
                act: Act::None,
                cast: Cast::F32,
                dims: vec![n, classes],
                out: Strided {
                    loc: Loc::Output(0),
                    strides: vec![classes as i64, 1],
                },
                a: Strided {
                    loc: Loc::Output(0),
                    strides: vec![classes as i64, 1],
                },
                b: Some(Strided {
                    loc: weight(bias),
                    strides: vec![0, 1],
                }),
            }),
        });
        Plan {
            batch: n,
            dtype: DType::F16,
            arena_len: 2 * len + n * c,
            wide_len: 0,
            input_len: len,
            output_len: n * classes,
            origins: (0..steps.len()).map(|i| format!("node {i}")).collect(),
            steps,
        }
    }

    /// The head takes the pool, the product and the softmax or bias after it, and the
    /// activation before the pool where there is one it may compute in f32, and gives the
    /// scores the steps gave, less their rounding to fp16 between; it names the product.
    #[test]
    fn the_head_gives_the_scores_of_the_steps_it_takes() {
        let cases = [
            (1, Act::None, true, Some(Act::None)),
            (1, Act::Silu, true, Some(Act::Silu)),
            (3, Act::Clip(0.0, 6.0), false, Some(Act::Clip(0.0, 6.0))),
            (HEAD_MAX_BATCH, Act::Relu, false, Some(Act::Relu)),
            // An activation larger than its input stays a step of its own.
            (2, Act::Exp, true, Some(Act::None)),
            (HEAD_MAX_BATCH + 1, Act::None, true, None),
        ];
        for (n, act, softmax, taken) in cases {
            let case = format!("{n} images, {act:?}, softmax {softmax}");
            let mut weights = Weights::default();
            let mut plan = plan(n, act, softmax, &mut weights);
            let input: Vec<f32> = (0..plan.input_len)
                .map(|i| (i % 11) as f32 * 0.3 - 1.5)
                .collect();
            let want = crate::sim::run(&plan, &weights, &input);
            let product = plan.origins[plan.steps.len() - 2].clone();
            head(&mut plan.steps, &mut plan.origins);
            assert_eq!(plan.steps.len(), plan.origins.len(), "{case}");
            let got = match plan.steps.last() {
                Some(Step::Head(h)) => Some(h.act_in),
                _ => None,
            };
            assert_eq!(got, taken, "{case}");
            if taken.is_some() {
                assert_eq!(plan.origins.last(), Some(&product), "{case}");
            }
            assert_close(&crate::sim::run(&plan, &weights, &input), &want, 1e-2);
        }
    }
}
