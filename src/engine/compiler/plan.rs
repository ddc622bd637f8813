// SPDX-License-Identifier: MPL-2.0
//! The lowered form of a graph for one batch size: a list of GPU steps over one activation
//! arena, with every layout, offset and stride settled. It is what the engine file stores
//! and what `runtime` replays; `sim` runs it on the CPU for the tests.

use serde::{Deserialize, Serialize};

use super::ir::{Act, BinOp};

/// Iteration dimensions of an element-wise step, after merging.
pub const MAX_RANK: usize = 6;

/// The most workspace a tuned convolution algorithm may use (bytes): the runtime allocates
/// this much, and `check` refuses a plan whose algorithm asks for more.
pub const MAX_WORKSPACE: usize = 256 << 20;

/// The type of a plan's activations and weights on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DType {
    F16,
    F32,
}

impl DType {
    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            DType::F16 => 2,
            DType::F32 => 4,
        }
    }
}

/// Where a step reads or writes; offsets are in elements of the plan's type (f32 for the
/// input and output buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Loc {
    Arena(usize),
    Weight {
        index: usize,
        offset: usize,
    },
    /// The frames, f32, as the model's input layout.
    Input(usize),
    /// The scores, f32.
    Output(usize),
    /// A buffer not placed in the arena yet; only during lowering.
    Temp {
        id: usize,
        offset: usize,
    },
}

impl Loc {
    /// The place `elements` further into the same buffer.
    pub fn offset(self, elements: usize) -> Loc {
        match self {
            Loc::Arena(o) => Loc::Arena(o + elements),
            Loc::Weight { index, offset } => Loc::Weight {
                index,
                offset: offset + elements,
            },
            Loc::Input(o) => Loc::Input(o + elements),
            Loc::Output(o) => Loc::Output(o + elements),
            Loc::Temp { id, offset } => Loc::Temp {
                id,
                offset: offset + elements,
            },
        }
    }
}

/// An operand of an element-wise step: its start and its stride (in elements) along each
/// iteration dimension; 0 broadcasts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Strided {
    pub loc: Loc,
    pub strides: Vec<i64>,
}

/// The conversion an element-wise step makes between f32 and the plan's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Cast {
    None,
    /// Reads f32 (the input frames).
    FromF32,
    /// Writes f32 (the scores).
    ToF32,
}

/// A 2-D convolution (cuDNN on the GPU) with its bias, residual and activation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConvStep {
    /// Input N, C, H, W (NHWC in memory); output K, OH, OW.
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub k: usize,
    pub oh: usize,
    pub ow: usize,
    pub kernel: [usize; 2],
    /// Symmetric: asymmetric pads are made explicit by the lowering.
    pub pads: [usize; 2],
    pub strides: [usize; 2],
    pub dilations: [usize; 2],
    pub group: usize,
    pub act: Act,
    pub x: Loc,
    /// KRSC.
    pub weight: Loc,
    pub bias: Loc,
    pub residual: Option<Loc>,
    pub y: Loc,
    /// Chosen by timing while building; `None` until then.
    pub algo: Option<Tuned>,
}

/// The cuDNN algorithm a convolution runs with, chosen by timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tuned {
    pub algo: i32,
    pub math: i32,
    pub workspace: usize,
    /// Whether cuDNN's fused convolution + bias + activation (+ residual) runs it.
    pub fused: bool,
}

/// One kernel launch or library call of a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Step {
    /// `out = act(op(a, b))`, or `act(a)`, over `dims`.
    Ew {
        op: Option<BinOp>,
        act: Act,
        cast: Cast,
        dims: Vec<usize>,
        out: Strided,
        a: Strided,
        b: Option<Strided>,
    },
    /// Sets `len` elements to zero.
    Zero {
        loc: Loc,
        len: usize,
    },
    Conv(ConvStep),
    /// `y[rows, n] = act(x[rows, k] · w[k, n] + bias + residual)`, act being None or Relu
    /// (cuBLASLt's epilogue). Also runs 1×1 convolutions, NHWC being `[pixels, channels]`.
    /// With `batch` above 1, that many products of consecutive `x`, `w` and `y` matrices
    /// (attention, where `w` is computed too).
    Gemm {
        batch: usize,
        /// Scales the product (not the bias or the residual).
        alpha: f32,
        rows: usize,
        n: usize,
        k: usize,
        x: Loc,
        w: Loc,
        bias: Option<Loc>,
        residual: Option<Loc>,
        relu: bool,
        y: Loc,
    },
    /// NHWC in and out.
    Pool {
        n: usize,
        h: usize,
        w: usize,
        c: usize,
        oh: usize,
        ow: usize,
        kernel: [usize; 2],
        strides: [usize; 2],
        /// Top, left, bottom, right.
        pads: [usize; 4],
        max: bool,
        count_include_pad: bool,
        x: Loc,
        y: Loc,
    },
    /// NHWC [n, hw, c] to [n, c].
    GlobalAvgPool {
        n: usize,
        hw: usize,
        c: usize,
        x: Loc,
        y: Loc,
    },
    Softmax {
        rows: usize,
        len: usize,
        x: Loc,
        y: Loc,
    },
    LayerNorm {
        rows: usize,
        len: usize,
        epsilon: f32,
        x: Loc,
        scale: Loc,
        bias: Option<Loc>,
        y: Loc,
    },
    RowMean {
        rows: usize,
        len: usize,
        x: Loc,
        y: Loc,
    },
    /// Across the channels of an NHWC tensor.
    Lrn {
        pixels: usize,
        c: usize,
        size: usize,
        alpha: f32,
        beta: f32,
        bias: f32,
        x: Loc,
        y: Loc,
    },
}

impl Step {
    /// A one-line summary, for profiles.
    pub fn describe(&self) -> String {
        match self {
            Step::Ew { op, act, dims, .. } => format!("ew {op:?} {act:?} {dims:?}"),
            Step::Zero { len, .. } => format!("zero {len}"),
            Step::Conv(c) => format!(
                "conv {}x{}x{}x{} k{}x{} s{} g{} -> {} {:?}{} {}",
                c.n,
                c.c,
                c.h,
                c.w,
                c.kernel[0],
                c.kernel[1],
                c.strides[0],
                c.group,
                c.k,
                c.act,
                if c.residual.is_some() { " +res" } else { "" },
                c.algo.map_or("untuned".into(), |t| format!(
                    "algo {} math {}{}",
                    t.algo,
                    t.math,
                    if t.fused { " fused" } else { "" }
                ))
            ),
            Step::Gemm {
                batch,
                alpha,
                rows,
                n,
                k,
                residual,
                relu,
                ..
            } => format!(
                "gemm {batch}x {rows}x{k} · {k}x{n}{}{}{}",
                if *alpha == 1.0 {
                    String::new()
                } else {
                    format!(" ×{alpha}")
                },
                if *relu { " Relu" } else { "" },
                if residual.is_some() { " +res" } else { "" }
            ),
            Step::Pool {
                n,
                h,
                w,
                c,
                kernel,
                max,
                ..
            } => format!(
                "{}pool {n}x{c}x{h}x{w} k{}",
                if *max { "max" } else { "avg" },
                kernel[0]
            ),
            Step::GlobalAvgPool { n, hw, c, .. } => format!("global avg {n}x{hw}x{c}"),
            Step::Softmax { rows, len, .. } => format!("softmax {rows}x{len}"),
            Step::LayerNorm { rows, len, .. } => format!("layernorm {rows}x{len}"),
            Step::RowMean { rows, len, .. } => format!("mean {rows}x{len}"),
            Step::Lrn { pixels, c, .. } => format!("lrn {pixels}x{c}"),
        }
    }

    /// The elements the step may touch in each buffer it reads or writes, as its sizes say:
    /// what an engine file is checked against before anything runs.
    pub fn spans(&self) -> Vec<Span> {
        let len = |loc: Loc, dims: &[usize]| Span {
            loc,
            start: 0,
            end: dims.iter().map(|&d| d as i128).product(),
        };
        let mut spans = match self {
            Step::Ew {
                dims, out, a, b, ..
            } => {
                let mut spans = vec![Span::strided(out, dims), Span::strided(a, dims)];
                spans.extend(b.as_ref().map(|b| Span::strided(b, dims)));
                spans
            }
            Step::Zero { loc, len: n } => vec![len(*loc, &[*n])],
            Step::Conv(c) => {
                let out = [c.n, c.oh, c.ow, c.k];
                let per_group = c.c.checked_div(c.group).unwrap_or(0);
                let mut spans = vec![
                    len(c.x, &[c.n, c.h, c.w, c.c]),
                    len(c.weight, &[c.k, c.kernel[0], c.kernel[1], per_group]),
                    len(c.bias, &[c.k]),
                    len(c.y, &out),
                ];
                spans.extend(c.residual.map(|r| len(r, &out)));
                spans
            }
            Step::Gemm {
                batch,
                rows,
                n,
                k,
                x,
                w,
                bias,
                residual,
                y,
                ..
            } => {
                let mut spans = vec![
                    len(*x, &[*batch, *rows, *k]),
                    len(*w, &[*batch, *k, *n]),
                    len(*y, &[*batch, *rows, *n]),
                ];
                spans.extend(bias.map(|b| len(b, &[*n])));
                spans.extend(residual.map(|r| len(r, &[*batch, *rows, *n])));
                spans
            }
            Step::Pool {
                n,
                h,
                w,
                c,
                oh,
                ow,
                x,
                y,
                ..
            } => vec![len(*x, &[*n, *h, *w, *c]), len(*y, &[*n, *oh, *ow, *c])],
            Step::GlobalAvgPool { n, hw, c, x, y } => {
                vec![len(*x, &[*n, *hw, *c]), len(*y, &[*n, *c])]
            }
            Step::Softmax { rows, len: l, x, y } => {
                vec![len(*x, &[*rows, *l]), len(*y, &[*rows, *l])]
            }
            Step::LayerNorm {
                rows,
                len: l,
                x,
                scale,
                bias,
                y,
                ..
            } => {
                let mut spans = vec![
                    len(*x, &[*rows, *l]),
                    len(*scale, &[*l]),
                    len(*y, &[*rows, *l]),
                ];
                spans.extend(bias.map(|b| len(b, &[*l])));
                spans
            }
            Step::RowMean { rows, len: l, x, y } => {
                vec![len(*x, &[*rows, *l]), len(*y, &[*rows])]
            }
            Step::Lrn {
                pixels, c, x, y, ..
            } => {
                vec![len(*x, &[*pixels, *c]), len(*y, &[*pixels, *c])]
            }
        };
        // An empty operand touches nothing, wherever it points.
        spans.retain(|s| s.end > s.start);
        spans
    }

    /// Every buffer the step reads or writes.
    pub fn locs_mut(&mut self) -> Vec<&mut Loc> {
        match self {
            Step::Ew { out, a, b, .. } => {
                let mut locs = vec![&mut out.loc, &mut a.loc];
                locs.extend(b.as_mut().map(|b| &mut b.loc));
                locs
            }
            Step::Zero { loc, .. } => vec![loc],
            Step::Conv(c) => {
                let mut locs = vec![&mut c.x, &mut c.weight, &mut c.bias, &mut c.y];
                locs.extend(c.residual.as_mut());
                locs
            }
            Step::Gemm {
                x,
                w,
                bias,
                residual,
                y,
                ..
            } => {
                let mut locs = vec![x, w, y];
                locs.extend(bias.as_mut());
                locs.extend(residual.as_mut());
                locs
            }
            Step::LayerNorm {
                x, scale, bias, y, ..
            } => {
                let mut locs = vec![x, scale, y];
                locs.extend(bias.as_mut());
                locs
            }
            Step::Pool { x, y, .. }
            | Step::GlobalAvgPool { x, y, .. }
            | Step::Softmax { x, y, .. }
            | Step::RowMean { x, y, .. }
            | Step::Lrn { x, y, .. } => vec![x, y],
        }
    }
}

/// Elements `start..end` of a buffer, counted from `loc`'s offset (`start` is negative for an
/// operand walked with negative strides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub loc: Loc,
    pub start: i128,
    pub end: i128,
}

impl Span {
    /// What `dims` iterations over `s` touch.
    fn strided(s: &Strided, dims: &[usize]) -> Span {
        let (mut start, mut end) = (0i128, 1i128);
        if dims.contains(&0) {
            return Span {
                loc: s.loc,
                start: 0,
                end: 0,
            };
        }
        for (&d, &stride) in dims.iter().zip(&s.strides) {
            let reach = (d as i128 - 1).max(0) * i128::from(stride);
            match reach < 0 {
                true => start += reach,
                false => end += reach,
            }
        }
        Span {
            loc: s.loc,
            start,
            end,
        }
    }
}

/// Everything one batch size runs: its steps, in order, over one arena.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub batch: usize,
    pub dtype: DType,
    /// Elements of `dtype`.
    pub arena_len: usize,
    /// f32 elements of the input and output buffers for the whole batch.
    pub input_len: usize,
    pub output_len: usize,
    pub steps: Vec<Step>,
}

/// Constants in f32, converted to the plan's type when they are uploaded. Shared by the
/// plans of all batch sizes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Weights {
    pub names: Vec<String>,
    #[serde(skip)]
    pub data: Vec<std::sync::Arc<Vec<f32>>>,
}

impl Weights {
    /// The index of the constant `name`, added if new.
    pub fn add(&mut self, name: &str, data: &std::sync::Arc<Vec<f32>>) -> usize {
        // A constant folded per batch size can have other values under the same name.
        let same = |(n, d): (&String, &std::sync::Arc<Vec<f32>>)| n == name && **d == **data;
        if let Some(i) = self.names.iter().zip(&self.data).position(same) {
            return i;
        }
        self.names.push(name.to_owned());
        self.data.push(data.clone());
        self.names.len() - 1
    }
}
