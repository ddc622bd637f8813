// SPDX-License-Identifier: MPL-2.0
//! ONNX to IR, for one batch size and input size: every shape is settled, so the
//! Shape/Gather/Concat/Reshape chains of PyTorch exports fold to constants here, and what
//! is left of the graph is the computation on the image.

use std::collections::HashMap;
use std::path::Path;

use tract_onnx::pb;

use super::ir::{Act, BinOp, Conv2d, Graph, Node, Op, Pool2d, PoolKind, Tensor, broadcast};
use super::{fold, reference};
use crate::engine::OnnxModel;

/// ONNX operators the engine runs or folds away (default domain).
pub const SUPPORTED_OPS: &[&str] = &[
    "Abs",
    "Add",
    "AveragePool",
    "BatchNormalization",
    "Cast",
    "Clip",
    "Concat",
    "Constant",
    "ConstantOfShape",
    "Conv",
    "Div",
    "Dropout",
    "Elu",
    "Equal",
    "Erf",
    "Exp",
    "Expand",
    "Flatten",
    "Gather",
    "Gelu",
    "Gemm",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "HardSigmoid",
    "HardSwish",
    "Identity",
    "LayerNormalization",
    "LeakyRelu",
    "LRN",
    "MatMul",
    "Max",
    "MaxPool",
    "Min",
    "Mod",
    "Mul",
    "Neg",
    "Not",
    "Pad",
    "Pow",
    "Range",
    "Reciprocal",
    "ReduceL2",
    "ReduceMean",
    "Relu",
    "Reshape",
    "ScatterND",
    "Shape",
    "Sigmoid",
    "Slice",
    "Softmax",
    "Softplus",
    "Split",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Sum",
    "Tanh",
    "Transpose",
    "Unsqueeze",
    "Where",
];

/// The operators of `model` that the engine lacks, each once.
pub fn unsupported_ops(model: &OnnxModel) -> Vec<String> {
    model
        .op_types()
        .into_iter()
        .filter(|op| !SUPPORTED_OPS.contains(&op.as_str()))
        .collect()
}

/// Builds the graph for `batch` frames of `height`×`width`.
pub fn import(
    model: &OnnxModel,
    batch: usize,
    height: usize,
    width: usize,
) -> Result<Graph, String> {
    import_with(model, &initializers(model)?, batch, height, width)
}

/// The model's initializers as tensors: read once for the imports of every batch size, since
/// a large model's weights are gigabytes in files of their own.
pub fn initializers(model: &OnnxModel) -> Result<Vec<(String, Tensor)>, String> {
    let graph = model
        .proto
        .graph
        .as_ref()
        .ok_or("the model holds no graph")?;
    let dir = model.folder();
    graph
        .initializer
        .iter()
        .map(|init| Ok((init.name.clone(), tensor(init, &dir)?)))
        .collect()
}

/// `import` with the model's `initializers` already read; their tensors are shared, not
/// copied.
pub fn import_with(
    model: &OnnxModel,
    initializers: &[(String, Tensor)],
    batch: usize,
    height: usize,
    width: usize,
) -> Result<Graph, String> {
    let graph = model
        .proto
        .graph
        .as_ref()
        .ok_or("the model holds no graph")?;
    let opset = model
        .proto
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map_or(13, |o| o.version);
    let input_shape = match model.input.layout {
        crate::preprocess::Layout::Nchw => vec![batch, model.input.channels, height, width],
        crate::preprocess::Layout::Nhwc => vec![batch, height, width, model.input.channels],
    };
    let mut importer = Importer {
        graph: Graph {
            input: model.input.name.clone(),
            ..Graph::default()
        },
        alias: HashMap::new(),
        opset,
        dir: model.folder(),
    };
    importer
        .graph
        .shapes
        .insert(model.input.name.clone(), input_shape);
    for (name, t) in initializers {
        importer.graph.consts.insert(name.clone(), t.clone());
    }
    // Constants made for a node are named after it, so each node gets a name of its own
    // (ONNX does not require them to be unique).
    let mut names = std::collections::HashSet::new();
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
        if let Some(out) = (node.output.iter()).find(|o| !o.is_empty() && importer.is_defined(o)) {
            return Err(format!(
                "node `{name}` ({}): its output `{out}` is already defined",
                node.op_type
            ));
        }
        let first_new = importer.graph.nodes.len();
        importer
            .node(node, &name)
            .and_then(|()| finite_parameters(&importer.graph.nodes[first_new..]))
            .map_err(|e| format!("node `{name}` ({}): {e}", node.op_type))?;
    }
    let output = importer.resolve(&model.output);
    importer.graph.output = output;
    if importer.graph.is_const(&importer.graph.output) {
        return Err("the output does not depend on the image".into());
    }
    importer.graph.prune_consts();
    Ok(importer.graph)
}

struct Importer {
    graph: Graph,
    /// Values that are another value under a second name (Identity, Dropout).
    alias: HashMap<String, String>,
    opset: i64,
    dir: std::path::PathBuf,
}

impl Importer {
    fn resolve(&self, name: &str) -> String {
        let mut name = name;
        while let Some(next) = self.alias.get(name) {
            name = next;
        }
        name.to_owned()
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, String> {
        let name = self.resolve(name);
        self.graph
            .shapes
            .get(&name)
            .or_else(|| self.graph.consts.get(&name).map(|t| &t.shape))
            .cloned()
            .ok_or_else(|| format!("input `{name}` is not defined before use"))
    }

    fn constant(&self, name: &str) -> Option<&Tensor> {
        self.graph.consts.get(&self.resolve(name))
    }

    fn need_const(&self, name: &str, what: &str) -> Result<&Tensor, String> {
        self.constant(name)
            .ok_or_else(|| format!("its {what} (`{name}`) must be a constant"))
    }

    fn add(&mut self, name: &str, op: Op, inputs: Vec<String>, output: &str, shape: Vec<usize>) {
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
    fn is_defined(&self, value: &str) -> bool {
        self.graph.shapes.contains_key(value)
            || self.graph.consts.contains_key(value)
            || self.alias.contains_key(value)
    }

    fn set_const(&mut self, output: &str, t: Tensor) {
        self.graph.consts.insert(output.to_owned(), t);
    }

    fn node(&mut self, node: &pb::NodeProto, name: &str) -> Result<(), String> {
        // Every input the operator requires is named, so that the arms below may index them.
        let required = required_inputs(&node.op_type, self.opset);
        if let Some(k) = (0..required).find(|&k| node.input.get(k).is_none_or(String::is_empty)) {
            return Err(format!("input {} of {required} is missing", k + 1));
        }
        if node.output.first().is_none_or(String::is_empty) {
            return Err("the node has no output".into());
        }
        for input in node.input.iter().filter(|i| !i.is_empty()) {
            self.shape(input)?;
        }
        let attrs = Attrs(&node.attribute);
        let inputs: Vec<String> = node.input.clone();
        // Optional inputs are given as empty names.
        let input = |i: usize| inputs.get(i).filter(|s| !s.is_empty()).cloned();
        let x = input(0).unwrap_or_default();
        let out = node.output.first().cloned().unwrap_or_default();
        match node.op_type.as_str() {
            "Identity" | "Dropout" => {
                self.alias.insert(out, x);
            }
            "Constant" => {
                let t = if let Some(t) = attrs.tensor("value") {
                    tensor(t, &self.dir)?
                } else if let Some(f) = attrs.f("value_float") {
                    Tensor::scalar(f)
                } else if let Some(i) = attrs.i("value_int") {
                    Tensor::scalar(i as f32)
                } else if let Some(v) = attrs.floats("value_floats") {
                    Tensor::new(vec![v.len()], v.to_vec())
                } else if let Some(v) = attrs.ints("value_ints") {
                    Tensor::new(vec![v.len()], v.iter().map(|&i| i as f32).collect())
                } else {
                    return Err("a Constant without a supported value".into());
                };
                self.set_const(&out, t);
            }
            "Shape" => {
                let shape = self.shape(&x)?;
                let rank = shape.len() as i64;
                let start = norm_axis(attrs.i("start").unwrap_or(0).clamp(-rank, rank), rank + 1);
                let end = norm_axis(attrs.i("end").unwrap_or(rank).clamp(-rank, rank), rank + 1);
                let dims: Vec<f32> = shape[start..end.max(start)]
                    .iter()
                    .map(|&d| d as f32)
                    .collect();
                self.set_const(&out, Tensor::new(vec![dims.len()], dims));
            }
            "Cast" => {
                // Integers are held as f32 already; a cast to an integer type truncates.
                let to = attrs.i("to").unwrap_or(1) as i32;
                let is_float = matches!(to, 1 | 10 | 11 | 16);
                match self.constant(&x) {
                    Some(t) if !is_float => {
                        let t = Tensor::new(
                            t.shape.clone(),
                            t.data.iter().map(|v| v.trunc()).collect(),
                        );
                        self.set_const(&out, t);
                    }
                    _ if is_float => {
                        self.alias.insert(out, x);
                    }
                    _ => return Err("a cast of the image to an integer type".into()),
                }
            }
            "Expand" if self.constant(&x).is_none() => {
                let xs = self.shape(&x)?;
                let shape = self.need_const(&inputs[1], "shape")?.ints();
                let shape = shape
                    .iter()
                    .map(|&d| usize::try_from(d).map_err(|_| format!("Expand to a size {d}")))
                    .collect::<Result<Vec<_>, _>>()?;
                let target = super::ir::broadcast(&xs, &shape)
                    .ok_or_else(|| format!("{xs:?} does not expand to {shape:?}"))?;
                if target == xs {
                    self.alias.insert(out, x);
                    return Ok(());
                }
                // x · 1, with ones along the axes that grow only: the product broadcasts x
                // (Swin v2 expands a row norm over its row before dividing by it).
                let pad = target.len() - xs.len();
                let ones_shape: Vec<usize> = (0..target.len())
                    .map(|i| match i.checked_sub(pad).map(|j| xs[j]) {
                        Some(d) if d == target[i] => 1,
                        _ => target[i],
                    })
                    .collect();
                let n: usize = ones_shape.iter().product();
                if n > 1 << 20 {
                    return Err(format!("an Expand of {xs:?} to {target:?}"));
                }
                let ones = format!("{name}.ones");
                self.set_const(&ones, Tensor::new(ones_shape, vec![1.0; n]));
                let op = Op::Binary {
                    op: BinOp::Mul,
                    act: Act::None,
                };
                self.add(name, op, vec![x, ones], &out, target);
            }
            "Equal" | "Not" | "Where" | "Mod" | "Expand" | "Range" | "ScatterND" => {
                let op = node.op_type.as_str();
                let values = inputs
                    .iter()
                    .map(|i| {
                        self.constant(i).ok_or_else(|| {
                            format!(
                                "its input `{i}` is computed from the image; {op} is only \
                                 supported on shape arithmetic, which the import evaluates"
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let scalar = |t: &Tensor| match t.len() {
                    1 => Ok(t.data[0]),
                    n => Err(format!("a Range bound of {n} values")),
                };
                let t = match op {
                    "Equal" => fold::equal(values[0], values[1])?,
                    "Not" => fold::not(values[0]),
                    "Where" => fold::select(values[0], values[1], values[2])?,
                    "Mod" => fold::modulo(values[0], values[1], attrs.i("fmod") == Some(1))?,
                    "Expand" => fold::expand(values[0], &values[1].ints())?,
                    "Range" => {
                        fold::range(scalar(values[0])?, scalar(values[1])?, scalar(values[2])?)?
                    }
                    _ => fold::scatter_nd(values[0], values[1], values[2])?,
                };
                self.set_const(&out, t);
            }
            "Pad" => {
                let mode = attrs.s("mode").unwrap_or("constant");
                let (pads, value) = if self.opset < 11 {
                    let pads = attrs.ints("pads").unwrap_or_default().to_vec();
                    (pads, attrs.f("value").unwrap_or(0.0))
                } else {
                    if input(3).is_some() {
                        return Err("a Pad with an axes input is not supported".into());
                    }
                    let pads = self.need_const(&inputs[1], "pads")?.ints();
                    let value = match input(2) {
                        Some(v) => self.need_const(&v, "constant value")?.data.first().copied(),
                        None => None,
                    };
                    (pads, value.unwrap_or(0.0))
                };
                // -∞ padding (before a max) is the lowest finite value, as for Clip.
                let value = value.clamp(f32::MIN, f32::MAX);
                match self.constant(&x) {
                    Some(t) if mode == "constant" => {
                        let t = fold::pad(t, &pads, value)?;
                        self.set_const(&out, t);
                    }
                    // Swin pads its feature maps to a multiple of the window: often by 0.
                    _ if pads.iter().all(|&p| p == 0) => {
                        self.alias.insert(out, x);
                    }
                    // Swin v2's windows of 8 do not divide its 28×28 and 14×14 maps.
                    _ if mode == "constant" && pads.iter().all(|&p| p >= 0) => {
                        let xs = self.shape(&x)?;
                        if pads.len() != 2 * xs.len() {
                            return Err(format!("{} pads for a rank of {}", pads.len(), xs.len()));
                        }
                        let pads: Vec<usize> = sizes(&pads, "pad")?;
                        let rank = xs.len();
                        let shape = (0..rank)
                            .map(|a| xs[a] + pads[a] + pads[a + rank])
                            .collect();
                        self.add(name, Op::Pad { pads, value }, vec![x], &out, shape);
                    }
                    _ => {
                        return Err(format!(
                            "padding the image's activations ({mode} mode, pads {pads:?}) is \
                             not supported"
                        ));
                    }
                }
            }
            "ConstantOfShape" => {
                let shape = sizes(&self.need_const(&x, "shape")?.ints(), "shape")?;
                let value = attrs
                    .tensor("value")
                    .map(|t| tensor(t, &self.dir))
                    .transpose()?
                    .map_or(0.0, |t| t.data[0]);
                let len = shape.iter().product();
                self.set_const(&out, Tensor::new(shape, vec![value; len]));
            }
            "Gather" if self.constant(&x).is_none() => {
                // Picking one slice of an activation (ViT's query, key and value; its class
                // token) is a Slice, and a Reshape that drops the axis for a scalar index.
                let xs = self.shape(&x)?;
                let indices = self.need_const(&inputs[1], "indices")?.clone();
                let axis = axis_of(attrs.i("axis").unwrap_or(0), xs.len() as i64)?;
                if indices.len() != 1 || indices.shape.len() > 1 {
                    return Err(format!(
                        "a Gather from the image's activations with indices of shape {:?}; \
                         only a single index is supported",
                        indices.shape
                    ));
                }
                let dim = xs[axis] as i64;
                let i = indices.ints()[0];
                let i = if i < 0 { i + dim } else { i };
                if !(0..dim).contains(&i) {
                    return Err(format!("index {i} is out of range for an axis of {dim}"));
                }
                let mut sliced = xs.clone();
                sliced[axis] = 1;
                let target = match indices.shape.len() {
                    0 => format!("{out}.slice"),
                    _ => out.clone(),
                };
                let start = i as usize;
                self.add(
                    name,
                    Op::Slice {
                        axis,
                        start,
                        end: start + 1,
                        step: 1,
                    },
                    vec![x],
                    &target,
                    sliced.clone(),
                );
                if indices.shape.is_empty() {
                    sliced.remove(axis);
                    self.add(name, Op::Reshape, vec![target], &out, sliced);
                }
            }
            "Gather" => {
                let data = self.need_const(&x, "data")?.clone();
                let indices = self.need_const(&inputs[1], "indices")?.clone();
                let rank = data.shape.len() as i64;
                let axis = axis_of(attrs.i("axis").unwrap_or(0), rank)?;
                let dim = data.shape[axis] as i64;
                let outer: usize = data.shape[..axis].iter().product();
                let inner: usize = data.shape[axis + 1..].iter().product();
                let mut values = Vec::new();
                for o in 0..outer {
                    for &i in &indices.ints() {
                        let i = if i < 0 { i + dim } else { i };
                        if !(0..dim).contains(&i) {
                            return Err(format!("index {i} is out of range for an axis of {dim}"));
                        }
                        let start = (o * data.shape[axis] + i as usize) * inner;
                        values.extend_from_slice(&data.data[start..start + inner]);
                    }
                }
                let mut shape = data.shape[..axis].to_vec();
                shape.extend(&indices.shape);
                shape.extend(&data.shape[axis + 1..]);
                self.set_const(&out, Tensor::new(shape, values));
            }
            "Conv" => {
                let xs = self.shape(&x)?;
                let w = self.need_const(&inputs[1], "weight")?.clone();
                if xs.len() != 4 || w.shape.len() != 4 {
                    return Err(format!(
                        "only 2-D convolutions are supported (input {xs:?})"
                    ));
                }
                let group = sizes(&[attrs.i("group").unwrap_or(1)], "group")?[0];
                let kernel = [w.shape[2], w.shape[3]];
                let strides = attrs.pair("strides", 1)?;
                let dilations = attrs.pair("dilations", 1)?;
                if group == 0 || xs[1] != w.shape[1] * group || w.shape[0] % group != 0 {
                    return Err(format!(
                        "weight {:?} does not fit {} input channels in {group} group(s)",
                        w.shape, xs[1]
                    ));
                }
                let pads = attrs.pads(&xs[2..], &kernel, &strides, &dilations)?;
                let out_hw = conv_out(&xs[2..], &kernel, &strides, &dilations, &pads)?;
                let bias = match input(2) {
                    Some(b) if self.shape(&b)? != [w.shape[0]] => {
                        return Err(format!(
                            "the bias has shape {:?}; {} output channels need [{}]",
                            self.shape(&b)?,
                            w.shape[0],
                            w.shape[0]
                        ));
                    }
                    Some(b) => b,
                    None => {
                        let b = format!("{name}.zero_bias");
                        self.set_const(&b, Tensor::new(vec![w.shape[0]], vec![0.0; w.shape[0]]));
                        b
                    }
                };
                let op = Op::Conv(Conv2d {
                    kernel,
                    strides,
                    pads,
                    dilations,
                    group,
                    act: Act::None,
                });
                let shape = vec![xs[0], w.shape[0], out_hw[0], out_hw[1]];
                self.add(name, op, vec![x, inputs[1].clone(), bias], &out, shape);
            }
            "BatchNormalization" => {
                let shape = self.shape(&x)?;
                for (i, what) in [(1, "scale"), (2, "bias"), (3, "mean"), (4, "variance")] {
                    let t = self.need_const(inputs.get(i).map_or("", |s| s), what)?;
                    if shape.len() < 2 || t.len() != shape[1] {
                        return Err(format!("its {what} does not have one value per channel"));
                    }
                }
                let epsilon = attrs.f("epsilon").unwrap_or(1e-5);
                self.add(
                    name,
                    Op::BatchNorm { epsilon },
                    inputs[..5].to_vec(),
                    &out,
                    shape,
                );
            }
            "Relu" | "Sigmoid" | "Tanh" | "Erf" | "Exp" | "Sqrt" | "Neg" | "Abs" | "Reciprocal"
            | "HardSwish" | "HardSigmoid" | "LeakyRelu" | "Softplus" | "Elu" | "Gelu" | "Clip" => {
                let act = match node.op_type.as_str() {
                    "Relu" => Act::Relu,
                    "Sigmoid" => Act::Sigmoid,
                    "Tanh" => Act::Tanh,
                    "Erf" => Act::Erf,
                    "Exp" => Act::Exp,
                    "Sqrt" => Act::Sqrt,
                    "Neg" => Act::Neg,
                    "Abs" => Act::Abs,
                    "Reciprocal" => Act::Reciprocal,
                    "HardSwish" => Act::HardSwish,
                    "Softplus" => Act::Softplus,
                    "HardSigmoid" => Act::HardSigmoid(
                        attrs.f("alpha").unwrap_or(0.2),
                        attrs.f("beta").unwrap_or(0.5),
                    ),
                    "LeakyRelu" => Act::LeakyRelu(attrs.f("alpha").unwrap_or(0.01)),
                    "Elu" => Act::Elu(attrs.f("alpha").unwrap_or(1.0)),
                    "Gelu" if attrs.s("approximate").unwrap_or("none") == "none" => Act::Gelu,
                    "Gelu" => return Err("only the exact (erf) GELU is supported".into()),
                    _ => {
                        // An infinite bound is no bound: the largest finite value does
                        // the same, and is stored in engine files as a number.
                        let bound = |i: usize, attr: &str, default: f32| -> Result<f32, String> {
                            let v = match input(i) {
                                Some(v) => self.need_const(&v, "bound")?.data.first().copied(),
                                None => attrs.f(attr),
                            };
                            Ok(v.unwrap_or(default).clamp(f32::MIN, f32::MAX))
                        };
                        Act::Clip(bound(1, "min", f32::MIN)?, bound(2, "max", f32::MAX)?)
                    }
                };
                let shape = self.shape(&x)?;
                self.add(name, Op::Unary(act), vec![x], &out, shape);
            }
            "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Max" | "Min" | "Sum" => {
                let op = match node.op_type.as_str() {
                    "Add" | "Sum" => BinOp::Add,
                    "Sub" => BinOp::Sub,
                    "Mul" => BinOp::Mul,
                    "Div" => BinOp::Div,
                    "Pow" => BinOp::Pow,
                    "Max" => BinOp::Max,
                    _ => BinOp::Min,
                };
                if inputs.len() == 1 {
                    self.alias.insert(out, x);
                    return Ok(());
                }
                // Sum, Max and Min take any number of inputs: a chain of binary nodes.
                let mut acc = x;
                for (i, rhs) in inputs[1..].iter().enumerate() {
                    let shape =
                        broadcast(&self.shape(&acc)?, &self.shape(rhs)?).ok_or_else(|| {
                            format!(
                                "shapes {:?} and {:?} do not broadcast",
                                self.shape(&acc),
                                self.shape(rhs)
                            )
                        })?;
                    let last = i + 2 == inputs.len();
                    let target = if last {
                        out.clone()
                    } else {
                        format!("{out}.{i}")
                    };
                    self.add(
                        name,
                        Op::Binary { op, act: Act::None },
                        vec![acc, rhs.clone()],
                        &target,
                        shape,
                    );
                    acc = target;
                }
            }
            "MaxPool" | "AveragePool" => {
                let xs = self.shape(&x)?;
                if xs.len() != 4 {
                    return Err(format!("only 2-D pooling is supported (input {xs:?})"));
                }
                if node.output.len() > 1 && !node.output[1].is_empty() {
                    return Err("MaxPool's indices output is not supported".into());
                }
                let kernel = attrs.pair("kernel_shape", 0)?;
                let strides = attrs.pair("strides", 1)?;
                let dilations = attrs.pair("dilations", 1)?;
                if dilations != [1, 1] {
                    return Err("dilated pooling is not supported".into());
                }
                let pads = attrs.pads(&xs[2..], &kernel, &strides, &dilations)?;
                let mut out_hw = conv_out(&xs[2..], &kernel, &strides, &dilations, &pads)?;
                if attrs.i("ceil_mode") == Some(1) {
                    for a in 0..2 {
                        let span = xs[2 + a] + pads[a] + pads[a + 2] - kernel[a];
                        let mut o = span.div_ceil(strides[a]) + 1;
                        // The last window must start inside the input or its left padding.
                        if (o - 1) * strides[a] >= xs[2 + a] + pads[a] {
                            o -= 1;
                        }
                        out_hw[a] = o;
                    }
                }
                let kind = if node.op_type == "MaxPool" {
                    PoolKind::Max
                } else {
                    PoolKind::Avg {
                        count_include_pad: attrs.i("count_include_pad") == Some(1),
                    }
                };
                // The output shape carries ceil_mode; the pads stay as declared, which is
                // what count_include_pad counts.
                let pool = Pool2d {
                    kind,
                    kernel,
                    strides,
                    pads,
                };
                let shape = vec![xs[0], xs[1], out_hw[0], out_hw[1]];
                self.add(name, Op::Pool(pool), vec![x], &out, shape);
            }
            "GlobalAveragePool" | "GlobalMaxPool" => {
                let xs = self.shape(&x)?;
                if xs.len() != 4 {
                    return Err(format!("only 2-D pooling is supported (input {xs:?})"));
                }
                let op = if node.op_type == "GlobalAveragePool" {
                    Op::GlobalAvgPool
                } else {
                    Op::Pool(Pool2d {
                        kind: PoolKind::Max,
                        kernel: [xs[2], xs[3]],
                        strides: [1, 1],
                        pads: [0; 4],
                    })
                };
                self.add(name, op, vec![x], &out, vec![xs[0], xs[1], 1, 1]);
            }
            "Gemm" => {
                let xs = self.shape(&x)?;
                if attrs.i("transA").unwrap_or(0) != 0 || xs.len() != 2 {
                    return Err("only Gemm with a 2-D, untransposed A is supported".into());
                }
                let w = self.need_const(&inputs[1], "B")?.clone();
                if w.shape.len() != 2 {
                    return Err(format!("B must be a matrix; it has shape {:?}", w.shape));
                }
                let alpha = attrs.f("alpha").unwrap_or(1.0);
                let beta = attrs.f("beta").unwrap_or(1.0);
                let w = if attrs.i("transB").unwrap_or(0) != 0 {
                    transpose2(&w)
                } else {
                    w
                };
                let w = scale(&w, alpha);
                let n = w.shape[1];
                if w.shape[0] != xs[1] {
                    return Err(format!("A is {xs:?} but B is {:?}", w.shape));
                }
                let w_name = format!("{name}.weight");
                self.set_const(&w_name, w);
                let mut node_inputs = vec![x, w_name];
                if let Some(c) = input(2) {
                    let c = self.need_const(&c, "C")?;
                    let bias = match c.len() {
                        1 => vec![c.data[0] * beta; n],
                        len if len == n => c.data.iter().map(|v| v * beta).collect(),
                        _ => {
                            return Err(format!(
                                "C has shape {:?}; one value per output is supported",
                                c.shape
                            ));
                        }
                    };
                    let b_name = format!("{name}.bias");
                    self.set_const(&b_name, Tensor::new(vec![n], bias));
                    node_inputs.push(b_name);
                }
                self.add(
                    name,
                    Op::Gemm { act: Act::None },
                    node_inputs,
                    &out,
                    vec![xs[0], n],
                );
            }
            "MatMul" => {
                let xs = self.shape(&x)?;
                let Some(w) = self.constant(&inputs[1]).cloned() else {
                    let ws = self.shape(&inputs[1])?;
                    let r = xs.len();
                    if r < 2
                        || ws.len() != r
                        || xs[..r - 2] != ws[..r - 2]
                        || xs[r - 1] != ws[r - 2]
                    {
                        return Err(format!(
                            "a MatMul of {xs:?} and {ws:?}: only products with the same \
                             leading axes are supported"
                        ));
                    }
                    let mut shape = xs.clone();
                    shape[r - 1] = ws[r - 1];
                    let op = Op::MatMul { alpha: 1.0 };
                    self.add(name, op, vec![x, inputs[1].clone()], &out, shape);
                    return Ok(());
                };
                if w.shape.len() != 2 || xs.last() != Some(&w.shape[0]) {
                    return Err(format!("shapes {xs:?} and {:?} do not multiply", w.shape));
                }
                let mut shape = xs.clone();
                *shape.last_mut().expect("rank checked") = w.shape[1];
                self.add(
                    name,
                    Op::Gemm { act: Act::None },
                    vec![x, inputs[1].clone()],
                    &out,
                    shape,
                );
            }
            "Flatten" | "Reshape" | "Squeeze" | "Unsqueeze" => {
                let xs = self.shape(&x)?;
                let shape = match node.op_type.as_str() {
                    "Flatten" => {
                        // The axis may be the rank itself: everything in the first factor.
                        let rank = xs.len() as i64;
                        let axis = match attrs.i("axis").unwrap_or(1) {
                            a if a == rank => a as usize,
                            a => axis_of(a, rank)?,
                        };
                        vec![xs[..axis].iter().product(), xs[axis..].iter().product()]
                    }
                    "Reshape" => {
                        let target = self.need_const(&inputs[1], "shape")?.ints();
                        reshape(&xs, &target, attrs.i("allowzero") == Some(1))?
                    }
                    op => {
                        let axes = match input(1) {
                            Some(a) => self.need_const(&a, "axes")?.ints(),
                            None => attrs.ints("axes").map(<[i64]>::to_vec).unwrap_or_default(),
                        };
                        if op == "Squeeze" {
                            let axes: Vec<usize> = axes
                                .iter()
                                .map(|&a| axis_of(a, xs.len() as i64))
                                .collect::<Result<_, _>>()?;
                            xs.iter()
                                .enumerate()
                                .filter(|(i, d)| {
                                    if axes.is_empty() {
                                        **d != 1
                                    } else {
                                        !axes.contains(i)
                                    }
                                })
                                .map(|(_, &d)| d)
                                .collect()
                        } else {
                            let rank = (xs.len() + axes.len()) as i64;
                            let axes: Vec<usize> = axes
                                .iter()
                                .map(|&a| axis_of(a, rank))
                                .collect::<Result<_, _>>()?;
                            let mut rest = xs.iter();
                            (0..rank as usize)
                                .map(|i| {
                                    if axes.contains(&i) {
                                        1
                                    } else {
                                        *rest.next().unwrap_or(&1)
                                    }
                                })
                                .collect()
                        }
                    }
                };
                // Checked: a target's sizes may multiply past usize.
                let count = |s: &[usize]| s.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
                if count(&shape).is_none() || count(&shape) != count(&xs) {
                    return Err(format!("cannot reshape {xs:?} to {shape:?}"));
                }
                self.add(name, Op::Reshape, vec![x], &out, shape);
            }
            "Transpose" => {
                let xs = self.shape(&x)?;
                let perm: Vec<usize> = match attrs.ints("perm") {
                    Some(p) => p
                        .iter()
                        .map(|&a| axis_of(a, xs.len() as i64))
                        .collect::<Result<_, _>>()?,
                    None => (0..xs.len()).rev().collect(),
                };
                let mut sorted = perm.clone();
                sorted.sort_unstable();
                if sorted != (0..xs.len()).collect::<Vec<_>>() {
                    return Err(format!(
                        "perm {perm:?} is not a permutation of {} axes",
                        xs.len()
                    ));
                }
                let shape = perm.iter().map(|&p| xs[p]).collect();
                self.add(name, Op::Transpose { perm }, vec![x], &out, shape);
            }
            "Concat" => {
                let shapes = inputs
                    .iter()
                    .map(|i| self.shape(i))
                    .collect::<Result<Vec<_>, _>>()?;
                let rank = shapes[0].len();
                let axis = axis_of(attrs.i("axis").unwrap_or(0), rank as i64)?;
                let mut shape = shapes[0].clone();
                shape[axis] = 0;
                for s in &shapes {
                    if s.len() != rank || (0..rank).any(|a| a != axis && s[a] != shapes[0][a]) {
                        return Err(format!(
                            "inputs {shapes:?} do not concatenate on axis {axis}"
                        ));
                    }
                    shape[axis] += s[axis];
                }
                // Empty inputs (the `[]` of some shape chains) add nothing.
                let inputs: Vec<String> = inputs
                    .iter()
                    .zip(&shapes)
                    .filter(|(_, s)| s[axis] > 0)
                    .map(|(i, _)| i.clone())
                    .collect();
                self.add(name, Op::Concat { axis }, inputs, &out, shape);
            }
            "Slice" => {
                let (starts, ends, axes, steps) = if self.opset < 10 {
                    (
                        attrs.ints("starts").unwrap_or_default().to_vec(),
                        attrs.ints("ends").unwrap_or_default().to_vec(),
                        attrs.ints("axes").map(<[i64]>::to_vec),
                        None,
                    )
                } else {
                    let get = |i: usize, what: &str| -> Result<Option<Vec<i64>>, String> {
                        input(i)
                            .map(|n| self.need_const(&n, what).map(Tensor::ints))
                            .transpose()
                    };
                    (
                        get(1, "starts")?.unwrap_or_default(),
                        get(2, "ends")?.unwrap_or_default(),
                        get(3, "axes")?,
                        get(4, "steps")?,
                    )
                };
                let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
                if starts.len() != axes.len() || ends.len() != axes.len() {
                    return Err(format!(
                        "{} starts and {} ends for {} axes",
                        starts.len(),
                        ends.len(),
                        axes.len()
                    ));
                }
                let steps = steps.unwrap_or_else(|| vec![1; axes.len()]);
                if steps.len() != axes.len() {
                    return Err(format!("{} steps for {} axes", steps.len(), axes.len()));
                }
                if let Some(t) = self.constant(&x).filter(|_| steps.iter().any(|&s| s != 1)) {
                    // Exporters reverse pad lists with a step of -1: shape arithmetic.
                    let rank = t.shape.len() as i64;
                    let axes = axes
                        .iter()
                        .map(|&a| axis_of(a, rank))
                        .collect::<Result<Vec<_>, _>>()?;
                    let t = fold::slice(t, &starts, &ends, &axes, &steps)?;
                    self.set_const(&out, t);
                    return Ok(());
                }
                if steps.iter().any(|&s| s < 1) {
                    return Err(format!(
                        "a Slice of the image's activations with steps {steps:?}; only \
                         positive steps are supported"
                    ));
                }
                let mut acc = x;
                for (i, (&axis, (&start, (&end, &step)))) in axes
                    .iter()
                    .zip(starts.iter().zip(ends.iter().zip(&steps)))
                    .enumerate()
                {
                    let shape = self.shape(&acc)?;
                    let axis = axis_of(axis, shape.len() as i64)?;
                    let dim = shape[axis] as i64;
                    let clampi = |v: i64| (if v < 0 { v + dim } else { v }).clamp(0, dim) as usize;
                    let (start, end) = (clampi(start), clampi(end).max(clampi(start)));
                    let step = step as usize;
                    let mut out_shape = shape.clone();
                    out_shape[axis] = (end - start).div_ceil(step);
                    let target = if i + 1 == axes.len() {
                        out.clone()
                    } else {
                        format!("{out}.{i}")
                    };
                    self.add(
                        name,
                        Op::Slice {
                            axis,
                            start,
                            end,
                            step,
                        },
                        vec![acc],
                        &target,
                        out_shape,
                    );
                    acc = target;
                }
                if axes.is_empty() {
                    self.alias.insert(out, acc);
                }
            }
            "Split" => {
                let xs = self.shape(&x)?;
                let axis = axis_of(attrs.i("axis").unwrap_or(0), xs.len() as i64)?;
                let sizes: Vec<usize> = match input(1) {
                    Some(s) => sizes(&self.need_const(&s, "split")?.ints(), "split")?,
                    None => match attrs.ints("split") {
                        Some(s) => sizes(s, "split")?,
                        None => {
                            let n = node.output.len();
                            let each = xs[axis].div_ceil(n);
                            (0..n)
                                .map(|i| each.min(xs[axis].saturating_sub(i * each)))
                                .collect()
                        }
                    },
                };
                if sizes.len() != node.output.len() || sizes.iter().sum::<usize>() != xs[axis] {
                    return Err(format!(
                        "split sizes {sizes:?} do not fit axis {axis} of {xs:?}"
                    ));
                }
                let mut start = 0;
                for (size, target) in sizes.iter().zip(&node.output) {
                    let mut shape = xs.clone();
                    shape[axis] = *size;
                    self.add(
                        name,
                        Op::Slice {
                            axis,
                            start,
                            end: start + size,
                            step: 1,
                        },
                        vec![x.clone()],
                        target,
                        shape,
                    );
                    start += size;
                }
            }
            "Softmax" => {
                let xs = self.shape(&x)?;
                let rank = xs.len() as i64;
                let default = if self.opset < 13 { 1 } else { -1 };
                let axis = axis_of(attrs.i("axis").unwrap_or(default), rank)?;
                // Before opset 13 Softmax works on the axes from `axis` on flattened, which
                // is the same as on the last axis when those after `axis` are 1.
                if self.opset < 13 && xs[axis + 1..].iter().any(|&d| d != 1) {
                    return Err("Softmax over several axes (opset < 13) is not supported".into());
                }
                self.add(name, Op::Softmax { axis }, vec![x], &out, xs);
            }
            "LayerNormalization" => {
                let xs = self.shape(&x)?;
                let axis = axis_of(attrs.i("axis").unwrap_or(-1), xs.len() as i64)?;
                let inner: usize = xs[axis..].iter().product();
                let scale = self.need_const(&inputs[1], "scale")?;
                if scale.len() != inner {
                    return Err(format!(
                        "its scale has {} values for rows of {inner}",
                        scale.len()
                    ));
                }
                let mut node_inputs = vec![x, inputs[1].clone()];
                if let Some(b) = input(2) {
                    self.need_const(&b, "bias")?;
                    node_inputs.push(b);
                }
                if node.output.iter().skip(1).any(|o| !o.is_empty()) {
                    return Err(
                        "LayerNormalization's mean/inv_std outputs are not supported".into(),
                    );
                }
                let epsilon = attrs.f("epsilon").unwrap_or(1e-5);
                self.add(name, Op::LayerNorm { axis, epsilon }, node_inputs, &out, xs);
            }
            "LRN" => {
                let xs = self.shape(&x)?;
                if xs.len() != 4 {
                    return Err(format!("only 4-D LRN is supported (input {xs:?})"));
                }
                let op = Op::Lrn {
                    size: attrs.i("size").unwrap_or(1).max(1) as usize,
                    alpha: attrs.f("alpha").unwrap_or(1e-4),
                    beta: attrs.f("beta").unwrap_or(0.75),
                    bias: attrs.f("bias").unwrap_or(1.0),
                };
                self.add(name, op, vec![x], &out, xs);
            }
            "ReduceMean" | "ReduceL2" => {
                let xs = self.shape(&x)?;
                let rank = xs.len() as i64;
                let axes = match input(1) {
                    Some(a) => self.need_const(&a, "axes")?.ints(),
                    None => attrs
                        .ints("axes")
                        .map(<[i64]>::to_vec)
                        .unwrap_or_else(|| (0..rank).collect()),
                };
                let mut axes: Vec<usize> = axes
                    .iter()
                    .map(|&a| axis_of(a, rank))
                    .collect::<Result<_, _>>()?;
                axes.sort_unstable();
                axes.dedup();
                let keep = attrs.i("keepdims").unwrap_or(1) == 1;
                let shape: Vec<usize> = xs
                    .iter()
                    .enumerate()
                    .filter_map(|(i, &d)| match (axes.contains(&i), keep) {
                        (false, _) => Some(d),
                        (true, true) => Some(1),
                        (true, false) => None,
                    })
                    .collect();
                if node.op_type == "ReduceL2" {
                    // √(n · mean(x²)) over the n reduced elements (Swin v2's cosine
                    // attention normalises query and key rows this way).
                    let n: usize = axes.iter().map(|&a| xs[a]).product();
                    let (squared, mean, sum, count) = (
                        format!("{out}.squared"),
                        format!("{out}.mean_square"),
                        format!("{out}.sum_square"),
                        format!("{name}.count"),
                    );
                    self.set_const(&count, Tensor::scalar(n as f32));
                    let binary = |op| Op::Binary { op, act: Act::None };
                    self.add(name, binary(BinOp::Mul), vec![x.clone(), x], &squared, xs);
                    let reduce = Op::ReduceMean { axes };
                    self.add(name, reduce, vec![squared], &mean, shape.clone());
                    self.add(
                        name,
                        binary(BinOp::Mul),
                        vec![mean, count],
                        &sum,
                        shape.clone(),
                    );
                    self.add(name, Op::Unary(Act::Sqrt), vec![sum], &out, shape);
                    return Ok(());
                }
                let op = if xs.len() == 4 && axes == [2, 3] && keep {
                    Op::GlobalAvgPool
                } else {
                    Op::ReduceMean { axes }
                };
                self.add(name, op, vec![x], &out, shape);
            }
            other => return Err(format!("the operator {other} is not supported")),
        }
        Ok(())
    }
}

/// An initializer or Constant value as f32; `dir` is the model's folder, for external data.
fn tensor(t: &pb::TensorProto, dir: &Path) -> Result<Tensor, String> {
    // The values are in the model (or in its external data, whose range was checked), so
    // a tensor may be as large as its data: `sizes`' cap, which keeps a small model from
    // making huge constants, does not apply. Past 2 GiB is what external data is for.
    let (shape, len) = counted(&t.dims, &format!("tensor `{}` has dims", t.name))?;
    let raw = if t.data_location == Some(1) {
        crate::engine::external_data::locate(t, dir)?.read()?
    } else {
        t.raw_data.clone()
    };
    let from_raw = |size: usize, f: &dyn Fn(&[u8]) -> f32| -> Vec<f32> {
        raw.chunks_exact(size).map(f).collect()
    };
    let data: Vec<f32> = match t.data_type {
        1 if !raw.is_empty() => {
            from_raw(4, &|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        }
        1 => t.float_data.clone(),
        7 if !raw.is_empty() => from_raw(8, &|b| {
            i64::from_le_bytes(b.try_into().expect("8 bytes")) as f32
        }),
        7 => t.int64_data.iter().map(|&v| v as f32).collect(),
        6 if !raw.is_empty() => from_raw(4, &|b| {
            i32::from_le_bytes(b.try_into().expect("4 bytes")) as f32
        }),
        6 | 5 | 4 | 3 | 2 | 9 if raw.is_empty() => t.int32_data.iter().map(|&v| v as f32).collect(),
        11 if !raw.is_empty() => from_raw(8, &|b| {
            f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32
        }),
        11 => t.double_data.iter().map(|&v| v as f32).collect(),
        10 if !raw.is_empty() => from_raw(2, &|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        10 => t
            .int32_data
            .iter()
            .map(|&v| half::f16::from_bits(v as u16).to_f32())
            .collect(),
        9 | 2 | 3 => raw
            .iter()
            .map(|&b| {
                if t.data_type == 3 {
                    b as i8 as f32
                } else {
                    b as f32
                }
            })
            .collect(),
        other => {
            return Err(format!(
                "tensor `{}` has data type {other}, which is not supported",
                t.name
            ));
        }
    };
    if data.len() != len {
        return Err(format!(
            "tensor `{}` holds {} values for shape {shape:?}",
            t.name,
            data.len()
        ));
    }
    Ok(Tensor::new(shape, data))
}

struct Attrs<'a>(&'a [pb::AttributeProto]);

impl Attrs<'_> {
    fn get(&self, name: &str) -> Option<&pb::AttributeProto> {
        self.0.iter().find(|a| a.name == name)
    }
    fn i(&self, name: &str) -> Option<i64> {
        self.get(name).map(|a| a.i)
    }
    fn f(&self, name: &str) -> Option<f32> {
        self.get(name).map(|a| a.f)
    }
    fn s(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(|a| std::str::from_utf8(&a.s).ok())
    }
    fn ints(&self, name: &str) -> Option<&[i64]> {
        self.get(name).map(|a| a.ints.as_slice())
    }
    fn floats(&self, name: &str) -> Option<&[f32]> {
        self.get(name).map(|a| a.floats.as_slice())
    }
    fn tensor(&self, name: &str) -> Option<&pb::TensorProto> {
        self.get(name).and_then(|a| a.t.as_ref())
    }

    /// A 2-D attribute such as strides; `default` when absent (0 means it is required).
    fn pair(&self, name: &str, default: usize) -> Result<[usize; 2], String> {
        match self.ints(name) {
            Some([a, b]) if *a > 0 && *b > 0 => Ok([*a as usize, *b as usize]),
            None if default > 0 => Ok([default; 2]),
            other => Err(format!("{name} {other:?} is not two positive values")),
        }
    }

    /// Pads as top, left, bottom, right, from `pads` or `auto_pad`.
    fn pads(
        &self,
        input: &[usize],
        kernel: &[usize; 2],
        strides: &[usize; 2],
        dilations: &[usize; 2],
    ) -> Result<[usize; 4], String> {
        match self.s("auto_pad").unwrap_or("NOTSET") {
            "NOTSET" | "" => match self.ints("pads") {
                None => Ok([0; 4]),
                Some(p) if p.len() == 4 && p.iter().all(|&v| v >= 0) => {
                    Ok([p[0] as usize, p[1] as usize, p[2] as usize, p[3] as usize])
                }
                Some(p) => Err(format!("pads {p:?} are not four values ≥ 0")),
            },
            "VALID" => Ok([0; 4]),
            mode @ ("SAME_UPPER" | "SAME_LOWER") => {
                let mut pads = [0; 4];
                for a in 0..2 {
                    let out = input[a].div_ceil(strides[a]);
                    let span = (kernel[a] - 1) * dilations[a] + 1;
                    let total = ((out - 1) * strides[a] + span).saturating_sub(input[a]);
                    let (small, big) = (total / 2, total - total / 2);
                    (pads[a], pads[a + 2]) = if mode == "SAME_UPPER" {
                        (small, big)
                    } else {
                        (big, small)
                    };
                }
                Ok(pads)
            }
            other => Err(format!("auto_pad {other} is not supported")),
        }
    }
}

/// Sizes given as integers (a shape, a group count, split lengths): none negative, and
/// together small enough for a constant to be made of them.
fn sizes(values: &[i64], what: &str) -> Result<Vec<usize>, String> {
    const MAX_ELEMENTS: usize = 1 << 28;
    match counted(values, what)? {
        (sizes, n) if n <= MAX_ELEMENTS => Ok(sizes),
        _ => Err(format!("{what} {values:?} is too large")),
    }
}

/// Sizes, none negative, and how many elements they make.
fn counted(values: &[i64], what: &str) -> Result<(Vec<usize>, usize), String> {
    let sizes: Vec<usize> = values
        .iter()
        .map(|&v| usize::try_from(v))
        .collect::<Result<_, _>>()
        .map_err(|_| format!("{what} {values:?} has a negative value"))?;
    let n = sizes
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("{what} {values:?} is too large"))?;
    Ok((sizes, n))
}

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
fn required_inputs(op: &str, opset: i64) -> usize {
    match op {
        "Constant" => 0,
        "BatchNormalization" => 5,
        // Opset 10 moved Slice's starts and ends from attributes to inputs.
        "Slice" if opset >= 10 => 3,
        // Reshape's shape has been an input since opset 5; the older attribute is not read.
        "Reshape" => 2,
        "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Conv" | "Gather" | "Gemm" | "MatMul"
        | "LayerNormalization" | "Equal" | "Mod" | "Expand" => 2,
        "Where" | "Range" | "ScatterND" => 3,
        "Pad" if opset >= 11 => 2,
        _ => 1,
    }
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

/// `axis` of a tensor of `rank` dimensions, counted from the end when negative.
fn axis_of(axis: i64, rank: i64) -> Result<usize, String> {
    let a = if axis < 0 { axis + rank } else { axis };
    match (0..rank).contains(&a) {
        true => Ok(a as usize),
        false => Err(format!(
            "axis {axis} is out of range for a tensor of rank {rank}"
        )),
    }
}

/// `axis` counted from the end when negative, clamped into `0..rank`.
fn norm_axis(axis: i64, rank: i64) -> usize {
    (if axis < 0 { axis + rank } else { axis }).clamp(0, (rank - 1).max(0)) as usize
}

fn conv_out(
    input: &[usize],
    kernel: &[usize; 2],
    strides: &[usize; 2],
    dilations: &[usize; 2],
    pads: &[usize; 4],
) -> Result<[usize; 2], String> {
    let mut out = [0; 2];
    for a in 0..2 {
        let span = (kernel[a] - 1) * dilations[a] + 1;
        let padded = input[a] + pads[a] + pads[a + 2];
        if kernel[a] == 0 || padded < span {
            return Err(format!(
                "a kernel of {span} does not fit an input of {padded} (padded)"
            ));
        }
        out[a] = (padded - span) / strides[a] + 1;
    }
    Ok(out)
}

fn reshape(input: &[usize], target: &[i64], allow_zero: bool) -> Result<Vec<usize>, String> {
    let total: usize = input.iter().product();
    let mut shape = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, &d) in target.iter().enumerate() {
        shape.push(match d {
            -1 if infer.is_none() => {
                infer = Some(i);
                1
            }
            0 if !allow_zero => *input
                .get(i)
                .ok_or("a 0 in the shape beyond the input's axes")?,
            d if d >= 0 => d as usize,
            d => return Err(format!("shape {target:?} has an invalid entry {d}")),
        });
    }
    if let Some(i) = infer {
        let known: usize = shape.iter().product();
        if known == 0 || !total.is_multiple_of(known) {
            return Err(format!("cannot reshape {input:?} to {target:?}"));
        }
        shape[i] = total / known;
    }
    Ok(shape)
}

fn transpose2(w: &Tensor) -> Tensor {
    let (r, c) = (w.shape[0], w.shape[1]);
    let mut data = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            data[j * r + i] = w.data[i * c + j];
        }
    }
    Tensor::new(vec![c, r], data)
}

fn scale(w: &Tensor, alpha: f32) -> Tensor {
    if alpha == 1.0 {
        return w.clone();
    }
    Tensor::new(w.shape.clone(), w.data.iter().map(|v| v * alpha).collect())
}
