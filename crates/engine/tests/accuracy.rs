// SPDX-License-Identifier: MPL-2.0
//! Accuracy on real data: the digits classifier (`models/digits/train.py`, a small CNN
//! trained on scikit-learn's handwritten digits) classifies its held-out digits, as frames,
//! within a point of onnxruntime's fp32 accuracy on them. The GPU's precisions are checked the
//! same way in the plugin's `tests/cuda.rs`.

use trtclassify_compiler::testing::{digits_heldout, models};
use trtclassify_engine::{Backend, EngineOptions, build};

#[test]
fn the_cpu_backend_keeps_the_digits_accuracy() {
    let digits = digits_heldout();
    let mut options = EngineOptions::new(models().join("digits/digits.onnx"));
    options.batch_size = 16;
    let mut engine = build(Backend::Cpu, &options).expect("the cpu engine builds");
    let scores = engine
        .classify(&digits.views())
        .expect("the digits classify");
    digits.check("backend=cpu", &scores);
}
