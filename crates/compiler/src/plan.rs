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
    /// Half precision, 2 bytes: the `fp16` precision.
    F16,
    /// Single precision, 4 bytes.
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
    /// An offset into the activation arena.
    Arena(usize),
    /// A slice of one constant.
    Weight {
        /// The constant's index in `Weights`.
        index: usize,
        /// The offset into that constant.
        offset: usize,
    },
    /// The frames, f32, as the model's input layout.
    Input(usize),
    /// The scores, f32.
    Output(usize),
    /// An offset into the f32 arena of a mixed-precision plan, in f32 elements: the values
    /// of the nodes an fp16 plan keeps in f32 because fp16 cannot hold them (`Plan::wide_len`).
    Wide(usize),
    /// A buffer not placed in the arena yet; only during lowering.
    Temp {
        /// The lowering's buffer number, which arena placement turns into an offset.
        id: usize,
        /// The offset into that buffer.
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
            Loc::Wide(o) => Loc::Wide(o + elements),
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
    /// The element that iteration 0 reads or writes.
    pub loc: Loc,
    /// One stride per dimension of the step's `dims`, in elements; negative walks backwards.
    pub strides: Vec<i64>,
}

/// The conversion an element-wise step makes between f32 and the plan's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Cast {
    /// Reads and writes the plan's type.
    None,
    /// Reads f32 (the input frames).
    FromF32,
    /// Writes f32 (the scores).
    ToF32,
    /// Reads and writes f32: the scores, after the product that wrote them in f32 (whose
    /// bias and activation this step applies; `b` is in the plan's type).
    F32,
    /// Reads and writes f32 only, `b` too: a step of a node kept in f32 in an fp16 plan.
    Wide,
}

/// A 2-D convolution (cuDNN on the GPU) with its bias, residual and activation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConvStep {
    /// Input N, C, H, W (NHWC in memory); output K, OH, OW.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Input height, in pixels.
    pub h: usize,
    /// Input width, in pixels.
    pub w: usize,
    /// Output channels: the number of filters.
    pub k: usize,
    /// Output height, in pixels.
    pub oh: usize,
    /// Output width, in pixels.
    pub ow: usize,
    /// Kernel height and width (R, S).
    pub kernel: [usize; 2],
    /// Symmetric: asymmetric pads are made explicit by the lowering.
    pub pads: [usize; 2],
    /// Vertical and horizontal stride, in pixels.
    pub strides: [usize; 2],
    /// Vertical and horizontal dilation; 1 = a dense kernel.
    pub dilations: [usize; 2],
    /// Groups the channels are split into: 1 for a plain convolution, `c` for a depthwise one.
    pub group: usize,
    /// Applied last, after the bias and the residual.
    pub act: Act,
    /// The input, `[n, h, w, c]`.
    pub x: Loc,
    /// KRSC.
    pub weight: Loc,
    /// One value per output channel (`k` elements).
    pub bias: Loc,
    /// Added before the activation; the same shape as `y`.
    pub residual: Option<Loc>,
    /// The output, `[n, oh, ow, k]`.
    pub y: Loc,
    /// Chosen by timing while building; `None` until then.
    pub algo: Option<Tuned>,
}

/// The cuDNN algorithm a convolution runs with, chosen by timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tuned {
    /// cuDNN's `cudnnConvolutionFwdAlgo_t`, as an integer: the engine file holds no cuDNN type.
    pub algo: i32,
    /// cuDNN's `cudnnMathType_t` (whether tensor cores may be used), as an integer.
    pub math: i32,
    /// Bytes of workspace the algorithm needs; at most `MAX_WORKSPACE`.
    pub workspace: usize,
    /// Whether cuDNN's fused convolution + bias + activation (+ residual) runs it.
    pub fused: bool,
}

/// The head sizes (query/key and value) the fused attention kernel is built for: `dk ≤ dv`,
/// both from this list (kernels.cu's `ATTENTION` instantiations).
pub const ATTENTION_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Whether the fused attention kernel takes heads of `dk` query/key and `dv` value elements.
pub fn attention_takes(dk: usize, dv: usize) -> bool {
    dk <= dv && ATTENTION_HEAD_DIMS.contains(&dk) && ATTENTION_HEAD_DIMS.contains(&dv)
}

/// Rows of a matrix operand of `AttentionStep`, one matrix per batch index: the elements of a
/// row are contiguous, rows and matrices lie at any stride.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Rows {
    /// Row 0 of matrix 0.
    pub loc: Loc,
    /// The stride of each of the three batch axes, in elements; 0 broadcasts.
    pub batch: [usize; 3],
    /// From one row to the next, in elements; 0 broadcasts.
    pub row: usize,
}

impl Rows {
    /// What `rows × width` matrices over the batch `axes` touch.
    fn span(&self, axes: [usize; 3], rows: usize, width: usize) -> Span {
        let reach = |n: usize, stride: usize| (n.max(1) as i128 - 1) * stride as i128;
        let end = 1
            + axes
                .iter()
                .zip(self.batch)
                .map(|(&n, s)| reach(n, s))
                .sum::<i128>()
            + reach(rows, self.row)
            + width as i128
            - 1;
        Span {
            loc: self.loc,
            start: 0,
            end: if axes.contains(&0) || rows * width == 0 {
                0
            } else {
                end
            },
        }
    }
}

/// Scaled dot-product attention, fused: for each batch index, `y = softmax(alpha·q·kᵀ +
/// bias)·v` over rows of keys, in f32 inside the kernel; the scores are never written. On the
/// GPU it runs on tensor cores (fp16 plans only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionStep {
    /// The batch index as three axes, outermost first (1 where unused): heads, windows,
    /// images.
    pub batch: [usize; 3],
    /// Query rows per matrix (S).
    pub queries: usize,
    /// Key and value rows per matrix (T).
    pub keys: usize,
    /// Elements of a query or key row.
    pub dk: usize,
    /// Elements of a value row, and of an output row.
    pub dv: usize,
    /// Scales `q·kᵀ`, not the bias.
    pub alpha: f32,
    /// `[queries, dk]` per batch index.
    pub q: Rows,
    /// `[keys, dk]` per batch index.
    pub k: Rows,
    /// `[keys, dv]` per batch index.
    pub v: Rows,
    /// `[queries, keys]` added to the scaled scores (position biases, window masks).
    pub bias: Option<Rows>,
    /// `[queries, dv]` per batch index.
    pub y: Rows,
}

impl AttentionStep {
    /// Every operand, with its rows and row width.
    fn operands(&self) -> Vec<(Rows, usize, usize)> {
        let mut all = vec![
            (self.q, self.queries, self.dk),
            (self.k, self.keys, self.dk),
            (self.v, self.keys, self.dv),
            (self.y, self.queries, self.dv),
        ];
        all.extend(self.bias.map(|b| (b, self.queries, self.keys)));
        all
    }

    /// The step computed on the CPU in f32, reading through `read`: the values to write and
    /// where (the simulator's and the CPU runner's attention).
    pub fn run(&self, read: impl Fn(Loc) -> f32) -> Vec<(Loc, f32)> {
        let at = |r: &Rows, i: [usize; 3], row: usize, col: usize| {
            let matrix: usize = i.iter().zip(r.batch).map(|(i, s)| i * s).sum();
            r.loc.offset(matrix + row * r.row + col)
        };
        let [b0, b1, b2] = self.batch;
        let mut out = Vec::with_capacity(b0 * b1 * b2 * self.queries * self.dv);
        for i in (0..b0).flat_map(|a| (0..b1).flat_map(move |b| (0..b2).map(move |c| [a, b, c]))) {
            for s in 0..self.queries {
                let scores: Vec<f32> = (0..self.keys)
                    .map(|t| {
                        let dot: f32 = (0..self.dk)
                            .map(|d| read(at(&self.q, i, s, d)) * read(at(&self.k, i, t, d)))
                            .sum();
                        let bias = self.bias.map_or(0.0, |b| read(at(&b, i, s, t)));
                        self.alpha * dot + bias
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let weights: Vec<f32> = scores.iter().map(|v| (v - max).exp()).collect();
                let sum: f32 = weights.iter().sum();
                for d in 0..self.dv {
                    let acc: f32 = (0..self.keys)
                        .map(|t| weights[t] * read(at(&self.v, i, t, d)))
                        .sum();
                    out.push((at(&self.y, i, s, d), acc / sum));
                }
            }
        }
        out
    }
}

/// One kernel launch or library call of a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Step {
    /// `out = act(op(a, b))`, or `act(a)`, over `dims`.
    Ew {
        /// The binary operation; `None` for `act(a)`, with no `b`.
        op: Option<BinOp>,
        /// Applied to the result of `op`, or to `a` alone.
        act: Act,
        /// Whether the step reads or writes f32 instead of the plan's type.
        cast: Cast,
        /// Iteration extents, outermost first; at most `MAX_RANK`.
        dims: Vec<usize>,
        /// Where the results go.
        out: Strided,
        /// The first operand.
        a: Strided,
        /// The second operand: present when `op` is.
        b: Option<Strided>,
    },
    /// Sets `len` elements to zero.
    Zero {
        /// The first element to clear.
        loc: Loc,
        /// Elements of the plan's type.
        len: usize,
    },
    /// A convolution, see `ConvStep`.
    Conv(ConvStep),
    /// `y[rows, n] = act(x[rows, k] · w[k, n] + bias + residual)`, act being None, Relu or,
    /// in fp16 plans, Gelu (cuBLASLt's epilogue). Also runs 1×1 convolutions, NHWC being
    /// `[pixels, channels]`.
    /// With `batch` above 1, that many products of consecutive `w` matrices, each with its
    /// own `x` and `y` (attention, where `w` is computed too) or all of one `x` (the query,
    /// key and value of one input, `lower::products`).
    Gemm {
        /// Products run; 1 for a single product.
        batch: usize,
        /// Scales the product (not the bias or the residual).
        alpha: f32,
        /// Rows of `x` and `y` (pixels for a 1×1 convolution).
        rows: usize,
        /// Columns of `w` and `y` (output channels for a 1×1 convolution).
        n: usize,
        /// Columns of `x` and rows of `w`: the dimension summed over.
        k: usize,
        /// Row-major `[rows, k]` matrices, `x_batch` elements apart.
        x: Loc,
        /// Elements from one product's `x` to the next's: `rows · k`, or 0 where every
        /// product reads the same `x`.
        x_batch: usize,
        /// Row-major `[batch, k, n]`, or `[batch, n, k]` where `w_transposed`.
        w: Loc,
        /// Whether `w` holds the transpose of each matrix the product reads (attention's
        /// keys, `q · kᵀ`), read in place instead of copied into `[k, n]` order.
        w_transposed: bool,
        /// `n` values added to every row; with `batch` above 1, `[batch, n]`: each product's
        /// own.
        bias: Option<Loc>,
        /// Laid out as `y`, added after the scaling by `alpha`.
        residual: Option<Loc>,
        /// The activation that follows: `Act::None`, `Act::Relu`, or `Act::Gelu` in fp16
        /// plans, which the GPU applies in cuBLASLt's tanh form: it differs from the erf form
        /// by at most 4.7e-4 (at x ≈ 2.7, where fp16's step is 2e-3), so that the fp16 results
        /// differ by one step at most.
        act: Act,
        /// Row-major `[rows, n]` matrices, `y_batch` elements apart; in f32 where it is the
        /// output buffer (the scores of an fp16 plan, computed in f32 so that they cannot
        /// overflow fp16).
        y: Loc,
        /// Elements from one product's `y` to the next's: at least `rows · n` (more where
        /// each starts aligned as a buffer of its own would).
        y_batch: usize,
    },
    /// NHWC in and out.
    Pool {
        /// Images in the batch.
        n: usize,
        /// Input height, in pixels.
        h: usize,
        /// Input width, in pixels.
        w: usize,
        /// Channels, the same in and out.
        c: usize,
        /// Output height, in pixels.
        oh: usize,
        /// Output width, in pixels.
        ow: usize,
        /// Window height and width.
        kernel: [usize; 2],
        /// Vertical and horizontal stride, in pixels.
        strides: [usize; 2],
        /// Top, left, bottom, right.
        pads: [usize; 4],
        /// Max pooling if true, else average pooling.
        max: bool,
        /// Whether an average counts the window's cells in the padding too; max pooling ignores it.
        count_include_pad: bool,
        /// The input, `[n, h, w, c]`.
        x: Loc,
        /// The output, `[n, oh, ow, c]`.
        y: Loc,
    },
    /// NHWC [n, hw, c] to [n, c].
    GlobalAvgPool {
        /// Images in the batch.
        n: usize,
        /// Pixels per image (height × width), all averaged together.
        hw: usize,
        /// Channels.
        c: usize,
        /// The input, `[n, hw, c]`.
        x: Loc,
        /// The output, `[n, c]`.
        y: Loc,
    },
    /// Softmax over each row of `x`, `[rows, len]` in and out.
    Softmax {
        /// Rows, each normalised on its own.
        rows: usize,
        /// Elements per row: the softmax axis, innermost.
        len: usize,
        /// The input, `[rows, len]`.
        x: Loc,
        /// The output, `[rows, len]`.
        y: Loc,
    },
    /// Normalises each row of `x` to zero mean and unit variance, then applies `scale` and `bias`.
    LayerNorm {
        /// Rows, each normalised on its own.
        rows: usize,
        /// Elements per row: the normalised axis, innermost.
        len: usize,
        /// Added to the variance before its square root.
        epsilon: f32,
        /// The input, `[rows, len]`.
        x: Loc,
        /// `len` values, multiplied into every row.
        scale: Loc,
        /// `len` values added to every row; `None` adds nothing.
        bias: Option<Loc>,
        /// The output, `[rows, len]`.
        y: Loc,
    },
    /// The mean of each row: `[rows, len]` to `[rows]`.
    RowMean {
        /// Rows, each averaged on its own.
        rows: usize,
        /// Elements averaged per row.
        len: usize,
        /// The input, `[rows, len]`.
        x: Loc,
        /// The output, `[rows]`.
        y: Loc,
    },
    /// Fused attention, see `AttentionStep`.
    Attention(AttentionStep),
    /// Across the channels of an NHWC tensor.
    Lrn {
        /// Positions normalised independently: N × H × W.
        pixels: usize,
        /// Channels, the innermost dimension.
        c: usize,
        /// Channels in the window around each channel (ONNX `size`).
        size: usize,
        /// Scales the window's sum of squares, divided by `size` first (ONNX `alpha`).
        alpha: f32,
        /// The exponent of the divisor (ONNX `beta`).
        beta: f32,
        /// Added to the scaled sum of squares (ONNX `bias`).
        bias: f32,
        /// The input, `[pixels, c]`.
        x: Loc,
        /// The output, `[pixels, c]`.
        y: Loc,
    },
}

/// Whether `dims` walked with `strides` touch each of `len` consecutive values once.
pub fn covers_once(dims: &[usize], strides: &[i64], len: usize) -> bool {
    let mut axes: Vec<(i64, usize)> = strides
        .iter()
        .copied()
        .zip(dims.iter().copied())
        .filter(|&(_, d)| d > 1)
        .collect();
    axes.sort_unstable();
    let mut next = 1i64;
    for (stride, dim) in axes {
        if stride != next {
            return false;
        }
        next *= dim as i64;
    }
    next == len as i64
}

/// A product's residual in its description: added, or added in place (the output written
/// over it, as the CPU's plans do).
fn residual_note(residual: Option<Loc>, y: Loc) -> &'static str {
    match residual {
        Some(z) if z == y => " +res in place",
        Some(_) => " +res",
        None => "",
    }
}
impl Step {
    /// Whether the step computes in f32 in an fp16 plan: a step of a node kept in f32, which
    /// reads and writes the f32 arena (`Loc::Wide`) and f32 weights. Element-wise steps say
    /// so by their cast (a cast writes the f32 arena without being one).
    pub fn is_wide(&self) -> bool {
        match self {
            Step::Ew { cast, .. } => *cast == Cast::Wide,
            step => matches!(step.written().loc, Loc::Wide(_)),
        }
    }

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
                residual_note(c.residual, c.y),
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
                act,
                w_transposed,
                x_batch,
                y,
                ..
            } => format!(
                "gemm {batch}x{} {rows}x{k} · {k}x{n}{}{}{}{}{}",
                if *batch > 1 && *x_batch == 0 {
                    " of one x"
                } else {
                    ""
                },
                if *w_transposed { "ᵀ" } else { "" },
                if *alpha == 1.0 {
                    String::new()
                } else {
                    format!(" ×{alpha}")
                },
                match act {
                    Act::None => String::new(),
                    act => format!(" {act:?}"),
                },
                residual_note(*residual, *y),
                if matches!(y, Loc::Output(_)) {
                    " -> f32 scores"
                } else {
                    ""
                }
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
            Step::Attention(a) => format!(
                "attention {:?} {}x{} · {}x{}ᵀ · {}x{}{}",
                a.batch,
                a.queries,
                a.dk,
                a.keys,
                a.dk,
                a.keys,
                a.dv,
                if a.bias.is_some() { " +bias" } else { "" }
            ),
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
                x_batch,
                w,
                bias,
                residual,
                y,
                y_batch,
                ..
            } => {
                let mut spans = vec![
                    batched(*x, *batch, *x_batch, rows * k),
                    len(*w, &[*batch, *k, *n]),
                    batched(*y, *batch, *y_batch, rows * n),
                ];
                spans.extend(bias.map(|b| len(b, &[*batch, *n])));
                spans.extend(residual.map(|r| batched(r, *batch, *y_batch, rows * n)));
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
            Step::Attention(a) => a
                .operands()
                .into_iter()
                .map(|(r, rows, width)| r.span(a.batch, rows, width))
                .collect(),
        };
        // An empty operand touches nothing, wherever it points.
        spans.retain(|s| s.end > s.start);
        spans
    }

    /// The elements the step writes, as its sizes say; a strided output may leave elements
    /// inside this span untouched.
    pub fn written(&self) -> Span {
        let len = |loc: Loc, dims: &[usize]| Span {
            loc,
            start: 0,
            end: dims.iter().map(|&d| d as i128).product(),
        };
        match self {
            Step::Ew { dims, out, .. } => Span::strided(out, dims),
            Step::Zero { loc, len: n } => len(*loc, &[*n]),
            Step::Conv(c) => len(c.y, &[c.n, c.oh, c.ow, c.k]),
            Step::Gemm {
                batch,
                rows,
                n,
                y,
                y_batch,
                ..
            } => batched(*y, *batch, *y_batch, rows * n),
            Step::Pool {
                n, oh, ow, c, y, ..
            } => len(*y, &[*n, *oh, *ow, *c]),
            Step::GlobalAvgPool { n, c, y, .. } => len(*y, &[*n, *c]),
            Step::Softmax {
                rows, len: l, y, ..
            }
            | Step::LayerNorm {
                rows, len: l, y, ..
            } => len(*y, &[*rows, *l]),
            Step::RowMean { rows, y, .. } => len(*y, &[*rows]),
            Step::Lrn { pixels, c, y, .. } => len(*y, &[*pixels, *c]),
            Step::Attention(a) => a.y.span(a.batch, a.queries, a.dv),
        }
    }

    /// The spans the step reads: `spans` less the written one, once (a second copy of it is
    /// an operand read in place: a residual written over).
    pub fn reads(&self) -> Vec<Span> {
        let mut spans = self.spans();
        let written = self.written();
        if let Some(at) = spans.iter().position(|s| *s == written) {
            spans.remove(at);
        }
        spans
    }

    /// Whether the step writes every element of `written`: not so for an element-wise step
    /// whose output strides skip some (a slice of a concatenation), nor for products of
    /// several matrices or attention, whose outputs may leave gaps between matrices.
    pub fn writes_all(&self) -> bool {
        match self {
            Step::Ew { dims, out, .. } => covers_once(dims, &out.strides, dims.iter().product()),
            Step::Gemm { batch, .. } => *batch == 1,
            Step::Attention(_) => false,
            // Each writes every element of its output once. Listed, not a catch-all: a new
            // kind of step must say which it is.
            Step::Zero { .. }
            | Step::Conv(_)
            | Step::Pool { .. }
            | Step::GlobalAvgPool { .. }
            | Step::Softmax { .. }
            | Step::LayerNorm { .. }
            | Step::RowMean { .. }
            | Step::Lrn { .. } => true,
        }
    }

    /// Every buffer the step reads or writes, as `locs_mut` lists them.
    pub fn locs(&self) -> Vec<Loc> {
        self.clone()
            .locs_mut()
            .into_iter()
            .map(|loc| *loc)
            .collect()
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
            Step::Attention(a) => {
                let mut locs = vec![&mut a.q.loc, &mut a.k.loc, &mut a.v.loc, &mut a.y.loc];
                locs.extend(a.bias.as_mut().map(|b| &mut b.loc));
                locs
            }
        }
    }
}

/// Elements `start..end` of a buffer, counted from `loc`'s offset (`start` is negative for an
/// operand walked with negative strides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The buffer, and the offset that `start` and `end` count from.
    pub loc: Loc,
    /// The first element touched, relative to `loc`.
    pub start: i128,
    /// One past the last element touched, relative to `loc`.
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

/// What `count` matrices of `len` elements, `stride` apart, touch (a stride of 0: one).
fn batched(loc: Loc, count: usize, stride: usize, len: usize) -> Span {
    let end = match (count, len) {
        (0, _) | (_, 0) => 0,
        _ => ((count - 1) * stride + len) as i128,
    };
    Span { loc, start: 0, end }
}

/// Everything one batch size runs: its steps, in order, over one arena.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Frames per run: every size in the plan is for exactly this many.
    pub batch: usize,
    /// The type of the arena and the weights; the input and output buffers stay f32, and so
    /// do the values and weights of the nodes an fp16 plan keeps in f32 (`wide_len`).
    pub dtype: DType,
    /// Elements of `dtype`.
    pub arena_len: usize,
    /// f32 elements of the arena of the nodes kept in f32 (`Loc::Wide`); 0 in a plan wholly
    /// of one type.
    pub wide_len: usize,
    /// f32 elements of the input buffer for the whole batch.
    pub input_len: usize,
    /// f32 elements of the output buffer for the whole batch.
    pub output_len: usize,
    /// In the order they run.
    pub steps: Vec<Step>,
    /// The ONNX node each step computes (after the passes, the first node of a fused group),
    /// parallel to `steps`: what a profile or an overflow report names.
    pub origins: Vec<String>,
}

impl Plan {
    /// The nodes whose steps run in f32 in an fp16 plan (`Step::is_wide`), in plan order;
    /// the copy into the scores is no node's.
    pub fn wide_nodes(&self) -> Vec<String> {
        let mut nodes: Vec<String> = Vec::new();
        for (step, origin) in self.steps.iter().zip(&self.origins) {
            let scores = matches!(step.written().loc, Loc::Output(_));
            if step.is_wide() && !scores && !nodes.contains(origin) {
                nodes.push(origin.clone());
            }
        }
        nodes
    }
}

/// Constants in f32, converted to the plan's type when they are uploaded. Shared by the
/// plans of all batch sizes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Weights {
    /// Each constant's name (the ONNX initializer's, or the folded node's), by index.
    pub names: Vec<String>,
    /// Whether each constant is read by a node kept in f32, and so stays in f32 on the device
    /// in an fp16 plan; parallel to `names`.
    pub wide: Vec<bool>,
    /// The values, parallel to `names`; not serialised: the engine file stores them converted.
    #[serde(skip)]
    pub data: Vec<std::sync::Arc<Vec<f32>>>,
}

impl Weights {
    /// The index of the constant `name` with `data`, added if it is not there yet; `wide`
    /// for one that a node kept in f32 reads (a constant read by both is stored twice).
    pub fn add(&mut self, name: &str, data: &std::sync::Arc<Vec<f32>>, wide: bool) -> usize {
        // A constant folded per batch size can have other values under the same name.
        let same =
            |i: &usize| self.names[*i] == name && self.wide[*i] == wide && *self.data[*i] == **data;
        if let Some(i) = (0..self.names.len()).find(same) {
            return i;
        }
        self.names.push(name.to_owned());
        self.wide.push(wide);
        self.data.push(data.clone());
        self.names.len() - 1
    }

    /// The type constant `index` has on the device in a plan of `dtype`.
    pub fn dtype(&self, index: usize, dtype: DType) -> DType {
        weight_type(&self.wide, index, dtype)
    }
}

/// The type of weight `index` on the device in a plan of `dtype`, `wide` saying which
/// weights nodes kept in f32 read (`Weights::wide`, as an engine file stores it).
pub fn weight_type(wide: &[bool], index: usize, dtype: DType) -> DType {
    match wide.get(index) {
        Some(true) => DType::F32,
        _ => dtype,
    }
}
