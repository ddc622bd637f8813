// SPDX-License-Identifier: MPL-2.0
//! Quantized plans against onnxruntime running the same quantization (a QDQ model made by
//! `models/digits/quantized_reference.py` from the committed calibration table), and the
//! pieces of calibration on their own.

use std::sync::Arc;

use super::*;
use crate::ir::Act;
use crate::plan::{DType, GemmStep};
use crate::testing::{Digits, assert_close, digits_calibration, digits_heldout, models};
use crate::{OnnxModel, sim};

/// The digits classifier's fp32 plan for one frame.
fn digits_plan() -> (Plan, Weights) {
    let model = OnnxModel::load(&models().join("digits/digits.onnx")).expect("digits.onnx");
    let spec = model.input_spec(None).expect("an image input");
    let (mut plans, weights) = crate::compile(&model, &[1], spec, DType::F32).expect("compiles");
    (plans.pop().expect("one plan"), weights)
}

/// The table calibration makes from the calibration frames, through `sim`.
fn calibrate(plan: &Plan, weights: &Weights, frames: &Digits) -> CalibrationTable {
    let mut calibrator = Calibrator::new();
    for i in 0..frames.frames.len() {
        let input = frames.model_input(i);
        let mut runner = sim::Stepper::new(plan, weights, &input);
        let Ok(()) = calibrator.run(plan, &mut runner);
    }
    assert_eq!(calibrator.frames(), frames.frames.len());
    calibrator.table(weights)
}

/// Each frame's scores from `plan`.
fn scores(plan: &Plan, weights: &Weights, frames: &Digits) -> Vec<Vec<f32>> {
    (0..frames.frames.len())
        .map(|i| sim::run(plan, weights, &frames.model_input(i)))
        .collect()
}

/// The committed table is what calibration makes now (`TRTCLASSIFY_BLESS=1` writes it, and
/// `quantized_reference.py` then makes onnxruntime's outputs from it): the second and
/// third convolutions, the ones whose channels suit 8-bit tensor cores.
#[test]
fn calibration_makes_the_committed_digits_table() {
    let (plan, weights) = digits_plan();
    let table = calibrate(&plan, &weights, &digits_calibration());
    let path = models().join("digits/digits_calibration.txt");
    if std::env::var_os("TRTCLASSIFY_BLESS").is_some() {
        table.save(&path).expect("table written");
    }
    let committed = CalibrationTable::load(&path).expect("the committed table");
    assert_eq!(table.frames, 128);
    assert_eq!(
        table.nodes.keys().collect::<Vec<_>>(),
        ["conv2", "conv3"],
        "the quantizable nodes"
    );
    for (name, got) in &table.nodes {
        let want = committed.get(name).expect("the same nodes");
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * (1.0 + b.abs());
        assert!(
            close(got.amax, want.amax) && close(got.int8, want.int8),
            "{name}: {got:?}"
        );
        // Clipping at the entropy range leaves most of a ReLU's range to the int8 steps.
        assert!(
            got.int8 > 0.1 * got.amax && got.int8 <= got.amax,
            "{name}: {got:?}"
        );
        for error in [got.int8_error, got.fp8_error] {
            assert!(error > 0.0 && error < LAYER_ERROR_BOUND, "{name}: {got:?}");
        }
    }
}

/// The quantized plan, run by `sim`, gives onnxruntime's scores for the same quantization
/// on the held-out digits, and its accuracy is within a point of fp32's.
#[test]
fn quantized_digits_match_onnxruntime_and_keep_the_accuracy() {
    let (plan, weights) = digits_plan();
    let table = CalibrationTable::load(&models().join("digits/digits_calibration.txt"))
        .expect("the committed table");
    let text = std::fs::read_to_string(models().join("digits/digits_quantized_reference.json"))
        .expect("models/digits/digits_quantized_reference.json");
    let reference: serde_json::Value = serde_json::from_str(&text).expect("json");
    let heldout = digits_heldout();
    let exact = scores(&plan, &weights, &heldout);
    let fp32 = heldout.accuracy(&exact);
    for format in [QuantFormat::Int8, QuantFormat::Fp8] {
        let (mut plan, mut weights) = (plan.clone(), weights.clone());
        let done = quantize(&mut plan, &mut weights, &table, format, &[]);
        assert_eq!(done.nodes, ["conv2", "conv3"], "{format}");
        assert_eq!(done.kept, [], "{format}");
        let got = scores(&plan, &weights, &heldout);
        let want: Vec<f32> = (reference[format.to_string()]["scores"].as_array())
            .expect("scores")
            .iter()
            .map(|v| v.as_f64().expect("number") as f32)
            .collect();
        assert_close(&got.concat(), &want, 2e-3);
        let accuracy = heldout.accuracy(&got);
        println!(
            "digits, held out: sim {format} {:.2} %, fp32 {:.2} %",
            accuracy * 100.0,
            fp32 * 100.0
        );
        assert!(
            accuracy >= fp32 - 0.01,
            "{format}: {accuracy} against {fp32}"
        );
        // The quantization made a difference: rounding to 8 bits moves the scores.
        assert_ne!(got, exact, "{format}");
        let mut agreement = Agreement::default();
        agreement.add(&exact.concat(), &got.concat(), 10);
        assert!(agreement.top1() >= 0.98, "{format}: {agreement}");
    }
}

#[test]
fn a_quantized_product_rounds_its_input_and_each_columns_weights() {
    // x = [1.3, -0.2], w = [[1, 0.01], [0.5, -0.04]] (k = 2, n = 2): column 0's scale is
    // 1/127, column 1's 0.04/127; x's scale 0.01 (a range of 1.27).
    let mut weights = Weights::default();
    let w = weights.add("w", &Arc::new(vec![1.0, 0.01, 0.5, -0.04]), false);
    let mut plan = Plan {
        batch: 1,
        dtype: DType::F32,
        arena_len: 0,
        wide_len: 0,
        input_len: 2,
        output_len: 2,
        steps: vec![Step::Gemm(GemmStep {
            batch: 1,
            alpha: 1.0,
            rows: 1,
            n: 2,
            k: 2,
            x: Loc::Input(0),
            x_batch: 2,
            w: Loc::Weight {
                index: w,
                offset: 0,
            },
            w_transposed: false,
            bias: None,
            residual: None,
            act: Act::None,
            y: Loc::Output(0),
            y_batch: 2,
            quant: None,
            algo: None,
        })],
        origins: vec!["fc".into()],
    };
    let range = NodeRange {
        amax: 1.27,
        int8: 1.27,
        int8_error: 0.01,
        fp8_error: 0.01,
    };
    let table = CalibrationTable {
        frames: 1,
        nodes: [("fc".to_owned(), range)].into(),
    };
    // Too small for tensor cores: nothing is quantized, and nothing is said to be kept.
    let done = quantize(&mut plan, &mut weights, &table, QuantFormat::Int8, &[]);
    assert_eq!(done, Quantized::default());
    // The rounding itself, on the step as `quantize` would mark it.
    let Step::Gemm(g) = &mut plan.steps[0] else {
        unreachable!()
    };
    let w_scales = weight_scales(&mut weights, &gemm_columns(g), QuantFormat::Int8);
    assert_eq!(
        *weights.data[w_scales_index(w_scales)],
        [1.0 / 127.0, 0.04 / 127.0]
    );
    g.quant = Some(Quant {
        format: QuantFormat::Int8,
        x_scale: 0.01,
        w_scales,
        algo: None,
        kernel: None,
    });
    let got = sim::run(&plan, &weights, &[1.3, -0.2]);
    // x reads [1.27 (clipped), -0.2]; column 0's weights [1, 0.5] round to [127, 64] steps
    // of 1/127 (63.5 to the even 64), column 1's [0.01, -0.04] to [32, -127] of 0.04/127.
    let (s0, s1) = (1.0f32 / 127.0, 0.04f32 / 127.0);
    let want = [
        1.27 * (127.0 * s0) + -0.2 * (64.0 * s0),
        1.27 * (32.0 * s1) + -0.2 * (-127.0 * s1),
    ];
    assert_close(&got, &want, 1e-6);
}

fn w_scales_index(loc: Loc) -> usize {
    match loc {
        Loc::Weight { index, .. } => index,
        other => panic!("scales at {other:?}"),
    }
}

#[test]
fn int8_clips_a_long_tail_and_fp8_keeps_it() {
    let mut calibrator = Calibrator::new();
    // 99.99 % of the values spread over 0..1, a few out at 100. The histogram's range grows
    // from the first run's to 128; int8's search starts at 128 of its 2,048 bins (8.0).
    let mut values: Vec<f32> = (0..100_000).map(|i| (i % 1000) as f32 / 1000.0).collect();
    values.extend([100.0; 10]);
    let step = conv_step_16();
    calibrator.observe(&step, "conv", &values[..16 * 64]);
    calibrator.observe(&step, "conv", &values);
    let weights = weights_for_conv_16();
    let range = calibrator.table(&weights).nodes["conv"];
    assert_eq!(range.amax, 100.0);
    assert_eq!(range.range(QuantFormat::Fp8), 100.0);
    assert!(
        range.int8 > 0.9 && range.int8 <= 8.0,
        "int8 clips the tail: {range:?}"
    );
}

/// A 1×1 convolution of 16 channels to 16, over 8×8 pixels of one frame.
fn conv_step_16() -> Step {
    let step = crate::testing::conv_step(
        [1, 16, 8, 8, 16],
        [[1, 1], [1, 1], [0, 0], [1, 1]],
        Loc::Arena(0),
        Loc::Arena(1024),
    );
    Step::Conv(step.expect("a 1×1 convolution fits"))
}

fn weights_for_conv_16() -> Weights {
    let mut weights = Weights::default();
    let w: Vec<f32> = (0..256)
        .map(|i| ((i * 37) % 17) as f32 / 17.0 - 0.5)
        .collect();
    weights.add("w", &Arc::new(w), false);
    weights.add("b", &Arc::new(vec![0.0; 16]), false);
    weights
}

#[test]
fn steps_past_the_error_bound_or_named_stay_unquantized() {
    let (plan, weights) = digits_plan();
    let mut table = CalibrationTable::load(&models().join("digits/digits_calibration.txt"))
        .expect("the committed table");
    table.nodes.get_mut("conv3").expect("conv3").fp8_error = 0.25;
    let (mut p, mut w) = (plan.clone(), weights.clone());
    let done = quantize(&mut p, &mut w, &table, QuantFormat::Fp8, &[]);
    assert_eq!(done.nodes, ["conv2"]);
    assert_eq!(done.kept, [("conv3".to_owned(), Kept::Error(0.25))]);
    // int8's error is still within the bound; conv2 is asked to stay.
    let (mut p, mut w) = (plan.clone(), weights.clone());
    let done = quantize(&mut p, &mut w, &table, QuantFormat::Int8, &["conv2".into()]);
    assert_eq!(done.nodes, ["conv3"]);
    assert_eq!(done.kept, [("conv2".to_owned(), Kept::Asked)]);
    // A table of another model quantizes nothing, and says so.
    let (mut p, mut w) = (plan.clone(), weights.clone());
    let done = quantize(
        &mut p,
        &mut w,
        &CalibrationTable::default(),
        QuantFormat::Int8,
        &[],
    );
    assert_eq!(done.nodes, Vec::<String>::new());
    assert_eq!(
        done.kept,
        [
            ("conv2".to_owned(), Kept::NotCalibrated),
            ("conv3".to_owned(), Kept::NotCalibrated)
        ]
    );
    assert_eq!(p, plan);
}

#[test]
fn quantized_plans_pass_their_checks_and_broken_scales_do_not() {
    let (plan, weights) = digits_plan();
    let table = CalibrationTable::load(&models().join("digits/digits_calibration.txt"))
        .expect("the committed table");
    let (mut p, mut w) = (plan, weights);
    quantize(&mut p, &mut w, &table, QuantFormat::Fp8, &[]);
    let spec = (3 * 32 * 32, 10);
    let weight = |i: usize| w.data.get(i).map(|d| (d.len(), w.dtype(i, DType::F32)));
    crate::check::check_plan(&mut p.clone(), &weight, DType::F32, spec.0, spec.1)
        .expect("a quantized plan passes");
    let conv = p
        .steps
        .iter()
        .position(|s| matches!(s, Step::Conv(c) if c.quant.is_some()))
        .expect("a quantized convolution");
    for (broken, problem) in [
        (f32::NAN, "an input scale of NaN"),
        (-1.0, "an input scale of -1"),
    ] {
        let mut bad = p.clone();
        if let Step::Conv(c) = &mut bad.steps[conv] {
            c.quant.as_mut().expect("quantized").x_scale = broken;
        }
        let err = crate::check::check_plan(&mut bad, &weight, DType::F32, spec.0, spec.1)
            .expect_err("refused");
        assert!(err.to_string().contains(problem), "{err}");
    }
    // Scales past the end of their constant.
    let mut bad = p.clone();
    if let Step::Conv(c) = &mut bad.steps[conv] {
        c.quant.as_mut().expect("quantized").w_scales = Loc::Weight {
            index: 0,
            offset: 1 << 20,
        };
    }
    let err = crate::check::check_plan(&mut bad, &weight, DType::F32, spec.0, spec.1)
        .expect_err("refused");
    assert!(err.to_string().contains("touches elements"), "{err}");
}

#[test]
fn the_table_reads_back_what_it_wrote_and_names_what_is_wrong() {
    let table = CalibrationTable {
        frames: 64,
        nodes: [
            (
                "conv 1".to_owned(),
                NodeRange {
                    amax: 3.25,
                    int8: 2.875,
                    int8_error: 0.0121,
                    fp8_error: 0.0232,
                },
            ),
            (
                "fc".to_owned(),
                NodeRange {
                    amax: 1e-30,
                    int8: 0.0,
                    int8_error: 0.0,
                    fp8_error: 1.0 / 3.0,
                },
            ),
        ]
        .into(),
    };
    let text = table.to_text();
    assert!(text.starts_with("trtclassify-calibration 1\nframes 64\n"));
    assert_eq!(CalibrationTable::parse(&text, "t.txt"), Ok(table));
    let header = "trtclassify-calibration 1\nframes 1\n";
    for (text, line, problem) in [
        ("", 1, "not a calibration table"),
        (
            "trtclassify-calibration 2\n",
            1,
            "a version this build does not read",
        ),
        (
            "trtclassify-calibration 1\nframes x\n",
            2,
            "not a count of frames",
        ),
        ("trtclassify-calibration 1\n", 2, "no `frames N` line"),
        (&format!("{header}a\t1\t1\t0\n"), 3, "4 fields, not 5"),
        (
            &format!("{header}a\t1\t1\t0\tNaN\n"),
            3,
            "not finite numbers",
        ),
        (
            &format!("{header}a\t1\t-1\t0\t0\n"),
            3,
            "not finite numbers",
        ),
        (&format!("{header}a\t1\t2\t0\t0\n"), 3, "an int8 range past"),
        (
            &format!("{header}a\t1\t1\t0\t0\na\t1\t1\t0\t0\n"),
            4,
            "node `a` a second time",
        ),
    ] {
        let err = CalibrationTable::parse(text, "t.txt").expect_err(text);
        assert!(
            err.to_string()
                .starts_with(&format!("t.txt: line {line}: "))
                && err.to_string().contains(problem),
            "{text:?}: {err}"
        );
    }
    let missing = std::path::Path::new("/nonexistent/table.txt");
    let err = CalibrationTable::load(missing).expect_err("no file");
    assert!(
        err.to_string().starts_with("/nonexistent/table.txt: "),
        "{err}"
    );
}

#[test]
fn agreement_counts_top1_and_the_largest_probability_and_logit_errors() {
    let mut a = Agreement::default();
    // Probabilities as they are; logits through softmax; a NaN frame disagrees.
    a.add(&[0.7, 0.3], &[0.6, 0.4], 2);
    a.add(&[0.0, 10.0], &[0.0, 9.0], 2);
    a.add(&[1.0, 0.0], &[f32::NAN, 0.5], 2);
    assert_eq!((a.frames, a.same_top1), (3, 2));
    assert!((a.top1() - 2.0 / 3.0).abs() < 1e-12);
    assert_eq!(a.max_probability_error, f32::INFINITY);
    assert_eq!(a.max_logit_error, f32::INFINITY);
    let mut b = Agreement::default();
    b.add(&[0.7, 0.3], &[0.6, 0.4], 2);
    assert!((b.max_probability_error - 0.1).abs() < 1e-6, "{b}");
    // Centred logits ±0.424 against ±0.203: off by 0.221, 52 % of the reference's.
    let want = ((0.7f64 / 0.3).ln() - (0.6f64 / 0.4).ln()) / (0.7f64 / 0.3).ln();
    assert!((f64::from(b.max_logit_error) - want).abs() < 1e-5, "{b:?}");
    // Logits moved by a constant are the same logits; any move from a tie is infinite.
    let mut c = Agreement::default();
    c.add(&[1.0, 2.0, 4.0], &[11.0, 12.0, 14.0], 3);
    assert!(c.max_logit_error < 1e-5, "{c:?}");
    c.add(&[0.5, 0.5], &[0.5, 0.5], 2);
    assert!(c.max_logit_error < 1e-5, "{c:?}");
    let tie = [0.1; 10];
    c.add(&tie, &tie, 10);
    assert!(c.max_logit_error < 1e-5, "{c:?}");
    c.add(&[0.5, 0.5], &[0.6, 0.4], 2);
    assert_eq!(c.max_logit_error, f32::INFINITY);
    let mut d = Agreement::default();
    let mut moved = tie;
    (moved[0], moved[1]) = (0.11, 0.09);
    d.add(&tie, &moved, 10);
    assert_eq!(d.max_logit_error, f32::INFINITY);
    // Probabilities that sum to 1 less closely than the reference are still probabilities.
    let mut e = Agreement::default();
    e.add(&[0.7, 0.3], &[0.6, 0.405], 2);
    assert!(e.max_probability_error < 0.11, "{e:?}");
    assert!(
        b.to_string()
            .starts_with("top-1 agreement 100.00 % (1 of 1 frames)")
    );
}
