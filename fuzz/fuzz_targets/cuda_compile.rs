// SPDX-License-Identifier: MPL-2.0
//! Fuzzes the CUDA engine's compiler front-end, which runs on the CPU: arbitrary bytes as an
//! ONNX file, through the operator check, import (with its constant folding), the passes and
//! the lowering to plans, for batch sizes 1 and 2. Any outcome but an error or plans (a panic,
//! a hang, a crash, gigabytes) is a bug; and plans the compiler makes must pass the checks
//! that an engine file's plans pass when loaded.
#![no_main]

use std::path::Path;

use trtclassify_compiler::OnnxModel;
use trtclassify_compiler::{self as compiler, import, plan::DType};
use trtclassify_cuda::{self as cuda, engine_file};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.onnx");
    let Ok(model) = OnnxModel::from_bytes(path, data) else {
        return;
    };
    if !import::unsupported_ops(&model).is_empty() {
        return;
    }
    // Dynamic sizes get a small input, so that huge declared sizes are the only way to ask
    // for much memory.
    let Ok(spec) = model.input_spec(None) else {
        return;
    };
    let batch_sizes = compiler::batch_sizes(2, model.input.batch.fixed());
    let Ok((plans, weights)) = compiler::compile(&model, &batch_sizes, spec, DType::F32) else {
        return;
    };
    let file = engine_file::EngineFile {
        key: engine_file::Key {
            format: engine_file::FORMAT_VERSION,
            plugin_version: String::new(),
            kernels_sha256: String::new(),
            onnx_sha256: String::new(),
            gpu: String::new(),
            compute_capability: (9, 0),
            cuda_driver: 0,
            nvrtc: 0,
            cudnn: 0,
            cublaslt: 0,
            precision: DType::F32,
            batch_sizes,
            input: (spec.height, spec.width),
        },
        num_classes: plans[0].output_len / plans[0].batch,
        kernels: Vec::new(),
        weights: weights
            .data
            .iter()
            .map(|w| cuda::runtime::to_bytes(w, DType::F32))
            .collect(),
        plans,
        fp32_because: None,
        kept_f32: None,
    };
    let bytes = engine_file::to_bytes(&file).expect("serialises");
    if let Err(e) = engine_file::from_bytes(&bytes, &file.key, spec.frame_len()) {
        panic!("a plan of the compiler fails the engine file's checks: {e}");
    }
});
