// SPDX-License-Identifier: MPL-2.0
//! What 8-bit rounding alone does to a model, with no GPU: calibrates on an export's
//! reference frames, quantizes its f32 plan in int8 and FP8 (every quantizable layer within
//! the layer error bound in 8 bits, as `strict-precision` does), runs it in the plan
//! simulator and compares the scores with onnxruntime's fp32 ones (`Agreement`: top-1, the
//! largest probability error and the logit error, as `tests/cuda.rs` measures the GPU's).
//! Slow: the simulator is plain f32 code, a few minutes a format for Swin-T.
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
    let bad = || format!("{name}.ref.json: an output that is not rows of numbers");
    let rows = reference["output"].as_array().ok_or_else(bad)?;
    let want: Vec<Vec<f32>> = (rows.iter())
        .map(|row| {
            (row.as_array().ok_or_else(bad)?.iter())
                .map(|v| v.as_f64().map(|v| v as f32).ok_or_else(bad))
                .collect()
        })
        .collect::<Result<_, _>>()?;

    let path = file("onnx");
    let mut calibration =
        Calibration::new(&EngineOptions::new(&path)).map_err(|e| e.to_string())?;
    let frame_len = calibration.frame_len();
    for frame in input.chunks_exact(frame_len) {
        calibration.add_input(frame).map_err(|e| e.to_string())?;
    }
    let classes = want.first().map_or(0, Vec::len);
    if classes == 0
        || want.len() != input.len() / frame_len
        || want.iter().any(|r| r.len() != classes)
    {
        return Err(format!(
            "{name}.ref.json: {} rows, where {name}.input.bin holds {} frames, or rows of \
             different lengths",
            want.len(),
            input.len() / frame_len
        ));
    }
    let table = calibration.table();
    let model = OnnxModel::load(&path).map_err(|e| e.to_string())?;
    let spec = model.input_spec(None)?;
    let (plans, weights) = compile(&model, &[1], spec, DType::F32).map_err(|e| e.to_string())?;
    for format in [QuantFormat::Int8, QuantFormat::Fp8] {
        let (mut plan, mut weights) = (plans[0].clone(), weights.clone());
        let done = quant::quantize(&mut plan, &mut weights, &table, format, &[]);
        let got: Vec<f32> = (input.chunks_exact(frame_len))
            .flat_map(|frame| sim::run(&plan, &weights, frame))
            .collect();
        if got.len() != want.len() * classes {
            return Err(format!(
                "{name}: {} scores from the simulator, {} in {name}.ref.json",
                got.len(),
                want.len() * classes
            ));
        }
        let mut agreement = Agreement::default();
        agreement.add(&want.concat(), &got, classes);
        println!(
            "{name} {format}, {} layers in 8 bits, {} kept: {agreement}, logit error {:.4}",
            done.nodes.len(),
            done.kept.len(),
            agreement.max_logit_error
        );
    }
    Ok(())
}
