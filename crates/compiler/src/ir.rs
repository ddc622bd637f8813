// SPDX-License-Identifier: MPL-2.0
//! The engine's own graph: a handful of operators with ONNX semantics (logical NCHW shapes),
//! every shape known, every constant folded. It knows nothing of GPUs, so that the import
//! and the rewriting passes can be checked on any machine against `reference`.

use std::collections::HashMap;
use std::sync::Arc;

pub use crate::ops::elementwise::{Act, BinOp};

/// A constant: weights, or a value folded at import. Integers are held as f32, which is
/// exact for the shapes and indices of image classifiers (below 2^24).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Tensor {
    pub shape: Vec<usize>,
    pub data: Arc<Vec<f32>>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Self {
            shape,
            data: Arc::new(data),
        }
    }

    pub fn scalar(value: f32) -> Self {
        Self::new(vec![], vec![value])
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The values as integers (shapes, axes, indices).
    pub fn ints(&self) -> Vec<i64> {
        self.data.iter().map(|&v| v as i64).collect()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Conv2d {
    pub kernel: [usize; 2],
    pub strides: [usize; 2],
    /// Top, left, bottom, right.
    pub pads: [usize; 4],
    pub dilations: [usize; 2],
    pub group: usize,
    /// Applied after the bias and the residual.
    pub act: Act,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PoolKind {
    Max,
    Avg { count_include_pad: bool },
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Pool2d {
    pub kind: PoolKind,
    pub kernel: [usize; 2],
    pub strides: [usize; 2],
    /// Top, left, bottom, right, as declared: `ceil_mode` shows in the output shape only.
    pub pads: [usize; 4],
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Op {
    /// Inputs: x, weight [K, C/group, R, S], bias [K], and optionally a residual (the output's
    /// shape) added before `act`.
    Conv(Conv2d),
    /// Inference batch normalisation; inputs x, scale, bias, mean, var. Folded into the
    /// convolution before it where there is one.
    BatchNorm {
        epsilon: f32,
    },
    /// `y = act(x · W + bias)` over the last axis of x. Inputs: x, W as [K, N], optional bias
    /// [N].
    Gemm {
        act: Act,
    },
    /// `alpha · [..., M, K] · [..., K, N]` of two computed tensors with the same leading
    /// axes: one product per leading index (attention's query·keyᵀ and weights·values;
    /// `alpha` takes the scaling of query and key).
    MatMul {
        alpha: f32,
    },
    /// `softmax(alpha · q · kᵀ + bias) · v` over the last axis, from `passes::fuse_attention`
    /// (fp16 plans). Inputs: q `[..., S, D]`, kᵀ `[..., D, T]`, v `[..., T, Dv]` and
    /// optionally a constant bias `[..., S, T]` of the same rank, 1 along the axes it
    /// broadcasts over.
    Attention {
        alpha: f32,
    },
    Pool(Pool2d),
    /// Mean over the spatial axes of an NCHW tensor, kept as [N, C, 1, 1].
    GlobalAvgPool,
    Unary(Act),
    /// NumPy broadcasting, then `act`.
    Binary {
        op: BinOp,
        act: Act,
    },
    Softmax {
        axis: usize,
    },
    /// Inputs: x, scale, bias, over the axes from `axis` on.
    LayerNorm {
        axis: usize,
        epsilon: f32,
    },
    Lrn {
        size: usize,
        alpha: f32,
        beta: f32,
        bias: f32,
    },
    Concat {
        axis: usize,
    },
    /// `output[i] = input[perm[i]]` for axes.
    Transpose {
        perm: Vec<usize>,
    },
    /// The output shape is the output value's.
    Reshape,
    /// Keeps `start, start + step, ...` below `end` of one axis.
    Slice {
        axis: usize,
        start: usize,
        end: usize,
        step: usize,
    },
    /// Mean over `axes`; the output shape says whether they are kept.
    ReduceMean {
        axes: Vec<usize>,
    },
    /// Constant padding: `pads` holds the sizes added before each axis, then after each.
    Pad {
        pads: Vec<usize>,
        value: f32,
    },
}

impl Op {
    /// The operator's numeric parameters (epsilons, slopes, bounds, scales), to check them.
    pub fn parameters(&self) -> Vec<f32> {
        let act = |a: &Act| match *a {
            Act::LeakyRelu(p) | Act::Elu(p) => vec![p],
            Act::Clip(p, q) | Act::HardSigmoid(p, q) => vec![p, q],
            _ => vec![],
        };
        match self {
            Op::Conv(c) => act(&c.act),
            Op::Gemm { act: a } | Op::Unary(a) | Op::Binary { act: a, .. } => act(a),
            Op::BatchNorm { epsilon } | Op::LayerNorm { epsilon, .. } => vec![*epsilon],
            Op::MatMul { alpha } | Op::Attention { alpha } => vec![*alpha],
            Op::Pad { value, .. } => vec![*value],
            Op::Lrn {
                alpha, beta, bias, ..
            } => vec![*alpha, *beta, *bias],
            Op::Pool(_)
            | Op::GlobalAvgPool
            | Op::Softmax { .. }
            | Op::Concat { .. }
            | Op::Transpose { .. }
            | Op::Reshape
            | Op::Slice { .. }
            | Op::ReduceMean { .. } => vec![],
        }
    }

    /// Whether the op only views its input another way (a reshape, a transpose, a slice):
    /// the lowering makes no copy where the layout allows.
    pub fn is_view(&self) -> bool {
        matches!(self, Op::Reshape | Op::Transpose { .. } | Op::Slice { .. })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Op::Conv(_) => "Conv",
            Op::BatchNorm { .. } => "BatchNormalization",
            Op::Gemm { .. } => "Gemm",
            Op::MatMul { .. } => "MatMul",
            Op::Attention { .. } => "Attention",
            Op::Pool(p) if p.kind == PoolKind::Max => "MaxPool",
            Op::Pool(_) => "AveragePool",
            Op::GlobalAvgPool => "GlobalAveragePool",
            Op::Unary(_) => "Unary",
            Op::Binary { .. } => "Binary",
            Op::Softmax { .. } => "Softmax",
            Op::LayerNorm { .. } => "LayerNormalization",
            Op::Lrn { .. } => "LRN",
            Op::Concat { .. } => "Concat",
            Op::Transpose { .. } => "Transpose",
            Op::Reshape => "Reshape",
            Op::Slice { .. } => "Slice",
            Op::Pad { .. } => "Pad",
            Op::ReduceMean { .. } => "ReduceMean",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Node {
    /// The ONNX node's name (or its output's), kept for messages and for naming weights.
    pub name: String,
    pub op: Op,
    pub inputs: Vec<String>,
    pub output: String,
}

/// A graph in topological order with the shape of every value. Constants live in `consts`;
/// everything else is computed from the one input.
#[derive(Debug, Clone, Default)]
pub(super) struct Graph {
    pub nodes: Vec<Node>,
    pub shapes: HashMap<String, Vec<usize>>,
    pub consts: HashMap<String, Tensor>,
    pub input: String,
    pub output: String,
}

impl Graph {
    pub fn shape(&self, value: &str) -> &[usize] {
        self.shapes
            .get(value)
            .map(Vec::as_slice)
            .or_else(|| self.consts.get(value).map(|t| t.shape.as_slice()))
            .unwrap_or_else(|| panic!("value `{value}` has no shape"))
    }

    pub fn is_const(&self, value: &str) -> bool {
        self.consts.contains_key(value)
    }

    /// How many node inputs (and the graph output) read `value`.
    pub fn uses(&self, value: &str) -> usize {
        self.nodes
            .iter()
            .flat_map(|n| &n.inputs)
            .filter(|i| *i == value)
            .count()
            + usize::from(self.output == value)
    }

    pub fn producer(&self, value: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.output == value)
    }

    /// Drops constants no node reads any more.
    pub fn prune_consts(&mut self) {
        let used: std::collections::HashSet<&String> =
            self.nodes.iter().flat_map(|n| &n.inputs).collect();
        self.consts.retain(|k, _| used.contains(k));
    }
}

/// Broadcast shape of NumPy's rules, or `None` where the shapes do not broadcast.
pub(super) fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    (0..rank)
        .map(|i| {
            let da = if i + a.len() >= rank {
                a[i + a.len() - rank]
            } else {
                1
            };
            let db = if i + b.len() >= rank {
                b[i + b.len() - rank]
            } else {
                1
            };
            match (da, db) {
                (x, y) if x == y => Some(x),
                (1, y) => Some(y),
                (x, 1) => Some(x),
                _ => None,
            }
        })
        .collect()
}

/// Row-major strides of `shape`.
pub(super) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

/// The four axes of an NCHW tensor (or a KCRS weight).
pub(super) fn dims4(shape: &[usize]) -> [usize; 4] {
    shape.try_into().expect("a 4-D tensor")
}
