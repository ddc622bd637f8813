// SPDX-License-Identifier: MPL-2.0
//! Whether fp16 holds a model's values. Before a freshly built fp16 engine is trusted, it
//! runs sample frames (noise, white, black, saturated colours, gradients, each normalised as
//! the element will normalise frames) step by step; where a step's values go past `LIMIT`,
//! fp16's largest value, that node is built again in f32 (with the nodes that read its
//! values; the rest stays fp16, as TensorRT's mixed precision does), and the samples run
//! again, a few rounds at most before the whole engine is built in fp32. The engine says
//! which nodes run in f32 and why. Without this, a model whose activations overflow fp16
//! gives infinite scores, and top-k nothing.

use super::error::Result;
use super::runtime::Runtime;
use trtclassify_compiler::overflow::Overflow;
use trtclassify_compiler::spec::{InputSpec, Layout, PreprocessOptions};

/// fp16's largest finite value. The samples hold the extremes of every channel, so no
/// headroom is kept beyond them: on the GPU host, half of it made fp32 engines of models
/// whose values reach 42,400 and 63,680 on the samples (LeViT's attention logits, RegNet's
/// scores), which fp16 holds. Frames that go further are caught at run time, where the
/// warning names the node.
pub const LIMIT: f32 = 65504.0;

/// How many times the build keeps one more node in f32 before it builds the whole engine in
/// fp32 instead: each round is a build, and a model whose values pass fp16's range at many
/// places gains little from fp16.
pub const ROUNDS: usize = 4;

/// How many sample frames `sample_frames` makes.
pub const SAMPLES: usize = 5;

/// The first step of `runtime`'s smallest plan whose values pass `LIMIT` on `frames` (the
/// `sample_frames`, of `frame_len` values each), if any.
pub fn check(runtime: &mut Runtime, frames: &[f32], frame_len: usize) -> Result<Option<Overflow>> {
    let batch = runtime.plans().map(|p| p.batch).min().unwrap_or(1);
    // Each run fills its plan's batch, the samples repeated where they do not.
    let runs = SAMPLES.div_ceil(batch);
    for run in 0..runs {
        let input: Vec<f32> = (0..batch)
            .flat_map(|slot| {
                let k = (run * batch + slot) % SAMPLES;
                frames[k * frame_len..(k + 1) * frame_len].iter().copied()
            })
            .collect();
        runtime.upload(&input)?;
        if let Some(overflow) = runtime.first_overflow(batch, LIMIT)? {
            return Ok(Some(overflow));
        }
    }
    Ok(None)
}

/// `SAMPLES` frames in the model's input layout, normalised by `options`: noise, white,
/// black, a checkerboard of saturated colours, and gradients, so that the extremes of every
/// channel are among them.
pub fn sample_frames(spec: InputSpec, options: &PreprocessOptions) -> Result<Vec<f32>, String> {
    let (mean, std) = options.per_channel(spec.channels)?;
    let (h, w, channels) = (spec.height, spec.width, spec.channels);
    let mut noise = 0x2545_f491_4f6c_dd1du64;
    let mut pixel = |k: usize, c: usize, y: usize, x: usize| -> u8 {
        match k {
            0 => {
                // xorshift64: the same noise on every machine.
                noise ^= noise << 13;
                noise ^= noise >> 7;
                noise ^= noise << 17;
                (noise >> 56) as u8
            }
            1 => 255,
            2 => 0,
            3 => [0, 255][(x / 8 + y / 8 + c) % 2],
            _ => {
                let ramp = |i: usize, n: usize| (i * 255 / n.saturating_sub(1).max(1)) as u8;
                match c % 3 {
                    0 => ramp(x, w),
                    1 => ramp(y, h),
                    _ => ramp(x + y, w + h - 1),
                }
            }
        }
    };
    let frame_len = spec.frame_len();
    let mut out = vec![0.0; SAMPLES * frame_len];
    for (k, frame) in out.chunks_exact_mut(frame_len).enumerate() {
        let value = |p: u8, c: usize| (f32::from(p) * options.scale - mean[c]) / std[c];
        for c in 0..channels {
            for y in 0..h {
                for x in 0..w {
                    let at = match spec.layout {
                        Layout::Nchw => (c * h + y) * w + x,
                        Layout::Nhwc => (y * w + x) * channels + c,
                    };
                    frame[at] = value(pixel(k, c, y, x), c);
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    use trtclassify_compiler::OnnxModel;
    use trtclassify_compiler::plan::{DType, Step};
    use trtclassify_compiler::testing::{assert_close, reference_frames};
    use trtclassify_compiler::{compile, compile_mixed, sim};

    #[test]
    fn the_samples_find_the_node_that_overflows() {
        // big_activations.onnx's first convolution reaches about 1e5 on any frame; the
        // other models stay well within fp16's headroom on every sample.
        let models = trtclassify_compiler::testing::repo().join("models");
        for (model, want) in [
            ("big_activations.onnx", Some("conv_0")),
            // Logits of about 2e5, which the last product writes in f32 (`lower::scores`).
            ("big_logits.onnx", None),
            ("big_middle.onnx", Some("conv_0")),
            ("cnn.onnx", None),
            ("ops.onnx", None),
            ("colors.onnx", None),
        ] {
            let onnx = OnnxModel::load(&models.join(model)).unwrap();
            let spec = onnx.input_spec(None).unwrap();
            let (plans, weights) = compile(&onnx, &[1], spec, DType::F16).unwrap();
            let frames = sample_frames(spec, &PreprocessOptions::default()).unwrap();
            let found = frames
                .chunks_exact(spec.frame_len())
                .find_map(|frame| sim::first_overflow(&plans[0], &weights, frame, LIMIT));
            match want {
                Some(node) => {
                    let o = found.unwrap_or_else(|| panic!("{model}: no overflow found"));
                    assert_eq!(o.node, node, "{model}: {o}");
                    assert!(o.kind.starts_with("conv"), "{model}: {o}");
                    assert!(o.largest > LIMIT && o.largest.is_finite(), "{model}: {o}");
                    let said = o.to_string();
                    assert!(
                        said.contains("node `conv_0`") && said.contains("reaches"),
                        "{said}"
                    );
                }
                None => assert!(found.is_none(), "{model}: {found:?}"),
            }
        }
    }

    /// The GPU build's rounds, run on the CPU: the first node past fp16's range on the
    /// samples is kept in f32 (with the nodes reading its values), until no value of the
    /// fp16 part passes it; the plan then gives onnxruntime's answer. big_middle.onnx's first
    /// convolution reaches about 6e5 and its second (a product: 1×1) brings the values back
    /// to a few units: one round keeps both in f32, the rest stays fp16. big_activations.onnx
    /// passes the range up to its last product, which the second round keeps too.
    #[test]
    fn keeping_the_nodes_past_the_range_in_f32_ends_the_overflow() {
        let models = trtclassify_compiler::testing::repo().join("models");
        for (model, rounds, in_f32) in [
            ("big_middle", &["conv_0"][..], &["conv_0", "conv_1"][..]),
            (
                "big_activations",
                &["conv_0", "gemm_0"],
                &["conv_0", "globalaveragepool_0", "gemm_0"],
            ),
        ] {
            let onnx = OnnxModel::load(&models.join(format!("{model}.onnx"))).unwrap();
            let spec = onnx.input_spec(None).unwrap();
            let frames = sample_frames(spec, &PreprocessOptions::default()).unwrap();
            let mut kept: Vec<String> = Vec::new();
            let (plans, weights) = loop {
                let (plans, weights) = compile_mixed(&onnx, &[2], spec, DType::F16, &kept).unwrap();
                let found = frames
                    .chunks_exact(2 * spec.frame_len())
                    .find_map(|two| sim::first_overflow(&plans[0], &weights, two, LIMIT));
                let Some(o) = found else {
                    break (plans, weights);
                };
                assert!(
                    !kept.contains(&o.node),
                    "{model}: {o} again, kept: {kept:?}"
                );
                kept.push(o.node);
                assert!(
                    kept.len() <= ROUNDS,
                    "{model}: still past fp16's range: {kept:?}"
                );
            };
            assert_eq!(kept, rounds, "{model}");
            let plan = &plans[0];
            let kinds: Vec<String> = plan.steps.iter().map(Step::describe).collect();
            assert_eq!(plan.wide_nodes(), in_f32, "{model}: {kinds:?}");
            assert!(
                (plan.steps.iter())
                    .any(|s| matches!(s, Step::Conv(_) | Step::Gemm(_)) && !s.is_wide())
                    || model == "big_activations",
                "{model}: {kinds:?}"
            );
            let (input, want) = reference_frames(&format!("{model}_reference.json"));
            let got = sim::run(plan, &weights, &input[..2 * spec.frame_len()]);
            assert_close(&got, &want[..got.len()], 1e-4);
        }
    }

    #[test]
    fn the_samples_reach_both_ends_of_every_channel() {
        let options = PreprocessOptions::default();
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let spec = InputSpec {
                layout,
                channels: 3,
                height: 20,
                width: 30,
            };
            let frames = sample_frames(spec, &options).unwrap();
            assert_eq!(frames.len(), SAMPLES * spec.frame_len());
            let (mean, std) = options.per_channel(3).unwrap();
            let channel_of = |i: usize| match layout {
                Layout::Nchw => (i % spec.frame_len()) / (20 * 30),
                Layout::Nhwc => i % 3,
            };
            for c in 0..3 {
                let values: Vec<f32> = frames
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| channel_of(*i) == c)
                    .map(|(_, v)| *v)
                    .collect();
                let (lo, hi) = values
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                assert!(
                    (lo - (0.0 - mean[c]) / std[c]).abs() < 1e-6,
                    "{layout:?} {c}: {lo}"
                );
                assert!(
                    (hi - (1.0 - mean[c]) / std[c]).abs() < 1e-6,
                    "{layout:?} {c}: {hi}"
                );
            }
            // The white frame (the second) is the top of the range everywhere.
            let white = &frames[spec.frame_len()..2 * spec.frame_len()];
            for (i, v) in white.iter().enumerate() {
                let c = channel_of(i);
                assert!((v - (1.0 - mean[c]) / std[c]).abs() < 1e-6);
            }
        }
        // A one-channel model gets the grey of the three means.
        let grey = InputSpec {
            layout: Layout::Nchw,
            channels: 1,
            height: 4,
            width: 4,
        };
        let frames = sample_frames(grey, &options).unwrap();
        assert_eq!(frames.len(), SAMPLES * 16);
        let bad = PreprocessOptions {
            mean: vec![0.1, 0.2],
            ..options
        };
        assert!(
            sample_frames(grey, &bad)
                .unwrap_err()
                .contains("mean has 2 values")
        );
    }
}
