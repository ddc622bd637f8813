// SPDX-License-Identifier: MPL-2.0
//! The engine's own depthwise convolution (depthwise.cu): which convolutions it can run, and
//! its launch. The build times it beside cuDNN's algorithms and keeps the faster
//! (`Tuned::OWN_DEPTHWISE`).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::super::Runtime;
use super::super::kernels::kernel_set;
use super::launch;
use crate::abi::{DW_MAX_TAPS, DW_THREADS, DepthwiseParams, act_params};
use crate::error::{Error, Result};
use trtclassify_compiler::plan::{ConvStep, DType, Loc};

kernel_set! {
    /// depthwise.cu's kernel: a convolution with a group a channel.
    DepthwiseKernels {
        conv: "depthwise_conv",
    }
}

/// The depthwise kernel's parameters for `c` in a plan of `dtype`, where the kernel can run
/// it (with its input's activation, `act_in`, too): a group a channel and a filter a group (channels in and out the same), channels by
/// the 16 bytes, input and output in the arena (so in the plan's type), no dilation, no
/// residual, not 8-bit, at most `DW_MAX_TAPS` taps, and offsets within an image in an `int`.
pub(in crate::runtime) fn depthwise_params(c: &ConvStep, dtype: DType) -> Option<DepthwiseParams> {
    let in_arena = |l: Loc| matches!(l, Loc::Arena(_));
    let vec = 16 / dtype.size();
    let fits = c.group == c.c
        && c.k == c.c
        && c.c.is_multiple_of(vec)
        && c.dilations == [1, 1]
        && c.residual.is_none()
        && c.quant.is_none()
        && c.kernel[0] * c.kernel[1] <= DW_MAX_TAPS
        && in_arena(c.x)
        && in_arena(c.y);
    let vectors = c.c / vec;
    // As many of a pixel's vectors as divide its channels evenly, so that no block has
    // idle lanes: 8 (a warp reads 4 pixels' 128 bytes), else 4, 2 or 1.
    let group = [8, 4, 2, 1]
        .into_iter()
        .find(|g| vectors.is_multiple_of(*g))?;
    let int = |v: usize| i32::try_from(v).ok();
    let (act_id, p0, p1) = act_params(c.act, dtype);
    let (act_in_id, q0, q1) = act_params(c.act_in, dtype);
    let p = DepthwiseParams {
        n: int(c.n)?,
        h: int(c.h)?,
        w: int(c.w)?,
        c: int(c.c)?,
        oh: int(c.oh)?,
        ow: int(c.ow)?,
        r: int(c.kernel[0])?,
        s: int(c.kernel[1])?,
        sh: int(c.strides[0])?,
        sw: int(c.strides[1])?,
        ph: int(c.pads[0])?,
        pw: int(c.pads[1])?,
        group: int(group)?,
        act_id,
        p0,
        p1,
        act_in_id,
        q0,
        q1,
    };
    // The kernel counts pixels of the batch (past them by less than their number and a
    // block's slots) and offsets within an image in an `int`.
    let ints = [
        2 * c.n * c.oh * c.ow + DW_THREADS,
        c.h * c.w * c.c,
        c.c * c.kernel[0] * c.kernel[1],
    ];
    (fits && ints.iter().all(|&v| int(v).is_some())).then_some(p)
}

impl Runtime {
    /// The depthwise kernel's parameters for `c` on this GPU, where it can run it.
    pub(in crate::runtime) fn depthwise_params(&self, c: &ConvStep) -> Option<DepthwiseParams> {
        depthwise_params(c, self.writes(c.y).1)
    }

    /// The convolution `c` (with its bias and activation) in the depthwise kernel.
    pub(in crate::runtime) fn depthwise_conv(&self, c: &ConvStep) -> Result<()> {
        let dtype = self.writes(c.y).1;
        let p = self.depthwise_params(c).ok_or(Error::Plan(
            "a convolution tuned for the engine's own depthwise kernel, which cannot run it",
        ))?;
        let (x, w, bias, y) = (
            self.ptr(c.x),
            self.ptr(c.weight),
            self.ptr(c.bias),
            self.ptr(c.y),
        );
        if !(x.is_multiple_of(16) && y.is_multiple_of(16)) {
            return Err(Error::Plan(
                "the depthwise kernel's input or output is not 16-byte aligned",
            ));
        }
        let mut b = self.stream.launch_builder(&self.kernels.depthwise.conv);
        b.arg(&p).arg(&x).arg(&w).arg(&bias).arg(&y);
        launch(b, depthwise_launch(&p, dtype, self.sm_count as usize))
    }
}

/// The launch of the depthwise kernel for `p`: enough blocks along the pixels to fill
/// `sm_count` SMs several times over, each taking its slots of pixels in turn after that
/// (it lays its channels' weights out once for all of them).
pub(super) fn depthwise_launch(p: &DepthwiseParams, dtype: DType, sm_count: usize) -> LaunchConfig {
    let along_channels = p.channel_blocks(dtype);
    let pixels = (p.n * p.oh * p.ow) as usize;
    let wanted = (8 * sm_count).div_ceil(along_channels).max(1);
    let along_pixels = pixels.div_ceil(p.slots()).min(wanted).max(1);
    LaunchConfig {
        grid_dim: (along_pixels as u32, along_channels as u32, 1),
        block_dim: (DW_THREADS as u32, 1, 1),
        shared_mem_bytes: p.shared_bytes(dtype) as u32,
    }
}

/// A depthwise convolution for the tests: `[n, c, h, w]` with its kernel, strides, pads and
/// activation, reading and writing the arena.
#[cfg(test)]
pub(super) fn depthwise_step(
    [n, c, h, w]: [usize; 4],
    kernel: [usize; 2],
    strides: [usize; 2],
    pads: [usize; 2],
    act: trtclassify_compiler::ir::Act,
) -> ConvStep {
    let step = trtclassify_compiler::testing::conv_step(
        [n, c, h, w, c],
        [kernel, strides, pads, [1, 1]],
        Loc::Arena(0),
        Loc::Arena(1 << 24),
    )
    .expect("the convolution fits its input");
    ConvStep {
        act,
        group: c,
        ..step
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trtclassify_compiler::ir::Act;

    /// MobileNetV2's 3×3 depthwise convolution over 144 channels, stride 2, at batch `n`.
    fn mobilenet(n: usize) -> ConvStep {
        depthwise_step(
            [n, 144, 56, 56],
            [3, 3],
            [2, 2],
            [1, 1],
            Act::Clip(0.0, 6.0),
        )
    }

    #[test]
    fn the_depthwise_kernel_takes_depthwise_convolutions_and_nothing_else() {
        let p = depthwise_params(&mobilenet(64), DType::F16).expect("MobileNet's");
        // 18 vectors of 8 channels: blocks of 2 vectors, 128 pixels at a time.
        assert_eq!((p.group, p.oh, p.ow), (2, 28, 28));
        assert_eq!((p.channel_blocks(DType::F16), p.slots()), (9, 128));
        assert_eq!(p.shared_bytes(DType::F16), 9 * 16 * 4);
        let cfg = depthwise_launch(&p, DType::F16, 132);
        assert_eq!(cfg.grid_dim, (118, 9, 1));
        // f32: 36 vectors of 4 channels, blocks of 4.
        let p = depthwise_params(&mobilenet(1), DType::F32).expect("in f32");
        assert_eq!((p.group, p.channel_blocks(DType::F32)), (4, 9));
        let cfg = depthwise_launch(&p, DType::F32, 132);
        assert_eq!(cfg.grid_dim, (13, 9, 1), "784 pixels, 64 at a time");
        type Change = fn(&mut ConvStep);
        let refused: [(&str, Change); 8] = [
            ("grouped by 2", |c| c.group = 72),
            ("a multiplier of 2", |c| c.k = 288),
            ("channels not by 8", |c| (c.c, c.k, c.group) = (36, 36, 36)),
            ("dilated", |c| c.dilations = [2, 2]),
            ("a residual", |c| c.residual = Some(Loc::Arena(0))),
            ("9x9", |c| c.kernel = [9, 9]),
            ("the f32 frames", |c| c.x = Loc::Input(0)),
            ("kept in f32", |c| c.y = Loc::Wide(0)),
        ];
        for (why, change) in refused {
            let mut c = mobilenet(1);
            change(&mut c);
            assert_eq!(depthwise_params(&c, DType::F16), None, "{why}");
        }
    }
}
