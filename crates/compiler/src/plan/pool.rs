// SPDX-License-Identifier: MPL-2.0
//! Pooling steps over NHWC tensors: windows (max or average) and the global average.

use serde::{Deserialize, Serialize};

use super::{Loc, Span, StepKind};
use crate::check::Types;

/// Max or average pooling over windows, NHWC in and out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolStep {
    /// Images in the batch.
    pub n: usize,
    /// Input height, in pixels.
    pub h: usize,
    /// Input width, in pixels.
    pub w: usize,
    /// Channels, the same in and out.
    pub c: usize,
    /// Output height, in pixels.
    pub oh: usize,
    /// Output width, in pixels.
    pub ow: usize,
    /// Window height and width.
    pub kernel: [usize; 2],
    /// Vertical and horizontal stride, in pixels.
    pub strides: [usize; 2],
    /// Top, left, bottom, right.
    pub pads: [usize; 4],
    /// Max pooling if true, else average pooling.
    pub max: bool,
    /// Whether an average counts the window's cells in the padding too; max pooling ignores it.
    pub count_include_pad: bool,
    /// The input, `[n, h, w, c]`.
    pub x: Loc,
    /// The output, `[n, oh, ow, c]`.
    pub y: Loc,
}

impl StepKind for PoolStep {
    fn describe(&self) -> String {
        let p = self;
        let kind = if p.max { "max" } else { "avg" };
        format!(
            "{kind}pool {}x{}x{}x{} k{}",
            p.n, p.c, p.h, p.w, p.kernel[0]
        )
    }

    fn spans(&self) -> Vec<Span> {
        vec![
            Span::dense(self.x, &[self.n, self.h, self.w, self.c]),
            self.written(),
        ]
    }

    fn written(&self) -> Span {
        Span::dense(self.y, &[self.n, self.oh, self.ow, self.c])
    }

    fn writes_all(&self) -> bool {
        true
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        vec![&mut self.x, &mut self.y]
    }

    fn sizes_fit(&self) -> bool {
        let p = self;
        let int = |v: usize| i32::try_from(v).is_ok();
        let positive = |v: usize| v >= 1 && int(v);
        [p.n, p.h, p.w, p.c, p.oh, p.ow]
            .into_iter()
            .chain(p.kernel)
            .chain(p.strides)
            .all(positive)
            && p.pads.iter().all(|&p| int(p))
    }

    fn types_fit(&self, t: &Types) -> bool {
        t.uniform(self)
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for PoolStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        let PoolStep {
            n,
            h,
            w,
            c,
            oh,
            ow,
            kernel,
            strides,
            pads,
            max,
            count_include_pad,
            x,
            y,
        } = *self;
        for b in 0..n {
            for oy in 0..oh {
                for ox in 0..ow {
                    for ch in 0..c {
                        let (mut acc, mut best, mut count, mut padded) =
                            (0.0, f32::NEG_INFINITY, 0, 0);
                        for ky in 0..kernel[0] {
                            for kx in 0..kernel[1] {
                                let yy = (oy * strides[0] + ky) as isize - pads[0] as isize;
                                let xx = (ox * strides[1] + kx) as isize - pads[1] as isize;
                                if yy < 0 || xx < 0 || yy >= h as isize || xx >= w as isize {
                                    padded += usize::from(
                                        yy < (h + pads[2]) as isize && xx < (w + pads[3]) as isize,
                                    );
                                    continue;
                                }
                                let v =
                                    m.read(x, ((b * h + yy as usize) * w + xx as usize) * c + ch);
                                acc += v;
                                best = f32::max(best, v);
                                count += 1;
                            }
                        }
                        let v = match (max, count_include_pad) {
                            (true, _) => best,
                            (false, true) => acc / (count + padded) as f32,
                            (false, false) => acc / count as f32,
                        };
                        m.write(y, ((b * oh + oy) * ow + ox) * c + ch, v);
                    }
                }
            }
        }
    }
}

/// The average of each channel over all pixels: NHWC `[n, hw, c]` to `[n, c]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GlobalAvgPoolStep {
    /// Images in the batch.
    pub n: usize,
    /// Pixels per image (height × width), all averaged together.
    pub hw: usize,
    /// Channels.
    pub c: usize,
    /// The input, `[n, hw, c]`.
    pub x: Loc,
    /// The output, `[n, c]`.
    pub y: Loc,
}

impl StepKind for GlobalAvgPoolStep {
    fn describe(&self) -> String {
        format!("global avg {}x{}x{}", self.n, self.hw, self.c)
    }

    fn spans(&self) -> Vec<Span> {
        vec![
            Span::dense(self.x, &[self.n, self.hw, self.c]),
            self.written(),
        ]
    }

    fn written(&self) -> Span {
        Span::dense(self.y, &[self.n, self.c])
    }

    fn writes_all(&self) -> bool {
        true
    }

    fn locs_mut(&mut self) -> Vec<&mut Loc> {
        vec![&mut self.x, &mut self.y]
    }

    fn sizes_fit(&self) -> bool {
        let positive = |v: usize| v >= 1 && i32::try_from(v).is_ok();
        [self.n, self.hw, self.c].into_iter().all(positive)
    }

    fn types_fit(&self, t: &Types) -> bool {
        t.uniform(self)
    }
}

#[cfg(any(test, feature = "testing"))]
impl crate::sim::Simulate for GlobalAvgPoolStep {
    fn simulate(&self, m: &mut crate::sim::Memory) {
        let GlobalAvgPoolStep { n, hw, c, x, y } = *self;
        for b in 0..n {
            for ch in 0..c {
                let sum: f32 = (0..hw).map(|p| m.read(x, (b * hw + p) * c + ch)).sum();
                m.write(y, b * c + ch, sum / hw as f32);
            }
        }
    }
}
