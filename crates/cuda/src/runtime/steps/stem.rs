// SPDX-License-Identifier: MPL-2.0
//! The engine's own convolution over an image's few channels (stem.cu): which convolutions
//! it can run, and its launch. The build times it beside cuDNN's algorithms and keeps the
//! faster (`Tuned::OWN_STEM`).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::super::Runtime;
use super::super::kernels::kernel_set;
use super::launch;
use crate::abi::{STEM_THREADS, StemParams, act_params};
use crate::error::{Error, Result};
use trtclassify_compiler::plan::{ConvStep, DType, Loc};

kernel_set! {
    /// stem.cu's kernels: a network's first convolution, over an image's few channels.
    StemKernels {
        /// 64 output channels a pass.
        conv64: "stem_conv64",
        /// 32 output channels a pass.
        conv32: "stem_conv32",
    }
}

impl StemKernels {
    /// Lets the kernels have as much shared memory as a block may (`shared_optin`): a 7×7
    /// stem's weights, tile and outputs take about 54 KB, past the 48 KB given without asking.
    pub(in crate::runtime) fn allow_shared_memory(&self, shared_optin: usize) -> Result<()> {
        for f in [&self.conv64, &self.conv32] {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared_optin as i32,
            )
            .map_err(Error::driver("the stem kernel's shared memory"))?;
        }
        Ok(())
    }
}

/// The stem kernel's parameters for `c` in a plan of `dtype` on a GPU of compute capability
/// `arch`, where the kernel can run it: fp16 in and out (both in the arena), sm_80 on
/// (mma.sync m16n8k16), 1 to 4 input channels, a plain convolution (one group, no dilation,
/// no residual, not 8-bit) with an even stride across (so that two neighbouring input pixels
/// of 4 channels are an aligned A row of 16 bytes), output channels by the 32, and its
/// weights and a tile within `shared_optin` bytes.
pub(in crate::runtime) fn stem_params(
    c: &ConvStep,
    dtype: DType,
    arch: (i32, i32),
    shared_optin: usize,
) -> Option<StemParams> {
    // In the arena, so in the plan's type: not the f32 frames, scores or values kept in f32.
    let in_arena = |l: Loc| matches!(l, Loc::Arena(_));
    let fits = dtype == DType::F16
        && arch.0 >= 8
        && (1..=4).contains(&c.c)
        && c.group == 1
        && c.dilations == [1, 1]
        && c.residual.is_none()
        && c.quant.is_none()
        && c.act_in.is_none()
        && c.strides[1].is_multiple_of(2)
        && c.k.is_multiple_of(32)
        && in_arena(c.x)
        && in_arena(c.y);
    let int = |v: usize| i32::try_from(v).ok();
    let (act_id, p0, p1) = act_params(c.act, dtype);
    let p = StemParams {
        n: int(c.n)?,
        h: int(c.h)?,
        w: int(c.w)?,
        c: int(c.c)?,
        k: int(c.k)?,
        oh: int(c.oh)?,
        ow: int(c.ow)?,
        r: int(c.kernel[0])?,
        s: int(c.kernel[1])?,
        sh: int(c.strides[0])?,
        sw: int(c.strides[1])?,
        ph: int(c.pads[0])?,
        pw: int(c.pads[1])?,
        act_id,
        p0,
        p1,
    };
    // Offsets within an image and the weights are ints in the kernel.
    let ints = [
        c.h * c.w * c.c,
        c.oh * c.ow * c.k,
        c.k * c.kernel[0] * c.kernel[1] * c.c,
    ];
    (fits && ints.iter().all(|&v| int(v).is_some()) && p.shared_bytes() <= shared_optin)
        .then_some(p)
}

impl Runtime {
    /// The stem kernel's parameters for `c` on this GPU, where it can run it.
    pub(in crate::runtime) fn stem_params(&self, c: &ConvStep) -> Option<StemParams> {
        stem_params(c, self.writes(c.y).1, self.arch, self.shared_optin)
    }

    /// The convolution `c` (with its bias and activation) in the stem kernel.
    pub(in crate::runtime) fn stem_conv(&self, c: &ConvStep) -> Result<()> {
        let p = self.stem_params(c).ok_or(Error::Plan(
            "a convolution tuned for the engine's own stem kernel, which cannot run it on this GPU",
        ))?;
        let kernels = &self.kernels.stem;
        let func = match p.pass() {
            64 => &kernels.conv64,
            _ => &kernels.conv32,
        };
        let shared = p.shared_bytes();
        // As many blocks as stay on the GPU at once, each taking tiles in turn: a block lays
        // the weights out in its shared memory once for all of its tiles.
        let per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(STEM_THREADS as u32, shared, None)
            .map_err(Error::driver("the stem kernel's occupancy"))?
            .max(1);
        let blocks = p.tiles().min((self.sm_count * per_sm) as usize).max(1);
        let (x, w, bias, y) = (
            self.ptr(c.x),
            self.ptr(c.weight),
            self.ptr(c.bias),
            self.ptr(c.y),
        );
        if !y.is_multiple_of(16) {
            return Err(Error::Plan(
                "the stem kernel's output is not 16-byte aligned",
            ));
        }
        let mut b = self.stream.launch_builder(func);
        b.arg(&p).arg(&x).arg(&w).arg(&bias).arg(&y);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (STEM_THREADS as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        launch(b, cfg)
    }
}

/// A stem convolution for the tests: `[n, c, h, w, k]` with its kernel, strides and pads,
/// reading and writing the arena.
#[cfg(test)]
pub(super) fn stem_step(
    shape: [usize; 5],
    kernel: [usize; 2],
    strides: [usize; 2],
    pads: [usize; 2],
    act: trtclassify_compiler::ir::Act,
) -> ConvStep {
    let step = trtclassify_compiler::testing::conv_step(
        shape,
        [kernel, strides, pads, [1, 1]],
        Loc::Arena(0),
        Loc::Arena(1 << 20),
    );
    ConvStep {
        act,
        ..step.expect("the stem fits its input")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trtclassify_compiler::ir::Act;

    /// ResNet's stem at batch `n`.
    fn resnet_stem(n: usize) -> ConvStep {
        stem_step([n, 3, 224, 224, 64], [7, 7], [2, 2], [3, 3], Act::Relu)
    }

    #[test]
    fn the_stem_kernel_takes_image_stems_and_nothing_else() {
        const H100: (i32, i32) = (9, 0);
        const OPTIN: usize = 227 * 1024;
        let p = stem_params(&resnet_stem(64), DType::F16, H100, OPTIN).expect("ResNet's stem");
        assert_eq!((p.pass(), p.tiles()), (64, 64 * 14 * 7));
        // 14 steps of 16 × 64 filters × 32 bytes, 21 × 38 pixels of 8 bytes, 128 × 72 fp16.
        assert_eq!(p.shared_bytes(), 28_672 + 6_384 + 18_432);
        type Change = fn(&mut ConvStep);
        let refused: [(&str, Change); 10] = [
            ("8 channels", |c| c.c = 8),
            ("grouped", |c| c.group = 3),
            ("dilated", |c| c.dilations = [2, 2]),
            ("odd stride across", |c| c.strides = [2, 1]),
            ("48 filters", |c| c.k = 48),
            ("a residual", |c| c.residual = Some(Loc::Arena(0))),
            ("an activation of its input", |c| c.act_in = Act::Relu),
            ("the f32 frames", |c| c.x = Loc::Input(0)),
            ("kept in f32", |c| c.y = Loc::Wide(0)),
            ("weights past shared memory", |c| c.k = 1024),
        ];
        for (why, change) in refused {
            let mut c = resnet_stem(1);
            change(&mut c);
            assert_eq!(stem_params(&c, DType::F16, H100, OPTIN), None, "{why}");
        }
        let c = resnet_stem(1);
        assert_eq!(stem_params(&c, DType::F32, H100, OPTIN), None, "f32");
        assert_eq!(
            stem_params(&c, DType::F16, (7, 5), 64 * 1024),
            None,
            "sm_75"
        );
    }
}
