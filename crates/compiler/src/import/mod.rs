// SPDX-License-Identifier: MPL-2.0
//! ONNX to IR, for one batch size and input size: every shape is settled, so the
//! Shape/Gather/Concat/Reshape chains of PyTorch exports fold to constants here, and what
//! is left of the graph is the computation on the image.
//!
//! Operators are imported by their family's module in `ops/` (see there), which declares
//! the operators it takes in its `OPS` and their required inputs in its `required_inputs`;
//! `FAMILIES` below lists the families, and the supported operators are what they declare.
//! This module walks the graph, checks what every node needs, and folds what is computed
//! from constants only. `tensor` reads ONNX tensors, `attrs` node attributes.

pub(crate) mod attrs;
pub(crate) mod tensor;

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;

use tract_onnx::pb;

use super::CompileError;
use super::ir::{Graph, Node, Op, Tensor};
use super::reference;
use crate::OnnxModel;
use crate::ops::{conv, elementwise, matmul, normalization, resize, shape, shape_arithmetic};
use attrs::Attrs;

/// A family of operators: the ONNX operators (default domain) one module of `ops/` imports,
/// how many inputs each requires, and the function that imports them.
struct Family {
    /// The file, and what its operators become (for `docs/operators.md`).
    name: &'static str,
    becomes: &'static str,
    ops: &'static [&'static str],
    required_inputs: fn(op: &str, opset: i64) -> usize,
    import: fn(&mut Importer, &OnnxNode) -> Result<Handled, String>,
}

/// Every family of operators; an operator belongs to exactly one.
const FAMILIES: &[Family] = &[
    Family {
        name: "conv",
        becomes: "convolutions (cuDNN on the GPU) with their bias, batch norm, activation and residual fused; pooling",
        ops: conv::OPS,
        required_inputs: conv::required_inputs,
        import: conv::import,
    },
    Family {
        name: "elementwise",
        becomes: "element-wise steps, fused into the product or convolution before them where they can be; GELU's five nodes become a product's activation, its tanh form eight steps",
        ops: elementwise::OPS,
        required_inputs: elementwise::required_inputs,
        import: elementwise::import,
    },
    Family {
        name: "matmul",
        becomes: "matrix products (cuBLASLt), batched for attention; an Einsum that is a batched product becomes transposes and one",
        ops: matmul::OPS,
        required_inputs: matmul::required_inputs,
        import: matmul::import,
    },
    Family {
        name: "normalization",
        becomes: "row kernels: softmax, layer norm (instance norm as one, then its scale and bias), means; sums and L2 norms from a mean",
        ops: normalization::OPS,
        required_inputs: normalization::required_inputs,
        import: normalization::import,
    },
    Family {
        name: "resize",
        becomes: "products with constant interpolation matrices (nearest, linear), one per resized axis",
        ops: resize::OPS,
        required_inputs: resize::required_inputs,
        import: resize::import,
    },
    Family {
        name: "shape",
        becomes: "reshapes (free), transposes, slices, concatenation and padding of activations; on constants, evaluated at import",
        ops: shape::OPS,
        required_inputs: shape::required_inputs,
        import: shape::import,
    },
    Family {
        name: "shape_arithmetic",
        becomes: "evaluated at import, with the batch and input size fixed: never run",
        ops: shape_arithmetic::OPS,
        required_inputs: shape_arithmetic::required_inputs,
        import: shape_arithmetic::import,
    },
];

/// Whether a family's `import` took the node: `NotMine` for an operator it does not handle,
/// which the dispatch reports as unsupported (and a test finds, should a family's `OPS` name
/// an operator its `import` lacks).
#[derive(Debug, PartialEq)]
pub(crate) enum Handled {
    Yes,
    NotMine,
}

/// ONNX operators the engine runs or folds away (default domain): those the families
/// declare, sorted as a dictionary would.
pub(crate) static SUPPORTED_OPS: LazyLock<Vec<&'static str>> = LazyLock::new(|| {
    let mut ops: Vec<&str> = FAMILIES.iter().flat_map(|f| f.ops).copied().collect();
    ops.sort_by_key(|op| op.to_ascii_lowercase());
    ops
});

/// The table of supported operators in `docs/operators.md`, made from the families'
/// declarations (a test keeps the file in step).
pub fn operator_table() -> String {
    let mut table =
        String::from("| ONNX operators | imported by | what they become |\n|---|---|---|\n");
    for f in FAMILIES {
        let mut ops = f.ops.to_vec();
        ops.sort_by_key(|op| op.to_ascii_lowercase());
        table += &format!(
            "| {} | `ops/{}.rs` | {} |\n",
            ops.join(", "),
            f.name,
            f.becomes
        );
    }
    table
}

fn family(op: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.ops.contains(&op))
}

/// The operators of `model` that the engine lacks, each once.
pub fn unsupported_ops(model: &OnnxModel) -> Vec<String> {
    model
        .op_types()
        .into_iter()
        .filter(|op| !SUPPORTED_OPS.contains(&op.as_str()))
        .collect()
}

/// Builds the graph for `batch` frames of `height`×`width` (`compile` reads the
/// initializers once for all its batch sizes instead).
#[cfg(test)]
pub(super) fn import(
    model: &OnnxModel,
    batch: usize,
    height: usize,
    width: usize,
) -> Result<Graph, CompileError> {
    import_with(model, &initializers(model)?, batch, height, width)
}

/// The model's initializers as tensors: read once for the imports of every batch size, since
/// a large model's weights are gigabytes in files of their own.
pub(super) fn initializers(model: &OnnxModel) -> Result<Vec<(String, Tensor)>, CompileError> {
    let graph = model_graph(model)?;
    let dir = model.folder();
    graph
        .initializer
        .iter()
        .map(|init| {
            let t = tensor::tensor(init, &dir).map_err(CompileError::Weights)?;
            Ok((init.name.clone(), t))
        })
        .collect()
}

fn model_graph(model: &OnnxModel) -> Result<&pb::GraphProto, CompileError> {
    (model.proto.graph.as_ref())
        .ok_or_else(|| CompileError::Model("the model holds no graph".into()))
}

/// `import` with the model's `initializers` already read; their tensors are shared, not
/// copied.
pub(super) fn import_with(
    model: &OnnxModel,
    initializers: &[(String, Tensor)],
    batch: usize,
    height: usize,
    width: usize,
) -> Result<Graph, CompileError> {
    let graph = model_graph(model)?;
    let opset = model
        .proto
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map_or(13, |o| o.version);
    let input_shape = model
        .input
        .layout
        .shape(batch, model.input.channels, height, width)
        .to_vec();
    let mut importer = Importer::new(&model.input.name, input_shape, opset, model.folder());
    for (name, t) in initializers {
        importer.graph.consts.insert(name.clone(), t.clone());
    }
    for init in graph
        .initializer
        .iter()
        .filter(|t| is_integer_type(t.data_type))
    {
        importer.integers.insert(init.name.clone());
    }
    // Constants made for a node are named after it, so each node gets a name of its own
    // (ONNX does not require them to be unique).
    let mut names = HashSet::new();
    for (i, node) in graph.node.iter().enumerate() {
        let mut name = if node.name.is_empty() {
            node.output.first().cloned().unwrap_or_default()
        } else {
            node.name.clone()
        };
        if !names.insert(name.clone()) {
            name = format!("{name}#{i}");
            names.insert(name.clone());
        }
        let fail = |problem: String| CompileError::Node {
            node: name.clone(),
            op: node.op_type.clone(),
            problem,
        };
        if let Some(out) = (node.output.iter()).find(|o| !o.is_empty() && importer.is_defined(o)) {
            return Err(fail(format!("its output `{out}` is already defined")));
        }
        let first_new = importer.graph.nodes.len();
        importer
            .node(node, &name)
            .and_then(|()| finite_parameters(&importer.graph.nodes[first_new..]))
            .map_err(fail)?;
    }
    let output = importer.resolve(&model.output);
    importer.graph.output = output;
    if importer.graph.is_const(&importer.graph.output) {
        return Err(CompileError::Model(
            "the output does not depend on the image".into(),
        ));
    }
    importer.graph.prune_consts();
    Ok(importer.graph)
}

/// The graph being imported, and what the families need to add to it.
pub(crate) struct Importer {
    pub(crate) graph: Graph,
    /// Values that are another value under a second name (Identity, Dropout).
    pub(crate) alias: HashMap<String, String>,
    /// Constants of an integer (or boolean) type: held as f32 like the others, but their
    /// division truncates (`(192 + 2) / 3` is 64 in MaxViT's query/key/value split).
    pub(crate) integers: HashSet<String>,
    pub(crate) opset: i64,
    /// The model's folder, for Constant values in external data.
    pub(crate) dir: std::path::PathBuf,
}

/// One ONNX node as the families read it.
pub(crate) struct OnnxNode<'a> {
    pub(crate) proto: &'a pb::NodeProto,
    /// The node's name, unique in the graph: made-up constants are named after it.
    pub(crate) name: &'a str,
    pub(crate) attrs: Attrs<'a>,
}

impl OnnxNode<'_> {
    pub(crate) fn op(&self) -> &str {
        &self.proto.op_type
    }

    /// The inputs as named, optional ones absent given as empty names.
    pub(crate) fn inputs(&self) -> &[String] {
        &self.proto.input
    }

    /// Input `i`, if it is given (optional inputs are given as empty names).
    pub(crate) fn input(&self, i: usize) -> Option<String> {
        self.proto.input.get(i).filter(|s| !s.is_empty()).cloned()
    }

    /// The first input, the one most operators compute on.
    pub(crate) fn x(&self) -> String {
        self.input(0).unwrap_or_default()
    }

    pub(crate) fn outputs(&self) -> &[String] {
        &self.proto.output
    }

    /// The first output (named: the dispatch checks it).
    pub(crate) fn out(&self) -> String {
        self.proto.output.first().cloned().unwrap_or_default()
    }
}

impl Importer {
    pub(crate) fn new(
        input: &str,
        input_shape: Vec<usize>,
        opset: i64,
        dir: std::path::PathBuf,
    ) -> Self {
        let mut graph = Graph {
            input: input.to_owned(),
            ..Graph::default()
        };
        graph.shapes.insert(input.to_owned(), input_shape);
        Importer {
            graph,
            alias: HashMap::new(),
            integers: HashSet::new(),
            opset,
            dir,
        }
    }

    pub(crate) fn resolve(&self, name: &str) -> String {
        let mut name = name;
        while let Some(next) = self.alias.get(name) {
            name = next;
        }
        name.to_owned()
    }

    pub(crate) fn shape(&self, name: &str) -> Result<Vec<usize>, String> {
        let name = self.resolve(name);
        self.graph
            .shapes
            .get(&name)
            .or_else(|| self.graph.consts.get(&name).map(|t| &t.shape))
            .cloned()
            .ok_or_else(|| format!("input `{name}` is not defined before use"))
    }

    pub(crate) fn constant(&self, name: &str) -> Option<&Tensor> {
        self.graph.consts.get(&self.resolve(name))
    }

    pub(crate) fn need_const(&self, name: &str, what: &str) -> Result<&Tensor, String> {
        self.constant(name)
            .ok_or_else(|| format!("its {what} (`{name}`) must be a constant"))
    }

    pub(crate) fn add(
        &mut self,
        name: &str,
        op: Op,
        inputs: Vec<String>,
        output: &str,
        shape: Vec<usize>,
    ) {
        let inputs: Vec<String> = inputs.iter().map(|i| self.resolve(i)).collect();
        let node = Node {
            name: name.to_owned(),
            op,
            inputs,
            output: output.to_owned(),
        };
        // Anything computed from constants only is a constant.
        if node
            .inputs
            .iter()
            .all(|i| self.graph.consts.contains_key(i))
        {
            let values: Vec<&Tensor> = node.inputs.iter().map(|i| &self.graph.consts[i]).collect();
            let t = reference::eval(&node, &values, &shape);
            self.graph.consts.insert(output.to_owned(), t);
        } else {
            self.graph.shapes.insert(output.to_owned(), shape);
            self.graph.nodes.push(node);
        }
    }

    /// Whether `value` is the input, a constant or a computed value already.
    pub(crate) fn is_defined(&self, value: &str) -> bool {
        self.graph.shapes.contains_key(value)
            || self.graph.consts.contains_key(value)
            || self.alias.contains_key(value)
    }

    pub(crate) fn set_const(&mut self, output: &str, t: Tensor) {
        self.graph.consts.insert(output.to_owned(), t);
    }

    /// Checks what every operator needs (its required inputs named and defined, an output),
    /// then hands the node to the family that declares its operator.
    pub(crate) fn node(&mut self, proto: &pb::NodeProto, name: &str) -> Result<(), String> {
        let op = proto.op_type.as_str();
        let family = family(op);
        // Every input the operator requires is named, so that the families may index them.
        let required = family.map_or(1, |f| (f.required_inputs)(op, self.opset));
        if let Some(k) = (0..required).find(|&k| proto.input.get(k).is_none_or(String::is_empty)) {
            return Err(format!("input {} of {required} is missing", k + 1));
        }
        if proto.output.first().is_none_or(String::is_empty) {
            return Err("the node has no output".into());
        }
        for input in proto.input.iter().filter(|i| !i.is_empty()) {
            self.shape(input)?;
        }
        let node = OnnxNode {
            proto,
            name,
            attrs: Attrs(&proto.attribute),
        };
        match family.map(|f| (f.import)(self, &node)).transpose()? {
            Some(Handled::Yes) => {
                self.note_integers(&node);
                Ok(())
            }
            Some(Handled::NotMine) | None => Err(format!("the operator {op} is not supported")),
        }
    }

    /// Whether `value` is a constant of an integer type.
    pub(crate) fn is_integer(&self, value: &str) -> bool {
        let value = self.resolve(value);
        self.integers.contains(&value) && self.graph.consts.contains_key(&value)
    }

    /// Records which constant outputs of `node` are integers: what shape operators give,
    /// casts and constants of integer types, and whatever is computed from integers only.
    pub(crate) fn note_integers(&mut self, node: &OnnxNode) {
        let attrs = &node.attrs;
        let integer = match node.op() {
            "Shape" | "Size" | "Equal" | "Not" | "Less" | "Greater" => true,
            "Cast" => is_integer_type(attrs.i("to").unwrap_or(1) as i32),
            "Constant" | "ConstantOfShape" => match attrs.tensor("value") {
                Some(t) => is_integer_type(t.data_type),
                None => attrs.i("value_int").is_some() || attrs.ints("value_ints").is_some(),
            },
            // Where picks from its second and third inputs; the condition is boolean.
            "Where" => node.inputs()[1..].iter().all(|i| self.is_integer(i)),
            _ => {
                let mut inputs = node.inputs().iter().filter(|i| !i.is_empty()).peekable();
                inputs.peek().is_some() && inputs.all(|i| self.is_integer(i))
            }
        };
        if integer {
            let outputs: Vec<String> = (node.outputs().iter())
                .filter(|o| self.constant(o).is_some())
                .map(|o| self.resolve(o))
                .collect();
            self.integers.extend(outputs);
        }
    }
}

/// Whether an ONNX `TensorProto.DataType` holds integers or booleans.
fn is_integer_type(data_type: i32) -> bool {
    // UINT8, INT8, UINT16, INT16, INT32, INT64, BOOL, UINT32, UINT64.
    matches!(data_type, 2..=7 | 9 | 12 | 13)
}

/// Refuses operator parameters that are not finite numbers (a NaN epsilon, an infinite
/// slope): what they would compute is not meant, and an engine file could not store them.
fn finite_parameters(nodes: &[Node]) -> Result<(), String> {
    for node in nodes {
        if let Some(v) = node.op.parameters().into_iter().find(|v| !v.is_finite()) {
            return Err(format!("a parameter is {v}, not a finite number"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An importer whose one value is an image `x` of [1, 3, 4, 4].
    fn importer() -> Importer {
        Importer::new("x", vec![1, 3, 4, 4], 13, std::path::PathBuf::new())
    }

    /// A node of `op` whose five inputs are all the image: every family's checks run on
    /// it (most refuse it, which is fine), but none panics.
    fn node_of(op: &str) -> pb::NodeProto {
        pb::NodeProto {
            op_type: op.to_owned(),
            input: vec!["x".to_owned(); 5],
            output: vec!["y".to_owned()],
            ..Default::default()
        }
    }

    #[test]
    fn every_supported_operator_is_imported_by_exactly_the_family_declaring_it() {
        assert!(!SUPPORTED_OPS.is_empty());
        let mut sorted = SUPPORTED_OPS.clone();
        sorted.dedup();
        assert_eq!(sorted, *SUPPORTED_OPS, "an operator declared twice");
        for &op in SUPPORTED_OPS.iter() {
            let declaring: Vec<usize> = (0..FAMILIES.len())
                .filter(|&f| FAMILIES[f].ops.contains(&op))
                .collect();
            assert_eq!(
                declaring.len(),
                1,
                "{op} is declared by families {declaring:?}"
            );
            let proto = node_of(op);
            let node = OnnxNode {
                proto: &proto,
                name: "n",
                attrs: Attrs(&proto.attribute),
            };
            let taking: Vec<usize> = (0..FAMILIES.len())
                .filter(|&f| (FAMILIES[f].import)(&mut importer(), &node) != Ok(Handled::NotMine))
                .collect();
            assert_eq!(taking, declaring, "the families whose import takes {op}");
            // And the dispatch, past its checks of inputs and outputs, does not refuse it.
            let refused = Err(format!("the operator {op} is not supported"));
            assert_ne!(importer().node(&proto, "n"), refused);
        }
        // An operator no family declares is refused by the dispatch, after the same checks.
        let refused = Err("the operator FrobnicateImage is not supported".to_owned());
        assert_eq!(importer().node(&node_of("FrobnicateImage"), "n"), refused);
    }

    fn node(
        op: &str,
        inputs: &[&str],
        output: &str,
        attrs: &[(&str, i64, &[u8])],
    ) -> pb::NodeProto {
        pb::NodeProto {
            op_type: op.to_owned(),
            input: inputs.iter().map(|i| (*i).to_owned()).collect(),
            output: vec![output.to_owned()],
            attribute: (attrs.iter())
                .map(|&(name, i, s)| pb::AttributeProto {
                    name: name.to_owned(),
                    i,
                    s: s.to_vec(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_documented_operator_table_is_the_code_s() {
        // docs/operators.md holds `operator_table()` between two markers;
        // TRTCLASSIFY_BLESS=1 writes it there after a family changes.
        let path = crate::testing::repo().join("docs/operators.md");
        let text = std::fs::read_to_string(&path).expect("docs/operators.md");
        let (start, end) = ("<!-- operators -->\n", "<!-- /operators -->");
        let from = text.find(start).expect("the start marker") + start.len();
        let to = text.find(end).expect("the end marker");
        let table = operator_table();
        if text[from..to] != table {
            if std::env::var_os("TRTCLASSIFY_BLESS").is_some() {
                let updated = format!("{}{table}{}", &text[..from], &text[to..]);
                std::fs::write(&path, updated).expect("docs/operators.md written");
            } else {
                panic!(
                    "docs/operators.md's table is not the code's: run \
                     `TRTCLASSIFY_BLESS=1 cargo test -p trtclassify-compiler --lib the_documented_operator_table`"
                );
            }
        }
    }

    #[test]
    fn gathers_of_evenly_spaced_indices_are_strided_slices() {
        let mut im = importer();
        im.set_const("odd", Tensor::new(vec![2, 1], vec![1.0, 3.0]));
        im.set_const("uneven", Tensor::new(vec![3], vec![0.0, 1.0, 3.0]));
        im.node(
            &node("Gather", &["x", "odd"], "y", &[("axis", 3, b"")]),
            "g",
        )
        .expect("imports");
        assert_eq!(im.graph.shapes["y"], [1, 3, 4, 2, 1]);
        let ops: Vec<&Op> = im.graph.nodes.iter().map(|n| &n.op).collect();
        let slice = Op::Slice {
            axis: 3,
            start: 1,
            end: 4,
            step: 2,
        };
        assert_eq!(ops, [&slice, &Op::Reshape]);
        let err = im.node(
            &node("Gather", &["x", "uneven"], "z", &[("axis", 3, b"")]),
            "h",
        );
        assert!(err.unwrap_err().contains("do not step evenly"));
    }

    #[test]
    fn integer_division_of_shapes_truncates() {
        // MaxViT splits its query/key/value projection at ((192 + 2) / 3) * k, in int64.
        let mut im = importer();
        let int64 = |v: f32| {
            let mut t = pb::TensorProto {
                dims: vec![1],
                data_type: 7,
                ..Default::default()
            };
            t.int64_data = vec![v as i64];
            t
        };
        let constant = |name: &str, v: f32| pb::NodeProto {
            op_type: "Constant".into(),
            output: vec![name.into()],
            attribute: vec![pb::AttributeProto {
                name: "value".into(),
                t: Some(int64(v)),
                ..Default::default()
            }],
            ..Default::default()
        };
        for (name, v) in [("a", 194.0), ("b", 3.0)] {
            im.node(&constant(name, v), name).expect("a constant");
        }
        im.node(&node("Div", &["a", "b"], "q", &[]), "div")
            .expect("divides");
        assert_eq!(*im.constant("q").expect("folded").data, [64.0]);
        // Floats divide as floats.
        im.set_const("f", Tensor::new(vec![1], vec![194.0]));
        im.node(&node("Div", &["f", "b"], "r", &[]), "fdiv")
            .expect("divides");
        assert!((im.constant("r").expect("folded").data[0] - 64.666_67).abs() < 1e-4);
    }

    #[test]
    fn einsums_that_are_batched_products_become_matmuls() {
        let mut im = importer();
        // x is [1, 3, 4, 4]: b=1, h=3, i=j=4, d=4; query · keyᵀ.
        fn eq(e: &str) -> [(&'static str, i64, &[u8]); 1] {
            [("equation", 0, e.as_bytes())]
        }
        im.node(
            &node("Einsum", &["x", "x"], "s", &eq("bhid,bhjd->bhij")),
            "e",
        )
        .expect("imports");
        assert_eq!(im.graph.shapes["s"], [1, 3, 4, 4]);
        let matmuls = (im.graph.nodes.iter())
            .filter(|n| n.op == Op::MatMul { alpha: 1.0 })
            .count();
        assert_eq!(matmuls, 1);
        // A sum over a letter of one input only, and `...`, are refused by name.
        for bad in ["bhid,bhjd->bhi", "...id,...jd->...ij", "bhid,bhjd"] {
            let err = im
                .node(&node("Einsum", &["x", "x"], "t", &eq(bad)), "bad")
                .unwrap_err();
            assert!(err.contains("Einsum"), "{bad}: {err}");
        }
    }
}
