// SPDX-License-Identifier: MPL-2.0
//! Resize of the image's activations. Along each spatial axis a nearest or linear resize is
//! a fixed linear map, so it imports as a product with a constant interpolation matrix: one
//! over the width (the last axis), and one over the height, moved last for it and back.
//! MobileViT pads its 7×7 maps to 8×8 this way, and EfficientFormer v2 doubles the size of
//! its attention's output; neither needs a kernel of its own.

use crate::import::{Handled, Importer, OnnxNode};
use crate::ir::{Act, Op, Tensor};

pub(crate) const OPS: &[&str] = &["Resize"];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(crate) fn required_inputs(_op: &str, _opset: i64) -> usize {
    1
}

pub(crate) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
    match node.op() {
        "Resize" => resize(im, node)?,
        _ => return Ok(Handled::NotMine),
    }
    Ok(Handled::Yes)
}

/// How an output position maps back to the input (ONNX's `coordinate_transformation_mode`).
#[derive(Clone, Copy)]
enum Coordinates {
    HalfPixel,
    PytorchHalfPixel,
    AlignCorners,
    Asymmetric,
}

/// Which input values an output takes, and in what share.
#[derive(Clone, Copy)]
enum Interpolation {
    /// The nearest value, ties going down (`round_prefer_floor`, `floor`) or up.
    Nearest {
        rounding: Rounding,
    },
    Linear,
}

#[derive(Clone, Copy)]
enum Rounding {
    PreferFloor,
    PreferCeil,
    Floor,
    Ceil,
}

fn resize(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (name, attrs, x, out) = (node.name, &node.attrs, node.x(), node.out());
    let xs = im.shape(&x)?;
    let interpolation = match attrs.s("mode").unwrap_or("nearest") {
        "nearest" => Interpolation::Nearest {
            rounding: match attrs.s("nearest_mode").unwrap_or("round_prefer_floor") {
                "round_prefer_floor" => Rounding::PreferFloor,
                "round_prefer_ceil" => Rounding::PreferCeil,
                "floor" => Rounding::Floor,
                "ceil" => Rounding::Ceil,
                other => return Err(format!("nearest_mode `{other}` is not supported")),
            },
        },
        "linear" => Interpolation::Linear,
        other => {
            return Err(format!(
                "the `{other}` mode is not supported (nearest, linear are)"
            ));
        }
    };
    // Opset 10's Resize is asymmetric; from 11 on the default is half_pixel.
    let default = if im.opset < 11 {
        "asymmetric"
    } else {
        "half_pixel"
    };
    let coordinates = match attrs.s("coordinate_transformation_mode").unwrap_or(default) {
        "half_pixel" => Coordinates::HalfPixel,
        "pytorch_half_pixel" => Coordinates::PytorchHalfPixel,
        "align_corners" => Coordinates::AlignCorners,
        "asymmetric" => Coordinates::Asymmetric,
        other => {
            return Err(format!(
                "coordinate_transformation_mode `{other}` is not supported"
            ));
        }
    };
    if attrs.i("antialias").unwrap_or(0) != 0 {
        return Err("antialiased resizing is not supported".into());
    }
    if attrs
        .s("keep_aspect_ratio_policy")
        .is_some_and(|p| p != "stretch")
    {
        return Err("keep_aspect_ratio_policy other than `stretch` is not supported".into());
    }
    let rank = xs.len();
    let axes: Vec<usize> = match attrs.ints("axes") {
        Some(axes) => axes
            .iter()
            .map(|&a| crate::import::attrs::axis_of(a, rank as i64))
            .collect::<Result<_, _>>()?,
        None => (0..rank).collect(),
    };
    // Opset 10: (X, scales); from 11: (X, roi, scales, sizes).
    let (scales, sizes) = if im.opset < 11 {
        (node.input(1), None)
    } else {
        (node.input(2), node.input(3))
    };
    let scales = scales
        .map(|s| im.need_const(&s, "scales").map(|t| t.data.to_vec()))
        .transpose()?
        .filter(|s| !s.is_empty());
    let sizes = sizes
        .map(|s| im.need_const(&s, "sizes").map(Tensor::ints))
        .transpose()?
        .filter(|s| !s.is_empty());
    // Each axis's output size, and the scale that maps coordinates.
    let mut target = xs.clone();
    let mut scale: Vec<f32> = vec![1.0; rank];
    match (scales, sizes) {
        (_, Some(sizes)) if sizes.len() == axes.len() => {
            for (&axis, &size) in axes.iter().zip(&sizes) {
                target[axis] = usize::try_from(size)
                    .ok()
                    .filter(|&s| s > 0)
                    .ok_or_else(|| format!("an output size of {size}"))?;
                scale[axis] = target[axis] as f32 / xs[axis] as f32;
            }
        }
        (Some(scales), None) if scales.len() == axes.len() => {
            for (&axis, &s) in axes.iter().zip(&scales) {
                if !(s.is_finite() && s > 0.0) {
                    return Err(format!("a scale of {s}"));
                }
                target[axis] = (xs[axis] as f32 * s).floor() as usize;
                scale[axis] = s;
            }
        }
        _ => {
            return Err(format!(
                "neither scales nor sizes give one value for each of its {} axes",
                axes.len()
            ));
        }
    }
    if rank != 4 || target[..2] != xs[..2] || target.contains(&0) {
        return Err(format!(
            "resizing {xs:?} to {target:?}: only the last two axes of a 4-D tensor may be \
             resized"
        ));
    }
    // The width first, then the height: each a product over the last axis.
    let matrix = |axis: usize| {
        interpolation_matrix(
            xs[axis],
            target[axis],
            scale[axis],
            coordinates,
            interpolation,
        )
    };
    let (width, height) = (matrix(3), matrix(2));
    let mut value = x;
    let mut shape = xs.clone();
    if let Some(w) = width {
        shape[3] = target[3];
        let next = if height.is_some() {
            format!("{out}.width")
        } else {
            out.clone()
        };
        product(im, name, "width", &value, w, &next, shape.clone());
        value = next;
    }
    if let Some(h) = height {
        let swap = vec![0, 1, 3, 2];
        let (turned, resized) = (format!("{out}.turned"), format!("{out}.height"));
        let turned_shape = vec![shape[0], shape[1], shape[3], shape[2]];
        im.add(
            name,
            Op::Transpose { perm: swap.clone() },
            vec![value],
            &turned,
            turned_shape.clone(),
        );
        let mut resized_shape = turned_shape;
        resized_shape[3] = target[2];
        product(im, name, "height", &turned, h, &resized, resized_shape);
        shape[2] = target[2];
        im.add(
            name,
            Op::Transpose { perm: swap },
            vec![resized],
            &out,
            shape,
        );
    } else if value != out {
        // Nothing to resize: the output is the input.
        im.alias.insert(out, value);
    }
    Ok(())
}

/// `output = value · matrix` over the last axis, the matrix a constant named after the node.
fn product(
    im: &mut Importer,
    name: &str,
    axis: &str,
    value: &str,
    matrix: Tensor,
    output: &str,
    shape: Vec<usize>,
) {
    let weight = format!("{name}.{axis}_interpolation");
    im.set_const(&weight, matrix);
    let op = Op::Gemm { act: Act::None };
    im.add(name, op, vec![value.to_owned(), weight], output, shape);
}

/// The `[input, output]` matrix whose product with a row of `input` values resizes it to
/// `output` values (ONNX's Resize reference); `None` where it is the identity.
fn interpolation_matrix(
    input: usize,
    output: usize,
    scale: f32,
    coordinates: Coordinates,
    interpolation: Interpolation,
) -> Option<Tensor> {
    let mut m = vec![0.0f32; input * output];
    let last = (input - 1) as f32;
    for o in 0..output {
        let x = match coordinates {
            Coordinates::HalfPixel => (o as f32 + 0.5) / scale - 0.5,
            Coordinates::PytorchHalfPixel if output > 1 => (o as f32 + 0.5) / scale - 0.5,
            Coordinates::PytorchHalfPixel => 0.0,
            Coordinates::AlignCorners if output > 1 => o as f32 * last / (output - 1) as f32,
            Coordinates::AlignCorners => 0.0,
            Coordinates::Asymmetric => o as f32 / scale,
        };
        match interpolation {
            Interpolation::Nearest { rounding } => {
                let i = match rounding {
                    Rounding::PreferFloor if x.fract() == 0.5 => x.floor(),
                    Rounding::PreferCeil if x.fract() == 0.5 => x.ceil(),
                    Rounding::PreferFloor | Rounding::PreferCeil => x.round(),
                    Rounding::Floor => x.floor(),
                    Rounding::Ceil => x.ceil(),
                };
                m[i.clamp(0.0, last) as usize * output + o] = 1.0;
            }
            Interpolation::Linear => {
                let x = x.clamp(0.0, last);
                let i0 = x.floor() as usize;
                let i1 = (i0 + 1).min(input - 1);
                let w1 = x - i0 as f32;
                m[i0 * output + o] += 1.0 - w1;
                m[i1 * output + o] += w1;
            }
        }
    }
    let identity = input == output
        && (0..input).all(|i| (0..output).all(|o| m[i * output + o] == f32::from(i == o)));
    (!identity).then(|| Tensor::new(vec![input, output], m))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(t: &Tensor) -> Vec<Vec<f32>> {
        // [input, output] as one row per output, for reading.
        let (i, o) = (t.shape[0], t.shape[1]);
        (0..o)
            .map(|c| (0..i).map(|r| t.data[r * o + c]).collect())
            .collect()
    }

    #[test]
    fn linear_half_pixel_doubling_matches_the_onnx_reference() {
        // ONNX's reference for [1, 2, 3, 4] resized to 8 (half_pixel, linear):
        // [1, 1.25, 1.75, 2.25, 2.75, 3.25, 3.75, 4].
        let m = interpolation_matrix(4, 8, 2.0, Coordinates::HalfPixel, Interpolation::Linear)
            .expect("not the identity");
        let got: Vec<f32> = rows(&m)
            .iter()
            .map(|w| w.iter().zip([1.0, 2.0, 3.0, 4.0]).map(|(w, v)| w * v).sum())
            .collect();
        assert_eq!(got, [1.0, 1.25, 1.75, 2.25, 2.75, 3.25, 3.75, 4.0]);
    }

    #[test]
    fn seven_to_eight_keeps_every_row_a_weighted_mean() {
        // MobileViT's 7 → 8 (sizes given, so the scale is 8/7).
        let m = interpolation_matrix(
            7,
            8,
            8.0 / 7.0,
            Coordinates::HalfPixel,
            Interpolation::Linear,
        )
        .expect("not the identity");
        for w in rows(&m) {
            assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6, "{w:?}");
            assert!(w.iter().all(|&v| (0.0..=1.0).contains(&v)));
        }
        // The first and last outputs are the first and last inputs (clamped).
        assert_eq!(rows(&m)[0][0], 1.0);
        assert_eq!(rows(&m)[7][6], 1.0);
    }

    #[test]
    fn nearest_asymmetric_doubling_repeats_values() {
        let nearest = Interpolation::Nearest {
            rounding: Rounding::Floor,
        };
        let m = interpolation_matrix(3, 6, 2.0, Coordinates::Asymmetric, nearest)
            .expect("not the identity");
        let picked: Vec<usize> = rows(&m)
            .iter()
            .map(|w| w.iter().position(|&v| v == 1.0).expect("one value"))
            .collect();
        assert_eq!(picked, [0, 0, 1, 1, 2, 2]);
        // The same size is the identity, which needs no product.
        assert!(
            interpolation_matrix(5, 5, 1.0, Coordinates::HalfPixel, Interpolation::Linear)
                .is_none()
        );
    }
}
