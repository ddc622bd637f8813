// SPDX-License-Identifier: MPL-2.0
//! Accuracy on real data: the digits classifier (`models/digits/train.py`, a small CNN
//! trained on scikit-learn's handwritten digits) classifies its held-out digits, as frames,
//! within a point of onnxruntime's fp32 accuracy on them. The GPU's precisions are checked the
//! same way in the plugin's `tests/cuda.rs`.

use trtclassify_compiler::testing::{DIGITS_SIZE, accuracy, digits_heldout, models};
use trtclassify_engine::frame::FrameView;
use trtclassify_engine::{Backend, EngineOptions, build};

#[test]
fn the_cpu_backend_keeps_the_digits_accuracy() {
    let digits = digits_heldout();
    let mut options = EngineOptions::new(models().join("digits/digits.onnx"));
    options.batch_size = 16;
    let mut engine = build(Backend::Cpu, &options).expect("the cpu engine builds");
    let frames: Vec<FrameView> = (digits.frames.iter())
        .map(|f| FrameView::rgb(DIGITS_SIZE, DIGITS_SIZE, f))
        .collect();
    let scores = engine.classify(&frames).expect("the digits classify");
    let got = accuracy(&scores, &digits.labels);
    println!(
        "digits, held out: backend=cpu {:.2}%, onnxruntime fp32 {:.2}% ({} images)",
        got * 100.0,
        digits.onnxruntime_accuracy * 100.0,
        digits.labels.len()
    );
    assert!(
        got >= digits.onnxruntime_accuracy - 0.01,
        "backend=cpu classifies {:.2}% of the held-out digits right, onnxruntime {:.2}%",
        got * 100.0,
        digits.onnxruntime_accuracy * 100.0
    );
}
