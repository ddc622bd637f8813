// SPDX-License-Identifier: MPL-2.0
//! Element-wise operators: activations and other functions of one value, arithmetic on
//! broadcast inputs, and what passes values through (Identity, Dropout, casts).

use super::{Handled, Importer, OnnxNode};
use crate::ir::{Act, BinOp, Op, Tensor, broadcast};

pub(super) const OPS: &[&str] = &[
    "Identity",
    "Dropout",
    "Cast",
    "Relu",
    "Sigmoid",
    "Tanh",
    "Erf",
    "Exp",
    "Sqrt",
    "Neg",
    "Abs",
    "Reciprocal",
    "HardSwish",
    "HardSigmoid",
    "LeakyRelu",
    "Softplus",
    "Elu",
    "Gelu",
    "Clip",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Max",
    "Min",
    "Sum",
];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(super) fn required_inputs(op: &str, _opset: i64) -> usize {
    match op {
        "Add" | "Sub" | "Mul" | "Div" | "Pow" => 2,
        _ => 1,
    }
}

pub(super) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
    match node.op() {
        "Identity" | "Dropout" => {
            im.alias.insert(node.out(), node.x());
        }
        "Cast" => cast(im, node)?,
        "Gelu" if node.attrs.s("approximate") == Some("tanh") => gelu_tanh(im, node)?,
        "Relu" | "Sigmoid" | "Tanh" | "Erf" | "Exp" | "Sqrt" | "Neg" | "Abs" | "Reciprocal"
        | "HardSwish" | "HardSigmoid" | "LeakyRelu" | "Softplus" | "Elu" | "Gelu" | "Clip" => {
            let act = activation(im, node)?;
            let x = node.x();
            let shape = im.shape(&x)?;
            im.add(node.name, Op::Unary(act), vec![x], &node.out(), shape);
        }
        "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Max" | "Min" | "Sum" => binary(im, node)?,
        _ => return Ok(Handled::NotMine),
    }
    Ok(Handled::Yes)
}

fn cast(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    // Integers are held as f32 already; a cast to an integer type truncates.
    let (x, out) = (node.x(), node.out());
    let to = node.attrs.i("to").unwrap_or(1) as i32;
    let is_float = matches!(to, 1 | 10 | 11 | 16);
    match im.constant(&x) {
        Some(t) if !is_float => {
            let t = Tensor::new(t.shape.clone(), t.data.iter().map(|v| v.trunc()).collect());
            im.set_const(&out, t);
        }
        _ if is_float => {
            im.alias.insert(out, x);
        }
        _ => return Err("a cast of the image to an integer type".into()),
    }
    Ok(())
}

/// The function of one value that a unary operator computes, with its attributes.
fn activation(im: &Importer, node: &OnnxNode) -> Result<Act, String> {
    let attrs = &node.attrs;
    Ok(match node.op() {
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
        "Gelu" => match attrs.s("approximate").unwrap_or("none") {
            "none" => Act::Gelu,
            other => return Err(format!("GELU's approximation `{other}` is not supported")),
        },
        _ => {
            // Clip. An infinite bound is no bound: the largest finite value does the same,
            // and is stored in engine files as a number.
            let bound = |i: usize, attr: &str, default: f32| -> Result<f32, String> {
                let v = match node.input(i) {
                    Some(v) => im.need_const(&v, "bound")?.data.first().copied(),
                    None => attrs.f(attr),
                };
                Ok(v.unwrap_or(default).clamp(f32::MIN, f32::MAX))
            };
            Act::Clip(bound(1, "min", f32::MIN)?, bound(2, "max", f32::MAX)?)
        }
    })
}

/// GELU's tanh form, `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`, as the operators
/// PyTorch's TorchScript exporter writes for it (the dynamo exporter writes one Gelu node):
/// the same steps as from that export.
fn gelu_tanh(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (name, x, out) = (node.name, node.x(), node.out());
    let shape = im.shape(&x)?;
    let constant = |im: &mut Importer, tag: &str, v: f32| {
        let c = format!("{name}.{tag}");
        im.set_const(&c, Tensor::scalar(v));
        c
    };
    let (cubic, root, half) = (
        constant(im, "cubic", 0.044715),
        constant(im, "root_2_over_pi", (2.0 / std::f32::consts::PI).sqrt()),
        constant(im, "half", 0.5),
    );
    let mut step = |op: BinOp, a: String, b: String, tag: &str, act: Act| {
        let value = if tag.is_empty() {
            out.clone()
        } else {
            format!("{out}.{tag}")
        };
        im.add(
            name,
            Op::Binary { op, act },
            vec![a, b],
            &value,
            shape.clone(),
        );
        value
    };
    let square = step(BinOp::Mul, x.clone(), x.clone(), "square", Act::None);
    let cube = step(BinOp::Mul, square, x.clone(), "cube", Act::None);
    let scaled = step(BinOp::Mul, cube, cubic, "scaled_cube", Act::None);
    let inner = step(BinOp::Add, x.clone(), scaled, "inner", Act::None);
    let tanh = step(BinOp::Mul, inner, root, "tanh", Act::Tanh);
    let half_tanh = step(BinOp::Mul, tanh, half.clone(), "half_tanh", Act::None);
    let gate = step(BinOp::Add, half_tanh, half, "gate", Act::None);
    step(BinOp::Mul, x, gate, "", Act::None);
    Ok(())
}

fn binary(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (inputs, out) = (node.inputs(), node.out());
    let op = match node.op() {
        "Add" | "Sum" => BinOp::Add,
        "Sub" => BinOp::Sub,
        "Mul" => BinOp::Mul,
        "Div" => BinOp::Div,
        "Pow" => BinOp::Pow,
        "Max" => BinOp::Max,
        _ => BinOp::Min,
    };
    if inputs.len() == 1 {
        im.alias.insert(out, node.x());
        return Ok(());
    }
    // Sum, Max and Min take any number of inputs: a chain of binary nodes.
    let mut acc = node.x();
    for (i, rhs) in inputs[1..].iter().enumerate() {
        let shape = broadcast(&im.shape(&acc)?, &im.shape(rhs)?).ok_or_else(|| {
            format!(
                "shapes {:?} and {:?} do not broadcast",
                im.shape(&acc),
                im.shape(rhs)
            )
        })?;
        let last = i + 2 == inputs.len();
        let target = if last {
            out.clone()
        } else {
            format!("{out}.{i}")
        };
        let integers = im.is_integer(&acc) && im.is_integer(rhs);
        let binary = Op::Binary { op, act: Act::None };
        im.add(node.name, binary, vec![acc, rhs.clone()], &target, shape);
        // Integer division truncates, as ONNX runtimes compute it.
        if let (BinOp::Div, true, Some(t)) = (op, integers, im.constant(&target)) {
            let t = Tensor::new(t.shape.clone(), t.data.iter().map(|v| v.trunc()).collect());
            im.set_const(&target, t);
            im.integers.insert(target.clone());
        }
        acc = target;
    }
    Ok(())
}
