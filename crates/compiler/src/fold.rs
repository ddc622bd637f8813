// SPDX-License-Identifier: MPL-2.0
//! Shape arithmetic on constants. Exporters compute reshape targets, class-token expansions
//! and attention masks from the input's shape (Shape, Equal, Where, Expand, Mod, Range, Not,
//! ScatterND, Pad, ...). The engine fixes each plan's batch and input size, so every such
//! value is known at import: these operators are evaluated here and never reach the GPU.

use super::ir::{Tensor, broadcast, strides};

/// The values of `t` broadcast (NumPy rules) to `shape`, which `t` must broadcast to.
fn broadcast_to(t: &Tensor, shape: &[usize]) -> Vec<f32> {
    let offset = shape.len() - t.shape.len();
    let src_strides = strides(&t.shape);
    let len: usize = shape.iter().product();
    let out_strides = strides(shape);
    (0..len)
        .map(|i| {
            let mut src = 0;
            for (axis, (&dim, &stride)) in shape.iter().zip(&out_strides).enumerate() {
                if axis < offset {
                    continue;
                }
                let k = axis - offset;
                if t.shape[k] != 1 {
                    src += (i / stride % dim) * src_strides[k];
                }
            }
            t.data[src]
        })
        .collect()
}

/// `f` of the inputs' values, element by element, with the inputs broadcast together.
fn elementwise(inputs: &[&Tensor], f: impl Fn(&[f32]) -> f32) -> Result<Tensor, String> {
    let mut shape = Vec::new();
    for t in inputs {
        shape = broadcast(&shape, &t.shape).ok_or_else(|| {
            let shapes: Vec<_> = inputs.iter().map(|t| &t.shape).collect();
            format!("shapes {shapes:?} do not broadcast together")
        })?;
    }
    let columns: Vec<Vec<f32>> = inputs.iter().map(|t| broadcast_to(t, &shape)).collect();
    let mut values = vec![0.0; inputs.len()];
    let data = (0..shape.iter().product())
        .map(|i| {
            for (v, column) in values.iter_mut().zip(&columns) {
                *v = column[i];
            }
            f(&values)
        })
        .collect();
    Ok(Tensor::new(shape, data))
}

fn truth(v: bool) -> f32 {
    if v { 1.0 } else { 0.0 }
}

pub(super) fn equal(a: &Tensor, b: &Tensor) -> Result<Tensor, String> {
    elementwise(&[a, b], |v| truth(v[0] == v[1]))
}

pub(super) fn not(x: &Tensor) -> Tensor {
    Tensor::new(
        x.shape.clone(),
        x.data.iter().map(|&v| truth(v == 0.0)).collect(),
    )
}

/// ONNX Where: `x` where `condition` is true, else `y`.
pub(super) fn select(condition: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor, String> {
    elementwise(
        &[condition, x, y],
        |v| if v[0] != 0.0 { v[1] } else { v[2] },
    )
}

/// ONNX Mod: with `fmod`, the remainder takes the dividend's sign (C's fmod); without it,
/// integers whose remainder takes the divisor's sign (Python's %).
pub(super) fn modulo(a: &Tensor, b: &Tensor, fmod: bool) -> Result<Tensor, String> {
    if !fmod && b.data.contains(&0.0) {
        return Err("an integer Mod by zero".into());
    }
    elementwise(&[a, b], |v| {
        let r = v[0] % v[1];
        if !fmod && r != 0.0 && (r < 0.0) != (v[1] < 0.0) {
            r + v[1]
        } else {
            r
        }
    })
}

/// ONNX Expand: `x` broadcast with `shape` (both ways, so a 1 in `shape` keeps `x`'s size).
pub(super) fn expand(x: &Tensor, shape: &[i64]) -> Result<Tensor, String> {
    let shape = shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("Expand to a negative size {d}")))
        .collect::<Result<Vec<_>, _>>()?;
    let target = broadcast(&x.shape, &shape)
        .ok_or_else(|| format!("{:?} does not expand to {shape:?}", x.shape))?;
    Ok(Tensor::new(target.clone(), broadcast_to(x, &target)))
}

/// ONNX Range: start, start + delta, ... up to (not including) limit.
pub(super) fn range(start: f32, limit: f32, delta: f32) -> Result<Tensor, String> {
    if delta == 0.0 {
        return Err("a Range with a step of 0".into());
    }
    let n = ((limit - start) / delta).ceil().max(0.0);
    if n > (1 << 24) as f32 {
        return Err(format!("a Range of {n} values"));
    }
    let data: Vec<f32> = (0..n as usize).map(|i| start + i as f32 * delta).collect();
    Ok(Tensor::new(vec![data.len()], data))
}

/// The slices of `data` that the index tuples of `indices` (its last axis, as ScatterND and
/// GatherND read them) name: each slice's first element and the slice's length. `op` names
/// the operator in errors.
fn nd_slices(data: &Tensor, indices: &Tensor, op: &str) -> Result<(Vec<usize>, usize), String> {
    let depth = *indices
        .shape
        .last()
        .ok_or(format!("{op} indices of rank 0"))?;
    if depth == 0 || depth > data.shape.len() {
        return Err(format!(
            "{op} indices of depth {depth} into a tensor of rank {}",
            data.shape.len()
        ));
    }
    let data_strides = strides(&data.shape);
    let starts = (indices.ints().chunks(depth))
        .map(|index| {
            let mut start = 0;
            for (axis, &i) in index.iter().enumerate() {
                let dim = data.shape[axis] as i64;
                let i = if i < 0 { i + dim } else { i };
                if !(0..dim).contains(&i) {
                    return Err(format!("{op} index {i} out of range for an axis of {dim}"));
                }
                start += i as usize * data_strides[axis];
            }
            Ok(start)
        })
        .collect::<Result<_, String>>()?;
    Ok((starts, data.shape[depth..].iter().product()))
}

/// ONNX ScatterND (reduction none): `data` with the slices that `indices` name replaced by
/// `updates`.
pub(super) fn scatter_nd(
    data: &Tensor,
    indices: &Tensor,
    updates: &Tensor,
) -> Result<Tensor, String> {
    let (starts, slice) = nd_slices(data, indices, "ScatterND")?;
    let count = starts.len();
    if updates.len() != count * slice {
        return Err(format!(
            "ScatterND of {count} slices of {slice} values with {} updates",
            updates.len()
        ));
    }
    let mut out = data.data.to_vec();
    for (k, start) in starts.into_iter().enumerate() {
        out[start..start + slice].copy_from_slice(&updates.data[k * slice..(k + 1) * slice]);
    }
    Ok(Tensor::new(data.shape.clone(), out))
}

/// ONNX GatherND with `batch_dims` 0: each index tuple (the last axis of `indices`) picks a
/// slice of `data`.
pub(super) fn gather_nd(data: &Tensor, indices: &Tensor) -> Result<Tensor, String> {
    let (starts, slice) = nd_slices(data, indices, "GatherND")?;
    let mut out = Vec::with_capacity(starts.len() * slice);
    for start in starts {
        out.extend_from_slice(&data.data[start..start + slice]);
    }
    // [indices' axes but the last, the slice's axes]; nd_slices checked the tuples' depth.
    let (tuple_axes, depth) = indices.shape.split_at(indices.shape.len() - 1);
    let mut shape = tuple_axes.to_vec();
    shape.extend(&data.shape[depth[0]..]);
    Ok(Tensor::new(shape, out))
}

/// ONNX Pad in constant mode: `pads` holds every axis's padding before, then after
/// (negative values crop).
pub(super) fn pad(x: &Tensor, pads: &[i64], value: f32) -> Result<Tensor, String> {
    let rank = x.shape.len();
    if pads.len() != 2 * rank {
        return Err(format!("{} pads for a tensor of rank {rank}", pads.len()));
    }
    let shape = (0..rank)
        .map(|a| {
            let d = x.shape[a] as i64 + pads[a] + pads[a + rank];
            usize::try_from(d).map_err(|_| format!("Pad {pads:?} leaves a negative size"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let out_strides = strides(&shape);
    let in_strides = strides(&x.shape);
    let data = (0..shape.iter().product())
        .map(|i| {
            let mut src = 0;
            for a in 0..rank {
                let j = (i / out_strides[a] % shape[a]) as i64 - pads[a];
                if !(0..x.shape[a] as i64).contains(&j) {
                    return value;
                }
                src += j as usize * in_strides[a];
            }
            x.data[src]
        })
        .collect();
    Ok(Tensor::new(shape, data))
}

/// ONNX Slice with any steps (negative ones walk backwards), on the axes given.
pub(super) fn slice(
    x: &Tensor,
    starts: &[i64],
    ends: &[i64],
    axes: &[usize],
    steps: &[i64],
) -> Result<Tensor, String> {
    let rank = x.shape.len();
    // Per axis: the first index taken, the step, and how many.
    let mut ranges: Vec<(i64, i64, usize)> = x.shape.iter().map(|&d| (0, 1, d)).collect();
    for (k, &axis) in axes.iter().enumerate() {
        let (dim, step) = (x.shape[axis] as i64, steps[k]);
        if step == 0 {
            return Err("a Slice with a step of 0".into());
        }
        let wrap = |v: i64| if v < 0 { v + dim } else { v };
        let (start, end) = if step > 0 {
            (wrap(starts[k]).clamp(0, dim), wrap(ends[k]).clamp(0, dim))
        } else {
            (
                wrap(starts[k]).clamp(0, dim - 1),
                wrap(ends[k]).clamp(-1, dim - 1),
            )
        };
        let count = if step > 0 {
            (end - start + step - 1).div_euclid(step)
        } else {
            (start - end - step - 1).div_euclid(-step)
        };
        ranges[axis] = (start, step, count.max(0) as usize);
    }
    let shape: Vec<usize> = ranges.iter().map(|r| r.2).collect();
    let (out_strides, in_strides) = (strides(&shape), strides(&x.shape));
    let data = (0..shape.iter().product())
        .map(|i| {
            let src: i64 = (0..rank)
                .map(|a| {
                    let (start, step, _) = ranges[a];
                    (start + (i / out_strides[a] % shape[a]) as i64 * step) * in_strides[a] as i64
                })
                .sum();
            x.data[src as usize]
        })
        .collect();
    Ok(Tensor::new(shape, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize], data: &[f32]) -> Tensor {
        Tensor::new(shape.to_vec(), data.to_vec())
    }

    #[test]
    fn comparisons_and_selection_broadcast() {
        let shape = t(&[3], &[2.0, -1.0, 8.0]);
        let minus_one = t(&[], &[-1.0]);
        let mask = equal(&shape, &minus_one).unwrap();
        assert_eq!(*mask.data, [0.0, 1.0, 0.0]);
        assert_eq!(*not(&mask).data, [1.0, 0.0, 1.0]);
        // The Reshape-target pattern: -1 replaced by 1.
        let picked = select(&mask, &t(&[3], &[1.0; 3]), &shape).unwrap();
        assert_eq!(*picked.data, [2.0, 1.0, 8.0]);
        let rows = select(
            &t(&[2, 1], &[1.0, 0.0]),
            &t(&[3], &[1.0, 2.0, 3.0]),
            &minus_one,
        );
        assert_eq!(*rows.unwrap().data, [1.0, 2.0, 3.0, -1.0, -1.0, -1.0]);
        assert!(equal(&t(&[2], &[0.0; 2]), &t(&[3], &[0.0; 3])).is_err());
    }

    #[test]
    fn mod_follows_the_divisor_or_the_dividend() {
        let a = t(&[4], &[7.0, -7.0, 7.0, -7.0]);
        let b = t(&[4], &[3.0, 3.0, -3.0, -3.0]);
        assert_eq!(*modulo(&a, &b, false).unwrap().data, [1.0, 2.0, -2.0, -1.0]);
        assert_eq!(*modulo(&a, &b, true).unwrap().data, [1.0, -1.0, 1.0, -1.0]);
        assert!(modulo(&a, &t(&[], &[0.0]), false).is_err());
    }

    #[test]
    fn expand_broadcasts_both_ways() {
        // A class token [1, 1, 2] expanded to the batch: [3, 1, 2].
        let token = t(&[1, 1, 2], &[5.0, 6.0]);
        let e = expand(&token, &[3, 1, 2]).unwrap();
        assert_eq!(e.shape, [3, 1, 2]);
        assert_eq!(*e.data, [5.0, 6.0, 5.0, 6.0, 5.0, 6.0]);
        // A 1 in the shape keeps the tensor's size; a shorter shape is aligned right.
        let column = t(&[2, 1], &[1.0, 2.0]);
        let e = expand(&column, &[1, 3]).unwrap();
        assert_eq!(
            (e.shape.as_slice(), e.data.as_slice()),
            (&[2, 3][..], &[1.0, 1.0, 1.0, 2.0, 2.0, 2.0][..])
        );
        assert!(expand(&column, &[3, 3]).is_err());
        assert!(expand(&column, &[-1]).is_err());
    }

    #[test]
    fn range_counts_up_and_down() {
        assert_eq!(*range(0.0, 4.0, 1.0).unwrap().data, [0.0, 1.0, 2.0, 3.0]);
        assert_eq!(*range(10.0, 4.0, -3.0).unwrap().data, [10.0, 7.0]);
        assert!(range(0.0, 4.0, -1.0).unwrap().is_empty());
        assert!(range(0.0, 4.0, 0.0).is_err());
    }

    #[test]
    fn scatter_nd_replaces_slices() {
        // Whole rows (indices of depth 1), then one element (depth 2, a negative index).
        let data = t(&[4, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        let indices = t(&[2, 1], &[0.0, 2.0]);
        let updates = t(&[2, 2], &[10.0, 11.0, 12.0, 13.0]);
        let s = scatter_nd(&data, &indices, &updates).unwrap();
        assert_eq!(*s.data, [10.0, 11.0, 3.0, 4.0, 12.0, 13.0, 7.0, 8.0]);
        let element = scatter_nd(&data, &t(&[1, 2], &[3.0, -1.0]), &t(&[1], &[0.0])).unwrap();
        assert_eq!(element.data[7], 0.0);
        assert!(scatter_nd(&data, &t(&[1, 1], &[4.0]), &t(&[1, 2], &[0.0; 2])).is_err());
        assert!(scatter_nd(&data, &indices, &t(&[3], &[0.0; 3])).is_err());
    }

    #[test]
    fn gather_nd_picks_slices_by_index_tuples() {
        // LeViT's bias table [heads, offsets] indexed by (head, offset) pairs, as the dynamo
        // exporter writes it.
        let table = t(&[2, 3], &[0.0, 1.0, 2.0, 10.0, 11.0, 12.0]);
        let pairs = t(&[2, 2, 2], &[0.0, 2.0, 1.0, 0.0, 1.0, -1.0, 0.0, 0.0]);
        let got = gather_nd(&table, &pairs).unwrap();
        assert_eq!(got.shape, [2, 2]);
        assert_eq!(*got.data, [2.0, 10.0, 12.0, 0.0]);
        // A shorter tuple picks whole rows.
        let rows = gather_nd(&table, &t(&[2, 1], &[1.0, 0.0])).unwrap();
        assert_eq!(rows.shape, [2, 3]);
        assert_eq!(*rows.data, [10.0, 11.0, 12.0, 0.0, 1.0, 2.0]);
        assert!(gather_nd(&table, &t(&[1, 2], &[2.0, 0.0])).is_err());
        assert!(gather_nd(&table, &t(&[1, 3], &[0.0, 0.0, 0.0])).is_err());
    }

    #[test]
    fn slice_steps_forwards_and_backwards() {
        let x = t(&[2, 4], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        // How the exporter reverses F.pad's pairs: step -1 from the end.
        let r = slice(&x, &[-1], &[i64::MIN], &[0], &[-1]).unwrap();
        assert_eq!(*r.data, [4.0, 5.0, 6.0, 7.0, 0.0, 1.0, 2.0, 3.0]);
        let every_other = slice(&x, &[1], &[4], &[1], &[2]).unwrap();
        assert_eq!(
            (every_other.shape.as_slice(), every_other.data.as_slice()),
            (&[2, 2][..], &[1.0, 3.0, 5.0, 7.0][..])
        );
        let back = slice(&x, &[3], &[0], &[1], &[-2]).unwrap();
        assert_eq!(*back.data, [3.0, 1.0, 7.0, 5.0]);
        assert!(slice(&x, &[0], &[9], &[1], &[3]).unwrap().data.len() == 4);
        assert!(slice(&x, &[0], &[1], &[1], &[0]).is_err());
    }

    #[test]
    fn pad_adds_and_crops() {
        let x = t(&[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let p = pad(&x, &[0, 1, 1, 0], 9.0).unwrap();
        assert_eq!(p.shape, [3, 3]);
        assert_eq!(*p.data, [9.0, 1.0, 2.0, 9.0, 3.0, 4.0, 9.0, 9.0, 9.0]);
        let cropped = pad(&x, &[0, -1, 0, 0], 0.0).unwrap();
        assert_eq!(
            (cropped.shape.as_slice(), cropped.data.as_slice()),
            (&[2, 1][..], &[2.0, 4.0][..])
        );
        assert!(pad(&x, &[0, 0], 0.0).is_err());
        assert!(pad(&x, &[0, -3, 0, 0], 0.0).is_err());
    }
}
