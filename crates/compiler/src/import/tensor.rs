// SPDX-License-Identifier: MPL-2.0
//! ONNX tensors (initializers, Constant values) as f32, and sizes given as integers.

use std::path::Path;

use tract_onnx::pb;

use crate::ir::Tensor;

/// An initializer or Constant value as f32; `dir` is the model's folder, for external data.
pub(crate) fn tensor(t: &pb::TensorProto, dir: &Path) -> Result<Tensor, String> {
    // The values are in the model (or in its external data, whose range was checked), so
    // a tensor may be as large as its data: `sizes`' cap, which keeps a small model from
    // making huge constants, does not apply. Past 2 GiB is what external data is for.
    let (shape, len) = counted(&t.dims, &format!("tensor `{}` has dims", t.name))?;
    let raw = if t.data_location == Some(1) {
        super::super::external_data::locate(t, dir)?.read()?
    } else {
        t.raw_data.clone()
    };
    let from_raw = |size: usize, f: &dyn Fn(&[u8]) -> f32| -> Vec<f32> {
        raw.chunks_exact(size).map(f).collect()
    };
    let data: Vec<f32> = match t.data_type {
        1 if !raw.is_empty() => {
            from_raw(4, &|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        }
        1 => t.float_data.clone(),
        7 if !raw.is_empty() => from_raw(8, &|b| {
            i64::from_le_bytes(b.try_into().expect("8 bytes")) as f32
        }),
        7 => t.int64_data.iter().map(|&v| v as f32).collect(),
        6 if !raw.is_empty() => from_raw(4, &|b| {
            i32::from_le_bytes(b.try_into().expect("4 bytes")) as f32
        }),
        6 | 5 | 4 | 3 | 2 | 9 if raw.is_empty() => t.int32_data.iter().map(|&v| v as f32).collect(),
        11 if !raw.is_empty() => from_raw(8, &|b| {
            f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32
        }),
        11 => t.double_data.iter().map(|&v| v as f32).collect(),
        10 if !raw.is_empty() => from_raw(2, &|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        10 => t
            .int32_data
            .iter()
            .map(|&v| half::f16::from_bits(v as u16).to_f32())
            .collect(),
        9 | 2 | 3 => raw
            .iter()
            .map(|&b| {
                if t.data_type == 3 {
                    b as i8 as f32
                } else {
                    b as f32
                }
            })
            .collect(),
        other => {
            return Err(format!(
                "tensor `{}` has data type {other}, which is not supported",
                t.name
            ));
        }
    };
    if data.len() != len {
        return Err(format!(
            "tensor `{}` holds {} values for shape {shape:?}",
            t.name,
            data.len()
        ));
    }
    Ok(Tensor::new(shape, data))
}

/// Sizes given as integers (a shape, a group count, split lengths): none negative, and
/// together small enough for a constant to be made of them.
pub(crate) fn sizes(values: &[i64], what: &str) -> Result<Vec<usize>, String> {
    const MAX_ELEMENTS: usize = 1 << 28;
    match counted(values, what)? {
        (sizes, n) if n <= MAX_ELEMENTS => Ok(sizes),
        _ => Err(format!("{what} {values:?} is too large")),
    }
}

/// Sizes, none negative, and how many elements they make.
fn counted(values: &[i64], what: &str) -> Result<(Vec<usize>, usize), String> {
    let sizes: Vec<usize> = values
        .iter()
        .map(|&v| usize::try_from(v))
        .collect::<Result<_, _>>()
        .map_err(|_| format!("{what} {values:?} has a negative value"))?;
    let n = sizes
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("{what} {values:?} is too large"))?;
    Ok((sizes, n))
}
