// SPDX-License-Identifier: MPL-2.0
//! Matrix products with constant weights, packed once when the plan is loaded: columns in
//! panels of 16, the activations read where they lie (NHWC rows are the left-hand matrix as
//! they are; a convolution's taps through a pointer per row and tap, `Lhs::Taps`), and the
//! epilogue (bias, residual, activation) applied to each tile while it is in registers or in
//! the cache.
//!
//! The `gemm` crate packs both operands on every call: on the late layers of a network
//! (49 rows, weights of 512 × 2048) that packing cost more than the arithmetic, and its
//! epilogue had to be a pass of its own over the whole output. onnxruntime's MLAS packs the
//! weights once the same way; this is that scheme, a tile's sums held in registers (the
//! compiler does not keep them there on its own):
//! - AVX-512: 12 rows × two panels (24 of the 32 registers, two loads of the panels and
//!   twelve broadcasts for 24 products along k), in assembly over a matrix's rows
//!   (`rows_avx512`);
//! - AVX2/FMA: 6 rows × one panel (twelve of the 16 registers);
//! - NEON on aarch64 (the inner loop), plain loops elsewhere.
//!
//! The x86 path is chosen at run time, so that one build uses AVX-512 where the CPU has it.
//! Here: the packing, the blocking and the tile dispatch, which every target compiles; the
//! tiles in x86 registers are in `x86_64::panels`, NEON's inner loop in `aarch64::panels`.

use std::ops::Range;
use std::sync::Arc;

#[cfg(target_arch = "aarch64")]
use super::aarch64::panels::accumulate_neon;
use super::product::Product;
#[cfg(target_arch = "x86_64")]
use super::x86_64::panels::{run_avx512, tile_avx2, tile_avx512};
use super::{Aligned, Threads, activate_with, clamp_of, fma};
use trtclassify_compiler::ir::Act;

/// Columns of a panel; a last panel of 8 where no more than 8 columns remain.
pub(super) const WIDTH: usize = 16;
/// Rows of a tile (AVX2 and the others; AVX-512's have 12).
const ROWS: usize = 6;
/// Steps along k per block of a matrix, at most: all of k in the products of the models we
/// measure (up to 2048), so that a tile adds to the output once. Blocks of 256, whose panel
/// block (16 KB) stays in the L1 cache (MLAS's choice), read and wrote the output again after
/// each: 1 % of ResNet-50 on Zen 3, 3–6 % of its late 1×1 layers. The panels stream from the
/// L2 cache as fast as the FMAs take them.
const KC: usize = 2048;
/// The same for a convolution's taps read where they lie: all of k in one block but in the
/// last 3×3 convolutions of ResNet-50 (4608, in two). Blocks of 256 cost those convolutions
/// 4 %, blocks of 1024 1 %.
const KC_TAPS: usize = 4096;
/// Steps along k that a tile asks for its panels' values ahead of reading them. The panels
/// of a model's late layers (4 MB in ResNet-50's 2048 × 512) arrive from memory or the L3
/// cache at batch 1, once for each row tile, and the hardware's prefetcher alone left the
/// tile waiting on them: asked for 32 steps (2 KB) ahead, 49 × 2048 · 2048 × 512 went from
/// 0.93–1.01 to 0.75–0.81 ms with the panels cold and from 0.73 to 0.61 ms with them in the
/// L2 cache (Xeon, AVX-512); distances from 8 to 96 steps did about as well.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) const AHEAD: usize = 32;
/// Rows per block: their values are read again for each panel of the block's columns.
const MC: usize = 120;
/// Columns per block: the part of the output that an activation the tile cannot apply in
/// registers revisits in the L2 cache.
const NC: usize = 128;

/// A `k × n` weight matrix in column panels (16 columns, the last 8 where 8 or fewer
/// remain), each panel `k` rows of its columns, zeros past column `n`.
/// Cloned, it shares the packed values (the batch plan's last steps use the one-frame plan's).
#[derive(Clone, Default)]
pub struct Panels {
    data: Arc<Aligned>,
    k: usize,
    n: usize,
}

impl Panels {
    /// Packs `alpha · w`, `w[i][j]` being `at(i, j)` for `i < k`, `j < n`.
    pub fn pack(k: usize, n: usize, alpha: f32, at: impl Fn(usize, usize) -> f32) -> Panels {
        let mut data = Vec::with_capacity(k * n.next_multiple_of(8));
        for (col, width) in spans(n, 0..n) {
            for i in 0..k {
                data.extend((col..col + width).map(|j| if j < n { alpha * at(i, j) } else { 0.0 }));
            }
        }
        Panels {
            data: Arc::new(Aligned::from_slice(&data)),
            k,
            n,
        }
    }

    /// The panel of columns from `col` (a multiple of 16), `k` rows of `width` values, and
    /// its width (16, or 8 for a last panel of 8 columns or fewer).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn panel(&self, col: usize) -> (*const f32, usize) {
        debug_assert!(
            col.is_multiple_of(WIDTH) && col < self.n,
            "column {col} of {}",
            self.n
        );
        let width = spans(self.n, col..self.n).next().map_or(0, |(_, w)| w);
        (self.data.as_slice()[self.k * col..].as_ptr(), width)
    }

    /// `diag(scale) · w` into `into`: row `i` of the matrix times `scale[i]`.
    pub fn scale_rows(&self, scale: &[f32], into: &mut Panels) {
        into.k = self.k;
        into.n = self.n;
        let to = Arc::make_mut(&mut into.data);
        to.resize(self.data.as_slice().len());
        let (from, to) = (self.data.as_slice(), to.as_mut_slice());
        let mut at = 0;
        for (_, width) in spans(self.n, 0..self.n) {
            for &s in &scale[..self.k] {
                let (from, to) = (&from[at..at + width], &mut to[at..at + width]);
                to.iter_mut().zip(from).for_each(|(t, &f)| *t = f * s);
                at += width;
            }
        }
    }
}

/// The panels `(first column, width)` of an `n`-column matrix that lie in `cols` (whose
/// ends are panel boundaries, or `n`).
fn spans(n: usize, cols: Range<usize>) -> impl Iterator<Item = (usize, usize)> {
    (cols.start..cols.end)
        .step_by(WIDTH)
        .map(move |col| (col, if n - col <= 8 { 8 } else { WIDTH }))
}

/// Splits the columns `0..n` into about `parts` ranges that start on panel boundaries.
pub(super) fn column_shares(n: usize, parts: usize) -> Vec<Range<usize>> {
    let panels = n.div_ceil(WIDTH);
    let per = panels.div_ceil(parts.max(1)) * WIDTH;
    (0..n).step_by(per).map(|c| c..(c + per).min(n)).collect()
}

/// `y = act(x·w + bias + residual)` for the columns `cols` of `p` (its `w` being `panels`),
/// with the widest tiles the CPU has (AVX-512 where `threads` may use it).
pub(super) fn run_panels(p: &Product, panels: &Panels, cols: Range<usize>, threads: Threads) {
    #[cfg(target_arch = "x86_64")]
    if threads.avx512 {
        // SAFETY: the CPU has AVX-512F (`Threads::new`).
        return unsafe { run_avx512(p, panels, cols) };
    }
    let _ = threads;
    run_narrow(p, panels, cols)
}

wide! {
    /// Tiles of AVX2 registers, NEON's or plain loops.
    fn run_narrow(product: &Product, panels: &Panels, cols: Range<usize>) => run_narrow_with
}

#[inline(always)]
fn run_narrow_with<const FMA: bool>(p: &Product, panels: &Panels, cols: Range<usize>) {
    run::<FMA, false>(p, panels, cols)
}

/// The product in blocks that fit the caches, each block's panels in tiles: with
/// `AVX512`, pairs of full panels in tiles of 12 rows.
#[inline(always)]
pub(super) fn run<const FMA: bool, const AVX512: bool>(
    p: &Product,
    panels: &Panels,
    cols: Range<usize>,
) {
    debug_assert_eq!((panels.k, panels.n), (p.k, p.n));
    // ReLU and clipping happen in the registers; other activations over each block of the
    // output once its sums are complete, while it is still in the cache.
    let clamp = clamp_of(p.act);
    let pass = clamp.is_none() && !matches!(p.act, Act::None);
    let blocks = match p.taps {
        Some(taps) => k_blocks(taps.count(), taps.len(), KC_TAPS),
        None => k_blocks(1, p.k, KC),
    };
    let (mut table, mut scratch) = (Vec::new(), Vec::new());
    for r0 in (0..p.rows).step_by(MC) {
        let r1 = (r0 + MC).min(p.rows);
        let (runs, offset) = match p.taps {
            Some(taps) => taps.runs(p.x, r0..r1, &mut table, &mut scratch),
            None => (std::ptr::null(), 0),
        };
        for c0 in (cols.start..cols.end).step_by(NC) {
            let c1 = (c0 + NC).min(cols.end);
            for block in &blocks {
                let ks = block.ks.clone();
                let clamp = clamp.filter(|_| ks.end == p.k);
                let lhs = match p.taps {
                    None => Lhs::Rows {
                        x: p.x.wrapping_add(r0 * p.x_stride + ks.start),
                        stride: p.x_stride,
                        len: ks.len(),
                    },
                    Some(taps) => Lhs::Taps {
                        table: runs.wrapping_add(block.tap),
                        taps: taps.count(),
                        segments: block.segments,
                        offset: offset + block.offset,
                        len: ks.len() / block.segments,
                    },
                };
                let mut spans = spans(panels.n, c0..c1);
                while let Some((col, width)) = spans.next() {
                    // SAFETY: the panels' blocks lie inside `data` (`pack` wrote k rows of
                    // `width` for each panel, in order).
                    let at = |col: usize, width| unsafe {
                        panels
                            .data
                            .as_slice()
                            .as_ptr()
                            .add(col * p.k + ks.start * width)
                    };
                    // A full panel with the next, a last panel of 8 included: two panels'
                    // sums for each broadcast (MobileNetV2's 24 channels at 56×56 had read
                    // their rows once for each panel).
                    let pair = if AVX512 && width == WIDTH {
                        spans.next().map(|s| s.1)
                    } else {
                        None
                    };
                    let b2_width = pair.unwrap_or(0);
                    let width = if pair.is_some() { 2 * WIDTH } else { width };
                    let tile = Tile {
                        col,
                        cols: width.min(p.n - col),
                        ks: ks.clone(),
                        lhs,
                        b: at(col, width.min(WIDTH)),
                        b2: if pair.is_some() {
                            at(col + WIDTH, b2_width)
                        } else {
                            std::ptr::null()
                        },
                        b2_width,
                        clamp,
                    };
                    let mut r = r0;
                    for rows in even_parts(r1 - r0, if AVX512 { 2 * ROWS } else { ROWS }) {
                        tile.run::<FMA, AVX512>(p, r, r - r0, rows, width);
                        r += rows;
                    }
                }
            }
            if pass {
                for r in r0..r1 {
                    // SAFETY: row `r` of the output, columns `c0..c1`, inside the
                    // caller's checked span.
                    let out = unsafe {
                        std::slice::from_raw_parts_mut(p.y.add(r * p.y_stride + c0), c1 - c0)
                    };
                    activate_with::<FMA>(p.act, out);
                }
            }
        }
    }
}

/// `total` in as few parts of at most `most` as there can be, as even as they go.
///
/// The rows of a block in tiles: a tile of fewer than 4 rows has too few sums to keep both
/// FMA units busy while each sum waits on its last addition, so that the 49 rows of a 7×7
/// layer as 8 tiles of 6 and one of 1 took 8.7 tiles' time, against 8.2 as 4 tiles of 6
/// and 5 of 5. A convolution's taps in blocks of k: each block after the first reads and
/// writes the output once more, and a short one does little between.
pub(super) fn even_parts(total: usize, most: usize) -> impl Iterator<Item = usize> {
    let parts = total.div_ceil(most);
    (0..parts).map(move |t| total / parts + usize::from(t < total % parts))
}

/// A block of k: the panels' rows `ks`, and where they lie in the left-hand matrix.
#[derive(Debug, PartialEq)]
struct KBlock {
    ks: Range<usize>,
    /// The block's first tap, its number of taps (1 where a tap has more values than a block
    /// takes) and the offset into each.
    tap: usize,
    segments: usize,
    offset: usize,
}

/// The blocks of k, `count` taps of `len` values each (a matrix's rows being one tap), at
/// most `most` a block: whole taps, as many in each as there can be, or even parts of one.
fn k_blocks(count: usize, len: usize, most: usize) -> Vec<KBlock> {
    let mut blocks = Vec::new();
    if len <= most {
        let mut tap = 0;
        for taps in even_parts(count, most / len.max(1)) {
            blocks.push(KBlock {
                ks: tap * len..(tap + taps) * len,
                tap,
                segments: taps,
                offset: 0,
            });
            tap += taps;
        }
        return blocks;
    }
    for tap in 0..count {
        let mut offset = 0;
        for part in even_parts(len, most) {
            let k0 = tap * len + offset;
            blocks.push(KBlock {
                ks: k0..k0 + part,
                tap,
                segments: 1,
                offset,
            });
            offset += part;
        }
    }
    blocks
}

/// Where a tile's rows of the left-hand matrix lie over a block of k: `segments()` runs of
/// values, each row's part of each run at an address of its own.
#[derive(Clone, Copy)]
pub(super) enum Lhs {
    /// Row `r`'s block at `x + r · stride`: one run of `len`.
    Rows {
        x: *const f32,
        stride: usize,
        len: usize,
    },
    /// Row `r`'s run `s` at `table[r · taps + s] + offset`, `len` values: a convolution's
    /// taps, whole (`offset` 0) or a part of one.
    Taps {
        table: *const *const f32,
        taps: usize,
        segments: usize,
        offset: usize,
        len: usize,
    },
}

impl Lhs {
    /// The same from `rows` rows further on.
    fn skip(self, rows: usize) -> Lhs {
        match self {
            Lhs::Rows { x, stride, len } => Lhs::Rows {
                x: x.wrapping_add(rows * stride),
                stride,
                len,
            },
            Lhs::Taps {
                table,
                taps,
                segments,
                offset,
                len,
            } => Lhs::Taps {
                table: table.wrapping_add(rows * taps),
                taps,
                segments,
                offset,
                len,
            },
        }
    }

    pub(super) fn segments(&self) -> usize {
        match *self {
            Lhs::Rows { .. } => 1,
            Lhs::Taps { segments, .. } => segments,
        }
    }

    /// Where run `s` of rows `0..R` begins, and its length.
    ///
    /// # Safety
    /// With taps, the table holds the run's pointers for the `R` rows.
    #[inline(always)]
    pub(super) unsafe fn segment<const R: usize>(&self, s: usize) -> ([*const f32; R], usize) {
        match *self {
            Lhs::Rows { x, stride, len } => {
                (std::array::from_fn(|r| x.wrapping_add(r * stride)), len)
            }
            Lhs::Taps {
                table,
                taps,
                offset,
                len,
                ..
            } => (
                std::array::from_fn(|r| {
                    // SAFETY: the caller's.
                    unsafe { *table.add(r * taps + s) }.wrapping_add(offset)
                }),
                len,
            ),
        }
    }
}

/// One panel's block of k, to run over the rows of a block.
struct Tile {
    col: usize,
    /// Columns of the panel inside the matrix (the rest is padding).
    cols: usize,
    ks: Range<usize>,
    /// The block's rows of the left-hand matrix, from its first row.
    lhs: Lhs,
    /// The panel's first value at `ks.start`.
    b: *const f32,
    /// The next panel's, where the tile takes two (null otherwise), and its width.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    b2: *const f32,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    b2_width: usize,
    /// The clamp of the block's results: ReLU or clipping, on the last block of k.
    clamp: Option<(f32, f32)>,
}

impl Tile {
    #[inline(always)]
    fn run<const FMA: bool, const AVX512: bool>(
        &self,
        p: &Product,
        row: usize,
        in_block: usize,
        rows: usize,
        width: usize,
    ) {
        let lhs = self.lhs.skip(in_block);
        macro_rules! dispatch {
            ($($r:literal)*) => {
                match (rows, width) {
                    $(($r, 8) => self.sums::<$r, 8, FMA, AVX512>(p, row, lhs),
                      ($r, 16) => self.sums::<$r, 16, FMA, AVX512>(p, row, lhs),
                      ($r, _) => self.sums::<$r, 32, FMA, AVX512>(p, row, lhs),)*
                    _ => unreachable!("tiles of 1 to {} rows", 2 * ROWS),
                }
            };
        }
        if AVX512 {
            dispatch!(1 2 3 4 5 6 7 8 9 10 11 12)
        } else {
            dispatch!(1 2 3 4 5 6)
        }
    }

    /// Rows `row..row + R` (of the left-hand matrix, `x`) times the panel (width `W`; 32
    /// for two) over the block's k: the sums start from the bias and residual on the first
    /// block and from the output on the others.
    #[inline(always)]
    fn sums<const R: usize, const W: usize, const FMA: bool, const AVX512: bool>(
        &self,
        p: &Product,
        row: usize,
        x: Lhs,
    ) {
        // SAFETY (all of it): rows `row..row + R` and columns `col..col + cols` of `x`,
        // `y` and the residual lie in the caller's checked spans, the bias holds `n` values,
        // and the panel `ks.len()` rows of `W`.
        unsafe {
            let at = Operands {
                x,
                b: self.b,
                y: p.y.add(row * p.y_stride + self.col),
                y_stride: p.y_stride,
                cols: self.cols,
                start: if self.ks.start > 0 {
                    Start::Output
                } else {
                    Start::Epilogue {
                        bias: p.bias.map(|b| b.add(self.col)),
                        residual: p.residual.map(|z| z.add(row * p.y_stride + self.col)),
                    }
                },
                clamp: self.clamp,
            };
            #[cfg(target_arch = "x86_64")]
            if AVX512 {
                return match W {
                    32 => tile_avx512::<R, 2>(&at, self.b2, [WIDTH, self.b2_width]),
                    _ => tile_avx512::<R, 1>(&at, self.b2, [W, 0]),
                };
            }
            #[cfg(target_arch = "x86_64")]
            if FMA && W <= WIDTH {
                return tile_avx2::<R, W>(&at);
            }
            if W <= WIDTH {
                return tile::<R, W, FMA>(&at);
            }
            unreachable!("pairs of panels with AVX-512 only")
        }
    }
}

/// A tile's operands: `R` rows of `x` from its block of k, the panel's block, the output.
pub(super) struct Operands {
    pub(super) x: Lhs,
    pub(super) b: *const f32,
    pub(super) y: *mut f32,
    pub(super) y_stride: usize,
    /// Columns of the output the tile writes (the panel's others are padding).
    pub(super) cols: usize,
    pub(super) start: Start,
    pub(super) clamp: Option<(f32, f32)>,
}

/// What a tile's sums start from.
pub(super) enum Start {
    /// The output: the sums of the previous blocks of k.
    Output,
    /// The bias and the residual (which may be the output itself, read before it is
    /// written), or zeros.
    Epilogue {
        bias: Option<*const f32>,
        residual: Option<*const f32>,
    },
}

/// A tile in plain loops over arrays (NEON's inner loop on aarch64).
///
/// # Safety
/// As `Tile::sums`.
#[inline(always)]
unsafe fn tile<const R: usize, const W: usize, const FMA: bool>(at: &Operands) {
    let mut acc = [[0.0f32; W]; R];
    let cols = at.cols;
    // SAFETY: the caller's.
    unsafe {
        match at.start {
            Start::Output => {
                for (r, acc) in acc.iter_mut().enumerate() {
                    load(acc, at.y.add(r * at.y_stride), cols);
                }
            }
            Start::Epilogue { bias, residual } => {
                if let Some(bias) = bias {
                    let mut b = [0.0; W];
                    load(&mut b, bias, cols);
                    acc.iter_mut().for_each(|a| *a = b);
                }
                if let Some(z) = residual {
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let mut v = [0.0; W];
                        load(&mut v, z.add(r * at.y_stride), cols);
                        acc.iter_mut().zip(v).for_each(|(a, v)| *a += v);
                    }
                }
            }
        }
        let mut b = at.b;
        for s in 0..at.x.segments() {
            let (x, k) = at.x.segment::<R>(s);
            accumulate::<R, W, FMA>(&mut acc, k, &x, b);
            b = b.add(k * W);
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            if let Some((lo, hi)) = at.clamp {
                acc.iter_mut().for_each(|s| *s = s.max(lo).min(hi));
            }
            store(acc, at.y.add(r * at.y_stride), cols);
        }
    }
}

/// `acc[r] += Σ_i x[r][i] · b[i]` over `i < k`, `b` `k` rows of `W` values: the tile's
/// inner loop, in NEON registers on aarch64.
///
/// # Safety
/// `k` readable values at each of `x`, `k × W` at `b`.
#[inline(always)]
unsafe fn accumulate<const R: usize, const W: usize, const FMA: bool>(
    acc: &mut [[f32; W]; R],
    k: usize,
    x: &[*const f32; R],
    b: *const f32,
) {
    // SAFETY: the caller's.
    unsafe {
        #[cfg(target_arch = "aarch64")]
        return accumulate_neon(acc, k, x, b);
        #[allow(unreachable_code)]
        for i in 0..k {
            let b = &*(b.add(i * W) as *const [f32; W]);
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = *x[r].add(i);
                for (s, &b) in acc.iter_mut().zip(b) {
                    *s = fma::<FMA>(a, b, *s);
                }
            }
        }
    }
}

/// The first `cols` values at `src` into `dst` (all of it in one go when full).
#[inline(always)]
unsafe fn load<const W: usize>(dst: &mut [f32; W], src: *const f32, cols: usize) {
    // SAFETY: the caller's: `cols` readable values at `src`.
    unsafe {
        if cols == W {
            *dst = std::ptr::read_unaligned(src as *const [f32; W]);
        } else {
            std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), cols);
        }
    }
}

#[inline(always)]
unsafe fn store<const W: usize>(src: &[f32; W], dst: *mut f32, cols: usize) {
    // SAFETY: the caller's: `cols` writable values at `dst`.
    unsafe {
        if cols == W {
            std::ptr::write_unaligned(dst as *mut [f32; W], *src);
        } else {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, cols);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{KBlock, KC, KC_TAPS, even_parts, k_blocks};

    #[test]
    fn k_splits_into_blocks_of_whole_taps_or_even_parts_of_one() {
        let block = |ks: std::ops::Range<usize>, tap, segments, offset| KBlock {
            ks,
            tap,
            segments,
            offset,
        };
        // 3×3 of 64 channels: all in one block.
        assert_eq!(k_blocks(9, 64, KC_TAPS), [block(0..576, 0, 9, 0)]);
        // 3×3 of 512 channels: 8 taps fit a block; 5 and 4 instead of 8 and 1.
        assert_eq!(
            k_blocks(9, 512, KC_TAPS),
            [block(0..2560, 0, 5, 0), block(2560..4608, 5, 4, 0)]
        );
        // A matrix (one tap) of 5000 rows: three even parts.
        assert_eq!(
            k_blocks(1, 5000, KC),
            [
                block(0..1667, 0, 1, 0),
                block(1667..3334, 0, 1, 1667),
                block(3334..5000, 0, 1, 3334)
            ]
        );
        // Every value of k once, in order, at most `most` a block.
        for most in [KC, KC_TAPS] {
            for (count, len) in [(9, 32), (49, 300), (25, 300), (1, 4097), (3, 5000), (49, 3)] {
                let blocks = k_blocks(count, len, most);
                let mut next = 0;
                for b in &blocks {
                    assert_eq!(b.ks.start, next, "{count} × {len}: {blocks:?}");
                    assert!(b.ks.len() <= most, "{count} × {len}: {blocks:?}");
                    assert_eq!(b.ks.start, b.tap * len + b.offset, "{count} × {len}");
                    assert_eq!(
                        b.ks.len(),
                        b.segments * len.min(b.ks.len()),
                        "{count} × {len}"
                    );
                    next = b.ks.end;
                }
                assert_eq!(next, count * len);
            }
        }
    }

    #[test]
    fn tiles_share_the_rows_evenly() {
        assert_eq!(
            even_parts(49, 6).collect::<Vec<_>>(),
            [6, 6, 6, 6, 5, 5, 5, 5, 5]
        );
        assert_eq!(even_parts(49, 12).collect::<Vec<_>>(), [10, 10, 10, 10, 9]);
        for most in [6, 12] {
            for rows in 1..=300 {
                let tiles: Vec<usize> = even_parts(rows, most).collect();
                assert_eq!(
                    tiles.iter().sum::<usize>(),
                    rows,
                    "{rows} rows, {most} a tile"
                );
                assert_eq!(tiles.len(), rows.div_ceil(most), "{rows} rows: {tiles:?}");
                let (least, largest) = (tiles.iter().min(), tiles.iter().max());
                assert!(largest <= Some(&most), "{rows} rows: {tiles:?}");
                assert!(
                    largest.unwrap() - least.unwrap() <= 1,
                    "{rows} rows: {tiles:?}"
                );
            }
        }
    }
}
