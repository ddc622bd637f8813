// SPDX-License-Identifier: MPL-2.0
//! Fuzzes the calibration table (`quant::CalibrationTable::parse`), the text file the
//! quantized engines read from the cache or from `trtclassify-engine build --calibration`:
//! arbitrary bytes as a table. A table that parses must write back to the same table, and
//! quantize the digits classifier's plans (int8 and FP8, at batch sizes 1 and 2) into plans
//! that pass the checks a loaded engine file's plans pass. The same bytes are read as the
//! held-out frames beside a table (`quant::HeldOut::parse`). Anything else (a panic, an
//! arithmetic overflow, a crash, a plan refused) is a bug.
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use trtclassify_compiler::plan::{DType, Plan, QuantFormat, Weights};
use trtclassify_compiler::quant::{CalibrationTable, HeldOut, quantize};
use trtclassify_compiler::{self as compiler, OnnxModel};

struct Seed {
    plans: Vec<Plan>,
    weights: Weights,
    frame_len: usize,
}

fn seed() -> &'static Seed {
    static SEED: OnceLock<Seed> = OnceLock::new();
    SEED.get_or_init(|| {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/digits/digits.onnx");
        let model = OnnxModel::load(&path).expect("digits.onnx");
        let spec = model.input_spec(None).expect("an image input");
        let (plans, weights) =
            compiler::compile(&model, &[1, 2], spec, DType::F16).expect("compiles");
        Seed {
            plans,
            weights,
            frame_len: spec.frame_len(),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    // The same bytes as the held-out frames beside a table: they parse, or are refused with
    // an error, and what parses writes back to the same bytes.
    if let Ok(held) = HeldOut::parse(data, "fuzz") {
        assert_eq!(held.to_bytes(), data);
    }
    let text = String::from_utf8_lossy(data);
    let Ok(table) = CalibrationTable::parse(&text, "fuzz") else {
        return;
    };
    let again = CalibrationTable::parse(&table.to_text(), "written");
    // Names with tabs or line breaks are written with spaces; every other table reads back.
    if table.nodes.keys().all(|n| !n.contains(['\t', '\n', '\r'])) {
        assert_eq!(again.as_ref(), Ok(&table));
    }
    let seed = seed();
    for format in [QuantFormat::Int8, QuantFormat::Fp8] {
        let mut weights = seed.weights.clone();
        for plan in &seed.plans {
            let mut plan = plan.clone();
            quantize(&mut plan, &mut weights, &table, format, &[]);
            let weight =
                |i: usize| (weights.data.get(i)).map(|d| (d.len(), weights.dtype(i, DType::F16)));
            let classes = plan.output_len / plan.batch;
            compiler::check::check_plan(&mut plan, &weight, DType::F16, seed.frame_len, classes)
                .expect("a quantized plan passes its checks");
        }
    }
});
