// SPDX-License-Identifier: MPL-2.0
//! Fuzzes engine-file loading (`engine_file::from_bytes`: framing, header, and the checks of
//! every plan step against the buffers it names). An engine file's checksum would stop almost
//! every mutated file at once, so the mutations are made where the checks must catch them:
//!
//! - input starting with an even byte: edits to the numbers of a real engine file's header
//!   (the plans of `models/cnn.onnx` and `models/ops.onnx` at batch sizes 1 and 2: offsets,
//!   sizes, strides, dimensions, weight indices), each a pair (which number, new value), then
//!   the file is written with a correct checksum;
//! - otherwise: the rest of the input as a whole file, its last 32 bytes replaced by the
//!   checksum of the others.
//!
//! Any outcome but an error or a checked engine file (a panic, an arithmetic overflow, a
//! crash) is a bug.
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use trtclassify_compiler::OnnxModel;
use trtclassify_compiler::{self as compiler, plan::DType};
use trtclassify_cuda::{self as cuda, engine_file};
use libfuzzer_sys::fuzz_target;

struct Seed {
    file: engine_file::EngineFile,
    frame_len: usize,
    /// The header as JSON, and the JSON pointers of all its numbers.
    header: serde_json::Value,
    numbers: Vec<String>,
}

fn seeds() -> &'static [Seed] {
    static SEEDS: OnceLock<Vec<Seed>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        ["cnn.onnx", "ops.onnx"]
            .iter()
            .map(|name| {
                let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models").join(name);
                let model = OnnxModel::load(&path).expect("a committed model loads");
                let spec = model.input_spec(None).expect("input");
                let batch_sizes = vec![1, 2];
                let (plans, weights) = compiler::compile(&model, &batch_sizes, spec, DType::F16)
                    .expect("a committed model compiles");
                let file = engine_file::EngineFile {
                    key: engine_file::Key {
                        format: engine_file::FORMAT_VERSION,
                        plugin_version: "fuzz".into(),
                        kernels_sha256: String::new(),
                        onnx_sha256: String::new(),
                        gpu: "fuzz".into(),
                        compute_capability: (9, 0),
                        cuda_driver: 13000,
                        nvrtc: 13000,
                        cudnn: 91400,
                        cublaslt: 130000,
                        precision: DType::F16,
                        batch_sizes,
                        input: (spec.height, spec.width),
                    },
                    num_classes: plans[0].output_len / plans[0].batch,
                    kernels: b"kernels".to_vec(),
                    weights: weights
                        .data
                        .iter()
                        .map(|w| cuda::runtime::to_bytes(w, DType::F16))
                        .collect(),
                    plans,
                    fp32_because: None,
                    kept_f32: None,
                };
                let bytes = engine_file::to_bytes(&file).expect("serialises");
                let header = header_of(&bytes);
                let mut numbers = Vec::new();
                collect_numbers(&header, String::new(), &mut numbers);
                Seed {
                    file,
                    frame_len: spec.frame_len(),
                    header,
                    numbers,
                }
            })
            .collect()
    })
}

/// The header JSON of a file `engine_file::to_bytes` wrote: after the 8-byte magic, the
/// format (4 bytes) and the header's length (8 bytes).
fn header_of(bytes: &[u8]) -> serde_json::Value {
    let len = u64::from_le_bytes(bytes[12..20].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[20..20 + len]).unwrap()
}

fn collect_numbers(value: &serde_json::Value, at: String, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Number(_) => out.push(at),
        serde_json::Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                collect_numbers(v, format!("{at}/{i}"), out);
            }
        }
        serde_json::Value::Object(fields) => {
            for (k, v) in fields {
                collect_numbers(v, format!("{at}/{k}"), out);
            }
        }
        _ => {}
    }
}

/// The file of `seed` with `header` in place of its own, and a correct checksum.
fn file_with(seed: &Seed, header: &serde_json::Value) -> Vec<u8> {
    let bytes = engine_file::to_bytes(&seed.file).expect("serialises");
    let old_len = u64::from_le_bytes(bytes[12..20].try_into().unwrap()) as usize;
    let header = serde_json::to_vec(header).unwrap();
    let mut body = bytes[..12].to_vec();
    body.extend_from_slice(&(header.len() as u64).to_le_bytes());
    body.extend_from_slice(&header);
    body.extend_from_slice(&bytes[20 + old_len..bytes.len() - 32]);
    let checksum = engine_file::checksum(&body);
    body.extend_from_slice(&checksum);
    body
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let seed = &seeds()[usize::from(first >> 1) % seeds().len()];
    let bytes = if first % 2 == 0 {
        // Edits of 9 bytes each: 2 name a number of the header, 7 give its new value
        // (signed, so that negative offsets and strides are tried too).
        let mut header = seed.header.clone();
        for edit in rest.chunks_exact(9) {
            let which = usize::from(u16::from_le_bytes([edit[0], edit[1]])) % seed.numbers.len();
            let mut raw = [0u8; 8];
            raw[..7].copy_from_slice(&edit[2..]);
            let value = i64::from_le_bytes(raw) << 8 >> 8;
            if let Some(n) = header.pointer_mut(&seed.numbers[which]) {
                *n = match n.as_f64() {
                    // Floats (epsilon, alpha, ...) stay floats.
                    Some(_) if !n.is_i64() && !n.is_u64() => serde_json::json!(value as f64),
                    _ => serde_json::json!(value),
                };
            }
        }
        file_with(seed, &header)
    } else {
        let mut bytes = rest.to_vec();
        if bytes.len() >= 32 {
            let n = bytes.len() - 32;
            let checksum = engine_file::checksum(&bytes[..n]);
            bytes[n..].copy_from_slice(&checksum);
        }
        bytes
    };
    let _ = engine_file::from_bytes(&bytes, &seed.file.key, seed.frame_len);
});
