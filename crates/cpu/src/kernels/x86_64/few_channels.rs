// SPDX-License-Identifier: MPL-2.0
//! Convolutions of few input channels (a network's first layer on RGB or grey frames) in
//! AVX-512 registers, straight from the NHWC input: each input value broadcast and
//! multiplied with a row of the packed weights for up to 8 neighbouring output pixels at
//! once. As a product of the taps (`conv_gemm`), such a layer has only 27 steps along k
//! (3×3 × RGB) for each tile's 9 to 12 pointers to its runs, and took twice onnxruntime's
//! time (MnasNet's 3→16 stem at 224×224: 0.14 against 0.06 ms, AMD EPYC).

use std::arch::x86_64::*;
use std::ops::Range;

use super::depthwise::taps_inside;
use crate::kernels::panels::{Panels, even_parts};
use crate::kernels::{Buffers, activate, clamp_of};
use trtclassify_compiler::plan::ConvStep;

/// Whether `few_channels_row_avx512` takes `c`: one group of up to 4 input channels, up to
/// 32 output channels (two registers a pixel).
pub(in crate::kernels) fn fits(c: &ConvStep) -> bool {
    c.group == 1 && c.c <= 4 && c.k <= 32
}

/// One output row (`row` of `n · oh`) of `c`, whose weights `panels` holds as the product's
/// right-hand matrix (`[kernel positions × input channels][output channels]`).
///
/// # Safety
/// The CPU has AVX-512F; `fits(c)`; `panels` is `c`'s, whose spans were checked.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(in crate::kernels) unsafe fn few_channels_row_avx512(
    buf: &Buffers,
    c: &ConvStep,
    panels: &Panels,
    row: usize,
) {
    debug_assert!(fits(c));
    let (oh, ow) = (c.oh, c.ow);
    let (n, oy) = (row / oh, row % oh);
    let o = (n * oh + oy) * ow * c.k;
    // The second panel exists where there are more than 16 output channels; otherwise no
    // tile reads it.
    let first = panels.panel(0);
    let second = if c.k > 16 {
        panels.panel(16)
    } else {
        (first.0, 0)
    };
    let width = [first.1, second.1];
    // SAFETY: the caller's: checked spans.
    let row = unsafe {
        Row {
            c,
            n,
            oy,
            rows: taps_inside(c, 0, oy),
            x: buf.at(c.x),
            w: [first.0, second.0],
            w_masks: width.map(|width| ((1u32 << width) - 1) as __mmask16),
            width,
            y: buf.at_mut(c.y).add(o),
            bias: buf.at(c.bias),
            residual: c.residual.map(|z| buf.at(z).add(o)),
            clamp: clamp_of(c.act),
        }
    };
    // Tiles of near-equal sizes, as the depthwise rows' (`tiles_avx512`).
    let mut ox = 0;
    for p in even_parts(ow, 8) {
        let ix0 = (ox * c.strides[1]) as isize - c.pads[1] as isize;
        let reach = ((p - 1) * c.strides[1] + (c.kernel[1] - 1) * c.dilations[1]) as isize;
        let inside = ix0 >= 0 && ix0 + reach < c.w as isize;
        // SAFETY: the caller's.
        unsafe {
            match (c.k > 16, inside) {
                (false, true) => row.tile_of::<1, true>(p, ox),
                (false, false) => row.tile_of::<1, false>(p, ox),
                (true, true) => row.tile_of::<2, true>(p, ox),
                (true, false) => row.tile_of::<2, false>(p, ox),
            }
        }
        ox += p;
    }
    if row.clamp.is_none() {
        // SAFETY: the row's outputs, written above.
        activate(c.act, unsafe {
            std::slice::from_raw_parts_mut(row.y, ow * c.k)
        });
    }
}

/// What the tiles of one output row share.
struct Row<'a> {
    c: &'a ConvStep,
    n: usize,
    oy: usize,
    /// The kernel rows inside the input.
    rows: Range<usize>,
    x: *const f32,
    /// The panels of output channels 0..16 and 16..32, and their widths (16, or 8 for a
    /// last panel of 8 channels or fewer).
    w: [*const f32; 2],
    width: [usize; 2],
    /// Their loads' masks: the panels' widths.
    w_masks: [__mmask16; 2],
    /// The row's first output.
    y: *mut f32,
    bias: *const f32,
    residual: Option<*const f32>,
    clamp: Option<(f32, f32)>,
}

impl Row<'_> {
    /// `tile` for `p` pixels (1 to 8).
    ///
    /// # Safety
    /// As `tile`.
    #[inline(always)]
    unsafe fn tile_of<const B: usize, const INSIDE: bool>(&self, p: usize, ox: usize) {
        // SAFETY: the caller's.
        unsafe {
            match p {
                8 => self.tile::<8, B, INSIDE>(ox),
                7 => self.tile::<7, B, INSIDE>(ox),
                6 => self.tile::<6, B, INSIDE>(ox),
                5 => self.tile::<5, B, INSIDE>(ox),
                4 => self.tile::<4, B, INSIDE>(ox),
                3 => self.tile::<3, B, INSIDE>(ox),
                2 => self.tile::<2, B, INSIDE>(ox),
                _ => self.tile::<1, B, INSIDE>(ox),
            }
        }
    }

    /// Output pixels `ox..ox + P`, all output channels (`B` registers of 16 a pixel), all
    /// their taps inside the input along the row if `INSIDE`; the sums in registers over
    /// every tap.
    ///
    /// # Safety
    /// The CPU has AVX-512F; the row's spans were checked.
    #[inline(always)]
    unsafe fn tile<const P: usize, const B: usize, const INSIDE: bool>(&self, ox: usize) {
        let c = self.c;
        let (ch, k) = (c.c, c.k);
        let masks: [__mmask16; 2] = [
            ((1u32 << k.min(16)) - 1) as __mmask16,
            ((1u32 << k.saturating_sub(16).min(16)) - 1) as __mmask16,
        ];
        let ix0 = (ox * c.strides[1]) as isize - c.pads[1] as isize;
        // SAFETY: the caller's; the loads and stores masked to the output channels that
        // exist (the weights' to the panel's width), the taps to those inside the input.
        // Indexed loops of constant lengths, unrolled, the sums in registers.
        #[allow(clippy::needless_range_loop)]
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); B]; P];
            for b in 0..B {
                let bias = _mm512_maskz_loadu_ps(masks[b], self.bias.add(16 * b));
                for p in 0..P {
                    acc[p][b] = bias;
                    if let Some(z) = self.residual {
                        let z = _mm512_maskz_loadu_ps(masks[b], z.add((ox + p) * k + 16 * b));
                        acc[p][b] = _mm512_add_ps(acc[p][b], z);
                    }
                }
            }
            for r in self.rows.clone() {
                let iy = self.oy * c.strides[0] + r * c.dilations[0] - c.pads[0];
                let xs = self.x.add((self.n * c.h + iy) * c.w * ch);
                for s in 0..c.kernel[1] {
                    let ix = ix0 + (s * c.dilations[1]) as isize;
                    for ci in 0..ch {
                        // The weights' row: kernel position (r, s), input channel ci.
                        let i = (r * c.kernel[1] + s) * ch + ci;
                        let mut w = [_mm512_setzero_ps(); B];
                        for b in 0..B {
                            w[b] = _mm512_maskz_loadu_ps(
                                self.w_masks[b],
                                self.w[b].add(i * self.width[b]),
                            );
                        }
                        for p in 0..P {
                            let ix = ix + (p * c.strides[1]) as isize;
                            if !INSIDE && !(0..c.w as isize).contains(&ix) {
                                continue;
                            }
                            let x = _mm512_set1_ps(*xs.add(ix as usize * ch + ci));
                            for b in 0..B {
                                acc[p][b] = _mm512_fmadd_ps(x, w[b], acc[p][b]);
                            }
                        }
                    }
                }
            }
            for p in 0..P {
                for b in 0..B {
                    let mut v = acc[p][b];
                    if let Some((lo, hi)) = self.clamp {
                        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
                    }
                    _mm512_mask_storeu_ps(self.y.add((ox + p) * k + 16 * b), masks[b], v);
                }
            }
        }
    }
}
