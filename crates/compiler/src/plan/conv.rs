// SPDX-License-Identifier: MPL-2.0
//! The convolution step: cuDNN on the GPU, packed kernels on the CPU.

use serde::{Deserialize, Serialize};

use super::{Loc, MAX_WORKSPACE, Quant, Span, StepKind, residual_note};
use crate::check::Types;
use crate::ir::Act;

/// A 2-D convolution (cuDNN on the GPU) with its bias, residual and activation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConvStep {
    /// Input N, C, H, W (NHWC in memory); output K, OH, OW.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Input height, in pixels.
    pub h: usize,
    /// Input width, in pixels.
    pub w: usize,
    /// Output channels: the number of filters.
    pub k: usize,
    /// Output height, in pixels.
    pub oh: usize,
    /// Output width, in pixels.
    pub ow: usize,
    /// Kernel height and width (R, S).
    pub kernel: [usize; 2],
    /// Symmetric: asymmetric pads are made explicit by the lowering.
    pub pads: [usize; 2],
    /// Vertical and horizontal stride, in pixels.
    pub strides: [usize; 2],
    /// Vertical and horizontal dilation; 1 = a dense kernel.
    pub dilations: [usize; 2],
    /// Groups the channels are split into: 1 for a plain convolution, `c` for a depthwise one.
    pub group: usize,
    /// Applied last, after the bias and the residual.
    pub act: Act,
    /// Applied to each input value as it is read (not to the padding): the activation of
    /// the step before, taken into a depthwise convolution (`lower::depthwise`). Absent
    /// from engine files where it is `Act::None`.
    #[serde(default, skip_serializing_if = "Act::is_none")]
    pub act_in: Act,
    /// The input, `[n, h, w, c]`.
    pub x: Loc,
    /// KRSC.
    pub weight: Loc,
    /// One value per output channel (`k` elements).
    pub bias: Loc,
    /// Added before the activation; the same shape as `y`.
    pub residual: Option<Loc>,
    /// The output, `[n, oh, ow, k]`.
    pub y: Loc,
    /// Chosen by timing while building; `None` until then.
    pub algo: Option<Tuned>,
    /// Whether `x` and `weight` are read rounded to 8 bits (`crate::quant`); `w_scales`
    /// holds one scale per filter. Absent from engine files of unquantized plans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quant: Option<Quant>,
}

/// The algorithm a convolution runs with, chosen by timing: cuDNN's, or one of the engine's
/// own kernels: for an image's few channels (`Tuned::OWN_STEM`), or a group a channel
/// (`Tuned::OWN_DEPTHWISE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tuned {
    /// cuDNN's `cudnnConvolutionFwdAlgo_t`, as an integer (the engine file holds no cuDNN
    /// type), `OWN_STEM` or `OWN_DEPTHWISE`.
    pub algo: i32,
    /// cuDNN's `cudnnMathType_t` (whether tensor cores may be used), as an integer.
    pub math: i32,
    /// Bytes of workspace the algorithm needs; at most `MAX_WORKSPACE`.
    pub workspace: usize,
    /// Whether cuDNN's fused convolution + bias + activation (+ residual) runs it.
    pub fused: bool,
}

impl Tuned {
    /// `algo` of the CUDA engine's own convolution over an image's few channels (a
    /// network's stem: stem.cu), where the build's timing found it faster than cuDNN's.
    pub const OWN_STEM: i32 = -1;

    /// `algo` of the CUDA engine's own depthwise convolution (depthwise.cu), where the
    /// build's timing found it faster than cuDNN's convolution and the bias and activation
    /// after it.
    pub const OWN_DEPTHWISE: i32 = -2;

    /// The engine's own kernel `algo` (`OWN_STEM` or `OWN_DEPTHWISE`), which takes its bias
    /// and activation itself.
    const fn own(algo: i32) -> Tuned {
        Tuned {
            algo,
            math: 0,
            workspace: 0,
            fused: true,
        }
    }

    /// The engine's own stem convolution.
    pub const fn own_stem() -> Tuned {
        Tuned::own(Tuned::OWN_STEM)
    }

    /// The engine's own depthwise convolution.
    pub const fn own_depthwise() -> Tuned {
        Tuned::own(Tuned::OWN_DEPTHWISE)
    }

    /// Whether the convolution runs in the engine's own stem kernel.
    pub fn is_own_stem(&self) -> bool {
        self.algo == Tuned::OWN_STEM
    }

    /// Whether the convolution runs in the engine's own depthwise kernel.
    pub fn is_own_depthwise(&self) -> bool {
        self.algo == Tuned::OWN_DEPTHWISE
    }

    /// Whether the convolution runs in one of the engine's own kernels.
    pub fn is_own(&self) -> bool {
        self.is_own_stem() || self.is_own_depthwise()
    }

    /// What it is, for profiles and the build's log.
    pub fn describe(&self) -> String {
        match self.algo {
            Tuned::OWN_STEM => "own stem kernel".into(),
            Tuned::OWN_DEPTHWISE => "own depthwise kernel".into(),
            algo => format!(
                "algo {algo} math {}{}",
                self.math,
                if self.fused { " fused" } else { "" }
            ),
        }
    }
}

impl StepKind for ConvStep {
    fn describe(&self) -> String {
        let c = self;
        format!(
            "conv {}{}x{}x{}x{} k{}x{} s{} g{} -> {} {:?}{}{} {}",
            match c.act_in {
                Act::None => String::new(),
                act => format!("{act:?} of "),
            },
            c.n,
            c.c,
            c.h,
            c.w,
            c.kernel[0],
            c.kernel[1],
            c.strides[0],
            c.group,
            c.k,
            c.act,
            residual_note(c.residual, c.y),
            super::quant_note(c.quant),
            c.algo.map_or("untuned".into(), |t| t.describe())
        )
    }

    fn spans(&self) -> Vec<Span> {
        let c = self;
        let per_group = c.c.checked_div(c.group).unwrap_or(0);
        let mut spans = vec![
            Span::dense(c.x, &[c.n, c.h, c.w, c.c]),
            Span::dense(c.weight, &[c.k, c.kernel[0], c.kernel[1], per_group]),
            Span::dense(c.bias, &[c.k]),
            self.written(),
        ];
        spans.extend(c.residual.map(|r| Span::dense(r, &[c.n, c.oh, c.ow, c.k])));
        spans.extend(c.quant.map(|q| Span::dense(q.w_scales, &[c.k])));
        spans
    }

    fn written(&self) -> Span {
        Span::dense(self.y, &[self.n, self.oh, self.ow, self.k])
    }

    fn writes_all(&self) -> bool {
        true
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        let mut locs = vec![&mut self.x, &mut self.weight, &mut self.bias, &mut self.y];
        locs.extend(self.residual.as_mut());
        locs.extend(self.quant.as_mut().map(|q| &mut q.w_scales));
        locs
    }

    fn sizes_fit(&self) -> bool {
        let c = self;
        let int = |v: usize| i32::try_from(v).is_ok();
        let positive = |v: usize| v >= 1 && int(v);
        let out_dim = |i: usize, h: usize| {
            let reach = c.dilations[i] * (c.kernel[i] - 1) + 1;
            (h + 2 * c.pads[i])
                .checked_sub(reach)
                .map(|v| v / c.strides[i] + 1)
        };
        [c.n, c.c, c.h, c.w, c.k, c.oh, c.ow, c.group]
            .into_iter()
            .chain(c.kernel)
            .chain(c.strides)
            .chain(c.dilations)
            .all(positive)
            && c.pads.into_iter().all(int)
            && c.c.is_multiple_of(c.group)
            && c.k.is_multiple_of(c.group)
            && out_dim(0, c.h) == Some(c.oh)
            && out_dim(1, c.w) == Some(c.ow)
            && c.algo.is_none_or(|t| t.workspace <= MAX_WORKSPACE)
    }

    /// The scales of a quantized convolution are f32 constants beside operands of the
    /// plan's type (`super::check_quant`).
    fn types_fit(&self, t: &Types) -> bool {
        t.uniform(&ConvStep {
            quant: None,
            ..self.clone()
        })
    }

    /// A quantized convolution's own rules (`super::check_quant`); an activation of the
    /// input only where `lower::depthwise` puts one: a depthwise convolution, not 8-bit,
    /// reading the arena, which the GPU may activate in place before cuDNN's call.
    fn check(&self, t: &Types) -> Result<(), String> {
        super::check_quant(self, self.quant, t)?;
        let depthwise = self.group == self.c && self.k == self.c;
        let in_arena = matches!(self.x, Loc::Arena(_) | Loc::Temp { .. });
        let takes_act_in = depthwise && in_arena && self.quant.is_none();
        if !(self.act_in.is_none() || takes_act_in) {
            return Err(format!(
                "{:?} of the input of a convolution that is not depthwise, reads outside the arena or is 8-bit",
                self.act_in
            ));
        }
        crate::check::sizes_and_types(self, t)
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for ConvStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        let c = self;
        let (cig, kg) = (c.c / c.group, c.k / c.group);
        // What the kernel reads: the operands as they are, or rounded to 8 bits.
        let read_x = |m: &crate::sim::Memory, i| {
            let x = c.act_in.apply(m.read(c.x, i));
            match c.quant {
                Some(q) => q.format.fake(x, q.x_scale),
                None => x,
            }
        };
        let read_w = |m: &crate::sim::Memory, i, k| match c.quant {
            Some(q) => q.format.fake(m.read(c.weight, i), m.read(q.w_scales, k)),
            None => m.read(c.weight, i),
        };
        for n in 0..c.n {
            for oy in 0..c.oh {
                for ox in 0..c.ow {
                    for k in 0..c.k {
                        let g = k / kg;
                        let mut acc = m.read(c.bias, k);
                        for r in 0..c.kernel[0] {
                            let y = (oy * c.strides[0] + r * c.dilations[0]) as isize
                                - c.pads[0] as isize;
                            for s in 0..c.kernel[1] {
                                let x = (ox * c.strides[1] + s * c.dilations[1]) as isize
                                    - c.pads[1] as isize;
                                if y < 0 || x < 0 || y >= c.h as isize || x >= c.w as isize {
                                    continue;
                                }
                                let base = ((n * c.h + y as usize) * c.w + x as usize) * c.c;
                                for cc in 0..cig {
                                    let wv = read_w(
                                        m,
                                        ((k * c.kernel[0] + r) * c.kernel[1] + s) * cig + cc,
                                        k,
                                    );
                                    acc += wv * read_x(m, base + g * cig + cc);
                                }
                            }
                        }
                        let o = ((n * c.oh + oy) * c.ow + ox) * c.k + k;
                        if let Some(z) = c.residual {
                            acc += m.read(z, o);
                        }
                        m.write(c.y, o, c.act.apply(acc));
                    }
                }
            }
        }
    }
}
