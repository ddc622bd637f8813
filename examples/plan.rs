// SPDX-License-Identifier: MPL-2.0
//! Prints the plan the compiler makes of a model, one step a line with the ONNX node it
//! computes: what runs on the GPU (fp16) and, in fp32, on the CPU backend, without a GPU.
//!
//! `cargo run --release --example plan -- MODEL.onnx [BATCH]` (BATCH: 1 by default).

use gsttrtclassify::engine::OnnxModel;
use gsttrtclassify::engine::compiler::{compile, plan::DType};

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: plan MODEL.onnx [BATCH]")?;
    let batch = match args.next() {
        Some(b) => b.parse().map_err(|e| format!("batch {b}: {e}"))?,
        None => 1,
    };
    let model = OnnxModel::load(path.as_ref()).map_err(|e| e.to_string())?;
    let spec = model.input_spec(None)?;
    let (plans, _) = compile(&model, &[batch], spec, DType::F16).map_err(|e| e.to_string())?;
    for (i, (step, node)) in plans[0].steps.iter().zip(&plans[0].origins).enumerate() {
        println!("{i:4}  {}  ({node})", step.describe());
    }
    Ok(())
}
