// SPDX-License-Identifier: MPL-2.0
//! What 8-bit rounding alone does to a model, with no GPU: calibrates on an export's
//! reference frames, quantizes its f32 plan in int8 and FP8 with every quantizable layer in
//! 8 bits (as `strict-precision`), runs it in the plan simulator and compares the scores with
//! onnxruntime's fp32 ones: top-1 agreement, the largest probability error and the logit
//! error (as `tests/cuda.rs` measures the GPU's). Slow: the simulator is plain f32 code, a
//! few minutes a format for Swin-T.
//!
//! `cargo run --release --example quant_sim -- DIR NAME` for the files `NAME.onnx`,
//! `NAME.input.bin` and `NAME.ref.json` that `bench/gpu/torch_models.py export DIR` writes.

use gsttrtclassify::engine::calibration::Calibration;
use gsttrtclassify::engine::compiler::quant::{self, Agreement, QuantFormat};
use gsttrtclassify::engine::compiler::{compile, plan::DType, sim};
use gsttrtclassify::engine::{EngineOptions, OnnxModel};

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: quant_sim DIR NAME";
    let dir = std::path::PathBuf::from(args.next().ok_or(usage)?);
    let name = args.next().ok_or(usage)?;
    let file = |ext: &str| dir.join(format!("{name}.{ext}"));
    let read = |ext: &str| std::fs::read(file(ext)).map_err(|e| format!("{name}.{ext}: {e}"));
    let input: Vec<f32> = read("input.bin")?
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    let reference: serde_json::Value =
        serde_json::from_slice(&read("ref.json")?).map_err(|e| format!("{name}.ref.json: {e}"))?;
    let want: Vec<Vec<f32>> = (reference["output"].as_array())
        .ok_or("ref.json without output")?
        .iter()
        .map(|row| row.as_array().into_iter().flatten())
        .map(|row| row.filter_map(|v| v.as_f64()).map(|v| v as f32).collect())
        .collect();

    let path = file("onnx");
    let mut calibration =
        Calibration::new(&EngineOptions::new(&path)).map_err(|e| e.to_string())?;
    let frame_len = calibration.frame_len();
    for frame in input.chunks_exact(frame_len) {
        calibration.add_input(frame).map_err(|e| e.to_string())?;
    }
    let table = calibration.table();
    let model = OnnxModel::load(&path).map_err(|e| e.to_string())?;
    let spec = model.input_spec(None)?;
    let (plans, weights) = compile(&model, &[1], spec, DType::F32).map_err(|e| e.to_string())?;
    for format in [QuantFormat::Int8, QuantFormat::Fp8] {
        let (mut plan, mut weights) = (plans[0].clone(), weights.clone());
        let done = quant::quantize(&mut plan, &mut weights, &table, format, &[]);
        let got: Vec<Vec<f32>> = input
            .chunks_exact(frame_len)
            .map(|frame| probabilities(sim::run(&plan, &weights, frame)))
            .collect();
        let mut agreement = Agreement::default();
        agreement.add(&want.concat(), &got.concat(), want[0].len());
        println!(
            "{name} {format}, {} layers in 8 bits, {} kept: {agreement}, logit error {:.4}",
            done.nodes.len(),
            done.kept.len(),
            logit_error(&got, &want)
        );
    }
    Ok(())
}

/// `scores` as probabilities: a softmax, unless they are probabilities already.
fn probabilities(scores: Vec<f32>) -> Vec<f32> {
    let sum: f32 = scores.iter().sum();
    if (sum - 1.0).abs() < 1e-3 && scores.iter().all(|&v| v >= 0.0) {
        return scores;
    }
    let max = scores.iter().copied().fold(f32::MIN, f32::max);
    let exp: Vec<f32> = scores.iter().map(|v| (v - max).exp()).collect();
    let total: f32 = exp.iter().sum();
    exp.iter().map(|v| v / total).collect()
}

/// `tests/common`'s `logit_error`: the largest over frames of the root-mean-square difference
/// of the centred log-probabilities over that of `want`'s.
fn logit_error(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    let centred = |p: &[f32]| {
        let l: Vec<f64> = p.iter().map(|&v| f64::from(v.max(1e-12)).ln()).collect();
        let mean = l.iter().sum::<f64>() / l.len() as f64;
        l.into_iter().map(move |v| v - mean)
    };
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            let (diff, norm) = centred(g)
                .zip(centred(w))
                .fold((0.0, 0.0), |(d, n), (g, w)| {
                    (d + (g - w) * (g - w), n + w * w)
                });
            (diff / norm).sqrt() as f32
        })
        .fold(0.0, f32::max)
}
