// SPDX-License-Identifier: MPL-2.0
//! Helpers for tests of the compiler and of the runtimes built on it (the `testing` feature):
//! the repository's models and onnxruntime's outputs for them, and a tolerance check.

use std::path::{Path, PathBuf};

use crate::frame::FrameView;
use crate::ir::{Act, Tensor};
use crate::plan::{ConvStep, Loc};

/// The repository's root (this crate lives in `crates/compiler`).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The repository's `models/` folder, or the one `TRTCLASSIFY_MODELS_DIR` names (for test
/// binaries run on another machine, the GPU host).
pub fn models() -> PathBuf {
    std::env::var_os("TRTCLASSIFY_MODELS_DIR").map_or_else(|| repo().join("models"), PathBuf::from)
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

/// A convolution step for tests: input `[n, c, h, w]` to `k` channels with `kernel`,
/// `strides`, `pads` and `dilations` (one group, no activation, no residual), from `x` to
/// `y`, its filters and bias the plan's weights 0 and 1; its output size follows. `None`
/// where the kernel does not fit the padded input.
pub fn conv_step(
    [n, c, h, w, k]: [usize; 5],
    [kernel, strides, pads, dilations]: [[usize; 2]; 4],
    x: Loc,
    y: Loc,
) -> Option<ConvStep> {
    let pads4 = [pads[0], pads[1], pads[0], pads[1]];
    let [oh, ow] =
        crate::ops::conv::conv_out(&[h, w], &kernel, &strides, &dilations, &pads4).ok()?;
    Some(ConvStep {
        n,
        c,
        h,
        w,
        k,
        oh,
        ow,
        kernel,
        pads,
        strides,
        dilations,
        group: 1,
        act: Act::None,
        act_in: Act::None,
        x,
        weight: Loc::Weight {
            index: 0,
            offset: 0,
        },
        bias: Loc::Weight {
            index: 1,
            offset: 0,
        },
        residual: None,
        y,
        algo: None,
        quant: None,
    })
}

/// The side of the digits classifier's frames (`models/digits/`).
pub const DIGITS_SIZE: u32 = 32;

/// Images of the digits classifier (`models/digits/`, written by `models/digits/train.py` with
/// the model): a small CNN trained on real data, to tell what a precision costs in accuracy.
pub struct Digits {
    /// Each image as the training made it a frame: `DIGITS_SIZE`² packed RGB, grey.
    pub frames: Vec<Vec<u8>>,
    /// The digit each shows.
    pub labels: Vec<usize>,
    /// The share onnxruntime classifies right in fp32 (of the held-out images).
    pub onnxruntime_accuracy: Option<f64>,
}

/// The held-out digits, as frames.
pub fn digits_heldout() -> Digits {
    Digits::load("digits_heldout.json")
}

/// The training images kept for calibration, as frames.
pub fn digits_calibration() -> Digits {
    Digits::load("digits_calibration.json")
}

impl Digits {
    /// The images in `models/digits/NAME`.
    fn load(name: &str) -> Digits {
        let path = models().join("digits").join(name);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        let v: serde_json::Value = serde_json::from_str(&text).expect("digits json");
        let scale = (DIGITS_SIZE / 8) as usize;
        // Each of the 8×8 values (0-16) repeated scale×scale, grey in all three channels.
        let frame = |values: &serde_json::Value| -> Vec<u8> {
            let values: Vec<u8> = (values.as_array().expect("values").iter())
                .map(|x| (x.as_f64().expect("value") * 255.0 / 16.0).round() as u8)
                .collect();
            let side = DIGITS_SIZE as usize;
            (0..side * side)
                .flat_map(|i| [values[(i / side / scale) * 8 + (i % side) / scale]; 3])
                .collect()
        };
        Digits {
            frames: (v["values"].as_array().expect("values").iter())
                .map(frame)
                .collect(),
            labels: (v["labels"].as_array().expect("labels").iter())
                .map(|l| l.as_u64().expect("label") as usize)
                .collect(),
            onnxruntime_accuracy: v["onnxruntime_fp32_accuracy"].as_f64(),
        }
    }

    /// The model's input for frame `i`: NCHW, `(pixel / 255 − mean) / std` with ImageNet's
    /// mean and std, as the training script and the element's default preprocessing make it.
    pub fn model_input(&self, i: usize) -> Vec<f32> {
        const MEAN: [f32; 3] = [0.485, 0.456, 0.406];
        const STD: [f32; 3] = [0.229, 0.224, 0.225];
        let frame = &self.frames[i];
        (0..3)
            .flat_map(|c| {
                (frame.iter().skip(c).step_by(3))
                    .map(move |&p| (p as f32 / 255.0 - MEAN[c]) / STD[c])
            })
            .collect()
    }

    /// The share of `scores` (a row per frame) whose top class is the frame's label.
    pub fn accuracy(&self, scores: &[Vec<f32>]) -> f64 {
        assert_eq!(
            scores.len(),
            self.labels.len(),
            "one row of scores per frame"
        );
        let best = |s: &Vec<f32>| (0..s.len()).max_by(|&a, &b| s[a].total_cmp(&s[b]));
        let right = (scores.iter().zip(&self.labels))
            .filter(|&(s, &l)| best(s) == Some(l))
            .count();
        right as f64 / self.labels.len() as f64
    }

    /// The frames, as the engines take them.
    pub fn views(&self) -> Vec<FrameView<'_>> {
        (self.frames.iter())
            .map(|f| FrameView::rgb(DIGITS_SIZE, DIGITS_SIZE, f))
            .collect()
    }

    /// Asserts that `scores` (a row per frame, from `views`) classify the held-out digits
    /// within a point of onnxruntime's fp32 accuracy, and prints both: `what` names the
    /// backend and precision.
    #[track_caller]
    pub fn check(&self, what: &str, scores: &[Vec<f32>]) {
        let got = self.accuracy(scores);
        let want = self
            .onnxruntime_accuracy
            .expect("the held-out digits, with onnxruntime's accuracy");
        println!(
            "digits, held out: {what} {:.2}%, onnxruntime fp32 {:.2}% ({} images)",
            got * 100.0,
            want * 100.0,
            self.labels.len()
        );
        assert!(
            got >= want - 0.01,
            "{what}: {:.2}% of the held-out digits right, onnxruntime {:.2}%",
            got * 100.0,
            want * 100.0
        );
    }
}
