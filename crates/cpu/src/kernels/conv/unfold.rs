// SPDX-License-Identifier: MPL-2.0
//! Convolutions other than depthwise, as a matrix product of their taps: read where they
//! lie (`Taps`, the product's left-hand matrix found through a pointer per row and tap) or
//! unfolded first (im2col). Apart from `depthwise`, with which they share only the step.

use std::ops::Range;

use super::is_pointwise;
use crate::kernels::panels::Panels;
use crate::kernels::product::{Product, Weights};
use crate::kernels::{Buffers, Out, Threads};
use trtclassify_compiler::plan::ConvStep;

/// A convolution of one group (not depthwise: `depthwise` takes those; nor, with AVX-512, one
/// of few channels: `x86_64::few_channels`), as a product of
/// the input's patches and the packed weights, with bias, residual and activation: the
/// patches read where they lie (`Taps`), or unfolded first (im2col, NHWC patches in `col`)
/// where neither a tap nor a kernel row is a run worth finding (`Taps::of`). The output's
/// rows (pixels) go to `out`, `out.stride` values apart.
pub(in crate::kernels) fn conv_gemm(
    buf: &Buffers,
    c: &ConvStep,
    panels: &Panels,
    col: &mut Vec<f32>,
    out: Out,
    threads: Threads,
) {
    let (x, y) = (buf.at(c.x), buf.at_mut(out.y));
    let rows = c.kernel[0] * c.kernel[1] * c.c;
    let pixels = c.oh * c.ow;
    let pointwise = is_pointwise(c);
    let taps = match pointwise {
        false => Taps::of(c, 0),
        true => None,
    };
    let indirect = taps.is_some();
    // Unfolded in blocks of pixels of about 256 KB, which stay in the L2 cache for the
    // product (the weights are packed once, so more calls cost nothing); at least 120 rows,
    // so that the weights read for a block serve enough of them. Several threads take the
    // whole image, which the product shares out, as does a product that reads its input
    // where it lies.
    let block = match (pointwise || indirect, threads.count) {
        (true, _) | (_, 2..) => pixels,
        _ => ((1 << 16) / rows.max(1)).max(120),
    };
    for n in 0..c.n {
        // SAFETY: checked spans.
        let (xb, yb) = unsafe { (x.add(n * c.h * c.w * c.c), y.add(n * pixels * out.stride)) };
        // A residual is the output's shape (`concat_in_place` redirects none).
        debug_assert!(c.residual.is_none() || out.stride == c.k);
        let residual = c
            .residual
            .map(|z| unsafe { buf.at(z).add(n * pixels * c.k) });
        for start in (0..pixels).step_by(block.max(1)) {
            let count = block.min(pixels - start);
            let (lhs, lhs_stride) = if pointwise {
                // SAFETY: checked span.
                (unsafe { xb.add(start * c.c) }, c.c)
            } else if indirect {
                (xb, 0)
            } else {
                col.resize(count * rows, 0.0);
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
                    w: Weights::Panels(panels),
                    y: yb.add(start * out.stride),
                    y_stride: out.stride,
                    alpha: 1.0,
                    bias: Some(buf.at(c.bias)),
                    residual: residual.map(|z| z.add(start * c.k)),
                    act: c.act,
                }
            };
            product.run(threads);
        }
    }
}

/// The pixels of each of a grouped convolution's products: the whole image where it is
/// 1×1 (read as it lies), else a block whose taps (`rows` values a pixel) take about
/// 256 KB, which stays in the L2 cache, and at least 120 pixels, so that the weights read
/// for a block serve enough of them.
pub(crate) fn group_block(c: &ConvStep) -> usize {
    let pixels = c.oh * c.ow;
    if is_pointwise(c) {
        return pixels;
    }
    let rows = c.kernel[0] * c.kernel[1] * (c.c / c.group);
    ((1 << 16) / rows.max(1)).max(120).min(pixels)
}

/// A grouped convolution (not depthwise: `depthwise` takes those), as one product for each
/// group and block of pixels: the group's channels of each tap (read where they lie,
/// `Taps`, or unfolded; of the input where it is 1×1) times the group's panels, with the
/// group's part of the bias, residual and activation. The threads share out the (block,
/// group) pairs, each product on one: a product shared out would hand work to the threads
/// once per group (24 in a RegNet layer) instead of once.
///
/// A block's groups run one after the other, so that its input, which they all read (a
/// cache line holds the channels of several), stays in the cache; where the taps are read
/// in place, they share the runs found once for the block. Found again for each group (25
/// in RegNetX-400MF's last layers), the runs took 7 % of that model's time, and with the
/// groups one after the other, its first grouped layer's two (16 channels each of a
/// 1.6 MB input) each read half of every line: the model's grouped steps took 2.5 ms on
/// one thread of the Xeon, against 1.9 now.
///
/// Only groups of fewer than 8 channels unfold, a block (about 256 KB) at a time, which
/// stays in the L2 cache for its product: each group unfolding its whole image wrote and
/// read again 1.8 MB a group in RegNetX-400MF's first grouped layer.
pub(in crate::kernels) fn conv_groups(
    buf: &Buffers,
    c: &ConvStep,
    panels: &[Panels],
    col: &mut Vec<f32>,
    out: Out,
    threads: Threads,
) {
    let (cg, kg) = (c.c / c.group, c.k / c.group);
    debug_assert!(c.residual.is_none() || out.stride == c.k);
    let rows = c.kernel[0] * c.kernel[1] * cg;
    let pixels = c.oh * c.ow;
    let pointwise = is_pointwise(c);
    let taps = match pointwise {
        false => Taps::of(c, 0),
        true => None,
    };
    let unfolded = !pointwise && taps.is_none();
    let shared = taps.filter(|_| Taps::shares_runs(c));
    let block = group_block(c);
    let blocks = pixels.div_ceil(block.max(1));
    let units = c.n * blocks * c.group;
    // The units shared out over the threads as they are, or, where they unfold or share
    // their runs, in one part of consecutive units for each thread, each with its own part
    // of `col` or its own runs. (Two parts of units read in place ran RegNetX-400MF's
    // grouped steps on two threads no faster than on one.)
    let parts = match unfolded || shared.is_some() {
        true => threads.count.clamp(1, units.max(1)),
        false => units,
    };
    if unfolded {
        col.resize(parts * block * rows, 0.0);
    }
    let col = col.as_mut_ptr() as usize;
    let part = |p: usize| {
        // The runs of the (image, block) of the last unit, where the groups share them.
        let (mut table, mut scratch, mut found) = (Vec::new(), Vec::new(), None);
        for unit in p * units / parts..(p + 1) * units / parts {
            let (n, start, g) = (
                unit / (blocks * c.group),
                unit / c.group % blocks * block,
                unit % c.group,
            );
            let count = block.min(pixels - start);
            // SAFETY: checked spans; part `p` writes only its part of `col`, and each unit
            // only its group's channels of its block of the output. The runs shared hold
            // the image's every group (`shares_runs`), and outlive the product.
            unsafe {
                let xb = buf.at(c.x).add(n * c.h * c.w * c.c);
                let at = (n * pixels + start) * c.k + g * kg;
                let out_at = (n * pixels + start) * out.stride + g * kg;
                let mut taps = taps.map(|t| t.skip_rows(start));
                if let Some(block_taps) = shared.map(|t| t.skip_rows(start)) {
                    if found != Some((n, start)) {
                        block_taps.find(xb, 0..count, &mut table, &mut scratch);
                        found = Some((n, start));
                    }
                    taps = Some(block_taps.reading(table.as_ptr(), g * cg));
                }
                let (lhs, lhs_stride) = if pointwise {
                    (xb.add(start * c.c + g * cg), c.c)
                } else if taps.is_some() {
                    // The group's channels of each tap, where they lie.
                    (xb.add(g * cg), 0)
                } else {
                    let mine = (col as *mut f32).add(p * block * rows);
                    let mine = std::slice::from_raw_parts_mut(mine, count * rows);
                    unfold(xb, c, g, start, count, mine);
                    (mine.as_ptr(), rows)
                };
                Product {
                    rows: count,
                    n: kg,
                    k: rows,
                    x: lhs,
                    x_stride: lhs_stride,
                    taps,
                    w: Weights::Panels(&panels[g]),
                    y: buf.at_mut(out.y).add(out_at),
                    y_stride: out.stride,
                    alpha: 1.0,
                    bias: Some(buf.at(c.bias).add(g * kg)),
                    residual: c.residual.map(|z| buf.at(z).add(at)),
                    act: c.act,
                }
                .run(threads.single());
            }
        }
    };
    threads.for_each(parts, part);
}

/// im2col for group `g` of one image, output pixels `start..start + count`: for each, its
/// kernel's taps in order, each the group's input channels (zeros outside the image).
fn unfold(x: *const f32, c: &ConvStep, g: usize, start: usize, count: usize, col: &mut [f32]) {
    let cg = c.c / c.group;
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
                copy_run(&mut col[dst..dst + row_len], unsafe {
                    std::slice::from_raw_parts(x.add(at), row_len)
                });
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
                    copy_run(out, unsafe { std::slice::from_raw_parts(x.add(at), cg) });
                }
                dst += cg;
            }
        }
    }
}

/// `to = from`, in moves of 8 values inline: the runs here are a group's channels or a
/// kernel row (8 to a few hundred values), for which a call to `memmove` (what
/// `copy_from_slice` becomes) cost more than the copy: 17 % of RegNet-X-400MF's time.
#[inline(always)]
fn copy_run(to: &mut [f32], from: &[f32]) {
    let mut to = to.chunks_exact_mut(8);
    let mut from = from.chunks_exact(8);
    for (t, f) in (&mut to).zip(&mut from) {
        let f: [f32; 8] = f.try_into().expect("8 values");
        t.copy_from_slice(&f);
    }
    for (t, &f) in to.into_remainder().iter_mut().zip(from.remainder()) {
        *t = f;
    }
}

/// Zeros, for the taps that fall outside the image.
pub(in crate::kernels) static ZEROS: [f32; 4096] = [0.0; 4096];

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
pub(in crate::kernels) struct Taps {
    conv: *const ConvStep,
    first: usize,
    /// Whether each run is a kernel row (`kernel[1]` taps) rather than one tap.
    rows: bool,
    /// The runs found beforehand, from row `first` on (a grouped convolution's, which its
    /// groups share), and the offset of this product's channels in each; else each product
    /// finds its own.
    found: Option<(*const *const f32, usize)>,
}

// SAFETY: `conv` points at the plan's step, which the threads of a step only read and which
// outlives the step.
unsafe impl Sync for Taps {}

impl Taps {
    /// The channels a tap may have: with fewer, the tile would find its rows again every
    /// few steps; more do not fit in `ZEROS`.
    const CHANNELS: std::ops::RangeInclusive<usize> = 32..=ZEROS.len();
    /// The values a kernel row may have, read as one run.
    const ROW_VALUES: std::ops::RangeInclusive<usize> = 8..=ZEROS.len();
    /// The channels a group's tap may have: the alternative, unfolding, copies every tap
    /// (RegNet's groups have 8 to 24 channels).
    const GROUP_CHANNELS: std::ops::RangeInclusive<usize> = 8..=ZEROS.len();

    /// The taps of `c` read where they lie, from output pixel `first` on: one tap a run, or
    /// one kernel row where a tap's channels are few and a row's taps are neighbours (one
    /// group, no dilation along the row). `None` where neither applies.
    pub(in crate::kernels) fn of(c: &ConvStep, first: usize) -> Option<Taps> {
        let row = c.kernel[1] * c.c;
        let cg = c.c / c.group;
        let rows =
            if Self::CHANNELS.contains(&cg) || c.group > 1 && Self::GROUP_CHANNELS.contains(&cg) {
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
            found: None,
        })
    }

    /// The same taps, their runs read from `table` (found by `find` from row `first` on,
    /// for the image at group 0), `offset` values into each: one group's channels.
    ///
    /// # Safety
    /// `table` outlives the products that read these taps and holds their rows' runs; every
    /// run found holds `offset` more values than the taps' `len`: the image's other groups,
    /// or `ZEROS` (`shares_runs`).
    pub(in crate::kernels) unsafe fn reading(
        self,
        table: *const *const f32,
        offset: usize,
    ) -> Taps {
        Taps {
            found: Some((table, offset)),
            ..self
        }
    }

    /// Whether the groups of `c` may share their runs (`reading`): a run that falls outside
    /// the image is read from `ZEROS` at any group's offset.
    pub(in crate::kernels) fn shares_runs(c: &ConvStep) -> bool {
        c.c <= ZEROS.len()
    }

    /// The runs of rows `rows`, `count()` a row, and the offset to read them at: the table
    /// found beforehand (`reading`), or found now into `table` for the image at `x`.
    pub(in crate::kernels) fn runs(
        &self,
        x: *const f32,
        rows: Range<usize>,
        table: &mut Vec<*const f32>,
        scratch: &mut Vec<f32>,
    ) -> (*const *const f32, usize) {
        match self.found {
            Some((found, offset)) => (found.wrapping_add(rows.start * self.count()), offset),
            None => {
                self.find(x, rows, table, scratch);
                (table.as_ptr(), 0)
            }
        }
    }

    fn conv(&self) -> &ConvStep {
        // SAFETY: the plan's step outlives the product (`conv_gemm`).
        unsafe { &*self.conv }
    }

    /// The same taps from `rows` rows further on.
    pub(in crate::kernels) fn skip_rows(self, rows: usize) -> Taps {
        Taps {
            first: self.first + rows,
            found: self
                .found
                .map(|(table, offset)| (table.wrapping_add(rows * self.count()), offset)),
            ..self
        }
    }

    /// Runs of the kernel: its taps, or its rows.
    pub(in crate::kernels) fn count(&self) -> usize {
        let c = self.conv();
        if self.rows {
            c.kernel[0]
        } else {
            c.kernel[0] * c.kernel[1]
        }
    }

    /// Values of each run: a group's input channels, for each tap of a row.
    pub(in crate::kernels) fn len(&self) -> usize {
        let c = self.conv();
        if self.rows {
            c.kernel[1] * c.c
        } else {
            c.c / c.group
        }
    }

    /// Where each run of rows `rows` begins, `count()` a row, for the image at `x`; the
    /// copies of rows partly outside the image go to `scratch`.
    ///
    /// The output pixels are walked along their rows, not found by division, and a pixel
    /// whose kernel lies inside the image along x takes the fast path: with a division per
    /// pixel, finding the runs took 29 % of the samples of MobileNetV2's first convolution
    /// (k = 27, so a tile has little arithmetic to hide it).
    pub(in crate::kernels) fn find(
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
        // The input row of each kernel row, for the current output row.
        let kernel_rows = |oy: usize| {
            (0..c.kernel[0]).map(move |r| {
                (oy * sy + r * dy)
                    .checked_sub(c.pads[0])
                    .filter(|&iy| iy < c.h)
            })
        };
        let mut iys: Vec<Option<usize>> = kernel_rows(oy).collect();
        // Where the copies of rows partly outside go in `table`: `scratch` may move until
        // it is whole. (Looking for them in the whole table took a fifth of the time here.)
        let mut holes = Vec::new();
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
            for &iy in &iys {
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
                        holes.push(table.len());
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
                iys.clear();
                iys.extend(kernel_rows(oy));
            }
        }
        debug_assert_eq!(
            holes.len() * self.len(),
            scratch.len(),
            "a copy for each hole"
        );
        for (hole, copy) in holes.into_iter().zip(scratch.chunks_exact(self.len())) {
            table[hole] = copy.as_ptr();
        }
    }
}
