// SPDX-License-Identifier: MPL-2.0
//! Calibration on the CPU: the model's f32 plan run one step at a time on calibration
//! frames, each quantizable step's input read before the step runs
//! (`compiler::quant::Calibrator`). Any host calibrates, GPU or not, and the table serves the
//! GPU engines of every batch size, which key it by ONNX node as the CPU plan does.

use std::sync::Arc;

use trtclassify_compiler::check::check_plan;
use trtclassify_compiler::plan::{DType, Loc, Plan, Span, Weights};
use trtclassify_compiler::quant::{CalibrationTable, Calibrator, Stepper};
use trtclassify_compiler::spec::InputSpec;
use trtclassify_compiler::{self as compiler, CompileError, OnnxModel};

use crate::kernels::{self, Aligned, Buffers, Packed, Scratch, Threads};

/// A model's one-frame plan with its packed weights, for calibration.
pub struct CalibrationRunner {
    plan: Plan,
    weights: Weights,
    packed: Vec<Packed>,
    calibrator: Calibrator,
}

impl CalibrationRunner {
    /// Compiles `model` for one frame; fails where the compiler does not take the model
    /// (which the GPU engine then cannot build either).
    pub fn new(model: &OnnxModel, spec: InputSpec) -> Result<Self, CompileError> {
        let (mut plans, weights) = compiler::compile_for_cpu(model, &[1], spec)?;
        let mut plan = plans.pop().expect("a plan per batch size");
        let num_classes = plan.output_len;
        let weight = |i: usize| weights.data.get(i).map(|w| (w.len(), DType::F32));
        check_plan(
            &mut plan,
            &weight,
            DType::F32,
            spec.frame_len(),
            num_classes,
        )?;
        // Unfused: the runner's fusions leave some steps' outputs unwritten (an activation
        // applied by the step before, an input scaled inside the product that reads it),
        // and calibration reads every quantizable step's input from memory.
        let packed = (plan.steps.iter())
            .map(|s| kernels::pack(s, &weights.data))
            .collect();
        Ok(CalibrationRunner {
            plan,
            weights,
            packed,
            calibrator: Calibrator::new(),
        })
    }

    /// Runs one frame (`input`: the model's input, preprocessed) and records what each
    /// quantizable step read.
    pub fn run(&mut self, input: &[f32]) {
        let mut memory = Memory::new(&self.plan, &self.packed, &self.weights.data, input);
        let Ok(()) = self.calibrator.run(&self.plan, &mut memory);
    }

    /// The model's f32 scores for one frame, recording nothing: the reference a quantized
    /// engine is measured against on held-out frames.
    pub fn score(&mut self, input: &[f32]) -> Vec<f32> {
        let mut memory = Memory::new(&self.plan, &self.packed, &self.weights.data, input);
        for step in 0..self.plan.steps.len() {
            let Ok(()) = memory.run_step(step);
        }
        memory.output
    }

    /// Scores per frame.
    pub fn classes(&self) -> usize {
        self.plan.output_len
    }

    /// Frames run so far.
    pub fn frames(&self) -> usize {
        self.calibrator.frames()
    }

    /// The table of what the frames run so far showed.
    pub fn table(&self) -> CalibrationTable {
        self.calibrator.table(&self.weights)
    }
}

/// One frame's buffers, as the plan's steps fill them.
struct Memory<'a> {
    plan: &'a Plan,
    packed: &'a [Packed],
    weights: &'a [Arc<Vec<f32>>],
    arena: Aligned,
    input: &'a [f32],
    output: Vec<f32>,
    scratch: Scratch,
    threads: Threads,
}

impl<'a> Memory<'a> {
    /// The buffers of one frame of `plan`, its model input `input`.
    fn new(
        plan: &'a Plan,
        packed: &'a [Packed],
        weights: &'a [Arc<Vec<f32>>],
        input: &'a [f32],
    ) -> Self {
        assert_eq!(input.len(), plan.input_len, "one frame's model input");
        let mut memory = Memory {
            plan,
            packed,
            weights,
            arena: Aligned::default(),
            input,
            output: vec![0.0; plan.output_len],
            scratch: Scratch::default(),
            threads: Threads::new(crate::cores(), true),
        };
        memory.arena.resize(plan.arena_len);
        memory
    }
}

impl Stepper for Memory<'_> {
    type Error = std::convert::Infallible;

    fn run_step(&mut self, step: usize) -> Result<(), Self::Error> {
        let buffers = Buffers {
            arena: self.arena.as_mut_slice().as_mut_ptr(),
            input: self.input.as_ptr(),
            output: self.output.as_mut_ptr(),
            weights: self.weights,
        };
        let (step, packed) = (&self.plan.steps[step], &self.packed[step]);
        kernels::run(step, packed, &buffers, &mut self.scratch, self.threads);
        Ok(())
    }

    /// Spans of checked plans lie within their buffers.
    fn read(&mut self, span: Span) -> Result<Vec<f32>, Self::Error> {
        let (buffer, offset): (&[f32], usize) = match span.loc {
            Loc::Arena(o) => (self.arena.as_slice(), o),
            Loc::Input(o) => (self.input, o),
            Loc::Output(o) => (&self.output, o),
            Loc::Weight { index, offset } => (&self.weights[index], offset),
            Loc::Wide(_) | Loc::Temp { .. } => unreachable!("not in a checked f32 plan"),
        };
        let start = (offset as i128 + span.start) as usize;
        let end = (offset as i128 + span.end) as usize;
        Ok(buffer[start..end].to_vec())
    }
}
