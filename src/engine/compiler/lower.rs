// SPDX-License-Identifier: MPL-2.0
//! IR to plan. Each value gets a memory layout: a permutation saying in which order its
//! logical (ONNX) axes lie in memory. Convolutions and pooling want NHWC, matrix products and
//! row operations want the logical order; element-wise steps take any layout through
//! strides, a transpose only changes the permutation, and a copy is made only where a layout
//! must change. Buffers are placed in one arena by lifetime.

use std::collections::HashMap;

use super::ir::{Act, Graph, Node, Op, PoolKind, Tensor, strides};
use super::plan::{Cast, ConvStep, DType, Loc, MAX_RANK, Plan, Step, Strided, Weights};

/// Buffers start at multiples of this many elements (256 bytes in fp16), as cuDNN and
/// cuBLASLt prefer.
const ALIGN: usize = 128;

pub const NHWC: [usize; 4] = [0, 2, 3, 1];

#[derive(Debug, Clone)]
struct Val {
    loc: Loc,
    shape: Vec<usize>,
    /// `perm[j]` is the logical axis at memory position `j` (outermost first).
    perm: Vec<usize>,
}

impl Val {
    /// Element stride of each logical axis.
    fn strides(&self) -> Vec<usize> {
        let mut strides = vec![0; self.shape.len()];
        let mut acc = 1;
        for &axis in self.perm.iter().rev() {
            strides[axis] = acc;
            acc *= self.shape[axis];
        }
        strides
    }

    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the memory order under `perm` is this value's: axes of size 1 do not count.
    fn is_laid_out_as(&self, perm: &[usize]) -> bool {
        let order = |p: &[usize]| -> Vec<usize> {
            p.iter().copied().filter(|&a| self.shape[a] != 1).collect()
        };
        order(&self.perm) == order(perm)
    }
}

struct Storage {
    len: usize,
    first: usize,
    last: usize,
}

struct Lowering<'a> {
    graph: &'a Graph,
    weights: &'a mut Weights,
    steps: Vec<Step>,
    storages: Vec<Storage>,
    values: HashMap<String, Val>,
}

fn identity(rank: usize) -> Vec<usize> {
    (0..rank).collect()
}

/// Lowers `graph` for its batch size; the constants go to `weights`.
pub fn lower(graph: &Graph, dtype: DType, weights: &mut Weights) -> Result<Plan, String> {
    let input_shape = graph.shape(&graph.input).to_vec();
    let output_shape = graph.shape(&graph.output).to_vec();
    let batch = input_shape[0];
    let mut l = Lowering {
        graph,
        weights,
        steps: Vec::new(),
        storages: Vec::new(),
        values: HashMap::new(),
    };
    // The frames arrive as f32 in the model's logical layout; they are cast once, straight
    // into NHWC when the model is NCHW.
    let staged = Val {
        loc: Loc::Input(0),
        perm: identity(input_shape.len()),
        shape: input_shape.clone(),
    };
    let perm = if input_shape.len() == 4 {
        NHWC.to_vec()
    } else {
        identity(input_shape.len())
    };
    let input = l.copy(&staged, &perm, Cast::FromF32)?;
    l.values.insert(graph.input.clone(), input);

    for node in &graph.nodes {
        l.node(node)
            .map_err(|e| format!("node `{}` ({}): {e}", node.name, node.op.name()))?;
    }

    let out = l.get(&graph.output)?;
    let out = l.require(&out, &identity(output_shape.len()))?;
    l.ew(
        None,
        Act::None,
        Cast::ToF32,
        &out.shape,
        &identity(out.shape.len()),
        Loc::Output(0),
        &strides(&out.shape),
        &[&out],
    )?;

    let (arena_len, offsets) = place(&l.storages);
    let steps = l.steps.into_iter().map(|s| resolve(s, &offsets)).collect();
    Ok(Plan {
        batch,
        dtype,
        arena_len,
        input_len: input_shape.iter().product(),
        output_len: output_shape.iter().product(),
        steps,
    })
}

impl Lowering<'_> {
    fn get(&mut self, name: &str) -> Result<Val, String> {
        if let Some(v) = self.values.get(name) {
            let v = v.clone();
            self.touch(v.loc);
            return Ok(v);
        }
        let t = self
            .graph
            .consts
            .get(name)
            .ok_or_else(|| format!("value `{name}` is not computed"))?;
        Ok(self.constant(name, t))
    }

    fn constant(&mut self, name: &str, t: &Tensor) -> Val {
        let index = self.weights.add(name, &t.data);
        Val {
            loc: Loc::Weight { index, offset: 0 },
            perm: identity(t.shape.len()),
            shape: t.shape.clone(),
        }
    }

    /// Marks a buffer as read by the step about to be added.
    fn touch(&mut self, loc: Loc) {
        if let Loc::Temp { id, .. } = loc {
            self.storages[id].last = self.steps.len();
        }
    }

    fn alloc(&mut self, shape: &[usize], perm: Vec<usize>) -> Val {
        let len = shape.iter().product::<usize>().max(1);
        let step = self.steps.len();
        self.storages.push(Storage {
            len,
            first: step,
            last: step,
        });
        Val {
            loc: Loc::Temp {
                id: self.storages.len() - 1,
                offset: 0,
            },
            shape: shape.to_vec(),
            perm,
        }
    }

    /// `v` laid out as `perm`: itself when it already is, else a copy.
    fn require(&mut self, v: &Val, perm: &[usize]) -> Result<Val, String> {
        if v.is_laid_out_as(perm) {
            return Ok(Val {
                perm: perm.to_vec(),
                ..v.clone()
            });
        }
        self.copy(v, perm, Cast::None)
    }

    fn copy(&mut self, v: &Val, perm: &[usize], cast: Cast) -> Result<Val, String> {
        let out = self.alloc(&v.shape, perm.to_vec());
        let out_strides = out.strides();
        self.ew(
            None,
            Act::None,
            cast,
            &v.shape,
            perm,
            out.loc,
            &out_strides,
            &[v],
        )?;
        Ok(out)
    }

    /// Adds an element-wise step over `shape`, iterated in the memory order `order` of the
    /// output. Inputs broadcast to `shape` by NumPy's rules.
    #[allow(clippy::too_many_arguments)]
    fn ew(
        &mut self,
        op: Option<super::ir::BinOp>,
        act: Act,
        cast: Cast,
        shape: &[usize],
        order: &[usize],
        out: Loc,
        out_strides: &[usize],
        inputs: &[&Val],
    ) -> Result<(), String> {
        let rank = shape.len();
        let operand_strides = |v: &Val| -> Vec<i64> {
            let s = v.strides();
            let pad = rank - v.shape.len();
            (0..rank)
                .map(|a| {
                    if a < pad || v.shape[a - pad] == 1 {
                        0
                    } else {
                        s[a - pad] as i64
                    }
                })
                .collect()
        };
        let mut all: Vec<Vec<i64>> = vec![out_strides.iter().map(|&s| s as i64).collect()];
        all.extend(inputs.iter().map(|v| operand_strides(v)));
        let dims: Vec<usize> = order.iter().map(|&a| shape[a]).collect();
        let all: Vec<Vec<i64>> = all
            .iter()
            .map(|s| order.iter().map(|&a| s[a]).collect())
            .collect();
        let (dims, all) = merge_dims(dims, all);
        if dims.len() > MAX_RANK {
            return Err(format!(
                "an element-wise operation over {} dimensions ({shape:?}); at most {MAX_RANK} are supported",
                dims.len()
            ));
        }
        for v in inputs {
            self.touch(v.loc);
        }
        self.touch(out);
        let strided = |loc, strides: &Vec<i64>| Strided {
            loc,
            strides: strides.clone(),
        };
        self.steps.push(Step::Ew {
            op,
            act,
            cast,
            out: strided(out, &all[0]),
            a: strided(inputs[0].loc, &all[1]),
            b: inputs.get(1).map(|v| strided(v.loc, &all[2])),
            dims,
        });
        Ok(())
    }

    /// The activation a matrix product's epilogue cannot apply (anything but ReLU), as an
    /// element-wise pass over its output `y`, in place.
    fn gemm_activation(&mut self, act: Act, y: &Val) -> Result<(), String> {
        if matches!(act, Act::None | Act::Relu) {
            return Ok(());
        }
        let strides = y.strides();
        self.ew(
            None,
            act,
            Cast::None,
            &y.shape,
            &y.perm,
            y.loc,
            &strides,
            &[y],
        )
    }

    fn push(&mut self, step: Step, reads: &[Loc]) {
        for &loc in reads {
            self.touch(loc);
        }
        self.steps.push(step);
    }

    fn node(&mut self, node: &Node) -> Result<(), String> {
        let shape = self.graph.shape(&node.output).to_vec();
        let rank = shape.len();
        let out = match &node.op {
            Op::Conv(c) => {
                let x = self.get(&node.inputs[0])?;
                let mut x = self.require(&x, &NHWC)?;
                let [n, ci, mut h, mut w] = dims4(&x.shape);
                let [top, left, bottom, right] = c.pads;
                let mut pads = [top, left];
                if top != bottom || left != right {
                    // cuDNN pads symmetrically: pad explicitly into a zeroed buffer.
                    let padded_shape = vec![n, ci, h + top + bottom, w + left + right];
                    let padded = self.alloc(&padded_shape, NHWC.to_vec());
                    self.push(
                        Step::Zero {
                            loc: padded.loc,
                            len: padded.len(),
                        },
                        &[padded.loc],
                    );
                    let ps = padded.strides();
                    let interior = padded.loc.offset(top * ps[2] + left * ps[3]);
                    self.ew(
                        None,
                        Act::None,
                        Cast::None,
                        &x.shape,
                        &NHWC,
                        interior,
                        &ps,
                        &[&x],
                    )?;
                    (h, w, pads) = (padded_shape[2], padded_shape[3], [0, 0]);
                    x = Val {
                        loc: padded.loc,
                        shape: padded_shape,
                        perm: NHWC.to_vec(),
                    };
                }
                let krsc = to_krsc(&self.graph.consts[&node.inputs[1]]);
                let bias = self.get(&node.inputs[2])?;
                let residual = match node.inputs.get(3) {
                    Some(z) => {
                        let z = self.get(z)?;
                        Some(self.require(&z, &NHWC)?)
                    }
                    None => None,
                };
                let y = self.alloc(&shape, NHWC.to_vec());
                let reads: Vec<Loc> = [x.loc, y.loc]
                    .into_iter()
                    .chain(residual.as_ref().map(|z| z.loc))
                    .collect();
                // A 1×1 convolution over NHWC is a matrix product [pixels, c] · [c, k]: run by
                // cuBLASLt, whose tensor-core kernels are much faster at small batches than
                // cuDNN's convolutions of that shape.
                let pointwise = c.kernel == [1, 1] && c.strides == [1, 1] && pads == [0, 0];
                if pointwise && c.group == 1 {
                    let [k, _, _, _] = dims4(&krsc.shape);
                    let ck = transpose2(&krsc.data, k, ci);
                    let weight = self.constant(&format!("{}.ck", node.inputs[1]), &ck);
                    self.push(
                        Step::Gemm {
                            batch: 1,
                            alpha: 1.0,
                            rows: n * h * w,
                            n: k,
                            k: ci,
                            x: x.loc,
                            w: weight.loc,
                            bias: Some(bias.loc),
                            residual: residual.map(|z| z.loc),
                            relu: c.act == Act::Relu,
                            y: y.loc,
                        },
                        &reads,
                    );
                    self.gemm_activation(c.act, &y)?;
                    y
                } else {
                    let weight = self.constant(&format!("{}.krsc", node.inputs[1]), &krsc);
                    let [_, k, oh, ow] = dims4(&shape);
                    self.push(
                        Step::Conv(ConvStep {
                            n,
                            c: ci,
                            h,
                            w,
                            k,
                            oh,
                            ow,
                            kernel: c.kernel,
                            pads,
                            strides: c.strides,
                            dilations: c.dilations,
                            group: c.group,
                            act: c.act,
                            x: x.loc,
                            weight: weight.loc,
                            bias: bias.loc,
                            residual: residual.map(|z| z.loc),
                            y: y.loc,
                            algo: None,
                        }),
                        &reads,
                    );
                    y
                }
            }
            Op::Gemm { act } => {
                let x = self.get(&node.inputs[0])?;
                let x = self.require(&x, &identity(x.shape.len()))?;
                let w = self.get(&node.inputs[1])?;
                let bias = match node.inputs.get(2) {
                    Some(b) => Some(self.get(b)?.loc),
                    None => None,
                };
                let y = self.alloc(&shape, identity(rank));
                let (k, n) = (w.shape[0], w.shape[1]);
                let relu = *act == Act::Relu;
                self.push(
                    Step::Gemm {
                        batch: 1,
                        alpha: 1.0,
                        rows: x.len() / k,
                        n,
                        k,
                        x: x.loc,
                        w: w.loc,
                        bias,
                        residual: None,
                        relu,
                        y: y.loc,
                    },
                    &[x.loc, y.loc],
                );
                self.gemm_activation(*act, &y)?;
                y
            }
            Op::MatMul { alpha } => {
                let a = self.get(&node.inputs[0])?;
                let a = self.require(&a, &identity(rank))?;
                let b = self.get(&node.inputs[1])?;
                let b = self.require(&b, &identity(rank))?;
                let (m, k, n) = (a.shape[rank - 2], a.shape[rank - 1], b.shape[rank - 1]);
                let y = self.alloc(&shape, identity(rank));
                self.push(
                    Step::Gemm {
                        batch: shape[..rank - 2].iter().product(),
                        alpha: *alpha,
                        rows: m,
                        n,
                        k,
                        x: a.loc,
                        w: b.loc,
                        bias: None,
                        residual: None,
                        relu: false,
                        y: y.loc,
                    },
                    &[a.loc, b.loc, y.loc],
                );
                y
            }
            Op::Pool(p) => {
                let x = self.get(&node.inputs[0])?;
                let x = self.require(&x, &NHWC)?;
                let [n, c, h, w] = dims4(&x.shape);
                let [_, _, oh, ow] = dims4(&shape);
                let y = self.alloc(&shape, NHWC.to_vec());
                let (max, count_include_pad) = match p.kind {
                    PoolKind::Max => (true, false),
                    PoolKind::Avg { count_include_pad } => (false, count_include_pad),
                };
                self.push(
                    Step::Pool {
                        n,
                        h,
                        w,
                        c,
                        oh,
                        ow,
                        kernel: p.kernel,
                        strides: p.strides,
                        pads: p.pads,
                        max,
                        count_include_pad,
                        x: x.loc,
                        y: y.loc,
                    },
                    &[x.loc, y.loc],
                );
                y
            }
            Op::GlobalAvgPool => {
                let x = self.get(&node.inputs[0])?;
                let x = self.require(&x, &NHWC)?;
                let [n, c, h, w] = dims4(&x.shape);
                let y = self.alloc(&shape, NHWC.to_vec());
                self.push(
                    Step::GlobalAvgPool {
                        n,
                        hw: h * w,
                        c,
                        x: x.loc,
                        y: y.loc,
                    },
                    &[x.loc, y.loc],
                );
                y
            }
            Op::Lrn {
                size,
                alpha,
                beta,
                bias,
            } => {
                let x = self.get(&node.inputs[0])?;
                let x = self.require(&x, &NHWC)?;
                let y = self.alloc(&shape, NHWC.to_vec());
                self.push(
                    Step::Lrn {
                        pixels: x.len() / shape[1],
                        c: shape[1],
                        size: *size,
                        alpha: *alpha,
                        beta: *beta,
                        bias: *bias,
                        x: x.loc,
                        y: y.loc,
                    },
                    &[x.loc, y.loc],
                );
                y
            }
            Op::Unary(act) => {
                let x = self.get(&node.inputs[0])?;
                let y = self.alloc(&shape, x.perm.clone());
                let s = y.strides();
                self.ew(None, *act, Cast::None, &shape, &x.perm, y.loc, &s, &[&x])?;
                y
            }
            Op::Binary { op, act } => {
                let a = self.get(&node.inputs[0])?;
                let b = self.get(&node.inputs[1])?;
                // The output takes the layout of a full-size input, so that reading it is
                // sequential (NHWC for activations from convolutions).
                let perm = [&a, &b]
                    .into_iter()
                    .find(|v| v.shape == shape)
                    .map_or_else(|| identity(rank), |v| v.perm.clone());
                let y = self.alloc(&shape, perm.clone());
                let s = y.strides();
                self.ew(
                    Some(*op),
                    *act,
                    Cast::None,
                    &shape,
                    &perm,
                    y.loc,
                    &s,
                    &[&a, &b],
                )?;
                y
            }
            Op::Softmax { axis } | Op::LayerNorm { axis, .. } => {
                let x = self.get(&node.inputs[0])?;
                // Rows along the last memory axes: move the reduced axes last.
                let perm: Vec<usize> = match node.op {
                    Op::Softmax { .. } => (0..rank).filter(|a| a != axis).chain([*axis]).collect(),
                    _ => identity(rank),
                };
                let x = self.require(&x, &perm)?;
                let len: usize = match node.op {
                    Op::Softmax { .. } => shape[*axis],
                    _ => shape[*axis..].iter().product(),
                };
                let rows = x.len() / len;
                let y = self.alloc(&shape, perm);
                let step = match &node.op {
                    Op::Softmax { .. } => Step::Softmax {
                        rows,
                        len,
                        x: x.loc,
                        y: y.loc,
                    },
                    Op::LayerNorm { epsilon, .. } => {
                        let scale = self.get(&node.inputs[1])?.loc;
                        let bias = match node.inputs.get(2) {
                            Some(b) => Some(self.get(b)?.loc),
                            None => None,
                        };
                        Step::LayerNorm {
                            rows,
                            len,
                            epsilon: *epsilon,
                            x: x.loc,
                            scale,
                            bias,
                            y: y.loc,
                        }
                    }
                    _ => unreachable!("matched above"),
                };
                self.push(step, &[x.loc, y.loc]);
                y
            }
            Op::ReduceMean { axes } => {
                let x = self.get(&node.inputs[0])?;
                let in_rank = x.shape.len();
                let perm: Vec<usize> = (0..in_rank)
                    .filter(|a| !axes.contains(a))
                    .chain(axes.iter().copied())
                    .collect();
                let x = self.require(&x, &perm)?;
                let len: usize = axes.iter().map(|&a| x.shape[a]).product();
                let y = self.alloc(&shape, identity(rank));
                self.push(
                    Step::RowMean {
                        rows: x.len() / len,
                        len,
                        x: x.loc,
                        y: y.loc,
                    },
                    &[x.loc, y.loc],
                );
                y
            }
            Op::Concat { axis } => {
                let inputs = node
                    .inputs
                    .iter()
                    .map(|i| self.get(i))
                    .collect::<Result<Vec<_>, _>>()?;
                let perm = if rank == 4 {
                    NHWC.to_vec()
                } else {
                    identity(rank)
                };
                let y = self.alloc(&shape, perm.clone());
                let ys = y.strides();
                let mut start = 0;
                for v in &inputs {
                    let dst = y.loc.offset(start * ys[*axis]);
                    self.ew(None, Act::None, Cast::None, &v.shape, &perm, dst, &ys, &[v])?;
                    start += v.shape[*axis];
                }
                y
            }
            Op::Pad { pads, value } => {
                // The padding value everywhere, then the input inside it.
                let x = self.get(&node.inputs[0])?;
                let fill = self.constant(&format!("{}.value", node.name), &Tensor::scalar(*value));
                let fill = Val {
                    shape: vec![1; rank],
                    perm: identity(rank),
                    ..fill
                };
                let y = self.alloc(&shape, x.perm.clone());
                let ys = y.strides();
                self.ew(
                    None,
                    Act::None,
                    Cast::None,
                    &shape,
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
                y
            }
            Op::Slice {
                axis, start, step, ..
            } => {
                let x = self.get(&node.inputs[0])?;
                let xs = x.strides();
                let src = Val {
                    loc: x.loc.offset(start * xs[*axis]),
                    shape: shape.clone(),
                    perm: x.perm.clone(),
                };
                // A slice with nothing but axes of size 1 outside it in memory is one
                // contiguous range of its input (attention's query, key and value picked
                // from one projection): it is read in place where it starts as aligned as a
                // buffer would (cuBLASLt and cuDNN choose their kernels for 256 bytes).
                let outer = x.perm.iter().take_while(|&&a| a != *axis);
                let aligned = match x.loc {
                    Loc::Temp { offset, .. } => (offset + start * xs[*axis]) % ALIGN == 0,
                    _ => false,
                };
                if *step == 1 && aligned && outer.copied().all(|a| shape[a] == 1) {
                    return self.define(node, src);
                }
                // The source view keeps the input's strides, not the compact ones of its
                // shape: copy through explicit strides.
                let y = self.alloc(&shape, x.perm.clone());
                let ys = y.strides();
                let order: Vec<usize> = x.perm.clone();
                let in_strides: Vec<i64> = order
                    .iter()
                    .map(|&a| match (shape[a], a == *axis) {
                        (1, _) => 0,
                        (_, true) => (xs[a] * step) as i64,
                        _ => xs[a] as i64,
                    })
                    .collect();
                let out_strides: Vec<i64> = order.iter().map(|&a| ys[a] as i64).collect();
                let dims: Vec<usize> = order.iter().map(|&a| shape[a]).collect();
                let (dims, all) = merge_dims(dims, vec![out_strides, in_strides]);
                self.push(
                    Step::Ew {
                        op: None,
                        act: Act::None,
                        cast: Cast::None,
                        dims,
                        out: Strided {
                            loc: y.loc,
                            strides: all[0].clone(),
                        },
                        a: Strided {
                            loc: src.loc,
                            strides: all[1].clone(),
                        },
                        b: None,
                    },
                    &[x.loc, y.loc],
                );
                y
            }
            Op::Transpose { perm } => {
                // Only the layout changes: logical axis i of the output is axis perm[i] of
                // the input, at the same place in memory.
                let x = self.get(&node.inputs[0])?;
                let inverse: Vec<usize> = {
                    let mut inv = vec![0; perm.len()];
                    for (i, &p) in perm.iter().enumerate() {
                        inv[p] = i;
                    }
                    inv
                };
                Val {
                    loc: x.loc,
                    shape: shape.clone(),
                    perm: x.perm.iter().map(|&a| inverse[a]).collect(),
                }
            }
            Op::Reshape => {
                let x = self.get(&node.inputs[0])?;
                let x = self.require(&x, &identity(x.shape.len()))?;
                Val {
                    loc: x.loc,
                    shape: shape.clone(),
                    perm: identity(rank),
                }
            }
            Op::BatchNorm { .. } => {
                return Err("a batch norm left after the passes".into());
            }
        };
        self.define(node, out)
    }

    fn define(&mut self, node: &Node, value: Val) -> Result<(), String> {
        self.values.insert(node.output.clone(), value);
        Ok(())
    }
}

fn dims4(shape: &[usize]) -> [usize; 4] {
    shape.try_into().expect("a 4-D tensor")
}

/// ONNX's KCRS weights to cuDNN's NHWC filter layout, KRSC.
/// A row-major `rows × cols` matrix transposed.
fn transpose2(data: &[f32], rows: usize, cols: usize) -> Tensor {
    let mut t = vec![0.0; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = data[r * cols + c];
        }
    }
    Tensor::new(vec![cols, rows], t)
}

fn to_krsc(w: &Tensor) -> Tensor {
    let [k, c, r, s] = dims4(&w.shape);
    let mut data = vec![0.0; w.len()];
    for kk in 0..k {
        for cc in 0..c {
            for rr in 0..r {
                for ss in 0..s {
                    data[((kk * r + rr) * s + ss) * c + cc] =
                        w.data[((kk * c + cc) * r + rr) * s + ss];
                }
            }
        }
    }
    Tensor::new(vec![k, r, s, c], data)
}

/// Drops dimensions of 1 and merges neighbours that are contiguous for every operand, so
/// that a plain element-wise step iterates over one dimension.
pub fn merge_dims(dims: Vec<usize>, strides: Vec<Vec<i64>>) -> (Vec<usize>, Vec<Vec<i64>>) {
    let keep: Vec<usize> = (0..dims.len()).filter(|&j| dims[j] != 1).collect();
    let mut out_dims: Vec<usize> = Vec::new();
    let mut out_strides: Vec<Vec<i64>> = vec![Vec::new(); strides.len()];
    for &j in &keep {
        let mergeable = !out_dims.is_empty()
            && strides
                .iter()
                .zip(&out_strides)
                .all(|(s, o)| *o.last().expect("same length") == s[j] * dims[j] as i64);
        if mergeable {
            *out_dims.last_mut().expect("not empty") *= dims[j];
            for (s, o) in strides.iter().zip(&mut out_strides) {
                *o.last_mut().expect("not empty") = s[j];
            }
        } else {
            out_dims.push(dims[j]);
            for (s, o) in strides.iter().zip(&mut out_strides) {
                o.push(s[j]);
            }
        }
    }
    if out_dims.is_empty() {
        return (vec![1], vec![vec![0]; strides.len()]);
    }
    (out_dims, out_strides)
}

/// Places every buffer in the arena: largest first, at the lowest offset free during its
/// lifetime. Returns the arena length and each buffer's offset.
fn place(storages: &[Storage]) -> (usize, Vec<usize>) {
    let mut order: Vec<usize> = (0..storages.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(storages[i].len));
    let mut offsets = vec![usize::MAX; storages.len()];
    let mut placed: Vec<usize> = Vec::new();
    let mut arena = 0;
    for i in order {
        let s = &storages[i];
        let size = s.len.div_ceil(ALIGN) * ALIGN;
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&p| storages[p].first <= s.last && s.first <= storages[p].last)
            .map(|&p| {
                (
                    offsets[p],
                    offsets[p] + storages[p].len.div_ceil(ALIGN) * ALIGN,
                )
            })
            .collect();
        busy.sort_unstable();
        let mut offset = 0;
        for (start, end) in busy {
            if offset + size <= start {
                break;
            }
            offset = offset.max(end);
        }
        offsets[i] = offset;
        arena = arena.max(offset + size);
        placed.push(i);
    }
    (arena, offsets)
}

fn resolve(mut step: Step, offsets: &[usize]) -> Step {
    for loc in step.locs_mut() {
        if let Loc::Temp { id, offset } = *loc {
            *loc = Loc::Arena(offsets[id] + offset);
        }
    }
    step
}
