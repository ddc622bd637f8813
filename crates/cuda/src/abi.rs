// SPDX-License-Identifier: MPL-2.0
//! What the Rust side and kernels.cu must agree on: the structs passed to the kernels by
//! value, laid out field for field as their C twins, and the ids the kernels switch on.
//!
//! The layouts are asserted at compile time (size, alignment, every field's offset), as
//! kernels.cu asserts the C structs' sizes: a field changed on one side only stops a build.
//! Every id comes from a `match` here, spelled out, so that reordering a Rust enum never
//! changes what a kernel computes.

use cudarc::driver::DeviceRepr;
use std::mem::{align_of, offset_of, size_of};

use trtclassify_compiler::ir::{Act, BinOp};
use trtclassify_compiler::plan::{DType, MAX_RANK, Strided};

/// The longest row that the one-warp-per-row kernels (`softmax_warp`, `layernorm_warp`) hold
/// in registers: `WARP_ROW_MAX` in kernels.cu. Longer rows take a block each.
pub const WARP_ROW_MAX: usize = 1024;

/// The most source pixels of a row one block of `preprocess_rows` converts and keeps:
/// `PRE_SPAN` in kernels.cu.
pub const PRE_SPAN: usize = 2048;

// `#define MAX_RANK 6` in kernels.cu sizes the arrays of `struct Ew`.
const _: () = assert!(MAX_RANK == 6);

/// The element-wise kernels' parameters: kernels.cu's `struct Ew`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct EwParams {
    pub n: i64,
    pub rank: i32,
    /// `binop_id`, or -1 for none.
    pub op: i32,
    /// The first of `act_params`.
    pub act: i32,
    pub p0: f32,
    pub p1: f32,
    pub dims: [i32; MAX_RANK],
    pub so: [i64; MAX_RANK],
    pub sa: [i64; MAX_RANK],
    pub sb: [i64; MAX_RANK],
}
// SAFETY: plain old data laid out as the kernels' `struct Ew` (asserted below).
unsafe impl DeviceRepr for EwParams {}
const _: () = assert!(
    size_of::<EwParams>() == 200
        && align_of::<EwParams>() == 8
        && offset_of!(EwParams, n) == 0
        && offset_of!(EwParams, rank) == 8
        && offset_of!(EwParams, op) == 12
        && offset_of!(EwParams, act) == 16
        && offset_of!(EwParams, p0) == 20
        && offset_of!(EwParams, p1) == 24
        && offset_of!(EwParams, dims) == 28
        && offset_of!(EwParams, so) == 56
        && offset_of!(EwParams, sa) == 104
        && offset_of!(EwParams, sb) == 152
);

impl EwParams {
    /// The parameters of `out = act(op(a, b))` (or `act(a)`) over `dims`, in `dtype`.
    pub fn new(
        op: Option<BinOp>,
        act: Act,
        dtype: DType,
        dims: &[usize],
        out: &Strided,
        a: &Strided,
        b: Option<&Strided>,
    ) -> Self {
        let (id, p0, p1) = act_params(act, dtype);
        let mut p = EwParams {
            n: dims.iter().product::<usize>() as i64,
            rank: dims.len() as i32,
            op: op.map_or(-1, binop_id),
            act: id,
            p0,
            p1,
            ..Default::default()
        };
        for (j, &d) in dims.iter().enumerate() {
            p.dims[j] = d as i32;
            p.so[j] = out.strides[j];
            p.sa[j] = a.strides[j];
            p.sb[j] = b.map_or(0, |b| b.strides[j]);
        }
        p
    }
}

/// The fused attention kernels' parameters: kernels.cu's `struct Attn`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnParams {
    pub batch: [i32; 3],
    pub queries: i32,
    pub keys: i32,
    pub dk: i32,
    pub dv: i32,
    /// 1 where every row of q, k and v starts 16-byte aligned.
    pub vec: i32,
    pub alpha: f32,
    pub pad: i32,
    /// Strides of the three batch axes, then of the rows, per operand.
    pub q: [i64; 4],
    pub k: [i64; 4],
    pub v: [i64; 4],
    pub bias: [i64; 4],
    pub y: [i64; 4],
}
// SAFETY: plain old data laid out as the kernels' `struct Attn` (asserted below).
unsafe impl DeviceRepr for AttnParams {}
const _: () = assert!(
    size_of::<AttnParams>() == 200
        && align_of::<AttnParams>() == 8
        && offset_of!(AttnParams, batch) == 0
        && offset_of!(AttnParams, queries) == 12
        && offset_of!(AttnParams, dv) == 24
        && offset_of!(AttnParams, vec) == 28
        && offset_of!(AttnParams, alpha) == 32
        && offset_of!(AttnParams, q) == 40
        && offset_of!(AttnParams, bias) == 136
        && offset_of!(AttnParams, y) == 168
);

/// The pooling kernels' parameters: kernels.cu's `struct Pool`, sixteen ints in the order
/// n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl, pb, pr, max, include_pad.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PoolParams {
    pub v: [i32; 16],
}
// SAFETY: sixteen ints, as the kernels' `struct Pool` (asserted below).
unsafe impl DeviceRepr for PoolParams {}
const _: () = assert!(size_of::<PoolParams>() == 64 && align_of::<PoolParams>() == 4);

/// The preprocessing kernels' parameters: kernels.cu's `struct Pre`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pre {
    /// `FrameLayout::id`.
    pub format: i32,
    /// Bytes per pixel of a packed format.
    pub pixel_stride: i32,
    /// Byte offsets of R, G and B in a packed pixel.
    pub off: [i32; 3],
    /// Byte offset of each plane from the frame's address.
    pub plane: [i64; 3],
    /// Bytes between rows, per plane.
    pub stride: [i32; 3],
    /// The frame's width and height.
    pub size: [i32; 2],
    /// Whether chroma is cosited horizontally and vertically.
    pub cosited: [i32; 2],
    /// The area read: x, y, width, height.
    pub crop: [i32; 4],
    /// Where it lands in the model input: x, y, width, height.
    pub dst: [i32; 4],
    /// The model input's width.
    pub out_w: i32,
    /// The model input's height.
    pub out_h: i32,
    /// 1 for a planar (NCHW) model input.
    pub nchw: i32,
    /// 1 for blue, green, red channel order.
    pub bgr: i32,
    /// YUV to RGB: three rows of (y, u, v, offset).
    pub m: [f32; 12],
    /// Multiplies 0..=255 pixel values.
    pub scale: f32,
    /// Per-channel mean, subtracted after `scale`.
    pub mean: [f32; 3],
    /// Per-channel standard deviation, divided by.
    pub std: [f32; 3],
    /// The letterbox border's normalised value per channel.
    pub border: [f32; 3],
}
// SAFETY: plain old data laid out as the kernel's `struct Pre` (asserted below).
unsafe impl DeviceRepr for Pre {}
const _: () = assert!(
    size_of::<Pre>() == 216
        && align_of::<Pre>() == 8
        && offset_of!(Pre, format) == 0
        && offset_of!(Pre, pixel_stride) == 4
        && offset_of!(Pre, off) == 8
        && offset_of!(Pre, plane) == 24
        && offset_of!(Pre, stride) == 48
        && offset_of!(Pre, size) == 60
        && offset_of!(Pre, cosited) == 68
        && offset_of!(Pre, crop) == 76
        && offset_of!(Pre, dst) == 92
        && offset_of!(Pre, out_w) == 108
        && offset_of!(Pre, out_h) == 112
        && offset_of!(Pre, nchw) == 116
        && offset_of!(Pre, bgr) == 120
        && offset_of!(Pre, m) == 124
        && offset_of!(Pre, scale) == 172
        && offset_of!(Pre, mean) == 176
        && offset_of!(Pre, std) == 188
        && offset_of!(Pre, border) == 200
);

/// How a frame's pixels lie in memory, as the preprocessing kernels read them
/// (`Pre::format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameLayout {
    /// One plane of packed RGB-like pixels.
    Packed,
    /// Y, then interleaved UV at half size.
    Nv12,
    /// Y, U and V planes, chroma at half size.
    I420,
    /// NV12's layout with 16-bit samples.
    P010,
}

impl FrameLayout {
    /// The kernels' id: `format` in kernels.cu's `struct Pre`.
    pub fn id(self) -> i32 {
        match self {
            FrameLayout::Packed => 0,
            FrameLayout::Nv12 => 1,
            FrameLayout::I420 => 2,
            FrameLayout::P010 => 3,
        }
    }

    /// The layout of a kernel id, `None` for an id the kernels do not know.
    pub fn from_id(id: i32) -> Option<Self> {
        match id {
            0 => Some(FrameLayout::Packed),
            1 => Some(FrameLayout::Nv12),
            2 => Some(FrameLayout::I420),
            3 => Some(FrameLayout::P010),
            _ => None,
        }
    }
}

/// The kernel id of a binary operator (`binop` in kernels.cu), spelled out so that the
/// order of `BinOp` in ir.rs may change.
pub fn binop_id(op: BinOp) -> i32 {
    match op {
        BinOp::Add => 0,
        BinOp::Sub => 1,
        BinOp::Mul => 2,
        BinOp::Div => 3,
        BinOp::Pow => 4,
        BinOp::Max => 5,
        BinOp::Min => 6,
    }
}

/// The kernel id and parameters of an activation (`act` in kernels.cu).
pub fn act_params(act: Act, dtype: DType) -> (i32, f32, f32) {
    match act {
        Act::None => (0, 0.0, 0.0),
        Act::Relu => (1, 0.0, 0.0),
        Act::LeakyRelu(a) => (2, a, 0.0),
        // A positive floor keeps a divisor from 0 (`x / max(‖x‖, 1e-12)`, Swin v2's cosine
        // attention): below fp16's smallest value it would round to 0 and give 0/0, so it
        // stays the smallest positive fp16 instead.
        Act::Clip(lo, hi) if dtype == DType::F16 && lo > 0.0 && lo < F16_SMALLEST => {
            (3, F16_SMALLEST, hi)
        }
        Act::Clip(lo, hi) => (3, lo, hi),
        Act::Sigmoid => (4, 0.0, 0.0),
        Act::HardSigmoid(a, b) => (5, a, b),
        Act::HardSwish => (6, 0.0, 0.0),
        Act::Silu => (7, 0.0, 0.0),
        Act::Tanh => (8, 0.0, 0.0),
        Act::Erf => (9, 0.0, 0.0),
        Act::Gelu => (10, 0.0, 0.0),
        Act::Exp => (11, 0.0, 0.0),
        Act::Sqrt => (12, 0.0, 0.0),
        Act::Neg => (13, 0.0, 0.0),
        Act::Abs => (14, 0.0, 0.0),
        Act::Reciprocal => (15, 0.0, 0.0),
        Act::Softplus => (16, 0.0, 0.0),
        Act::Elu(a) => (17, a, 0.0),
    }
}

/// 2⁻²⁴, the smallest positive (subnormal) fp16 value.
const F16_SMALLEST: f32 = 5.960_464_5e-8;
