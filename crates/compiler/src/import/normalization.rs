// SPDX-License-Identifier: MPL-2.0
//! Operators over rows or channels: softmax, layer, instance and local response
//! normalisation, sums, means and norms over axes.

use super::attrs::axis_of;
use super::{Handled, Importer, OnnxNode};
use crate::ir::{Act, BinOp, Op, Tensor};

pub(super) const OPS: &[&str] = &[
    "Softmax",
    "LayerNormalization",
    "InstanceNormalization",
    "LRN",
    "ReduceMean",
    "ReduceSum",
    "ReduceL2",
];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(super) fn required_inputs(op: &str, _opset: i64) -> usize {
    match op {
        "LayerNormalization" => 2,
        "InstanceNormalization" => 3,
        _ => 1,
    }
}

pub(super) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
    match node.op() {
        "Softmax" => softmax(im, node)?,
        "LayerNormalization" => layer_norm(im, node)?,
        "InstanceNormalization" => instance_norm(im, node)?,
        "LRN" => lrn(im, node)?,
        "ReduceMean" | "ReduceSum" | "ReduceL2" => reduce(im, node)?,
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

/// Instance normalisation is a layer norm over each channel's values (the axes after the
/// channel), then the per-channel scale and bias where they are not 1 and 0. PyTorch's
/// GroupNorm exports this way (MobileViT v2: one group, so the rows are whole frames).
fn instance_norm(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (name, inputs, x, out) = (node.name, node.inputs(), node.x(), node.out());
    let xs = im.shape(&x)?;
    if xs.len() < 3 {
        return Err(format!(
            "its input has shape {xs:?}; at least 3 axes are needed"
        ));
    }
    let scale = im.need_const(&inputs[1], "scale")?.clone();
    let bias = im.need_const(&inputs[2], "bias")?.clone();
    if scale.len() != xs[1] || bias.len() != xs[1] {
        return Err(format!(
            "its scale and bias have {} and {} values for {} channels",
            scale.len(),
            bias.len(),
            xs[1]
        ));
    }
    let epsilon = node.attrs.f("epsilon").unwrap_or(1e-5);
    let inner: usize = xs[2..].iter().product();
    let ones = format!("{name}.ones");
    im.set_const(&ones, Tensor::new(vec![inner], vec![1.0; inner]));
    // Per channel: [C, 1, ...] broadcasts over the axes after it.
    let mut channel_shape = vec![1; xs.len() - 1];
    channel_shape[0] = xs[1];
    let affine = [
        (BinOp::Mul, scale, 1.0, format!("{name}.scale")),
        (BinOp::Add, bias, 0.0, format!("{name}.bias")),
    ];
    let needed: Vec<_> = affine
        .into_iter()
        .filter(|(_, t, neutral, _)| t.data.iter().any(|v| v != neutral))
        .collect();
    let mut value = format!("{out}.normalised");
    if needed.is_empty() {
        value = out.clone();
    }
    let op = Op::LayerNorm { axis: 2, epsilon };
    im.add(name, op, vec![x, ones], &value, xs.clone());
    let last = needed.len();
    for (i, (op, t, _, const_name)) in needed.into_iter().enumerate() {
        im.set_const(
            &const_name,
            Tensor::new(channel_shape.clone(), t.data.to_vec()),
        );
        let next = if i + 1 == last {
            out.clone()
        } else {
            format!("{out}.scaled")
        };
        let op = Op::Binary { op, act: Act::None };
        im.add(name, op, vec![value, const_name], &next, xs.clone());
        value = next;
    }
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

/// ReduceMean; ReduceSum as a mean times the count; ReduceL2 as the square root of a mean of
/// squares.
fn reduce(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (name, attrs, x, out) = (node.name, &node.attrs, node.x(), node.out());
    let xs = im.shape(&x)?;
    let rank = xs.len() as i64;
    let axes = match node.input(1) {
        Some(a) => im.need_const(&a, "axes")?.ints(),
        None => attrs.ints("axes").map(<[i64]>::to_vec).unwrap_or_default(),
    };
    // No axes: all of them, or none where `noop_with_empty_axes` says so (opset 18).
    if axes.is_empty() && attrs.i("noop_with_empty_axes").unwrap_or(0) != 0 {
        im.alias.insert(out, x);
        return Ok(());
    }
    let axes = if axes.is_empty() {
        (0..rank).collect()
    } else {
        axes
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
    let n: usize = axes.iter().map(|&a| xs[a]).product();
    let mean = match node.op() {
        "ReduceSum" => format!("{out}.mean"),
        _ => out.clone(),
    };
    let op = if xs.len() == 4 && axes == [2, 3] && keep {
        Op::GlobalAvgPool
    } else {
        Op::ReduceMean { axes }
    };
    im.add(name, op, vec![x], &mean, shape.clone());
    if node.op() == "ReduceSum" {
        let count = format!("{name}.count");
        im.set_const(&count, Tensor::scalar(n as f32));
        let op = Op::Binary {
            op: BinOp::Mul,
            act: Act::None,
        };
        im.add(name, op, vec![mean, count], &out, shape);
    }
    Ok(())
}
