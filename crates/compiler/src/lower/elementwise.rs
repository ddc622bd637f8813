// SPDX-License-Identifier: MPL-2.0
//! Element-wise steps: unary and binary operators, and the copies that concatenate and
//! pad.

use super::{Lowering, NHWC, Val, identity};
use crate::ir::{Act, BinOp, Node, Tensor};
use crate::plan::Cast;

impl Lowering<'_> {
    pub(super) fn unary(&mut self, node: &Node, act: Act, shape: &[usize]) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let y = self.alloc(shape, x.perm.clone());
        let s = y.strides();
        self.ew(None, act, Cast::None, shape, &x.perm, y.loc, &s, &[&x])?;
        Ok(y)
    }

    pub(super) fn binary(
        &mut self,
        node: &Node,
        op: BinOp,
        act: Act,
        shape: &[usize],
    ) -> Result<Val, String> {
        let a = self.get(&node.inputs[0])?;
        let b = self.get(&node.inputs[1])?;
        // The output takes the layout of a full-size input, so that reading it is sequential
        // (NHWC for activations from convolutions).
        let perm = [&a, &b]
            .into_iter()
            .find(|v| v.shape == shape)
            .map_or_else(|| identity(shape.len()), |v| v.perm.clone());
        let y = self.alloc(shape, perm.clone());
        let s = y.strides();
        self.ew(
            Some(op),
            act,
            Cast::None,
            shape,
            &perm,
            y.loc,
            &s,
            &[&a, &b],
        )?;
        Ok(y)
    }

    /// Each input copied into its place along `axis` of one buffer.
    pub(super) fn concat(
        &mut self,
        node: &Node,
        axis: usize,
        shape: &[usize],
    ) -> Result<Val, String> {
        let inputs = node
            .inputs
            .iter()
            .map(|i| self.get(i))
            .collect::<Result<Vec<_>, _>>()?;
        let rank = shape.len();
        let perm = if rank == 4 {
            NHWC.to_vec()
        } else {
            identity(rank)
        };
        let y = self.alloc(shape, perm.clone());
        let ys = y.strides();
        let mut start = 0;
        for v in &inputs {
            let dst = y.loc.offset(start * ys[axis]);
            self.ew(None, Act::None, Cast::None, &v.shape, &perm, dst, &ys, &[v])?;
            start += v.shape[axis];
        }
        Ok(y)
    }

    /// The padding value everywhere, then the input inside it.
    pub(super) fn pad(
        &mut self,
        node: &Node,
        pads: &[usize],
        value: f32,
        shape: &[usize],
    ) -> Result<Val, String> {
        let rank = shape.len();
        let x = self.get(&node.inputs[0])?;
        let fill = self.constant(&format!("{}.value", node.name), &Tensor::scalar(value));
        let fill = Val {
            shape: vec![1; rank],
            perm: identity(rank),
            ..fill
        };
        let y = self.alloc(shape, x.perm.clone());
        let ys = y.strides();
        self.ew(
            None,
            Act::None,
            Cast::None,
            shape,
            &x.perm,
            y.loc,
            &ys,
            &[&fill],
        )?;
        let inside: usize = (0..rank).map(|a| pads[a] * ys[a]).sum();
        let dst = y.loc.offset(inside);
        self.ew(
            None,
            Act::None,
            Cast::None,
            &x.shape,
            &x.perm,
            dst,
            &ys,
            &[&x],
        )?;
        Ok(y)
    }
}
