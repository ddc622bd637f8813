// SPDX-License-Identifier: MPL-2.0
//! An activation pass whose only reader is a depthwise convolution right after it goes into
//! that convolution (`ConvStep::act_in`), which applies it as it reads its input: MobileNet's
//! clip after each expansion product, which cuBLASLt's epilogue cannot take, was a read and a
//! write of the network's largest tensors each. For the GPU's plans,
//! before the arena is placed, so that the product's output stays alive for the convolution.

use super::arena::Storage;
use crate::ir::Act;
use crate::plan::{Cast, EwStep, Loc, Step, covers_once};

/// Takes each such pass of `steps` (with their `origins`) into its convolution, the
/// buffers' lifetimes in `storages` following.
pub(super) fn activations_into_depthwise(
    steps: &mut Vec<Step>,
    origins: &mut Vec<String>,
    storages: &mut [Storage],
) {
    let mut i = 0;
    while i + 1 < steps.len() {
        let Some((x, y, act)) = taken(&steps[i], &steps[i + 1], storages, i) else {
            i += 1;
            continue;
        };
        let Step::Conv(conv) = &mut steps[i + 1] else {
            unreachable!("`taken` matched a convolution");
        };
        conv.x = Loc::Temp { id: x, offset: 0 };
        conv.act_in = act;
        steps.remove(i);
        origins.remove(i);
        // The steps after the pass move up one. The buffer the pass read is read by the
        // convolution, which takes the pass's place; the one it wrote, where it was
        // another, by nothing.
        for s in storages.iter_mut() {
            s.first -= usize::from(s.first > i);
            s.last -= usize::from(s.last > i);
        }
        storages[x].last = i;
        if y != x {
            // Written by nothing now: no place beside the convolution's buffers.
            storages[y].len = 1;
        }
    }
}

/// Where `pass` (step `i`) applies an activation to all of a buffer, in place or into
/// another that only `conv` reads, and `conv` is a depthwise convolution that reads the
/// result and is the last to read the buffer the pass read: that buffer (a `Loc::Temp` id)
/// and the one it wrote, and the activation. The last: the GPU may apply the activation to it
/// in place, before cuDNN's convolution, where the build finds that faster than the engine's
/// own kernel. Only activations of a few instructions, no larger than their input: the
/// kernel computes them again for each tap that reads a value (a SiLU's exponential and
/// division nine or 25 times made EfficientNet-B0's convolutions 1.1-4× slower than
/// cuDNN's on an H100, where MobileNet's clip costs nothing), and in f32 without rounding
/// them to fp16, where a larger one could pass fp16's range unseen by the plan's overflow
/// check, which would blame the convolution.
fn taken(pass: &Step, conv: &Step, storages: &[Storage], i: usize) -> Option<(usize, usize, Act)> {
    let Step::Ew(EwStep {
        op: None,
        act,
        cast: Cast::None,
        dims,
        out,
        a,
        b: None,
    }) = pass
    else {
        return None;
    };
    let (Loc::Temp { id: x, offset: 0 }, Loc::Temp { id: y, offset: 0 }) = (a.loc, out.loc) else {
        return None;
    };
    let Step::Conv(c) = conv else {
        return None;
    };
    let len = c.n * c.h * c.w * c.c;
    let (xs, ys) = (&storages[x], &storages[y]);
    let whole = a.strides == out.strides && covers_once(dims, &out.strides, len);
    let depthwise = c.group == c.c && c.k == c.c && c.quant.is_none() && c.act_in.is_none();
    let alone = match x == y {
        true => xs.last == i + 1,
        false => ys.first == i && ys.last == i + 1 && xs.last == i,
    };
    let cheap = matches!(
        act,
        Act::Relu | Act::LeakyRelu(-1.0..=1.0) | Act::Clip(..) | Act::HardSigmoid(..)
    );
    (cheap
        && c.residual != Some(out.loc)
        && c.x == out.loc
        && whole
        && depthwise
        && alone
        && xs.len == len
        && ys.len == len
        && !xs.wide
        && !ys.wide)
        .then_some((x, y, *act))
}
