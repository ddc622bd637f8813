// SPDX-License-Identifier: MPL-2.0
//! IR to plan. Each value gets a memory layout: a permutation saying in which order its
//! logical (ONNX) axes lie in memory. Convolutions and pooling want NHWC, matrix products and
//! row operations want the logical order; element-wise steps take any layout through
//! strides, a transpose only changes the permutation, and a copy is made only where a layout
//! must change. Buffers are placed in one arena by lifetime (`arena`).
//!
//! This file keeps the values, their layouts and the element-wise step everything else is
//! built from; each operator is lowered by its family's module in `ops/` (`impl Lowering`
//! there), called from `Lowering::node`; `scores` lets an fp16 plan's last product write the
//! scores in f32.
//!
//! Mixed precision: the nodes an fp16 plan keeps in f32 (`kept`, those whose values fp16
//! cannot hold) write buffers of an f32 arena of their own (`Loc::Wide`) and read f32
//! weights; a value goes from one type to the other by a cast where a node of the other
//! type reads it. Views (reshapes, transposes, slices) keep their input's type.

pub(crate) mod arena;
mod depthwise;
mod gate;
mod scores;

use std::collections::{HashMap, HashSet};

use super::CompileError;
use super::ir::{Act, Graph, Node, Op, Tensor, strides};
use super::plan::{Cast, DType, EwStep, Loc, MAX_RANK, Plan, Step, Strided, Weights};
use arena::{Storage, early_concats, over_residuals, place, resolve};

/// The memory order of NCHW axes in NHWC.
pub(crate) const NHWC: [usize; 4] = [0, 2, 3, 1];

#[derive(Debug, Clone)]
pub(crate) struct Val {
    pub(crate) loc: Loc,
    pub(crate) shape: Vec<usize>,
    /// `perm[j]` is the logical axis at memory position `j` (outermost first).
    pub(crate) perm: Vec<usize>,
}

impl Val {
    /// Element stride of each logical axis.
    pub(crate) fn strides(&self) -> Vec<usize> {
        let mut strides = vec![0; self.shape.len()];
        let mut acc = 1;
        for &axis in self.perm.iter().rev() {
            strides[axis] = acc;
            acc *= self.shape[axis];
        }
        strides
    }

    pub(crate) fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the memory order under `perm` is this value's: axes of size 1 do not count.
    pub(crate) fn is_laid_out_as(&self, perm: &[usize]) -> bool {
        let order = |p: &[usize]| -> Vec<usize> {
            p.iter().copied().filter(|&a| self.shape[a] != 1).collect()
        };
        order(&self.perm) == order(perm)
    }
}

pub(crate) struct Lowering<'a> {
    pub(crate) graph: &'a Graph,
    pub(crate) dtype: DType,
    /// The nodes computed in f32 in an fp16 plan.
    pub(crate) kept: &'a HashSet<String>,
    /// Whether the node being lowered is one of them: its buffers, constants and
    /// element-wise steps are f32.
    pub(crate) wide: bool,
    pub(crate) weights: &'a mut Weights,
    pub(crate) steps: Vec<Step>,
    pub(crate) storages: Vec<Storage>,
    pub(crate) values: HashMap<String, Val>,
}

pub(crate) fn identity(rank: usize) -> Vec<usize> {
    (0..rank).collect()
}

/// How the frames lie in the plan's input buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Frames {
    /// In the model's own layout.
    AsModel,
    /// A channels-first (NCHW) model's frames given channels-last (NHWC): the layout its
    /// convolutions read, so that an f32 plan reads them where they lie.
    ChannelsLast,
}

/// Lowers `graph` for its batch size, the nodes named in `kept` in f32 (an fp16 plan's:
/// `compile_mixed` keeps none in fp32 plans); the constants go to `weights`. With
/// `in_place`, a product's output is written over the residual it reads for the last time
/// (`arena::over_residuals`), and a concatenation is placed where its inputs' products can
/// write into it (`arena::early_concats`): the CPU runner's plans.
#[cfg(test)]
pub(super) fn lower(
    graph: &Graph,
    dtype: DType,
    kept: &HashSet<String>,
    weights: &mut Weights,
    in_place: bool,
) -> Result<Plan, CompileError> {
    lower_frames(graph, dtype, kept, weights, in_place, Frames::AsModel)
}

/// `lower`, for frames that lie in the input buffer as `frames` says.
pub(super) fn lower_frames(
    graph: &Graph,
    dtype: DType,
    kept: &HashSet<String>,
    weights: &mut Weights,
    in_place: bool,
    frames: Frames,
) -> Result<Plan, CompileError> {
    let input_shape = graph.shape(&graph.input).to_vec();
    let output_shape = graph.shape(&graph.output).to_vec();
    let batch = input_shape[0];
    let mut l = Lowering {
        graph,
        dtype,
        kept,
        wide: false,
        weights,
        steps: Vec::new(),
        storages: Vec::new(),
        values: HashMap::new(),
    };
    // The frames arrive as f32; they are cast once, straight into NHWC when the model is
    // NCHW. An f32 plan reads frames that arrive in NHWC where they lie: the first step's
    // copy cost small models 3 % of their time.
    let rank = input_shape.len();
    let perm = if rank == 4 {
        NHWC.to_vec()
    } else {
        identity(rank)
    };
    let staged = Val {
        loc: Loc::Input(0),
        perm: match frames {
            Frames::ChannelsLast if rank == 4 => perm.clone(),
            _ => identity(rank),
        },
        shape: input_shape.clone(),
    };
    let input = match dtype == DType::F32 && staged.perm == perm {
        true => staged,
        false => (l.copy(&staged, &perm, Cast::FromF32)).map_err(CompileError::Model)?,
    };
    l.values.insert(graph.input.clone(), input);
    let mut origins = vec![graph.input.clone(); l.steps.len()];

    for node in &graph.nodes {
        l.in_its_type(node)
            .and_then(|node| l.node(&node))
            .map_err(|problem| CompileError::Node {
                node: node.name.clone(),
                op: node.op.name().to_owned(),
                problem,
            })?;
        origins.resize(l.steps.len(), node.name.clone());
    }

    l.output(&graph.output, output_shape.len())
        .map_err(CompileError::Model)?;
    origins.resize(l.steps.len(), graph.output.clone());

    match in_place {
        true => early_concats(&l.steps, &mut l.storages),
        false => {
            depthwise::activations_into_depthwise(&mut l.steps, &mut origins, &mut l.storages);
            gate::gates(&mut l.steps, &mut origins, &mut l.storages);
        }
    }
    let shared = match in_place {
        true => over_residuals(&l.steps, &l.storages),
        false => vec![None; l.storages.len()],
    };
    let (arena_len, wide_len, offsets) = place(&l.storages, &shared);
    let mut steps = l
        .steps
        .into_iter()
        .map(|s| resolve(s, &l.storages, &offsets))
        .collect();
    scores::in_f32(dtype, &mut steps, &mut origins);
    Ok(Plan {
        batch,
        dtype,
        arena_len,
        wide_len,
        input_len: input_shape.iter().product(),
        output_len: output_shape.iter().product(),
        steps,
        origins,
    })
}

impl Lowering<'_> {
    /// The scores, cast to f32 in their logical layout into the output buffer.
    pub(crate) fn output(&mut self, name: &str, rank: usize) -> Result<(), String> {
        let out = self.get(name)?;
        self.wide = self.is_wide(out.loc);
        let out = self.require(&out, &identity(rank))?;
        self.ew(
            None,
            Act::None,
            if self.wide { Cast::Wide } else { Cast::ToF32 },
            &out.shape,
            &identity(out.shape.len()),
            Loc::Output(0),
            &strides(&out.shape),
            &[&out],
        )
    }

    pub(crate) fn get(&mut self, name: &str) -> Result<Val, String> {
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

    pub(crate) fn constant(&mut self, name: &str, t: &Tensor) -> Val {
        let index = self.weights.add(name, &t.data, self.wide);
        Val {
            loc: Loc::Weight { index, offset: 0 },
            perm: identity(t.shape.len()),
            shape: t.shape.clone(),
        }
    }

    /// Marks a buffer as read by the step about to be added.
    pub(crate) fn touch(&mut self, loc: Loc) {
        if let Loc::Temp { id, .. } = loc {
            self.storages[id].last = self.steps.len();
        }
    }

    pub(crate) fn alloc(&mut self, shape: &[usize], perm: Vec<usize>) -> Val {
        let len = shape.iter().product::<usize>().max(1);
        let step = self.steps.len();
        self.storages.push(Storage {
            len,
            first: step,
            last: step,
            wide: self.wide,
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
    pub(crate) fn require(&mut self, v: &Val, perm: &[usize]) -> Result<Val, String> {
        if v.is_laid_out_as(perm) {
            return Ok(Val {
                perm: perm.to_vec(),
                ..v.clone()
            });
        }
        self.copy(v, perm, Cast::None)
    }

    /// `v` with `axis` innermost in memory and its other axes in their order: itself where
    /// it already is, else a copy.
    pub(crate) fn innermost(&mut self, v: &Val, axis: usize) -> Result<Val, String> {
        let perm: Vec<usize> = v
            .perm
            .iter()
            .copied()
            .filter(|&a| a != axis)
            .chain([axis])
            .collect();
        self.require(v, &perm)
    }

    pub(crate) fn copy(&mut self, v: &Val, perm: &[usize], cast: Cast) -> Result<Val, String> {
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

    /// Copies `dims` elements from `src` to `out`, each given as a buffer and the element
    /// stride of each of `dims` in it (a slice's elements, or patches unfolded from an image).
    pub(crate) fn strided_copy(
        &mut self,
        dims: &[usize],
        out: (Loc, &[usize]),
        src: (Loc, &[usize]),
    ) {
        let strides = |s: &[usize]| s.iter().map(|&v| v as i64).collect::<Vec<_>>();
        let (dims, all) = merge_dims(dims.to_vec(), vec![strides(out.1), strides(src.1)]);
        self.push(
            Step::Ew(EwStep {
                op: None,
                act: Act::None,
                cast: self.same_type(),
                dims,
                out: Strided {
                    loc: out.0,
                    strides: all[0].clone(),
                },
                a: Strided {
                    loc: src.0,
                    strides: all[1].clone(),
                },
                b: None,
            }),
            &[src.0, out.0],
        );
    }

    /// Adds an element-wise step over `shape`, iterated in the memory order `order` of the
    /// output. Inputs broadcast to `shape` by NumPy's rules.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ew(
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
        let cast = match cast {
            Cast::None => self.same_type(),
            cast => cast,
        };
        self.steps.push(Step::Ew(EwStep {
            op,
            act,
            cast,
            out: strided(out, &all[0]),
            a: strided(inputs[0].loc, &all[1]),
            b: inputs.get(1).map(|v| strided(v.loc, &all[2])),
            dims,
        }));
        Ok(())
    }

    pub(crate) fn push(&mut self, step: Step, reads: &[Loc]) {
        for &loc in reads {
            self.touch(loc);
        }
        self.steps.push(step);
    }

    /// The cast of an element-wise step that reads and writes the node's own type.
    pub(crate) fn same_type(&self) -> Cast {
        match self.wide {
            true => Cast::Wide,
            false => Cast::None,
        }
    }

    /// Whether `loc` holds f32 values of a node kept in f32 (an f32 weight among them).
    pub(crate) fn is_wide(&self, loc: Loc) -> bool {
        match loc {
            Loc::Temp { id, .. } => self.storages[id].wide,
            Loc::Weight { index, .. } => self.weights.wide[index],
            Loc::Wide(_) => true,
            _ => false,
        }
    }

    /// Sets the type `node` computes in, and returns it reading its computed inputs in that
    /// type: an input of the other type is cast once (the cast kept for other readers). A
    /// view computes nothing and keeps its input's type.
    pub(crate) fn in_its_type(&mut self, node: &Node) -> Result<Node, String> {
        self.wide = match self.values.get(&node.inputs[0]) {
            Some(x) if node.op.is_view() => self.is_wide(x.loc),
            _ => self.kept.contains(&node.name),
        };
        let mut node = node.clone();
        for input in &mut node.inputs {
            let Some(v) = self.values.get(input.as_str()) else {
                continue;
            };
            if self.is_wide(v.loc) == self.wide {
                continue;
            }
            let name = format!("{input}.{}", if self.wide { "f32" } else { "f16" });
            if !self.values.contains_key(&name) {
                let v = self.get(input)?;
                let cast = if self.wide {
                    Cast::ToF32
                } else {
                    Cast::FromF32
                };
                let converted = self.copy(&v, &v.perm, cast)?;
                self.values.insert(name.clone(), converted);
            }
            *input = name;
        }
        Ok(node)
    }

    /// Lowers one node: a short dispatch to the files that lower each kind of operator.
    pub(crate) fn node(&mut self, node: &Node) -> Result<(), String> {
        if self.values.contains_key(&node.output) {
            // A product computed with an earlier one of the same input
            // (`Lowering::products_of_one_x`).
            return Ok(());
        }
        let shape = self.graph.shape(&node.output).to_vec();
        let out = match &node.op {
            Op::Conv(c) => self.conv(node, c, &shape)?,
            Op::Gemm { act } => self.gemm(node, *act, &shape)?,
            Op::MatMul { alpha } => self.matmul(node, *alpha, &shape)?,
            Op::Attention { alpha } => self.attention(node, *alpha, &shape)?,
            Op::Pool(p) => self.pool(node, p, &shape)?,
            Op::GlobalAvgPool => self.global_avg_pool(node, &shape)?,
            Op::Lrn {
                size,
                alpha,
                beta,
                bias,
            } => self.lrn(node, *size, [*alpha, *beta, *bias], &shape)?,
            Op::Unary(act) => self.unary(node, *act, &shape)?,
            Op::Binary { op, act } => self.binary(node, *op, *act, &shape)?,
            Op::Softmax { axis } => self.softmax(node, *axis, &shape)?,
            Op::LayerNorm { axis, epsilon } => self.layer_norm(node, *axis, *epsilon, &shape)?,
            Op::ReduceMean { axes } => self.reduce_mean(node, axes, &shape)?,
            Op::Concat { axis } => self.concat(node, *axis, &shape)?,
            Op::Pad { pads, value } => self.pad(node, pads, *value, &shape)?,
            Op::Slice {
                axis, start, step, ..
            } => self.slice(node, *axis, *start, *step, &shape)?,
            Op::Transpose { perm } => self.transpose(node, perm, &shape)?,
            Op::Reshape => self.reshape(node, &shape)?,
            Op::BatchNorm { .. } => {
                return Err("a batch norm left after the passes".into());
            }
        };
        self.define(node, out)
    }

    pub(crate) fn define(&mut self, node: &Node, value: Val) -> Result<(), String> {
        self.values.insert(node.output.clone(), value);
        Ok(())
    }
}

/// Drops dimensions of 1 and merges neighbours that are contiguous for every operand, so
/// that a plain element-wise step iterates over one dimension.
pub(crate) fn merge_dims(dims: Vec<usize>, strides: Vec<Vec<i64>>) -> (Vec<usize>, Vec<Vec<i64>>) {
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
