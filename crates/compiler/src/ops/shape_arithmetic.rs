// SPDX-License-Identifier: MPL-2.0
//! Constants, and the arithmetic exporters do on shapes (reshape targets, class-token
//! expansions, attention masks): with every shape settled at import, these operators only
//! ever see constants, and are evaluated here (by `fold`) rather than run.

use crate::fold;
use crate::import::attrs::norm_axis;
use crate::import::tensor::{sizes, tensor};
use crate::import::{Handled, Importer, OnnxNode};
use crate::ir::Tensor;

pub(crate) const OPS: &[&str] = &[
    "Constant",
    "ConstantOfShape",
    "Shape",
    "Equal",
    "Not",
    "Where",
    "Mod",
    "Range",
    "ScatterND",
    "GatherND",
];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(crate) fn required_inputs(op: &str, _opset: i64) -> usize {
    match op {
        "Constant" => 0,
        "Equal" | "Mod" | "GatherND" => 2,
        "Where" | "Range" | "ScatterND" => 3,
        _ => 1,
    }
}

pub(crate) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
    let attrs = &node.attrs;
    let t = match node.op() {
        "Constant" => constant(im, node)?,
        "ConstantOfShape" => {
            let shape = sizes(&im.need_const(&node.x(), "shape")?.ints(), "shape")?;
            let value = attrs
                .tensor("value")
                .map(|t| tensor(t, &im.dir))
                .transpose()?
                .map_or(0.0, |t| t.data[0]);
            let len = shape.iter().product();
            Tensor::new(shape, vec![value; len])
        }
        "Shape" => {
            let shape = im.shape(&node.x())?;
            let rank = shape.len() as i64;
            let start = norm_axis(attrs.i("start").unwrap_or(0).clamp(-rank, rank), rank + 1);
            let end = norm_axis(attrs.i("end").unwrap_or(rank).clamp(-rank, rank), rank + 1);
            let dims: Vec<f32> = shape[start..end.max(start)]
                .iter()
                .map(|&d| d as f32)
                .collect();
            Tensor::new(vec![dims.len()], dims)
        }
        "Equal" | "Not" | "Where" | "Mod" | "Range" | "ScatterND" | "GatherND" => {
            let values = constant_inputs(im, node)?;
            let scalar = |t: &Tensor| match t.len() {
                1 => Ok(t.data[0]),
                n => Err(format!("a Range bound of {n} values")),
            };
            match node.op() {
                "Equal" => fold::equal(values[0], values[1])?,
                "Not" => fold::not(values[0]),
                "Where" => fold::select(values[0], values[1], values[2])?,
                "Mod" => fold::modulo(values[0], values[1], attrs.i("fmod") == Some(1))?,
                "Range" => fold::range(scalar(values[0])?, scalar(values[1])?, scalar(values[2])?)?,
                // The dynamo exporter's indexing of LeViT's attention-bias table.
                "GatherND" => {
                    if attrs.i("batch_dims").unwrap_or(0) != 0 {
                        return Err("GatherND with batch_dims is not supported".into());
                    }
                    fold::gather_nd(values[0], values[1])?
                }
                _ => fold::scatter_nd(values[0], values[1], values[2])?,
            }
        }
        _ => return Ok(Handled::NotMine),
    };
    im.set_const(&node.out(), t);
    Ok(Handled::Yes)
}

fn constant(im: &Importer, node: &OnnxNode) -> Result<Tensor, String> {
    let attrs = &node.attrs;
    Ok(if let Some(t) = attrs.tensor("value") {
        tensor(t, &im.dir)?
    } else if let Some(f) = attrs.f("value_float") {
        Tensor::scalar(f)
    } else if let Some(i) = attrs.i("value_int") {
        Tensor::scalar(i as f32)
    } else if let Some(v) = attrs.floats("value_floats") {
        Tensor::new(vec![v.len()], v.to_vec())
    } else if let Some(v) = attrs.ints("value_ints") {
        Tensor::new(vec![v.len()], v.iter().map(|&i| i as f32).collect())
    } else {
        return Err("a Constant without a supported value".into());
    })
}

/// The values of every input of `node`, which must all be constants: an operator on shapes
/// that meets the image's activations is refused, naming the input.
pub(crate) fn constant_inputs<'a>(
    im: &'a Importer,
    node: &OnnxNode,
) -> Result<Vec<&'a Tensor>, String> {
    let op = node.op();
    (node.inputs().iter())
        .map(|i| {
            im.constant(i).ok_or_else(|| {
                format!(
                    "its input `{i}` is computed from the image; {op} is only supported on \
                     shape arithmetic, which the import evaluates"
                )
            })
        })
        .collect()
}
