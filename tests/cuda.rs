// SPDX-License-Identifier: MPL-2.0
//! backend=cuda against the cpu backend on every test model, fp16 and fp32, at batch 1 and
//! at batch 4 with a partial last batch; and against onnxruntime's outputs for the
//! torchvision models in `$TRTCLASSIFY_TORCHVISION_DIR` (exported by
//! `bench/gpu/torch_models.py export`). Where no GPU works, each test says SKIPPED and why.

mod common;

use gst_video::prelude::*;
use gsttrtclassify::engine::cpu::CpuEngine;
use gsttrtclassify::engine::cuda::{self, CudaEngine};
use gsttrtclassify::engine::{Engine, EngineOptions, Precision};
use gsttrtclassify::preprocess::{Crop, PreprocessOptions};

fn options(model: &str, batch_size: usize, precision: Precision) -> EngineOptions {
    EngineOptions {
        model: model.into(),
        batch_size,
        input_size: None,
        precision,
        calibration: None,
        min_agreement: gsttrtclassify::engine::DEFAULT_MIN_AGREEMENT,
        strict_precision: false,
        gpu_id: 0,
        threads: 0,
        engine_location: None,
        progress: Default::default(),
        server: Default::default(),
        preprocess: PreprocessOptions::default(),
    }
}

use common::skipped;

/// Whether a GPU is usable; prints why not. Where one is expected
/// (`TRTCLASSIFY_EXPECT_GPU`, set by the GPU host's script), no GPU is a failure, not a skip.
fn gpu(test: &str) -> bool {
    common::init();
    let reason = cuda::unavailable_reason().or_else(|| {
        gsttrtclassify::engine::cuda::runtime::open_gpu(0)
            .err()
            .map(|e| format!("no usable GPU: {e}"))
    });
    runs(test, reason)
}

/// True when nothing stops `test`; otherwise says SKIPPED and why, or fails where a GPU is
/// expected (`TRTCLASSIFY_EXPECT_GPU`).
fn runs(test: &str, reason: Option<String>) -> bool {
    match reason {
        Some(reason) if std::env::var_os("TRTCLASSIFY_EXPECT_GPU").is_some() => {
            panic!("{test}: a GPU is expected here, but {reason}")
        }
        Some(reason) => {
            skipped(&format!("{test}: {reason}"));
            false
        }
        None => true,
    }
}

fn top(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    idx.truncate(k);
    idx
}

/// fp16 tolerance: every score within `abs + rel·|want|`, and the same top-1 and top-5 but
/// for near ties: a class may stand in for another whose reference score is within that
/// tolerance of its own.
/// Returns the largest error seen.
#[track_caller]
fn compare(what: &str, got: &[f32], want: &[f32], abs: f32, rel: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: number of scores");
    let (g1, w1) = (top(got, 1)[0], top(want, 1)[0]);
    if g1 != w1 {
        let tolerance = abs + rel * want[w1].abs();
        assert!(
            want[w1] - want[g1] <= tolerance,
            "{what}: top-1 {g1} ({}) but the reference's is {w1} ({})",
            want[g1],
            want[w1]
        );
        println!(
            "{what}: top-1 {g1} for {w1}, a near tie in the reference ({} vs {})",
            want[g1], want[w1]
        );
    }
    if want.len() >= 5 {
        // A class of our top-5 outside the reference's must be a near tie with its fifth.
        let (g, w) = (top(got, 5), top(want, 5));
        let fifth = want[w[4]];
        let tolerance = abs + rel * fifth.abs();
        for c in g.iter().filter(|c| !w.contains(c)) {
            assert!(
                fifth - want[*c] <= tolerance,
                "{what}: top-5 {g:?} vs {w:?}: class {c} scores {} in the reference, its fifth {fifth}",
                want[*c]
            );
        }
    }
    let mut worst = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(err <= abs + rel * w.abs(), "{what}: score {i}: {g} vs {w}");
        worst = worst.max(err);
    }
    worst
}

fn reference_frames(name: &str) -> (Vec<f32>, usize) {
    let json = reference_file(name);
    let frames = json["input_shape"][0].as_u64().expect("shape") as usize;
    (floats(&json, "input"), frames)
}

/// onnxruntime's scores in a reference file of `models/`, frame after frame.
fn reference_scores(name: &str) -> Vec<f32> {
    floats(&reference_file(name), "output")
}

fn reference_file(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(common::model(name)).expect("reference");
    serde_json::from_str(&text).expect("json")
}

fn floats(json: &serde_json::Value, key: &str) -> Vec<f32> {
    json[key]
        .as_array()
        .unwrap_or_else(|| panic!("no `{key}` array"))
        .iter()
        .map(|v| v.as_f64().expect("number") as f32)
        .collect()
}

/// Runs `frames` of `input` (repeated cyclically to `count`) through both engines.
fn check_model(model: &str, reference: &str, precision: Precision, abs: f32, rel: f32) {
    let path = common::model(model);
    let (input, frames) = reference_frames(reference);
    let frame_len = input.len() / frames;
    let mut cpu = CpuEngine::build(&options(&path, 1, Precision::Fp32)).expect("cpu engine");
    let mut gpu = CudaEngine::build(&options(&path, 4, precision))
        .unwrap_or_else(|e| panic!("{model}: cuda engine: {e}"));
    // 1 frame, 3 (a partial batch of 4) and 5 (a full batch and one more).
    for count in [1, 3, 5] {
        let data: Vec<f32> = (0..count)
            .flat_map(|i| {
                input[(i % frames) * frame_len..][..frame_len]
                    .iter()
                    .copied()
            })
            .collect();
        let want = cpu.infer(&data, count).expect("cpu inference");
        let got = gpu.infer(&data, count).expect("cuda inference");
        assert_eq!(got.len(), count, "{model}: one result per frame");
        assert_eq!(want.len(), count, "{model}: one cpu result per frame");
        let mut worst = 0.0f32;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let what = format!("{model} {precision:?}, {count} frames, frame {i}");
            worst = worst.max(compare(&what, g, w, abs, rel));
        }
        println!("{model} {precision:?} {count} frames: largest score error {worst:.2e}");
    }
}

/// A model whose activations overflow fp16 on any frame, asked for in fp16, is built with
/// the nodes past fp16's range (and those reading their values) in f32 and the rest in fp16,
/// says so (naming the nodes), gives onnxruntime's scores, and keeps that in its engine file;
/// asked for in fp32 it says nothing. big_activations.onnx passes the range up to its last
/// product (all of it is kept in f32 but the frames' cast); big_middle.onnx in its first two
/// convolutions only.
#[test]
fn fp16_that_overflows_keeps_those_nodes_in_f32() {
    if !gpu("fp16_that_overflows_keeps_those_nodes_in_f32") {
        return;
    }
    for (model, kept) in [
        (
            "big_activations",
            &["conv_0", "globalaveragepool_0", "gemm_0"][..],
        ),
        ("big_middle", &["conv_0", "conv_1"][..]),
    ] {
        let path = common::model(&format!("{model}.onnx"));
        let reference = format!("{model}_reference.json");
        let (input, frames) = reference_frames(&reference);
        let want = reference_scores(&reference);
        let classes = want.len() / frames;
        let dir = tempfile::tempdir().unwrap();
        for (round, precision) in [
            (0, Precision::Fp16),
            (1, Precision::Fp16),
            (2, Precision::Fp32),
        ] {
            let mut o = options(&path, 2, precision);
            o.engine_location = Some(dir.path().join(format!("{precision:?}.engine")));
            let mut gpu = CudaEngine::build(&o).unwrap_or_else(|e| panic!("cuda engine: {e}"));
            let info = gpu.info().clone();
            let what = format!("{model} {precision:?}, round {round}");
            assert_eq!(info.precision, precision, "{what}");
            match precision {
                Precision::Fp16 => {
                    let note = info
                        .precision_note
                        .clone()
                        .expect("a note on the precision");
                    assert!(
                        note.contains("node `conv_0`")
                            && note.contains(&format!("{} node(s) run in f32", kept.len()))
                            && kept.iter().all(|k| note.contains(k))
                            && note.contains("the rest in fp16"),
                        "{what}: {note}"
                    );
                    println!("{what}: {note}");
                }
                Precision::Fp32 => assert_eq!(info.precision_note, None, "{what}"),
                Precision::Int8 | Precision::Fp8 => unreachable!("not among the cases"),
            }
            let got = gpu.infer(&input, frames).expect("cuda inference");
            for (i, g) in got.iter().enumerate() {
                compare(
                    &format!("{what} frame {i}"),
                    g,
                    &want[i * classes..][..classes],
                    1e-3,
                    1e-3,
                );
            }
        }
    }
}

/// A model whose logits alone pass fp16's range (about 2e5) stays in fp16: its last product
/// writes the scores in f32, so nothing overflows and there is no note; the scores are
/// onnxruntime's to fp16's precision.
#[test]
fn fp16_logits_beyond_its_range_stay_fp16() {
    if !gpu("fp16_logits_beyond_its_range_stay_fp16") {
        return;
    }
    let path = common::model("big_logits.onnx");
    let (input, frames) = reference_frames("big_logits_reference.json");
    let want = reference_scores("big_logits_reference.json");
    assert!(want.iter().any(|v| v.abs() > 65504.0), "logits past fp16");
    let classes = want.len() / frames;
    let mut gpu = CudaEngine::build(&options(&path, 2, Precision::Fp16)).expect("cuda engine");
    let info = gpu.info().clone();
    assert_eq!(info.precision, Precision::Fp16, "{:?}", info.precision_note);
    assert_eq!(info.precision_note, None);
    let got = gpu.infer(&input, frames).expect("cuda inference");
    assert_eq!(got.len(), frames, "big_logits: one result per frame");
    for (i, g) in got.iter().enumerate() {
        let want = &want[i * classes..][..classes];
        assert_eq!(
            g.len(),
            classes,
            "big_logits frame {i}: one score per class"
        );
        let largest = g
            .iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs() / w.abs().max(1.0))
            .fold(0.0f32, f32::max);
        println!("big_logits frame {i}: largest relative error {largest:.2e}");
        assert!(largest < 5e-3, "frame {i}: {g:?} against {want:?}");
    }
    assert!(info.non_finite.get().is_none());
}

/// Scores that come out not finite (frames beyond fp16's range) make the engine look for
/// where they began, once, and name that step and node for the element's warning.
#[test]
fn non_finite_scores_name_the_step_where_they_began() {
    if !gpu("non_finite_scores_name_the_step_where_they_began") {
        return;
    }
    let path = common::model("colors.onnx");
    let mut gpu = CudaEngine::build(&options(&path, 2, Precision::Fp16)).expect("cuda engine");
    let info = gpu.info().clone();
    assert_eq!(info.precision, Precision::Fp16, "colors.onnx holds in fp16");
    let frame_len = info.input.frame_len();
    let fine = gpu.infer(&vec![0.5; frame_len], 1).expect("inference");
    assert!(fine[0].iter().all(|v| v.is_finite()));
    assert!(info.non_finite.get().is_none(), "nothing to report yet");
    // 1e5 is past fp16's 65504: the input's cast to fp16, the plan's first step, gives
    // infinity.
    let got = gpu.infer(&vec![1e5; frame_len], 1).expect("inference");
    assert!(got[0].iter().any(|v| !v.is_finite()), "{:?}", got[0]);
    let found = info.non_finite.get().expect("the engine looked");
    assert!(
        found.contains("node `image` (step 0") && found.contains("infinite or NaN"),
        "{found}"
    );
    println!("{found}");
}

const MODELS: &[(&str, &str)] = &[
    ("cnn.onnx", "cnn_reference.json"),
    ("colors.onnx", "colors_reference.json"),
    ("colors_nhwc.onnx", "colors_reference.json"),
    ("colors_b1.onnx", "colors_reference.json"),
    ("ops.onnx", "ops_reference.json"),
    ("ops_rare.onnx", "ops_rare_reference.json"),
];

#[test]
fn cuda_fp16_agrees_with_cpu() {
    if !gpu("cuda_fp16_agrees_with_cpu") {
        return;
    }
    for (model, reference) in MODELS {
        // cnn.onnx outputs logits of a few units; the others probabilities.
        check_model(model, reference, Precision::Fp16, 2e-2, 2e-2);
    }
}

#[test]
fn cuda_fp32_agrees_with_cpu() {
    if !gpu("cuda_fp32_agrees_with_cpu") {
        return;
    }
    for (model, reference) in MODELS {
        check_model(model, reference, Precision::Fp32, 1e-4, 1e-3);
    }
}

/// Engines built on several threads at once (each capturing its plans as CUDA graphs in the
/// context they share) while other engines are built and dropped beside them all build and
/// agree with the cpu backend: a capture is not invalidated by another engine's setup.
/// The digits classifier (a small CNN trained on real data, `models/digits/train.py`) keeps
/// its held-out accuracy within a point of onnxruntime's fp32 in both precisions; the
/// figures are those of docs/benchmarks.md's accuracy table.
#[test]
fn cuda_keeps_the_digits_accuracy() {
    if !gpu("cuda_keeps_the_digits_accuracy") {
        return;
    }
    let digits = trtclassify_compiler::testing::digits_heldout();
    let frames = digits.views();
    let model = common::model("digits/digits.onnx");
    for precision in [Precision::Fp32, Precision::Fp16] {
        let mut gpu = CudaEngine::build(&options(&model, 16, precision)).expect("cuda engine");
        let scores = gpu.classify(&frames).expect("the digits classify");
        digits.check(&format!("backend=cuda {precision:?}"), &scores);
    }
}

/// The digits classifier in int8 and FP8, quantized with the committed calibration table
/// (its two inner convolutions): the held-out accuracy stays within a point of fp32's, and
/// with every quantized layer in 8 bits (`strict_precision`) the scores are those of
/// onnxruntime running the same quantization as a QDQ model
/// (`models/digits/digits_quantized_reference.json`), within fp16's difference (the layers
/// around them run in fp16 here, in f32 there). By default each layer runs in the faster of
/// 8 bits and fp16, which the build's report names.
#[test]
fn cuda_int8_and_fp8_keep_the_digits_accuracy() {
    if !gpu("cuda_int8_and_fp8_keep_the_digits_accuracy") {
        return;
    }
    let digits = trtclassify_compiler::testing::digits_heldout();
    let frames = digits.views();
    let model = common::model("digits/digits.onnx");
    let text = std::fs::read_to_string(common::model("digits/digits_quantized_reference.json"))
        .expect("the quantized reference");
    let reference: serde_json::Value = serde_json::from_str(&text).expect("json");
    let arch = cuda::runtime::open_gpu(0).expect("a GPU").arch;
    for (precision, format) in [(Precision::Int8, "int8"), (Precision::Fp8, "fp8")] {
        if precision == Precision::Fp8 && arch < (8, 9) {
            skipped(&format!("fp8 digits: sm_{}{} has no FP8", arch.0, arch.1));
            continue;
        }
        let mut options = options(&model, 16, precision);
        options.calibration = Some(common::model("digits/digits_calibration.txt").into());
        let mut gpu = CudaEngine::build(&options).expect("a quantized cuda engine");
        let report = gpu.info().quant_report.clone().expect("the build's report");
        println!("digits {format}, each layer the faster: {report}");
        assert_eq!(gpu.info().precision, precision);
        let scores = gpu.classify(&frames).expect("the digits classify");
        digits.check(&format!("backend=cuda {format}, the faster"), &scores);

        options.strict_precision = true;
        let mut gpu = CudaEngine::build(&options).expect("a quantized cuda engine");
        let report = gpu.info().quant_report.clone().expect("the build's report");
        assert!(!report.contains("faster on this GPU"), "{format}: {report}");
        let scores = gpu.classify(&frames).expect("the digits classify");
        digits.check(&format!("backend=cuda {format}"), &scores);
        let want = floats(&reference[format], "scores");
        let got = scores.concat();
        assert_eq!(got.len(), want.len(), "{format}: scores");
        let off: Vec<f32> = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).collect();
        let mean = off.iter().sum::<f32>() / off.len() as f32;
        let agree = (scores.iter().zip(want.chunks(10)))
            .filter(|(g, w)| top(g, 1) == top(w, 1))
            .count();
        println!(
            "digits {format} against onnxruntime's QDQ: mean score difference {mean:.1e}, \
             top-1 agreement {agree}/{}",
            scores.len()
        );
        assert!(mean <= 5e-3, "{format}: mean score difference {mean}");
        assert!(
            agree * 100 >= scores.len() * 98,
            "{format}: top-1 agrees on {agree} of {}",
            scores.len()
        );
    }
}

/// The accuracy guard: held-out frames beside the table (made by the engine's calibration,
/// as `trtclassify-engine calibrate` makes them) are measured at build and reported; where
/// the quantized engine agrees on fewer than `min_agreement` of them (here, held-out scores
/// of other frames), the engine is built in fp16 instead, with a note saying why.
#[test]
fn cuda_quantized_builds_measure_their_agreement_and_fall_back_below_it() {
    use gsttrtclassify::engine::calibration::Calibration;
    use trtclassify_compiler::quant::HeldOut;
    if !gpu("cuda_quantized_builds_measure_their_agreement_and_fall_back_below_it") {
        return;
    }
    let model = common::model("digits/digits.onnx");
    let dir = tempfile::tempdir().expect("temp dir");
    let table = dir.path().join("digits.txt");
    std::fs::copy(common::model("digits/digits_calibration.txt"), &table).expect("copied");
    let digits = trtclassify_compiler::testing::digits_heldout();
    let mut calibration =
        Calibration::new(&options(&model, 1, Precision::Fp32)).expect("calibration");
    for frame in &digits.views()[..64] {
        calibration.hold_out(frame).expect("a held-out frame");
    }
    let held = calibration.held_out().clone();
    held.save(&HeldOut::beside(&table)).expect("written");
    let mut o = options(&model, 16, Precision::Int8);
    o.calibration = Some(table.clone());
    o.engine_location = Some(dir.path().join("int8.engine"));
    let gpu = CudaEngine::build(&o).expect("an int8 engine");
    let info = gpu.info();
    let report = info
        .quant_report
        .clone()
        .expect("a report of the quantized build");
    println!("{report}");
    assert_eq!(info.precision, Precision::Int8);
    assert!(
        report.contains("2 product(s) and convolution(s) quantized")
            && report.contains("against fp32 on the held-out frames: top-1 agreement")
            && report.contains("of 64 frames"),
        "{report}"
    );
    // Each frame's scores swapped with the next one's: the engine agrees with few of them.
    let mut wrong = held.clone();
    let classes = wrong.classes;
    wrong.scores.rotate_left(classes);
    wrong.save(&HeldOut::beside(&table)).expect("written");
    o.engine_location = Some(dir.path().join("fell-back.engine"));
    for attempt in ["built", "loaded"] {
        let gpu = CudaEngine::build(&o).expect("an engine");
        let info = gpu.info();
        let note = info.precision_note.clone().expect("a note on the fallback");
        println!("{attempt}: {note}");
        assert_eq!(info.precision, Precision::Fp16, "{attempt}");
        assert_eq!(info.quant_report, None, "{attempt}");
        assert!(
            note.contains("below min-agreement 0.95") && note.contains("fp16 instead"),
            "{attempt}: {note}"
        );
    }
}

#[test]
fn engines_built_together_on_one_gpu_all_run() {
    if !gpu("engines_built_together_on_one_gpu_all_run") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (input, frames) = reference_frames("colors_reference.json");
    let data = &input[..];
    let path = common::model("colors.onnx");
    let want = CpuEngine::build(&options(&path, 1, Precision::Fp32))
        .expect("cpu engine")
        .infer(data, frames)
        .expect("cpu inference");
    std::thread::scope(|scope| {
        let builders: Vec<_> = (0..6)
            .map(|i| {
                let (dir, path) = (dir.path(), &path);
                scope.spawn(move || {
                    // Two rounds: the second's builds overlap the first's engines dropping.
                    (0..2)
                        .map(|round| {
                            let mut o = options(path, 4, Precision::Fp16);
                            o.engine_location = Some(dir.join(format!("{i}-{round}.engine")));
                            let mut engine = CudaEngine::build(&o)
                                .unwrap_or_else(|e| panic!("engine {i}, round {round}: {e}"));
                            engine.infer(data, frames).expect("cuda inference")
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for (i, builder) in builders.into_iter().enumerate() {
            let results = builder.join().expect("a builder panicked");
            assert_eq!(results.len(), 2, "engine {i}: two rounds");
            for got in results {
                assert_eq!(got.len(), want.len(), "engine {i}: one result per frame");
                for (f, (g, w)) in got.iter().zip(&want).enumerate() {
                    compare(&format!("engine {i}, frame {f}"), g, w, 2e-2, 2e-2);
                }
            }
        }
    });
}

/// The GPU compiler's part that runs on the CPU (import, passes, lowering) takes a model past
/// 2 GiB, and the plan it makes passes the engine file's checks: this runs without a GPU.
#[test]
fn the_gpu_compiler_takes_a_model_over_2_gib() {
    use common::large_model;
    use gsttrtclassify::engine::OnnxModel;
    use gsttrtclassify::engine::compiler::plan::DType;
    common::init();
    let dir = tempfile::tempdir().unwrap();
    let model = OnnxModel::load(&large_model::write(dir.path())).unwrap();
    let spec = model.input_spec(None).unwrap();
    let (plans, weights) =
        gsttrtclassify::engine::compiler::compile(&model, &[1, 4], spec, DType::F16).unwrap();
    assert_eq!(plans.len(), 2);
    assert_eq!(plans[1].output_len, 4 * large_model::CLASSES);
    let values: usize = weights.data.iter().map(|w| w.len()).sum();
    assert_eq!(
        values,
        large_model::FEATURES * large_model::CLASSES + large_model::CLASSES,
        "the weights and the bias, once for both plans"
    );
}

/// A model past protobuf's 2 GiB limit (external data): its weights imported from past 2 GiB
/// into their file, the engine file (over 1 GB in fp16, over 2 GB in fp32) written and read
/// back, and the scores exact in both precisions.
#[test]
fn cuda_runs_a_model_with_over_2_gib_of_external_weights() {
    use common::large_model;
    if !gpu("cuda_runs_a_model_with_over_2_gib_of_external_weights") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = large_model::write(dir.path());
    let (input, tops) = large_model::images();
    for precision in [Precision::Fp16, Precision::Fp32] {
        let mut options = options(path.to_str().unwrap(), 4, precision);
        options.engine_location = Some(dir.path().join(format!("{precision:?}.engine")));
        let messages = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let log = messages.clone();
        options.progress = gsttrtclassify::engine::Progress::new(move |m: &str| {
            log.lock().unwrap().push(m.to_owned())
        });
        // The first build writes the engine file, the second reads it.
        for build in ["built", "read back"] {
            messages.lock().unwrap().clear();
            let mut engine = CudaEngine::build(&options)
                .unwrap_or_else(|e| panic!("{precision:?}, {build}: {e}"));
            let loaded = messages
                .lock()
                .unwrap()
                .iter()
                .any(|m| m.starts_with("loaded engine file"));
            assert_eq!(loaded, build == "read back", "{precision:?}, {build}");
            assert_eq!(engine.info().num_classes, large_model::CLASSES);
            let scores = engine.infer(&input, tops.len()).expect("inference");
            assert_eq!(scores.len(), tops.len(), "one score vector per image");
            for (i, got) in scores.iter().enumerate() {
                assert_eq!(
                    got,
                    &large_model::expected_scores(i),
                    "{precision:?}, {build}: image {i}"
                );
            }
        }
        let written = std::fs::metadata(options.engine_location.as_ref().unwrap())
            .expect("the engine file was written")
            .len();
        println!("{precision:?}: engine file of {written} bytes");
        assert!(written > large_model::WEIGHT_BYTES / 2, "{written} bytes");
    }
}

#[test]
fn cuda_torchvision_agrees_with_onnxruntime() {
    if !gpu("cuda_torchvision_agrees_with_onnxruntime") {
        return;
    }
    let Ok(dir) = std::env::var("TRTCLASSIFY_TORCHVISION_DIR") else {
        skipped("cuda_torchvision_agrees_with_onnxruntime: TRTCLASSIFY_TORCHVISION_DIR is not set");
        return;
    };
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("torchvision dir")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".ref.json").map(str::to_owned))
        .collect();
    names.sort();
    assert!(!names.is_empty(), "no *.ref.json in {dir}");
    let mut failed = Vec::new();
    for name in names {
        let dir = std::path::Path::new(&dir);
        let (json, want) = common::reference_json(&dir.join(format!("{name}.ref.json")));
        // The reference frames 8 times over, in one batch, and the first alone: on a GPU of
        // 48 SMs or more, a ViT's attention runs 8 warps a block at 32 frames and 4 in the
        // batch-1 plan (`steps/attention.rs`).
        const REPEATS: usize = 8;
        let input = common::read_f32(&dir.join(format!("{name}.input.bin"))).repeat(REPEATS);
        let want: Vec<Vec<f32>> = std::iter::repeat_n(want, REPEATS).flatten().collect();
        // PyTorch's own fp16 error on the GPU for this input: our fp16 engine may be off by
        // as much as three times that (rounding differs; neither is exact).
        let torch_fp16 = json["torch_fp16_max_abs_diff"].as_f64().unwrap_or(0.0) as f32;
        let model = dir.join(format!("{name}.onnx"));
        for precision in [Precision::Fp16, Precision::Fp32] {
            let (abs, rel, floor) = match precision {
                Precision::Fp16 => (1e-2f32, 5e-2, 3.0 * torch_fp16),
                Precision::Fp32 => (1e-3, 1e-2, 0.0),
                Precision::Int8 | Precision::Fp8 => unreachable!("not among the precisions"),
            };
            let started = std::time::Instant::now();
            let model = model.to_str().expect("utf-8");
            let mut gpu = CudaEngine::build(&options(model, want.len(), precision))
                .unwrap_or_else(|e| panic!("{name}: cuda engine: {e}"));
            let built = started.elapsed();
            let got = gpu.infer(&input, want.len()).expect("cuda inference");
            let alone = gpu
                .infer(&input[..input.len() / want.len()], 1)
                .expect("cuda inference");
            assert_eq!(
                common::scores_shape(&got),
                common::scores_shape(&want),
                "{name} {precision:?}: frames, and scores per frame"
            );
            let worst = common::largest_difference(&got, &want);
            println!(
                "{name} {precision:?}: built in {built:.1?}, largest probability error {worst:.2e} \
                 (PyTorch fp16: {torch_fp16:.2e})"
            );
            if let Some(note) = &gpu.info().precision_note {
                println!("{name}: {note}");
            }
            let checked = std::panic::catch_unwind(|| {
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let what = format!("{name} {precision:?} frame {i}");
                    compare(&what, g, w, abs.max(floor), rel);
                }
                assert_eq!(alone.len(), 1, "{name} {precision:?}: frames alone");
                let what = format!("{name} {precision:?} frame 0 alone");
                compare(&what, &alone[0], &want[0], abs.max(floor), rel);
            });
            if let Err(panic) = checked {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| "unknown failure".into());
                failed.push(msg);
            }
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

/// The largest logit error a transformer export may make in strict int8 or FP8: half again
/// the 0.16 that FP8's rounding alone makes of Swin-T's in the plan simulator
/// (`cargo run --release --example quant_sim -- DIR swin_t`; on an H200: 0.13, and ViT-B/16
/// 0.15).
const LOGIT_ERROR_BOUND: f32 = 0.25;

/// Each export in int8 and FP8 (FP8 from sm_89 on), calibrated on its own reference frames,
/// every quantized layer in 8 bits (`strict_precision`): the engine builds and runs, its
/// scores are probabilities, and the transformers' logits stay within `LOGIT_ERROR_BOUND`
/// of onnxruntime's fp32 (`Agreement::max_logit_error`). Top-1 agreement and the largest
/// probability error are printed, not asserted: the exports have random weights, which leave
/// classes near ties, so that rounding alone moves their probabilities far (Swin-T in
/// strict FP8 in the plan simulator, with no GPU in it: top-1 2 of 4, a probability off by
/// 0.27, logits by 0.16). A CNN with random weights turns a layer's few per cent of error
/// into larger moves still (MobileNetV2: one FP8 layer of 3.8 % error moves a probability by
/// up to 0.86 in the simulator, where fp16's error moves none), so theirs are printed only;
/// LayerNorm keeps a transformer's error in scale, as training keeps a trained CNN's.
///
/// What this catches is a fault of the 8-bit path as a whole (in the simulator, every layer's
/// weights doubled take Swin-T's logit error from 0.16 to 1.18); one layer gone wrong among
/// 77 does not show past the rounding (one layer's weights reversed: 0.17). The digits tests
/// check the kernels layer by layer against onnxruntime's QDQ on a trained model.
#[test]
fn cuda_int8_and_fp8_run_every_export() {
    use gsttrtclassify::engine::compiler::quant::Agreement;
    if !gpu("cuda_int8_and_fp8_run_every_export") {
        return;
    }
    let Ok(dir) = std::env::var("TRTCLASSIFY_TORCHVISION_DIR") else {
        skipped("cuda_int8_and_fp8_run_every_export: TRTCLASSIFY_TORCHVISION_DIR is not set");
        return;
    };
    let dir = std::path::Path::new(&dir);
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("torchvision dir")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".ref.json").map(str::to_owned))
        .collect();
    names.sort();
    let arch = cuda::runtime::open_gpu(0).expect("a GPU").arch;
    let tables = tempfile::tempdir().expect("temp dir");
    let mut checked = 0;
    for name in names {
        let (_, want) = common::reference_json(&dir.join(format!("{name}.ref.json")));
        let input = common::read_f32(&dir.join(format!("{name}.input.bin")));
        let path = dir.join(format!("{name}.onnx"));
        let model = path.to_str().expect("utf-8");
        let table = tables.path().join(format!("{name}.txt"));
        calibrated(model, &input)
            .save(&table)
            .expect("the table is written");
        let transformer = name.starts_with("vit") || name.starts_with("swin");
        for precision in [Precision::Int8, Precision::Fp8] {
            if precision == Precision::Fp8 && arch < (8, 9) {
                continue;
            }
            let mut o = options(model, 8, precision);
            o.calibration = Some(table.clone());
            o.strict_precision = true;
            let mut gpu = CudaEngine::build(&o)
                .unwrap_or_else(|e| panic!("{name} {precision:?}: cuda engine: {e}"));
            let got = gpu.infer(&input, want.len()).expect("quantized inference");
            assert_eq!(
                common::scores_shape(&got),
                common::scores_shape(&want),
                "{name}"
            );
            assert!(
                got.iter().flatten().all(|v| v.is_finite()),
                "{name} {precision:?}"
            );
            let mut agreement = Agreement::default();
            agreement.add(&want.concat(), &got.concat(), want[0].len());
            let logits = agreement.max_logit_error;
            println!(
                "{name} {precision:?}: against onnxruntime fp32 (random weights): {agreement}, logit error {logits:.3}"
            );
            let sums_to_one = got
                .iter()
                .all(|f| (f.iter().sum::<f32>() - 1.0).abs() < 1e-2);
            assert!(
                sums_to_one,
                "{name} {precision:?}: scores that are not probabilities"
            );
            if transformer {
                assert!(
                    logits <= LOGIT_ERROR_BOUND,
                    "{name} {precision:?}: logit error {logits} against onnxruntime's fp32"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "no transformer export was checked");
}

#[test]
fn vision_transformers_agree_with_onnxruntime() {
    // Small torchvision ViT, Swin and MaxViT exports, the hybrids' patterns and the dynamo
    // exporter's graphs (`models/transformers/export.py`): attention as batched products
    // (MatMul or Einsum), LayerNorm, GroupNorm, GELU (erf and tanh), shifted windows,
    // resizes.
    if !gpu("vision_transformers_agree_with_onnxruntime") {
        return;
    }
    let input = common::transformer_input();
    for &name in common::TRANSFORMERS {
        let reference = common::model(&format!("transformers/{name}.ref.json"));
        let (_, want) = common::reference_json(reference.as_ref());
        let model = common::model(&format!("transformers/{name}.onnx"));
        for (precision, abs, rel) in [(Precision::Fp32, 1e-4, 1e-3), (Precision::Fp16, 1e-2, 5e-2)]
        {
            let mut gpu = CudaEngine::build(&options(&model, 2, precision))
                .unwrap_or_else(|e| panic!("{name}: cuda engine: {e}"));
            // Both frames in one batch, then the first alone (the batch-1 plan).
            let both = gpu.infer(&input, 2).expect("cuda inference");
            let first = gpu
                .infer(&input[..input.len() / 2], 1)
                .expect("cuda inference");
            assert_eq!(
                (both.len(), first.len(), want.len()),
                (2, 1, 2),
                "{name}: frames"
            );
            let mut worst = 0.0f32;
            for (i, (g, w)) in both
                .iter()
                .chain(&first)
                .zip(want.iter().chain(&want[..1]))
                .enumerate()
            {
                worst = worst.max(compare(
                    &format!("{name} {precision:?} #{i}"),
                    g,
                    w,
                    abs,
                    rel,
                ));
            }
            println!("{name} {precision:?}: largest probability error {worst:.2e}");
        }
    }
}

/// Builds `model` at batch 4 with the engine file at `engine`; returns the scores of the
/// reference frames and the progress messages.
fn build_with_file(model: &str, engine: &std::path::Path) -> (Vec<Vec<f32>>, Vec<String>) {
    let (_, reference) = MODELS
        .iter()
        .find(|(m, _)| *m == model)
        .expect("a test model");
    let heard = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut o = options(&common::model(model), 4, Precision::Fp16);
    o.engine_location = Some(engine.into());
    let sink = heard.clone();
    o.progress =
        gsttrtclassify::engine::Progress::new(move |m| sink.lock().unwrap().push(m.to_owned()));
    let mut gpu = CudaEngine::build(&o).unwrap_or_else(|e| panic!("{model}: {e}"));
    let (input, frames) = reference_frames(reference);
    let scores = gpu.infer(&input, frames).expect("inference");
    let heard = heard.lock().unwrap().clone();
    (scores, heard)
}

/// The engine file is written on the first build and loaded on the next; a damaged or
/// foreign file, or one that cannot be written, means a rebuild with the same results.
#[test]
fn engine_file_is_reused_and_damage_means_a_rebuild() {
    if !gpu("engine_file_is_reused_and_damage_means_a_rebuild") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cnn.engine");
    let loaded = |heard: &[String]| heard.iter().any(|m| m.starts_with("loaded engine file"));
    let saved = |heard: &[String]| heard.iter().any(|m| m.starts_with("saved engine file"));

    let (built, heard) = build_with_file("cnn.onnx", &path);
    assert!(saved(&heard) && !loaded(&heard), "first build: {heard:?}");
    let good = std::fs::read(&path).unwrap();
    let started = std::time::Instant::now();
    let (cached, heard) = build_with_file("cnn.onnx", &path);
    println!("cached start of cnn.onnx: {:.1?}", started.elapsed());
    assert!(loaded(&heard) && !saved(&heard), "second build: {heard:?}");
    assert_eq!(cached, built, "the loaded engine gives other scores");

    let damaged: [(&str, Vec<u8>); 4] = [
        ("truncated", good[..good.len() / 3].to_vec()),
        ("bit-flipped", {
            let mut b = good.clone();
            let i = b.len() / 2;
            b[i] ^= 0x10;
            b
        }),
        ("foreign", std::fs::read(common::model("cnn.onnx")).unwrap()),
        ("empty", Vec::new()),
    ];
    for (what, bytes) in damaged {
        std::fs::write(&path, &bytes).unwrap();
        let (scores, heard) = build_with_file("cnn.onnx", &path);
        assert!(!loaded(&heard) && saved(&heard), "{what} file: {heard:?}");
        // Tuning again may pick other algorithms: fp16 rounding may differ, no more.
        assert_eq!(scores.len(), built.len(), "{what} file, rebuilt: frames");
        for (s, b) in scores.iter().zip(&built) {
            compare(&format!("{what} file, rebuilt"), s, b, 2e-2, 2e-2);
        }
        let (_, heard) = build_with_file("cnn.onnx", &path);
        assert!(
            loaded(&heard),
            "{what}: the rewritten file does not load: {heard:?}"
        );
    }
    // Another model's engine at the same path: its key differs.
    let (other, heard) = build_with_file("colors.onnx", &path);
    assert!(!loaded(&heard) && saved(&heard), "another model: {heard:?}");
    assert_eq!(other.len(), reference_frames("colors_reference.json").1);

    // Nowhere to write (even root cannot create files under /proc): it runs unsaved.
    let nowhere = std::path::Path::new("/proc/trtclassify-test/cnn.engine");
    let (scores, heard) = build_with_file("cnn.onnx", nowhere);
    assert!(!saved(&heard), "{heard:?}");
    assert_eq!(scores.len(), built.len(), "unsaved engine: frames");
    for (s, b) in scores.iter().zip(&built) {
        compare("unsaved engine", s, b, 2e-2, 2e-2);
    }
}

/// Each product's cuBLASLt algorithm is chosen by timing at build, and the engine file keeps
/// the choice: a load runs the same algorithms, with the same scores. The same for the 8-bit
/// products of int8 and FP8 engines (the digits classifier, every quantized layer in 8 bits).
#[test]
fn products_are_tuned_at_build_and_loads_keep_the_choice() {
    use trtclassify_compiler::plan::{ConvStep, GemmStep, Step};
    if !gpu("products_are_tuned_at_build_and_loads_keep_the_choice") {
        return;
    }
    // Each product's algorithm, and each 8-bit convolution's (its product's).
    let algos = |engine: &CudaEngine| -> Vec<Vec<Option<[u64; 8]>>> {
        (engine.runtime().plans())
            .map(|plan| {
                (plan.steps.iter())
                    .filter_map(|s| match s {
                        Step::Gemm(GemmStep { quant: Some(q), .. })
                        | Step::Conv(ConvStep { quant: Some(q), .. }) => Some(q.algo),
                        Step::Gemm(GemmStep { algo, .. }) => Some(*algo),
                        _ => None,
                    })
                    .collect()
            })
            .collect()
    };
    let arch = cuda::runtime::open_gpu(0).expect("a GPU").arch;
    let digits = common::model("digits/digits.onnx");
    let cases = [
        ("cnn.onnx", Precision::Fp16, common::model("cnn.onnx")),
        ("digits int8", Precision::Int8, digits.clone()),
        ("digits fp8", Precision::Fp8, digits),
    ];
    for (name, precision, model) in cases {
        if precision == Precision::Fp8 && arch < (8, 9) {
            skipped(&format!("{name}: sm_{}{} has no FP8", arch.0, arch.1));
            continue;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut o = options(&model, 4, precision);
        o.engine_location = Some(dir.path().join("engine"));
        if precision != Precision::Fp16 {
            o.calibration = Some(common::model("digits/digits_calibration.txt").into());
            o.strict_precision = true;
        }
        let mut built = CudaEngine::build(&o).expect("build");
        let tuned = algos(&built);
        let products: usize = tuned.iter().map(Vec::len).sum();
        assert!(products > 0, "{name} has products");
        assert!(
            tuned.iter().flatten().all(Option::is_some),
            "{name}: an untuned product: {tuned:?}"
        );
        let scores = |engine: &mut CudaEngine| match precision {
            Precision::Fp16 => {
                let (input, frames) = reference_frames("cnn_reference.json");
                engine.infer(&input, frames).expect("inference")
            }
            _ => {
                let digits = trtclassify_compiler::testing::digits_heldout();
                engine
                    .classify(&digits.views())
                    .expect("the digits classify")
            }
        };
        let want = scores(&mut built);
        drop(built);
        let mut loaded = CudaEngine::build(&o).expect("load");
        assert_eq!(
            algos(&loaded),
            tuned,
            "{name}: the loaded engine's algorithms"
        );
        assert_eq!(
            scores(&mut loaded),
            want,
            "{name}: the loaded engine's scores"
        );
    }
}

/// The calibration table of `model` on `input` (model inputs, frame after frame).
fn calibrated(
    model: &str,
    input: &[f32],
) -> gsttrtclassify::engine::compiler::quant::CalibrationTable {
    use gsttrtclassify::engine::calibration::Calibration;
    let mut calibration =
        Calibration::new(&options(model, 1, Precision::Fp16)).expect("calibration");
    for frame in input.chunks_exact(calibration.frame_len()) {
        calibration.add_input(frame).expect("a calibration frame");
    }
    calibration.table()
}

/// An int8 step gives the same scores, to the bit, whether the engine's own kernel runs it
/// (`Quant::kernel`, blocks of 64 or 128 output channels, the input rounded as it is read
/// or by a pass before; a value passed in int8 to a later such step that is its only reader) or
/// patches, cuBLASLt's product and the pass that scales its sums back do: on the digits
/// classifier (16 input channels, the summed dimension not a multiple of the kernel's
/// chunks) and ops.onnx (int8 passed from a convolution and from a GELU product), in fp16 and
/// f32 plans, and, where the GPU host's exports are, on ResNet-50, MobileNetV2 and ViT-B/16
/// (64 to 3,072 channels, strides, residuals, products of many rows), every quantized layer
/// in int8; and again after a step-by-step run (the overflow check's).
#[test]
fn the_own_int8_kernel_gives_cublaslts_scores_to_the_bit() {
    use gsttrtclassify::engine::compiler::plan::{DType, EightBitKernel, Plan, QuantFormat, Step};
    use gsttrtclassify::engine::compiler::quant::{self, CalibrationTable};
    use gsttrtclassify::engine::compiler::{OnnxModel, compile_mixed};
    if !gpu("the_own_int8_kernel_gives_cublaslts_scores_to_the_bit") {
        return;
    }
    let gpu = cuda::runtime::open_gpu(0).expect("a GPU");
    if gpu.arch < (8, 0) {
        skipped(&format!(
            "the own int8 kernel: sm_{}{} has no mma.sync m16n8k32",
            gpu.arch.0, gpu.arch.1
        ));
        return;
    }
    // The models, each with its frames (the model's input) and its calibration table: the
    // digits' committed one, else made on the frames.
    let digits = trtclassify_compiler::testing::digits_heldout();
    let digits_input: Vec<f32> = (0..16).flat_map(|i| digits.model_input(i)).collect();
    // ops.onnx passes int8 from a convolution to the next and from a GELU product to the
    // next (`int8_passes_from_a_step_to_its_only_reader`).
    let ops = common::model("ops.onnx");
    let (ops_input, _) = reference_frames("ops_reference.json");
    let ops_table = calibrated(&ops, &ops_input);
    // The repository's models in f32 plans too (an fp16 engine whose values pass fp16's
    // range is built again in f32, its int8 steps reading f32).
    let both: &[DType] = &[DType::F16, DType::F32];
    let mut models = vec![
        (
            common::model("digits/digits.onnx"),
            digits_input,
            CalibrationTable::load(common::model("digits/digits_calibration.txt").as_ref())
                .expect("the digits table"),
            both,
        ),
        (ops, ops_input, ops_table, both),
    ];
    match std::env::var("TRTCLASSIFY_TORCHVISION_DIR") {
        Ok(dir) => {
            for name in ["resnet50", "mobilenet_v2", "vit_b_16"] {
                let path = std::path::Path::new(&dir).join(format!("{name}.onnx"));
                if !path.exists() {
                    skipped(&format!(
                        "the own int8 kernel on {name}: no export in {dir}"
                    ));
                    continue;
                }
                let input = common::read_f32(&path.with_extension("input.bin"));
                let model = path.to_str().expect("utf-8");
                let table = calibrated(model, &input);
                models.push((model.to_owned(), input, table, &[DType::F16]));
            }
        }
        Err(_) => {
            skipped("the own int8 kernel on the exports: TRTCLASSIFY_TORCHVISION_DIR is not set")
        }
    }
    for (model, input, table, types) in models {
        let onnx = OnnxModel::load(std::path::Path::new(&model)).expect("the model");
        let spec = onnx.input_spec(None).expect("an image input");
        let frames = input.len() / (3 * spec.height * spec.width);
        for &dtype in types {
            let (mut plans, mut weights) =
                compile_mixed(&onnx, &[frames], spec, dtype, &[]).expect("compiles");
            let mut plan = plans.pop().expect("a plan");
            let done = quant::quantize(&mut plan, &mut weights, &table, QuantFormat::Int8, &[]);
            let what = format!("{model} {dtype:?} (kept: {:?})", done.kept);
            assert!(!done.nodes.is_empty(), "{what}: nothing quantized");
            let bytes: Vec<Vec<u8>> = (0..weights.data.len())
                .map(|i| cuda::runtime::to_bytes(&weights.data[i], weights.dtype(i, dtype)))
                .collect();
            let cubin = cuda::runtime::compile(dtype, gpu.arch)
                .expect("the kernels")
                .cubin;
            let open = |plan: Plan| {
                cuda::runtime::Runtime::new(
                    &gpu,
                    &cubin,
                    dtype,
                    &bytes,
                    vec![plan],
                    None,
                    false,
                    &mut |_| {},
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"))
            };
            // Every int8 step through cuBLASLt first; the other steps' algorithms, tuned
            // then, are kept for the runs in the own kernel, so that only the int8 steps
            // differ between them.
            let with = |plan: &Plan, kernel: EightBitKernel| {
                let mut plan = plan.clone();
                for step in &mut plan.steps {
                    let quant = match step {
                        Step::Gemm(g) => g.quant.as_mut(),
                        Step::Conv(c) => c.quant.as_mut(),
                        _ => None,
                    };
                    if let Some(q) = quant {
                        q.kernel = Some(kernel);
                    }
                }
                plan
            };
            let mut rt = open(with(&plan, EightBitKernel::Library));
            assert_eq!(
                (rt.own_int8_steps(), rt.int8_passes()),
                (0, 0),
                "{what}: cuBLASLt's path"
            );
            let library = rt.run(&input, frames).expect("inference").to_vec();
            assert!(library.iter().all(|v| v.is_finite()), "{what}");
            let tuned = rt.plans().next().expect("a plan").clone();
            drop(rt);
            for kernel in EightBitKernel::OWN {
                let mut rt = open(with(&tuned, kernel));
                let (steps, passes) = (rt.own_int8_steps(), rt.int8_passes());
                println!(
                    "{what}: {steps} int8 steps in the own kernel ({kernel:?}), {passes} values \
                     passed in int8, {frames} frames, against cuBLASLt's path"
                );
                assert_eq!(
                    steps,
                    done.nodes.len(),
                    "{what}, {kernel:?}: own-kernel steps"
                );
                if model.ends_with("ops.onnx") || model.ends_with("resnet50.onnx") {
                    assert!(passes > 0, "{what}, {kernel:?}: no value passed in int8");
                }
                let same = |got: &[f32], how: &str| {
                    let differ = (got.iter().zip(&library))
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(
                        differ,
                        0,
                        "{what}, {kernel:?}{how}: {differ} of {} scores differ",
                        got.len()
                    );
                };
                same(rt.run(&input, frames).expect("inference"), "");
                // Step by step, each output read back (in the plan's type, nothing passed in
                // int8), then the graphs again.
                let overflow = rt
                    .first_overflow(frames, f32::MAX)
                    .expect("a step-by-step run");
                assert!(overflow.is_none(), "{what}, {kernel:?}: {overflow:?}");
                same(
                    rt.run(&input, frames).expect("inference"),
                    ", after a step-by-step run",
                );
            }
        }
    }
}

/// Bytes read by this thread so far (its `rchar`): the engine reads the model and the engine
/// file on the thread that builds it, so other tests running meanwhile do not count.
fn thread_read_bytes() -> u64 {
    let io = std::fs::read_to_string("/proc/thread-self/io").expect("/proc/thread-self/io");
    io.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .and_then(|n| n.parse().ok())
        .expect("rchar")
}

/// A start that finds its engine file knows the model by what was remembered of it (its
/// digest, its input): it reads the engine file, not the model, until the model changes.
#[test]
fn a_cached_start_does_not_read_the_model() {
    const TEST: &str = "a_cached_start_does_not_read_the_model";
    if !gpu(TEST) {
        return;
    }
    let Ok(exports) = std::env::var("TRTCLASSIFY_TORCHVISION_DIR") else {
        skipped(&format!("{TEST}: TRTCLASSIFY_TORCHVISION_DIR is not set"));
        return;
    };
    // ResNet-50: 98 MB of ONNX, an fp16 engine file of about half that.
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("resnet50.onnx");
    std::fs::copy(std::path::Path::new(&exports).join("resnet50.onnx"), &model)
        .expect("resnet50.onnx among the exports");
    let mut o = options(model.to_str().unwrap(), 2, Precision::Fp16);
    o.engine_location = Some(dir.path().join("resnet50.engine"));
    let built = CudaEngine::build(&o).expect("first build");
    assert!(!built.info().engine_file.as_ref().unwrap().loaded);
    drop(built);
    let model_len = std::fs::metadata(&model).unwrap().len();
    let engine_len = std::fs::metadata(o.engine_location.as_ref().unwrap())
        .unwrap()
        .len();
    let start = |what: &str| {
        let before = thread_read_bytes();
        let engine = CudaEngine::build(&o).unwrap_or_else(|e| panic!("{what}: {e}"));
        let read = thread_read_bytes() - before;
        assert!(
            engine.info().engine_file.as_ref().unwrap().loaded,
            "{what}: the engine file is not used"
        );
        println!("{what}: read {read} bytes (model {model_len}, engine file {engine_len})");
        read
    };
    let read = start("cached start");
    assert!(
        read < engine_len + model_len / 4,
        "a cached start read {read} bytes: the model ({model_len}) as well as the engine file ({engine_len})"
    );
    // The model touched: what was remembered of it no longer holds, so it is read (and
    // hashed) again; its bytes are the same, and so is its engine.
    std::fs::File::options()
        .write(true)
        .open(&model)
        .unwrap()
        .set_modified(std::time::SystemTime::now())
        .unwrap();
    let read = start("the model touched");
    assert!(
        read >= engine_len + model_len,
        "after the model changed, a start read {read} bytes: not the model ({model_len}) and the engine file ({engine_len})"
    );
    assert!(start("cached again") < engine_len + model_len / 4);
}

/// A smooth test picture (gradients, so that resamplers agree to a level or two) in `format`,
/// converted from RGB by GStreamer.
fn picture(
    format: gst_video::VideoFormat,
    width: u32,
    height: u32,
) -> (gst::Buffer, gst_video::VideoInfo) {
    let rgb_info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Rgb, width, height)
        .build()
        .unwrap();
    let mut rgb = gst::Buffer::with_size(rgb_info.size()).unwrap();
    {
        let mut frame =
            gst_video::VideoFrameRef::from_buffer_ref_writable(rgb.get_mut().unwrap(), &rgb_info)
                .unwrap();
        let stride = frame.plane_stride()[0] as usize;
        let data = frame.plane_data_mut(0).unwrap();
        for y in 0..height as usize {
            for x in 0..width as usize {
                let px = &mut data[y * stride + x * 3..][..3];
                px[0] = (x * 255 / width as usize) as u8;
                px[1] = (y * 255 / height as usize) as u8;
                px[2] = 255 - (((x + y) * 255) / (width + height) as usize) as u8;
            }
        }
    }
    convert(&rgb, &rgb_info, format)
}

/// An RGB frame converted to `format` by GStreamer.
fn convert(
    rgb: &gst::Buffer,
    rgb_info: &gst_video::VideoInfo,
    format: gst_video::VideoFormat,
) -> (gst::Buffer, gst_video::VideoInfo) {
    let info = gst_video::VideoInfo::builder(format, rgb_info.width(), rgb_info.height())
        .build()
        .unwrap();
    let mut out = gst::Buffer::with_size(info.size()).unwrap();
    let converter = gst_video::VideoConverter::new(rgb_info, &info, None).unwrap();
    {
        let src =
            gst_video::VideoFrameRef::from_buffer_ref_readable(rgb.as_ref(), rgb_info).unwrap();
        let mut dst =
            gst_video::VideoFrameRef::from_buffer_ref_writable(out.get_mut().unwrap(), &info)
                .unwrap();
        converter.frame_ref(&src, &mut dst);
    }
    (out, info)
}

/// How far a model input is from `truth`: the largest and the mean absolute difference.
fn off_by(input: &[f32], truth: &[f32]) -> (f32, f32) {
    assert_eq!(input.len(), truth.len(), "a model input and its truth");
    let d: Vec<f32> = input
        .iter()
        .zip(truth)
        .map(|(a, b)| (a - b).abs())
        .collect();
    (
        d.iter().copied().fold(0.0, f32::max),
        d.iter().sum::<f32>() / d.len() as f32,
    )
}

/// Regions (`roi=regions`) are cropped on the GPU as on the CPU: odd offsets and sizes, in
/// every kind of format (packed, 4:2:0 with chroma shared across a crop's edge, 10-bit), in
/// each resize mode; one frame's crops pushed together land in order, across model batches.
#[test]
fn gpu_region_crops_match_the_cpu() {
    use gst_video::VideoFormat::*;
    use gsttrtclassify::preprocess::{Preprocessor, Rect, ResizeMode};
    if !gpu("gpu_region_crops_match_the_cpu") {
        return;
    }
    let regions = [
        Rect {
            x: 3,
            y: 5,
            w: 17,
            h: 13,
        },
        Rect {
            x: 101,
            y: 37,
            w: 64,
            h: 151,
        },
        Rect {
            x: 0,
            y: 0,
            w: 320,
            h: 240,
        },
        Rect {
            x: 318,
            y: 239,
            w: 2,
            h: 1,
        },
        // Clipped to the frame: 20×40 at 300,200.
        Rect {
            x: 300,
            y: 200,
            w: 50,
            h: 90,
        },
    ];
    for mode in [
        ResizeMode::Stretch,
        ResizeMode::Letterbox,
        ResizeMode::CenterCrop,
    ] {
        let mut o = options(&common::model("colors.onnx"), 4, Precision::Fp32);
        o.preprocess.resize = mode;
        let mut gpu = CudaEngine::build(&o).unwrap();
        let mut cpu = CpuEngine::build(&o).unwrap();
        let spec = gpu.info().input;
        let mut pre = Preprocessor::new(o.preprocess.clone(), spec).unwrap();
        // The picture as RGB: the truth that each format's frame stands for.
        let (truth_buffer, truth_info) = picture(Rgb, 320, 240);
        let truth_frame =
            gst_video::VideoFrameRef::from_buffer_ref_readable(truth_buffer.as_ref(), &truth_info)
                .unwrap();
        let truth_frame = gsttrtclassify::video::view(&truth_frame).unwrap();
        for format in [Rgb, Bgrx, Nv12, I420, P01010le] {
            let (buffer, info) = picture(format, 320, 240);
            let frame =
                gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), &info).unwrap();
            let frames = [gsttrtclassify::video::view(&frame).unwrap()];
            let mut alone = Vec::new();
            for r in regions {
                let what = format!("{mode:?} {format:?} {r:?}");
                let crop = [Crop::Region(r)];
                let got = gpu
                    .gpu_preprocess(&frames, &crop)
                    .unwrap()
                    .unwrap_or_else(|| panic!("{what}: not preprocessed on the GPU"));
                let mut truth = vec![0.0; spec.frame_len()];
                pre.run(&truth_frame, &crop, &mut truth).unwrap();
                let mut cpu_input = vec![0.0; spec.frame_len()];
                pre.run(&frames[0], &crop, &mut cpu_input).unwrap();
                let ((max, mean), (_, cpu_mean)) =
                    (off_by(&got, &truth), off_by(&cpu_input, &truth));
                // As in `gpu_preprocessing_matches_the_cpu`: off the picture by a few 8-bit
                // levels (≈ 0.017 each) at most, or no farther than the CPU path plus about
                // half a level (a crop of a few pixels of a 4:2:0 frame holds one or two
                // chroma samples, which the two paths upsample differently).
                assert!(
                    max <= 0.25 && (mean <= 0.03 || mean <= cpu_mean + 0.01),
                    "{what}: off the picture by max {max:.3}, mean {mean:.4} (CPU path: mean {cpu_mean:.4})"
                );
                alone.push(got);
            }
            // A batch's crops of all sizes go through one launch (a job each, the grid fitting
            // the largest): each lands in its slot exactly as when preprocessed alone.
            let four: Vec<Crop> = regions[..4].iter().map(|&r| Crop::Region(r)).collect();
            let together = gpu.gpu_preprocess(&frames, &four).unwrap().unwrap();
            assert!(
                together == alone[..4].concat(),
                "{mode:?} {format:?}: crops preprocessed together differ from each alone"
            );
            // All crops of the frame in one push (5 crops, batches of 4): each crop's scores,
            // in order, as the CPU backend gives them. Packed formats only: from YUV the two
            // paths' inputs differ by chroma upsampling (checked above), which on this
            // gradient moves the colour model's near ties.
            if !matches!(format, Rgb | Bgrx) {
                continue;
            }
            let crops: Vec<Crop> = regions.iter().map(|&r| Crop::Region(r)).collect();
            gpu.push(&frames[0], &crops).unwrap();
            let g = gpu.run_pushed().unwrap();
            cpu.push(&frames[0], &crops).unwrap();
            let c = cpu.run_pushed().unwrap();
            assert_eq!((g.len(), c.len()), (5, 5));
            for (i, (g, c)) in g.iter().zip(&c).enumerate() {
                compare(&format!("{mode:?} {format:?} crop {i}"), g, c, 0.1, 0.1);
            }
        }
    }
}

/// The GPU preprocessing makes the same model input as the CPU one (to a few pixel levels:
/// the CPU rounds to 8 bits after each stage, and resamples chroma in its own grid), for every
/// format, resize mode and layout; and the scores from raw frames agree with the CPU backend.
#[test]
fn gpu_preprocessing_matches_the_cpu() {
    use gst_video::VideoFormat::*;
    use gsttrtclassify::preprocess::{Preprocessor, ResizeMode};
    if !gpu("gpu_preprocessing_matches_the_cpu") {
        return;
    }
    let mut report = Vec::new();
    for model in ["colors.onnx", "colors_nhwc.onnx", "cnn.onnx"] {
        for mode in [
            ResizeMode::Stretch,
            ResizeMode::Letterbox,
            ResizeMode::CenterCrop,
        ] {
            let mut o = options(&common::model(model), 4, Precision::Fp16);
            o.preprocess.resize = mode;
            let mut gpu = CudaEngine::build(&o).unwrap_or_else(|e| panic!("{model}: {e}"));
            let mut cpu = CpuEngine::build(&o).unwrap();
            let spec = gpu.info().input;
            let mut pre = Preprocessor::new(o.preprocess.clone(), spec).unwrap();
            for (w, h) in [(320, 240), (1920, 1080), (34, 18)] {
                // The picture as RGB: the truth that each format's frame stands for.
                let (truth_buffer, truth_info) = picture(Rgb, w, h);
                let truth_frame = gst_video::VideoFrameRef::from_buffer_ref_readable(
                    truth_buffer.as_ref(),
                    &truth_info,
                )
                .unwrap();
                let truth_frame = gsttrtclassify::video::view(&truth_frame).unwrap();
                let mut truth = vec![0.0; spec.frame_len()];
                pre.run(&truth_frame, &[Crop::Whole], &mut truth).unwrap();
                let truth_scores = cpu.classify(&[truth_frame]).unwrap();
                // The GPU's scores from NV12 (which comes before P010 below).
                let mut nv12_off = f32::NAN;
                for format in [
                    Rgb, Bgr, Rgbx, Bgrx, Xrgb, Xbgr, Rgba, Bgra, Nv12, I420, P01010le,
                ] {
                    let (buffer, info) = picture(format, w, h);
                    let frame =
                        gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), &info)
                            .unwrap();
                    let frames = [gsttrtclassify::video::view(&frame).unwrap()];
                    let got = gpu
                        .gpu_preprocess(&frames, &[Crop::Whole])
                        .unwrap()
                        .unwrap_or_else(|| panic!("{format:?}: not preprocessed on the GPU"));
                    let mut cpu_input = vec![0.0; spec.frame_len()];
                    pre.run(&frames[0], &[Crop::Whole], &mut cpu_input).unwrap();
                    let ((max, mean), (_, cpu_mean)) =
                        (off_by(&got, &truth), off_by(&cpu_input, &truth));
                    let what = format!("{model} {mode:?} {format:?} {w}x{h}");
                    // One 8-bit level is 1/255/std ≈ 0.017 here. YUV frames lose some colour
                    // to 4:2:0 and 8-bit rounding. The CPU path resamples NV12 and I420 in
                    // 8 bits before converting them (0.7–1.4 levels off such a picture in
                    // `video.rs`'s test), and P010 through GStreamer's converter; the GPU
                    // converts each sample in floats (0.6 levels off in NV12).
                    assert!(
                        max <= 0.2 && mean <= 0.03 && mean <= cpu_mean + 0.01,
                        "{what}: off the picture by max {max:.3}, mean {mean:.4} (CPU path: mean {cpu_mean:.4})"
                    );
                    report.push((mean, cpu_mean, what.clone()));
                    // Scores: those of the CPU backend on the same frame for RGB formats; for
                    // YUV, whose colours differ from the picture's, the truth's top-1 and no
                    // farther from the truth's scores than the CPU backend's (+ fp16 rounding).
                    let g = gpu.classify(&frames).unwrap();
                    let c = cpu.classify(&frames).unwrap();
                    if matches!(format, Nv12 | I420 | P01010le) {
                        let off = |s: &[f32]| {
                            assert_eq!(s.len(), truth_scores[0].len(), "{what}: classes");
                            s.iter()
                                .zip(&truth_scores[0])
                                .map(|(a, b)| (a - b).abs())
                                .fold(0.0f32, f32::max)
                        };
                        let (ours, theirs) = (off(&g[0]), off(&c[0]));
                        // The CPU path reads P010 (through GStreamer's converter) closer
                        // to the picture than NV12; there the bar is also what the GPU gets
                        // from the same picture in NV12, which P010's two more bits must
                        // not make worse.
                        let bar = match format {
                            P01010le => theirs.max(nv12_off),
                            _ => theirs,
                        };
                        assert!(
                            ours <= bar + 2e-2,
                            "{what}: scores off the picture's by {ours:.3}, the CPU backend's by {theirs:.3}, the GPU's from NV12 by {nv12_off:.3}"
                        );
                        if format == Nv12 {
                            nv12_off = ours;
                        }
                        compare(&what, &g[0], &truth_scores[0], 0.1, 0.1);
                    } else {
                        compare(&what, &g[0], &c[0], 2e-2, 2e-2);
                    }
                }
            }
        }
    }
    report.sort_by(|a, b| b.0.total_cmp(&a.0));
    for (mean, cpu_mean, what) in report.iter().take(5) {
        println!(
            "preprocessing off the true picture, largest: {what}: GPU mean {mean:.4}, CPU mean {cpu_mean:.4}"
        );
    }
}

/// Frames pushed one by one in mixed formats (preprocessed on the GPU, or on the CPU for
/// GRAY8), across full and partial batches, come back in order with the CPU backend's
/// results; a discard forgets the frames pushed before it.
#[test]
fn pushed_frames_match_the_cpu_in_order() {
    use gst_video::VideoFormat::*;
    if !gpu("pushed_frames_match_the_cpu_in_order") {
        return;
    }
    let path = common::model("colors.onnx");
    let mut cpu = CpuEngine::build(&options(&path, 1, Precision::Fp32)).expect("cpu engine");
    let mut gpu = CudaEngine::build(&options(&path, 4, Precision::Fp16)).expect("cuda engine");
    assert_eq!(gpu.info().model_batch, 4);
    let rgb_info = gst_video::VideoInfo::builder(Rgb, 64, 48).build().unwrap();
    let formats = [Rgb, Nv12, Bgrx, Gray8, I420];
    let frames: Vec<(gst::Buffer, gst_video::VideoInfo)> = (0..11)
        .map(|i| {
            let rgb = common::solid_rgb(64, 48, common::COLORS[i % 6].1, i as u64);
            convert(&rgb, &rgb_info, formats[i % formats.len()])
        })
        .collect();
    let mapped: Vec<_> = frames
        .iter()
        .map(|(buffer, info)| {
            gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), info).unwrap()
        })
        .collect();
    let frame = |i: usize| gsttrtclassify::video::view(&mapped[i]).unwrap();
    // Discarded with two batches in flight and one gathering.
    for i in [3, 1, 4, 1, 5, 9, 2, 6, 5] {
        gpu.push(&frame(i), &[Crop::Whole]).expect("push");
    }
    assert_eq!(gpu.pending(), 9);
    gpu.discard();
    assert_eq!(gpu.pending(), 0);
    // 11 frames: two full batches of 4 launched as they are pushed (running while the next
    // gather; what finished is taken on the way), 3 at the end.
    let mut got = Vec::new();
    for i in 0..11 {
        gpu.push(&frame(i), &[Crop::Whole]).expect("push");
        if i == 9 {
            let ready = gpu.take_ready().expect("ready");
            assert!(
                [0, 4, 8].contains(&ready.scores.len()),
                "whole batches: {}",
                ready.scores.len()
            );
            assert_eq!(ready.batches * 4, ready.scores.len());
            got.extend(ready.scores);
        }
    }
    got.extend(gpu.run_pushed().expect("run"));
    assert_eq!(
        got.len(),
        11,
        "one result per frame pushed since the discard"
    );
    for (i, g) in got.iter().enumerate() {
        let want = cpu.classify(&[frame(i)]).expect("cpu");
        let what = format!("frame {i} ({:?})", formats[i % formats.len()]);
        compare(&what, g, &want[0], 2e-2, 2e-2);
        if formats[i % formats.len()] != Gray8 {
            assert_eq!(top(g, 1)[0], i % 6, "{what}: its colour");
        }
    }
    assert!(gpu.run_pushed().expect("run").is_empty(), "all run");
}

/// Batches in flight keep their frames: 1080p frames at batch 32 take about 11 preprocessing
/// launches a batch, more than the job arrays used in turn, while two batches run, and the
/// fourth batch waits for the first; NV12 and RGB frames through the page-locked staging,
/// reused for each batch while the one before runs. Each frame's colour comes back in its
/// place.
#[test]
fn batches_in_flight_keep_their_frames() {
    use gst_video::VideoFormat::*;
    if !gpu("batches_in_flight_keep_their_frames") {
        return;
    }
    let path = common::model("colors.onnx");
    let mut gpu = CudaEngine::build(&options(&path, 32, Precision::Fp16)).expect("cuda engine");
    assert_eq!(
        gpu.info().batches_in_flight,
        cuda::runtime::IN_FLIGHT + 1,
        "batches run while the next gathers"
    );
    let rgb_info = gst_video::VideoInfo::builder(Rgb, 1920, 1080)
        .build()
        .unwrap();
    // Six colours, each in NV12 and in RGB.
    let frames: Vec<(gst::Buffer, gst_video::VideoInfo)> = (0..6)
        .flat_map(|c| {
            let rgb = common::solid_rgb(1920, 1080, common::COLORS[c].1, c as u64);
            [
                convert(&rgb, &rgb_info, Nv12),
                (rgb.clone(), rgb_info.clone()),
            ]
        })
        .collect();
    let mapped: Vec<_> = frames
        .iter()
        .map(|(buffer, info)| {
            gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), info).unwrap()
        })
        .collect();
    // Frame i: colour (i * 5) % 6, NV12 or RGB.
    let colour = |i: usize| (i * 5) % 6;
    let n = 32 * 4 + 7;
    let mut got = Vec::new();
    for i in 0..n {
        let view = gsttrtclassify::video::view(&mapped[colour(i) * 2 + i % 2]).unwrap();
        gpu.push(&view, &[Crop::Whole]).expect("push");
        if i % 40 == 39 {
            got.extend(gpu.take_ready().expect("ready").scores);
        }
    }
    got.extend(gpu.run_pushed().expect("run"));
    assert_eq!(got.len(), n, "one result per frame");
    for (i, g) in got.iter().enumerate() {
        assert_eq!(top(g, 1)[0], colour(i), "frame {i}: its colour");
    }
}

/// Whether GStreamer's CUDA elements (`cudaupload`, from gst-plugins-bad's nvcodec) and its
/// CUDA library are here; prints why not.
fn cuda_elements(test: &str) -> bool {
    if !gpu(test) {
        return false;
    }
    let reason = gsttrtclassify::cudamem::unavailable_reason()
        .map(str::to_owned)
        .or_else(|| {
            gst::ElementFactory::find("cudaupload")
                .is_none()
                .then(|| "no cudaupload element (gst-plugins-bad's nvcodec)".to_owned())
        });
    runs(test, reason)
}

fn in_cuda_memory(caps: &Option<gst::Caps>) -> bool {
    caps.as_ref()
        .and_then(|c| c.features(0))
        .is_some_and(|f| f.contains(gsttrtclassify::cudamem::CAPS_FEATURE))
}

/// Top-5 of two runs of the same frames: each class both report within `tol`, and the same
/// top-1 but for a near tie (the other's top-1 within `tol` of it).
fn same_results(what: &str, got: &[Classification], want: &[Classification], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: frame counts");
    assert!(!got.is_empty(), "{what}: no frames came out");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.frame, w.frame, "{what}: order");
        assert_eq!(
            g.classes.len(),
            w.classes.len(),
            "{what}: frame {}",
            g.frame
        );
        let confidence = |r: &Classification, id: u32| {
            r.classes
                .iter()
                .find(|c| c.class_id == id)
                .map(|c| c.confidence)
        };
        for a in &g.classes {
            if let Some(b) = confidence(w, a.class_id) {
                assert!(
                    (a.confidence - b).abs() <= tol,
                    "{what}: frame {}: class {} {} against {b}",
                    g.frame,
                    a.class_id,
                    a.confidence
                );
            }
        }
        let (gt, wt) = (&g.classes[0], &w.classes[0]);
        let tie = confidence(w, gt.class_id).is_some_and(|c| wt.confidence - c <= tol);
        assert!(
            gt.class_id == wt.class_id || tie,
            "{what}: frame {}: top-1 {gt:?} against {wt:?}",
            g.frame
        );
    }
}

use gsttrtclassify::meta::Classification;

/// Frames in CUDA memory (through `cudaupload`) are read where they are and give what the
/// same frames in system memory give, for every format both the GPU preprocessing and
/// `cudaupload` take.
#[test]
fn cuda_memory_input_matches_system_memory() {
    if !cuda_elements("cuda_memory_input_matches_system_memory") {
        return;
    }
    let upload_caps = gst::ElementFactory::find("cudaupload")
        .unwrap()
        .static_pad_templates()
        .into_iter()
        .find(|t| t.direction() == gst::PadDirection::Src)
        .unwrap()
        .caps();
    let model = common::model("cnn.onnx");
    let mut tested = Vec::new();
    for format in [
        "NV12",
        "I420",
        "P010_10LE",
        "RGBA",
        "BGRA",
        "RGBx",
        "BGRx",
        "RGB",
        "BGR",
    ] {
        let probe: gst::Caps = format!("video/x-raw(memory:CUDAMemory),format={format}")
            .parse()
            .unwrap();
        if !upload_caps.can_intersect(&probe) {
            continue;
        }
        let element = |id: &str| {
            format!(
                "trtclassify backend=cuda onnx-location={model} top-k=5 batch-size=4 \
                 model-instance-id={id}-{format}"
            )
        };
        let description = format!(
            "videotestsrc num-buffers=10 pattern=ball ! \
             video/x-raw,format={format},width=322,height=242 ! tee name=t \
             t. ! queue ! cudaupload ! video/x-raw(memory:CUDAMemory) ! {} ! \
                 appsink name=device sync=false \
             t. ! queue ! {} ! appsink name=system sync=false",
            element("device"),
            element("system")
        );
        let runs = common::run_pipeline_sinks(&description, &["device", "system"])
            .unwrap_or_else(|e| panic!("{format}: {e}"));
        let (device, system) = (&runs[0], &runs[1]);
        assert!(in_cuda_memory(&device.1), "{format}: {:?}", device.1);
        assert!(!in_cuda_memory(&system.1), "{format}: {:?}", system.1);
        assert_eq!(device.0.len(), 10, "{format}");
        same_results(format, &device.0, &system.0, 2e-3);
        tested.push(format);
    }
    eprintln!("cuda memory formats tested: {tested:?}");
    for needed in ["NV12", "I420", "RGBA", "BGRx"] {
        assert!(
            tested.contains(&needed),
            "{needed} was not tested: {tested:?}"
        );
    }
}

/// NVIDIA's decoders feed the element in CUDA memory: every committed clip (H.264, H.265 8-
/// and 10-bit, VP9, AV1; `tests/clips/make.sh`) gives each frame its colour, in the format
/// the decoder gives (NV12, P010 for 10-bit video), and through `cudaconvert` to RGBA; the
/// frames stay in CUDA memory.
#[test]
fn nvidia_decoders_feed_the_element_in_cuda_memory() {
    if !cuda_elements("nvidia_decoders_feed_the_element_in_cuda_memory") {
        return;
    }
    let mut tested = Vec::new();
    for (clip, demux, decoder, format) in [
        ("h264.mp4", "qtdemux ! h264parse", "nvh264dec", "NV12"),
        ("h265.mp4", "qtdemux ! h265parse", "nvh265dec", "NV12"),
        (
            "h265-10bit.mp4",
            "qtdemux ! h265parse",
            "nvh265dec",
            "P010_10LE",
        ),
        ("vp9.mkv", "matroskademux ! vp9parse", "nvvp9dec", "NV12"),
        ("av1.mkv", "matroskademux ! av1parse", "nvav1dec", "NV12"),
    ] {
        if gst::ElementFactory::find(decoder).is_none() {
            common::skipped(&format!("{clip}: no {decoder} here"));
            continue;
        }
        // GStreamer's CUDA filters need an NVRTC it knows (1.22 knows none of CUDA 13's).
        let convert = match gst::ElementFactory::find("cudaconvert") {
            Some(_) => Some((
                "cudaconvert ! video/x-raw(memory:CUDAMemory),format=RGBA ! ",
                "RGBA",
            )),
            None => {
                common::skipped(&format!(
                    "{clip}: cudaconvert, which this GStreamer does not have here"
                ));
                None
            }
        };
        for (convert, format) in std::iter::once(("", format)).chain(convert) {
            let what = format!("{clip} {decoder} {convert}{format}");
            let runs = common::run_pipeline_sinks(
                &format!(
                    "filesrc location={} ! {demux} ! {decoder} ! {convert}{} ! \
                     appsink name=sink sync=false",
                    common::clip(clip),
                    common::colors_element("backend=cuda batch-size=4 top-k=1")
                ),
                &["sink"],
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let (results, caps) = &runs[0];
            assert!(in_cuda_memory(caps), "{what}: {caps:?}");
            let got = caps
                .as_ref()
                .and_then(|c| c.structure(0)?.get::<String>("format").ok());
            assert_eq!(got.as_deref(), Some(format), "{what}");
            common::assert_clip_colours(&what, results);
            tested.push(what);
        }
    }
    eprintln!("decoders tested: {tested:?}");
    assert!(
        tested.iter().any(|t| t.contains("P010")),
        "10-bit video was not tested: {tested:?}"
    );
}

/// Four streams in CUDA memory sharing one engine (frames of all of them in each batch)
/// get the results each stream gets alone, and the colour model names each stream's colour.
#[test]
fn streams_sharing_a_gpu_engine_agree_with_each_alone() {
    if !cuda_elements("streams_sharing_a_gpu_engine_agree_with_each_alone") {
        return;
    }
    let patterns = ["ball", "smpte", "checkers-8", "zone-plate"];
    let branch = |i: usize, pattern: &str, id: &str| {
        format!(
            "videotestsrc num-buffers=24 pattern={pattern} ! \
             video/x-raw,format=NV12,width=640,height=360 ! cudaupload ! \
             video/x-raw(memory:CUDAMemory) ! trtclassify backend=cuda onnx-location={} top-k=5 batch-size=8 batch-timeout=20 \
                 model-instance-id={id} ! appsink name=sink{i} sync=false ",
            common::model("cnn.onnx")
        )
    };
    let names: Vec<String> = (0..patterns.len()).map(|i| format!("sink{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let shared: String = patterns
        .iter()
        .enumerate()
        .map(|(i, p)| branch(i, p, "shared"))
        .collect();
    let shared = common::run_pipeline_sinks(&shared, &names).expect("shared run");
    for (i, pattern) in patterns.iter().enumerate() {
        let alone =
            common::run_pipeline_sinks(&branch(0, pattern, &format!("alone-{i}")), &["sink0"])
                .expect("run alone");
        assert!(in_cuda_memory(&shared[i].1));
        same_results(pattern, &shared[i].0, &alone[0].0, 1e-2);
    }

    let colours = ["red", "green", "blue", "white"];
    let description: String = colours
        .iter()
        .enumerate()
        .map(|(i, c)| {
            format!(
                "videotestsrc num-buffers=17 pattern={c} ! video/x-raw,format=NV12,width=320,height=240 ! \
                 cudaupload ! video/x-raw(memory:CUDAMemory) ! {} ! appsink name=sink{i} sync=false ",
                common::colors_element(
                    "backend=cuda batch-size=8 batch-timeout=20 top-k=1 model-instance-id=colours"
                )
            )
        })
        .collect();
    let runs = common::run_pipeline_sinks(&description, &names).expect("colour streams");
    assert_eq!(runs.len(), colours.len(), "one run per colour");
    for (colour, (results, caps)) in colours.iter().zip(&runs) {
        assert!(in_cuda_memory(caps));
        assert_eq!(results.len(), 17, "{colour}");
        for r in results {
            assert_eq!(
                r.top().unwrap().label,
                *colour,
                "frame {} of the {colour} stream",
                r.frame
            );
        }
    }
}

/// The GPU each element's engine runs on, from its `stats`.
fn placed_gpus(pipeline: &gst::Pipeline, names: &[String]) -> Vec<u32> {
    names
        .iter()
        .map(|name| {
            let element = pipeline.by_name(name).expect("named element");
            let stats = element.property::<gst::Structure>("stats");
            stats
                .get::<u32>("gpu")
                .unwrap_or_else(|_| panic!("{name}: no gpu in {stats}"))
        })
        .collect()
}

/// With `gpu-id=-1` (the default) on a machine of several GPUs, elements fed from system
/// memory spread evenly over the GPUs, and an element fed by a GPU's NVDEC decoder
/// (`nvh264dec` for GPU 0, `nvh264deviceNdec` for GPU N) classifies on that GPU, with the
/// clip's colours.
#[test]
fn elements_run_on_their_frames_gpu_or_spread_over_the_gpus() {
    let test = "elements_run_on_their_frames_gpu_or_spread_over_the_gpus";
    if !cuda_elements(test) {
        return;
    }
    let gpus = cuda::gpu_count();
    if gpus < 2 {
        skipped(&format!(
            "{test}: {gpus} GPU here, the test needs 2 or more"
        ));
        return;
    }
    let element = common::colors_element("backend=cuda batch-size=4 top-k=1");
    let names: Vec<String> = (0..2 * gpus).map(|i| format!("c{i}")).collect();
    let launch: String = names
        .iter()
        .map(|name| {
            format!(
                "videotestsrc num-buffers=8 pattern=blue ! video/x-raw,format=NV12,width=64,height=48 ! \
                 {element} name={name} ! fakesink "
            )
        })
        .collect();
    let pipeline = common::launch(&launch);
    common::run_to_eos(&pipeline).expect("system-memory branches");
    let mut per_gpu = vec![0; gpus];
    for gpu in placed_gpus(&pipeline, &names) {
        per_gpu[gpu as usize] += 1;
    }
    pipeline.set_state(gst::State::Null).unwrap();
    assert_eq!(per_gpu, vec![2; gpus], "two elements a GPU");

    let mut decoders = Vec::new();
    let mut launch = String::new();
    for gpu in 0..gpus {
        let decoder = match gpu {
            0 => "nvh264dec".to_owned(),
            n => format!("nvh264device{n}dec"),
        };
        if gst::ElementFactory::find(&decoder).is_none() {
            skipped(&format!("{test}: no {decoder} here"));
            continue;
        }
        launch += &format!(
            "filesrc location={} ! qtdemux ! h264parse ! {decoder} ! queue ! {element} name=d{gpu} ! \
             fakesink ",
            common::clip("h264.mp4")
        );
        decoders.push(gpu as u32);
    }
    if decoders.len() < 2 {
        return;
    }
    let names: Vec<String> = decoders.iter().map(|g| format!("d{g}")).collect();
    let pipeline = common::launch(&launch);
    common::run_to_eos(&pipeline).expect("decoder branches");
    assert_eq!(
        placed_gpus(&pipeline, &names),
        decoders,
        "each on its decoder's GPU"
    );
    for name in &names {
        let stats = pipeline
            .by_name(name)
            .unwrap()
            .property::<gst::Structure>("stats");
        let frames = stats.get::<u64>("frames-in").unwrap();
        assert!(frames > 0, "{name}: {stats}");
        assert_eq!(
            stats.get::<u64>("classified").unwrap(),
            frames,
            "{name}: {stats}"
        );
    }
    pipeline.set_state(gst::State::Null).unwrap();
}

/// `precision=int8` without `calibration-location`: the element classifies in fp16 while it
/// calibrates on its stream's first frames, says so, then moves to the int8 engine without
/// losing a frame; the next start finds the table in the cache and builds int8 at once.
#[test]
fn int8_without_a_table_calibrates_on_the_stream() {
    use gst::prelude::*;
    if !gpu("int8_without_a_table_calibrates_on_the_stream") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // A model file of its own: the cached table is named by the model's path and time, so
    // each run of this test calibrates afresh. `min-agreement=0`: the test pattern's frames
    // are no digits, and the accuracy guard is not what this test checks.
    let model = dir.path().join("digits.onnx");
    std::fs::copy(common::model("digits/digits.onnx"), &model).unwrap();
    let launch = |source: &str| {
        let pipeline = gst::parse::launch(&format!(
            "{source} ! video/x-raw,width=64,height=64,framerate=30/1 ! trtclassify name=c \
             backend=cuda precision=int8 calibration-frames=16 min-agreement=0 max-lateness=-1 \
             onnx-location={} \
             ! fakesink sync=false",
            model.display()
        ))
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
        let element = pipeline.by_name("c").unwrap();
        (pipeline, element)
    };
    let stats = |element: &gst::Element| element.property::<gst::Structure>("stats");
    let field = |s: &gst::Structure, name: &str| s.get::<String>(name).unwrap_or_default();
    let count = |s: &gst::Structure, name: &str| s.get::<u64>(name).unwrap_or(0);

    let (pipeline, element) = launch("videotestsrc is-live=true pattern=ball");
    let bus = pipeline.bus().unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let (mut infos, mut precisions) = (Vec::new(), Vec::new());
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "int8 within 2 minutes: {infos:?}, {precisions:?}"
        );
        if let Some(msg) = bus.timed_pop(gst::ClockTime::from_mseconds(100)) {
            match msg.view() {
                // The element's text is the message's debug part, as for its warnings.
                gst::MessageView::Info(i) => infos.push(i.debug().unwrap_or_default().to_string()),
                gst::MessageView::Error(_) | gst::MessageView::Warning(_) => {
                    panic!("{}", common::message_text(&msg))
                }
                _ => (),
            }
        }
        let s = stats(&element);
        let precision = field(&s, "precision");
        if precisions.last() != Some(&precision) {
            precisions.push(precision.clone());
        }
        if precision == "int8" {
            break;
        }
    }
    pipeline.send_event(gst::event::Eos::new());
    let ended = bus.timed_pop_filtered(
        gst::ClockTime::from_seconds(30),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    assert!(matches!(
        ended.as_ref().map(|m| m.view()),
        Some(gst::MessageView::Eos(_))
    ));
    let s = stats(&element);
    pipeline.set_state(gst::State::Null).unwrap();
    eprintln!("stream calibration: {infos:?}; precision {precisions:?}; {s}");
    assert_eq!(precisions, ["fp16", "int8"], "{infos:?}");
    assert!(
        infos
            .iter()
            .any(|m| m.contains("fp16 while calibrating on 16 frames")),
        "{infos:?}"
    );
    assert!(
        infos
            .iter()
            .any(|m| m.contains("on 16 frames of the stream")),
        "{infos:?}"
    );
    assert_eq!(count(&s, "model-updates"), 1, "{s}");
    let frames_in = count(&s, "frames-in");
    assert!(frames_in > 16, "{s}");
    assert_eq!(count(&s, "frames-out"), frames_in, "no frame lost: {s}");

    // The next start: int8 from the first frame, the table found.
    let (pipeline, element) = launch("videotestsrc num-buffers=30 pattern=ball");
    common::run_to_eos(&pipeline).unwrap();
    let s = stats(&element);
    pipeline.set_state(gst::State::Null).unwrap();
    assert_eq!(field(&s, "precision"), "int8", "{s}");
    assert_eq!(count(&s, "model-updates"), 0, "{s}");
    assert_eq!(count(&s, "frames-out"), 30, "{s}");
}
