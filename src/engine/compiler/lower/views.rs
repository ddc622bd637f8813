// SPDX-License-Identifier: MPL-2.0
//! Operators that change how a value is seen more than what it holds: a transpose only
//! changes the layout, a reshape of a logically laid out value nothing, and a slice is read
//! in place where it can be.

use super::arena::ALIGN;
use super::{Lowering, Val, identity, merge_dims};
use crate::engine::compiler::ir::{Act, Node};
use crate::engine::compiler::plan::{Cast, Loc, Step, Strided};

impl Lowering<'_> {
    pub(super) fn slice(
        &mut self,
        node: &Node,
        axis: usize,
        start: usize,
        step: usize,
        shape: &[usize],
    ) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let xs = x.strides();
        let src = Val {
            loc: x.loc.offset(start * xs[axis]),
            shape: shape.to_vec(),
            perm: x.perm.clone(),
        };
        // A slice with nothing but axes of size 1 outside it in memory is one contiguous
        // range of its input (attention's query, key and value picked from one projection):
        // it is read in place where it starts as aligned as a buffer would (cuBLASLt and
        // cuDNN choose their kernels for 256 bytes).
        let outer = x.perm.iter().take_while(|&&a| a != axis);
        let aligned = match x.loc {
            Loc::Temp { offset, .. } => (offset + start * xs[axis]).is_multiple_of(ALIGN),
            _ => false,
        };
        if step == 1 && aligned && outer.copied().all(|a| shape[a] == 1) {
            return Ok(src);
        }
        // The source view keeps the input's strides, not the compact ones of its shape: copy
        // through explicit strides.
        let y = self.alloc(shape, x.perm.clone());
        let ys = y.strides();
        let order: Vec<usize> = x.perm.clone();
        let in_strides: Vec<i64> = order
            .iter()
            .map(|&a| match (shape[a], a == axis) {
                (1, _) => 0,
                (_, true) => (xs[a] * step) as i64,
                _ => xs[a] as i64,
            })
            .collect();
        let out_strides: Vec<i64> = order.iter().map(|&a| ys[a] as i64).collect();
        let dims: Vec<usize> = order.iter().map(|&a| shape[a]).collect();
        let (dims, all) = merge_dims(dims, vec![out_strides, in_strides]);
        self.push(
            Step::Ew {
                op: None,
                act: Act::None,
                cast: Cast::None,
                dims,
                out: Strided {
                    loc: y.loc,
                    strides: all[0].clone(),
                },
                a: Strided {
                    loc: src.loc,
                    strides: all[1].clone(),
                },
                b: None,
            },
            &[x.loc, y.loc],
        );
        Ok(y)
    }

    /// Only the layout changes: logical axis i of the output is axis perm[i] of the input,
    /// at the same place in memory.
    pub(super) fn transpose(
        &mut self,
        node: &Node,
        perm: &[usize],
        shape: &[usize],
    ) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let mut inverse = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i;
        }
        Ok(Val {
            loc: x.loc,
            shape: shape.to_vec(),
            perm: x.perm.iter().map(|&a| inverse[a]).collect(),
        })
    }

    /// The value in its logical layout, seen with another shape.
    pub(super) fn reshape(&mut self, node: &Node, shape: &[usize]) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let x = self.require(&x, &identity(x.shape.len()))?;
        Ok(Val {
            loc: x.loc,
            shape: shape.to_vec(),
            perm: identity(shape.len()),
        })
    }
}
