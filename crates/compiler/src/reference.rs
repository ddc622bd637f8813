// SPDX-License-Identifier: MPL-2.0
//! A plain, slow CPU evaluator of the IR in f32. It folds constants at import, and the tests
//! use it to check that every rewriting pass leaves the graph's results unchanged, so that
//! most engine bugs show up without a GPU.

#[cfg(test)]
use std::collections::HashMap;

#[cfg(test)]
use super::ir::Graph;
use super::ir::{Node, Op, PoolKind, Tensor, broadcast, strides};

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

/// Computes one node; `out_shape` is the output's inferred shape.
pub(super) fn eval(node: &Node, inputs: &[&Tensor], out_shape: &[usize]) -> Tensor {
    let out_len: usize = out_shape.iter().product();
    let data = match &node.op {
        Op::Conv(c) => conv(c, inputs, out_shape),
        Op::BatchNorm { epsilon } => {
            let (x, [scale, bias, mean, var]) = (inputs[0], [1, 2, 3, 4].map(|i| inputs[i]));
            let channels = x.shape[1];
            let inner: usize = x.shape[2..].iter().product();
            x.data
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    let c = (i / inner) % channels;
                    (v - mean.data[c]) / (var.data[c] + epsilon).sqrt() * scale.data[c]
                        + bias.data[c]
                })
                .collect()
        }
        Op::Gemm { act } => {
            let (x, w) = (inputs[0], inputs[1]);
            let (k, n) = (w.shape[0], w.shape[1]);
            let rows = x.len() / k;
            let mut out = vec![0.0; rows * n];
            for r in 0..rows {
                for j in 0..n {
                    let mut acc = inputs.get(2).map_or(0.0, |b| b.data[j]);
                    for i in 0..k {
                        acc += x.data[r * k + i] * w.data[i * n + j];
                    }
                    // A residual fused by `passes::fuse_residual`, before the activation.
                    if let Some(z) = inputs.get(3) {
                        acc += z.data[r * n + j];
                    }
                    out[r * n + j] = act.apply(acc);
                }
            }
            out
        }
        Op::MatMul { alpha } => {
            let (a, b) = (inputs[0], inputs[1]);
            let r = a.shape.len();
            let (m, k, n) = (a.shape[r - 2], a.shape[r - 1], b.shape[r - 1]);
            let mut out = vec![0.0; out_len];
            for p in 0..out_len / (m * n).max(1) {
                for i in 0..m {
                    for j in 0..n {
                        let mut acc = 0.0;
                        for q in 0..k {
                            acc += a.data[(p * m + i) * k + q] * b.data[(p * k + q) * n + j];
                        }
                        out[(p * m + i) * n + j] = alpha * acc;
                    }
                }
            }
            out
        }
        Op::Attention { alpha } => {
            // The operators it fuses, one after the other.
            let step = |op: Op, inputs: &[&Tensor], shape: &[usize]| {
                let node = Node { op, ..node.clone() };
                eval(&node, inputs, shape)
            };
            let (q, kt) = (inputs[0], inputs[1]);
            let r = q.shape.len();
            let mut scores_shape = q.shape.clone();
            scores_shape[r - 1] = kt.shape[r - 1];
            let mut scores = step(Op::MatMul { alpha: *alpha }, &[q, kt], &scores_shape);
            if let Some(bias) = inputs.get(3) {
                let add = Op::Binary {
                    op: super::ir::BinOp::Add,
                    act: super::ir::Act::None,
                };
                scores = step(add, &[&scores, bias], &scores_shape);
            }
            let weights = step(Op::Softmax { axis: r - 1 }, &[&scores], &scores_shape);
            return step(Op::MatMul { alpha: 1.0 }, &[&weights, inputs[2]], out_shape);
        }
        Op::Pool(p) => {
            let x = inputs[0];
            let [n, c, h, w] = dims4(&x.shape);
            let [_, _, oh, ow] = dims4(out_shape);
            let mut out = Vec::with_capacity(out_len);
            for plane in 0..n * c {
                let src = &x.data[plane * h * w..(plane + 1) * h * w];
                for oy in 0..oh {
                    for ox in 0..ow {
                        let (mut acc, mut count, mut padded) = (0.0f32, 0, 0);
                        let mut max = f32::NEG_INFINITY;
                        for ky in 0..p.kernel[0] {
                            for kx in 0..p.kernel[1] {
                                let y = (oy * p.strides[0] + ky) as isize - p.pads[0] as isize;
                                let x = (ox * p.strides[1] + kx) as isize - p.pads[1] as isize;
                                // The padded area of count_include_pad excludes ceil_mode's
                                // extra rows, as in ONNX Runtime and PyTorch.
                                let in_pad_area =
                                    y < (h + p.pads[2]) as isize && x < (w + p.pads[3]) as isize;
                                if y < 0 || x < 0 || y >= h as isize || x >= w as isize {
                                    padded += usize::from(in_pad_area);
                                    continue;
                                }
                                let v = src[y as usize * w + x as usize];
                                acc += v;
                                max = max.max(v);
                                count += 1;
                            }
                        }
                        out.push(match p.kind {
                            PoolKind::Max => max,
                            PoolKind::Avg {
                                count_include_pad: true,
                            } => acc / (count + padded) as f32,
                            PoolKind::Avg { .. } => acc / count as f32,
                        });
                    }
                }
            }
            out
        }
        Op::GlobalAvgPool => {
            let x = inputs[0];
            let inner: usize = x.shape[2..].iter().product();
            x.data
                .chunks(inner)
                .map(|c| c.iter().sum::<f32>() / inner as f32)
                .collect()
        }
        Op::Unary(act) => inputs[0].data.iter().map(|&v| act.apply(v)).collect(),
        Op::Binary { op, act } => {
            let (a, b) = (inputs[0], inputs[1]);
            let ia = broadcast_index(&a.shape, out_shape);
            let ib = broadcast_index(&b.shape, out_shape);
            (0..out_len)
                .map(|i| act.apply(op.apply(a.data[ia(i)], b.data[ib(i)])))
                .collect()
        }
        Op::Softmax { axis } => {
            let x = inputs[0];
            let mut out = x.data.to_vec();
            along_axis(&x.shape, *axis, |idx| {
                let max = idx.iter().map(|&i| x.data[i]).fold(f32::MIN, f32::max);
                let sum: f32 = idx.iter().map(|&i| (x.data[i] - max).exp()).sum();
                for &i in idx {
                    out[i] = (x.data[i] - max).exp() / sum;
                }
            });
            out
        }
        Op::LayerNorm { axis, epsilon } => {
            let (x, scale, bias) = (inputs[0], inputs[1], inputs.get(2));
            let inner: usize = x.shape[*axis..].iter().product();
            let mut out = Vec::with_capacity(out_len);
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
        Op::Lrn {
            size,
            alpha,
            beta,
            bias,
        } => {
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
                    x.data[i] / (bias + alpha / *size as f32 * sq).powf(*beta)
                })
                .collect()
        }
        Op::Pad { pads, value } => {
            let pads: Vec<i64> = pads.iter().map(|&p| p as i64).collect();
            let padded = super::fold::pad(inputs[0], &pads, *value).expect("checked at import");
            std::sync::Arc::unwrap_or_clone(padded.data)
        }
        Op::Concat { axis } => {
            let outer: usize = out_shape[..*axis].iter().product();
            let mut out = Vec::with_capacity(out_len);
            for o in 0..outer {
                for t in inputs {
                    let block: usize = t.shape[*axis..].iter().product();
                    out.extend_from_slice(&t.data[o * block..(o + 1) * block]);
                }
            }
            out
        }
        Op::Transpose { perm } => {
            let x = inputs[0];
            let in_strides = strides(&x.shape);
            let out_strides = strides(out_shape);
            (0..out_len)
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
        Op::Reshape => inputs[0].data.to_vec(),
        Op::Slice {
            axis,
            start,
            end,
            step,
        } => {
            let x = inputs[0];
            let outer: usize = x.shape[..*axis].iter().product();
            let inner: usize = x.shape[axis + 1..].iter().product();
            let mut out = Vec::with_capacity(out_len);
            for o in 0..outer {
                let base = o * x.shape[*axis] * inner;
                for i in (*start..*end).step_by(*step) {
                    out.extend_from_slice(&x.data[base + i * inner..base + (i + 1) * inner]);
                }
            }
            out
        }
        Op::ReduceMean { axes } => {
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
    };
    debug_assert_eq!(data.len(), out_len, "{}", node.name);
    Tensor::new(out_shape.to_vec(), data)
}

fn conv(c: &super::ir::Conv2d, inputs: &[&Tensor], out_shape: &[usize]) -> Vec<f32> {
    let (x, w) = (inputs[0], inputs[1]);
    let (bias, residual) = (inputs[2], inputs.get(3));
    let [n, ci, h, wd] = dims4(&x.shape);
    let [_, co, oh, ow] = dims4(out_shape);
    let (cig, cog) = (ci / c.group, co / c.group);
    let [kh, kw] = c.kernel;
    let mut out = vec![0.0; n * co * oh * ow];
    for b in 0..n {
        for k in 0..co {
            let g = k / cog;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = bias.data[k];
                    for cc in 0..cig {
                        let ch = g * cig + cc;
                        for ky in 0..kh {
                            let y = (oy * c.strides[0] + ky * c.dilations[0]) as isize
                                - c.pads[0] as isize;
                            if y < 0 || y >= h as isize {
                                continue;
                            }
                            for kx in 0..kw {
                                let xx = (ox * c.strides[1] + kx * c.dilations[1]) as isize
                                    - c.pads[1] as isize;
                                if xx < 0 || xx >= wd as isize {
                                    continue;
                                }
                                acc += x.data[((b * ci + ch) * h + y as usize) * wd + xx as usize]
                                    * w.data[((k * cig + cc) * kh + ky) * kw + kx];
                            }
                        }
                    }
                    let o = ((b * co + k) * oh + oy) * ow + ox;
                    if let Some(r) = residual {
                        acc += r.data[o];
                    }
                    out[o] = c.act.apply(acc);
                }
            }
        }
    }
    out
}

fn dims4(shape: &[usize]) -> [usize; 4] {
    shape.try_into().expect("a 4-D tensor")
}

/// Maps a flat index of `out` to the flat index of an input broadcast to it.
pub(super) fn broadcast_index(shape: &[usize], out: &[usize]) -> impl Fn(usize) -> usize {
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
fn along_axis(shape: &[usize], axis: usize, mut f: impl FnMut(&[usize])) {
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
