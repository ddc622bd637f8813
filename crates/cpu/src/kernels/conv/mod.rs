// SPDX-License-Identifier: MPL-2.0
//! Convolutions: depthwise ones as loops along the NHWC channels, the others as a matrix
//! product of their taps (read where they lie, or unfolded: im2col), with their weights
//! packed once for each.
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
pub(super) use unfold::{Taps, ZEROS, conv_gemm};

use trtclassify_compiler::plan::ConvStep;

pub(super) fn is_depthwise(c: &ConvStep) -> bool {
    c.group == c.c && c.group == c.k
}

/// A 1×1 convolution with stride 1 and no padding reads the NHWC input as a matrix
/// as it is; the others unfold it first.
pub(super) fn is_pointwise(c: &ConvStep) -> bool {
    c.kernel == [1, 1] && c.strides == [1, 1] && c.pads == [0, 0]
}
