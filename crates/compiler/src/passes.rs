// SPDX-License-Identifier: MPL-2.0
//! Rewrites that make the graph cheaper to run and leave its results unchanged (checked by
//! the tests with `reference`), in `optimise`'s order: batch norms folded into convolution
//! weights; `x · sigmoid(x)` fused into SiLU and PyTorch's exact GELU into GELU; scalar
//! scales of a product's operands (attention's query and key) into the product, and a
//! constant add or scale along a product's columns (a bias, a batch norm over its rows) into
//! its bias and weights; projections whose column groups are only sliced apart split into a
//! product per group (`column_split`); residual adds and biases, then activations, fused into
//! the operator before them; dead nodes and unused constants removed.

use std::collections::HashSet;
use std::f32::consts::{FRAC_1_SQRT_2, SQRT_2};

use super::ir::{Act, BinOp, Graph, Node, Op, Tensor};
use super::plan::attention_takes;

/// All passes, in the order that lets each find its patterns.
pub(super) fn optimise(graph: &mut Graph) {
    fold_batchnorm(graph);
    fuse_silu(graph);
    fuse_gelu(graph);
    fold_matmul_scale(graph);
    fold_into_gemm(graph);
    super::column_split::split_products(graph);
    fuse_residual(graph);
    fuse_activation(graph);
    remove_dead(graph);
    graph.prune_consts();
}

/// The nodes of `graph` an fp16 plan keeps in f32: those named in `names` (whose values
/// passed fp16's range) and the nodes that read their values, through views, which would
/// otherwise read them cast to fp16. Names not in the graph are left out.
pub(super) fn kept_in_f32(graph: &Graph, names: &[String]) -> HashSet<String> {
    let mut kept = HashSet::new();
    let mut values: Vec<String> = Vec::new();
    for node in graph.nodes.iter().filter(|n| names.contains(&n.name)) {
        kept.insert(node.name.clone());
        values.push(node.output.clone());
    }
    while let Some(value) = values.pop() {
        for reader in graph.nodes.iter().filter(|n| n.inputs.contains(&value)) {
            if kept.insert(reader.name.clone()) && reader.op.is_view() {
                values.push(reader.output.clone());
            }
        }
    }
    kept
}

/// The node producing `value` when only one node reads it.
fn sole_producer(graph: &Graph, value: &str) -> Option<usize> {
    (graph.uses(value) == 1)
        .then(|| graph.producer(value))
        .flatten()
}

/// `BatchNormalization(Conv(x))` becomes `Conv(x)` with scaled weights and a shifted bias;
/// a batch norm after anything else becomes a per-channel multiply and add.
pub(super) fn fold_batchnorm(graph: &mut Graph) {
    let mut i = 0;
    while i < graph.nodes.len() {
        let Op::BatchNorm { epsilon } = graph.nodes[i].op else {
            i += 1;
            continue;
        };
        let node = graph.nodes[i].clone();
        let [scale, shift] = bn_affine(graph, &node, epsilon);
        let conv = sole_producer(graph, &node.inputs[0]).filter(|&c| {
            matches!(&graph.nodes[c].op, Op::Conv(conv) if conv.act == Act::None)
                && graph.nodes[c].inputs.len() == 3
        });
        if let Some(c) = conv {
            let conv_node = &graph.nodes[c];
            let w = &graph.consts[&conv_node.inputs[1]];
            let b = &graph.consts[&conv_node.inputs[2]];
            let per_k = w.len() / w.shape[0];
            let w = Tensor::new(
                w.shape.clone(),
                w.data
                    .iter()
                    .enumerate()
                    .map(|(j, v)| v * scale[j / per_k])
                    .collect(),
            );
            let b = Tensor::new(
                b.shape.clone(),
                b.data
                    .iter()
                    .enumerate()
                    .map(|(k, v)| v * scale[k] + shift[k])
                    .collect(),
            );
            let (w_name, b_name) = (
                format!("{}.folded_weight", conv_node.name),
                format!("{}.folded_bias", conv_node.name),
            );
            graph.consts.insert(w_name.clone(), w);
            graph.consts.insert(b_name.clone(), b);
            let conv_node = &mut graph.nodes[c];
            conv_node.inputs[1] = w_name;
            conv_node.inputs[2] = b_name;
            conv_node.output = node.output.clone();
            graph.shapes.remove(&node.inputs[0]);
            graph.nodes.remove(i);
            continue;
        }
        // y = x·scale + shift, per channel (axis 1).
        let rank = graph.shape(&node.inputs[0]).len();
        let mut shape = vec![scale.len()];
        shape.resize(rank - 1, 1);
        let (scale_name, shift_name, mid) = (
            format!("{}.scale", node.name),
            format!("{}.shift", node.name),
            format!("{}.scaled", node.output),
        );
        graph
            .consts
            .insert(scale_name.clone(), Tensor::new(shape.clone(), scale));
        graph
            .consts
            .insert(shift_name.clone(), Tensor::new(shape, shift));
        let out_shape = graph.shape(&node.output).to_vec();
        graph.shapes.insert(mid.clone(), out_shape);
        let binary = |op, inputs, output| Node {
            name: node.name.clone(),
            op: Op::Binary { op, act: Act::None },
            inputs,
            output,
        };
        graph.nodes[i] = binary(
            BinOp::Mul,
            vec![node.inputs[0].clone(), scale_name],
            mid.clone(),
        );
        graph.nodes.insert(
            i + 1,
            binary(BinOp::Add, vec![mid, shift_name], node.output.clone()),
        );
        i += 2;
    }
}

/// Per-channel scale and shift of an inference batch norm.
fn bn_affine(graph: &Graph, node: &Node, epsilon: f32) -> [Vec<f32>; 2] {
    let [gamma, beta, mean, var] = [1, 2, 3, 4].map(|i| &graph.consts[&node.inputs[i]].data);
    let scale: Vec<f32> = gamma
        .iter()
        .zip(var.iter())
        .map(|(g, v)| g / (v + epsilon).sqrt())
        .collect();
    let shift = beta
        .iter()
        .zip(mean.iter())
        .zip(&scale)
        .map(|((b, m), s)| b - m * s)
        .collect();
    [scale, shift]
}

/// For the plain binary `op` node `i`: an operand whose sole producer `fits` (given the
/// producer, the operand and the other operand), as (producer index, operand, other operand).
fn operand_from(
    graph: &Graph,
    i: usize,
    op: BinOp,
    fits: impl Fn(&Node, &str, &str) -> bool,
) -> Option<(usize, String, String)> {
    let node = &graph.nodes[i];
    if node.op != (Op::Binary { op, act: Act::None }) {
        return None;
    }
    [(0, 1), (1, 0)].into_iter().find_map(|(a, b)| {
        let (y, other) = (&node.inputs[a], &node.inputs[b]);
        let p = sole_producer(graph, y)?;
        fits(&graph.nodes[p], y, other).then(|| (p, y.clone(), other.clone()))
    })
}

/// `Mul(x, Sigmoid(x))`, PyTorch's SiLU, becomes one `Silu(x)`.
pub(super) fn fuse_silu(graph: &mut Graph) {
    let mut i = 0;
    while i < graph.nodes.len() {
        let out_shape = graph.shapes.get(&graph.nodes[i].output).cloned();
        let found = operand_from(graph, i, BinOp::Mul, |producer, _, x| {
            producer.op == Op::Unary(Act::Sigmoid)
                && producer.inputs[0] == x
                && out_shape.as_deref() == Some(graph.shape(x))
        });
        if let Some((p, sigmoid, x)) = found {
            let node = &mut graph.nodes[i];
            node.op = Op::Unary(Act::Silu);
            node.inputs = vec![x];
            graph.shapes.remove(&sigmoid);
            graph.nodes.remove(p);
            continue;
        }
        i += 1;
    }
}

/// PyTorch's exact GELU, exported as `x · (1 + erf(x / √2)) · 0.5` (five nodes; the two
/// products in either order), becomes one `Gelu(x)`: one pass over the tensor instead of
/// five, which a matrix product before it then takes as its activation.
pub(super) fn fuse_gelu(graph: &mut Graph) {
    let mut found = false;
    for i in 0..graph.nodes.len() {
        if let Some(x) = gelu_input(graph, i) {
            let node = &mut graph.nodes[i];
            node.op = Op::Unary(Act::Gelu);
            node.inputs = vec![x];
            found = true;
        }
    }
    if found {
        // The division, erf, add and inner product are read by nothing now.
        remove_dead(graph);
    }
}

/// The value `x` when node `i` computes GELU(x) in the exported form.
fn gelu_input(graph: &Graph, i: usize) -> Option<String> {
    let mul = Op::Binary {
        op: BinOp::Mul,
        act: Act::None,
    };
    let node = &graph.nodes[i];
    if node.op != mul {
        return None;
    }
    // The three factors, looking through the inner product (read by this node only).
    let mut factors = Vec::new();
    for input in &node.inputs {
        match sole_producer(graph, input).map(|p| &graph.nodes[p]) {
            Some(inner) if inner.op == mul => factors.extend(inner.inputs.iter().cloned()),
            _ => factors.push(input.clone()),
        }
    }
    if factors.len() != 3 {
        return None;
    }
    let half = factors.iter().position(|f| is_scalar(graph, f, 0.5))?;
    factors.remove(half);
    let [a, b] = [&factors[0], &factors[1]];
    [(a, b), (b, a)]
        .into_iter()
        .find(|(erf_part, x)| {
            erf_part_input(graph, erf_part) == Some(x.as_str())
                && graph.shapes.get(*x) == graph.shapes.get(&node.output)
        })
        .map(|(_, x)| x.clone())
}

/// `x` when `value` is `1 + erf(x / √2)` (or `x · (1/√2)`), each step read only once.
fn erf_part_input<'g>(graph: &'g Graph, value: &str) -> Option<&'g str> {
    let producer = |v: &str| sole_producer(graph, v).map(|p| &graph.nodes[p]);
    let add = producer(value)?;
    if add.op
        != (Op::Binary {
            op: BinOp::Add,
            act: Act::None,
        })
    {
        return None;
    }
    let erf_out = match &add.inputs[..] {
        [e, one] | [one, e] if is_scalar(graph, one, 1.0) => e,
        _ => return None,
    };
    let erf = producer(erf_out)?;
    if erf.op != Op::Unary(Act::Erf) {
        return None;
    }
    let scaled = producer(&erf.inputs[0])?;
    match (&scaled.op, &scaled.inputs[..]) {
        (
            Op::Binary {
                op: BinOp::Div,
                act: Act::None,
            },
            [x, d],
        ) if is_scalar(graph, d, SQRT_2) => Some(x),
        (
            Op::Binary {
                op: BinOp::Mul,
                act: Act::None,
            },
            [x, m] | [m, x],
        ) if is_scalar(graph, m, FRAC_1_SQRT_2) => Some(x),
        _ => None,
    }
}

/// Whether `value` is a one-element constant equal to `want` (to f32 rounding).
fn is_scalar(graph: &Graph, value: &str, want: f32) -> bool {
    graph
        .consts
        .get(value)
        .is_some_and(|t| t.len() == 1 && (t.data[0] - want).abs() <= 1e-6 * want.abs())
}

/// `MatMul(a · s, b · t)` with scalar constants `s` and `t` becomes `MatMul(a, b)` scaled by
/// `s · t` (attention scales query and key, each by the fourth root of the head size), also
/// through a transpose (`Transpose(k · t)`, the keys): the product's scaling is free, two
/// passes over query and key are not.
pub(super) fn fold_matmul_scale(graph: &mut Graph) {
    for i in 0..graph.nodes.len() {
        if !matches!(graph.nodes[i].op, Op::MatMul { .. }) {
            continue;
        }
        for input in 0..2 {
            let value = graph.nodes[i].inputs[input].clone();
            // The node whose input is the scaled value: the MatMul, or a transpose before it.
            let (reader, at) = match sole_producer(graph, &value) {
                Some(t) if matches!(graph.nodes[t].op, Op::Transpose { .. }) => (t, 0),
                _ => (i, input),
            };
            let scaled = graph.nodes[reader].inputs[at].clone();
            let Some(mul) = sole_producer(graph, &scaled) else {
                continue;
            };
            let m = &graph.nodes[mul];
            let plain_mul = Op::Binary {
                op: BinOp::Mul,
                act: Act::None,
            };
            let found = (m.op == plain_mul)
                .then(|| {
                    [(0, 1), (1, 0)].into_iter().find_map(|(x, s)| {
                        let t = graph.consts.get(&m.inputs[s]).filter(|t| t.len() == 1)?;
                        Some((m.inputs[x].clone(), t.data[0]))
                    })
                })
                .flatten();
            let Some((x, factor)) = found.filter(|(_, f)| f.is_finite()) else {
                continue;
            };
            if graph.shapes.get(&x) != graph.shapes.get(&scaled) {
                continue; // the scalar made it larger (broadcast a smaller x)
            }
            let Op::MatMul { alpha } = &mut graph.nodes[i].op else {
                unreachable!("checked above");
            };
            if !(*alpha * factor).is_finite() {
                continue;
            }
            *alpha *= factor;
            graph.nodes[reader].inputs[at] = x;
        }
    }
    remove_dead(graph);
}

/// `MatMul(Softmax(MatMul(q, kᵀ)), v)`, with scalings, constant additions (position biases,
/// masks) and reshapes of the leading axes (Swin's shifted windows) between the first product
/// and the softmax, becomes one `Attention` where the kernel takes its head sizes: the fp16
/// plan runs it as one kernel that keeps the scores in registers instead of writing and
/// reading them four times. The additions become one constant bias, their sum over the
/// scores' last two axes; where reshapes split the leading axes (images and windows), the
/// attention runs over the finest split, between reshapes of its operands and its output.
/// An attention whose product with the values is named in `kept` (kept in f32, because its
/// output passed fp16's range) stays unfused: the fused kernel runs in fp16 only.
pub(super) fn fuse_attention(graph: &mut Graph, kept: &HashSet<String>) {
    let mut i = 0;
    while i < graph.nodes.len() {
        let found = (graph.nodes[i].op == Op::MatMul { alpha: 1.0 }
            && !kept.contains(&graph.nodes[i].name))
        .then(|| attention_at(graph, i))
        .flatten();
        let Some(found) = found else {
            i += 1;
            continue;
        };
        let node = graph.nodes[i].clone();
        let lead = found.lead.clone();
        // An operand seen with the attention's leading axes: itself, or a reshape.
        let mut added = Vec::new();
        let mut view = |graph: &mut Graph, value: &str, what: &str| {
            let shape = graph.shape(value);
            let want = [lead.clone(), shape[shape.len() - 2..].to_vec()].concat();
            if shape == want.as_slice() {
                return value.to_owned();
            }
            let name = format!("{}.{what}", node.name);
            graph.shapes.insert(name.clone(), want);
            added.push(Node {
                name: name.clone(),
                op: Op::Reshape,
                inputs: vec![value.to_owned()],
                output: name.clone(),
            });
            name
        };
        let mut inputs = vec![
            view(graph, &found.q, "q"),
            view(graph, &found.kt, "kt"),
            view(graph, &node.inputs[1], "v"),
        ];
        if !found.biases.is_empty() {
            let name = format!("{}.attention_bias", node.name);
            let scores = graph.shape(&node.inputs[0]);
            let queries_keys = &scores[scores.len() - 2..];
            let bias = attention_bias(graph, &found.biases, &lead, queries_keys);
            graph.consts.insert(name.clone(), bias);
            inputs.push(name);
        }
        let out_shape = graph.shape(&node.output).to_vec();
        let fused_shape = [lead.clone(), out_shape[out_shape.len() - 2..].to_vec()].concat();
        let mut attention = Node {
            op: Op::Attention { alpha: found.alpha },
            inputs,
            ..node.clone()
        };
        if fused_shape != out_shape {
            attention.output = format!("{}.attention", node.name);
            graph.shapes.insert(attention.output.clone(), fused_shape);
            graph.nodes[i] = Node {
                name: format!("{}.merge", node.name),
                op: Op::Reshape,
                inputs: vec![attention.output.clone()],
                output: node.output.clone(),
            };
            added.push(attention);
        } else {
            graph.nodes[i] = attention;
        }
        let n = added.len();
        graph.nodes.splice(i..i, added);
        i += n + 1;
    }
    remove_dead(graph);
    graph.prune_consts();
}

/// What `fuse_attention` finds before the product with the values.
struct AttentionParts {
    q: String,
    kt: String,
    alpha: f32,
    /// The leading axes the attention runs over: the finest split of every view of them.
    lead: Vec<usize>,
    /// Constants added to the scores, each with the factor the scalings after it apply and
    /// the leading axes of the scores where it is added.
    biases: Vec<(String, f32, Vec<usize>)>,
}

/// The attention whose product with the values is node `i`, walking back from its softmax
/// to the product of query and keys.
fn attention_at(graph: &Graph, i: usize) -> Option<AttentionParts> {
    let weights = &graph.nodes[i].inputs[0];
    let rank = graph.shape(weights).len();
    let softmax = sole_producer(graph, weights)?;
    if graph.nodes[softmax].op != (Op::Softmax { axis: rank - 1 }) {
        return None;
    }
    let queries_keys = graph.shape(weights)[rank - 2..].to_vec();
    let lead = |value: &str| -> Option<Vec<usize>> {
        let shape = graph.shape(value);
        (shape.len() >= 2 && shape[shape.len() - 2..] == queries_keys)
            .then(|| shape[..shape.len() - 2].to_vec())
    };
    let mut views = vec![lead(weights)?];
    let mut value = graph.nodes[softmax].inputs[0].clone();
    let (mut scale, mut biases) = (1.0f32, Vec::new());
    loop {
        let here = lead(&value)?;
        views.push(here.clone());
        let n = &graph.nodes[sole_producer(graph, &value)?];
        match n.op {
            Op::MatMul { alpha } => {
                let (q, kt, v) = (&n.inputs[0], &n.inputs[1], &graph.nodes[i].inputs[1]);
                let (dk, dv) = (*graph.shape(q).last()?, *graph.shape(v).last()?);
                let alpha = alpha * scale;
                let lead = refinement(&views)?;
                return (attention_takes(dk, dv) && alpha.is_finite()).then(|| AttentionParts {
                    q: q.clone(),
                    kt: kt.clone(),
                    alpha,
                    lead,
                    biases,
                });
            }
            Op::Reshape => {
                value = n.inputs[0].clone();
                continue;
            }
            Op::Binary { op, act: Act::None } => {
                // One computed operand with the scores' shape, one constant.
                let (x, c) = [(0, 1), (1, 0)].into_iter().find_map(|(x, c)| {
                    let t = graph.consts.get(&n.inputs[c])?;
                    (!graph.is_const(&n.inputs[x]))
                        .then_some((n.inputs[x].clone(), (&n.inputs[c], t)))
                })?;
                if graph.shape(&x) != graph.shape(&value) {
                    return None;
                }
                let scalar = (c.1.len() == 1).then(|| c.1.data[0]);
                match (op, scalar) {
                    (BinOp::Add, _) if c.1.shape.len() <= here.len() + 2 => {
                        biases.push((c.0.clone(), scale, here))
                    }
                    (BinOp::Mul, Some(f)) => scale *= f,
                    (BinOp::Div, Some(f)) if n.inputs[1] == *c.0 => scale /= f,
                    _ => return None,
                }
                value = x;
            }
            _ => return None,
        }
    }
}

/// The finest shape that each of `views` (shapes of as many elements) is a merge of, if
/// there is one: `[8, 3]` and `[2, 4, 3]` give `[2, 4, 3]`; `[4, 6]` and `[6, 4]` none.
fn refinement(views: &[Vec<usize>]) -> Option<Vec<usize>> {
    let mut cuts = std::collections::BTreeSet::new();
    for view in views {
        let mut product = 1;
        for &d in view {
            product *= d;
            cuts.insert(product);
        }
    }
    let mut out = Vec::new();
    let mut previous = 1;
    for cut in cuts {
        if cut % previous != 0 {
            return None;
        }
        if cut != previous {
            out.push(cut / previous);
        }
        previous = cut;
    }
    Some(out)
}

/// `shape` (a bias over the leading axes `view`, then queries and keys) over the finer
/// leading axes `lead`: each axis of `view` splits into the axes of `lead` it covers, or into
/// axes of 1 where the bias broadcasts along it.
fn split_bias_shape(shape: &[usize], view: &[usize], lead: &[usize]) -> Vec<usize> {
    let shape = [vec![1; view.len() + 2 - shape.len()], shape.to_vec()].concat();
    let mut out = Vec::new();
    let mut l = 0;
    for (a, &d) in view.iter().enumerate() {
        let mut covered = 1;
        while covered < d {
            covered *= lead[l];
            out.push(if shape[a] == 1 { 1 } else { lead[l] });
            l += 1;
        }
    }
    // Axes of 1 in `lead` that no view axis covered.
    out.extend(std::iter::repeat_n(1, lead.len() - out.len()));
    out.extend(&shape[view.len()..]);
    out
}

/// The sum of `biases` (each times its factor) broadcast to `queries_keys` over the leading
/// axes `lead`, which stay 1 where every bias broadcasts along them.
fn attention_bias(
    graph: &Graph,
    biases: &[(String, f32, Vec<usize>)],
    lead: &[usize],
    queries_keys: &[usize],
) -> Tensor {
    let shapes: Vec<Vec<usize>> = biases
        .iter()
        .map(|(name, _, view)| split_bias_shape(graph.shape(name), view, lead))
        .collect();
    let mut shape = vec![1; lead.len() + 2];
    for s in &shapes {
        for (o, &d) in shape.iter_mut().zip(s) {
            *o = (*o).max(d);
        }
    }
    shape[lead.len()..].copy_from_slice(queries_keys);
    let mut data = vec![0.0; shape.iter().product()];
    for ((name, factor, _), bias_shape) in biases.iter().zip(&shapes) {
        let t = &graph.consts[name];
        let index = super::reference::broadcast_index(bias_shape, &shape);
        for (j, v) in data.iter_mut().enumerate() {
            *v += factor * t.data[index(j)];
        }
    }
    Tensor::new(shape, data)
}

/// `Add(Gemm(x), c)` and `Mul(Gemm(x), c)`, `c` a constant along the last axis, become the
/// product's own bias (which cuBLASLt adds in its epilogue) or a scale of its weights' and
/// bias's columns, also where reshapes that keep the last axis lie between the two (LeViT's
/// batch norms after its linear layers, over the rows flattened: two element-wise passes
/// each, 140 of its 240 steps).
pub(super) fn fold_into_gemm(graph: &mut Graph) {
    let mut i = 0;
    while i < graph.nodes.len() {
        if !fold_into_gemm_at(graph, i) {
            i += 1;
        }
    }
}

/// `fold_into_gemm` for node `i`; whether it folded (and removed) it.
fn fold_into_gemm_at(graph: &mut Graph, i: usize) -> bool {
    let node = graph.nodes[i].clone();
    let op = match node.op {
        Op::Binary {
            op: op @ (BinOp::Add | BinOp::Mul),
            act: Act::None,
        } => op,
        _ => return false,
    };
    let shape = graph.shape(&node.output).to_vec();
    let n = *shape.last().unwrap_or(&0);
    for (y, c) in [(0, 1), (1, 0)].map(|(a, b)| (&node.inputs[a], &node.inputs[b])) {
        let along_last = |t: &Tensor| t.len() == n && t.shape.iter().rev().skip(1).all(|&d| d == 1);
        if !graph.consts.get(c).is_some_and(along_last) || graph.shape(y) != shape {
            continue;
        }
        // A product behind reshapes that keep the last axis, each read once.
        let Some((p, views)) = product_behind_views(graph, y) else {
            continue;
        };
        let keeps_columns = |v: &usize| {
            let view = &graph.nodes[*v];
            view.op == Op::Reshape && graph.shape(&view.inputs[0]).last() == Some(&n)
        };
        if !views.iter().all(keeps_columns) || !graph.is_const(&graph.nodes[p].inputs[1]) {
            continue;
        }
        let writer = views.first().copied().unwrap_or(p);
        let c = graph.consts[c].data.clone();
        let product = graph.nodes[p].clone();
        let mut bias = match product.inputs.get(2) {
            Some(b) => graph.consts[b].data.to_vec(),
            None => vec![0.0; n],
        };
        let mut inputs = product.inputs.clone();
        match op {
            BinOp::Mul => {
                let w = &graph.consts[&product.inputs[1]];
                let scaled = (w.data.iter().enumerate())
                    .map(|(j, v)| v * c[j % n])
                    .collect();
                let w = Tensor::new(w.shape.clone(), scaled);
                let name = format!("{}.weight", node.output);
                graph.consts.insert(name.clone(), w);
                inputs[1] = name;
                bias.iter_mut().zip(c.iter()).for_each(|(b, s)| *b *= s);
            }
            _ => bias.iter_mut().zip(c.iter()).for_each(|(b, s)| *b += s),
        }
        let name = format!("{}.bias", node.output);
        graph
            .consts
            .insert(name.clone(), Tensor::new(vec![n], bias));
        inputs.truncate(2);
        inputs.push(name);
        graph.nodes[p].inputs = inputs;
        // The node's value is now written by the last reshape, or by the product.
        graph.shapes.remove(y.as_str());
        graph.nodes[writer].output = node.output.clone();
        graph.nodes.remove(i);
        return true;
    }
    false
}

/// `Add(Conv(x), z)` becomes a convolution that adds `z` itself (cuDNN's fused residual),
/// and `Add(Gemm(x), z)` a product that adds it (cuBLASLt's C operand), also where reshapes
/// and transposes lie between the product and the Add (a transformer's output projection,
/// whose rows go back to the residual stream's order): `z` then goes through the inverse
/// views to the product's shape, and the views follow the product. The fused node takes the
/// Add's place, where `z` is known to be computed.
pub(super) fn fuse_residual(graph: &mut Graph) {
    let mut i = 0;
    while i < graph.nodes.len() {
        let found = operand_from(graph, i, BinOp::Add, |producer, y, z| {
            matches!(&producer.op, Op::Conv(c) if c.act == Act::None)
                && producer.inputs.len() == 3
                && !graph.is_const(z)
                && graph.shape(z) == graph.shape(y)
                && y != z
        });
        if let Some((p, y, z)) = found {
            let mut fused = graph.nodes[p].clone();
            fused.inputs.push(z);
            fused.output = graph.nodes[i].output.clone();
            graph.nodes[i] = fused;
            graph.nodes.remove(p);
            graph.shapes.remove(&y);
            continue;
        }
        if fuse_gemm_residual(graph, i) {
            continue;
        }
        i += 1;
    }
}

/// The product (without an activation or a residual yet) that `value` is a view of, through
/// reshapes and transposes each read only by the next, and those views, nearest first.
fn product_behind_views(graph: &Graph, value: &str) -> Option<(usize, Vec<usize>)> {
    let mut views = Vec::new();
    let mut value = value;
    loop {
        let p = sole_producer(graph, value)?;
        match &graph.nodes[p].op {
            Op::Reshape | Op::Transpose { .. } => {
                views.push(p);
                value = &graph.nodes[p].inputs[0];
            }
            Op::Gemm { act: Act::None } if graph.nodes[p].inputs.len() <= 3 => {
                return Some((p, views));
            }
            _ => return None,
        }
    }
}

/// The rewrite of `fuse_residual` for a product behind views, at Add node `i`; whether it
/// applied (node `i` then holds the next node to look at).
fn fuse_gemm_residual(graph: &mut Graph, i: usize) -> bool {
    let found = operand_from(graph, i, BinOp::Add, |_, y, z| {
        !graph.is_const(z)
            && y != z
            && graph.shape(z) == graph.shape(y)
            && product_behind_views(graph, y).is_some()
    });
    let Some((_, y, z)) = found else {
        return false;
    };
    let (p, views) = product_behind_views(graph, &y).expect("found above");
    let add = graph.nodes[i].clone();
    let mut product = graph.nodes[p].clone();
    let product_shape = graph.shape(&product.output).to_vec();
    // The residual seen as the product's output: the views undone, last first.
    let mut moved = Vec::new();
    let mut residual = z;
    for &v in &views {
        let view = &graph.nodes[v];
        let undone = format!("{}.residual", view.output);
        let op = match &view.op {
            Op::Transpose { perm } => {
                let mut inverse = vec![0; perm.len()];
                for (j, &a) in perm.iter().enumerate() {
                    inverse[a] = j;
                }
                Op::Transpose { perm: inverse }
            }
            _ => Op::Reshape,
        };
        let shape = graph.shape(&view.inputs[0]).to_vec();
        graph.shapes.insert(undone.clone(), shape);
        moved.push(Node {
            name: format!("{}.residual", view.name),
            op,
            inputs: vec![residual],
            output: undone.clone(),
        });
        residual = undone;
    }
    debug_assert_eq!(graph.shape(&residual), product_shape.as_slice());
    if product.inputs.len() == 2 {
        // cuBLASLt's residual comes with a bias: a zero one costs nothing.
        let name = format!("{}.zero_bias", product.name);
        let n = *product_shape.last().unwrap_or(&1);
        graph
            .consts
            .insert(name.clone(), Tensor::new(vec![n], vec![0.0; n]));
        product.inputs.push(name);
    }
    product.inputs.push(residual);
    moved.push(product);
    // Then the views, first to last, the last one writing the Add's output.
    for &v in views.iter().rev() {
        moved.push(graph.nodes[v].clone());
    }
    moved.last_mut().expect("the product at least").output = add.output.clone();
    graph.shapes.remove(&y);
    let mut gone: Vec<usize> = views.iter().copied().chain([p]).collect();
    gone.sort_unstable();
    graph.nodes.splice(i..=i, moved);
    for &g in gone.iter().rev() {
        graph.nodes.remove(g);
    }
    true
}

/// An activation after a convolution, a matrix product or an element-wise operation runs in
/// that operator.
pub(super) fn fuse_activation(graph: &mut Graph) {
    let mut i = 0;
    while i < graph.nodes.len() {
        let Op::Unary(act) = graph.nodes[i].op else {
            i += 1;
            continue;
        };
        let input = graph.nodes[i].inputs[0].clone();
        let target = sole_producer(graph, &input).filter(|&p| match &graph.nodes[p].op {
            Op::Conv(c) => c.act == Act::None,
            Op::Gemm { act } | Op::Binary { act, .. } => *act == Act::None,
            _ => false,
        });
        if let Some(p) = target {
            let output = graph.nodes[i].output.clone();
            let producer = &mut graph.nodes[p];
            match &mut producer.op {
                Op::Conv(c) => c.act = act,
                Op::Gemm { act: a } | Op::Binary { act: a, .. } => *a = act,
                _ => unreachable!("filtered above"),
            }
            producer.output = output;
            graph.shapes.remove(&input);
            graph.nodes.remove(i);
            continue;
        }
        i += 1;
    }
}

/// Drops nodes whose results nothing reads.
pub(super) fn remove_dead(graph: &mut Graph) {
    loop {
        let dead = graph.nodes.iter().rposition(|n| graph.uses(&n.output) == 0);
        match dead {
            Some(d) => {
                let node = graph.nodes.remove(d);
                graph.shapes.remove(&node.output);
            }
            None => break,
        }
    }
}
