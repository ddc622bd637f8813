// SPDX-License-Identifier: MPL-2.0
//! A plan's validation: every step's sizes fit what its kernel takes and keep it inside the
//! buffers it names. The plan runners (GPU and CPU) index raw memory with these numbers, and
//! a plan may come from an engine file on disk, so nothing runs one that has not passed here.

use super::CompileError;
use super::ir::Act;
use super::plan::{Cast, DType, Loc, MAX_RANK, MAX_WORKSPACE, Plan, Step, attention_takes};

/// One plan holds the batch's frames and scores in its input and output buffers, and every
/// step's sizes fit what its kernel takes and keep it inside the buffers it names
/// (`weight`: the number of values of each weight and their type). The CPU backend checks
/// its plans with it too.
pub fn check_plan(
    plan: &mut Plan,
    weight: &dyn Fn(usize) -> Option<(usize, DType)>,
    dtype: DType,
    frame_len: usize,
    num_classes: usize,
) -> Result<(), CompileError> {
    let batch = plan.batch;
    let fail = |problem: String| Err(CompileError::Plan { batch, problem });
    if plan.dtype != dtype {
        return fail("another precision".into());
    }
    if plan.origins.len() != plan.steps.len() {
        return fail(format!(
            "{} steps but {} origins",
            plan.steps.len(),
            plan.origins.len()
        ));
    }
    if Some(plan.input_len) != batch.checked_mul(frame_len)
        || Some(plan.output_len) != batch.checked_mul(num_classes)
    {
        return fail(format!(
            "input of {} and output of {} values, for frames of {frame_len} and {num_classes} classes",
            plan.input_len, plan.output_len
        ));
    }
    if plan.wide_len > 0 && dtype != DType::F16 {
        return fail("an f32 arena apart in an fp32 plan".into());
    }
    let weight_len = |index| weight(index).map(|(len, _)| len);
    let buffer_len = |loc: Loc| -> Option<i128> {
        let len = match loc {
            Loc::Arena(_) => plan.arena_len,
            Loc::Wide(_) => plan.wide_len,
            Loc::Input(_) => plan.input_len,
            Loc::Output(_) => plan.output_len,
            Loc::Weight { index, .. } => weight_len(index)?,
            Loc::Temp { .. } => return None,
        };
        Some(len as i128)
    };
    // `locs_mut` is the one list of a step's buffers; nothing is changed through it here.
    for (s, step) in plan.steps.iter_mut().enumerate() {
        let kind = step.describe();
        let fail = |problem: String| {
            Err(CompileError::Step {
                batch,
                step: s,
                kind: kind.clone(),
                problem,
            })
        };
        if matches!(step, Step::Attention(_)) && dtype != DType::F16 {
            return fail("fused attention in an fp32 plan: its kernel runs fp16 only".into());
        }
        let wide = step.is_wide();
        if let Step::Gemm { act, .. } = step {
            let epilogue = match act {
                Act::None | Act::Relu => true,
                Act::Gelu => dtype == DType::F16 && !wide,
                _ => false,
            };
            if !epilogue {
                return fail(format!(
                    "{act:?} in a matrix product's epilogue in {dtype:?}"
                ));
            }
        }
        // f32 apart from the plan's type: the frames, the scores, values kept in f32.
        let is_f32 = |loc: Loc| match loc {
            Loc::Weight { index, .. } => weight(index).is_some_and(|(_, t)| t != dtype),
            Loc::Arena(_) | Loc::Temp { .. } => false,
            Loc::Input(_) | Loc::Output(_) | Loc::Wide(_) => true,
        };
        if let Err(what) = check_sizes(step).and_then(|()| check_types(step, dtype, &is_f32)) {
            return fail(what);
        }
        for span in step.spans() {
            let (offset, buffer) = match span.loc {
                Loc::Arena(o) | Loc::Input(o) | Loc::Output(o) | Loc::Wide(o) => (o, "buffer"),
                Loc::Weight { index, offset } if weight_len(index).is_some() => (offset, "weight"),
                Loc::Weight { index, offset } => {
                    return fail(format!("names weight {index} at {offset}, not in the file"));
                }
                Loc::Temp { .. } => return fail("an unplaced buffer".into()),
            };
            let len = buffer_len(span.loc).expect("placed above");
            let (start, end) = (offset as i128 + span.start, offset as i128 + span.end);
            if start < 0 || end > len {
                return fail(format!(
                    "touches elements {start}..{end} of a {buffer} of {len} ({:?})",
                    span.loc
                ));
            }
        }
        // Every buffer was covered by a span (those of empty operands aside).
        for loc in step.locs_mut() {
            if matches!(loc, Loc::Temp { .. }) {
                return fail("an unplaced buffer".into());
            }
        }
    }
    Ok(())
}

/// Every step reads and writes one type, the plan's or, for a node kept in f32, f32
/// (`is_f32`: the frames, the scores and the values and weights kept in f32), except the
/// casts between them and the scores, which a product may write in f32 from operands of
/// the plan's type: a step that took a buffer's elements for the other type would read
/// half or twice as many bytes as it holds. In an fp32 plan every type is f32, and only the
/// casts of the frames and the scores are held to their buffers.
fn check_types(step: &Step, dtype: DType, is_f32: &dyn Fn(Loc) -> bool) -> Result<(), String> {
    let all = |want: bool, locs: &[Loc]| locs.iter().all(|&l| is_f32(l) == want);
    let plain = dtype == DType::F32;
    let ok = match step {
        Step::Ew {
            cast, out, a, b, ..
        } => {
            let b_is = |want: bool| b.as_ref().is_none_or(|b| is_f32(b.loc) == want);
            match cast {
                Cast::None => plain || all(false, &[out.loc, a.loc]) && b_is(false),
                Cast::Wide => all(true, &[out.loc, a.loc]) && b_is(true),
                Cast::FromF32 => is_f32(a.loc) && !is_f32(out.loc) && b_is(false),
                Cast::ToF32 => is_f32(out.loc) && !is_f32(a.loc) && b_is(false),
                Cast::F32 => all(true, &[out.loc, a.loc]) && b_is(false),
            }
        }
        // A product may write the scores in f32 (`lower::scores`), with neither a bias nor a
        // residual in the plan's type beside them in cuBLASLt's epilogue.
        Step::Gemm {
            x,
            w,
            bias: None,
            residual: None,
            y: y @ Loc::Output(_),
            ..
        } if !plain && !is_f32(*x) => all(false, &[*x, *w]) && is_f32(*y),
        // A softmax of the scores reads and writes them in f32, in place.
        Step::Softmax { x, y, .. } if [x, y].iter().any(|l| matches!(l, Loc::Output(_))) => {
            plain || matches!((x, y), (Loc::Output(a), Loc::Output(b)) if a == b)
        }
        // The fused attention runs in fp16 only.
        Step::Attention(_) => all(
            false,
            &step.spans().iter().map(|s| s.loc).collect::<Vec<_>>(),
        ),
        // Every buffer a step touches has a span (an empty operand touches nothing).
        _ => {
            let locs: Vec<Loc> = step.spans().iter().map(|s| s.loc).collect();
            plain || all(step.is_wide(), &locs) && locs.iter().all(|l| !matches!(l, Loc::Input(_)))
        }
    };
    match ok {
        true => Ok(()),
        false => Err(
            "reads or writes a buffer in the wrong type (the frames, the scores, \
                      or a value kept in f32)"
                .into(),
        ),
    }
}

/// The sizes a step passes to its kernel or library call: positive where they divide or
/// shape a descriptor, within 32 bits where the kernels take `int`, ranks within `MAX_RANK`.
fn check_sizes(step: &Step) -> Result<(), String> {
    let int = |v: usize| i32::try_from(v).is_ok();
    let positive = |v: usize| v >= 1 && int(v);
    let ok = match step {
        Step::Ew {
            op,
            dims,
            out,
            a,
            b,
            ..
        } => {
            dims.len() <= MAX_RANK
                && dims.iter().all(|&d| int(d))
                && dims
                    .iter()
                    .try_fold(1i64, |n, &d| n.checked_mul(d as i64))
                    .is_some()
                && op.is_some() == b.is_some()
                && [Some(out), Some(a), b.as_ref()]
                    .into_iter()
                    .flatten()
                    .all(|s| s.strides.len() == dims.len())
        }
        Step::Zero { .. } => true,
        Step::Conv(c) => {
            let out_dim = |i: usize, h: usize| {
                let reach = c.dilations[i] * (c.kernel[i] - 1) + 1;
                (h + 2 * c.pads[i])
                    .checked_sub(reach)
                    .map(|v| v / c.strides[i] + 1)
            };
            [c.n, c.c, c.h, c.w, c.k, c.oh, c.ow, c.group]
                .into_iter()
                .chain(c.kernel)
                .chain(c.strides)
                .chain(c.dilations)
                .all(positive)
                && c.pads.into_iter().all(int)
                && c.c % c.group == 0
                && c.k % c.group == 0
                && out_dim(0, c.h) == Some(c.oh)
                && out_dim(1, c.w) == Some(c.ow)
                && c.algo.is_none_or(|t| t.workspace <= MAX_WORKSPACE)
        }
        Step::Gemm {
            batch,
            rows,
            n,
            k,
            y_batch,
            ..
        } => {
            // The products' outputs do not overlap.
            [*batch, *rows, *n, *k].into_iter().all(positive)
                && (*batch == 1 || *y_batch >= rows * n)
        }
        Step::Pool {
            n,
            h,
            w,
            c,
            oh,
            ow,
            kernel,
            strides,
            pads,
            ..
        } => {
            [*n, *h, *w, *c, *oh, *ow]
                .into_iter()
                .chain(*kernel)
                .chain(*strides)
                .all(positive)
                && pads.iter().all(|&p| int(p))
        }
        Step::GlobalAvgPool { n, hw, c, .. } => [*n, *hw, *c].into_iter().all(positive),
        Step::Softmax { rows, len, .. }
        | Step::LayerNorm { rows, len, .. }
        | Step::RowMean { rows, len, .. } => [*rows, *len].into_iter().all(positive),
        Step::Lrn {
            pixels, c, size, ..
        } => [*pixels, *c, *size].into_iter().all(positive),
        // One block per matrix and 64 queries: the matrices count in 31 bits (the grid's x).
        Step::Attention(a) => {
            a.batch
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d).filter(|&n| int(n)))
                .is_some()
                && a.batch.into_iter().all(positive)
                && [a.queries, a.keys].into_iter().all(positive)
                && attention_takes(a.dk, a.dv)
        }
    };
    match ok {
        true => Ok(()),
        false => Err("sizes its kernel cannot take".into()),
    }
}
