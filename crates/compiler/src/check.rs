// SPDX-License-Identifier: MPL-2.0
//! A plan's validation: every step's sizes fit what its kernel takes and keep it inside the
//! buffers it names. The plan runners (GPU and CPU) index raw memory with these numbers, and
//! a plan may come from an engine file on disk, so nothing runs one that has not passed here.

use super::CompileError;
use super::plan::{DType, Loc, Plan, StepKind};

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
        // f32 apart from the plan's type: the frames, the scores, values kept in f32.
        let is_f32 = |loc: Loc| match loc {
            Loc::Weight { index, .. } => weight(index).is_some_and(|(_, t)| t != dtype),
            Loc::Arena(_) | Loc::Temp { .. } => false,
            Loc::Input(_) | Loc::Output(_) | Loc::Wide(_) => true,
        };
        if let Err(what) = step.check(&Types {
            dtype,
            is_f32: &is_f32,
        }) {
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

/// What a step's buffers hold: every step reads and writes one type, the plan's or, for a
/// node kept in f32, f32 (`is_f32`: the frames, the scores and the values and weights kept
/// in f32), except the casts between them and the scores, which a product may write in f32
/// from operands of the plan's type: a step that took a buffer's elements for the other type
/// would read half or twice as many bytes as it holds. In an fp32 plan every type is f32, and
/// only the casts of the frames and the scores are held to their buffers.
pub struct Types<'a> {
    /// The plan's type.
    pub dtype: DType,
    /// Whether a buffer holds f32 where the plan's type is fp16.
    pub is_f32: &'a dyn Fn(Loc) -> bool,
}

impl Types<'_> {
    /// Whether every buffer is f32 (an fp32 plan).
    pub fn plain(&self) -> bool {
        self.dtype == DType::F32
    }

    /// The rule of most steps: every buffer the step touches (an empty operand touches
    /// nothing) holds the step's type (f32 for a step of a node kept in f32), and none is the
    /// frames.
    pub fn uniform(&self, step: &(impl StepKind + ?Sized)) -> bool {
        let locs: Vec<Loc> = (step.spans().iter())
            .filter(|s| s.end > s.start)
            .map(|s| s.loc)
            .collect();
        let wide = step.is_wide();
        self.plain()
            || locs.iter().all(|&l| (self.is_f32)(l) == wide)
                && locs.iter().all(|l| !matches!(l, Loc::Input(_)))
    }
}

/// `StepKind::check`'s common part: the sizes, then the types.
pub fn sizes_and_types(step: &(impl StepKind + ?Sized), types: &Types) -> Result<(), String> {
    if !step.sizes_fit() {
        return Err("sizes its kernel cannot take".into());
    }
    if !step.types_fit(types) {
        return Err(
            "reads or writes a buffer in the wrong type (the frames, the scores, \
                    or a value kept in f32)"
                .into(),
        );
    }
    Ok(())
}
