// SPDX-License-Identifier: MPL-2.0
//! Calibration for the int8 and FP8 precisions: frames preprocessed as the engine would
//! preprocess them, run through the model's f32 plan on the CPU
//! (`trtclassify_cpu::CalibrationRunner`), make the table of each quantizable node's input
//! range and error (`compiler::quant::CalibrationTable`). Frames held out instead keep their
//! f32 scores (`compiler::quant::HeldOut`), against which a build measures the quantized
//! engine. `trtclassify-engine calibrate` writes both from a folder of images or a video.

use crate::compiler::quant::{CalibrationTable, HeldOut};
use crate::frame::FrameView;
use crate::preprocess::{Crop, Preprocessor};
use crate::{EngineError, EngineOptions, OnnxModel};

/// `Calibration::take` holds out one frame in this many for the build's accuracy guard...
pub const HOLD_OUT_EVERY: usize = 8;
/// ...up to this many: enough to see a layer gone wrong, few enough to keep the file small
/// (a 224×224 frame is 300 KB in fp16).
pub const HOLD_OUT_MOST: usize = 32;

/// Frames gathered for one model's calibration table.
pub struct Calibration {
    runner: trtclassify_cpu::CalibrationRunner,
    preprocessor: Preprocessor,
    input: Vec<f32>,
    held_out: HeldOut,
}

impl Calibration {
    /// Calibration of `options.model`, its frames preprocessed as `options.preprocess` says.
    pub fn new(options: &EngineOptions) -> Result<Self, EngineError> {
        let model = OnnxModel::load(&options.model)?;
        let fail = |reason: String| EngineError::Build {
            path: model.path.clone(),
            reason,
        };
        let spec = model.input_spec(options.input_size).map_err(fail)?;
        let runner = trtclassify_cpu::CalibrationRunner::new(&model, spec)
            .map_err(|e| fail(format!("calibration: {e}")))?;
        let preprocessor = Preprocessor::new(options.preprocess.clone(), spec).map_err(fail)?;
        Ok(Calibration {
            held_out: HeldOut::new(spec.frame_len(), runner.classes()),
            runner,
            preprocessor,
            input: vec![0.0; spec.frame_len()],
        })
    }

    /// Runs `frame` through the model and keeps what its quantizable steps read.
    pub fn add(&mut self, frame: &FrameView) -> Result<(), EngineError> {
        self.preprocessed(frame, Self::add_input)
    }

    /// Takes `frame` into the table, or holds it out: every `HOLD_OUT_EVERY`th frame is
    /// held out, up to `HOLD_OUT_MOST` of them.
    pub fn take(&mut self, frame: &FrameView) -> Result<(), EngineError> {
        self.preprocessed(frame, Self::take_input)
    }

    /// `take` for a frame already in the model's input layout (as `add_input`).
    pub fn take_input(&mut self, input: &[f32]) -> Result<(), EngineError> {
        let seen = self.frames() + self.held_out.frames();
        let hold_out =
            seen % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1 && self.held_out.frames() < HOLD_OUT_MOST;
        match hold_out {
            true => self.hold_out_input(input),
            false => self.add_input(input),
        }
    }

    /// Keeps `frame` out of the table, with the model's f32 scores for it.
    pub fn hold_out(&mut self, frame: &FrameView) -> Result<(), EngineError> {
        self.preprocessed(frame, Self::hold_out_input)
    }

    /// `then` on `frame` preprocessed as the engine's defaults do.
    fn preprocessed(
        &mut self,
        frame: &FrameView,
        then: fn(&mut Self, &[f32]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        self.preprocessor
            .run(frame, &[Crop::Whole], &mut self.input)?;
        let input = std::mem::take(&mut self.input);
        let done = then(self, &input);
        self.input = input;
        done
    }

    /// Keeps a frame (its model input) out of the table, with the model's f32 scores for it:
    /// a frame the build measures the quantized engine on.
    pub fn hold_out_input(&mut self, input: &[f32]) -> Result<(), EngineError> {
        self.check_len(input)?;
        let scores = self.runner.score(input);
        self.held_out.push(input, &scores);
        Ok(())
    }

    /// The frames held out so far, with their scores.
    pub fn held_out(&self) -> &HeldOut {
        &self.held_out
    }

    /// Runs one frame already in the model's input layout (`InputSpec::frame_len` values,
    /// preprocessed) through the model, as `add` does for frames.
    pub fn add_input(&mut self, input: &[f32]) -> Result<(), EngineError> {
        self.check_len(input)?;
        self.runner.run(input);
        Ok(())
    }

    /// An error unless `input` is one frame of the model's input.
    fn check_len(&self, input: &[f32]) -> Result<(), EngineError> {
        match input.len() == self.held_out.frame_len {
            true => Ok(()),
            false => Err(EngineError::Inference(format!(
                "calibration: a model input of {} values, where the model takes {}",
                input.len(),
                self.held_out.frame_len
            ))),
        }
    }

    /// The values of one frame of model input.
    pub fn frame_len(&self) -> usize {
        self.held_out.frame_len
    }

    /// Frames added so far.
    pub fn frames(&self) -> usize {
        self.runner.frames()
    }

    /// The table of the frames added so far.
    pub fn table(&self) -> CalibrationTable {
        self.runner.table()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compiler::testing::{digits_calibration, models};

    /// The digits' calibration frames, preprocessed by the engine's own preprocessing, give
    /// the committed table (made from the training script's model inputs by `sim`).
    #[test]
    fn calibration_of_frames_makes_the_committed_digits_table() {
        let options = EngineOptions::new(models().join("digits/digits.onnx"));
        let mut calibration = Calibration::new(&options).expect("calibration");
        let digits = digits_calibration();
        for frame in digits.views() {
            calibration.add(&frame).expect("a frame");
        }
        assert_eq!(calibration.frames(), 128);
        let got = calibration.table();
        let want = CalibrationTable::load(&models().join("digits/digits_calibration.txt"))
            .expect("the committed table");
        for (name, w) in &want.nodes {
            let g = got.get(name).unwrap_or_else(|| panic!("{name} calibrated"));
            // The preprocessing's rounding differs from numpy's by a last bit at most.
            let close = |a: f32, b: f32| (a - b).abs() <= 1e-3 * b.abs().max(1e-3);
            assert!(
                close(g.amax, w.amax) && close(g.int8, w.int8),
                "{name}: {g:?}, committed {w:?}"
            );
        }
    }

    #[test]
    fn a_missing_model_is_named() {
        let options = EngineOptions::new("/nonexistent/model.onnx");
        let err = Calibration::new(&options).err().expect("no model");
        assert!(err.to_string().contains("/nonexistent/model.onnx"), "{err}");
    }
}
