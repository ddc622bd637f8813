// SPDX-License-Identifier: MPL-2.0
//! A plain, slow CPU evaluator of the IR in f32. It folds constants at import, and the tests
//! use it to check that every rewriting pass leaves the graph's results unchanged, so that
//! most engine bugs show up without a GPU.

#[cfg(test)]
use std::collections::HashMap;

#[cfg(test)]
use super::ir::Graph;
use super::ir::{Node, Op, Tensor, broadcast, strides};
use super::ops::{conv, elementwise, matmul, normalization, shape};

/// Runs `graph` on `input` and returns its output (the tests' check of every pass).
#[cfg(test)]
pub(super) fn run(graph: &Graph, input: &Tensor) -> Tensor {
    let mut values: HashMap<&str, Tensor> = HashMap::new();
    values.insert(&graph.input, input.clone());
    for node in &graph.nodes {
        let inputs: Vec<&Tensor> = node
            .inputs
            .iter()
            .map(|name| {
                values
                    .get(name.as_str())
                    .or_else(|| graph.consts.get(name))
                    .unwrap_or_else(|| panic!("{}: input `{name}` is not computed", node.name))
            })
            .collect();
        let out = eval(node, &inputs, graph.shape(&node.output));
        values.insert(&node.output, out);
    }
    values
        .remove(graph.output.as_str())
        .or_else(|| graph.consts.get(&graph.output).cloned())
        .expect("the graph computes its output")
}

/// Computes one node; `out_shape` is the output's inferred shape. Each family of operators
/// evaluates its own (`ops`).
pub(crate) fn eval(node: &Node, inputs: &[&Tensor], out_shape: &[usize]) -> Tensor {
    let data = match &node.op {
        Op::Conv(c) => conv::eval_conv(c, inputs, out_shape),
        Op::BatchNorm { epsilon } => conv::eval_batch_norm(*epsilon, inputs),
        Op::Pool(p) => conv::eval_pool(p, inputs, out_shape),
        Op::GlobalAvgPool => conv::eval_global_avg_pool(inputs),
        Op::Gemm { act } => matmul::eval_gemm(*act, inputs),
        Op::MatMul { alpha } => matmul::eval_matmul(*alpha, inputs, out_shape),
        Op::Attention { alpha } => matmul::eval_attention(*alpha, node, inputs, out_shape),
        Op::Unary(act) => elementwise::eval_unary(*act, inputs),
        Op::Binary { op, act } => elementwise::eval_binary(*op, *act, inputs, out_shape),
        Op::Softmax { axis } => normalization::eval_softmax(*axis, inputs),
        Op::LayerNorm { axis, epsilon } => normalization::eval_layer_norm(*axis, *epsilon, inputs),
        Op::Lrn {
            size,
            alpha,
            beta,
            bias,
        } => normalization::eval_lrn(*size, [*alpha, *beta, *bias], inputs),
        Op::ReduceMean { axes } => normalization::eval_reduce_mean(axes, inputs),
        Op::Pad { pads, value } => shape::eval_pad(pads, *value, inputs),
        Op::Concat { axis } => shape::eval_concat(*axis, inputs, out_shape),
        Op::Transpose { perm } => shape::eval_transpose(perm, inputs, out_shape),
        Op::Reshape => inputs[0].data.to_vec(),
        Op::Slice {
            axis,
            start,
            end,
            step,
        } => shape::eval_slice(*axis, *start..*end, *step, inputs),
    };
    debug_assert_eq!(
        data.len(),
        out_shape.iter().product::<usize>(),
        "{}",
        node.name
    );
    Tensor::new(out_shape.to_vec(), data)
}

/// Maps a flat index of `out` to the flat index of an input broadcast to it.
pub(crate) fn broadcast_index(shape: &[usize], out: &[usize]) -> impl Fn(usize) -> usize {
    debug_assert_eq!(broadcast(shape, out).as_deref(), Some(out));
    let pad = out.len() - shape.len();
    let in_strides = strides(shape);
    let out_strides = strides(out);
    let terms: Vec<(usize, usize, usize)> = (0..shape.len())
        .filter(|&a| shape[a] != 1)
        .map(|a| (out_strides[a + pad], out[a + pad], in_strides[a]))
        .collect();
    move |i| terms.iter().map(|(os, d, is)| (i / os) % d * is).sum()
}

/// Calls `f` with the flat indices of each line along `axis`.
pub(crate) fn along_axis(shape: &[usize], axis: usize, mut f: impl FnMut(&[usize])) {
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let mut idx = Vec::with_capacity(shape[axis]);
    for o in 0..outer {
        for i in 0..inner {
            idx.clear();
            idx.extend((0..shape[axis]).map(|a| (o * shape[axis] + a) * inner + i));
            f(&idx);
        }
    }
}
