// SPDX-License-Identifier: MPL-2.0
//! backend=cuda against the cpu backend on every test model, fp16 and fp32, at batch 1 and
//! at batch 4 with a partial last batch; and against onnxruntime's outputs for the
//! torchvision models in `$TRTCLASSIFY_TORCHVISION_DIR` (exported by
//! `bench/gpu/torch_models.py export`). Where no GPU works, each test says SKIPPED and why.

mod common;

use gsttrtclassify::engine::cpu::CpuEngine;
use gsttrtclassify::engine::cuda::{self, CudaEngine};
use gsttrtclassify::engine::{Engine, EngineOptions, Precision};
use gsttrtclassify::preprocess::PreprocessOptions;

fn options(model: &str, batch_size: usize, precision: Precision) -> EngineOptions {
    EngineOptions {
        model: model.into(),
        batch_size,
        input_size: None,
        precision,
        gpu_id: 0,
        progress: Default::default(),
        preprocess: PreprocessOptions::default(),
    }
}

/// Says a test did not run, on stderr directly: the test harness captures `println!`, and a
/// skip must show in CI's log (`.ci/run` counts these lines as skipped tests).
fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {why}");
}

/// Whether a GPU is usable; prints why not.
fn gpu(test: &str) -> bool {
    common::init();
    let reason = cuda::unavailable_reason().or_else(|| {
        gsttrtclassify::engine::cuda::runtime::open_gpu(0)
            .err()
            .map(|e| format!("no usable GPU: {e}"))
    });
    match reason {
        Some(reason) => {
            skipped(&format!("{test}: {reason}"));
            false
        }
        None => true,
    }
}

fn top(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    idx.truncate(k);
    idx
}

/// fp16 tolerance: every score within `abs + rel·|want|`, top-5 sharing at least 4 classes,
/// and the same top-1 unless the reference's first two are closer than that tolerance.
/// Returns the largest error seen.
#[track_caller]
fn compare(what: &str, got: &[f32], want: &[f32], abs: f32, rel: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: number of scores");
    let (g1, w1) = (top(got, 1)[0], top(want, 1)[0]);
    if g1 != w1 {
        let tolerance = abs + rel * want[w1].abs();
        assert!(
            want[w1] - want[g1] <= tolerance,
            "{what}: top-1 {g1} ({}) but the reference's is {w1} ({})",
            want[g1],
            want[w1]
        );
        println!(
            "{what}: top-1 {g1} for {w1}, a near tie in the reference ({} vs {})",
            want[g1], want[w1]
        );
    }
    if want.len() >= 5 {
        let (g, w) = (top(got, 5), top(want, 5));
        let shared = g.iter().filter(|c| w.contains(c)).count();
        assert!(shared >= 4, "{what}: top-5 {g:?} vs {w:?}");
    }
    let mut worst = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(err <= abs + rel * w.abs(), "{what}: score {i}: {g} vs {w}");
        worst = worst.max(err);
    }
    worst
}

fn reference_frames(name: &str) -> (Vec<f32>, usize) {
    let text = std::fs::read_to_string(common::model(name)).expect("reference");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    let input: Vec<f32> = json["input"]
        .as_array()
        .expect("input")
        .iter()
        .map(|v| v.as_f64().expect("number") as f32)
        .collect();
    let frames = json["input_shape"][0].as_u64().expect("shape") as usize;
    (input, frames)
}

/// Runs `frames` of `input` (repeated cyclically to `count`) through both engines.
fn check_model(model: &str, reference: &str, precision: Precision, abs: f32, rel: f32) {
    let path = common::model(model);
    let (input, frames) = reference_frames(reference);
    let frame_len = input.len() / frames;
    let mut cpu = CpuEngine::build(&options(&path, 1, Precision::Fp32)).expect("cpu engine");
    let mut gpu = CudaEngine::build(&options(&path, 4, precision))
        .unwrap_or_else(|e| panic!("{model}: cuda engine: {e}"));
    // 1 frame, 3 (a partial batch of 4) and 5 (a full batch and one more).
    for count in [1, 3, 5] {
        let data: Vec<f32> = (0..count)
            .flat_map(|i| {
                input[(i % frames) * frame_len..][..frame_len]
                    .iter()
                    .copied()
            })
            .collect();
        let want = cpu.infer(&data, count).expect("cpu inference");
        let got = gpu.infer(&data, count).expect("cuda inference");
        assert_eq!(got.len(), count, "{model}: one result per frame");
        let mut worst = 0.0f32;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let what = format!("{model} {precision:?}, {count} frames, frame {i}");
            worst = worst.max(compare(&what, g, w, abs, rel));
        }
        println!("{model} {precision:?} {count} frames: largest score error {worst:.2e}");
    }
}

const MODELS: &[(&str, &str)] = &[
    ("cnn.onnx", "cnn_reference.json"),
    ("colors.onnx", "colors_reference.json"),
    ("colors_nhwc.onnx", "colors_reference.json"),
    ("colors_b1.onnx", "colors_reference.json"),
    ("ops.onnx", "ops_reference.json"),
];

#[test]
fn cuda_fp16_agrees_with_cpu() {
    if !gpu("cuda_fp16_agrees_with_cpu") {
        return;
    }
    for (model, reference) in MODELS {
        // cnn.onnx outputs logits of a few units; the others probabilities.
        check_model(model, reference, Precision::Fp16, 2e-2, 2e-2);
    }
}

#[test]
fn cuda_fp32_agrees_with_cpu() {
    if !gpu("cuda_fp32_agrees_with_cpu") {
        return;
    }
    for (model, reference) in MODELS {
        check_model(model, reference, Precision::Fp32, 1e-4, 1e-3);
    }
}

#[test]
fn cuda_torchvision_agrees_with_onnxruntime() {
    if !gpu("cuda_torchvision_agrees_with_onnxruntime") {
        return;
    }
    let Ok(dir) = std::env::var("TRTCLASSIFY_TORCHVISION_DIR") else {
        skipped("cuda_torchvision_agrees_with_onnxruntime: TRTCLASSIFY_TORCHVISION_DIR is not set");
        return;
    };
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("torchvision dir")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".ref.json").map(str::to_owned))
        .collect();
    names.sort();
    assert!(!names.is_empty(), "no *.ref.json in {dir}");
    let mut failed = Vec::new();
    for name in names {
        let dir = std::path::Path::new(&dir);
        let text = std::fs::read_to_string(dir.join(format!("{name}.ref.json"))).expect("ref");
        let json: serde_json::Value = serde_json::from_str(&text).expect("json");
        let want: Vec<Vec<f32>> = json["output"]
            .as_array()
            .expect("output")
            .iter()
            .map(|row| {
                row.as_array()
                    .expect("row")
                    .iter()
                    .map(|v| v.as_f64().expect("number") as f32)
                    .collect()
            })
            .collect();
        let bytes = std::fs::read(dir.join(format!("{name}.input.bin"))).expect("input");
        let input: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let model = dir.join(format!("{name}.onnx"));
        for precision in [Precision::Fp16, Precision::Fp32] {
            let started = std::time::Instant::now();
            let mut gpu = CudaEngine::build(&options(model.to_str().expect("utf-8"), 8, precision))
                .unwrap_or_else(|e| panic!("{name}: cuda engine: {e}"));
            let built = started.elapsed();
            let got = gpu.infer(&input, want.len()).expect("cuda inference");
            let checked = std::panic::catch_unwind(|| {
                let mut worst = 0.0f32;
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let what = format!("{name} {precision:?} frame {i}");
                    worst = worst.max(compare(&what, g, w, 1e-2, 5e-2));
                }
                worst
            });
            match checked {
                Ok(worst) => println!(
                    "{name} {precision:?}: built in {built:.1?}, largest probability error {worst:.2e}"
                ),
                Err(_) => failed.push(format!("{name} {precision:?}")),
            }
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
}
