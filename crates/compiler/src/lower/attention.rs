// SPDX-License-Identifier: MPL-2.0
//! Fused attention: the query, key and value are read where they lie (the heads of one
//! projection, through strides) and the output is written in the query's layout, so that the
//! heads split from and merged into the sequence need no copies either.

use super::{Lowering, Val, merge_dims};
use crate::ir::Node;
use crate::plan::{AttentionStep, Rows, Step};

impl Lowering<'_> {
    pub(super) fn attention(
        &mut self,
        node: &Node,
        alpha: f32,
        shape: &[usize],
    ) -> Result<Val, String> {
        if self.wide {
            return Err("fused attention kept in f32: its kernel runs fp16 only".into());
        }
        let rank = shape.len();
        let (s, t) = (rank - 2, rank - 1);
        // The kernel reads rows whose elements are contiguous: the head axis innermost.
        let q = self.get(&node.inputs[0])?;
        let q = self.innermost(&q, t)?;
        let kt = self.get(&node.inputs[1])?;
        let k = self.innermost(&kt, s)?;
        let v = self.get(&node.inputs[2])?;
        let v = self.innermost(&v, t)?;
        let bias = match node.inputs.get(3) {
            Some(b) => {
                let b = self.get(b)?;
                Some(self.innermost(&b, t)?)
            }
            None => None,
        };
        // After attention the heads usually merge back into the rows of the sequence that
        // the query came from: laid out as the query, that merge is no copy.
        let y = self.alloc(shape, q.perm.clone());

        let stride = |v: &Val, axis: usize| match v.shape[axis] {
            1 => 0,
            _ => v.strides()[axis],
        };
        // (operand, its row axis); the key's rows are kᵀ's columns.
        let mut operands = vec![(&q, s), (&k, t), (&v, s), (&y, s)];
        operands.extend(bias.as_ref().map(|b| (b, s)));
        let batch_strides: Vec<Vec<i64>> = operands
            .iter()
            .map(|(v, _)| (0..s).map(|a| stride(v, a) as i64).collect())
            .collect();
        let (dims, merged) = merge_dims(shape[..s].to_vec(), batch_strides);
        if dims.len() > 3 {
            return Err(format!(
                "attention over {} batch axes that do not merge ({:?}); at most 3 are supported",
                dims.len(),
                &shape[..s]
            ));
        }
        let pad = 3 - dims.len();
        let mut batch = [1; 3];
        batch[pad..].copy_from_slice(&dims);
        let rows: Vec<Rows> = operands
            .iter()
            .zip(&merged)
            .map(|(&(v, row_axis), strides)| {
                let mut b = [0; 3];
                for (o, &st) in b[pad..].iter_mut().zip(strides) {
                    *o = st as usize;
                }
                Rows {
                    loc: v.loc,
                    batch: b,
                    row: stride(v, row_axis),
                }
            })
            .collect();
        let reads: Vec<_> = rows.iter().map(|r| r.loc).collect();
        let step = Step::Attention(AttentionStep {
            batch,
            queries: shape[s],
            keys: k.shape[t],
            dk: q.shape[t],
            dv: shape[t],
            alpha,
            q: rows[0],
            k: rows[1],
            v: rows[2],
            y: rows[3],
            bias: rows.get(4).copied(),
        });
        self.push(step, &reads);
        Ok(y)
    }
}
