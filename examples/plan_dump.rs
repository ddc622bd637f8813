// SPDX-License-Identifier: MPL-2.0
//! Prints the plan the compiler makes of a model, step by step with the ONNX node of each:
//! what the GPU (fp16 by default) or the CPU backend (`fp32`) would run, without a GPU.
//!
//! `cargo run --release --example plan_dump -- MODEL.onnx [BATCH] [fp16|fp32]`

use gsttrtclassify::engine::compiler::{compile, plan::DType};
use gsttrtclassify::engine::onnx::OnnxModel;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .ok_or("usage: plan_dump MODEL.onnx [BATCH] [fp16|fp32]")?;
    let batch: usize = args.get(2).map_or(Ok(1), |b| b.parse())?;
    let dtype = match args.get(3).map(String::as_str) {
        Some("fp32") => DType::F32,
        _ => DType::F16,
    };
    let model = OnnxModel::load(std::path::Path::new(path))?;
    let spec = model.input_spec(None)?;
    let (plans, _) = compile(&model, &[batch], spec, dtype)?;
    for (step, origin) in plans[0].steps.iter().zip(&plans[0].origins) {
        println!("{origin}: {}", step.describe());
    }
    println!("{} steps", plans[0].steps.len());
    Ok(())
}
