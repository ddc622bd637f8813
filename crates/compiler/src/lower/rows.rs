// SPDX-License-Identifier: MPL-2.0
//! Row operations: softmax, layer normalisation and means, each over rows laid out along
//! the last memory axes.

use super::{Lowering, Val, identity};
use crate::ir::Node;
use crate::plan::{LayerNormStep, RowMeanStep, SoftmaxStep, Step};

impl Lowering<'_> {
    pub(super) fn softmax(
        &mut self,
        node: &Node,
        axis: usize,
        shape: &[usize],
    ) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        // Rows along the last memory axis: the reduced axis innermost, the others in their
        // order in memory.
        let x = self.innermost(&x, axis)?;
        let perm = x.perm.clone();
        let len = shape[axis];
        let rows = x.len() / len;
        let y = self.alloc(shape, perm);
        let step = Step::Softmax(SoftmaxStep {
            rows,
            len,
            x: x.loc,
            y: y.loc,
        });
        self.push(step, &[x.loc, y.loc]);
        Ok(y)
    }

    /// Normalises over the axes from `axis` on, which are the last ones in memory.
    pub(super) fn layer_norm(
        &mut self,
        node: &Node,
        axis: usize,
        epsilon: f32,
        shape: &[usize],
    ) -> Result<Val, String> {
        // The normalised axes innermost in their logical order, the rows in any order.
        let x = self.get(&node.inputs[0])?;
        let perm: Vec<usize> = x
            .perm
            .iter()
            .copied()
            .filter(|&a| a < axis)
            .chain(axis..shape.len())
            .collect();
        let x = self.require(&x, &perm)?;
        let len: usize = shape[axis..].iter().product();
        let rows = x.len() / len;
        let y = self.alloc(shape, perm);
        let scale = self.get(&node.inputs[1])?.loc;
        let bias = match node.inputs.get(2) {
            Some(b) => Some(self.get(b)?.loc),
            None => None,
        };
        let step = Step::LayerNorm(LayerNormStep {
            rows,
            len,
            epsilon,
            x: x.loc,
            scale,
            bias,
            y: y.loc,
        });
        self.push(step, &[x.loc, y.loc]);
        Ok(y)
    }

    /// The mean over `axes`, moved last in memory.
    pub(super) fn reduce_mean(
        &mut self,
        node: &Node,
        axes: &[usize],
        shape: &[usize],
    ) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let in_rank = x.shape.len();
        let perm: Vec<usize> = (0..in_rank)
            .filter(|a| !axes.contains(a))
            .chain(axes.iter().copied())
            .collect();
        let x = self.require(&x, &perm)?;
        let len: usize = axes.iter().map(|&a| x.shape[a]).product();
        let y = self.alloc(shape, identity(shape.len()));
        self.push(
            Step::RowMean(RowMeanStep {
                rows: x.len() / len,
                len,
                x: x.loc,
                y: y.loc,
            }),
            &[x.loc, y.loc],
        );
        Ok(y)
    }
}
