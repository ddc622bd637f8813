// SPDX-License-Identifier: MPL-2.0
//! Convolutions: depthwise ones as loops along the NHWC channels, the others as a matrix
//! product of their taps (read where they lie, or unfolded: im2col), with their weights
//! packed once for each.

use std::ops::Range;
use std::sync::Arc;

#[cfg(target_arch = "x86_64")]
use super::clamp_of;
use super::panels::Panels;
use super::product::{Product, Weights, epilogue_init};
use super::winograd;
use super::{Aligned, Buffers, Packed, Threads, activate, activate_with, fma};
use trtclassify_compiler::plan::{ConvStep, Loc, Step};

pub(super) fn is_depthwise(c: &ConvStep) -> bool {
    c.group == c.c && c.group == c.k
}

/// A 1×1 convolution with stride 1 and no padding reads the NHWC input as a matrix
/// as it is; the others unfold it first.
pub(super) fn is_pointwise(c: &ConvStep) -> bool {
    c.kernel == [1, 1] && c.strides == [1, 1] && c.pads == [0, 0]
}

pub fn pack(step: &Step, weights: &[Arc<Vec<f32>>]) -> Packed {
    let Step::Conv(c) = step else {
        return Packed::None;
    };
    let Loc::Weight { index, offset } = c.weight else {
        // A weight computed by the plan is read as it is, at run time.
        return Packed::None;
    };
    let krsc = &weights[index][offset..];
    let taps = c.kernel[0] * c.kernel[1];
    if is_depthwise(c) {
        let mut packed = vec![0.0; taps * c.k];
        for k in 0..c.k {
            for t in 0..taps {
                packed[t * c.k + k] = krsc[k * taps + t];
            }
        }
        return Packed::Depthwise(Arc::new(Aligned::from_slice(&packed)));
    }
    let (cg, kg) = (c.c / c.group, c.k / c.group);
    let rows = taps * cg;
    if winograd::fits(c) {
        return Packed::Winograd(winograd::pack(c, krsc));
    }
    if c.group == 1 {
        return Packed::Panels(
            Panels::pack(rows, c.k, 1.0, |i, j| krsc[j * rows + i]),
            None,
        );
    }
    let mut packed = vec![0.0; c.group * rows * kg];
    for g in 0..c.group {
        for kk in 0..kg {
            let k = g * kg + kk;
            for i in 0..rows {
                packed[(g * rows + i) * kg + kk] = krsc[k * rows + i];
            }
        }
    }
    Packed::Gemm(Arc::new(packed))
}

/// Depthwise convolution, NHWC: for each output pixel, each tap's channels multiplied and
/// added along the channel vector.
pub(super) fn depthwise(buf: &Buffers, c: &ConvStep, w: &[f32], threads: Threads) {
    #[cfg(target_arch = "x86_64")]
    {
        // The kernel columns inside the input are the same for every output row.
        let cols: Vec<Range<usize>> = (0..c.ow).map(|ox| taps_inside(c, 1, ox)).collect();
        // SAFETY (both): the CPU has the features the row is compiled for (AVX-512F:
        // `Threads::new`); the weights are the step's, packed by `pack`.
        if threads.avx512 {
            return threads.for_each(c.n * c.oh, |row| unsafe {
                depthwise_row_avx512(buf, c, &cols, w, row)
            });
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return threads.for_each(c.n * c.oh, |row| unsafe {
                depthwise_row_avx2(buf, c, &cols, w, row)
            });
        }
    }
    threads.for_each(c.n * c.oh, |row| depthwise_row(buf, c, w, row));
}

/// The kernel positions along `axis` (0: rows, 1: columns) that land inside the input for
/// output position `o` (a contiguous range, the input position growing with the kernel's).
#[cfg(target_arch = "x86_64")]
fn taps_inside(c: &ConvStep, axis: usize, o: usize) -> Range<usize> {
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

wide! {
    /// One output row of a depthwise convolution.
    fn depthwise_row(buf: &Buffers, c: &ConvStep, w: &[f32], row: usize) => depthwise_row_with
}

#[inline(always)]
fn depthwise_row_with<const FMA: bool>(buf: &Buffers, c: &ConvStep, w: &[f32], row: usize) {
    let (h, wd, ch, oh, ow) = (c.h, c.w, c.k, c.oh, c.ow);
    let (x, y) = (buf.at(c.x), buf.at_mut(c.y));
    // SAFETY: checked spans.
    let bias = unsafe { std::slice::from_raw_parts(buf.at(c.bias), ch) };
    let (n, oy) = (row / oh, row % oh);
    let mut taps: Vec<(usize, usize)> = Vec::with_capacity(c.kernel[0] * c.kernel[1]);
    for ox in 0..ow {
        let o = ((n * oh + oy) * ow + ox) * ch;
        // SAFETY: checked span; each thread writes its own output rows.
        let out = unsafe { std::slice::from_raw_parts_mut(y.add(o), ch) };
        match c.residual.map(|z| buf.at(z)) {
            // The output written over its residual (`arena::over_residuals`) holds it.
            Some(z) if z == y.cast_const() => {
                out.iter_mut().zip(bias).for_each(|(o, &b)| *o += b);
            }
            Some(z) => {
                let z = unsafe { std::slice::from_raw_parts(z.add(o), ch) };
                for ((o, &b), &z) in out.iter_mut().zip(bias).zip(z) {
                    *o = b + z;
                }
            }
            None => out.copy_from_slice(bias),
        }
        taps.clear();
        for r in 0..c.kernel[0] {
            let iy = (oy * c.strides[0] + r * c.dilations[0]) as isize - c.pads[0] as isize;
            if iy < 0 || iy >= h as isize {
                continue;
            }
            for s in 0..c.kernel[1] {
                let ix = (ox * c.strides[1] + s * c.dilations[1]) as isize - c.pads[1] as isize;
                if ix < 0 || ix >= wd as isize {
                    continue;
                }
                let pixel = (n * h + iy as usize) * wd + ix as usize;
                taps.push((pixel * ch, (r * c.kernel[1] + s) * ch));
            }
        }
        for &(xi, wi) in &taps {
            // SAFETY: inside the checked input span.
            let xs = unsafe { std::slice::from_raw_parts(x.add(xi), ch) };
            let ws = &w[wi..wi + ch];
            for ((o, &a), &b) in out.iter_mut().zip(xs).zip(ws) {
                *o = fma::<FMA>(a, b, *o);
            }
        }
        activate_with::<FMA>(c.act, out);
    }
}

/// One output row of a depthwise convolution in SIMD registers: up to 8 neighbouring output
/// pixels whose taps fall alike (all of them, inside the image) at once, for each block of
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
unsafe fn depthwise_row_avx512(
    buf: &Buffers,
    c: &ConvStep,
    cols: &[Range<usize>],
    w: &[f32],
    row: usize,
) {
    // SAFETY: the caller's.
    unsafe {
        DepthwiseRow::new(buf, c, cols, w, row)
            .run(|row, cb, ox, p, cols| row.pixels_avx512(cb, ox, p, cols))
    }
}

/// `depthwise_row_avx512` in 8-wide registers.
///
/// # Safety
/// As `depthwise_row_avx512`, the CPU having AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn depthwise_row_avx2(
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
        if self.clamp.is_none() {
            // SAFETY: the row's outputs, written above.
            activate_with::<true>(self.c.act, unsafe {
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

/// Any other convolution, as a product of the input's patches and the packed weights, with
/// bias, residual and activation: the patches read where they lie (`Taps`), or unfolded
/// first (im2col, NHWC patches in `col`) where neither a tap nor a kernel row is a run
/// worth finding (`Taps::of`) or the weights are not packed.
pub(super) fn conv_gemm(
    buf: &Buffers,
    c: &ConvStep,
    w: Weights,
    col: &mut Vec<f32>,
    threads: Threads,
) {
    let (x, y) = (buf.at(c.x), buf.at_mut(c.y));
    let (cg, kg) = (c.c / c.group, c.k / c.group);
    let rows = c.kernel[0] * c.kernel[1] * cg;
    let pixels = c.oh * c.ow;
    let pointwise = is_pointwise(c);
    let taps = match w {
        Weights::Panels(_) if !pointwise => Taps::of(c, 0),
        _ => None,
    };
    let indirect = taps.is_some();
    for n in 0..c.n {
        // SAFETY: checked spans.
        let (xb, yb) = unsafe { (x.add(n * c.h * c.w * c.c), y.add(n * pixels * c.k)) };
        let residual = c
            .residual
            .map(|z| unsafe { buf.at(z).add(n * pixels * c.k) });
        if c.group == 1 {
            // Unfolded in blocks of pixels of about 256 KB, which stay in the L2 cache for
            // the product (the weights are packed once, so more calls cost nothing); at
            // least 120 rows, so that the weights read for a block serve enough of them.
            // Several threads take the whole image, which the product shares out, as does a
            // product that reads its input where it lies.
            let block = match (pointwise || indirect, threads.count) {
                (true, _) | (_, 2..) => pixels,
                _ => ((1 << 16) / rows.max(1)).max(120),
            };
            for start in (0..pixels).step_by(block.max(1)) {
                let count = block.min(pixels - start);
                let (lhs, lhs_stride) = if pointwise {
                    // SAFETY: checked span.
                    (unsafe { xb.add(start * c.c) }, c.c)
                } else if indirect {
                    (xb, 0)
                } else {
                    unfold(xb, c, 0, start, count, col);
                    (col.as_ptr(), rows)
                };
                // SAFETY: checked spans; `col` holds `count × rows` values.
                let product = unsafe {
                    Product {
                        rows: count,
                        n: c.k,
                        k: rows,
                        x: lhs,
                        x_stride: lhs_stride,
                        taps: taps.map(|t| t.skip_rows(start)),
                        w,
                        y: yb.add(start * c.k),
                        y_stride: c.k,
                        alpha: 1.0,
                        bias: Some(buf.at(c.bias)),
                        residual: residual.map(|z| z.add(start * c.k)),
                        act: c.act,
                    }
                };
                product.run(threads);
            }
            continue;
        }
        let Weights::Strided { ptr: w, .. } = w else {
            unreachable!("grouped convolutions keep their weights per group (`pack`)");
        };
        epilogue_init(yb, pixels, c.k, c.k, Some(buf.at(c.bias)), residual);
        for g in 0..c.group {
            let (lhs, lhs_rs) = if pointwise {
                (unsafe { xb.add(g * cg) }, c.c)
            } else {
                unfold(xb, c, g, 0, pixels, col);
                (col.as_ptr(), rows)
            };
            // SAFETY: checked spans; `col` holds `pixels × rows` values.
            unsafe {
                gemm::gemm(
                    pixels,
                    kg,
                    rows,
                    yb.add(g * kg),
                    1,
                    c.k as isize,
                    true,
                    lhs,
                    1,
                    lhs_rs as isize,
                    w.add(g * rows * kg),
                    1,
                    kg as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    threads.gemm(),
                )
            };
        }
        // SAFETY: checked span.
        activate(c.act, unsafe {
            std::slice::from_raw_parts_mut(yb, pixels * c.k)
        });
    }
}

/// im2col for group `g` of one image, output pixels `start..start + count`: for each, its
/// kernel's taps in order, each the group's input channels (zeros outside the image).
fn unfold(x: *const f32, c: &ConvStep, g: usize, start: usize, count: usize, col: &mut Vec<f32>) {
    let cg = c.c / c.group;
    let rows = c.kernel[0] * c.kernel[1] * cg;
    col.resize(count * rows, 0.0);
    let mut dst = 0;
    // Where the taps of a kernel row are neighbours in the input (no dilation along the
    // row, one group), the row's patch is one run of `kernel[1] × c` values: one copy
    // instead of a copy per tap (three values each for an RGB input).
    let runs = c.group == 1 && c.dilations[1] == 1;
    let row_len = c.kernel[1] * cg;
    for pixel in start..start + count {
        let (oy, ox) = (pixel / c.ow, pixel % c.ow);
        for r in 0..c.kernel[0] {
            let iy = (oy * c.strides[0] + r * c.dilations[0]) as isize - c.pads[0] as isize;
            let ix0 = (ox * c.strides[1]) as isize - c.pads[1] as isize;
            if iy < 0 || iy >= c.h as isize {
                col[dst..dst + row_len].fill(0.0);
                dst += row_len;
                continue;
            }
            if runs && ix0 >= 0 && ix0 as usize + c.kernel[1] <= c.w {
                let at = (iy as usize * c.w + ix0 as usize) * c.c;
                // SAFETY: inside the checked input span (the run ends inside the row).
                col[dst..dst + row_len]
                    .copy_from_slice(unsafe { std::slice::from_raw_parts(x.add(at), row_len) });
                dst += row_len;
                continue;
            }
            for s in 0..c.kernel[1] {
                let ix = ix0 + (s * c.dilations[1]) as isize;
                let out = &mut col[dst..dst + cg];
                if ix < 0 || ix >= c.w as isize {
                    out.fill(0.0);
                } else {
                    let at = (iy as usize * c.w + ix as usize) * c.c + g * cg;
                    // SAFETY: inside the checked input span.
                    out.copy_from_slice(unsafe { std::slice::from_raw_parts(x.add(at), cg) });
                }
                dst += cg;
            }
        }
    }
}

/// Zeros, for the taps that fall outside the image.
pub(super) static ZEROS: [f32; 4096] = [0.0; 4096];

/// The left-hand matrix of a convolution's product read where it lies (indirect
/// convolution) instead of unfolded: row `i` is output pixel `first + i` of the image at
/// `Product::x`, and its values are the kernel's taps in order, each the input's channels at
/// that tap (zeros outside the image). Unfolding wrote and read again a matrix 9 times the
/// input (3×3): 2.5 % of ResNet-50's time.
///
/// Where a tap has too few channels to be worth finding (an RGB input), the runs found are
/// the kernel's rows instead: a row's taps lie side by side in the NHWC input, so that
/// ResNet-50's 7×7 stem reads runs of 21 values instead of 3, and is not unfolded. A row
/// that is partly outside the image is copied, with its zeros, into a scratch buffer.
#[derive(Clone, Copy)]
pub(super) struct Taps {
    conv: *const ConvStep,
    first: usize,
    /// Whether each run is a kernel row (`kernel[1]` taps) rather than one tap.
    rows: bool,
}

impl Taps {
    /// The channels a tap may have: with fewer, the tile would find its rows again every
    /// few steps; more do not fit in `ZEROS`.
    const CHANNELS: std::ops::RangeInclusive<usize> = 32..=ZEROS.len();
    /// The values a kernel row may have, read as one run.
    const ROW_VALUES: std::ops::RangeInclusive<usize> = 8..=ZEROS.len();

    /// The taps of `c` read where they lie, from output pixel `first` on: one tap a run, or
    /// one kernel row where a tap's channels are few and a row's taps are neighbours (one
    /// group, no dilation along the row). `None` where neither applies.
    pub(super) fn of(c: &ConvStep, first: usize) -> Option<Taps> {
        let row = c.kernel[1] * c.c;
        let rows = if Self::CHANNELS.contains(&c.c) {
            false
        } else if c.group == 1 && c.dilations[1] == 1 && Self::ROW_VALUES.contains(&row) {
            true
        } else {
            return None;
        };
        Some(Taps {
            conv: c,
            first,
            rows,
        })
    }

    fn conv(&self) -> &ConvStep {
        // SAFETY: the plan's step outlives the product (`conv_gemm`).
        unsafe { &*self.conv }
    }

    /// The same taps from `rows` rows further on.
    pub(super) fn skip_rows(self, rows: usize) -> Taps {
        Taps {
            first: self.first + rows,
            ..self
        }
    }

    /// Runs of the kernel: its taps, or its rows.
    pub(super) fn count(&self) -> usize {
        let c = self.conv();
        if self.rows {
            c.kernel[0]
        } else {
            c.kernel[0] * c.kernel[1]
        }
    }

    /// Values of each run: the input's channels, for each tap of a row.
    pub(super) fn len(&self) -> usize {
        let c = self.conv();
        if self.rows { c.kernel[1] * c.c } else { c.c }
    }

    /// Where each run of rows `rows` begins, `count()` a row, for the image at `x`; the
    /// copies of rows partly outside the image go to `scratch`.
    ///
    /// The output pixels are walked along their rows, not found by division, and a pixel
    /// whose kernel lies inside the image along x takes the fast path: with a division per
    /// pixel, finding the runs took 29 % of the samples of MobileNetV2's first convolution
    /// (k = 27, so a tile has little arithmetic to hide it).
    pub(super) fn find(
        &self,
        x: *const f32,
        rows: Range<usize>,
        table: &mut Vec<*const f32>,
        scratch: &mut Vec<f32>,
    ) {
        let c = self.conv();
        table.clear();
        scratch.clear();
        table.reserve(rows.len() * self.count());
        let at = |iy: usize, ix: usize| x.wrapping_add((iy * c.w + ix) * c.c);
        let [sy, sx] = c.strides;
        let [dy, dx] = c.dilations;
        let kw = c.kernel[1];
        let runs = if self.rows { 1 } else { kw };
        let pixel = self.first + rows.start;
        let (mut oy, mut ox) = (pixel / c.ow, pixel % c.ow);
        for _ in rows {
            let ix = |s: usize| {
                (ox * sx + s * dx)
                    .checked_sub(c.pads[1])
                    .filter(|&ix| ix < c.w)
            };
            let inside = match (ix(0), ix(kw - 1)) {
                (Some(first), Some(_)) => Some(first),
                _ => None,
            };
            for r in 0..c.kernel[0] {
                let iy = (oy * sy + r * dy)
                    .checked_sub(c.pads[0])
                    .filter(|&iy| iy < c.h);
                match (iy, inside) {
                    (None, _) => table.extend(std::iter::repeat_n(ZEROS.as_ptr(), runs)),
                    (Some(iy), Some(first)) => {
                        let run = at(iy, first);
                        if self.rows {
                            table.push(run);
                        } else {
                            table.extend((0..kw).map(|s| run.wrapping_add(s * dx * c.c)));
                        }
                    }
                    (Some(iy), None) if !self.rows => {
                        table.extend((0..kw).map(|s| match ix(s) {
                            Some(ix) => at(iy, ix),
                            None => ZEROS.as_ptr(),
                        }));
                    }
                    (Some(iy), None) => {
                        // Null until `scratch` is whole and cannot move.
                        table.push(std::ptr::null());
                        for s in 0..kw {
                            match ix(s) {
                                // SAFETY: inside the checked input span.
                                Some(ix) => scratch.extend_from_slice(unsafe {
                                    std::slice::from_raw_parts(at(iy, ix), c.c)
                                }),
                                None => scratch.extend_from_slice(&ZEROS[..c.c]),
                            }
                        }
                    }
                }
            }
            ox += 1;
            if ox == c.ow {
                (oy, ox) = (oy + 1, 0);
            }
        }
        if scratch.is_empty() {
            return;
        }
        let mut copies = scratch.chunks_exact(self.len());
        for run in table.iter_mut().filter(|run| run.is_null()) {
            *run = copies
                .next()
                .expect("a copy for each row partly outside")
                .as_ptr();
        }
    }
}
