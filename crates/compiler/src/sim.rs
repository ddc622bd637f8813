// SPDX-License-Identifier: MPL-2.0
//! Runs a plan on the CPU in f32, step by step as the GPU would: the same arena offsets,
//! layouts and strides. A lowering bug (a wrong stride, two live buffers sharing memory)
//! shows here as a result that differs from `reference`.

use super::plan::{Loc, Plan, Span, Step, Weights};

/// The buffers of a plan, in f32.
pub(crate) struct Memory<'a> {
    arena: Vec<f32>,
    wide: Vec<f32>,
    weights: &'a Weights,
    input: &'a [f32],
    output: Vec<f32>,
}

impl Memory<'_> {
    /// Element `i` after `loc`.
    pub(crate) fn read(&self, loc: Loc, i: usize) -> f32 {
        match loc {
            Loc::Arena(o) => self.arena[o + i],
            Loc::Wide(o) => self.wide[o + i],
            Loc::Weight { index, offset } => self.weights.data[index][offset + i],
            Loc::Input(o) => self.input[o + i],
            Loc::Output(o) => self.output[o + i],
            Loc::Temp { .. } => panic!("an unplaced buffer in a plan"),
        }
    }

    /// Sets element `i` after `loc`.
    pub(crate) fn write(&mut self, loc: Loc, i: usize, v: f32) {
        match loc {
            Loc::Arena(o) => self.arena[o + i] = v,
            Loc::Wide(o) => self.wide[o + i] = v,
            Loc::Output(o) => self.output[o + i] = v,
            other => panic!("a write to {other:?}"),
        }
    }
}

/// Runs `plan` on `input` (one batch in the plan's input layout) and returns its output.
pub fn run(plan: &Plan, weights: &Weights, input: &[f32]) -> Vec<f32> {
    assert_eq!(input.len(), plan.input_len);
    let mut m = Memory {
        // NaN marks memory no step has written: reading it shows in the result.
        arena: vec![f32::NAN; plan.arena_len],
        wide: vec![f32::NAN; plan.wide_len],
        weights,
        input,
        output: vec![f32::NAN; plan.output_len],
    };
    for step in &plan.steps {
        run_step(&mut m, step);
    }
    m.output
}

/// Runs `plan` one step at a time over an arena that starts zeroed (as the GPU's does when
/// it looks for an overflow), and returns where its values first pass `limit`.
pub fn first_overflow(
    plan: &Plan,
    weights: &Weights,
    input: &[f32],
    limit: f32,
) -> Option<super::overflow::Overflow> {
    let mut m = Memory {
        arena: vec![0.0; plan.arena_len],
        wide: vec![0.0; plan.wide_len],
        weights,
        input,
        output: vec![0.0; plan.output_len],
    };
    let found = super::overflow::first_overflow(plan, limit, |i| {
        let step = &plan.steps[i];
        run_step(&mut m, step);
        let span = step.written();
        let start = usize::try_from(span.start).map_err(|_| "a span before its buffer")?;
        let end = usize::try_from(span.end).map_err(|_| "a negative span")?;
        Ok::<_, &str>((start..end).map(|j| m.read(span.loc, j)).collect())
    });
    found.expect("spans within their buffers")
}

/// A plan run one step at a time, its buffers read between steps (`quant::Calibrator`).
pub struct Stepper<'a> {
    plan: &'a Plan,
    memory: Memory<'a>,
}

impl<'a> Stepper<'a> {
    /// `plan` over `input` (one batch in the plan's input layout), before its first step.
    pub fn new(plan: &'a Plan, weights: &'a Weights, input: &'a [f32]) -> Self {
        assert_eq!(input.len(), plan.input_len);
        let memory = Memory {
            arena: vec![f32::NAN; plan.arena_len],
            wide: vec![f32::NAN; plan.wide_len],
            weights,
            input,
            output: vec![f32::NAN; plan.output_len],
        };
        Stepper { plan, memory }
    }

    /// The output, once every step ran.
    pub fn output(self) -> Vec<f32> {
        self.memory.output
    }
}

impl crate::quant::Stepper for Stepper<'_> {
    type Error = std::convert::Infallible;

    fn run_step(&mut self, step: usize) -> Result<(), Self::Error> {
        run_step(&mut self.memory, &self.plan.steps[step]);
        Ok(())
    }

    fn read(&mut self, span: Span) -> Result<Vec<f32>, Self::Error> {
        let start = usize::try_from(span.start).expect("a span within its buffer");
        let end = usize::try_from(span.end).expect("a span within its buffer");
        Ok((start..end)
            .map(|i| self.memory.read(span.loc, i))
            .collect())
    }
}

/// Each kind of step computed in f32, reading and writing `Memory` as its kernels would.
pub(crate) trait Simulate {
    /// Runs the step over `m`.
    fn simulate(&self, m: &mut Memory);
}

fn run_step(m: &mut Memory, step: &Step) {
    crate::with_step!(step, s => s.simulate(m))
}
