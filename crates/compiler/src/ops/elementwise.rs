// SPDX-License-Identifier: MPL-2.0
//! Element-wise operators: activations and other functions of one value (`Act`),
//! arithmetic on broadcast inputs (`BinOp`), and what passes values through (Identity,
//! Dropout, casts); from their ONNX import to their reference evaluation and their lowering
//! to element-wise steps (fused into the product or convolution before them by `passes`
//! where they can be). A new function of one value is a line in `UNARY`, its attributes in
//! `activation`, an `Act` variant and its `apply`, and its kernel line in each runtime.

use crate::import::{Handled, Importer, OnnxNode};
use crate::ir::{Node, Op, Tensor, broadcast};
use crate::lower::{Lowering, Val, identity};
use crate::plan::Cast;
use crate::reference::broadcast_index;

// The functions of one and two values, as the reference, the simulator and the CPU compute
// them.

/// Element-wise functions of one value; `None` where an operator has no activation.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Act {
    /// x unchanged.
    #[default]
    None,
    /// max(x, 0).
    Relu,
    /// x, or alpha·x below 0, the value being alpha.
    LeakyRelu(f32),
    /// x clamped to [min, max], the two values in that order.
    Clip(f32, f32),
    /// 1 / (1 + e^−x).
    Sigmoid,
    /// clamp(alpha·x + beta, 0, 1), the values being alpha and beta.
    HardSigmoid(f32, f32),
    /// x·clamp(x/6 + 1/2, 0, 1), MobileNetV3's.
    HardSwish,
    /// x·sigmoid(x), from PyTorch's SiLU exported as Sigmoid then Mul.
    Silu,
    /// The hyperbolic tangent.
    Tanh,
    /// The error function.
    Erf,
    /// x·Φ(x) with the exact (erf) form.
    Gelu,
    /// e^x.
    Exp,
    /// √x; NaN below 0.
    Sqrt,
    /// −x.
    Neg,
    /// |x|.
    Abs,
    /// 1/x.
    Reciprocal,
    /// ln(1 + e^x).
    Softplus,
    /// x, or alpha·(e^x − 1) below 0, the value being alpha.
    Elu(f32),
}

impl Act {
    /// Whether it is `Act::None` (serde's test for an activation left out of a file).
    pub fn is_none(&self) -> bool {
        *self == Act::None
    }

    /// The function at `x` (what the reference and the CPU kernels compute).
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Act::None => x,
            Act::Relu => x.max(0.0),
            Act::LeakyRelu(a) => {
                if x < 0.0 {
                    a * x
                } else {
                    x
                }
            }
            Act::Clip(lo, hi) => x.max(lo).min(hi),
            Act::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Act::HardSigmoid(a, b) => (a * x + b).clamp(0.0, 1.0),
            Act::HardSwish => x * (x / 6.0 + 0.5).clamp(0.0, 1.0),
            Act::Silu => x / (1.0 + (-x).exp()),
            Act::Tanh => x.tanh(),
            Act::Erf => erf(x),
            Act::Gelu => 0.5 * x * (1.0 + erf(x / std::f32::consts::SQRT_2)),
            Act::Exp => x.exp(),
            Act::Sqrt => x.sqrt(),
            Act::Neg => -x,
            Act::Abs => x.abs(),
            Act::Reciprocal => 1.0 / x,
            Act::Softplus => (1.0 + x.exp()).ln(),
            Act::Elu(a) => {
                if x < 0.0 {
                    a * (x.exp() - 1.0)
                } else {
                    x
                }
            }
        }
    }
}

/// Element-wise functions of two broadcast values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum BinOp {
    /// a + b.
    Add,
    /// a − b.
    Sub,
    /// a·b.
    Mul,
    /// a / b.
    Div,
    /// a raised to the power b.
    Pow,
    /// The larger of a and b.
    Max,
    /// The smaller of a and b.
    Min,
}

impl BinOp {
    /// The function of `a` and `b`.
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            BinOp::Add => a + b,
            BinOp::Sub => a - b,
            BinOp::Mul => a * b,
            BinOp::Div => a / b,
            BinOp::Pow => a.powf(b),
            BinOp::Max => a.max(b),
            BinOp::Min => a.min(b),
        }
    }
}

/// Abramowitz–Stegun 7.1.26 has 1.5e-7 absolute error, well below fp16's resolution.
pub(crate) fn erf(x: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
    let y = 1.0
        - (((((1.061_405_4 * t - 1.453_152_1) * t) + 1.421_413_8) * t - 0.284_496_74) * t
            + 0.254_829_6)
            * t
            * (-x * x).exp();
    y.copysign(x)
}

// ONNX import: what each operator becomes, with its output shape.

/// The operators that apply a function of one value (an `Act`, made by `activation`): their
/// output has their input's shape.
pub(crate) const UNARY: &[&str] = &[
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
];

/// The operators on broadcast inputs (a `BinOp` each; Sum of any number).
const BINARY: &[&str] = &["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum"];

pub(crate) const OPS: &[&str] =
    &join::<{ 3 + UNARY.len() + BINARY.len() }>(&["Identity", "Dropout", "Cast"], UNARY, BINARY);

/// Three lists of operators as one, in a constant.
const fn join<const N: usize>(
    a: &[&'static str],
    b: &[&'static str],
    c: &[&'static str],
) -> [&'static str; N] {
    let mut out = [""; N];
    let mut i = 0;
    while i < N {
        out[i] = if i < a.len() {
            a[i]
        } else if i < a.len() + b.len() {
            b[i - a.len()]
        } else {
            c[i - a.len() - b.len()]
        };
        i += 1;
    }
    out
}

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(crate) fn required_inputs(op: &str, _opset: i64) -> usize {
    match op {
        "Add" | "Sub" | "Mul" | "Div" | "Pow" => 2,
        _ => 1,
    }
}

pub(crate) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
    match node.op() {
        "Identity" | "Dropout" => {
            im.alias.insert(node.out(), node.x());
        }
        "Cast" => cast(im, node)?,
        "Gelu" if node.attrs.s("approximate") == Some("tanh") => gelu_tanh(im, node)?,
        op if UNARY.contains(&op) => {
            let act = activation(im, node)?;
            let x = node.x();
            let shape = im.shape(&x)?;
            im.add(node.name, Op::Unary(act), vec![x], &node.out(), shape);
        }
        op if BINARY.contains(&op) => binary(im, node)?,
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

// Reference evaluation, in f32 (`reference::eval`).

pub(crate) fn eval_unary(act: Act, inputs: &[&Tensor]) -> Vec<f32> {
    inputs[0].data.iter().map(|&v| act.apply(v)).collect()
}

pub(crate) fn eval_binary(
    op: BinOp,
    act: Act,
    inputs: &[&Tensor],
    out_shape: &[usize],
) -> Vec<f32> {
    let (a, b) = (inputs[0], inputs[1]);
    let ia = broadcast_index(&a.shape, out_shape);
    let ib = broadcast_index(&b.shape, out_shape);
    (0..out_shape.iter().product())
        .map(|i| act.apply(op.apply(a.data[ia(i)], b.data[ib(i)])))
        .collect()
}

// Lowering to plan steps (`lower::Lowering::node`).

impl Lowering<'_> {
    pub(crate) fn unary(&mut self, node: &Node, act: Act, shape: &[usize]) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let y = self.alloc(shape, x.perm.clone());
        let s = y.strides();
        self.ew(None, act, Cast::None, shape, &x.perm, y.loc, &s, &[&x])?;
        Ok(y)
    }

    pub(crate) fn binary(
        &mut self,
        node: &Node,
        op: BinOp,
        act: Act,
        shape: &[usize],
    ) -> Result<Val, String> {
        let a = self.get(&node.inputs[0])?;
        let b = self.get(&node.inputs[1])?;
        // The output takes the layout of a full-size input, so that reading it is sequential
        // (NHWC for activations from convolutions).
        let perm = [&a, &b]
            .into_iter()
            .find(|v| v.shape == shape)
            .map_or_else(|| identity(shape.len()), |v| v.perm.clone());
        let y = self.alloc(shape, perm.clone());
        let s = y.strides();
        self.ew(
            Some(op),
            act,
            Cast::None,
            shape,
            &perm,
            y.loc,
            &s,
            &[&a, &b],
        )?;
        Ok(y)
    }
}
