// SPDX-License-Identifier: MPL-2.0
//! Where a plan's values first pass a bound: the plan run one step at a time by a runner
//! (the GPU runtime, or `sim` in the tests) that hands back what each step wrote. The GPU
//! engine looks with it where fp16 overflows, on sample frames before it trusts an fp16
//! build and on the batch whose scores first came out not finite.

use super::plan::{Loc, Plan};

/// The first step of a plan whose output held a value beyond a bound.
#[derive(Debug, Clone, PartialEq)]
pub struct Overflow {
    /// Its index in the plan.
    pub step: usize,
    /// The step described (`Step::describe`).
    pub kind: String,
    /// The ONNX node it computes.
    pub node: String,
    /// The largest magnitude it wrote; infinite where a value was infinite or NaN.
    pub largest: f32,
}

impl std::fmt::Display for Overflow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "node `{}` (step {}: {}) ",
            self.node, self.step, self.kind
        )?;
        match self.largest.is_finite() {
            true => write!(f, "reaches {:.3e}", self.largest),
            false => write!(f, "gives infinite or NaN values"),
        }
    }
}

/// Runs `plan` step by step through `run_step` (which runs step `i` and returns the values in
/// its `Step::written` span) and returns the first step that writes a value that is not
/// finite or, into the plan's arena, whose magnitude is above `limit`; the steps after it
/// do not run.
pub fn first_overflow<E>(
    plan: &Plan,
    limit: f32,
    mut run_step: impl FnMut(usize) -> Result<Vec<f32>, E>,
) -> Result<Option<Overflow>, E> {
    for (i, step) in plan.steps.iter().enumerate() {
        let largest = run_step(i)?
            .iter()
            .map(|v| if v.is_nan() { f32::INFINITY } else { v.abs() })
            .fold(0.0f32, f32::max);
        // The scores, and the values of nodes kept in f32, are f32 whatever the plan's type:
        // only what f32 cannot hold overflows there.
        let limit = match step.written().loc {
            Loc::Output(_) | Loc::Wide(_) => f32::MAX,
            _ => limit,
        };
        if largest > limit {
            return Ok(Some(Overflow {
                step: i,
                kind: step.describe(),
                node: plan.origins.get(i).cloned().unwrap_or_default(),
                largest,
            }));
        }
    }
    Ok(None)
}
