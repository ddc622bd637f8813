// SPDX-License-Identifier: MPL-2.0
//! 3×3 convolutions of stride 1 by Winograd's minimal filtering, F(2×2, 3×3): each 2×2 block
//! of outputs (a tile) comes from its 4×4 patch of input, transformed (`Bᵀ d B`), multiplied
//! channel by channel with the weights transformed once (`G g Gᵀ`), and transformed back
//! (`Aᵀ m A`). The products are 16 matrix products, one for each of the 16 positions of the
//! transformed patch: tiles × input channels times input channels × output channels, on the
//! same packed panels as every other product (`panels`). They take 16 multiplications for 4
//! outputs where the direct convolution takes 36, 2.25 times fewer.
//!
//! onnxruntime's MLAS computes these convolutions directly: at one thread on AVX2, both
//! implementations ran ResNet-50's 3×3 layers at the FMA units' peak, and ours could go no
//! faster without doing less arithmetic.
//!
//! The transforms only add, subtract and halve, so F(2×2, 3×3) loses little precision in
//! f32 (a few units in the last place of each sum); the larger tiles (F(4×4, 3×3)) save more
//! multiplications but lose more. Layers of few pixels are left to the direct convolution:
//! a 7×7 output in 2×2 tiles computes 64 outputs for 49, and its products have few rows for
//! weights 16/9 the size.

use std::cell::RefCell;

use super::panels::{Panels, run_panels};
use super::product::{Product, Weights};
use super::{Aligned, Buffers, Out, Threads, activate, clamp_of};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::ConvStep;

/// The channels a transform handles at once: a register of AVX2 (two of NEON).
const LANES: usize = 8;
/// Output pixels a convolution must have to take this path (see the module's notes).
const PIXELS_MIN: usize = 64;

/// Whether `c` is computed by Winograd's F(2×2, 3×3) on the CPU: a 3×3 kernel of stride 1,
/// no dilation, one group, channels in whole transform lanes (and few enough for the zeros
/// of `ZEROS`), enough of them for the products, and enough pixels.
/// `TRTCLASSIFY_CPU_WINOGRAD=0` turns it off (to compare the two paths on one machine).
pub(super) fn fits(c: &ConvStep) -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let enabled = *ENABLED
        .get_or_init(|| std::env::var("TRTCLASSIFY_CPU_WINOGRAD").map_or(true, |v| v != "0"));
    enabled
        && c.kernel == [3, 3]
        && c.strides == [1, 1]
        && c.dilations == [1, 1]
        && c.group == 1
        && c.c.is_multiple_of(LANES)
        && c.k.is_multiple_of(LANES)
        && (32..=super::conv::ZEROS.len()).contains(&c.c)
        && c.k >= 32
        && c.oh * c.ow >= PIXELS_MIN
}

/// The weights of a convolution that `fits`, `krsc` (`[k][3][3][c]`), transformed: for each
/// of the 16 positions, the `c × k` matrix `(G g Gᵀ)[position]` in panels.
pub(super) fn pack(c: &ConvStep, krsc: &[f32]) -> Vec<Panels> {
    let mut u = vec![0.0f32; 16 * c.k * c.c];
    for k in 0..c.k {
        for ch in 0..c.c {
            let g: [[f32; 3]; 3] = std::array::from_fn(|r| {
                std::array::from_fn(|s| krsc[(k * 9 + r * 3 + s) * c.c + ch])
            });
            // Down the kernel's columns, then along the rows.
            let cols: [[f32; 4]; 3] = std::array::from_fn(|s| g_t([g[0][s], g[1][s], g[2][s]]));
            let rows: [[f32; 4]; 4] =
                std::array::from_fn(|i| g_t([cols[0][i], cols[1][i], cols[2][i]]));
            for (i, row) in rows.iter().enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    u[((i * 4 + j) * c.k + k) * c.c + ch] = v;
                }
            }
        }
    }
    (0..16)
        .map(|xi| {
            let u = &u[xi * c.k * c.c..(xi + 1) * c.k * c.c];
            Panels::pack(c.c, c.k, 1.0, |i, j| u[j * c.c + i])
        })
        .collect()
}

thread_local! {
    /// A block's transformed input and products, kept between calls on each thread.
    static SCRATCH: RefCell<Aligned> = RefCell::new(Aligned::default());
}

/// The convolution `c` (bias, residual, activation and all) on the weights `u` (`pack`),
/// its output's pixels at `out`.
pub(super) fn conv(buf: &Buffers, c: &ConvStep, u: &[Panels], out: Out, threads: Threads) {
    // A residual is the output's shape (`concat_in_place` redirects none).
    debug_assert!(c.residual.is_none() || out.stride == c.k);
    let tiles = c.oh.div_ceil(2) * c.ow.div_ceil(2);
    // Blocks of tiles whose transformed input and products (16 × tiles × (c + k) values)
    // stay near 512 KB, in the L2 cache, but of at least 64 tiles: the products' weights
    // are read again for each block, and need rows enough to be worth it.
    let most = ((1 << 17) / (16 * (c.c + c.k))).max(64);
    let blocks = tiles.div_ceil(most).max(threads.count.min(tiles));
    let per = tiles.div_ceil(blocks);
    let blocks = tiles.div_ceil(per);
    let one = threads.single();
    for n in 0..c.n {
        let run = |b: usize| {
            let start = b * per;
            let block = Block {
                c,
                out,
                n,
                tiles: start..(start + per).min(tiles),
            };
            SCRATCH.with_borrow_mut(|scratch| block.run(buf, u, scratch, one));
        };
        threads.for_each(blocks, run);
    }
}

/// A run of tiles of image `n`, numbered along the rows of tiles.
struct Block<'a> {
    c: &'a ConvStep,
    out: Out,
    n: usize,
    tiles: std::ops::Range<usize>,
}

impl Block<'_> {
    fn run(&self, buf: &Buffers, u: &[Panels], scratch: &mut Aligned, threads: Threads) {
        let c = self.c;
        let t = self.tiles.len();
        scratch.resize(16 * t * (c.c + c.k));
        let (v, m) = scratch.as_mut_slice().split_at_mut(16 * t * c.c);
        self.transform_input(buf, v);
        for (xi, u) in u.iter().enumerate() {
            let product = Product {
                rows: t,
                n: c.k,
                k: c.c,
                x: v[xi * t * c.c..].as_ptr(),
                x_stride: c.c,
                taps: None,
                w: Weights::Panels(u),
                y: m[xi * t * c.k..].as_mut_ptr(),
                y_stride: c.k,
                alpha: 1.0,
                bias: None,
                residual: None,
                act: Act::None,
            };
            run_panels(&product, u, 0..c.k, threads);
        }
        self.transform_output(buf, m);
    }

    /// `Bᵀ d B` of each tile's 4×4 input patch (zeros outside the image) into `v`: for
    /// position `xi`, the tiles' rows of channels at `xi × tiles × c`.
    fn transform_input(&self, buf: &Buffers, v: &mut [f32]) {
        let c = self.c;
        let x = buf.at(c.x);
        let tw = c.ow.div_ceil(2);
        let at = |iy: usize, ix: usize| {
            let pixel = (self.n * c.h + iy) * c.w + ix;
            // SAFETY: a pixel inside the image, in the checked input span.
            unsafe { x.add(pixel * c.c) }
        };
        for (i, tile) in self.tiles.clone().enumerate() {
            let (ty, tx) = (tile / tw, tile % tw);
            let patch: [[*const f32; 4]; 4] = std::array::from_fn(|r| {
                std::array::from_fn(|s| {
                    let iy = (2 * ty + r).checked_sub(c.pads[0]).filter(|&y| y < c.h);
                    let ix = (2 * tx + s).checked_sub(c.pads[1]).filter(|&x| x < c.w);
                    match (iy, ix) {
                        (Some(iy), Some(ix)) => at(iy, ix),
                        _ => super::conv::ZEROS.as_ptr(),
                    }
                })
            });
            let stride = self.tiles.len() * c.c;
            // Each pointer of the patch has `c.c` values (`ZEROS` at least as many: `fits`);
            // `v` holds 16 positions of `tiles × c` values.
            input_tile(&patch, c.c, v[i * c.c..].as_mut_ptr(), stride);
        }
    }

    /// `Aᵀ m A` of each tile's products into its 2×2 outputs (those inside the output), with
    /// bias, residual and activation.
    fn transform_output(&self, buf: &Buffers, m: &[f32]) {
        let c = self.c;
        let (y, bias) = (buf.at_mut(self.out.y), buf.at(c.bias));
        let residual = c.residual.map(|z| buf.at(z));
        let tw = c.ow.div_ceil(2);
        let clamp = match c.act {
            Act::None => Some((f32::NEG_INFINITY, f32::INFINITY)),
            act => clamp_of(act),
        };
        for (i, tile) in self.tiles.clone().enumerate() {
            let (ty, tx) = (tile / tw, tile % tw);
            let mut pixels = [None; 4];
            for (p, pixel) in pixels.iter_mut().enumerate() {
                let (oy, ox) = (2 * ty + p / 2, 2 * tx + p % 2);
                if oy < c.oh && ox < c.ow {
                    *pixel = Some(((self.n * c.oh + oy) * c.ow + ox) * self.out.stride);
                }
            }
            let out = Outputs {
                y,
                bias,
                residual,
                pixels,
                clamp,
            };
            // `m` holds 16 positions of `tiles × k` values; the pixels' outputs and
            // residuals lie in the checked spans; this block's tiles are its own.
            output_tile(&m[i * c.k..], self.tiles.len() * c.k, c.k, &out);
            if clamp.is_none() {
                for o in pixels.into_iter().flatten() {
                    // SAFETY: the pixel's outputs, written above.
                    activate(c.act, unsafe {
                        std::slice::from_raw_parts_mut(y.add(o), c.k)
                    });
                }
            }
        }
    }
}

/// Where a tile's outputs go.
struct Outputs {
    y: *mut f32,
    bias: *const f32,
    residual: Option<*const f32>,
    /// The offset of each of the tile's 2×2 outputs (row by row) inside the output, and
    /// inside the residual (the same where there is one).
    pixels: [Option<usize>; 4],
    /// The activation where it is a clamp (none: no clamp; else applied afterwards).
    clamp: Option<(f32, f32)>,
}

type Lanes = [f32; LANES];

/// # Safety
/// `LANES` readable values at `p`.
#[inline(always)]
unsafe fn load(p: *const f32) -> Lanes {
    // SAFETY: the caller's.
    unsafe { std::ptr::read_unaligned(p as *const Lanes) }
}

/// # Safety
/// `LANES` writable values at `p`.
#[inline(always)]
unsafe fn store(p: *mut f32, v: Lanes) {
    // SAFETY: the caller's.
    unsafe { std::ptr::write_unaligned(p as *mut Lanes, v) }
}

/// `G g Gᵀ` along one axis: `[g0, (g0 + g1 + g2) / 2, (g0 - g1 + g2) / 2, g2]`.
fn g_t([g0, g1, g2]: [f32; 3]) -> [f32; 4] {
    [g0, 0.5 * (g0 + g1 + g2), 0.5 * (g0 - g1 + g2), g2]
}

// The transforms below are indexed loops over arrays of lanes, always inlined: closures
// (`array::from_fn`) were compiled apart, without the caller's AVX2, and called, which
// made the input transform as slow as the 16 products.

/// `Bᵀ d B` along one axis: `[d0 - d2, d1 + d2, d2 - d1, d1 - d3]`.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn b_t(d: [Lanes; 4]) -> [Lanes; 4] {
    let mut t = [[0.0; LANES]; 4];
    for l in 0..LANES {
        t[0][l] = d[0][l] - d[2][l];
        t[1][l] = d[1][l] + d[2][l];
        t[2][l] = d[2][l] - d[1][l];
        t[3][l] = d[1][l] - d[3][l];
    }
    t
}

/// `Aᵀ m A` along one axis: `[m0 + m1 + m2, m1 - m2 - m3]`.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn a_t(m: [Lanes; 4]) -> [Lanes; 2] {
    let mut t = [[0.0; LANES]; 2];
    for l in 0..LANES {
        t[0][l] = m[0][l] + m[1][l] + m[2][l];
        t[1][l] = m[1][l] - m[2][l] - m[3][l];
    }
    t
}

wide! {
    /// One tile's input transform, channel lanes at a time: position `r × 4 + s` of the
    /// transformed patch to `v + (r × 4 + s) × stride`. Each pointer of `patch` has
    /// `channels` readable values, and `v` room for the 16 positions.
    fn input_tile(patch: &[[*const f32; 4]; 4], channels: usize, v: *mut f32, stride: usize) => input_tile_with
}

#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn input_tile_with<const FMA: bool>(
    patch: &[[*const f32; 4]; 4],
    channels: usize,
    v: *mut f32,
    stride: usize,
) {
    for c0 in (0..channels).step_by(LANES) {
        // Down the patch's columns, then along the rows.
        let mut cols = [[[0.0; LANES]; 4]; 4];
        for (s, col) in cols.iter_mut().enumerate() {
            // SAFETY (all): the caller's.
            let d = unsafe {
                [
                    load(patch[0][s].add(c0)),
                    load(patch[1][s].add(c0)),
                    load(patch[2][s].add(c0)),
                    load(patch[3][s].add(c0)),
                ]
            };
            *col = b_t(d);
        }
        for r in 0..4 {
            let row = b_t([cols[0][r], cols[1][r], cols[2][r], cols[3][r]]);
            for (s, value) in row.into_iter().enumerate() {
                unsafe { store(v.add((r * 4 + s) * stride + c0), value) };
            }
        }
    }
}

wide! {
    /// One tile's output transform, channel lanes at a time, from position `xi` of its
    /// products at `m + xi × stride`, with bias, residual and clamp. `out`'s pixels and
    /// bias have `channels` values each.
    fn output_tile(m: &[f32], stride: usize, channels: usize, out: &Outputs) => output_tile_with
}

#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn output_tile_with<const FMA: bool>(m: &[f32], stride: usize, channels: usize, out: &Outputs) {
    let m = m.as_ptr();
    let (lo, hi) = out.clamp.unwrap_or((f32::NEG_INFINITY, f32::INFINITY));
    for k0 in (0..channels).step_by(LANES) {
        // Down the columns of positions, then along the rows.
        let mut cols = [[[0.0; LANES]; 2]; 4];
        for (s, col) in cols.iter_mut().enumerate() {
            let at = |r: usize| (r * 4 + s) * stride + k0;
            // SAFETY (all): the caller's.
            let p = unsafe {
                [
                    load(m.add(at(0))),
                    load(m.add(at(1))),
                    load(m.add(at(2))),
                    load(m.add(at(3))),
                ]
            };
            *col = a_t(p);
        }
        let bias = unsafe { load(out.bias.add(k0)) };
        for a in 0..2 {
            let row = a_t([cols[0][a], cols[1][a], cols[2][a], cols[3][a]]);
            for (b, mut value) in row.into_iter().enumerate() {
                let Some(o) = out.pixels[a * 2 + b] else {
                    continue;
                };
                let z = match out.residual {
                    Some(z) => unsafe { load(z.add(o + k0)) },
                    None => [0.0; LANES],
                };
                for (l, v) in value.iter_mut().enumerate() {
                    *v = (*v + bias[l] + z[l]).max(lo).min(hi);
                }
                unsafe { store(out.y.add(o + k0), value) };
            }
        }
    }
}
