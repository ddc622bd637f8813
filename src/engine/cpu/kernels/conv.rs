// SPDX-License-Identifier: MPL-2.0
//! Convolutions: depthwise ones as loops along the NHWC channels, the others unfolded
//! (im2col) into a matrix product, with their weights packed once for each.

#[cfg(target_arch = "x86_64")]
use std::ops::Range;
use std::sync::Arc;

use super::panels::Panels;
use super::product::{Product, Weights, epilogue_init};
use super::{Aligned, Buffers, Packed, Threads, fma};
#[cfg(target_arch = "x86_64")]
use crate::engine::compiler::ir::Act;
use crate::engine::compiler::plan::{ConvStep, Loc, Step};
use crate::engine::cpu::vector::activate;

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
        return Packed::Depthwise(Aligned::from_slice(&packed));
    }
    let (cg, kg) = (c.c / c.group, c.k / c.group);
    let rows = taps * cg;
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
    Packed::Gemm(packed)
}

/// Depthwise convolution, NHWC: for each output pixel, each tap's channels multiplied and
/// added along the channel vector.
pub(super) fn depthwise(buf: &Buffers, c: &ConvStep, w: &[f32], threads: Threads) {
    #[cfg(target_arch = "x86_64")]
    if threads.avx512 {
        // SAFETY: the CPU has AVX-512F (`Threads::new`); the weights are the step's,
        // packed by `pack`.
        return threads.for_each(c.n * c.oh, |row| unsafe {
            depthwise_row_avx512(buf, c, w, row)
        });
    }
    threads.for_each(c.n * c.oh, |row| depthwise_row(buf, c, w, row));
}

/// The kernel positions along one axis that land inside the input for output position
/// `o` (a contiguous range, the input position growing with the kernel's).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn taps_inside(
    o: usize,
    stride: usize,
    dilation: usize,
    pad: usize,
    kernel: usize,
    len: usize,
) -> Range<usize> {
    let start = (o * stride) as isize - pad as isize;
    let at = |t: usize| start + (t * dilation) as isize;
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
        match c.residual {
            Some(z) => {
                let z = unsafe { std::slice::from_raw_parts(buf.at(z).add(o), ch) };
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
        // SAFETY: FMA is true on x86_64 only where the CPU has AVX2 and FMA (`wide!`);
        // the taps lie inside the checked input span and the packed weights.
        #[cfg(target_arch = "x86_64")]
        let done = if FMA {
            unsafe { accumulate_avx2(out, x, w, &taps) }
        } else {
            0
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        for &(xi, wi) in &taps {
            // SAFETY: inside the checked input span.
            let xs = unsafe { std::slice::from_raw_parts(x.add(xi + done), ch - done) };
            let ws = &w[wi + done..wi + ch];
            for ((o, &a), &b) in out[done..].iter_mut().zip(xs).zip(ws) {
                *o = fma::<FMA>(a, b, *o);
            }
        }
        activate(c.act, out);
    }
}

/// Adds each tap's inputs times its weights to `out`, 32 channels at a time in registers
/// over all the taps; returns how many leading channels it did (a multiple of 8).
///
/// # Safety
/// The CPU has AVX2 and FMA; each tap's `x` offset starts `out.len()` readable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate_avx2(
    out: &mut [f32],
    x: *const f32,
    w: &[f32],
    taps: &[(usize, usize)],
) -> usize {
    use std::arch::x86_64::*;
    let ch = out.len();
    let o = out.as_mut_ptr();
    let mut cb = 0;
    // SAFETY: the caller's; every load and store lies within `cb + 32 <= ch` (or `+ 8`).
    unsafe {
        while cb + 32 <= ch {
            let mut acc = [
                _mm256_loadu_ps(o.add(cb)),
                _mm256_loadu_ps(o.add(cb + 8)),
                _mm256_loadu_ps(o.add(cb + 16)),
                _mm256_loadu_ps(o.add(cb + 24)),
            ];
            for &(xi, wi) in taps {
                let (xp, wp) = (x.add(xi + cb), w.as_ptr().add(wi + cb));
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(
                        _mm256_loadu_ps(xp.add(8 * j)),
                        _mm256_loadu_ps(wp.add(8 * j)),
                        *a,
                    );
                }
            }
            for (j, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(cb + 8 * j), *a);
            }
            cb += 32;
        }
        while cb + 8 <= ch {
            let mut acc = _mm256_loadu_ps(o.add(cb));
            for &(xi, wi) in taps {
                acc = _mm256_fmadd_ps(
                    _mm256_loadu_ps(x.add(xi + cb)),
                    _mm256_loadu_ps(w.as_ptr().add(wi + cb)),
                    acc,
                );
            }
            _mm256_storeu_ps(o.add(cb), acc);
            cb += 8;
        }
    }
    cb
}

/// One output row of a depthwise convolution in 16-wide registers: for each block of 16
/// channels, up to 8 neighbouring output pixels whose taps fall alike (all of them, inside
/// the image) at once, each's sums in a register over all the taps (8 chains of additions
/// instead of one, whose latency bound a pixel at a time) and stored once; the clamp of ReLU
/// or clipping on the registers, other activations over the whole row after.
///
/// # Safety
/// The CPU has AVX-512F; `w` holds the packed weights (`[taps][channels]`) of `c`, whose
/// spans were checked.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn depthwise_row_avx512(buf: &Buffers, c: &ConvStep, w: &[f32], row: usize) {
    let (ch, oh, ow) = (c.k, c.oh, c.ow);
    let (n, oy) = (row / oh, row % oh);
    let cols: Vec<Range<usize>> = (0..ow)
        .map(|ox| {
            taps_inside(
                ox,
                c.strides[1],
                c.dilations[1],
                c.pads[1],
                c.kernel[1],
                c.w,
            )
        })
        .collect();
    let o = (n * oh + oy) * ow * ch;
    // SAFETY: checked spans.
    let row = unsafe {
        DepthwiseRow {
            c,
            n,
            oy,
            rows: taps_inside(
                oy,
                c.strides[0],
                c.dilations[0],
                c.pads[0],
                c.kernel[0],
                c.h,
            ),
            x: buf.at(c.x),
            w: w.as_ptr(),
            y: buf.at_mut(c.y).add(o),
            bias: buf.at(c.bias),
            residual: c.residual.map(|z| buf.at(z).add(o)),
            clamp: match c.act {
                Act::Relu => Some((0.0, f32::INFINITY)),
                Act::Clip(lo, hi) => Some((lo, hi)),
                _ => None,
            },
        }
    };
    for cb in (0..ch).step_by(16) {
        let mut ox = 0;
        while ox < ow {
            let same = cols[ox..]
                .iter()
                .take(8)
                .take_while(|&t| *t == cols[ox])
                .count();
            // SAFETY: the caller's; `ox..ox + same` are output pixels of the row.
            unsafe {
                match same {
                    8 => row.pixels::<8>(cb, ox, &cols[ox]),
                    7 => row.pixels::<7>(cb, ox, &cols[ox]),
                    6 => row.pixels::<6>(cb, ox, &cols[ox]),
                    5 => row.pixels::<5>(cb, ox, &cols[ox]),
                    4 => row.pixels::<4>(cb, ox, &cols[ox]),
                    3 => row.pixels::<3>(cb, ox, &cols[ox]),
                    2 => row.pixels::<2>(cb, ox, &cols[ox]),
                    _ => row.pixels::<1>(cb, ox, &cols[ox]),
                }
            }
            ox += same.max(1);
        }
    }
    if row.clamp.is_none() {
        // SAFETY: the row's outputs, written above.
        activate(c.act, unsafe {
            std::slice::from_raw_parts_mut(row.y, ow * ch)
        });
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
    x: *const f32,
    w: *const f32,
    /// The row's first output.
    y: *mut f32,
    bias: *const f32,
    residual: Option<*const f32>,
    clamp: Option<(f32, f32)>,
}

#[cfg(target_arch = "x86_64")]
impl DepthwiseRow<'_> {
    /// Output pixels `ox..ox + P`, channels `cb..cb + 16` (fewer at the end), their taps
    /// the kernel columns `cols`.
    ///
    /// # Safety
    /// As `depthwise_row_avx512`.
    #[inline(always)]
    unsafe fn pixels<const P: usize>(&self, cb: usize, ox: usize, cols: &Range<usize>) {
        use std::arch::x86_64::*;
        let c = self.c;
        let ch = c.k;
        let mask = ((1u32 << (ch - cb).min(16)) - 1) as __mmask16;
        // SAFETY: the caller's; every load and store is masked to the channels that exist,
        // the taps to those inside the input.
        unsafe {
            let load = |p: *const f32| _mm512_maskz_loadu_ps(mask, p);
            let mut acc = [load(self.bias.add(cb)); P];
            if let Some(z) = self.residual {
                for (p, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_add_ps(*acc, load(z.add((ox + p) * ch + cb)));
                }
            }
            // A pixel whose taps all fall outside the input (padding wider than the kernel)
            // is its bias.
            let ix0 = (ox * c.strides[1] + cols.start * c.dilations[1])
                .checked_sub(c.pads[1])
                .filter(|_| !cols.is_empty());
            if let Some(ix0) = ix0 {
                for r in self.rows.clone() {
                    let iy = self.oy * c.strides[0] + r * c.dilations[0] - c.pads[0];
                    let xs = self.x.add(((self.n * c.h + iy) * c.w + ix0) * ch + cb);
                    let ws = self.w.add((r * c.kernel[1] + cols.start) * ch + cb);
                    for s in 0..cols.len() {
                        let wv = load(ws.add(s * ch));
                        let xs = xs.add(s * c.dilations[1] * ch);
                        for (p, acc) in acc.iter_mut().enumerate() {
                            *acc = _mm512_fmadd_ps(load(xs.add(p * c.strides[1] * ch)), wv, *acc);
                        }
                    }
                }
            }
            if let Some((lo, hi)) = self.clamp {
                let (lo, hi) = (_mm512_set1_ps(lo), _mm512_set1_ps(hi));
                for acc in acc.iter_mut() {
                    *acc = _mm512_min_ps(_mm512_max_ps(*acc, lo), hi);
                }
            }
            for (p, acc) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(self.y.add((ox + p) * ch + cb), mask, *acc);
            }
        }
    }
}

/// Any other convolution: the input unfolded (im2col, NHWC patches in `col`) times the
/// packed weights, with bias, residual and activation.
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
            // Several threads take the whole image, which the product shares out.
            let block = match (pointwise, threads.count) {
                (true, _) | (_, 2..) => pixels,
                _ => ((1 << 16) / rows.max(1)).max(120),
            };
            for start in (0..pixels).step_by(block.max(1)) {
                let count = block.min(pixels - start);
                let (lhs, lhs_stride) = if pointwise {
                    (xb, c.c)
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
                        x: if pointwise { lhs.add(start * c.c) } else { lhs },
                        x_stride: lhs_stride,
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
