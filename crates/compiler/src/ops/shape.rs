// SPDX-License-Identifier: MPL-2.0
//! Operators that change how a value is seen more than what it holds: reshapes,
//! transposes, slices (Split and Gather of constant indices among them), concatenation,
//! padding and Expand; from their ONNX import (on constants, evaluated there) to their
//! reference evaluation and their lowering. A transpose only changes the layout, a reshape
//! of a logically laid out value nothing, and a slice is read in place where it can be;
//! concatenation and padding are copies.

use super::shape_arithmetic::constant_inputs;
use crate::fold;
use crate::import::attrs::axis_of;
use crate::import::tensor::sizes;
use crate::import::{Handled, Importer, OnnxNode};
use crate::ir::{Node, Op, Tensor, broadcast, strides};
use crate::lower::arena::ALIGN;
use crate::lower::{Lowering, NHWC, Val, identity};
use crate::ops::elementwise::{Act, BinOp};
use crate::plan::{Cast, Loc};

// ONNX import: what each operator becomes, with its output shape.

pub(crate) const OPS: &[&str] = &[
    "Flatten",
    "Reshape",
    "Squeeze",
    "Unsqueeze",
    "Transpose",
    "Concat",
    "Slice",
    "Split",
    "Pad",
    "Gather",
    "Expand",
];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(crate) fn required_inputs(op: &str, opset: i64) -> usize {
    match op {
        // Reshape's shape has been an input since opset 5; the older attribute is not read.
        "Reshape" | "Gather" | "Expand" => 2,
        // Opset 10 moved Slice's starts and ends from attributes to inputs.
        "Slice" if opset >= 10 => 3,
        "Pad" if opset >= 11 => 2,
        _ => 1,
    }
}

pub(crate) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
    match node.op() {
        "Flatten" | "Reshape" | "Squeeze" | "Unsqueeze" => reshape(im, node)?,
        "Transpose" => transpose(im, node)?,
        "Concat" => concat(im, node)?,
        "Slice" => slice(im, node)?,
        "Split" => split(im, node)?,
        "Pad" => pad(im, node)?,
        "Gather" if im.constant(&node.x()).is_none() => gather_slice(im, node)?,
        "Gather" => gather_constant(im, node)?,
        "Expand" if im.constant(&node.x()).is_none() => expand(im, node)?,
        "Expand" => {
            let values = constant_inputs(im, node)?;
            let t = fold::expand(values[0], &values[1].ints())?;
            im.set_const(&node.out(), t);
        }
        _ => return Ok(Handled::NotMine),
    }
    Ok(Handled::Yes)
}

/// Flatten, Reshape, Squeeze and Unsqueeze: the IR's Reshape to the shape they give.
fn reshape(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (attrs, x) = (&node.attrs, node.x());
    let xs = im.shape(&x)?;
    let shape = match node.op() {
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
            let target = im.need_const(&node.inputs()[1], "shape")?.ints();
            reshape_target(&xs, &target, attrs.i("allowzero") == Some(1))?
        }
        op => {
            let axes = match node.input(1) {
                Some(a) => im.need_const(&a, "axes")?.ints(),
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
    im.add(node.name, Op::Reshape, vec![x], &node.out(), shape);
    Ok(())
}

/// Reshape's `target` for `input`: a -1 takes what is left, a 0 keeps the input's size
/// (unless `allow_zero`).
fn reshape_target(input: &[usize], target: &[i64], allow_zero: bool) -> Result<Vec<usize>, String> {
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

fn transpose(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let x = node.x();
    let xs = im.shape(&x)?;
    let perm: Vec<usize> = match node.attrs.ints("perm") {
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
    im.add(
        node.name,
        Op::Transpose { perm },
        vec![x],
        &node.out(),
        shape,
    );
    Ok(())
}

fn concat(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let inputs = node.inputs();
    let shapes = inputs
        .iter()
        .map(|i| im.shape(i))
        .collect::<Result<Vec<_>, _>>()?;
    let rank = shapes[0].len();
    let axis = axis_of(node.attrs.i("axis").unwrap_or(0), rank as i64)?;
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
    im.add(node.name, Op::Concat { axis }, inputs, &node.out(), shape);
    Ok(())
}

fn slice(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (attrs, x, out) = (&node.attrs, node.x(), node.out());
    let (starts, ends, axes, steps) = if im.opset < 10 {
        (
            attrs.ints("starts").unwrap_or_default().to_vec(),
            attrs.ints("ends").unwrap_or_default().to_vec(),
            attrs.ints("axes").map(<[i64]>::to_vec),
            None,
        )
    } else {
        let get = |i: usize, what: &str| -> Result<Option<Vec<i64>>, String> {
            node.input(i)
                .map(|n| im.need_const(&n, what).map(Tensor::ints))
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
    if let Some(t) = im.constant(&x).filter(|_| steps.iter().any(|&s| s != 1)) {
        // Exporters reverse pad lists with a step of -1: shape arithmetic.
        let rank = t.shape.len() as i64;
        let axes = axes
            .iter()
            .map(|&a| axis_of(a, rank))
            .collect::<Result<Vec<_>, _>>()?;
        let t = fold::slice(t, &starts, &ends, &axes, &steps)?;
        im.set_const(&out, t);
        return Ok(());
    }
    if steps.iter().any(|&s| s < 1) {
        return Err(format!(
            "a Slice of the image's activations with steps {steps:?}; only positive steps \
             are supported"
        ));
    }
    let mut acc = x;
    for (i, (&axis, (&start, (&end, &step)))) in axes
        .iter()
        .zip(starts.iter().zip(ends.iter().zip(&steps)))
        .enumerate()
    {
        let shape = im.shape(&acc)?;
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
        let op = Op::Slice {
            axis,
            start,
            end,
            step,
        };
        im.add(node.name, op, vec![acc], &target, out_shape);
        acc = target;
    }
    if axes.is_empty() {
        im.alias.insert(out, acc);
    }
    Ok(())
}

fn split(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (attrs, x, outputs) = (&node.attrs, node.x(), node.outputs());
    let xs = im.shape(&x)?;
    let axis = axis_of(attrs.i("axis").unwrap_or(0), xs.len() as i64)?;
    let sizes: Vec<usize> = match node.input(1) {
        Some(s) => sizes(&im.need_const(&s, "split")?.ints(), "split")?,
        None => match attrs.ints("split") {
            Some(s) => sizes(s, "split")?,
            None => {
                let n = outputs.len();
                let each = xs[axis].div_ceil(n);
                (0..n)
                    .map(|i| each.min(xs[axis].saturating_sub(i * each)))
                    .collect()
            }
        },
    };
    if sizes.len() != outputs.len() || sizes.iter().sum::<usize>() != xs[axis] {
        return Err(format!(
            "split sizes {sizes:?} do not fit axis {axis} of {xs:?}"
        ));
    }
    let mut start = 0;
    for (size, target) in sizes.iter().zip(outputs) {
        let mut shape = xs.clone();
        shape[axis] = *size;
        let op = Op::Slice {
            axis,
            start,
            end: start + size,
            step: 1,
        };
        im.add(node.name, op, vec![x.clone()], target, shape);
        start += size;
    }
    Ok(())
}

fn pad(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (attrs, x, out) = (&node.attrs, node.x(), node.out());
    let mode = attrs.s("mode").unwrap_or("constant");
    let (pads, value) = if im.opset < 11 {
        let pads = attrs.ints("pads").unwrap_or_default().to_vec();
        (pads, attrs.f("value").unwrap_or(0.0))
    } else {
        if node.input(3).is_some() {
            return Err("a Pad with an axes input is not supported".into());
        }
        let pads = im.need_const(&node.inputs()[1], "pads")?.ints();
        let value = match node.input(2) {
            Some(v) => im.need_const(&v, "constant value")?.data.first().copied(),
            None => None,
        };
        (pads, value.unwrap_or(0.0))
    };
    // -∞ padding (before a max) is the lowest finite value, as for Clip.
    let value = value.clamp(f32::MIN, f32::MAX);
    match im.constant(&x) {
        Some(t) if mode == "constant" => {
            let t = fold::pad(t, &pads, value)?;
            im.set_const(&out, t);
        }
        // Swin pads its feature maps to a multiple of the window: often by 0.
        _ if pads.iter().all(|&p| p == 0) => {
            im.alias.insert(out, x);
        }
        // Swin v2's windows of 8 do not divide its 28×28 and 14×14 maps.
        _ if mode == "constant" && pads.iter().all(|&p| p >= 0) => {
            let xs = im.shape(&x)?;
            if pads.len() != 2 * xs.len() {
                return Err(format!("{} pads for a rank of {}", pads.len(), xs.len()));
            }
            let pads: Vec<usize> = sizes(&pads, "pad")?;
            let rank = xs.len();
            let shape = (0..rank)
                .map(|a| xs[a] + pads[a] + pads[a + rank])
                .collect();
            im.add(node.name, Op::Pad { pads, value }, vec![x], &out, shape);
        }
        _ => {
            return Err(format!(
                "padding the image's activations ({mode} mode, pads {pads:?}) is not \
                 supported"
            ));
        }
    }
    Ok(())
}

/// Picking from an activation along one axis: a single index (ViT's query, key and value;
/// its class token) or indices that step evenly (the dynamo exporter's `as_strided`, which
/// reads Swin's pooled features through a flat Gather) is a strided Slice, then a Reshape
/// to the indices' shape.
fn gather_slice(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (x, out) = (node.x(), node.out());
    let xs = im.shape(&x)?;
    let indices = im.need_const(&node.inputs()[1], "indices")?.clone();
    let axis = axis_of(node.attrs.i("axis").unwrap_or(0), xs.len() as i64)?;
    let dim = xs[axis] as i64;
    let picked = indices
        .ints()
        .iter()
        .map(|&i| {
            let i = if i < 0 { i + dim } else { i };
            (0..dim)
                .contains(&i)
                .then_some(i as usize)
                .ok_or_else(|| format!("index {i} is out of range for an axis of {dim}"))
        })
        .collect::<Result<Vec<usize>, String>>()?;
    let (start, count) = (picked.first().copied(), picked.len());
    let step = match picked.get(1).zip(start) {
        Some((&second, start)) if second > start => second - start,
        None => 1,
        _ => 0,
    };
    let Some(start) = start.filter(|&start| {
        step > 0
            && picked
                .iter()
                .enumerate()
                .all(|(k, &i)| i == start + k * step)
    }) else {
        return Err(format!(
            "a Gather from the image's activations with indices of shape {:?} that do not \
             step evenly; only evenly spaced, increasing indices are supported",
            indices.shape
        ));
    };
    let mut sliced = xs.clone();
    sliced[axis] = count;
    let mut shape = xs[..axis].to_vec();
    shape.extend(&indices.shape);
    shape.extend(&xs[axis + 1..]);
    let target = if shape == sliced {
        out.clone()
    } else {
        format!("{out}.slice")
    };
    if count == xs[axis] {
        im.alias.insert(target.clone(), x);
    } else {
        let op = Op::Slice {
            axis,
            start,
            end: start + (count - 1) * step + 1,
            step,
        };
        im.add(node.name, op, vec![x], &target, sliced.clone());
    }
    if shape != sliced {
        im.add(node.name, Op::Reshape, vec![target], &out, shape);
    }
    Ok(())
}

/// A Gather from a constant (shape arithmetic, embedding tables): evaluated.
fn gather_constant(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let data = im.need_const(&node.x(), "data")?.clone();
    let indices = im.need_const(&node.inputs()[1], "indices")?.clone();
    let rank = data.shape.len() as i64;
    let axis = axis_of(node.attrs.i("axis").unwrap_or(0), rank)?;
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
    im.set_const(&node.out(), Tensor::new(shape, values));
    Ok(())
}

/// Expanding an activation: x · 1, with ones along the axes that grow only, so that the
/// product broadcasts x (Swin v2 expands a row norm over its row before dividing by it).
fn expand(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (x, out) = (node.x(), node.out());
    let xs = im.shape(&x)?;
    let shape = im.need_const(&node.inputs()[1], "shape")?.ints();
    let shape = shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("Expand to a size {d}")))
        .collect::<Result<Vec<_>, _>>()?;
    let target =
        broadcast(&xs, &shape).ok_or_else(|| format!("{xs:?} does not expand to {shape:?}"))?;
    if target == xs {
        im.alias.insert(out, x);
        return Ok(());
    }
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
    let ones = format!("{}.ones", node.name);
    im.set_const(&ones, Tensor::new(ones_shape, vec![1.0; n]));
    let op = Op::Binary {
        op: BinOp::Mul,
        act: Act::None,
    };
    im.add(node.name, op, vec![x, ones], &out, target);
    Ok(())
}

// Reference evaluation, in f32 (`reference::eval`).

pub(crate) fn eval_pad(pads: &[usize], value: f32, inputs: &[&Tensor]) -> Vec<f32> {
    let pads: Vec<i64> = pads.iter().map(|&p| p as i64).collect();
    let padded = fold::pad(inputs[0], &pads, value).expect("checked at import");
    std::sync::Arc::unwrap_or_clone(padded.data)
}

pub(crate) fn eval_concat(axis: usize, inputs: &[&Tensor], out_shape: &[usize]) -> Vec<f32> {
    let outer: usize = out_shape[..axis].iter().product();
    let mut out = Vec::with_capacity(out_shape.iter().product());
    for o in 0..outer {
        for t in inputs {
            let block: usize = t.shape[axis..].iter().product();
            out.extend_from_slice(&t.data[o * block..(o + 1) * block]);
        }
    }
    out
}

pub(crate) fn eval_transpose(perm: &[usize], inputs: &[&Tensor], out_shape: &[usize]) -> Vec<f32> {
    let x = inputs[0];
    let in_strides = strides(&x.shape);
    let out_strides = strides(out_shape);
    (0..out_shape.iter().product())
        .map(|i| {
            let offset: usize = perm
                .iter()
                .enumerate()
                .map(|(o, &p)| (i / out_strides[o]) % out_shape[o] * in_strides[p])
                .sum();
            x.data[offset]
        })
        .collect()
}

pub(crate) fn eval_slice(
    axis: usize,
    range: std::ops::Range<usize>,
    step: usize,
    inputs: &[&Tensor],
) -> Vec<f32> {
    let x = inputs[0];
    let outer: usize = x.shape[..axis].iter().product();
    let inner: usize = x.shape[axis + 1..].iter().product();
    let mut out = Vec::new();
    for o in 0..outer {
        let base = o * x.shape[axis] * inner;
        for i in range.clone().step_by(step) {
            out.extend_from_slice(&x.data[base + i * inner..base + (i + 1) * inner]);
        }
    }
    out
}

// Lowering to plan steps (`lower::Lowering::node`).

impl Lowering<'_> {
    pub(crate) fn slice(
        &mut self,
        node: &Node,
        axis: usize,
        start: usize,
        step: usize,
        shape: &[usize],
    ) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let xs = x.strides();
        let src = Val {
            loc: x.loc.offset(start * xs[axis]),
            shape: shape.to_vec(),
            perm: x.perm.clone(),
        };
        // A slice with nothing but axes of size 1 outside it in memory is one contiguous
        // range of its input (attention's query, key and value picked from one projection):
        // it is read in place where it starts as aligned as a buffer would (cuBLASLt and
        // cuDNN choose their kernels for 256 bytes).
        let outer = x.perm.iter().take_while(|&&a| a != axis);
        let aligned = match x.loc {
            Loc::Temp { offset, .. } => (offset + start * xs[axis]).is_multiple_of(ALIGN),
            _ => false,
        };
        if step == 1 && aligned && outer.copied().all(|a| shape[a] == 1) {
            return Ok(src);
        }
        // The source view keeps the input's strides, not the compact ones of its shape: copy
        // through explicit strides.
        let y = self.alloc(shape, x.perm.clone());
        let ys = y.strides();
        let order = &x.perm;
        let in_strides: Vec<usize> = order
            .iter()
            .map(|&a| match (shape[a], a == axis) {
                (1, _) => 0,
                (_, true) => xs[a] * step,
                _ => xs[a],
            })
            .collect();
        let out_strides: Vec<usize> = order.iter().map(|&a| ys[a]).collect();
        let dims: Vec<usize> = order.iter().map(|&a| shape[a]).collect();
        self.strided_copy(&dims, (y.loc, &out_strides), (src.loc, &in_strides));
        Ok(y)
    }

    /// Only the layout changes: logical axis i of the output is axis perm[i] of the input,
    /// at the same place in memory.
    pub(crate) fn transpose(
        &mut self,
        node: &Node,
        perm: &[usize],
        shape: &[usize],
    ) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let mut inverse = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i;
        }
        Ok(Val {
            loc: x.loc,
            shape: shape.to_vec(),
            perm: x.perm.iter().map(|&a| inverse[a]).collect(),
        })
    }

    /// The value seen with another shape: in place where its layout allows (attention's
    /// heads split from or merged into the rows of a projection), else copied into its
    /// logical layout first.
    pub(crate) fn reshape(&mut self, node: &Node, shape: &[usize]) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        if let Some(perm) = reshaped_layout(&x.shape, &x.perm, shape) {
            return Ok(Val {
                loc: x.loc,
                shape: shape.to_vec(),
                perm,
            });
        }
        // A feature map whose channels are regrouped (ShuffleNet's channel shuffle: split in
        // two groups, transposed, merged back) is copied within each pixel, channels-last as
        // the convolutions after it read it; copied to its logical layout, it would go to
        // channels-first and be copied back to channels-last for every use.
        if shape.len() == 4
            && let Some(layout) = regrouped_layout(&x.shape, &x.perm, shape)
            && reshaped_layout(&x.shape, &layout, shape).as_deref() == Some(&NHWC[..])
        {
            let x = self.require(&x, &layout)?;
            return Ok(Val {
                loc: x.loc,
                shape: shape.to_vec(),
                perm: NHWC.to_vec(),
            });
        }
        let x = self.require(&x, &identity(x.shape.len()))?;
        Ok(Val {
            loc: x.loc,
            shape: shape.to_vec(),
            perm: identity(shape.len()),
        })
    }

    /// Each input copied into its place along `axis` of one buffer.
    pub(crate) fn concat(
        &mut self,
        node: &Node,
        axis: usize,
        shape: &[usize],
    ) -> Result<Val, String> {
        let inputs = node
            .inputs
            .iter()
            .map(|i| self.get(i))
            .collect::<Result<Vec<_>, _>>()?;
        let rank = shape.len();
        let perm = if rank == 4 {
            NHWC.to_vec()
        } else {
            identity(rank)
        };
        let y = self.alloc(shape, perm.clone());
        let ys = y.strides();
        let mut start = 0;
        for v in &inputs {
            let dst = y.loc.offset(start * ys[axis]);
            self.ew(None, Act::None, Cast::None, &v.shape, &perm, dst, &ys, &[v])?;
            start += v.shape[axis];
        }
        Ok(y)
    }

    /// The padding value everywhere, then the input inside it.
    pub(crate) fn pad(
        &mut self,
        node: &Node,
        pads: &[usize],
        value: f32,
        shape: &[usize],
    ) -> Result<Val, String> {
        let rank = shape.len();
        let x = self.get(&node.inputs[0])?;
        let fill = self.constant(&format!("{}.value", node.name), &Tensor::scalar(value));
        let fill = Val {
            shape: vec![1; rank],
            perm: identity(rank),
            ..fill
        };
        let y = self.alloc(shape, x.perm.clone());
        let ys = y.strides();
        self.ew(
            None,
            Act::None,
            Cast::None,
            shape,
            &x.perm,
            y.loc,
            &ys,
            &[&fill],
        )?;
        let inside: usize = (0..rank).map(|a| pads[a] * ys[a]).sum();
        let dst = y.loc.offset(inside);
        self.ew(
            None,
            Act::None,
            Cast::None,
            &x.shape,
            &x.perm,
            dst,
            &ys,
            &[&x],
        )?;
        Ok(y)
    }
}

/// The axes of `from` and `to` (those not of size 1) in groups of equal size, a split or a
/// merge each: the group of each axis of `from` (`usize::MAX` for axes of 1), and each
/// group's axes of `to`. `None` where the sizes do not regroup.
fn regroup(from: &[usize], to: &[usize]) -> Option<(Vec<usize>, Vec<Vec<usize>>)> {
    let old: Vec<usize> = (0..from.len()).filter(|&a| from[a] != 1).collect();
    let new: Vec<usize> = (0..to.len()).filter(|&a| to[a] != 1).collect();
    let mut group_of_old = vec![usize::MAX; from.len()];
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        let (mut a, mut b) = (1usize, 1usize);
        let mut new_axes = Vec::new();
        loop {
            if a <= b && i < old.len() && (a < b || new_axes.is_empty() || a == 1) {
                a *= from[old[i]];
                group_of_old[old[i]] = groups.len();
                i += 1;
            } else if j < new.len() {
                b *= to[new[j]];
                new_axes.push(new[j]);
                j += 1;
            } else {
                return None;
            }
            if a == b && a > 1 {
                break;
            }
        }
        groups.push(new_axes);
    }
    Some((group_of_old, groups))
}

/// The layout of a value laid out as `perm` seen with `to`, if there is one without moving
/// anything: the axes of `from` and `to` fall into groups of equal size (a split or a merge),
/// and each group of `from` must lie together in memory, in its logical order; its axes in
/// `to` then take its place. Axes of size 1 go anywhere.
fn reshaped_layout(from: &[usize], perm: &[usize], to: &[usize]) -> Option<Vec<usize>> {
    let (group_of_old, groups) = regroup(from, to)?;
    // In memory, each group's old axes one after the other, in logical order.
    let in_memory: Vec<usize> = perm.iter().copied().filter(|&a| from[a] != 1).collect();
    let mut out: Vec<usize> = (0..to.len()).filter(|&a| to[a] == 1).collect();
    let mut k = 0;
    while k < in_memory.len() {
        let g = group_of_old[in_memory[k]];
        let members = members(&group_of_old, g);
        if in_memory.get(k..k + members.len())? != members.as_slice() {
            return None;
        }
        out.extend(&groups[g]);
        k += members.len();
    }
    Some(out)
}

/// A layout for a value laid out as `perm` that `reshaped_layout` takes to `to`, as near
/// to `perm` as one is: each group's axes together in their logical order, the groups in
/// the order in which their first axis lies in memory. A copy into it moves each value
/// little (within its pixel, for a feature map's channels regrouped).
fn regrouped_layout(from: &[usize], perm: &[usize], to: &[usize]) -> Option<Vec<usize>> {
    let (group_of_old, _) = regroup(from, to)?;
    let mut out: Vec<usize> = (0..from.len()).filter(|&a| from[a] == 1).collect();
    for &a in perm.iter().filter(|&&a| from[a] != 1) {
        if !out.contains(&a) {
            out.extend(members(&group_of_old, group_of_old[a]));
        }
    }
    Some(out)
}

/// The axes of group `g`, in logical order.
fn members(group_of_old: &[usize], g: usize) -> Vec<usize> {
    (0..group_of_old.len())
        .filter(|&a| group_of_old[a] == g)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{regrouped_layout, reshaped_layout};

    #[test]
    fn reshapes_keep_layouts_where_the_groups_lie_together() {
        // ViT's heads: [n, s, 768] → [n, s, 12, 64] splits the last axis, in any layout.
        assert_eq!(
            reshaped_layout(&[2, 197, 768], &[1, 0, 2], &[2, 197, 12, 64]),
            Some(vec![1, 0, 2, 3])
        );
        // Heads merged back: [n, s, h, d] laid out as [n, h, s, d] (perm [0, 2, 1, 3]) cannot
        // become [n, s, h·d] without a copy; laid out as itself it can.
        assert_eq!(
            reshaped_layout(&[2, 197, 12, 64], &[0, 2, 1, 3], &[2, 197, 768]),
            None
        );
        assert_eq!(
            reshaped_layout(&[2, 197, 12, 64], &[0, 1, 2, 3], &[2, 197, 768]),
            Some(vec![0, 1, 2])
        );
        // Swin's windows split from the batch axis: [n·w, h, t, d] → [n, w, h, t, d] with the
        // heads innermost but one.
        assert_eq!(
            reshaped_layout(&[8, 3, 49, 32], &[0, 2, 1, 3], &[2, 4, 3, 49, 32]),
            Some(vec![0, 1, 3, 2, 4])
        );
        // Axes of 1 anywhere; a reshape whose sizes do not regroup is refused.
        assert_eq!(
            reshaped_layout(&[1, 6, 1], &[2, 1, 0], &[2, 1, 3]),
            Some(vec![1, 0, 2])
        );
        assert_eq!(reshaped_layout(&[6, 4], &[1, 0], &[4, 6]), None);
        assert_eq!(reshaped_layout(&[6, 4], &[0, 1], &[4, 6]), Some(vec![0, 1]));
    }

    #[test]
    fn regrouped_layouts_keep_the_groups_where_they_lie() {
        // ShuffleNet's shuffle: [n, 2, 24, h, w] channels-last, transposed to [n, 24, 2, h, w]
        // (memory: n, h, w, the 2, the 24), merged to [n, 48, h, w]: copied within each
        // pixel, it is channels-last.
        let (from, perm, to) = ([8, 24, 2, 7, 7], [0, 3, 4, 2, 1], [8, 48, 7, 7]);
        assert_eq!(reshaped_layout(&from, &perm, &to), None);
        let layout = regrouped_layout(&from, &perm, &to).unwrap();
        assert_eq!(layout, [0, 3, 4, 1, 2]);
        assert_eq!(reshaped_layout(&from, &layout, &to), Some(vec![0, 2, 3, 1]));
        // One frame: its axis of 1 goes first, anywhere.
        let layout = regrouped_layout(&[1, 24, 2, 7, 7], &perm, &[1, 48, 7, 7]).unwrap();
        assert_eq!(layout, [0, 3, 4, 1, 2]);
        // Heads merged back ([n, s, h, d] laid out as [n, h, s, d]): the group (h, d) lies
        // where h does, so the copy is [n, h, d, s] and the merge is channels-first
        // ([n, h·d, s]), not what the 4-D case of `reshape` takes.
        assert_eq!(
            regrouped_layout(&[2, 197, 12, 64], &[0, 2, 1, 3], &[2, 197, 768]),
            Some(vec![0, 2, 3, 1])
        );
        // A merge of every axis: the logical order.
        assert_eq!(
            regrouped_layout(&[6, 4], &[1, 0], &[4, 6]),
            Some(vec![0, 1])
        );
        assert_eq!(regrouped_layout(&[6, 4], &[0, 1], &[5, 5]), None);
    }
}
