// SPDX-License-Identifier: MPL-2.0
//! The lowered form of a graph for one batch size: a list of GPU steps over one activation
//! arena, with every layout, offset and stride settled. It is what the engine file stores
//! and what `runtime` replays; `sim` runs it on the CPU for the tests.

use serde::{Deserialize, Serialize};

use crate::check::{self, Types};

mod attention;
mod conv;
mod ew;
mod gate;
mod gemm;
mod pool;
mod quant;
mod rows;

pub use attention::{ATTENTION_HEAD_DIMS, AttentionStep, Rows, attention_takes};
pub use conv::{ConvStep, Tuned};
pub use ew::{EwStep, ZeroStep};
pub use gate::{GATE_MAX_CHANNELS, GATE_MAX_HIDDEN, GateStep};
pub use gemm::GemmStep;
pub use pool::{GlobalAvgPoolStep, PoolStep};
pub use quant::{EightBitKernel, OwnTile, OwnWidth, Quant, QuantFormat};
pub use rows::{LayerNormStep, LrnStep, RowMeanStep, SoftmaxStep};

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
    /// The frames, f32, in the model's input layout, or channels-last where the CPU engine
    /// gives a channels-first model's frames so (`lower::Frames`).
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

/// What each kind of step says about itself: one module per kind implements it. Every item
/// but `is_wide` and `check` must be written, so a new kind that lacks one does not compile,
/// and the compiler lists what is missing.
pub trait StepKind {
    /// A one-line summary, for profiles.
    fn describe(&self) -> String;

    /// The elements it may touch in each buffer it reads or writes, as its sizes say, empty
    /// operands included (`Step::spans` drops them).
    fn spans(&self) -> Vec<Span>;

    /// The elements it writes, as its sizes say; a strided output may leave elements inside
    /// this span untouched.
    fn written(&self) -> Span;

    /// Whether it writes every element of `written`.
    fn writes_all(&self) -> bool;

    /// Every buffer it reads or writes.
    fn locs_mut(&mut self) -> Vec<&mut Loc>;

    /// Whether its sizes fit what its kernel or library call takes: positive where they
    /// divide or shape a descriptor, within 32 bits where the kernels take `int`, ranks
    /// within `MAX_RANK`.
    fn sizes_fit(&self) -> bool;

    /// Whether it reads and writes each buffer in the type that buffer holds
    /// (`check::Types`).
    fn types_fit(&self, types: &Types) -> bool;

    /// Whether it computes in f32 in an fp16 plan: a step of a node kept in f32, which reads
    /// and writes the f32 arena (`Loc::Wide`) and f32 weights.
    fn is_wide(&self) -> bool {
        matches!(self.written().loc, Loc::Wide(_))
    }

    /// Its sizes, then its types (`check::check_plan` then checks its spans); a kind with a
    /// rule of its own checks it first.
    fn check(&self, types: &Types) -> Result<(), String> {
        check::sizes_and_types(self, types)
    }
}

/// One kernel launch or library call of a plan. An engine file stores a step as
/// `{"Kind": {fields}}`: the variant names and the kinds' fields are its format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Step {
    /// See `EwStep`.
    Ew(EwStep),
    /// See `ZeroStep`.
    Zero(ZeroStep),
    /// See `ConvStep`.
    Conv(ConvStep),
    /// See `GemmStep`.
    Gemm(GemmStep),
    /// See `PoolStep`.
    Pool(PoolStep),
    /// See `GlobalAvgPoolStep`.
    GlobalAvgPool(GlobalAvgPoolStep),
    /// See `SoftmaxStep`.
    Softmax(SoftmaxStep),
    /// See `LayerNormStep`.
    LayerNorm(LayerNormStep),
    /// See `RowMeanStep`.
    RowMean(RowMeanStep),
    /// See `AttentionStep`.
    Attention(AttentionStep),
    /// See `LrnStep`.
    Lrn(LrnStep),
    /// See `GateStep`.
    Gate(GateStep),
}

/// `$body` with `$s` bound to the step of whatever kind `$step` holds: the one list of kinds
/// besides `Step` itself, so that a new kind is added in two places the compiler points to.
#[macro_export]
macro_rules! with_step {
    ($step:expr, $s:ident => $body:expr) => {
        match $step {
            $crate::plan::Step::Ew($s) => $body,
            $crate::plan::Step::Zero($s) => $body,
            $crate::plan::Step::Conv($s) => $body,
            $crate::plan::Step::Gemm($s) => $body,
            $crate::plan::Step::Pool($s) => $body,
            $crate::plan::Step::GlobalAvgPool($s) => $body,
            $crate::plan::Step::Softmax($s) => $body,
            $crate::plan::Step::LayerNorm($s) => $body,
            $crate::plan::Step::RowMean($s) => $body,
            $crate::plan::Step::Attention($s) => $body,
            $crate::plan::Step::Lrn($s) => $body,
            $crate::plan::Step::Gate($s) => $body,
        }
    };
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
/// A quantized step's format in its description.
fn quant_note(quant: Option<Quant>) -> String {
    quant.map_or(String::new(), |q| format!(" {}", q.format))
}

/// The rules of a quantized product or convolution: it computes in the plan's type (a node
/// kept in f32 is not rounded to 8 bits), its input's scale is a finite number, and its
/// weights' scales are a constant in f32.
fn check_quant(step: &impl StepKind, quant: Option<Quant>, t: &Types) -> Result<(), String> {
    let Some(q) = quant else {
        return Ok(());
    };
    if step.is_wide() {
        return Err("quantized, but kept in f32".into());
    }
    if !(q.x_scale.is_finite() && q.x_scale >= 0.0) {
        return Err(format!("an input scale of {}", q.x_scale));
    }
    if !matches!(q.w_scales, Loc::Weight { .. }) || !(t.plain() || (t.is_f32)(q.w_scales)) {
        return Err("weight scales that are not an f32 constant".into());
    }
    Ok(())
}

/// The weights that `plans`' 8-bit steps read as their per-channel scales: f32 constants
/// in every engine, whatever the plans' type (`weight_type` says the rest).
pub fn scale_weights(plans: &[Plan]) -> Vec<usize> {
    let mut scales: Vec<usize> = (plans.iter().flat_map(|p| &p.steps))
        .filter_map(|s| match s.quant()?.w_scales {
            Loc::Weight { index, .. } => Some(index),
            _ => None,
        })
        .collect();
    scales.sort_unstable();
    scales.dedup();
    scales
}

impl Step {
    /// How a product or convolution is quantized, if it is.
    pub fn quant(&self) -> Option<Quant> {
        match self {
            Step::Gemm(g) => g.quant,
            Step::Conv(c) => c.quant,
            _ => None,
        }
    }

    /// See `StepKind::is_wide`.
    pub fn is_wide(&self) -> bool {
        with_step!(self, s => s.is_wide())
    }

    /// A one-line summary, for profiles.
    pub fn describe(&self) -> String {
        with_step!(self, s => s.describe())
    }

    /// The elements the step may touch in each buffer it reads or writes, as its sizes say:
    /// what an engine file is checked against before anything runs.
    pub fn spans(&self) -> Vec<Span> {
        let mut spans = with_step!(self, s => s.spans());
        // An empty operand touches nothing, wherever it points.
        spans.retain(|s| s.end > s.start);
        spans
    }

    /// See `StepKind::written`.
    pub fn written(&self) -> Span {
        with_step!(self, s => s.written())
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
        with_step!(self, s => s.writes_all())
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
        with_step!(self, s => s.locs_mut())
    }

    /// See `StepKind::check`.
    pub fn check(&self, types: &Types) -> Result<(), String> {
        with_step!(self, s => s.check(types))
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
    /// What a dense `dims` tensor at `loc` takes.
    fn dense(loc: Loc, dims: &[usize]) -> Span {
        Span {
            loc,
            start: 0,
            end: dims.iter().map(|&d| d as i128).product(),
        }
    }

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
