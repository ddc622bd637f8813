// SPDX-License-Identifier: MPL-2.0
//! The IR on the CPU: the import against onnxruntime's outputs, and every pass against the
//! graph before it.

use std::path::{Path, PathBuf};

use super::ir::{Graph, Op, Tensor};
use super::plan::{DType, Weights};
use super::{import, lower, passes, reference, sim};
use crate::engine::OnnxModel;

fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models")
}

struct Reference {
    input: Tensor,
    output: Vec<f32>,
}

fn load_reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(models().join(name)).expect("reference file");
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference json");
    let floats = |key: &str| -> Vec<f32> {
        v[key]
            .as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_f64().expect("number") as f32)
            .collect()
    };
    let shape: Vec<usize> = v["input_shape"]
        .as_array()
        .expect("shape")
        .iter()
        .map(|d| d.as_u64().expect("dim") as usize)
        .collect();
    Reference {
        input: Tensor::new(shape, floats("input")),
        output: floats("output"),
    }
}

fn import_model(name: &str, batch: usize) -> Graph {
    let model = OnnxModel::load(&models().join(name)).expect("model loads");
    let spec = model.input_spec(None).expect("fixed input size");
    import::import(&model, batch, spec.height, spec.width).expect("model imports")
}

#[track_caller]
fn assert_close(got: &[f32], want: &[f32], tolerance: f32) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tolerance * (1.0 + w.abs()),
            "value {i}: got {g}, want {w}"
        );
    }
}

fn count(graph: &Graph, pred: impl Fn(&Op) -> bool) -> usize {
    graph.nodes.iter().filter(|n| pred(&n.op)).count()
}

#[test]
fn import_matches_onnxruntime() {
    for (model, reference) in [
        ("cnn.onnx", "cnn_reference.json"),
        ("colors.onnx", "colors_reference.json"),
        ("ops.onnx", "ops_reference.json"),
    ] {
        let r = load_reference(reference);
        let graph = import_model(model, r.input.shape[0]);
        let out = reference::run(&graph, &r.input);
        assert_close(&out.data, &r.output, 1e-4);
    }
}

#[test]
fn passes_keep_results_and_fuse() {
    let r = load_reference("cnn_reference.json");
    let mut graph = import_model("cnn.onnx", r.input.shape[0]);
    let before = reference::run(&graph, &r.input);
    let nodes_before = graph.nodes.len();
    assert_eq!(count(&graph, |op| matches!(op, Op::BatchNorm { .. })), 4);

    passes::optimise(&mut graph);
    let after = reference::run(&graph, &r.input);
    assert_close(&after.data, &before.data, 1e-5);
    assert_close(&after.data, &r.output, 1e-4);
    // Every batch norm follows a convolution; relu/relu6 and the residual add fuse into it.
    assert_eq!(count(&graph, |op| matches!(op, Op::BatchNorm { .. })), 0);
    assert_eq!(count(&graph, |op| matches!(op, Op::Unary(_))), 0);
    assert_eq!(count(&graph, |op| matches!(op, Op::Binary { .. })), 0);
    let ops: Vec<&str> = graph.nodes.iter().map(|n| n.op.name()).collect();
    assert_eq!(
        ops,
        [
            "Conv",
            "Conv",
            "Conv",
            "MaxPool",
            "Conv",
            "AveragePool",
            "GlobalAveragePool",
            "Reshape",
            "Gemm"
        ],
        "{nodes_before} nodes before"
    );
    let residual = graph
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Conv(_)) && n.inputs.len() == 4)
        .count();
    assert_eq!(residual, 1);
}

#[test]
fn import_folds_shape_chains_per_batch() {
    // The same model imports at several batch sizes with every shape settled.
    for batch in [1, 2, 7] {
        let graph = import_model("cnn.onnx", batch);
        assert_eq!(graph.shape(&graph.output), [batch, 10]);
    }
}

#[test]
fn unsupported_ops_are_named() {
    let model = OnnxModel::load(&models().join("bad/unsupported_op.onnx")).expect("loads");
    assert_eq!(
        import::unsupported_ops(&model),
        ["com.example.nonexistent.FrobnicateImage"]
    );
}

/// Imports, optimises and lowers `model` at each batch size, runs the plans on the CPU
/// simulator and compares with the reference evaluation of the imported graph.
fn check_lowering(model: &str, reference_file: &str) {
    let r = load_reference(reference_file);
    let frames = r.input.shape[0];
    let frame_len = r.input.len() / frames;
    let mut weights = Weights::default();
    for batch in [1, frames] {
        let input = Tensor::new(
            [vec![batch], r.input.shape[1..].to_vec()].concat(),
            r.input.data[..batch * frame_len].to_vec(),
        );
        let mut graph = import_model(model, batch);
        let want = reference::run(&graph, &input);
        passes::optimise(&mut graph);
        let plan = lower::lower(&graph, DType::F32, &mut weights).expect("lowers");
        let got = sim::run(&plan, &weights, &input.data);
        assert_close(&got, &want.data, 1e-4);
    }
    // The plans of both batch sizes share one copy of each weight.
    let mut names = weights.names.clone();
    names.dedup();
    assert_eq!(names.len(), weights.names.len(), "{:?}", weights.names);
}

#[test]
fn lowered_plans_match_reference() {
    check_lowering("cnn.onnx", "cnn_reference.json");
    check_lowering("colors.onnx", "colors_reference.json");
    check_lowering("ops.onnx", "ops_reference.json");
}

#[test]
fn kernels_compile_with_nvrtc() {
    // NVRTC needs no GPU: where it is installed, the kernels are compiled for both types.
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        skipped("kernels_compile_with_nvrtc: libnvrtc is not installed here");
        return;
    }
    for dtype in [DType::F16, DType::F32] {
        let ptx = super::runtime::compile(dtype, (8, 0)).unwrap_or_else(|e| panic!("{e}"));
        for kernel in ["ew", "ew_from_f32", "bias_act", "pool_nhwc", "softmax_rows"] {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{kernel} missing"
            );
        }
    }
}

#[test]
fn torchvision_models_import_and_lower() {
    // The torchvision exports are 5–115 MB and not in the repository; run with
    // TRTCLASSIFY_TORCHVISION_DIR set to the output of `bench/gpu/torch_models.py export`.
    let Some(dir) = std::env::var_os("TRTCLASSIFY_TORCHVISION_DIR") else {
        println!(
            "SKIPPED torchvision_models_import_and_lower: TRTCLASSIFY_TORCHVISION_DIR is not set"
        );
        return;
    };
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).expect("torchvision dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "onnx") {
            continue;
        }
        let model = OnnxModel::load(&path).expect("model loads");
        assert_eq!(import::unsupported_ops(&model), Vec::<String>::new());
        let mut weights = Weights::default();
        for batch in [1, 8] {
            let mut graph = import::import(&model, batch, 224, 224)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            passes::optimise(&mut graph);
            assert_eq!(count(&graph, |op| matches!(op, Op::BatchNorm { .. })), 0);
            let plan = lower::lower(&graph, DType::F16, &mut weights)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(plan.output_len, batch * 1000);
            println!(
                "{}: batch {batch}: {} nodes, {} steps, arena {} MB (fp16)",
                path.display(),
                graph.nodes.len(),
                plan.steps.len(),
                (plan.arena_len * 2) >> 20
            );
        }
        checked += 1;
    }
    assert!(checked > 0);
}

/// Says a test did not run, on stderr directly so that the harness does not capture it.
fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {why}");
}
