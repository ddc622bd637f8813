// SPDX-License-Identifier: MPL-2.0
//! The steps of a plan (`compiler::plan`, lowered in f32) run on the CPU: convolutions and
//! matrix products with constant weights on weights packed once (`panels`: AVX-512, AVX2/FMA
//! or NEON tiles; a grouped convolution's per group), depthwise convolutions in AVX-512 or
//! AVX2 register tiles (`conv`; loops the compiler vectorises elsewhere), products of
//! computed matrices (attention) through the `gemm` crate, and the rest (pooling,
//! element-wise steps) as loops over NHWC channels that the compiler vectorises.
//!
//! Here: the buffers, the dispatch of a step and the small kernels (pooling, rows); `conv`,
//! `product`, `panels` and `elementwise` hold the rest, and `x86_64` and `aarch64` the code
//! in one instruction set's registers that they choose or call.
//!
//! Steps read and write through raw pointers: the plan places several tensors in one arena,
//! and an element-wise step may write where it reads. `Plan` checks (`check_plan` in
//! `plan_runner`) keep every span a step touches inside its buffer before anything runs.

use std::sync::Arc;

use super::vector::{activate as activate_with, fma};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{GemmStep, Loc, Step};

/// f32 values that start on a cache line (64 bytes), as AVX-512's 64-byte loads want (one
/// across two lines costs two): the activation arena, whose buffers the plan places at
/// multiples of 128 values, and packed weights.
#[derive(Clone, Default)]
pub struct Aligned {
    lines: Vec<Line>,
    len: usize,
}

#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([f32; 16]);

impl Aligned {
    pub fn from_slice(values: &[f32]) -> Aligned {
        let mut aligned = Aligned::default();
        aligned.resize(values.len());
        aligned.as_mut_slice().copy_from_slice(values);
        aligned
    }

    /// `len` values, the new ones zero.
    pub fn resize(&mut self, len: usize) {
        self.lines.resize(len.div_ceil(16), Line::default());
        self.len = len;
    }

    pub fn as_slice(&self) -> &[f32] {
        // SAFETY: the lines hold at least `len` initialised f32 values, contiguous.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as `as_slice`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}

/// Where the plan's buffers are for one run.
pub struct Buffers<'a> {
    pub arena: *mut f32,
    pub input: *const f32,
    pub output: *mut f32,
    pub weights: &'a [Arc<Vec<f32>>],
}

impl Buffers<'_> {
    fn at(&self, loc: Loc) -> *const f32 {
        // SAFETY (for every `add` here): the plan was checked to keep each span inside its
        // buffer, so the offset lies within the allocation.
        unsafe {
            match loc {
                Loc::Arena(o) => self.arena.add(o),
                Loc::Input(o) => self.input.add(o),
                Loc::Output(o) => self.output.add(o),
                Loc::Weight { index, offset } => self.weights[index].as_ptr().add(offset),
                Loc::Temp { .. } => unreachable!("checked: plans hold no unplaced buffers"),
                Loc::Wide(_) => unreachable!("checked: f32 plans keep no f32 arena apart"),
            }
        }
    }

    fn at_mut(&self, loc: Loc) -> *mut f32 {
        match loc {
            Loc::Arena(_) | Loc::Output(_) => self.at(loc) as *mut f32,
            _ => unreachable!("checked: steps write the arena and the scores only"),
        }
    }
}

/// Weights of a convolution rearranged once, when the plan is loaded, for its kernel.
pub enum Packed {
    None,
    /// Depthwise: `[kernel positions][channels]`, so that the channel loop reads both
    /// operands in order.
    Depthwise(Arc<Aligned>),
    /// A grouped convolution's, each group's `[kernel positions × input channels of the
    /// group][output channels of the group]` in panels: the right-hand matrix of the
    /// group's product with its unfolded input.
    Groups(Vec<Panels>),
    /// The constant right-hand matrix of a product (a convolution's `[kernel positions ×
    /// input channels][output channels]`) in panels, and the activation of a following step
    /// where the product does it.
    Panels(Panels, Option<Act>),
    /// A product's panels (and fused activation) whose input the step before scales per
    /// channel (that step skipped): the panels are scaled for each frame (`scaled_input`),
    /// and `x`, the unscaled input, read.
    ScaledInput {
        panels: Panels,
        act: Option<Act>,
        x: Loc,
        scale: Loc,
    },
    /// A 3×3 convolution of stride 1 by Winograd's F(2×2, 3×3) (`winograd`): its weights
    /// transformed into 16 matrices of input × output channels, each in panels.
    Winograd(Vec<Panels>),
    /// A product whose output the next step activates in place: done here, on data still
    /// in the cache, and that step skipped.
    Activated(Act),
    /// A product or convolution packed as the inner packing says, whose output rows go
    /// where a later copy would have put them (`concat_in_place`).
    Into(Box<Packed>, Out),
    Skip,
}

/// Where a step writes its output's rows: `stride` values apart from `y`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Out {
    pub y: Loc,
    pub stride: usize,
}

impl Out {
    /// The output `y` as the plan lays it out, rows of `n` values one after the other; or
    /// where `packed` redirects it.
    fn of(packed: &Packed, y: Loc, n: usize) -> (&Packed, Out) {
        match packed {
            Packed::Into(inner, out) => (inner, *out),
            _ => (packed, Out { y, stride: n }),
        }
    }
}

impl Packed {
    /// The packing of the same weights for the same step of another plan (another batch),
    /// sharing the values; without what `fuse_activations`, `fuse_scales` and
    /// `write_into_concats` made of it, for them to decide again there.
    pub fn shared(&self) -> Packed {
        match self {
            Packed::Depthwise(w) => Packed::Depthwise(w.clone()),
            Packed::Groups(w) => Packed::Groups(w.clone()),
            Packed::Panels(panels, _) | Packed::ScaledInput { panels, .. } => {
                Packed::Panels(panels.clone(), None)
            }
            Packed::Winograd(u) => Packed::Winograd(u.clone()),
            Packed::Into(inner, _) => inner.shared(),
            Packed::None | Packed::Activated(_) | Packed::Skip => Packed::None,
        }
    }
}

/// How a step may use threads (`gemm`'s own split over the machine's shared pool, and
/// rows of the direct kernels spread over it), and whether its kernels may use AVX-512.
#[derive(Clone, Copy)]
pub struct Threads {
    pub(super) count: usize,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) avx512: bool,
}

impl Threads {
    /// `count` threads; AVX-512 where `avx512` and the CPU has it.
    pub fn new(count: usize, avx512: bool) -> Threads {
        Threads {
            count,
            avx512: avx512 && avx512_available(),
        }
    }

    /// The same, on the calling thread alone.
    fn single(self) -> Threads {
        Threads { count: 1, ..self }
    }

    fn gemm(self) -> gemm::Parallelism {
        // The team's helpers spin through a frame's run: `gemm` sharing its products over
        // the pool's threads beside them would oversubscribe the cores.
        if Team::active() {
            return gemm::Parallelism::None;
        }
        match self.count {
            0 | 1 => gemm::Parallelism::None,
            n => gemm::Parallelism::Rayon(n),
        }
    }

    /// Runs `f` on each of `0..n`, spread over the threads: the team's, awake, where the
    /// run holds it (`Team::run`), else the pool's.
    fn for_each(self, n: usize, f: impl Fn(usize) + Sync + Send) {
        use rayon::prelude::*;
        match self.count {
            0 | 1 => (0..n).for_each(f),
            t => {
                if Team::for_each(n, &f).is_none() {
                    (0..n)
                        .into_par_iter()
                        .with_min_len(n.div_ceil(t * 4).max(1))
                        .for_each(f)
                }
            }
        }
    }
}

// SAFETY: the buffers are read by every thread of a step and written by each in its own
// rows of the output only (`Threads::for_each` hands out disjoint rows).
unsafe impl Sync for Buffers<'_> {}

/// Defines `$name(args)` to run `$imp::<true>(args)` compiled for AVX2 and FMA where the
/// CPU has them, and `$imp::<FMA>` for the target's baseline elsewhere (aarch64 always has
/// NEON and FMA). Code that threads run (closures) does not inherit the features of the
/// function it is written in, so each row of a parallel kernel dispatches for itself.
macro_rules! wide {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) => $imp:ident) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide($($arg: $ty),*) {
                    $imp::<true>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has the features `wide` is compiled for.
                    return unsafe { wide($($arg),*) };
                }
            }
            $imp::<{ cfg!(target_arch = "aarch64") }>($($arg),*)
        }
    };
}

/// Whether the kernels that have an AVX-512 form may use it: where the CPU has it, unless
/// `TRTCLASSIFY_CPU_AVX512=0` keeps them to AVX2 (to compare the two on one machine).
pub fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::env::var("TRTCLASSIFY_CPU_AVX512").map_or(true, |v| v != "0")
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The bounds of an activation that is a clamp (ReLU, clipping), which the kernels apply to
/// their sums in registers; `None` for the others.
fn clamp_of(act: Act) -> Option<(f32, f32)> {
    match act {
        Act::Relu => Some((0.0, f32::INFINITY)),
        Act::Clip(lo, hi) => Some((lo, hi)),
        _ => None,
    }
}

wide! {
    /// `vector::activate` with FMA where the CPU has it, for kernels that are not generic
    /// over it themselves.
    fn activate(act: Act, v: &mut [f32]) => activate_with
}

// After `wide!`, which they use.
#[cfg(target_arch = "aarch64")]
mod aarch64;
mod concat_in_place;
mod conv;
mod elementwise;
mod panels;
mod pool;
mod product;
mod rows;
mod scaled_input;
mod team;
mod winograd;
#[cfg(target_arch = "x86_64")]
mod x86_64;

#[cfg(test)]
pub(crate) use conv::group_block;

pub use concat_in_place::write_into_concats;
use panels::Panels;
pub use product::fuse_activations;
pub use scaled_input::fuse_scales;
pub use team::Team;

/// The weights of `step` rearranged for its kernel, once, when the plan is loaded: those of
/// convolutions and of products whose weights are constants (up to `PACKED_MAX` values: a
/// larger matrix, a fully connected layer of hundreds of MB, is read once per product
/// anyway, and copying it would double the memory it takes).
pub fn pack(step: &Step, weights: &[Arc<Vec<f32>>]) -> Packed {
    const PACKED_MAX: usize = 1 << 24;
    match step {
        Step::Conv(_) => conv::pack(step, weights),
        &Step::Gemm(GemmStep {
            batch: 1,
            alpha,
            n,
            k,
            w: Loc::Weight { index, offset },
            w_transposed,
            ..
        }) if k * n <= PACKED_MAX => {
            let w = &weights[index][offset..];
            let at = |i, j| {
                if w_transposed {
                    w[j * k + i]
                } else {
                    w[i * n + j]
                }
            };
            Packed::Panels(Panels::pack(k, n, alpha, at), None)
        }
        _ => Packed::None,
    }
}

/// The weight that `packed` holds a rearranged copy of, which `step` then does not read.
pub fn packed_weight(step: &Step, packed: &Packed) -> Option<Loc> {
    match (step, packed) {
        (_, Packed::Into(inner, _)) => packed_weight(step, inner),
        (
            Step::Conv(c),
            Packed::Depthwise(_) | Packed::Groups(_) | Packed::Panels(..) | Packed::Winograd(_),
        ) => Some(c.weight),
        (Step::Gemm(GemmStep { w, .. }), Packed::Panels(..) | Packed::ScaledInput { .. }) => {
            Some(*w)
        }
        _ => None,
    }
}

/// What a run of the plan's steps keeps between them, to use again: the unfolded input of
/// a convolution, panels scaled for a frame.
#[derive(Default)]
pub struct Scratch {
    col: Vec<f32>,
    scaled: Panels,
}

/// Runs `step`, picking the widest SIMD the CPU has for the loops written here.
pub fn run(step: &Step, packed: &Packed, buf: &Buffers, scratch: &mut Scratch, threads: Threads) {
    run_step(step, packed, buf, scratch, threads)
}

/// A kind of step as the CPU runs it. Every kind implements it, in the module of its kernels
/// (`run` dispatches with `with_step!`), so a new kind does not build until it runs here.
/// `run` is `#[inline(always)]` in each: it is compiled inside `wide!`'s AVX2 and FMA function,
/// and a body not inlined there would run at the baseline's speed.
pub(super) trait CpuStep {
    /// Runs the step on `buf`, with its weights as `packed` holds them.
    fn run<const FMA: bool>(
        &self,
        packed: &Packed,
        buf: &Buffers,
        scratch: &mut Scratch,
        threads: Threads,
    );
}

wide! {
    fn run_step(step: &Step, packed: &Packed, buf: &Buffers, scratch: &mut Scratch, threads: Threads) => run_with
}

#[inline(always)]
fn run_with<const FMA: bool>(
    step: &Step,
    packed: &Packed,
    buf: &Buffers,
    scratch: &mut Scratch,
    threads: Threads,
) {
    if matches!(packed, Packed::Skip) {
        return;
    }
    trtclassify_compiler::with_step!(step, s => CpuStep::run::<FMA>(s, packed, buf, scratch, threads))
}
