// SPDX-License-Identifier: MPL-2.0
//! Operators over rows or channels: softmax, layer and local response normalisation, means
//! and norms over axes.

use super::attrs::axis_of;
use super::{Handled, Importer, OnnxNode};
use crate::engine::compiler::ir::{Act, BinOp, Op, Tensor};

pub(super) const OPS: &[&str] = &[
    "Softmax",
    "LayerNormalization",
    "LRN",
    "ReduceMean",
    "ReduceL2",
];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(super) fn required_inputs(op: &str, _opset: i64) -> usize {
    match op {
        "LayerNormalization" => 2,
        _ => 1,
    }
}

pub(super) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
    match node.op() {
        "Softmax" => softmax(im, node)?,
        "LayerNormalization" => layer_norm(im, node)?,
        "LRN" => lrn(im, node)?,
        "ReduceMean" | "ReduceL2" => reduce(im, node)?,
        _ => return Ok(Handled::NotMine),
    }
    Ok(Handled::Yes)
}

fn softmax(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let x = node.x();
    let xs = im.shape(&x)?;
    let rank = xs.len() as i64;
    let default = if im.opset < 13 { 1 } else { -1 };
    let axis = axis_of(node.attrs.i("axis").unwrap_or(default), rank)?;
    // Before opset 13 Softmax works on the axes from `axis` on flattened, which is the same
    // as on the last axis when those after `axis` are 1.
    if im.opset < 13 && xs[axis + 1..].iter().any(|&d| d != 1) {
        return Err("Softmax over several axes (opset < 13) is not supported".into());
    }
    im.add(node.name, Op::Softmax { axis }, vec![x], &node.out(), xs);
    Ok(())
}

fn layer_norm(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (inputs, x) = (node.inputs(), node.x());
    let xs = im.shape(&x)?;
    let axis = axis_of(node.attrs.i("axis").unwrap_or(-1), xs.len() as i64)?;
    let inner: usize = xs[axis..].iter().product();
    let scale = im.need_const(&inputs[1], "scale")?;
    if scale.len() != inner {
        return Err(format!(
            "its scale has {} values for rows of {inner}",
            scale.len()
        ));
    }
    let mut node_inputs = vec![x, inputs[1].clone()];
    if let Some(b) = node.input(2) {
        im.need_const(&b, "bias")?;
        node_inputs.push(b);
    }
    if node.outputs().iter().skip(1).any(|o| !o.is_empty()) {
        return Err("LayerNormalization's mean/inv_std outputs are not supported".into());
    }
    let epsilon = node.attrs.f("epsilon").unwrap_or(1e-5);
    let op = Op::LayerNorm { axis, epsilon };
    im.add(node.name, op, node_inputs, &node.out(), xs);
    Ok(())
}

fn lrn(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (attrs, x) = (&node.attrs, node.x());
    let xs = im.shape(&x)?;
    if xs.len() != 4 {
        return Err(format!("only 4-D LRN is supported (input {xs:?})"));
    }
    let op = Op::Lrn {
        size: attrs.i("size").unwrap_or(1).max(1) as usize,
        alpha: attrs.f("alpha").unwrap_or(1e-4),
        beta: attrs.f("beta").unwrap_or(0.75),
        bias: attrs.f("bias").unwrap_or(1.0),
    };
    im.add(node.name, op, vec![x], &node.out(), xs);
    Ok(())
}

/// ReduceMean, and ReduceL2 as the square root of a mean of squares.
fn reduce(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (name, attrs, x, out) = (node.name, &node.attrs, node.x(), node.out());
    let xs = im.shape(&x)?;
    let rank = xs.len() as i64;
    let axes = match node.input(1) {
        Some(a) => im.need_const(&a, "axes")?.ints(),
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
    if node.op() == "ReduceL2" {
        // √(n · mean(x²)) over the n reduced elements (Swin v2's cosine attention
        // normalises query and key rows this way).
        let n: usize = axes.iter().map(|&a| xs[a]).product();
        let (squared, mean, sum, count) = (
            format!("{out}.squared"),
            format!("{out}.mean_square"),
            format!("{out}.sum_square"),
            format!("{name}.count"),
        );
        im.set_const(&count, Tensor::scalar(n as f32));
        let binary = |op| Op::Binary { op, act: Act::None };
        im.add(name, binary(BinOp::Mul), vec![x.clone(), x], &squared, xs);
        let reduce = Op::ReduceMean { axes };
        im.add(name, reduce, vec![squared], &mean, shape.clone());
        let mul = binary(BinOp::Mul);
        im.add(name, mul, vec![mean, count], &sum, shape.clone());
        im.add(name, Op::Unary(Act::Sqrt), vec![sum], &out, shape);
        return Ok(());
    }
    let op = if xs.len() == 4 && axes == [2, 3] && keep {
        Op::GlobalAvgPool
    } else {
        Op::ReduceMean { axes }
    };
    im.add(name, op, vec![x], &out, shape);
    Ok(())
}
