// SPDX-License-Identifier: MPL-2.0
//! Operators that change how a value is seen more than what it holds: a transpose only
//! changes the layout, a reshape of a logically laid out value nothing, and a slice is read
//! in place where it can be.

use super::arena::ALIGN;
use super::{Lowering, Val, identity};
use crate::ir::Node;
use crate::plan::Loc;

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
        let order = &x.perm;
        let in_strides: Vec<usize> = order
            .iter()
            .map(|&a| match (shape[a], a == axis) {
                (1, _) => 0,
                (_, true) => xs[a] * step,
                _ => xs[a],
            })
            .collect();
        let out_strides: Vec<usize> = order.iter().map(|&a| ys[a]).collect();
        let dims: Vec<usize> = order.iter().map(|&a| shape[a]).collect();
        self.strided_copy(&dims, (y.loc, &out_strides), (src.loc, &in_strides));
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

    /// The value seen with another shape: in place where its layout allows (attention's
    /// heads split from or merged into the rows of a projection), else copied into its
    /// logical layout first.
    pub(super) fn reshape(&mut self, node: &Node, shape: &[usize]) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        if let Some(perm) = reshaped_layout(&x.shape, &x.perm, shape) {
            return Ok(Val {
                loc: x.loc,
                shape: shape.to_vec(),
                perm,
            });
        }
        let x = self.require(&x, &identity(x.shape.len()))?;
        Ok(Val {
            loc: x.loc,
            shape: shape.to_vec(),
            perm: identity(shape.len()),
        })
    }
}

/// The layout of a value laid out as `perm` seen with `to`, if there is one without moving
/// anything: the axes of `from` and `to` fall into groups of equal size (a split or a merge),
/// and each group of `from` must lie together in memory, in its logical order; its axes in
/// `to` then take its place. Axes of size 1 go anywhere.
fn reshaped_layout(from: &[usize], perm: &[usize], to: &[usize]) -> Option<Vec<usize>> {
    let old: Vec<usize> = (0..from.len()).filter(|&a| from[a] != 1).collect();
    let new: Vec<usize> = (0..to.len()).filter(|&a| to[a] != 1).collect();
    // Groups of old and new axes with the same number of elements.
    let mut group_of_old = vec![usize::MAX; from.len()];
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        let (mut a, mut b) = (1usize, 1usize);
        let mut new_axes = Vec::new();
        loop {
            if a <= b && i < old.len() && (a < b || new_axes.is_empty() || a == 1) {
                a *= from[old[i]];
                group_of_old[old[i]] = groups.len();
                i += 1;
            } else if j < new.len() {
                b *= to[new[j]];
                new_axes.push(new[j]);
                j += 1;
            } else {
                return None;
            }
            if a == b && a > 1 {
                break;
            }
        }
        groups.push(new_axes);
    }
    // In memory, each group's old axes one after the other, in logical order.
    let in_memory: Vec<usize> = perm.iter().copied().filter(|&a| from[a] != 1).collect();
    let mut out: Vec<usize> = (0..to.len()).filter(|&a| to[a] == 1).collect();
    let mut k = 0;
    while k < in_memory.len() {
        let g = group_of_old[in_memory[k]];
        let members: Vec<usize> = old
            .iter()
            .copied()
            .filter(|&a| group_of_old[a] == g)
            .collect();
        if in_memory.get(k..k + members.len())? != members.as_slice() {
            return None;
        }
        out.extend(&groups[g]);
        k += members.len();
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::reshaped_layout;

    #[test]
    fn reshapes_keep_layouts_where_the_groups_lie_together() {
        // ViT's heads: [n, s, 768] → [n, s, 12, 64] splits the last axis, in any layout.
        assert_eq!(
            reshaped_layout(&[2, 197, 768], &[1, 0, 2], &[2, 197, 12, 64]),
            Some(vec![1, 0, 2, 3])
        );
        // Heads merged back: [n, s, h, d] laid out as [n, h, s, d] (perm [0, 2, 1, 3]) cannot
        // become [n, s, h·d] without a copy; laid out as itself it can.
        assert_eq!(
            reshaped_layout(&[2, 197, 12, 64], &[0, 2, 1, 3], &[2, 197, 768]),
            None
        );
        assert_eq!(
            reshaped_layout(&[2, 197, 12, 64], &[0, 1, 2, 3], &[2, 197, 768]),
            Some(vec![0, 1, 2])
        );
        // Swin's windows split from the batch axis: [n·w, h, t, d] → [n, w, h, t, d] with the
        // heads innermost but one.
        assert_eq!(
            reshaped_layout(&[8, 3, 49, 32], &[0, 2, 1, 3], &[2, 4, 3, 49, 32]),
            Some(vec![0, 1, 3, 2, 4])
        );
        // Axes of 1 anywhere; a reshape whose sizes do not regroup is refused.
        assert_eq!(
            reshaped_layout(&[1, 6, 1], &[2, 1, 0], &[2, 1, 3]),
            Some(vec![1, 0, 2])
        );
        assert_eq!(reshaped_layout(&[6, 4], &[1, 0], &[4, 6]), None);
        assert_eq!(reshaped_layout(&[6, 4], &[0, 1], &[4, 6]), Some(vec![0, 1]));
    }
}
