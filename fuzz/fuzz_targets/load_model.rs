// SPDX-License-Identifier: MPL-2.0
//! Fuzzes model loading: arbitrary bytes as an ONNX file, through the classifier checks and
//! the CPU engine build. Any outcome but an error or an engine (a panic, a hang, a crash) is a
//! bug.
#![no_main]

use std::path::Path;

use trtclassify_engine::cpu::CpuEngine;
use trtclassify_engine::{EngineOptions, OnnxModel, Precision};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.onnx");
    let Ok(model) = OnnxModel::from_bytes(path, data) else {
        return;
    };
    let options = EngineOptions {
        batch_size: 2,
        precision: Precision::Fp32,
        ..EngineOptions::new(path)
    };
    let _ = CpuEngine::from_model(&model, &options);
});
