// SPDX-License-Identifier: MPL-2.0
//! Depthwise convolution rows in AVX-512 and AVX2 registers (`conv::depthwise` chooses them
//! at run time): intrinsics that x86-64 alone compiles, kept apart from the loops that every
//! target runs.

use std::ops::Range;

use crate::kernels::panels::even_parts;
use crate::kernels::{Buffers, activate, clamp_of};
use trtclassify_compiler::plan::ConvStep;

/// The kernel positions along `axis` (0: rows, 1: columns) that land inside the input for
/// output position `o` (a contiguous range, the input position growing with the kernel's).
#[cfg(target_arch = "x86_64")]
pub(in crate::kernels) fn taps_inside(c: &ConvStep, axis: usize, o: usize) -> Range<usize> {
    let len = [c.h, c.w][axis];
    let start = (o * c.strides[axis]) as isize - c.pads[axis] as isize;
    let at = |t: usize| start + (t * c.dilations[axis]) as isize;
    let kernel = c.kernel[axis];
    let first = (0..kernel).find(|&t| at(t) >= 0).unwrap_or(kernel);
    let end = (first..kernel)
        .find(|&t| at(t) >= len as isize)
        .unwrap_or(kernel);
    first..end
}

/// One output row of a depthwise convolution in SIMD registers: with AVX-512, kernels of 3 or
/// 5 columns undilated along the row in tiles of up to 8 pixels whatever their taps
/// (`tiles_avx512`); the others (and AVX2's) in runs of up to 8 neighbouring output pixels
/// whose taps fall alike (all of them, inside the image) at once, for each block of
/// channels (16 with AVX-512, 8 to 32 with AVX2), each pixel's and block's sums in a register
/// over all the taps (8 chains of additions instead of one, whose latency bound a pixel at a
/// time) and stored once; the clamp of ReLU or clipping on the registers, other activations
/// over the whole row after.
///
/// # Safety
/// The CPU has AVX-512F; `w` holds the packed weights (`[taps][channels]`) of `c`, whose
/// spans were checked.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(in crate::kernels) unsafe fn depthwise_row_avx512(
    buf: &Buffers,
    c: &ConvStep,
    cols: &[Range<usize>],
    w: &[f32],
    row: usize,
) {
    // SAFETY: the caller's.
    unsafe {
        let row = DepthwiseRow::new(buf, c, cols, w, row);
        match (c.kernel[1], c.strides[1], c.dilations[1]) {
            (3, 1, 1) => row.tiles_avx512::<3, 1>(),
            (3, 2, 1) => row.tiles_avx512::<3, 2>(),
            (5, 1, 1) => row.tiles_avx512::<5, 1>(),
            (5, 2, 1) => row.tiles_avx512::<5, 2>(),
            _ => row.run(|row, cb, ox, p, cols| row.pixels_avx512(cb, ox, p, cols)),
        }
    }
}

/// `depthwise_row_avx512` in 8-wide registers.
///
/// # Safety
/// As `depthwise_row_avx512`, the CPU having AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(in crate::kernels) unsafe fn depthwise_row_avx2(
    buf: &Buffers,
    c: &ConvStep,
    cols: &[Range<usize>],
    w: &[f32],
    row: usize,
) {
    // SAFETY: the caller's.
    unsafe {
        DepthwiseRow::new(buf, c, cols, w, row)
            .run(|row, cb, ox, p, cols| row.pixels_avx2(cb, ox, p, cols))
    }
}

/// What the pixels of one output row of a depthwise convolution share.
#[cfg(target_arch = "x86_64")]
struct DepthwiseRow<'a> {
    c: &'a ConvStep,
    n: usize,
    oy: usize,
    /// The kernel rows inside the input.
    rows: Range<usize>,
    /// For each output pixel of the row, the kernel columns inside the input.
    cols: &'a [Range<usize>],
    x: *const f32,
    w: *const f32,
    /// The row's first output.
    y: *mut f32,
    bias: *const f32,
    residual: Option<*const f32>,
    clamp: Option<(f32, f32)>,
}

#[cfg(target_arch = "x86_64")]
impl<'a> DepthwiseRow<'a> {
    /// # Safety
    /// As `depthwise_row_avx512`.
    unsafe fn new(
        buf: &Buffers,
        c: &'a ConvStep,
        cols: &'a [Range<usize>],
        w: &[f32],
        row: usize,
    ) -> Self {
        let (oh, ow) = (c.oh, c.ow);
        let (n, oy) = (row / oh, row % oh);
        let o = (n * oh + oy) * ow * c.k;
        // SAFETY: checked spans.
        unsafe {
            DepthwiseRow {
                c,
                n,
                oy,
                rows: taps_inside(c, 0, oy),
                cols,
                x: buf.at(c.x),
                w: w.as_ptr(),
                y: buf.at_mut(c.y).add(o),
                bias: buf.at(c.bias),
                residual: c.residual.map(|z| buf.at(z).add(o)),
                clamp: clamp_of(c.act),
            }
        }
    }

    /// The row in runs of up to 8 pixels whose taps fall alike, and each run in blocks of
    /// channels, each given to `pixels(self, first channel, first pixel, pixels, taps)`,
    /// which returns how many channels it did; then the activation that the registers did
    /// not apply. Channels inside pixels: a run's inputs (its taps' 3 to 5 rows of about 10
    /// pixels) stay in the L1 cache from one block of channels to the next, where a row's
    /// whole width did not (ReLU6's 144-channel layer at 56×56: 97 KB).
    #[inline(always)]
    fn run(&self, pixels: impl Fn(&Self, usize, usize, usize, &Range<usize>) -> usize) {
        let (ch, ow) = (self.c.k, self.c.ow);
        let mut ox = 0;
        while ox < ow {
            let cols = &self.cols[ox];
            let same = self.cols[ox..]
                .iter()
                .take(8)
                .take_while(|&t| t == cols)
                .count();
            let mut cb = 0;
            while cb < ch {
                cb += pixels(self, cb, ox, same, cols);
            }
            ox += same;
        }
        self.activate_rest();
    }

    /// The activation that the registers did not apply (all but ReLU and clipping), over
    /// the row's outputs: `activate`, compiled with FMA, not `activate_with`, whose
    /// `mul_add`s, compiled without it here, were calls to `fmaf` (EfficientNet-B0's SiLU
    /// depthwise layers took 8× as long).
    #[inline(always)]
    fn activate_rest(&self) {
        let (ch, ow) = (self.c.k, self.c.ow);
        if self.clamp.is_none() {
            // SAFETY: the row's outputs, written above.
            activate(self.c.act, unsafe {
                std::slice::from_raw_parts_mut(self.y, ow * ch)
            });
        }
    }

    /// Adds to `sums` each tap of output pixel `ox` that falls inside the input (the kernel
    /// rows `rows`, columns `cols`), at channel `cb`. None where the taps all fall outside
    /// (padding wider than the kernel: the pixel is its bias).
    ///
    /// # Safety
    /// As `depthwise_row_avx512`.
    #[inline(always)]
    unsafe fn taps(&self, cb: usize, ox: usize, cols: &Range<usize>, sums: &mut impl TapSums) {
        let c = self.c;
        let first = (ox * c.strides[1] + cols.start * c.dilations[1]).checked_sub(c.pads[1]);
        let Some(ix0) = first.filter(|_| !cols.is_empty()) else {
            return;
        };
        if self.rows.len() == 3 && cols.len() == 3 {
            // A 3×3 kernel inside the image, most pixels of most layers: loops of known
            // length, unrolled, a tile in half the instructions (a few per cent on
            // MobileNetV2's 112×112 layer).
            let first = self.rows.start;
            for r in first..first + 3 {
                // SAFETY: the caller's.
                unsafe { self.row_taps(r, cb, ix0, cols.start, 3, sums) };
            }
        } else {
            for r in self.rows.clone() {
                // SAFETY: the caller's.
                unsafe { self.row_taps(r, cb, ix0, cols.start, cols.len(), sums) };
            }
        }
    }

    /// `taps` along kernel row `r`: `count` taps from kernel column `col` (input column
    /// `ix0`).
    ///
    /// # Safety
    /// As `taps`.
    #[inline(always)]
    unsafe fn row_taps(
        &self,
        r: usize,
        cb: usize,
        ix0: usize,
        col: usize,
        count: usize,
        sums: &mut impl TapSums,
    ) {
        let c = self.c;
        let ch = c.k;
        // SAFETY: the caller's.
        let (xs, ws) = unsafe { self.operands(r, ix0, col, cb) };
        for s in 0..count {
            // SAFETY: the caller's.
            unsafe {
                sums.add(
                    xs.wrapping_add(s * c.dilations[1] * ch),
                    ws.wrapping_add(s * ch),
                )
            };
        }
    }

    /// The input of kernel row `r` at input column `ix`, and the weight of kernel column
    /// `col` of that row, both at channel `cb`.
    ///
    /// # Safety
    /// As `depthwise_row_avx512`; the tap inside the input.
    #[inline(always)]
    unsafe fn operands(
        &self,
        r: usize,
        ix: usize,
        col: usize,
        cb: usize,
    ) -> (*const f32, *const f32) {
        let c = self.c;
        let iy = self.oy * c.strides[0] + r * c.dilations[0] - c.pads[0];
        // SAFETY: the caller's: a tap inside the input, a weight of the step's taps.
        unsafe {
            (
                self.x.add(((self.n * c.h + iy) * c.w + ix) * c.k + cb),
                self.w.add((r * c.kernel[1] + col) * c.k + cb),
            )
        }
    }

    /// The row in tiles of up to 8 neighbouring output pixels (of near-equal sizes) × 16
    /// channels (fewer in the last block), for kernels `KW` columns wide at stride `S`,
    /// undilated along the row: each tile's sums in registers over all its taps, a kernel
    /// column's weights loaded once for the tile's pixels. In the tiles that reach into
    /// the padding, each tap outside the input is a masked load of nothing (no branch), so
    /// the pixels at the row's ends share a tile with their neighbours: `run` gives each of
    /// them a run of its own, one chain of additions whose latency, not the arithmetic,
    /// bound the small layers (576 channels at 7×7, 5×5: 4 of 7 pixels alone).
    ///
    /// # Safety
    /// As `depthwise_row_avx512`; `KW` and `S` are the step's.
    #[inline(always)]
    unsafe fn tiles_avx512<const KW: usize, const S: usize>(&self) {
        let (ch, ow) = (self.c.k, self.c.ow);
        // Tiles of near-equal sizes (14 pixels: 7 and 7, not 8 and 6): the smallest tile's
        // chains of additions bound its time.
        let mut ox = 0;
        for p in even_parts(ow, 8) {
            // Whether all the tile's taps are inside the input along the row.
            let ix0 = (ox * S) as isize - self.c.pads[1] as isize;
            let inside = ix0 >= 0 && ix0 + ((p - 1) * S + KW) as isize <= self.c.w as isize;
            let mut cb = 0;
            while cb < ch {
                // SAFETY: the caller's.
                unsafe {
                    if inside {
                        self.tile_of::<KW, S, true>(p, cb, ox)
                    } else {
                        self.tile_of::<KW, S, false>(p, cb, ox)
                    }
                }
                cb += 16;
            }
            ox += p;
        }
        self.activate_rest();
    }

    /// `tile_16` for `p` pixels (1 to 8).
    ///
    /// # Safety
    /// As `tile_16`.
    #[inline(always)]
    unsafe fn tile_of<const KW: usize, const S: usize, const INSIDE: bool>(
        &self,
        p: usize,
        cb: usize,
        ox: usize,
    ) {
        // SAFETY: the caller's.
        unsafe {
            match p {
                8 => self.tile_16::<8, KW, S, INSIDE>(cb, ox),
                7 => self.tile_16::<7, KW, S, INSIDE>(cb, ox),
                6 => self.tile_16::<6, KW, S, INSIDE>(cb, ox),
                5 => self.tile_16::<5, KW, S, INSIDE>(cb, ox),
                4 => self.tile_16::<4, KW, S, INSIDE>(cb, ox),
                3 => self.tile_16::<3, KW, S, INSIDE>(cb, ox),
                2 => self.tile_16::<2, KW, S, INSIDE>(cb, ox),
                _ => self.tile_16::<1, KW, S, INSIDE>(cb, ox),
            }
        }
    }

    /// One tile of `tiles_avx512`: output pixels `ox..ox + P`, channels `cb..cb + 16`, all
    /// their taps inside the input along the row if `INSIDE`.
    ///
    /// # Safety
    /// As `tiles_avx512`.
    #[inline(always)]
    unsafe fn tile_16<const P: usize, const KW: usize, const S: usize, const INSIDE: bool>(
        &self,
        cb: usize,
        ox: usize,
    ) {
        use std::arch::x86_64::*;
        const { assert!(KW == 3 || KW == 5, "the columns below are 3 or 5") };
        let c = self.c;
        let ch = c.k;
        let mask = ((1u32 << (ch - cb).min(16)) - 1) as __mmask16;
        // The input column of the tile's first tap.
        let ix0 = (ox * S) as isize - c.pads[1] as isize;
        // SAFETY: the caller's; every load and store is masked to the channels that exist,
        // the taps to those inside the input. Indexed loops of constant lengths, unrolled,
        // the sums in registers.
        #[allow(clippy::needless_range_loop)]
        unsafe {
            let bias = _mm512_maskz_loadu_ps(mask, self.bias.add(cb));
            let mut acc = [bias; P];
            if let Some(z) = self.residual {
                for p in 0..P {
                    let z = _mm512_maskz_loadu_ps(mask, z.add((ox + p) * ch + cb));
                    acc[p] = _mm512_add_ps(acc[p], z);
                }
            }
            for r in self.rows.clone() {
                let iy = self.oy * c.strides[0] + r * c.dilations[0] - c.pads[0];
                // The input row at column 0 and channel `cb` (the columns before it are
                // never read), the kernel row's weights.
                let xs = self.x.add((self.n * c.h + iy) * c.w * ch + cb);
                let ws = self.w.add(r * KW * ch + cb);
                // The kernel's columns one by one, not in a loop: LLVM left the loop of 5
                // of them rolled, and the sums on the stack (5×5 kernels took twice as
                // long). A macro, not a closure, whose intrinsics would lack the row's
                // target features (`TapSums`).
                macro_rules! column {
                    ($t:literal) => {
                        column_taps::<P, S, INSIDE>(
                            &mut acc,
                            xs,
                            ws.add($t * ch),
                            ix0 + $t,
                            c.w,
                            ch,
                            mask,
                        )
                    };
                }
                column!(0);
                column!(1);
                column!(2);
                if KW == 5 {
                    column!(3);
                    column!(4);
                }
            }
            if let Some((lo, hi)) = self.clamp {
                let (lo, hi) = (_mm512_set1_ps(lo), _mm512_set1_ps(hi));
                for p in 0..P {
                    acc[p] = _mm512_min_ps(_mm512_max_ps(acc[p], lo), hi);
                }
            }
            for p in 0..P {
                _mm512_mask_storeu_ps(self.y.add((ox + p) * ch + cb), mask, acc[p]);
            }
        }
    }

    /// Output pixels `ox..ox + count` (1 to 8), channels `cb..cb + 16` (fewer at the end),
    /// their taps the kernel columns `cols`; returns 16.
    ///
    /// # Safety
    /// As `depthwise_row_avx512`.
    #[inline(always)]
    unsafe fn pixels_avx512(
        &self,
        cb: usize,
        ox: usize,
        count: usize,
        cols: &Range<usize>,
    ) -> usize {
        // SAFETY: the caller's.
        unsafe {
            match count {
                8 => self.pixels_16::<8>(cb, ox, cols),
                7 => self.pixels_16::<7>(cb, ox, cols),
                6 => self.pixels_16::<6>(cb, ox, cols),
                5 => self.pixels_16::<5>(cb, ox, cols),
                4 => self.pixels_16::<4>(cb, ox, cols),
                3 => self.pixels_16::<3>(cb, ox, cols),
                2 => self.pixels_16::<2>(cb, ox, cols),
                _ => self.pixels_16::<1>(cb, ox, cols),
            }
        }
        16
    }

    /// `pixels_avx512` in 8-wide registers, up to 8 sums in registers: 1 or 2 pixels × 32
    /// channels (a run at the row's ends is as many chains of additions as one of 8 thus),
    /// up to 4 pixels × 16 channels, or, for a last block of 8 channels or fewer, up to 8
    /// pixels × 8 channels; returns the channels done.
    ///
    /// # Safety
    /// As `depthwise_row_avx2`.
    #[inline(always)]
    unsafe fn pixels_avx2(&self, cb: usize, ox: usize, count: usize, cols: &Range<usize>) -> usize {
        let left = self.c.k - cb;
        // SAFETY: the caller's. Channel counts are mostly multiples of 8: the masked loads
        // only for a last block of fewer.
        unsafe {
            match count {
                1 | 2 if left >= 32 => {
                    match count {
                        1 => self.pixels_8::<1, 4, true>(cb, ox, cols),
                        _ => self.pixels_8::<2, 4, true>(cb, ox, cols),
                    }
                    return 32;
                }
                _ if left >= 16 => {
                    // Runs of up to 4 pixels × 16 channels: a pixel's 64 bytes are a whole
                    // cache line, and each weight serves 4 sums in a row (against 8 × 8:
                    // 15 % faster on MobileNetV2's first depthwise layers).
                    let mut p = 0;
                    while p < count {
                        match count - p {
                            1 => self.pixels_8::<1, 2, true>(cb, ox + p, cols),
                            2 => self.pixels_8::<2, 2, true>(cb, ox + p, cols),
                            3 => self.pixels_8::<3, 2, true>(cb, ox + p, cols),
                            _ => self.pixels_8::<4, 2, true>(cb, ox + p, cols),
                        }
                        p += 4;
                    }
                    return 16;
                }
                _ => {}
            }
            macro_rules! by_count {
                ($full:literal) => {
                    match count {
                        8 => self.pixels_8::<8, 1, $full>(cb, ox, cols),
                        7 => self.pixels_8::<7, 1, $full>(cb, ox, cols),
                        6 => self.pixels_8::<6, 1, $full>(cb, ox, cols),
                        5 => self.pixels_8::<5, 1, $full>(cb, ox, cols),
                        4 => self.pixels_8::<4, 1, $full>(cb, ox, cols),
                        3 => self.pixels_8::<3, 1, $full>(cb, ox, cols),
                        2 => self.pixels_8::<2, 1, $full>(cb, ox, cols),
                        _ => self.pixels_8::<1, 1, $full>(cb, ox, cols),
                    }
                };
            }
            if left >= 8 {
                by_count!(true)
            } else {
                by_count!(false)
            }
        }
        8
    }

    /// # Safety
    /// As `pixels_avx512`.
    #[inline(always)]
    unsafe fn pixels_16<const P: usize>(&self, cb: usize, ox: usize, cols: &Range<usize>) {
        use std::arch::x86_64::*;
        let ch = self.c.k;
        let mask = ((1u32 << (ch - cb).min(16)) - 1) as __mmask16;
        // SAFETY: the caller's; every load and store is masked to the channels that exist,
        // the taps to those inside the input.
        unsafe {
            let bias = _mm512_maskz_loadu_ps(mask, self.bias.add(cb));
            let mut sums = Sums16 {
                acc: [bias; P],
                mask,
                step: self.c.strides[1] * ch,
            };
            if let Some(z) = self.residual {
                for (p, acc) in sums.acc.iter_mut().enumerate() {
                    let z = _mm512_maskz_loadu_ps(mask, z.add((ox + p) * ch + cb));
                    *acc = _mm512_add_ps(*acc, z);
                }
            }
            self.taps(cb, ox, cols, &mut sums);
            if let Some((lo, hi)) = self.clamp {
                let (lo, hi) = (_mm512_set1_ps(lo), _mm512_set1_ps(hi));
                for acc in sums.acc.iter_mut() {
                    *acc = _mm512_min_ps(_mm512_max_ps(*acc, lo), hi);
                }
            }
            for (p, acc) in sums.acc.iter().enumerate() {
                _mm512_mask_storeu_ps(self.y.add((ox + p) * ch + cb), mask, *acc);
            }
        }
    }

    /// `pixels_16` in 8-wide registers, `B` blocks of 8 channels: `FULL` where all of them
    /// exist, else one block, masked.
    ///
    /// # Safety
    /// As `pixels_avx2`.
    #[inline(always)]
    unsafe fn pixels_8<const P: usize, const B: usize, const FULL: bool>(
        &self,
        cb: usize,
        ox: usize,
        cols: &Range<usize>,
    ) {
        use std::arch::x86_64::*;
        let ch = self.c.k;
        // SAFETY: the caller's; every load and store is masked to the channels that exist
        // (or all `8 · B` exist), the taps to those inside the input.
        unsafe {
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((ch - cb).min(8) as i32), lanes);
            let mut bias = [_mm256_setzero_ps(); B];
            for (b, bias) in bias.iter_mut().enumerate() {
                *bias = load8::<FULL>(mask, self.bias.add(cb + 8 * b));
            }
            let mut sums = Sums8::<P, B, FULL> {
                acc: [bias; P],
                mask,
                step: self.c.strides[1] * ch,
            };
            if let Some(z) = self.residual {
                for (p, row) in sums.acc.iter_mut().enumerate() {
                    for (b, acc) in row.iter_mut().enumerate() {
                        let z = z.add((ox + p) * ch + cb + 8 * b);
                        *acc = _mm256_add_ps(*acc, load8::<FULL>(mask, z));
                    }
                }
            }
            self.slide_or_taps(cb, ox, cols, &mut sums);
            // Indexed loops, unrolled: iterating the nested array (`flatten`) kept the sums
            // on the stack, and MobileNetV2's depthwise layers took 15 % longer.
            let (lo, hi) = self.clamp.unwrap_or((f32::NEG_INFINITY, f32::INFINITY));
            let (lo, hi) = (_mm256_set1_ps(lo), _mm256_set1_ps(hi));
            #[allow(clippy::needless_range_loop)]
            for p in 0..P {
                for b in 0..B {
                    let mut v = sums.acc[p][b];
                    if self.clamp.is_some() {
                        v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
                    }
                    let y = self.y.add((ox + p) * ch + cb + 8 * b);
                    if FULL {
                        _mm256_storeu_ps(y, v);
                    } else {
                        _mm256_maskstore_ps(y, mask, v);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl DepthwiseRow<'_> {
    /// `taps` into `sums`, or, for runs of 4 pixels or more whose kernel columns (3 or 5, at
    /// stride 1 or 2, undilated) all fall inside the input, `slide`.
    ///
    /// # Safety
    /// As `pixels_avx2`.
    #[inline(always)]
    unsafe fn slide_or_taps<const P: usize, const B: usize, const FULL: bool>(
        &self,
        cb: usize,
        ox: usize,
        cols: &Range<usize>,
        sums: &mut Sums8<P, B, FULL>,
    ) {
        let c = self.c;
        let inside = cols.len() == c.kernel[1] && c.dilations[1] == 1;
        // SAFETY: the caller's.
        unsafe {
            match (inside && FULL && P >= 4, c.kernel[1], c.strides[1]) {
                (true, 3, 1) => self.slide::<P, B, FULL, 3, 1>(cb, ox, sums),
                (true, 3, 2) => self.slide::<P, B, FULL, 3, 2>(cb, ox, sums),
                (true, 5, 1) => self.slide::<P, B, FULL, 5, 1>(cb, ox, sums),
                (true, 5, 2) => self.slide::<P, B, FULL, 5, 2>(cb, ox, sums),
                _ => self.taps(cb, ox, cols, sums),
            }
        }
    }

    /// `taps` for a run whose kernel columns, `KW` of them, `S` apart, all fall inside the
    /// input: each kernel row's `KW` weights held in registers, and each input pixel of the
    /// row loaded once for all the sums it is a tap of. At stride 1, 3 wide, 4 pixels × 16
    /// channels: 12 input and 6 weight loads for 24 multiply-adds a kernel row, where `taps`
    /// makes 30 (the loads, not the arithmetic or the memory, bound the depthwise layers).
    ///
    /// # Safety
    /// As `pixels_avx2`; the columns of pixels `ox..ox + P` all inside the input.
    #[inline(always)]
    unsafe fn slide<
        const P: usize,
        const B: usize,
        const FULL: bool,
        const KW: usize,
        const S: usize,
    >(
        &self,
        cb: usize,
        ox: usize,
        sums: &mut Sums8<P, B, FULL>,
    ) {
        use std::arch::x86_64::*;
        let c = self.c;
        let ch = c.k;
        let ix0 = ox * S - c.pads[1];
        for r in self.rows.clone() {
            // SAFETY: the caller's: the run's taps inside the input. Indexed loops of
            // constant lengths, unrolled, the sums in registers.
            #[allow(clippy::needless_range_loop)]
            unsafe {
                let (xs, ws) = self.operands(r, ix0, 0, cb);
                let mut w = [[_mm256_setzero_ps(); B]; KW];
                for t in 0..KW {
                    for b in 0..B {
                        w[t][b] = load8::<FULL>(sums.mask, ws.add(t * ch + 8 * b));
                    }
                }
                for i in 0..(P - 1) * S + KW {
                    for b in 0..B {
                        let x = load8::<FULL>(sums.mask, xs.add(i * ch + 8 * b));
                        for t in 0..KW {
                            if i >= t && (i - t) % S == 0 && (i - t) / S < P {
                                let p = (i - t) / S;
                                sums.acc[p][b] = _mm256_fmadd_ps(x, w[t][b], sums.acc[p][b]);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Adds to each of the `P` sums of a tile of `tiles_avx512` its tap of one kernel column:
/// pixel `p`'s input at column `ix + p·S` of the input row `xs` (pixels `ch` floats apart),
/// times the column's weights at `ws`; a tap outside the row (`0..w`), only where not
/// `INSIDE`, loads nothing (masked lanes do not fault) and adds 0.
///
/// # Safety
/// The CPU has AVX-512F; the taps inside the row and the weights are readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn column_taps<const P: usize, const S: usize, const INSIDE: bool>(
    acc: &mut [std::arch::x86_64::__m512; P],
    xs: *const f32,
    ws: *const f32,
    ix: isize,
    w: usize,
    ch: usize,
    mask: std::arch::x86_64::__mmask16,
) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's.
    unsafe {
        let wv = _mm512_maskz_loadu_ps(mask, ws);
        for (p, acc) in acc.iter_mut().enumerate() {
            let ix = ix + (p * S) as isize;
            let m = if INSIDE || (0..w as isize).contains(&ix) {
                mask
            } else {
                0
            };
            let x = _mm512_maskz_loadu_ps(m, xs.wrapping_offset(ix * ch as isize));
            *acc = _mm512_fmadd_ps(x, wv, *acc);
        }
    }
}

/// The sums of a run of output pixels over a block of channels, in registers, to which a
/// depthwise row adds its taps one by one. A trait with a method always inlined, not a
/// closure: the closures' SIMD intrinsics, compiled without the row's target features,
/// were called, not inlined (each multiply-add a call through the stack: the AVX-512 rows
/// took 14× as long as the AVX2 ones on the GPU host's Xeon).
#[cfg(target_arch = "x86_64")]
trait TapSums {
    /// Adds the tap whose input for the run's first pixel is at `xs`, weights at `ws`.
    ///
    /// # Safety
    /// The CPU has the sums' features; the run's inputs and the weights are readable.
    unsafe fn add(&mut self, xs: *const f32, ws: *const f32);
}

/// `P` pixels × 16 channels (fewer where `mask` says), pixels `step` floats apart.
#[cfg(target_arch = "x86_64")]
struct Sums16<const P: usize> {
    acc: [std::arch::x86_64::__m512; P],
    mask: std::arch::x86_64::__mmask16,
    step: usize,
}

#[cfg(target_arch = "x86_64")]
impl<const P: usize> TapSums for Sums16<P> {
    #[inline(always)]
    unsafe fn add(&mut self, xs: *const f32, ws: *const f32) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's; loads masked to the channels that exist.
        unsafe {
            let wv = _mm512_maskz_loadu_ps(self.mask, ws);
            for (p, acc) in self.acc.iter_mut().enumerate() {
                let x = _mm512_maskz_loadu_ps(self.mask, xs.add(p * self.step));
                *acc = _mm512_fmadd_ps(x, wv, *acc);
            }
        }
    }
}

/// `P` pixels × `B` blocks of 8 channels: all of them where `FULL`, else one block, masked.
#[cfg(target_arch = "x86_64")]
struct Sums8<const P: usize, const B: usize, const FULL: bool> {
    acc: [[std::arch::x86_64::__m256; B]; P],
    mask: std::arch::x86_64::__m256i,
    step: usize,
}

/// 8 floats at `p`, or those of them that `mask` keeps unless `FULL`.
///
/// # Safety
/// The CPU has AVX2; the floats loaded are readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load8<const FULL: bool>(
    mask: std::arch::x86_64::__m256i,
    p: *const f32,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's.
    unsafe {
        if FULL {
            _mm256_loadu_ps(p)
        } else {
            _mm256_maskload_ps(p, mask)
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl<const P: usize, const B: usize, const FULL: bool> TapSums for Sums8<P, B, FULL> {
    #[inline(always)]
    unsafe fn add(&mut self, xs: *const f32, ws: *const f32) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's.
        unsafe {
            let mut wv = [_mm256_setzero_ps(); B];
            for (b, wv) in wv.iter_mut().enumerate() {
                *wv = load8::<FULL>(self.mask, ws.add(8 * b));
            }
            for (p, row) in self.acc.iter_mut().enumerate() {
                let xp = xs.add(p * self.step);
                for (b, acc) in row.iter_mut().enumerate() {
                    let x = load8::<FULL>(self.mask, xp.add(8 * b));
                    *acc = _mm256_fmadd_ps(x, wv[b], *acc);
                }
            }
        }
    }
}
