// SPDX-License-Identifier: MPL-2.0
//! Prints the plan the compiler makes of a model, one step a line with its index and the
//! ONNX node it computes: what the GPU runs (fp16 by default, or `fp32`) or the CPU backend
//! (`cpu`: fp32, its products written over their residuals), without a GPU.
//!
//! `cargo run --release --example plan -- MODEL.onnx [BATCH] [fp16|fp32|cpu]` (BATCH: 1 by
//! default).

use gsttrtclassify::engine::compiler::{compile, compile_for_cpu, plan::DType};
use gsttrtclassify::engine::onnx::OnnxModel;

const USAGE: &str = "usage: plan MODEL.onnx [BATCH] [fp16|fp32|cpu]";

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or(USAGE)?;
    let batch = match args.next() {
        Some(b) => b.parse().map_err(|e| format!("batch {b}: {e}"))?,
        None => 1,
    };
    let model = OnnxModel::load(path.as_ref()).map_err(|e| e.to_string())?;
    let spec = model.input_spec(None)?;
    let (plans, _) = match args.next().as_deref() {
        None | Some("fp16") => compile(&model, &[batch], spec, DType::F16),
        Some("fp32") => compile(&model, &[batch], spec, DType::F32),
        Some("cpu") => compile_for_cpu(&model, &[batch], spec),
        Some(other) => return Err(format!("{other}: not fp16, fp32 or cpu; {USAGE}")),
    }
    .map_err(|e| e.to_string())?;
    for (i, (step, node)) in plans[0].steps.iter().zip(&plans[0].origins).enumerate() {
        println!("{i:4}  {}  ({node})", step.describe());
    }
    println!("{} steps", plans[0].steps.len());
    Ok(())
}
