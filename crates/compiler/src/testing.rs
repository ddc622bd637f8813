// SPDX-License-Identifier: MPL-2.0
//! Helpers for tests of the compiler and of the runtimes built on it (the `testing` feature):
//! the repository's models and onnxruntime's outputs for them, and a tolerance check.

use std::path::{Path, PathBuf};

use crate::ir::Tensor;

/// The repository's root (this crate lives in `crates/compiler`).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The repository's `models/` folder.
pub fn models() -> PathBuf {
    repo().join("models")
}

/// One reference file: the input frames and onnxruntime's outputs for them.
pub(crate) struct Reference {
    /// The input, in the model's layout.
    pub(crate) input: Tensor,
    /// onnxruntime's outputs, frame after frame.
    pub(crate) output: Vec<f32>,
}

/// The input frames and onnxruntime's outputs in `models/NAME` (a `_reference.json`).
pub fn reference_frames(name: &str) -> (Vec<f32>, Vec<f32>) {
    let r = load_reference(name);
    (r.input.data.to_vec(), r.output)
}

/// The reference file `models/NAME`.
pub(crate) fn load_reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(models().join(name)).expect("reference file");
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference json");
    let floats = |key: &str| -> Vec<f32> {
        v[key]
            .as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_f64().expect("number") as f32)
            .collect()
    };
    let shape: Vec<usize> = v["input_shape"]
        .as_array()
        .expect("shape")
        .iter()
        .map(|d| d.as_u64().expect("dim") as usize)
        .collect();
    Reference {
        input: Tensor::new(shape, floats("input")),
        output: floats("output"),
    }
}

/// Asserts that `got` is `want` within `tolerance`, relative above 1 and absolute below.
#[track_caller]
pub fn assert_close(got: &[f32], want: &[f32], tolerance: f32) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tolerance * (1.0 + w.abs()),
            "value {i}: got {g}, want {w}"
        );
    }
}
