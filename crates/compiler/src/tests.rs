// SPDX-License-Identifier: MPL-2.0
//! The IR on the CPU: the import against onnxruntime's outputs, and every pass against the
//! graph before it.

use std::path::Path;

use super::ir::{Act, BinOp, Graph, Node, Op, Tensor};
use super::plan::{
    Cast, DType, EwStep, GemmStep, Loc, Plan, RowMeanStep, SoftmaxStep, Step, Weights,
};
use super::{check, import, lower, passes, reference, sim};
use crate::OnnxModel;
use crate::testing::{assert_close, load_reference, models};

fn import_model(name: &str, batch: usize) -> Graph {
    let model = OnnxModel::load(&models().join(name)).expect("model loads");
    let spec = model.input_spec(None).expect("fixed input size");
    import::import(&model, batch, spec.height, spec.width).expect("model imports")
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
        ("ops_rare.onnx", "ops_rare_reference.json"),
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
        // The simulator computes in f32 either way; the fp16 plan's steps differ at its end
        // (`lower::scores`).
        // The CPU runner's fp32 plans write products over their residuals (`in_place`).
        for (dtype, in_place) in [(DType::F32, false), (DType::F16, false), (DType::F32, true)] {
            let plan = lower::lower(&graph, dtype, &Default::default(), &mut weights, in_place)
                .expect("lowers");
            let got = sim::run(&plan, &weights, &input.data);
            assert_close(&got, &want.data, 1e-4);
        }
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
    check_lowering("big_activations.onnx", "big_activations_reference.json");
    check_lowering("ops_rare.onnx", "ops_rare_reference.json");
}

/// Of ops.onnx's two depthwise convolutions after an expansion product and its activation,
/// the one after a clip takes that clip into its input in the GPU's plans, whose scores
/// `lowered_plans_match_reference` checks; the one after a SiLU does not (too costly to
/// compute for each tap); the CPU's plans keep both as steps of their own.
#[test]
fn depthwise_convolutions_take_the_activation_before_them_on_the_gpu() {
    let taken = |in_place: bool| -> Vec<(Act, Act)> {
        let graph = {
            let mut g = import_model("ops.onnx", 1);
            passes::optimise(&mut g);
            g
        };
        let mut weights = Weights::default();
        let plan = lower::lower(
            &graph,
            DType::F32,
            &Default::default(),
            &mut weights,
            in_place,
        )
        .expect("lowers");
        (plan.steps.iter())
            .filter_map(|s| match s {
                Step::Conv(c) if !c.act_in.is_none() => Some((c.act_in, c.act)),
                _ => None,
            })
            .collect()
    };
    assert_eq!(taken(false), [(Act::Clip(0.0, 6.0), Act::HardSwish)]);
    assert_eq!(taken(true), []);
}

/// ops.onnx's three squeeze-and-excitation blocks (a global pool, two 1×1 convolutions and
/// their activations, the product with the gate) each have one gate step in the GPU's plans
/// of every batch size, whose scores `lowered_plans_match_reference` checks, with the
/// activations of both products; the CPU's plans keep the products.
#[test]
fn squeeze_and_excitation_is_one_gate_on_the_gpu() {
    let gates = |in_place: bool, batch: usize| -> Vec<(usize, usize, usize, Act, Act)> {
        let mut graph = import_model("ops.onnx", batch);
        passes::optimise(&mut graph);
        let plan = lower::lower(
            &graph,
            DType::F16,
            &Default::default(),
            &mut Weights::default(),
            in_place,
        )
        .expect("lowers");
        (plan.steps.iter())
            .filter_map(|s| match s {
                Step::Gate(g) => Some((g.n, g.c, g.r, g.act1, g.act2)),
                _ => None,
            })
            .collect()
    };
    for batch in [1, 3] {
        let hard = Act::HardSigmoid(1.0 / 6.0, 0.5);
        assert_eq!(
            gates(false, batch),
            [
                (batch, 16, 4, Act::Relu, Act::Sigmoid),
                (batch, 32, 8, Act::Relu, Act::Sigmoid),
                (batch, 32, 8, Act::Relu, hard)
            ]
        );
        assert_eq!(gates(true, batch), []);
    }
}

/// The committed models whose import and plans the tests above check against onnxruntime's
/// outputs (`lowered_plans_match_reference`, `vision_transformers_import_lower_and_match_
/// onnxruntime`), and the CPU engine runs against them too (`tests/engine.rs`).
const CHECKED_MODELS: &[&str] = &[
    "cnn.onnx",
    "colors.onnx",
    "ops.onnx",
    "ops_rare.onnx",
    "big_activations.onnx",
    "transformers/vit.onnx",
    "transformers/swin.onnx",
    "transformers/swin_v2.onnx",
    "transformers/maxvit.onnx",
    "transformers/hybrid.onnx",
    "transformers/hybrid.dynamo.onnx",
    "transformers/swin.dynamo.onnx",
];

/// Every operator a family declares runs end to end in one of the checked models: declaring
/// an operator without a model that shows it imported, lowered and computed as onnxruntime
/// computes it fails here, naming it (add it to `models/generate.py`'s `ops_rare.onnx`).
#[test]
fn every_declared_operator_runs_in_a_model_checked_against_onnxruntime() {
    let mut seen = std::collections::HashSet::new();
    for name in CHECKED_MODELS {
        let model = OnnxModel::load(&models().join(name)).expect("model loads");
        for node in model.proto.graph.iter().flat_map(|g| &g.node) {
            seen.insert(node.op_type.clone());
        }
    }
    let missing: Vec<&str> = import::SUPPORTED_OPS
        .iter()
        .copied()
        .filter(|op| !seen.contains(*op))
        .collect();
    assert!(
        missing.is_empty(),
        "declared but in no model checked against onnxruntime: {}",
        missing.join(", ")
    );
}

/// A graph node of `op` reading `inputs`.
fn node(name: &str, op: Op, inputs: &[&str], output: &str) -> Node {
    Node {
        name: name.into(),
        op,
        inputs: inputs.iter().map(|&i| i.into()).collect(),
        output: output.into(),
    }
}

/// The residual products of `plan`: whether each writes its output over its residual.
fn residual_products(plan: &Plan) -> Vec<bool> {
    plan.steps
        .iter()
        .filter_map(|step| match step {
            Step::Conv(c) => c.residual.map(|z| z == c.y),
            Step::Gemm(GemmStep { residual, y, .. }) => residual.map(|z| z == *y),
            _ => None,
        })
        .collect()
}

#[test]
fn the_cpu_plans_write_residual_products_over_their_residuals() {
    // cnn.onnx: a residual block, which adds its input (read by nothing after) to a
    // pointwise convolution's output.
    let model = OnnxModel::load(&models().join("cnn.onnx")).expect("loads");
    let spec = model.input_spec(None).expect("fixed input size");
    let (cpu, _) = super::compile_for_cpu(&model, &[1, 2], spec).expect("compiles");
    for plan in &cpu {
        assert_eq!(residual_products(plan), [true], "batch {}", plan.batch);
    }
    // The GPU's plans keep them apart: its kernels may write an output before reading all
    // of the residual.
    for dtype in [DType::F32, DType::F16] {
        let (gpu, _) = super::compile(&model, &[1, 2], spec, dtype).expect("compiles");
        for plan in &gpu {
            assert_eq!(residual_products(plan), [false], "{dtype:?}");
        }
    }
}

#[test]
fn a_product_writes_over_its_residual_only_where_nothing_else_reads_it() {
    // 3×3 convolutions, 8 channels in and out, and three residual products:
    // - `c = conv(b) + a`, with `a` read again by `d = c + a`;
    // - `e = conv(d) + d`, with `d` its input as well;
    // - `y = conv(g) + e`, with `e` read by nothing after: the only one written in place.
    let seq = |n: usize, scale: f32| {
        (0..n)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * scale)
            .collect()
    };
    let mut graph = Graph {
        input: "x".into(),
        output: "y".into(),
        ..Default::default()
    };
    let conv = |name: &str, inputs: &[&str], output: &str| {
        let op = Op::Conv(super::ir::Conv2d {
            kernel: [3, 3],
            strides: [1, 1],
            pads: [1, 1, 1, 1],
            dilations: [1, 1],
            group: 1,
            act: Act::None,
        });
        let inputs: Vec<&str> = [inputs[0], "w", "bias"]
            .into_iter()
            .chain(inputs[1..].iter().copied())
            .collect();
        node(name, op, &inputs, output)
    };
    let add = |name: &str, a: &str, b: &str, output: &str| {
        let op = Op::Binary {
            op: BinOp::Add,
            act: Act::None,
        };
        node(name, op, &[a, b], output)
    };
    graph.nodes = vec![
        conv("a", &["x"], "a"),
        conv("b", &["a"], "b"),
        conv("c", &["b", "a"], "c"),
        add("d", "c", "a", "d"),
        conv("e", &["d", "d"], "e"),
        conv("g", &["e"], "g"),
        conv("y", &["g", "e"], "y"),
    ];
    for value in ["x", "a", "b", "c", "d", "e", "g", "y"] {
        graph.shapes.insert(value.into(), vec![1, 8, 5, 5]);
    }
    graph
        .consts
        .insert("w".into(), Tensor::new(vec![8, 8, 3, 3], seq(576, 0.02)));
    graph
        .consts
        .insert("bias".into(), Tensor::new(vec![8], seq(8, 0.1)));
    let input = Tensor::new(vec![1, 8, 5, 5], seq(200, 0.1));
    let want = reference::run(&graph, &input);
    passes::optimise(&mut graph);
    let mut weights = Weights::default();
    let plan =
        lower::lower(&graph, DType::F32, &Default::default(), &mut weights, true).expect("lowers");
    assert_eq!(residual_products(&plan), [false, false, true]);
    assert_close(&sim::run(&plan, &weights, &input.data), &want.data, 1e-4);
}

#[test]
fn the_fp16_scores_come_from_the_last_product_in_f32() {
    // cnn.onnx ends with a Gemm and its bias; ops.onnx with a Gemm and a softmax.
    let writes_scores = |step: &Step| matches!(step.written().loc, Loc::Output(_));
    for (model, softmax) in [("cnn.onnx", false), ("ops.onnx", true)] {
        let mut graph = import_model(model, 2);
        passes::optimise(&mut graph);
        for dtype in [DType::F32, DType::F16] {
            let mut weights = Weights::default();
            let mut plan = lower::lower(&graph, dtype, &Default::default(), &mut weights, false)
                .expect("lowers");
            let writers: Vec<&Step> = plan.steps.iter().filter(|s| writes_scores(s)).collect();
            let kinds: Vec<String> = writers.iter().map(|s| s.describe()).collect();
            if dtype == DType::F32 {
                // The scores are the plan's own type: one copy writes them.
                assert!(
                    matches!(
                        writers[..],
                        [Step::Ew(EwStep {
                            cast: Cast::ToF32,
                            ..
                        })]
                    ),
                    "{model} {dtype:?}: {kinds:?}"
                );
            } else {
                // The product writes them; its bias is added to them in f32 by a step of its
                // own, or by the softmax that runs on them in place.
                let (product, rest) = match &writers[..] {
                    [product, rest @ ..] => (product, rest),
                    _ => panic!("{model}: {kinds:?}"),
                };
                assert!(
                    matches!(product, Step::Gemm(GemmStep { bias: None, .. })),
                    "{kinds:?}"
                );
                match softmax {
                    true => assert!(
                        matches!(
                            rest,
                            [Step::Softmax(SoftmaxStep {
                                x: Loc::Output(0),
                                bias: Some(_),
                                ..
                            })]
                        ),
                        "{kinds:?}"
                    ),
                    false => assert!(
                        matches!(
                            rest,
                            [Step::Ew(EwStep {
                                cast: Cast::F32,
                                b: Some(_),
                                ..
                            })]
                        ),
                        "{kinds:?}"
                    ),
                }
                assert_eq!(plan.steps.last(), writers.last().copied(), "{kinds:?}");
                assert_eq!(plan.origins.len(), plan.steps.len());
            }
            // The checks that every plan passes before it runs accept the rewritten steps.
            let weight = |i: usize| {
                weights
                    .data
                    .get(i)
                    .map(|d| (d.len(), weights.dtype(i, dtype)))
            };
            let (frame_len, classes) = (plan.input_len / 2, plan.output_len / 2);
            check::check_plan(&mut plan, &weight, dtype, frame_len, classes)
                .unwrap_or_else(|e| panic!("{model} {dtype:?}: {e}"));
        }
    }
}

#[test]
fn every_step_names_the_node_it_computes() {
    let graph = import_model("ops.onnx", 2);
    let mut optimised = graph.clone();
    passes::optimise(&mut optimised);
    let plan = lower::lower(
        &optimised,
        DType::F16,
        &Default::default(),
        &mut Weights::default(),
        false,
    )
    .expect("lowers");
    assert_eq!(plan.origins.len(), plan.steps.len());
    assert_eq!(plan.origins[0], graph.input, "the input's cast");
    let names: Vec<&str> = graph.nodes.iter().map(|n| n.name.as_str()).collect();
    for (step, origin) in plan.steps.iter().zip(&plan.origins).skip(1) {
        assert!(
            names.contains(&origin.as_str()) || *origin == graph.output,
            "{} names `{origin}`, not a node of the model",
            step.describe()
        );
    }
    // Every node of the graph after the passes that computes something has steps; a gate
    // names its first product (`lower::gate`), the second being the gate's too.
    let named: std::collections::HashSet<&String> = plan.origins.iter().collect();
    let gates: Vec<&String> = (plan.steps.iter().zip(&plan.origins))
        .filter(|(s, _)| matches!(s, Step::Gate(_)))
        .map(|(_, origin)| origin)
        .collect();
    let of_a_gate = |n: &Node| {
        (optimised.nodes.iter()).any(|p| p.output == n.inputs[0] && gates.contains(&&p.name))
    };
    let convs = optimised
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Conv(_)))
        .filter(|n| !named.contains(&n.name) && !of_a_gate(n))
        .map(|n| n.name.clone())
        .collect::<Vec<_>>();
    assert!(convs.is_empty(), "convolutions without a step: {convs:?}");
    assert_eq!(gates.len(), 3, "ops.onnx's squeeze-and-excitation blocks");
}

/// The input of `models/transformers/export.py`'s references: two frames, each element
/// ((i * 7919) % 1000) / 500 - 1 over the NCHW index i.
fn transformer_input() -> Tensor {
    let data = (0..2 * 3 * 224 * 224u64)
        .map(|i| (((i * 7919) % 1000) as f64 / 500.0 - 1.0) as f32)
        .collect();
    Tensor::new(vec![2, 3, 224, 224], data)
}

/// onnxruntime's output for `transformer_input()` through `models/transformers/NAME.onnx`.
fn transformer_reference(name: &str) -> Vec<f32> {
    let text = std::fs::read_to_string(models().join(format!("transformers/{name}.ref.json")))
        .expect("reference");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v["output"]
        .as_array()
        .expect("output")
        .iter()
        .flat_map(|row| row.as_array().expect("row").iter())
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

#[test]
fn vision_transformers_import_lower_and_match_onnxruntime() {
    // torchvision's ViT, Swin v1/v2 and MaxViT, small, as exported by their users, the
    // mobile hybrids' patterns, and the dynamo exporter's graphs: shape arithmetic (Shape,
    // Equal, Where, Expand, Mod, Range, Not, ScatterND, Pad, integer Div, ...) is evaluated at
    // import, at a fixed batch and size; query, key and value become slices, attention
    // (MatMul or Einsum) batched products, Resize products with interpolation matrices. The
    // imported graph, the optimised one and the plan (run step by step on the CPU) must all
    // give onnxruntime's probabilities.
    let input = transformer_input();
    // (model, GELU fused into a product, attention scaling folded into a product's alpha).
    // The hybrid's GELU is the tanh form, which stays element-wise; Swin v2's cosine
    // attention scales per head; MaxViT scales its keys before the transpose that its Einsum
    // becomes, and the hybrid scales after its Einsum.
    // The last number: attentions fused in fp16, Swin's shifted windows (whose mask is added
    // to the scores split by image and window) among them. Swin's heads of 8 values (the
    // kernel takes 16 to 128), Swin v2's scaling per head, and MaxViT's and the hybrid's
    // softmax reshaped before the product with the values stay products and a softmax.
    // Then whether query, key and value are projected by products of their own.
    let expected = [
        ("vit", true, true, 2, true),
        ("swin", true, true, 4, true),
        ("swin_v2", true, false, 0, true),
        ("maxvit", true, false, 0, true),
        ("hybrid", false, false, 0, false),
        ("hybrid.dynamo", false, false, 0, false),
        ("swin.dynamo", true, true, 4, true),
    ];
    for (name, gelu, scaled, attentions, split) in expected {
        let want = transformer_reference(name);
        let model = OnnxModel::load(&models().join(format!("transformers/{name}.onnx")))
            .expect("model loads");
        assert_eq!(
            import::unsupported_ops(&model),
            Vec::<String>::new(),
            "{name}"
        );
        let mut graph =
            import::import(&model, 2, 224, 224).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_close(&reference::run(&graph, &input).data, &want, 1e-4);
        passes::optimise(&mut graph);
        assert_close(&reference::run(&graph, &input).data, &want, 1e-4);
        // Each attention's query, key and value are products of their own (`column_split`),
        // whether the exporter slices them out of one projection through a reshape and a
        // permutation (Swin), through a reshape (ViT) or straight across its columns
        // (MaxViT); the hybrid's come from a convolution.
        let split_products = (graph.nodes.iter())
            .filter(|n| matches!(n.op, Op::Gemm { .. }) && n.name.contains(".group"))
            .count();
        // Every softmax but the scores' is an attention's.
        let layers = (graph.nodes.iter())
            .filter(|n| matches!(n.op, Op::Softmax { .. }) && n.output != graph.output)
            .count();
        assert_eq!(
            split_products,
            if split { 3 * layers } else { 0 },
            "{name}: query, key and value products ({layers} attentions)"
        );
        // GELU's five exported nodes (or its one dynamo node) became the MLP's first
        // product's activation.
        let ops: Vec<&Op> = graph.nodes.iter().map(|n| &n.op).collect();
        assert!(
            !ops.contains(&&Op::Unary(Act::Erf)),
            "{name}: an erf is left"
        );
        assert_eq!(
            ops.contains(&&Op::Gemm { act: Act::Gelu }),
            gelu,
            "{name}: GELU in a product"
        );
        assert_eq!(
            ops.iter()
                .any(|op| matches!(op, Op::MatMul { alpha } if *alpha != 1.0)),
            scaled,
            "{name}: scaled attention products"
        );
        let mut weights = Weights::default();
        let plan = lower::lower(&graph, DType::F32, &Default::default(), &mut weights, false)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_close(&sim::run(&plan, &weights, &input.data), &want, 1e-4);
        // fp16 plans fuse attention where the kernel takes the head sizes: the graph and
        // its plan (whose attention steps the simulator runs in f32) still give
        // onnxruntime's answer.
        passes::fuse_attention(&mut graph, &Default::default());
        let fused = |op: &Op| matches!(op, Op::Attention { .. });
        assert_eq!(count(&graph, fused), attentions, "{name}: fused attentions");
        assert_close(&reference::run(&graph, &input).data, &want, 1e-4);
        let plan = lower::lower(&graph, DType::F16, &Default::default(), &mut weights, false)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_close(&sim::run(&plan, &weights, &input.data), &want, 1e-4);
    }
    // The tiny ViT at batch 4 (the same frames twice gives the same answers twice): both
    // residual adds of each block are the products' (the attention's output projection adds
    // its residual through the reshapes and transposes that lie between it and the Add). In
    // fp16, each block's attention is one step that reads the heads where the projection
    // wrote them and writes its output where the heads merge, instead of three head copies,
    // two products, a softmax and a merge copy, and GELU is the MLP product's epilogue: seven
    // steps fewer per block; and query, key and value, each a product of the same input, run
    // as one batched product: two more. At the end, the scores' softmax adds the classifier's
    // bias, and the copy into the scores goes: one step fewer.
    let model = OnnxModel::load(&models().join("transformers/vit.onnx")).expect("model loads");
    let mut graph = import::import(&model, 4, 224, 224).expect("imports");
    passes::optimise(&mut graph);
    let with_residual = graph
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Gemm { .. }) && n.inputs.len() == 4)
        .count();
    assert_eq!(with_residual, 2 * 2, "products that add the residual");
    // Query, key and value are products of their own (`column_split`), not slices copied
    // out of one projection: the one slice left picks the class token.
    let slices: Vec<&str> = graph
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Slice { .. }))
        .map(|n| n.name.as_str())
        .collect();
    assert_eq!(slices, ["/0/Gather_4"], "slices left");
    let mut weights = Weights::default();
    let f32_plan =
        lower::lower(&graph, DType::F32, &Default::default(), &mut weights, false).expect("lowers");
    passes::fuse_attention(&mut graph, &Default::default());
    let f16_plan =
        lower::lower(&graph, DType::F16, &Default::default(), &mut weights, false).expect("lowers");
    assert_eq!(f16_plan.steps.len() + 2 * 9 + 1, f32_plan.steps.len());
    let of_one_x = |plan: &Plan| {
        (plan.steps.iter())
            .filter(|s| {
                matches!(
                    s,
                    Step::Gemm(GemmStep {
                        batch: 3,
                        x_batch: 0,
                        bias: Some(_),
                        ..
                    })
                )
            })
            .count()
    };
    assert_eq!((of_one_x(&f32_plan), of_one_x(&f16_plan)), (0, 2));
    let twice = [input.data.as_slice(), input.data.as_slice()].concat();
    let want = transformer_reference("vit");
    for plan in [f32_plan, f16_plan] {
        assert_close(
            &sim::run(&plan, &weights, &twice),
            &[want.as_slice(), want.as_slice()].concat(),
            1e-4,
        );
    }
}

#[test]
fn parameters_that_are_not_numbers_are_refused() {
    // Found by the cuda_compile fuzzer: a model whose plan held a NaN parameter, which an
    // engine file stores as `null`; every start then failed to read the file it had written.
    let path = crate::testing::repo().join("fuzz/regressions/cuda_compile_nan_parameter.onnx");
    let model = OnnxModel::load(&path).expect("parses");
    let spec = model.input_spec(None).expect("input");
    let err = super::compile(&model, &[1, 2], spec, DType::F32).expect_err("refused");
    assert!(
        (err.to_string()).contains("`clip_0` (Clip): a parameter is NaN"),
        "{err}"
    );
    // An infinite bound is no bound: it becomes the lowest finite value (the same clip, and
    // a number an engine file can store).
    use prost::Message;
    let mut proto = OnnxModel::load(&models().join("cnn.onnx")).unwrap().proto;
    let graph = proto.graph.as_mut().expect("graph");
    let min = graph
        .initializer
        .iter_mut()
        .find(|t| t.name == "clip_min_0");
    let min = min.expect("cnn.onnx clips");
    (min.raw_data, min.float_data) = (Vec::new(), vec![f32::NEG_INFINITY]);
    let model = OnnxModel::from_bytes(&path, &proto.encode_to_vec()).expect("parses");
    let graph = import::import(&model, 1, spec.height, spec.width).expect("imports");
    let clips: Vec<f32> = (graph.nodes.iter())
        .filter_map(|n| match n.op {
            Op::Unary(Act::Clip(lo, _)) => Some(lo),
            _ => None,
        })
        .collect();
    assert_eq!(clips, [f32::MIN]);
}

#[test]
fn nodes_of_one_name_keep_their_own_constants() {
    // Found by the cuda_compile fuzzer: two convolutions named `conv_2`, both without a bias,
    // shared one made-up zero bias (16 values for one, then 32 for both), and the batch-norm
    // fold indexed past it. Nodes now get names of their own: the model is cnn.onnx with a
    // node renamed, and computes what cnn.onnx computes.
    let regression =
        crate::testing::repo().join("fuzz/regressions/cuda_compile_duplicate_node_names.onnx");
    let run = |path: &Path| {
        let model = OnnxModel::load(path).expect("parses");
        let mut graph = import::import(&model, 1, 32, 32).expect("imports");
        passes::optimise(&mut graph);
        let input = Tensor::new(
            vec![1, 3, 32, 32],
            (0..3072).map(|i| (i % 7) as f32 / 7.0).collect(),
        );
        reference::run(&graph, &input).data.to_vec()
    };
    assert_close(&run(&regression), &run(&models().join("cnn.onnx")), 1e-6);

    // A value two nodes define is refused.
    use prost::Message;
    let mut proto = OnnxModel::load(&models().join("cnn.onnx")).unwrap().proto;
    let graph = proto.graph.as_mut().expect("graph");
    let first = graph.node[0].output[0].clone();
    graph.node[1].output[0] = first;
    let model = OnnxModel::from_bytes(&regression, &proto.encode_to_vec()).expect("parses");
    let err = import::import(&model, 1, 32, 32).expect_err("refused");
    assert!(
        (err.to_string()).contains("its output `conv_0` is already defined"),
        "{err}"
    );
}

#[test]
fn a_reshape_whose_sizes_overflow_is_refused() {
    // Found by the cuda_compile fuzzer: a Reshape target whose sizes multiply past usize
    // overflowed (a panic in debug builds; in release a wrapped product could match).
    let path = crate::testing::repo().join("fuzz/regressions/cuda_compile_reshape_overflow.onnx");
    let model = OnnxModel::load(&path).expect("parses");
    let spec = model.input_spec(None).expect("input");
    let err = super::compile(&model, &[1, 2], spec, DType::F32).expect_err("refused");
    assert!(err.to_string().contains("cannot reshape"), "{err}");
}

#[test]
fn torchvision_models_import_and_lower() {
    // The torchvision exports are 5–115 MB and not in the repository; run with
    // TRTCLASSIFY_TORCHVISION_DIR set to the output of `bench/gpu/torch_models.py export`.
    let Some(dir) = std::env::var_os("TRTCLASSIFY_TORCHVISION_DIR") else {
        skipped("torchvision_models_import_and_lower: TRTCLASSIFY_TORCHVISION_DIR is not set");
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
            let plan = lower::lower(&graph, DType::F16, &Default::default(), &mut weights, false)
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

/// A small deterministic generator, so that a proptest case is its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n.max(1)
    }

    fn small_int(&mut self) -> i64 {
        self.below(10) as i64 - 3
    }
}

/// One random damage to a model, described for the failure message.
fn mutate(proto: &mut tract_onnx::pb::ModelProto, rng: &mut Rng) -> String {
    use tract_onnx::pb::attribute_proto::AttributeType;
    let graph = proto.graph.as_mut().expect("a graph");
    let names: Vec<String> = graph
        .node
        .iter()
        .flat_map(|n| n.output.clone())
        .chain(graph.initializer.iter().map(|i| i.name.clone()))
        .chain(["".to_owned()])
        .collect();
    let n = rng.below(graph.node.len());
    let i = rng.below(graph.initializer.len());
    let node = &mut graph.node[n];
    let what = format!("node {n} ({})", node.op_type);
    match rng.below(8) {
        0 => {
            let keep = rng.below(node.input.len() + 1);
            node.input.truncate(keep);
            format!("{what} keeps {keep} inputs")
        }
        1 if !node.input.is_empty() => {
            let k = rng.below(node.input.len());
            node.input[k] = names[rng.below(names.len())].clone();
            format!("{what}: input {k} is now `{}`", node.input[k])
        }
        2 if !node.attribute.is_empty() => {
            let k = rng.below(node.attribute.len());
            let a = &mut node.attribute[k];
            let v = rng.small_int();
            match a.r#type() {
                AttributeType::Int => a.i = v,
                AttributeType::Float => a.f = v as f32 * 0.5,
                AttributeType::Ints if !a.ints.is_empty() => {
                    let k = rng.below(a.ints.len());
                    a.ints[k] = v;
                }
                AttributeType::Ints => a.ints.push(v),
                _ => a.i = v,
            }
            format!("{what}: attribute {} changed to {v}", a.name)
        }
        3 => {
            let ops = &super::import::SUPPORTED_OPS;
            node.op_type = ops[rng.below(ops.len())].to_owned();
            format!("{what} is now a {}", node.op_type)
        }
        4 => {
            graph.node.remove(n);
            format!("{what} removed")
        }
        5 if !graph.initializer.is_empty() => {
            let init = &mut graph.initializer[i];
            match rng.below(3) {
                0 => {
                    init.dims.pop();
                }
                1 => init.dims.push(1),
                _ if !init.dims.is_empty() => {
                    let k = rng.below(init.dims.len());
                    init.dims[k] = rng.below(5) as i64;
                }
                _ => init.dims.push(0),
            }
            format!("initializer {} has dims {:?}", init.name, init.dims)
        }
        6 if !graph.initializer.is_empty() => {
            let init = &mut graph.initializer[i];
            init.dims.clear();
            init.raw_data.truncate(8);
            init.float_data.truncate(1);
            init.int64_data.truncate(1);
            format!("initializer {} is a scalar", init.name)
        }
        _ => {
            let k = rng.below(node.output.len() + 1);
            node.output.truncate(k);
            format!("{what} keeps {k} outputs")
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(400),
        ..Default::default()
    })]

    /// A damaged model is an error (or, where the damage changes nothing that matters, a
    /// plan), never a panic: the front-end of the cuda engine runs on the CPU, so this runs in
    /// CI; a panic would be caught by the engine build, but as an "internal error" that does
    /// not tell the user what is wrong with the file.
    #[test]
    fn damaged_models_are_errors_not_panics(
        model in 0usize..3,
        seed in 1u64..u64::MAX,
        damages in 1usize..4,
    ) {
        use prost::Message;
        let name = ["colors.onnx", "cnn.onnx", "ops.onnx"][model];
        let path = models().join(name);
        let mut proto = OnnxModel::load(&path).expect("model loads").proto;
        let mut rng = Rng(seed);
        let done: Vec<String> = (0..damages).map(|_| mutate(&mut proto, &mut rng)).collect();
        let bytes = proto.encode_to_vec();
        let outcome = std::panic::catch_unwind(|| {
            let model = OnnxModel::from_bytes(&path, &bytes).map_err(|e| e.to_string())?;
            let spec = model.input_spec(None)?;
            if !import::unsupported_ops(&model).is_empty() {
                return Err("unsupported".to_owned());
            }
            super::compile(&model, &[1, 2], spec, DType::F16)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        if let Err(panic) = outcome {
            panic!(
                "{name} damaged by {done:?}: panicked: {}",
                crate::panic_message(&*panic)
            );
        }
    }
}

/// A small classifier built in code, for the import's refusals (docs/bad-inputs.md, rows
/// 23–29): each of those tests compiles it first, then damages one thing in it, so that the
/// refusal can only come from that damage. The image `image` [N, 3, 4, 4] goes through
///
/// `conv` (Conv, 8 channels, bias `cb`) → `split` (Split into 3 and 5 channels by `sizes`;
/// the 5 are unused) → `norm` (LayerNormalization over the last axis, `ls`, `lb`) → `pool`
/// (GlobalAveragePool) → `flatten` → `gemm` (Gemm, `B` [3, 2] and `C`) → `matmul` (MatMul
/// by `w` [2, 2]) → `scores` [N, 2].
fn built_classifier() -> tract_onnx::pb::ModelProto {
    use tract_onnx::pb;
    let floats = |name: &str, dims: &[i64]| pb::TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: 1,
        float_data: (0..dims.iter().product::<i64>())
            .map(|i| (i % 5) as f32 * 0.25 - 0.5)
            .collect(),
        ..Default::default()
    };
    let sizes = pb::TensorProto {
        name: "sizes".into(),
        dims: vec![2],
        data_type: 7,
        int64_data: vec![3, 5],
        ..Default::default()
    };
    let int = |name: &str, i: i64| pb::AttributeProto {
        name: name.into(),
        r#type: pb::attribute_proto::AttributeType::Int as i32,
        i,
        ..Default::default()
    };
    let node = |name: &str, op: &str, inputs: &[&str], outputs: &[&str], attrs| pb::NodeProto {
        name: name.into(),
        op_type: op.into(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        attribute: attrs,
        ..Default::default()
    };
    let value = |name: &str, dims: &[Option<i64>]| pb::ValueInfoProto {
        name: name.into(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: 1,
                shape: Some(pb::TensorShapeProto {
                    dim: (dims.iter())
                        .map(|d| pb::tensor_shape_proto::Dimension {
                            value: Some(match d {
                                Some(n) => pb::tensor_shape_proto::dimension::Value::DimValue(*n),
                                None => {
                                    pb::tensor_shape_proto::dimension::Value::DimParam("N".into())
                                }
                            }),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    pb::ModelProto {
        ir_version: 8,
        // LayerNormalization is an operator of opset 17.
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(pb::GraphProto {
            name: "built".into(),
            node: vec![
                node(
                    "conv",
                    "Conv",
                    &["image", "cw", "cb"],
                    &["c"],
                    vec![int("group", 1)],
                ),
                node(
                    "split",
                    "Split",
                    &["c", "sizes"],
                    &["s", "rest"],
                    vec![int("axis", 1)],
                ),
                node(
                    "norm",
                    "LayerNormalization",
                    &["s", "ls", "lb"],
                    &["n"],
                    vec![int("axis", -1)],
                ),
                node("pool", "GlobalAveragePool", &["n"], &["p"], vec![]),
                node("flatten", "Flatten", &["p"], &["f"], vec![int("axis", 1)]),
                node("gemm", "Gemm", &["f", "B", "C"], &["g"], vec![]),
                node("matmul", "MatMul", &["g", "w"], &["scores"], vec![]),
            ],
            initializer: vec![
                floats("cw", &[8, 3, 1, 1]),
                floats("cb", &[8]),
                sizes,
                floats("ls", &[4]),
                floats("lb", &[4]),
                floats("B", &[3, 2]),
                floats("C", &[2]),
                floats("w", &[2, 2]),
            ],
            input: vec![value("image", &[None, Some(3), Some(4), Some(4)])],
            output: vec![value("scores", &[None, Some(2)])],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What the cuda engine's front-end makes of `proto` (the path of the proptest above and of
/// the `cuda_compile` fuzzer): `Ok` with the plans' batch sizes, or the error's message.
fn compile_built(proto: &tract_onnx::pb::ModelProto) -> Result<Vec<usize>, String> {
    use prost::Message;
    let path = models().join("built.onnx");
    let model = OnnxModel::from_bytes(&path, &proto.encode_to_vec())
        .unwrap_or_else(|e| panic!("the load's checks pass it on to the import: {e}"));
    let spec = model.input_spec(None)?;
    assert_eq!(import::unsupported_ops(&model), Vec::<String>::new());
    let (plans, _) =
        super::compile(&model, &[1, 2], spec, DType::F16).map_err(|e| e.to_string())?;
    Ok(plans.iter().map(|p| p.batch).collect())
}

/// The built classifier's node `name`, to damage.
fn built_node<'a>(
    proto: &'a mut tract_onnx::pb::ModelProto,
    name: &str,
) -> &'a mut tract_onnx::pb::NodeProto {
    let graph = proto.graph.as_mut().expect("a graph");
    (graph.node.iter_mut().find(|n| n.name == name)).expect("the node")
}

/// The built classifier's initializer `name`, to damage.
fn built_initializer<'a>(
    proto: &'a mut tract_onnx::pb::ModelProto,
    name: &str,
) -> &'a mut tract_onnx::pb::TensorProto {
    let graph = proto.graph.as_mut().expect("a graph");
    (graph.initializer.iter_mut().find(|t| t.name == name)).expect("the initializer")
}

/// Compiles the built classifier as built (so that it is the damage that is refused), then
/// damaged by `damage`; the refusal must contain `message`.
#[track_caller]
fn assert_damage_refused(damage: impl FnOnce(&mut tract_onnx::pb::ModelProto), message: &str) {
    let mut proto = built_classifier();
    assert_eq!(compile_built(&proto), Ok(vec![1, 2]), "the model as built");
    damage(&mut proto);
    let err = compile_built(&proto).expect_err("the damaged model is refused");
    assert!(err.contains(message), "expected «{message}» in «{err}»");
}

/// MnasNet ends in `x.mean([2, 3])`: a ReduceMean over the planes without `keepdims`. It
/// runs as a global average pool, which reads the channels-last activations where they lie
/// (a mean over NCHW's last axes transposed them first), and scores as the pool does.
#[test]
fn a_mean_over_the_planes_runs_as_a_global_average_pool() {
    use prost::Message;
    use tract_onnx::pb;
    let pooled = built_classifier();
    let mut meaned = pooled.clone();
    let graph = meaned.graph.as_mut().expect("graph");
    graph.node.retain(|n| n.name != "flatten");
    let pool = graph
        .node
        .iter_mut()
        .find(|n| n.name == "pool")
        .expect("pool");
    pool.op_type = "ReduceMean".into();
    pool.output = vec!["f".into()];
    pool.attribute = vec![
        pb::AttributeProto {
            name: "axes".into(),
            r#type: pb::attribute_proto::AttributeType::Ints as i32,
            ints: vec![2, 3],
            ..Default::default()
        },
        pb::AttributeProto {
            name: "keepdims".into(),
            r#type: pb::attribute_proto::AttributeType::Int as i32,
            i: 0,
            ..Default::default()
        },
    ];
    let run = |proto: &pb::ModelProto| {
        let path = models().join("built.onnx");
        let model = OnnxModel::from_bytes(&path, &proto.encode_to_vec()).expect("loads");
        let spec = model.input_spec(None).expect("input");
        let (plans, weights) = super::compile_for_cpu(&model, &[2], spec).expect("compiles");
        let input: Vec<f32> = (0..2 * 3 * 4 * 4)
            .map(|i| (i % 7) as f32 * 0.3 - 1.0)
            .collect();
        // The kind of each step, as Debug names it.
        let steps: Vec<String> = (plans[0].steps.iter())
            .map(|s| {
                format!("{s:?}")
                    .split('(')
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect();
        (sim::run(&plans[0], &weights, &input), steps)
    };
    let (want, pool_steps) = run(&pooled);
    let (got, mean_steps) = run(&meaned);
    assert_close(&got, &want, 1e-6);
    assert_eq!(mean_steps, pool_steps);
}

/// docs/bad-inputs.md row 23.
#[test]
fn a_node_missing_a_required_input_is_named() {
    assert_damage_refused(
        |m| built_node(m, "matmul").input.truncate(1),
        "node `matmul` (MatMul): input 2 of 2 is missing",
    );
    // An empty name is an absent optional input in ONNX: for a required one, the same.
    assert_damage_refused(
        |m| built_node(m, "gemm").input[1].clear(),
        "node `gemm` (Gemm): input 2 of 2 is missing",
    );
}

/// docs/bad-inputs.md row 24.
#[test]
fn an_input_no_node_defines_is_named() {
    assert_damage_refused(
        |m| built_node(m, "matmul").input[0] = "nowhere".into(),
        "node `matmul` (MatMul): input `nowhere` is not defined before use",
    );
    // A value defined only by a later node is not defined yet: the graph is not in order.
    assert_damage_refused(
        |m| built_node(m, "gemm").input[0] = "scores".into(),
        "node `gemm` (Gemm): input `scores` is not defined before use",
    );
}

/// docs/bad-inputs.md row 25: an axis the load's rank check does not look at
/// (LayerNormalization's), which the import refuses.
#[test]
fn an_axis_out_of_range_is_named() {
    assert_damage_refused(
        |m| built_node(m, "norm").attribute[0].i = 7,
        "node `norm` (LayerNormalization): axis 7 is out of range for a tensor of rank 4",
    );
    assert_damage_refused(
        |m| built_node(m, "norm").attribute[0].i = -5,
        "node `norm` (LayerNormalization): axis -5 is out of range for a tensor of rank 4",
    );
}

/// docs/bad-inputs.md row 26.
#[test]
fn negative_sizes_group_or_split_are_refused() {
    assert_damage_refused(
        |m| built_node(m, "conv").attribute[0].i = -2,
        "node `conv` (Conv): group [-2] has a negative value",
    );
    assert_damage_refused(
        |m| built_initializer(m, "sizes").int64_data = vec![9, -1],
        "node `split` (Split): split [9, -1] has a negative value",
    );
}

/// docs/bad-inputs.md row 27.
#[test]
fn a_gemm_weight_that_is_not_a_matrix_is_refused() {
    assert_damage_refused(
        |m| {
            let b = built_initializer(m, "B");
            (b.dims, b.float_data) = (vec![16], vec![0.5; 16]);
        },
        "node `gemm` (Gemm): B must be a matrix; it has shape [16]",
    );
}

/// docs/bad-inputs.md row 28.
#[test]
fn a_bias_of_the_wrong_length_is_refused() {
    assert_damage_refused(
        |m| {
            let b = built_initializer(m, "cb");
            (b.dims, b.float_data) = (vec![16], vec![0.5; 16]);
        },
        "node `conv` (Conv): the bias has shape [16]; 8 output channels need [8]",
    );
}

/// docs/bad-inputs.md row 29: the data is read before any node, so the message names the
/// tensor.
#[test]
fn an_initializer_whose_data_does_not_fit_its_dims_is_refused() {
    // B holds 3 × 2 values; dims of [2, 2] leave two over.
    assert_damage_refused(
        |m| built_initializer(m, "B").dims = vec![2, 2],
        "tensor `B` holds 6 values for shape [2, 2]",
    );
    // The same in raw bytes, as exporters write weights: 6 f32 values, 24 bytes.
    assert_damage_refused(
        |m| {
            let b = built_initializer(m, "B");
            b.raw_data = b.float_data.drain(..).flat_map(f32::to_le_bytes).collect();
            b.dims = vec![2, 2];
        },
        "tensor `B` holds 6 values for shape [2, 2]",
    );
}

/// Says a test did not run, on stderr directly so that the harness does not capture it.
fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {why}");
}

/// Mixed precision: whatever nodes an fp16 plan keeps in f32, the plan passes its checks and,
/// run step by step, gives the graph's answer; the kept nodes' steps write only the f32
/// arena and read f32 weights, the others never touch either, and a value crosses between
/// the two by a cast. Kept sets: every third node (three ways), which puts kept and fp16
/// nodes next to each other everywhere, through views, residual adds, attention and the
/// scores.
#[test]
fn any_nodes_kept_in_f32_give_the_same_answers() {
    let transformer = transformer_input();
    let cases = [
        ("cnn.onnx", None),
        ("ops.onnx", None),
        ("big_activations.onnx", None),
        ("transformers/vit.onnx", Some("vit")),
        ("transformers/swin.onnx", Some("swin")),
    ];
    for (file, transformer_name) in cases {
        let model = OnnxModel::load(&models().join(file)).expect("model loads");
        let spec = model.input_spec(None).expect("fixed input size");
        let (input, want) = match transformer_name {
            Some(name) => (transformer.data.to_vec(), transformer_reference(name)),
            None => {
                let r = load_reference(&file.replace(".onnx", "_reference.json"));
                (r.input.data[..2 * spec.frame_len()].to_vec(), r.output)
            }
        };
        let (plans, _) = super::compile(&model, &[2], spec, DType::F16).expect("compiles");
        let mut nodes: Vec<String> = Vec::new();
        for origin in &plans[0].origins {
            if !nodes.contains(origin) {
                nodes.push(origin.clone());
            }
        }
        for phase in 0..3 {
            let kept: Vec<String> = nodes.iter().skip(phase).step_by(3).cloned().collect();
            let (mut plans, weights) =
                super::compile_mixed(&model, &[2], spec, DType::F16, &kept).expect("compiles");
            let plan = &mut plans[0];
            let what = format!("{file}, every third node from {phase}");
            assert!(plan.wide_len > 0, "{what}: nothing kept in f32");
            let weight =
                |i: usize| (weights.data.get(i)).map(|d| (d.len(), weights.dtype(i, DType::F16)));
            let (frame_len, classes) = (plan.input_len / 2, plan.output_len / 2);
            check::check_plan(plan, &weight, DType::F16, frame_len, classes)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let mut casts = 0;
            assert_eq!(
                plan.steps.len(),
                plan.origins.len(),
                "{what}: an origin a step"
            );
            for (step, origin) in plan.steps.iter_mut().zip(&plan.origins) {
                let wide = step.is_wide();
                if let Step::Ew(EwStep { cast, .. }) = step {
                    casts += usize::from(matches!(cast, Cast::ToF32 | Cast::FromF32));
                }
                for loc in step.locs_mut() {
                    match *loc {
                        Loc::Wide(_) => {}
                        Loc::Weight { index, .. } => assert_eq!(
                            weights.wide[index], wide,
                            "{what}: a weight of {origin} in the other type"
                        ),
                        _ => {}
                    }
                }
            }
            assert!(casts > 1, "{what}: {casts} casts");
            assert!(
                plan.steps.iter().any(|s| !s.is_wide()
                    && !matches!(
                        s,
                        Step::Ew(EwStep {
                            cast: Cast::ToF32 | Cast::FromF32 | Cast::F32,
                            ..
                        })
                    )),
                "{what}: nothing left in fp16"
            );
            let got = sim::run(plan, &weights, &input);
            assert_close(&got, &want[..got.len()], 1e-4);
        }
    }
}

/// The checks refuse a step that reads a value kept in f32 as if it were fp16, or writes one
/// without being a step of a kept node: either would read or write half or twice the bytes.
#[test]
fn the_checks_hold_each_buffer_to_its_type() {
    let model = OnnxModel::load(&models().join("big_activations.onnx")).expect("model loads");
    let spec = model.input_spec(None).expect("fixed input size");
    let kept = ["conv_0".to_owned()];
    let (plans, weights) =
        super::compile_mixed(&model, &[1], spec, DType::F16, &kept).expect("compiles");
    let weight = |i: usize| (weights.data.get(i)).map(|d| (d.len(), weights.dtype(i, DType::F16)));
    let (frame_len, classes) = (plans[0].input_len, plans[0].output_len);
    let check = |mut plan: super::plan::Plan| {
        check::check_plan(&mut plan, &weight, DType::F16, frame_len, classes)
    };
    check(plans[0].clone()).expect("the plan as lowered passes");
    let conv = plans[0]
        .steps
        .iter()
        .position(|s| matches!(s, Step::Conv(_)))
        .expect("a convolution");
    assert!(plans[0].steps[conv].is_wide(), "conv_0 is kept in f32");
    // The convolution writing the fp16 arena while reading f32 ones.
    let mut plan = plans[0].clone();
    let Step::Conv(c) = &mut plan.steps[conv] else {
        unreachable!()
    };
    c.y = Loc::Arena(0);
    let err = check(plan).expect_err("refused").to_string();
    assert!(err.contains("wrong type"), "{err}");
    // A plain copy (not a cast) out of the f32 arena into the fp16 one.
    let mut plan = plans[0].clone();
    let cast = plan
        .steps
        .iter()
        .position(|s| matches!(s, Step::Ew(EwStep { cast: Cast::ToF32, out, .. }) if matches!(out.loc, Loc::Wide(_))))
        .expect("the frames cast into the f32 arena");
    let Step::Ew(EwStep { cast: c, .. }) = &mut plan.steps[cast] else {
        unreachable!()
    };
    *c = Cast::None;
    let err = check(plan).expect_err("refused").to_string();
    assert!(err.contains("wrong type"), "{err}");
    // An f32 arena in an fp32 plan.
    let (mut plans32, _) = super::compile(&model, &[1], spec, DType::F32).expect("compiles");
    plans32[0].wide_len = 16;
    let err = check::check_plan(&mut plans32[0], &weight, DType::F32, frame_len, classes)
        .expect_err("refused")
        .to_string();
    assert!(err.contains("f32 arena"), "{err}");
}

#[test]
fn scales_and_shifts_after_a_product_become_its_own() {
    // LeViT's linear layers: a product, its rows flattened, a batch norm's per-column scale
    // and shift, the rows unflattened. The scale goes into the weights and bias, the shift
    // into the bias: one product and the two reshapes are left, with the same answers.
    let seq = |n: usize, scale: f32| {
        (0..n)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) * scale)
            .collect()
    };
    let mut graph = Graph {
        input: "x".into(),
        output: "y".into(),
        ..Default::default()
    };
    graph.nodes = vec![
        node("gemm", Op::Gemm { act: Act::None }, &["x", "w"], "p"),
        node("flatten", Op::Reshape, &["p"], "rows"),
        node(
            "scale",
            Op::Binary {
                op: BinOp::Mul,
                act: Act::None,
            },
            &["rows", "s"],
            "scaled",
        ),
        node(
            "shift",
            Op::Binary {
                op: BinOp::Add,
                act: Act::None,
            },
            &["t", "scaled"],
            "shifted",
        ),
        node("unflatten", Op::Reshape, &["shifted"], "y"),
    ];
    for (value, shape) in [
        ("x", vec![2, 4, 6]),
        ("p", vec![2, 4, 5]),
        ("rows", vec![8, 5]),
        ("scaled", vec![8, 5]),
        ("shifted", vec![8, 5]),
        ("y", vec![2, 4, 5]),
    ] {
        graph.shapes.insert(value.into(), shape);
    }
    graph
        .consts
        .insert("w".into(), Tensor::new(vec![6, 5], seq(30, 0.1)));
    graph
        .consts
        .insert("s".into(), Tensor::new(vec![5], seq(5, 0.3)));
    graph
        .consts
        .insert("t".into(), Tensor::new(vec![1, 5], seq(5, 0.7)));
    let input = Tensor::new(vec![2, 4, 6], seq(48, 0.05));
    let want = reference::run(&graph, &input);
    passes::optimise(&mut graph);
    assert_close(&reference::run(&graph, &input).data, &want.data, 1e-6);
    let ops: Vec<&str> = graph.nodes.iter().map(|n| n.op.name()).collect();
    assert_eq!(ops, ["Gemm", "Reshape", "Reshape"]);
    assert_eq!(graph.nodes[0].inputs.len(), 3, "a bias");
}

/// The plans of the committed models, one of each kind of step (and of each activation and
/// cast an element-wise step carries), as an engine file stores them (`plan/format.json`).
/// Engine files written before a change to the plan's types must still be read, so a change
/// here is a change of the engine file's format (raise `FORMAT_VERSION` in
/// trtclassify-cuda's `engine_file.rs`) or a mistake. `TRTCLASSIFY_BLESS=1` rewrites the file
/// after a deliberate change; `TRTCLASSIFY_DUMP_PLANS=DIR` writes every plan whole, to compare
/// the lowering before and after a change that should not alter it.
#[test]
fn plans_keep_the_engine_file_format() {
    let mut samples = std::collections::BTreeMap::<String, serde_json::Value>::new();
    let mut keep = |key: String, value: serde_json::Value| {
        samples.entry(key).or_insert(value);
    };
    let dump = std::env::var_os("TRTCLASSIFY_DUMP_PLANS").map(std::path::PathBuf::from);
    let models_and_kept: [(&str, &[&str]); 6] = [
        ("cnn.onnx", &[]),
        ("ops.onnx", &[]),
        ("ops_rare.onnx", &[]),
        ("big_activations.onnx", &["conv_0"]),
        ("transformers/vit.onnx", &[]),
        ("transformers/swin.onnx", &[]),
    ];
    for (name, kept) in models_and_kept {
        let model = OnnxModel::load(&models().join(name)).expect("model loads");
        let spec = (model.input_spec(None))
            .or_else(|_| model.input_spec(Some((224, 224))))
            .expect("an input");
        let kept: Vec<String> = kept.iter().map(|k| k.to_string()).collect();
        for dtype in [DType::F32, DType::F16] {
            let (plans, _) =
                super::compile_mixed(&model, &[2], spec, dtype, &kept).expect("compiles");
            let mut plan = plans.into_iter().next().expect("a plan");
            if let Some(dir) = &dump {
                std::fs::create_dir_all(dir).expect("dump folder");
                let file = dir.join(format!("{}.{dtype:?}.json", name.replace('/', "_")));
                let json = serde_json::to_string_pretty(&plan).expect("serialises");
                std::fs::write(file, json).expect("dump written");
            }
            for step in &plan.steps {
                let value = serde_json::to_value(step).expect("serialises");
                let kind = value.as_object().and_then(|o| o.keys().next().cloned());
                let kind = kind.expect("a step is written as {kind: fields}");
                if let Step::Ew(EwStep { act, cast, op, .. }) = step {
                    keep(format!("Ew act {act:?}"), value.clone());
                    keep(format!("Ew cast {cast:?}"), value.clone());
                    keep(format!("Ew op {op:?}"), value.clone());
                }
                if let Step::Softmax(SoftmaxStep { bias: Some(_), .. }) = step {
                    keep("Softmax with bias".into(), value.clone());
                }
                if matches!(step, Step::Conv(c) if !c.act_in.is_none()) {
                    keep("Conv with its input's activation".into(), value.clone());
                }
                keep(kind, value);
            }
            // A convolution as tuning leaves it, with its algorithm.
            if let Some(Step::Conv(c)) = plan.steps.iter().find(|s| matches!(s, Step::Conv(_))) {
                let mut c = c.clone();
                c.algo = Some(super::plan::Tuned {
                    algo: 1,
                    math: 2,
                    workspace: 4096,
                    fused: true,
                });
                keep(
                    "Conv tuned".into(),
                    serde_json::to_value(Step::Conv(c)).unwrap(),
                );
            }
            // A product as tuning leaves it, with cuBLASLt's algorithm.
            if let Some(Step::Gemm(g)) = plan.steps.iter().find(|s| matches!(s, Step::Gemm(_))) {
                let g = GemmStep {
                    algo: Some([1, 2, 3, 4, 5, 6, 7, u64::MAX]),
                    ..g.clone()
                };
                keep(
                    "Gemm tuned".into(),
                    serde_json::to_value(Step::Gemm(g.clone())).unwrap(),
                );
                // Quantized, with its 8-bit product's algorithm.
                let q = GemmStep {
                    algo: None,
                    quant: Some(super::plan::Quant {
                        format: super::plan::QuantFormat::Fp8,
                        x_scale: 0.5,
                        w_scales: Loc::Weight {
                            index: 9,
                            offset: 0,
                        },
                        algo: Some([8, 7, 6, 5, 4, 3, 2, 1]),
                        kernel: None,
                    }),
                    ..g
                };
                keep(
                    "Gemm quantized, tuned".into(),
                    serde_json::to_value(Step::Gemm(q.clone())).unwrap(),
                );
                // Quantized to int8, run by the engine's own kernel.
                let own = GemmStep {
                    quant: (q.quant).map(|quant| super::plan::Quant {
                        format: super::plan::QuantFormat::Int8,
                        algo: None,
                        kernel: Some(super::plan::EightBitKernel::Own(
                            super::plan::OwnWidth::Cols64,
                        )),
                        ..quant
                    }),
                    ..q
                };
                keep(
                    "Gemm quantized, own kernel".into(),
                    serde_json::to_value(Step::Gemm(own)).unwrap(),
                );
            }
            plan.steps.truncate(1);
            plan.origins.truncate(1);
            keep(
                format!("Plan {dtype:?}"),
                serde_json::to_value(&plan).unwrap(),
            );
        }
    }
    // No committed model's plan has a row mean (their means are global average pools).
    let mean = Step::RowMean(RowMeanStep {
        rows: 2,
        len: 3,
        x: Loc::Arena(0),
        y: Loc::Arena(8),
    });
    keep("RowMean".into(), serde_json::to_value(mean).unwrap());
    // Nor a clip or a SiLU as a step of its own (`lower::depthwise` takes them into the
    // depthwise convolutions after them), nor a sigmoid (`lower::gate` takes them into the
    // gates), though other plans keep them.
    for act in [
        Act::Clip(0.0, 6.0),
        Act::Silu,
        Act::Sigmoid,
        Act::HardSigmoid(1.0 / 6.0, 0.5),
    ] {
        let whole = super::plan::Strided {
            loc: Loc::Arena(0),
            strides: vec![1],
        };
        let step = Step::Ew(EwStep {
            op: None,
            act,
            cast: Cast::None,
            dims: vec![4096],
            out: whole.clone(),
            a: whole,
            b: None,
        });
        keep(
            format!("Ew act {act:?}"),
            serde_json::to_value(step).unwrap(),
        );
    }
    let mut text = String::from("{\n");
    let entries: Vec<String> = (samples.iter())
        .map(|(k, v)| format!("  {}: {v}", serde_json::Value::from(k.as_str())))
        .collect();
    text += &entries.join(",\n");
    text += "\n}\n";
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/plan/format.json");
    if std::env::var_os("TRTCLASSIFY_BLESS").is_some() {
        std::fs::write(&path, &text).expect("plan/format.json written");
    }
    let want = std::fs::read_to_string(&path).unwrap_or_default();
    // Line by line, so that a failure names the kind that changed.
    for (got, want) in text.lines().zip(want.lines()) {
        assert_eq!(
            got,
            want,
            "a step's engine-file form changed ({})",
            path.display()
        );
    }
    assert_eq!(
        text,
        want,
        "the kinds of steps changed ({})",
        path.display()
    );
}

/// The project map names files that exist: every path in `docs/architecture.md` that starts
/// at the repository's root (a `*` matching at least one file of its folder; `<name>`
/// placeholders aside), so that a move or a rename cannot leave the map behind.
#[test]
fn the_project_map_names_files_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let map = std::fs::read_to_string(root.join("docs/architecture.md")).expect("the map");
    let tops = [
        "crates/",
        "src/",
        "tests/",
        "docs/",
        "bench/",
        "scripts/",
        "pipelines/",
        "models/",
        "examples/",
        "fuzz/",
    ];
    let mut checked = 0;
    let mut missing = Vec::new();
    for path in map.split('`').skip(1).step_by(2) {
        if !tops.iter().any(|t| path.starts_with(t)) || path.contains('<') || path.contains(' ') {
            continue;
        }
        checked += 1;
        let found = match path.rsplit_once('/') {
            Some((dir, pattern)) if pattern.contains('*') => {
                let (before, after) = pattern.split_once('*').expect("a star");
                std::fs::read_dir(root.join(dir)).is_ok_and(|entries| {
                    entries.flatten().any(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        name.starts_with(before) && name.ends_with(after)
                    })
                })
            }
            _ => root.join(path).exists(),
        };
        if !found {
            missing.push(path);
        }
    }
    assert!(checked > 50, "only {checked} paths found in the map");
    assert!(missing.is_empty(), "docs/architecture.md names {missing:?}");
}
