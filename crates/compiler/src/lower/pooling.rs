// SPDX-License-Identifier: MPL-2.0
//! Pooling and local response normalisation: windows over NHWC feature maps.

use super::{Lowering, NHWC, Val, dims4};
use crate::ir::{Node, Pool2d, PoolKind};
use crate::plan::{GlobalAvgPoolStep, LrnStep, PoolStep, Step};

impl Lowering<'_> {
    pub(super) fn pool(&mut self, node: &Node, p: &Pool2d, shape: &[usize]) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let x = self.require(&x, &NHWC)?;
        let [n, c, h, w] = dims4(&x.shape);
        let [_, _, oh, ow] = dims4(shape);
        let y = self.alloc(shape, NHWC.to_vec());
        let (max, count_include_pad) = match p.kind {
            PoolKind::Max => (true, false),
            PoolKind::Avg { count_include_pad } => (false, count_include_pad),
        };
        self.push(
            Step::Pool(PoolStep {
                n,
                h,
                w,
                c,
                oh,
                ow,
                kernel: p.kernel,
                strides: p.strides,
                pads: p.pads,
                max,
                count_include_pad,
                x: x.loc,
                y: y.loc,
            }),
            &[x.loc, y.loc],
        );
        Ok(y)
    }

    pub(super) fn global_avg_pool(&mut self, node: &Node, shape: &[usize]) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let x = self.require(&x, &NHWC)?;
        let [n, c, h, w] = dims4(&x.shape);
        let y = self.alloc(shape, NHWC.to_vec());
        self.push(
            Step::GlobalAvgPool(GlobalAvgPoolStep {
                n,
                hw: h * w,
                c,
                x: x.loc,
                y: y.loc,
            }),
            &[x.loc, y.loc],
        );
        Ok(y)
    }

    /// LRN across channels; `[alpha, beta, bias]` as ONNX names them.
    pub(super) fn lrn(
        &mut self,
        node: &Node,
        size: usize,
        [alpha, beta, bias]: [f32; 3],
        shape: &[usize],
    ) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let x = self.require(&x, &NHWC)?;
        let y = self.alloc(shape, NHWC.to_vec());
        self.push(
            Step::Lrn(LrnStep {
                pixels: x.len() / shape[1],
                c: shape[1],
                size,
                alpha,
                beta,
                bias,
                x: x.loc,
                y: y.loc,
            }),
            &[x.loc, y.loc],
        );
        Ok(y)
    }
}
