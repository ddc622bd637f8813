// SPDX-License-Identifier: MPL-2.0
//! Prints the plan the compiler makes of a model, step by step with the ONNX node of each:
//! what the GPU (fp16 by default, or `fp32`) or the CPU backend (`cpu`: fp32, its products
//! written over their residuals) would run, without a GPU.
//!
//! `cargo run --release --example plan_dump -- MODEL.onnx [BATCH] [fp16|fp32|cpu]`

use gsttrtclassify::engine::compiler::{compile, compile_for_cpu, plan::DType};
use gsttrtclassify::engine::onnx::OnnxModel;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .ok_or("usage: plan_dump MODEL.onnx [BATCH] [fp16|fp32|cpu]")?;
    let batch: usize = args.get(2).map_or(Ok(1), |b| b.parse())?;
    let model = OnnxModel::load(std::path::Path::new(path))?;
    let spec = model.input_spec(None)?;
    let (plans, _) = match args.get(3).map(String::as_str) {
        Some("cpu") => compile_for_cpu(&model, &[batch], spec)?,
        Some("fp32") => compile(&model, &[batch], spec, DType::F32)?,
        _ => compile(&model, &[batch], spec, DType::F16)?,
    };
    for (step, origin) in plans[0].steps.iter().zip(&plans[0].origins) {
        println!("{origin}: {}", step.describe());
    }
    println!("{} steps", plans[0].steps.len());
    Ok(())
}
