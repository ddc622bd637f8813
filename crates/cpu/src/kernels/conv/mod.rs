// SPDX-License-Identifier: MPL-2.0
//! Convolutions: depthwise ones as loops along the NHWC channels, the others as a matrix
//! product of their taps (read where they lie, or unfolded: im2col) or, with AVX-512, those
//! of up to 4 input and 32 output channels (first layers) straight from the NHWC input
//! (`x86_64::few_channels`, chosen in `run`), with their weights packed once for each.
//!
//! Here: which kind a convolution is. `pack` rearranges the weights for the kernel of each
//! kind, `depthwise` chooses the depthwise rows (and holds their plain loops), `unfold` runs
//! the others as products; the depthwise rows in x86 registers are in `x86_64::depthwise`,
//! with the kernels' other code for one instruction set.

mod depthwise;
mod pack;
mod unfold;

pub(super) use depthwise::depthwise;
pub(super) use pack::pack;
#[cfg(test)]
pub(crate) use unfold::group_block;
pub(super) use unfold::{Taps, ZEROS, conv_gemm, conv_groups};

use std::sync::Arc;

#[cfg(target_arch = "x86_64")]
use super::x86_64::few_channels;
use super::{Buffers, CpuStep, Out, Packed, Scratch, Threads, winograd};
use trtclassify_compiler::plan::{ConvStep, Loc, Step};

pub(super) fn is_depthwise(c: &ConvStep) -> bool {
    c.group == c.c && c.group == c.k
}

/// A 1×1 convolution with stride 1 and no padding reads the NHWC input as a matrix
/// as it is; the others unfold it first.
pub(super) fn is_pointwise(c: &ConvStep) -> bool {
    c.kernel == [1, 1] && c.strides == [1, 1] && c.pads == [0, 0]
}

impl CpuStep for ConvStep {
    #[inline(always)]
    fn run<const FMA: bool>(
        &self,
        packed: &Packed,
        buf: &Buffers,
        scratch: &mut Scratch,
        threads: Threads,
    ) {
        let c = self;
        let col = &mut scratch.col;
        let (packed, out) = Out::of(packed, c.y, c.k);
        // Weights computed by the plan are packed on the fly, from a copy.
        let on_the_fly;
        let packed = match packed {
            Packed::None => {
                let weight = Loc::Weight {
                    index: 0,
                    offset: 0,
                };
                let step = Step::Conv(ConvStep {
                    weight,
                    ..c.clone()
                });
                on_the_fly = pack(&step, &[Arc::new(krsc_of(buf, c))]);
                &on_the_fly
            }
            packed => packed,
        };
        match packed {
            Packed::Depthwise(w) => depthwise(buf, c, w.as_slice(), threads),
            Packed::Groups(w) => conv_groups(buf, c, w, col, out, threads),
            Packed::Panels(w, _) => {
                #[cfg(target_arch = "x86_64")]
                if threads.avx512 && few_channels::fits(c) {
                    // SAFETY: the CPU has AVX-512F (`Threads::new`); `w` is the step's.
                    return threads.for_each(c.n * c.oh, |row| unsafe {
                        few_channels::few_channels_row_avx512(buf, c, w, row)
                    });
                }
                conv_gemm(buf, c, w, col, out, threads)
            }
            Packed::Winograd(u) => winograd::conv(buf, c, u, out, threads),
            _ => unreachable!("a convolution's weight packs"),
        }
    }
}

/// A convolution's KRSC weights, copied from wherever the plan keeps them.
fn krsc_of(buf: &Buffers, c: &ConvStep) -> Vec<f32> {
    let len = c.k * c.kernel[0] * c.kernel[1] * (c.c / c.group);
    // SAFETY: checked span.
    unsafe { std::slice::from_raw_parts(buf.at(c.weight), len) }.to_vec()
}
