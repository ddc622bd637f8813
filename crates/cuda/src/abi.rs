// SPDX-License-Identifier: MPL-2.0
//! What the Rust side and the kernels must agree on: the structs passed to the kernels by
//! value, laid out field for field as their C twins, and the ids and constants the kernels
//! use, which `prelude` writes into their source.
//!
//! The layouts are asserted at compile time (size, alignment, every field's offset), as the
//! kernel files assert the C structs' sizes: a field changed on one side only stops a build.
//! Activations and binary operations are known to both sides by name: the lists below give
//! each its id, `act_params` and `binop_id` name them (an unlisted name does not compile),
//! and the generated `act` and `binop` call the kernels' `act_<name>`/`binop_<name>`
//! (runtime/steps/activations.cu; a listed name without its function does not compile).

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use std::mem::{align_of, offset_of, size_of};

use trtclassify_compiler::ir::{Act, BinOp};
use trtclassify_compiler::plan::{DType, MAX_RANK, Strided};

/// The longest row that the one-warp-per-row kernels (`layernorm_warp`, `mean_warp`) hold
/// in registers (`WARP_ROW_MAX` in their source), and `softmax_block` with a block a row.
/// Longer rows take a block each and read the row again for each pass.
pub const WARP_ROW_MAX: usize = 1024;

/// The longest row `softmax_warp` takes a warp for (`SOFTMAX_WARP_MAX` in its source): 8
/// values a lane. Longer rows, up to `WARP_ROW_MAX`, take a block of `ROW_BLOCK` threads
/// (`softmax_block`): a lane's 32 loads of a row of 1000 took 8.9 µs where a block's 4 take
/// 1.8 (docs/benchmarks.md, "the scores' softmax").
pub const SOFTMAX_WARP_MAX: usize = 256;

/// The threads of the kernels that take a block a row (`ROW_BLOCK` in their source).
pub const ROW_BLOCK: usize = 256;

const _: () = assert!(SOFTMAX_WARP_MAX.is_multiple_of(32) && SOFTMAX_WARP_MAX <= WARP_ROW_MAX);
const _: () = assert!(ROW_BLOCK.is_multiple_of(32) && WARP_ROW_MAX.is_multiple_of(ROW_BLOCK));

/// The most source pixels of a row one block of `preprocess_rows` converts and keeps
/// (`PRE_SPAN` in its source).
pub const PRE_SPAN: usize = 2048;

/// The rows (output pixels) a block of the own int8 kernel computes, and its threads
/// (`C8_ROWS`, `C8_THREADS` in quant.cu).
pub const OWN_ROWS: usize = 128;
pub const OWN_THREADS: usize = 256;
/// The own int8 kernel's stages of shared memory: where it reads an int8 input (all copied
/// by cp.async, so that three chunks are in flight while it multiplies one), and where it
/// rounds its input as it reads it (`C8_STAGES_INT8_INPUT`, `C8_STAGES`).
pub const OWN_STAGES_INT8_INPUT: usize = 4;
pub const OWN_STAGES: usize = 2;
/// The own int8 kernel's chunk of the summed dimension: what a stage holds of a row
/// (`C8_CHUNK`).
pub const OWN_CHUNK: usize = 64;
/// The bytes of a row of a chunk of the own int8 kernel in shared memory: 64 and 16 of
/// padding, so that the 8 rows an ldmatrix reads fall on 8 different groups of banks
/// (`C8_STRIDE`).
pub const OWN_STRIDE: usize = OWN_CHUNK + 16;

/// The threads of a block of the own int8 kernel in warps of 64 × 64 outputs
/// (`C8_WIDE_THREADS`: `conv8_wide_*`, four warps whatever their block's shape).
pub const OWN_WIDE_THREADS: usize = 128;

/// The dynamic shared memory of the own int8 kernel in blocks of `rows` × `cols` outputs:
/// a chunk's input and weights in each stage.
pub fn own_shared_bytes(rows: usize, cols: usize, int8_input: bool) -> usize {
    let stages = if int8_input {
        OWN_STAGES_INT8_INPUT
    } else {
        OWN_STAGES
    };
    stages * (rows + cols) * OWN_STRIDE
}

/// The threads of a block of the own stem convolution (`STEM_THREADS` in stem.cu): four
/// warps.
pub const STEM_THREADS: usize = 128;
/// The output pixels of one of its tiles: 8 rows of 16, a warp two rows (`STEM_TILE_H`,
/// `STEM_TILE_W`).
pub const STEM_TILE_H: usize = 8;
pub const STEM_TILE_W: usize = 16;

/// The threads of a block of the own depthwise convolution (`DW_THREADS` in depthwise.cu).
pub const DW_THREADS: usize = 256;
/// The most taps (kernel height × width) it takes: 7×7.
pub const DW_MAX_TAPS: usize = 49;

/// The threads of the squeeze-and-excitation gate's block (`GATE_THREADS` in pool.cu).
pub const GATE_THREADS: usize = 512;

/// The activations the kernels apply, in the order of their ids.
pub const ACTIVATIONS: [&str; 18] = [
    "none",
    "relu",
    "leaky_relu",
    "clip",
    "sigmoid",
    "hard_sigmoid",
    "hard_swish",
    "silu",
    "tanh",
    "erf",
    "gelu",
    "exp",
    "sqrt",
    "neg",
    "abs",
    "reciprocal",
    "softplus",
    "elu",
];

/// The binary operations of the element-wise kernels, in the order of their ids (-1: none).
pub const BINARY_OPS: [&str; 7] = ["add", "sub", "mul", "div", "pow", "max", "min"];

/// The id of `name` in `names`, at compile time where it is called in a `const` block: a
/// name missing from the list stops the build.
const fn id_in(names: &[&str], name: &str) -> i32 {
    let mut i = 0;
    while i < names.len() {
        if same(names[i].as_bytes(), name.as_bytes()) {
            return i as i32;
        }
        i += 1;
    }
    panic!("a name the kernels' lists lack");
}

const fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Elements of the last dimension a thread of the scalar element-wise kernels takes at a
/// time: a short last dimension (an image's 3 channels) whole, so that its row's offsets
/// are worked out once and its loads issued together.
pub const EW_SCALAR_CHUNK: usize = 4;

/// What the kernels' source starts with, generated from the lists and constants here: the
/// sizes (`MAX_RANK`, `EW_SCALAR_CHUNK`, `WARP_ROW_MAX`, `SOFTMAX_WARP_MAX`, `ROW_BLOCK`,
/// `PRE_SPAN`, ...) and ids (`FRAME_*`, `ACT_*`, `BINOP_*`) as
/// defines, and the `act` and `binop` dispatchers, which come after the activations'
/// functions (`dispatchers`).
pub fn prelude() -> String {
    let mut s =
        String::from("// Generated by abi.rs's `prelude`: the Rust side's ids and sizes.\n");
    for (name, value) in [
        ("MAX_RANK", MAX_RANK),
        ("EW_SCALAR_CHUNK", EW_SCALAR_CHUNK),
        ("WARP_ROW_MAX", WARP_ROW_MAX),
        ("SOFTMAX_WARP_MAX", SOFTMAX_WARP_MAX),
        ("ROW_BLOCK", ROW_BLOCK),
        ("PRE_SPAN", PRE_SPAN),
        ("C8_ROWS", OWN_ROWS),
        ("C8_THREADS", OWN_THREADS),
        ("C8_WIDE_THREADS", OWN_WIDE_THREADS),
        ("C8_STAGES_INT8_INPUT", OWN_STAGES_INT8_INPUT),
        ("C8_STAGES", OWN_STAGES),
        ("C8_STRIDE", OWN_STRIDE),
        ("C8_CHUNK", OWN_CHUNK),
        ("STEM_THREADS", STEM_THREADS),
        ("STEM_TILE_H", STEM_TILE_H),
        ("STEM_TILE_W", STEM_TILE_W),
        ("DW_THREADS", DW_THREADS),
        ("GATE_THREADS", GATE_THREADS),
    ] {
        s += &format!("#define {name} {value}\n");
    }
    for layout in FrameLayout::ALL {
        s += &format!("#define FRAME_{} {}\n", layout.name(), layout.id());
    }
    for (id, name) in ACTIVATIONS.iter().enumerate() {
        s += &format!("#define ACT_{} {id}\n", name.to_uppercase());
    }
    for (id, name) in BINARY_OPS.iter().enumerate() {
        s += &format!("#define BINOP_{} {id}\n", name.to_uppercase());
    }
    s
}

/// `act(id, x, p0, p1)` and `binop(id, a, b)`, switching on the ids of `prelude` to the
/// functions of activations.cu.
pub fn dispatchers() -> String {
    let mut s = String::from(
        "// Generated by abi.rs's `dispatchers`.\n\
         __device__ __forceinline__ float act(int id, float x, float p0, float p1) {\n    switch (id) {\n",
    );
    for name in ACTIVATIONS {
        let upper = name.to_uppercase();
        s += &format!("    case ACT_{upper}: return act_{name}(x, p0, p1);\n");
    }
    s += "    }\n    return x;\n}\n\n__device__ __forceinline__ float binop(int id, float a, float b) {\n    switch (id) {\n";
    for name in BINARY_OPS {
        let upper = name.to_uppercase();
        s += &format!("    case BINOP_{upper}: return binop_{name}(a, b);\n");
    }
    s += "    }\n    return a;\n}\n";
    s
}

/// The element-wise kernels' parameters: elementwise.cu's `struct Ew`.
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
    /// What the threads take one at a time: `chunk` elements of the last dimension, `parts`
    /// of them a row (`items` in all), so that a thread works out a row's offsets once for
    /// several elements.
    pub items: i64,
    pub chunk: i32,
    pub parts: i32,
    /// 1 where `n` (so every index) and every offset into the operands fit in an `int`: the
    /// kernels then index in 32 bits.
    pub narrow: i32,
    /// `divider` of each dimension but the last, and of `parts` in the last's place.
    pub div_mul: [u32; MAX_RANK],
    pub div_shift: [u32; MAX_RANK],
}
// SAFETY: plain old data laid out as the kernels' `struct Ew` (asserted below).
unsafe impl DeviceRepr for EwParams {}
const _: () = assert!(
    size_of::<EwParams>() == 272
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
        && offset_of!(EwParams, items) == 200
        && offset_of!(EwParams, chunk) == 208
        && offset_of!(EwParams, parts) == 212
        && offset_of!(EwParams, narrow) == 216
        && offset_of!(EwParams, div_mul) == 220
        && offset_of!(EwParams, div_shift) == 244
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

    /// The same step with `chunk` elements of the last dimension a thread (a row's whole
    /// last dimension where it is shorter): what a launch needs beside `new`'s fields.
    pub fn chunked(mut self, chunk: usize) -> Self {
        if self.rank == 0 {
            // A scalar: one row of one element.
            self.rank = 1;
            self.dims[0] = 1;
        }
        let rank = self.rank as usize;
        let last = self.dims[rank - 1].max(1) as usize;
        let chunk = chunk.clamp(1, last);
        let parts = last.div_ceil(chunk);
        self.chunk = chunk as i32;
        self.parts = parts as i32;
        self.items = self.n / last as i64 * parts as i64;
        for d in 0..rank {
            let by = if d + 1 == rank {
                parts
            } else {
                self.dims[d].max(1) as usize
            };
            (self.div_mul[d], self.div_shift[d]) = divider(by as u32);
        }
        let reach = |strides: &[i64]| -> i64 {
            (0..rank)
                .map(|d| (i64::from(self.dims[d]) - 1).max(0) * strides[d].abs())
                .sum()
        };
        self.narrow = i32::from(
            fits_int(self.n)
                && fits_int(reach(&self.so))
                && fits_int(reach(&self.sa))
                && fits_int(reach(&self.sb)),
        );
        self
    }
}

/// An 8-bit step's shape as a convolution's (a product: 1×1 over one image of 1×`rows`
/// pixels): quant.cu's `struct ConvShape`, in `PatchParams` and `Conv8Params`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ConvShape {
    /// Output pixels: rows of patches, a product's rows.
    pub rows: i64,
    pub h: i32,
    pub w: i32,
    pub c: i32,
    pub oh: i32,
    pub ow: i32,
    pub kh: i32,
    pub kw: i32,
    pub ph: i32,
    pub pw: i32,
    pub sh: i32,
    pub sw: i32,
    pub dh: i32,
    pub dw: i32,
}
const _: () = assert!(
    size_of::<ConvShape>() == 64 && align_of::<ConvShape>() == 8 && offset_of!(ConvShape, dw) == 56
);

/// The 8-bit steps' patches: quant.cu's `struct Patches`, for `quantize_patches`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PatchParams {
    pub shape: ConvShape,
    pub scale: f32,
    pub fp8: i32,
    /// 1 where every index and offset fits in an `int`: 32-bit indexing.
    pub narrow: i32,
    /// 1 where the input's 8 channels of a thread are 16 aligned bytes (fp16): one load.
    pub vec: i32,
    /// `divider` of a row's groups of 8 channels (`kh·kw·c/8`), of `c/8`, `kw`, `ow`, `oh`.
    pub div_mul: [u32; 5],
    pub div_shift: [u32; 5],
}
// SAFETY: plain old data laid out as the kernels' `struct Patches` (asserted below).
unsafe impl DeviceRepr for PatchParams {}
const _: () = assert!(
    size_of::<PatchParams>() == 120
        && align_of::<PatchParams>() == 8
        && offset_of!(PatchParams, scale) == 64
        && offset_of!(PatchParams, narrow) == 72
        && offset_of!(PatchParams, vec) == 76
        && offset_of!(PatchParams, div_mul) == 80
        && offset_of!(PatchParams, div_shift) == 100
);

impl PatchParams {
    /// Fills in the dividers and `narrow` from the sizes; `aligned_fp16`: whether the input
    /// is fp16 and starts on 16 bytes.
    pub fn with_dividers(mut self, aligned_fp16: bool) -> Self {
        let groups = (self.shape.c / 8).max(1) as u32;
        let per_row = (self.shape.kh * self.shape.kw).max(1) as u32 * groups;
        let by = [
            per_row,
            groups,
            self.shape.kw as u32,
            self.shape.ow as u32,
            self.shape.oh as u32,
        ];
        for (j, d) in by.into_iter().enumerate() {
            (self.div_mul[j], self.div_shift[j]) = divider(d);
        }
        let images = self.shape.rows / (i64::from(self.shape.oh) * i64::from(self.shape.ow)).max(1);
        let input =
            images * i64::from(self.shape.h) * i64::from(self.shape.w) * i64::from(self.shape.c);
        self.narrow = i32::from(fits_int(self.shape.rows * i64::from(per_row)) && fits_int(input));
        self.vec = i32::from(aligned_fp16);
        self
    }
}

/// An int8 step run in one kernel: quant.cu's `struct Conv8`, for `conv8_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Conv8Params {
    pub shape: ConvShape,
    /// Output channels.
    pub n: i32,
    /// A row of the weights: `kh·kw·c`.
    pub summed: i32,
    /// The input's scale.
    pub x_scale: f32,
    /// The sums' scale before the channels': the product's alpha times `x_scale`.
    pub scale: f32,
    pub act_id: i32,
    pub p0: f32,
    pub p1: f32,
    /// 1 where the input's 8 channels of a thread are 16 aligned bytes (fp16): one load.
    pub vec: i32,
    /// 1 where the output is written in int8, as the next step rounds its input.
    pub y_int8: i32,
    /// That step's input scale.
    pub y_scale: f32,
    /// Where the output is also written in int8 (by `y_scale`), beside the plan's type: the
    /// copy its readers that take it as their input read (0: none).
    pub y8: u64,
}
// SAFETY: plain old data laid out as the kernels' `struct Conv8` (asserted below).
unsafe impl DeviceRepr for Conv8Params {}
const _: () = assert!(
    size_of::<Conv8Params>() == 112
        && align_of::<Conv8Params>() == 8
        && offset_of!(Conv8Params, n) == 64
        && offset_of!(Conv8Params, x_scale) == 72
        && offset_of!(Conv8Params, vec) == 92
        && offset_of!(Conv8Params, y_scale) == 100
        && offset_of!(Conv8Params, y8) == 104
);

/// The own stem convolution's parameters: stem.cu's `struct StemConv`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StemParams {
    /// The input, NHWC: images, height, width and channels (1 to 4).
    pub n: i32,
    pub h: i32,
    pub w: i32,
    pub c: i32,
    /// Output channels, height and width.
    pub k: i32,
    pub oh: i32,
    pub ow: i32,
    /// Kernel height and width.
    pub r: i32,
    pub s: i32,
    /// Strides (`sw` even) and pads.
    pub sh: i32,
    pub sw: i32,
    pub ph: i32,
    pub pw: i32,
    pub act_id: i32,
    pub p0: f32,
    pub p1: f32,
}
// SAFETY: plain old data laid out as the kernels' `struct StemConv` (asserted below).
unsafe impl DeviceRepr for StemParams {}
const _: () = assert!(
    size_of::<StemParams>() == 64
        && align_of::<StemParams>() == 4
        && offset_of!(StemParams, act_id) == 52
);

impl StemParams {
    /// The output channels a pass of the kernel computes (`stem_conv64` or `stem_conv32`).
    pub fn pass(&self) -> usize {
        if self.k % 64 == 0 { 64 } else { 32 }
    }

    /// The tiles of the output, each a block's turn.
    pub fn tiles(&self) -> usize {
        let (n, oh, ow) = (self.n as usize, self.oh as usize, self.ow as usize);
        n * oh.div_ceil(STEM_TILE_H) * ow.div_ceil(STEM_TILE_W)
    }

    /// A block's dynamic shared memory, as stem.cu's `stem_layout` lays it out: the
    /// weights (steps of 16 of the summed dimension × `k` × 32 bytes), a tile's input (4
    /// channels a pixel, 16-byte aligned) and the stage of a pass's outputs.
    pub fn shared_bytes(&self) -> usize {
        let [r, s, k] = [self.r, self.s, self.k].map(|v| v as usize);
        let [sh, sw] = [self.sh, self.sw].map(|v| v as usize);
        let groups = s.div_ceil(4);
        let weights = r * groups * k * 32;
        let patch_h = (STEM_TILE_H - 1) * sh + r;
        let patch_w = (STEM_TILE_W - 1) * sw + 4 * groups;
        let patch = (patch_h * patch_w * 8).next_multiple_of(16);
        let stage = STEM_TILE_H * STEM_TILE_W * (self.pass() + 8) * 2;
        weights + patch + stage
    }
}

/// The own depthwise convolution's parameters: depthwise.cu's `struct DepthwiseConv`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DepthwiseParams {
    /// The input, NHWC: images, height, width and channels (the output's too).
    pub n: i32,
    pub h: i32,
    pub w: i32,
    pub c: i32,
    /// Output height and width.
    pub oh: i32,
    pub ow: i32,
    /// Kernel height and width.
    pub r: i32,
    pub s: i32,
    /// Strides and pads.
    pub sh: i32,
    pub sw: i32,
    pub ph: i32,
    pub pw: i32,
    /// Channel vectors (16 bytes each) a block takes.
    pub group: i32,
    /// The activation of the output, and its parameters.
    pub act_id: i32,
    pub p0: f32,
    pub p1: f32,
    /// The activation of each input value as it is read (`ConvStep::act_in`).
    pub act_in_id: i32,
    pub q0: f32,
    pub q1: f32,
}
// SAFETY: plain old data laid out as the kernel's `struct DepthwiseConv` (asserted below).
unsafe impl DeviceRepr for DepthwiseParams {}
const _: () = assert!(
    size_of::<DepthwiseParams>() == 76
        && align_of::<DepthwiseParams>() == 4
        && offset_of!(DepthwiseParams, act_id) == 52
        && offset_of!(DepthwiseParams, act_in_id) == 64
);

impl DepthwiseParams {
    /// The channels a block takes.
    pub fn lanes(&self, dtype: DType) -> usize {
        self.group as usize * 16 / dtype.size()
    }

    /// A block's dynamic shared memory: its channels' weights in f32, tap by tap.
    pub fn shared_bytes(&self, dtype: DType) -> usize {
        (self.r * self.s) as usize * self.lanes(dtype) * 4
    }

    /// The blocks along the channels (`blockIdx.y`).
    pub fn channel_blocks(&self, dtype: DType) -> usize {
        self.c as usize / self.lanes(dtype)
    }

    /// The output pixels a block takes at a time.
    pub fn slots(&self) -> usize {
        DW_THREADS / self.group as usize
    }
}

/// The squeeze-and-excitation gate's parameters: pool.cu's `struct Gate`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GateParams {
    /// Images, channels and hidden values.
    pub n: i32,
    pub c: i32,
    pub r: i32,
    /// Runs of 8 weights of the first product after which a run's hidden values repeat:
    /// `r / gcd(r, 8)`.
    pub period: i32,
    /// The hidden values' activation, and its parameters.
    pub act1: i32,
    pub p0: f32,
    pub p1: f32,
    /// The gate's activation, and its parameters.
    pub act2: i32,
    pub q0: f32,
    pub q1: f32,
}
// SAFETY: plain old data laid out as the kernel's `struct Gate` (asserted below).
unsafe impl DeviceRepr for GateParams {}
const _: () = assert!(
    size_of::<GateParams>() == 40
        && align_of::<GateParams>() == 4
        && offset_of!(GateParams, act2) == 28
);

impl GateParams {
    /// A block's dynamic shared memory, in f32: the pooled channels, the hidden values, and
    /// 8 partial sums a thread.
    pub fn shared_bytes(&self) -> usize {
        (self.c as usize + self.r as usize + 8 * GATE_THREADS) * 4
    }
}

/// Whether `v` fits in the kernels' `int`.
fn fits_int(v: i64) -> bool {
    v <= i64::from(i32::MAX)
}

/// The multiplier and shift that divide a 31-bit `n` by `d` without a division instruction:
/// `(umulhi(n, mul) + n) >> shift == n / d` (Granlund and Montgomery, as PyTorch's
/// `IntDivider`); the element-wise kernels' `fast_div`.
pub fn divider(d: u32) -> (u32, u32) {
    let d = u64::from(d.max(1));
    let shift = (0..32).find(|&s| (1u64 << s) >= d).unwrap_or(32);
    let mul = ((1u64 << 32) * ((1u64 << shift) - d)) / d + 1;
    (mul as u32, shift)
}

/// The fused attention kernels' parameters: attention.cu's `struct Attn`.
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

/// The pooling kernels' parameters: pool.cu's `struct Pool`, sixteen ints in the order
/// n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl, pb, pr, max, include_pad.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PoolParams {
    pub v: [i32; 16],
}
// SAFETY: sixteen ints, as the kernels' `struct Pool` (asserted below).
unsafe impl DeviceRepr for PoolParams {}
const _: () = assert!(size_of::<PoolParams>() == 64 && align_of::<PoolParams>() == 4);

/// The preprocessing kernels' parameters: preprocess.cu's `struct Pre`, field for field.
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

/// One frame or crop of a batched preprocessing launch: preprocess.cu's `struct PreJob`.
/// The kernels take an array of them, one per `blockIdx.z`, so a batch's crops go through
/// one launch of each pass instead of two launches a crop.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PreJob {
    /// What to make of the frame.
    pub pre: Pre,
    /// The frame's device address.
    pub src: u64,
    /// The first pass's rows of this job: a device address in the runtime's rows buffer.
    pub rows: u64,
    /// Its frame of the model input: a device address.
    pub out: u64,
    /// Destination columns one block of the first pass filters (`columns_per_block`).
    pub cols: i32,
    /// Padding to the struct's 8-byte alignment.
    pub pad: i32,
}
// SAFETY: plain old data laid out as the kernel's `struct PreJob` (asserted below); all
// zeros is a valid value.
unsafe impl DeviceRepr for PreJob {}
unsafe impl ValidAsZeroBits for PreJob {}
const _: () = assert!(
    size_of::<PreJob>() == 248
        && align_of::<PreJob>() == 8
        && offset_of!(PreJob, src) == 216
        && offset_of!(PreJob, rows) == 224
        && offset_of!(PreJob, out) == 232
        && offset_of!(PreJob, cols) == 240
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
    /// Every layout, in the order of their ids.
    pub const ALL: [FrameLayout; 4] = [
        FrameLayout::Packed,
        FrameLayout::Nv12,
        FrameLayout::I420,
        FrameLayout::P010,
    ];

    /// Its name in the kernels (`FRAME_<name>`).
    pub fn name(self) -> &'static str {
        match self {
            FrameLayout::Packed => "PACKED",
            FrameLayout::Nv12 => "NV12",
            FrameLayout::I420 => "I420",
            FrameLayout::P010 => "P010",
        }
    }

    /// The kernels' id: `format` in preprocess.cu's `struct Pre`.
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

/// The kernel id of a binary operator (`binop` in the kernels), by its name in `BINARY_OPS`.
pub fn binop_id(op: BinOp) -> i32 {
    match op {
        BinOp::Add => const { id_in(&BINARY_OPS, "add") },
        BinOp::Sub => const { id_in(&BINARY_OPS, "sub") },
        BinOp::Mul => const { id_in(&BINARY_OPS, "mul") },
        BinOp::Div => const { id_in(&BINARY_OPS, "div") },
        BinOp::Pow => const { id_in(&BINARY_OPS, "pow") },
        BinOp::Max => const { id_in(&BINARY_OPS, "max") },
        BinOp::Min => const { id_in(&BINARY_OPS, "min") },
    }
}

/// The kernel id and parameters of an activation (`act` in the kernels), by its name in
/// `ACTIVATIONS`.
pub fn act_params(act: Act, dtype: DType) -> (i32, f32, f32) {
    let (id, p0, p1) = match act {
        Act::None => (const { id_in(&ACTIVATIONS, "none") }, 0.0, 0.0),
        Act::Relu => (const { id_in(&ACTIVATIONS, "relu") }, 0.0, 0.0),
        Act::LeakyRelu(a) => (const { id_in(&ACTIVATIONS, "leaky_relu") }, a, 0.0),
        // A positive floor keeps a divisor from 0 (`x / max(‖x‖, 1e-12)`, Swin v2's cosine
        // attention): below fp16's smallest value it would round to 0 and give 0/0, so it
        // stays the smallest positive fp16 instead.
        Act::Clip(lo, hi) if dtype == DType::F16 && lo > 0.0 && lo < F16_SMALLEST => {
            (const { id_in(&ACTIVATIONS, "clip") }, F16_SMALLEST, hi)
        }
        Act::Clip(lo, hi) => (const { id_in(&ACTIVATIONS, "clip") }, lo, hi),
        Act::Sigmoid => (const { id_in(&ACTIVATIONS, "sigmoid") }, 0.0, 0.0),
        Act::HardSigmoid(a, b) => (const { id_in(&ACTIVATIONS, "hard_sigmoid") }, a, b),
        Act::HardSwish => (const { id_in(&ACTIVATIONS, "hard_swish") }, 0.0, 0.0),
        Act::Silu => (const { id_in(&ACTIVATIONS, "silu") }, 0.0, 0.0),
        Act::Tanh => (const { id_in(&ACTIVATIONS, "tanh") }, 0.0, 0.0),
        Act::Erf => (const { id_in(&ACTIVATIONS, "erf") }, 0.0, 0.0),
        Act::Gelu => (const { id_in(&ACTIVATIONS, "gelu") }, 0.0, 0.0),
        Act::Exp => (const { id_in(&ACTIVATIONS, "exp") }, 0.0, 0.0),
        Act::Sqrt => (const { id_in(&ACTIVATIONS, "sqrt") }, 0.0, 0.0),
        Act::Neg => (const { id_in(&ACTIVATIONS, "neg") }, 0.0, 0.0),
        Act::Abs => (const { id_in(&ACTIVATIONS, "abs") }, 0.0, 0.0),
        Act::Reciprocal => (const { id_in(&ACTIVATIONS, "reciprocal") }, 0.0, 0.0),
        Act::Softplus => (const { id_in(&ACTIVATIONS, "softplus") }, 0.0, 0.0),
        Act::Elu(a) => (const { id_in(&ACTIVATIONS, "elu") }, a, 0.0),
    };
    (id, p0, p1)
}

/// 2⁻²⁴, the smallest positive (subnormal) fp16 value.
const F16_SMALLEST: f32 = 5.960_464_5e-8;
