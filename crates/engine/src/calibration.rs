// SPDX-License-Identifier: MPL-2.0
//! Calibration for the int8 and FP8 precisions: frames preprocessed as the engine would
//! preprocess them, run through the model's f32 plan on the CPU
//! (`trtclassify_cpu::CalibrationRunner`), make the table of each quantizable node's input
//! range and error (`compiler::quant::CalibrationTable`). `trtclassify-engine calibrate`
//! writes it from a folder of images or a video.

use crate::compiler::quant::CalibrationTable;
use crate::frame::FrameView;
use crate::preprocess::{Crop, Preprocessor};
use crate::{EngineError, EngineOptions, OnnxModel};

/// Frames gathered for one model's calibration table.
pub struct Calibration {
    runner: trtclassify_cpu::CalibrationRunner,
    preprocessor: Preprocessor,
    input: Vec<f32>,
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
            runner,
            preprocessor,
            input: vec![0.0; spec.frame_len()],
        })
    }

    /// Runs `frame` through the model and keeps what its quantizable steps read.
    pub fn add(&mut self, frame: &FrameView) -> Result<(), EngineError> {
        self.preprocessor
            .run(frame, &[Crop::Whole], &mut self.input)?;
        self.runner.run(&self.input);
        Ok(())
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
