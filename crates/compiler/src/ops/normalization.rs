// SPDX-License-Identifier: MPL-2.0
//! Normalisations and reductions: softmax, layer norm (instance norm as one), LRN, and the
//! means, sums and L2 norms of ReduceMean and its kin; from their ONNX import to their
//! reference evaluation and their lowering to row kernels (each over rows laid out along the
//! last memory axes; LRN across the channels of NHWC).

use crate::import::attrs::axis_of;
use crate::import::{Handled, Importer, OnnxNode};
use crate::ir::{Node, Op, Tensor, strides};
use crate::lower::{Lowering, NHWC, Val, identity};
use crate::ops::elementwise::{Act, BinOp};
use crate::plan::{LayerNormStep, LrnStep, RowMeanStep, SoftmaxStep, Step};
use crate::reference::along_axis;

// ONNX import: what each operator becomes, with its output shape.

pub(crate) const OPS: &[&str] = &[
    "Softmax",
    "LayerNormalization",
    "InstanceNormalization",
    "LRN",
    "ReduceMean",
    "ReduceSum",
    "ReduceL2",
];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(crate) fn required_inputs(op: &str, _opset: i64) -> usize {
    match op {
        "LayerNormalization" => 2,
        "InstanceNormalization" => 3,
        _ => 1,
    }
}

pub(crate) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
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
    if xs.len() == 4 && axes == [2, 3] {
        // The mean of each channel's plane, as a global average pool: the pool reads the
        // channels-last activations where they lie, where a mean over the last axes of
        // NCHW first transposed them (MnasNet's `x.mean([2, 3])`).
        if keep {
            im.add(name, Op::GlobalAvgPool, vec![x], &mean, shape.clone());
        } else {
            let pooled = format!("{mean}.pooled");
            let pool_shape = vec![xs[0], xs[1], 1, 1];
            im.add(name, Op::GlobalAvgPool, vec![x], &pooled, pool_shape);
            im.add(name, Op::Reshape, vec![pooled], &mean, shape.clone());
        }
    } else {
        im.add(name, Op::ReduceMean { axes }, vec![x], &mean, shape.clone());
    }
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

// Reference evaluation, in f32 (`reference::eval`).

pub(crate) fn eval_softmax(axis: usize, inputs: &[&Tensor]) -> Vec<f32> {
    let x = inputs[0];
    let mut out = x.data.to_vec();
    along_axis(&x.shape, axis, |idx| {
        let max = idx.iter().map(|&i| x.data[i]).fold(f32::MIN, f32::max);
        let sum: f32 = idx.iter().map(|&i| (x.data[i] - max).exp()).sum();
        for &i in idx {
            out[i] = (x.data[i] - max).exp() / sum;
        }
    });
    out
}

pub(crate) fn eval_layer_norm(axis: usize, epsilon: f32, inputs: &[&Tensor]) -> Vec<f32> {
    let (x, scale, bias) = (inputs[0], inputs[1], inputs.get(2));
    let inner: usize = x.shape[axis..].iter().product();
    let mut out = Vec::with_capacity(x.len());
    for row in x.data.chunks(inner) {
        let mean = row.iter().sum::<f32>() / inner as f32;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / inner as f32;
        let inv = 1.0 / (var + epsilon).sqrt();
        for (j, v) in row.iter().enumerate() {
            out.push((v - mean) * inv * scale.data[j] + bias.map_or(0.0, |b| b.data[j]));
        }
    }
    out
}

/// LRN across channels; `[alpha, beta, bias]` as ONNX names them.
pub(crate) fn eval_lrn(size: usize, [alpha, beta, bias]: [f32; 3], inputs: &[&Tensor]) -> Vec<f32> {
    let x = inputs[0];
    let channels = x.shape[1];
    let inner: usize = x.shape[2..].iter().product();
    (0..x.len())
        .map(|i| {
            let c = (i / inner) % channels;
            let lo = c.saturating_sub((size - 1) / 2);
            let hi = (c + size / 2).min(channels - 1);
            let sq: f32 = (lo..=hi)
                .map(|cc| x.data[i - c * inner + cc * inner].powi(2))
                .sum();
            x.data[i] / (bias + alpha / size as f32 * sq).powf(beta)
        })
        .collect()
}

pub(crate) fn eval_reduce_mean(axes: &[usize], inputs: &[&Tensor]) -> Vec<f32> {
    let x = inputs[0];
    let kept: Vec<usize> = x
        .shape
        .iter()
        .enumerate()
        .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
        .collect();
    let kept_strides = strides(&kept);
    let in_strides = strides(&x.shape);
    let mut out = vec![0.0; kept.iter().product()];
    for (i, v) in x.data.iter().enumerate() {
        let o: usize = (0..x.shape.len())
            .map(|a| (i / in_strides[a]) % x.shape[a] % kept[a] * kept_strides[a])
            .sum();
        out[o] += v;
    }
    let count: usize = axes.iter().map(|&a| x.shape[a]).product();
    out.iter_mut().for_each(|v| *v /= count as f32);
    out
}

// Lowering to plan steps (`lower::Lowering::node`).

impl Lowering<'_> {
    pub(crate) fn softmax(
        &mut self,
        node: &Node,
        axis: usize,
        shape: &[usize],
    ) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        // Rows along the last memory axis: the reduced axis innermost, the others in their
        // order in memory.
        let x = self.innermost(&x, axis)?;
        let perm = x.perm.clone();
        let len = shape[axis];
        let rows = x.len() / len;
        let y = self.alloc(shape, perm);
        let step = Step::Softmax(SoftmaxStep {
            rows,
            len,
            x: x.loc,
            bias: None,
            y: y.loc,
        });
        self.push(step, &[x.loc, y.loc]);
        Ok(y)
    }

    /// Normalises over the axes from `axis` on, which are the last ones in memory.
    pub(crate) fn layer_norm(
        &mut self,
        node: &Node,
        axis: usize,
        epsilon: f32,
        shape: &[usize],
    ) -> Result<Val, String> {
        // The normalised axes innermost in their logical order, the rows in any order.
        let x = self.get(&node.inputs[0])?;
        let perm: Vec<usize> = x
            .perm
            .iter()
            .copied()
            .filter(|&a| a < axis)
            .chain(axis..shape.len())
            .collect();
        let x = self.require(&x, &perm)?;
        let len: usize = shape[axis..].iter().product();
        let rows = x.len() / len;
        let y = self.alloc(shape, perm);
        let scale = self.get(&node.inputs[1])?.loc;
        let bias = match node.inputs.get(2) {
            Some(b) => Some(self.get(b)?.loc),
            None => None,
        };
        let step = Step::LayerNorm(LayerNormStep {
            rows,
            len,
            epsilon,
            x: x.loc,
            scale,
            bias,
            y: y.loc,
        });
        self.push(step, &[x.loc, y.loc]);
        Ok(y)
    }

    /// The mean over `axes`, moved last in memory.
    pub(crate) fn reduce_mean(
        &mut self,
        node: &Node,
        axes: &[usize],
        shape: &[usize],
    ) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let in_rank = x.shape.len();
        let perm: Vec<usize> = (0..in_rank)
            .filter(|a| !axes.contains(a))
            .chain(axes.iter().copied())
            .collect();
        let x = self.require(&x, &perm)?;
        let len: usize = axes.iter().map(|&a| x.shape[a]).product();
        let y = self.alloc(shape, identity(shape.len()));
        self.push(
            Step::RowMean(RowMeanStep {
                rows: x.len() / len,
                len,
                x: x.loc,
                y: y.loc,
            }),
            &[x.loc, y.loc],
        );
        Ok(y)
    }

    /// LRN across channels; `[alpha, beta, bias]` as ONNX names them.
    pub(crate) fn lrn(
        &mut self,
        node: &Node,
        size: usize,
        [alpha, beta, bias]: [f32; 3],
        shape: &[usize],
    ) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let x = self.require(&x, &NHWC)?;
        let y = self.alloc(shape, NHWC.to_vec());
        self.push(
            Step::Lrn(LrnStep {
                pixels: x.len() / shape[1],
                c: shape[1],
                size,
                alpha,
                beta,
                bias,
                x: x.loc,
                y: y.loc,
            }),
            &[x.loc, y.loc],
        );
        Ok(y)
    }
}
