// SPDX-License-Identifier: MPL-2.0
//! Convolutions, batch normalisation and pooling: the operators on NCHW feature maps.

use super::attrs::Attrs;
use super::tensor::sizes;
use super::{Handled, Importer, OnnxNode};
use crate::ir::{Act, Conv2d, Op, Pool2d, PoolKind, Tensor};

pub(super) const OPS: &[&str] = &[
    "Conv",
    "BatchNormalization",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "GlobalMaxPool",
];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(super) fn required_inputs(op: &str, _opset: i64) -> usize {
    match op {
        "Conv" => 2,
        "BatchNormalization" => 5,
        _ => 1,
    }
}

pub(super) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
    match node.op() {
        "Conv" => conv(im, node)?,
        "BatchNormalization" => batch_norm(im, node)?,
        "MaxPool" | "AveragePool" => pool(im, node)?,
        "GlobalAveragePool" | "GlobalMaxPool" => global_pool(im, node)?,
        _ => return Ok(Handled::NotMine),
    }
    Ok(Handled::Yes)
}

fn conv(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (name, attrs, inputs, x) = (node.name, &node.attrs, node.inputs(), node.x());
    let xs = im.shape(&x)?;
    let w = im.need_const(&inputs[1], "weight")?.clone();
    if xs.len() != 4 || w.shape.len() != 4 {
        return Err(format!(
            "only 2-D convolutions are supported (input {xs:?})"
        ));
    }
    let group = sizes(&[attrs.i("group").unwrap_or(1)], "group")?[0];
    let kernel = [w.shape[2], w.shape[3]];
    let strides = attrs.pair("strides", 1)?;
    let dilations = attrs.pair("dilations", 1)?;
    if group == 0 || xs[1] != w.shape[1] * group || w.shape[0] % group != 0 {
        return Err(format!(
            "weight {:?} does not fit {} input channels in {group} group(s)",
            w.shape, xs[1]
        ));
    }
    let pads = attrs.pads(&xs[2..], &kernel, &strides, &dilations)?;
    let out_hw = conv_out(&xs[2..], &kernel, &strides, &dilations, &pads)?;
    let bias = match node.input(2) {
        Some(b) if im.shape(&b)? != [w.shape[0]] => {
            return Err(format!(
                "the bias has shape {:?}; {} output channels need [{}]",
                im.shape(&b)?,
                w.shape[0],
                w.shape[0]
            ));
        }
        Some(b) => b,
        None => {
            let b = format!("{name}.zero_bias");
            im.set_const(&b, Tensor::new(vec![w.shape[0]], vec![0.0; w.shape[0]]));
            b
        }
    };
    let op = Op::Conv(Conv2d {
        kernel,
        strides,
        pads,
        dilations,
        group,
        act: Act::None,
    });
    let shape = vec![xs[0], w.shape[0], out_hw[0], out_hw[1]];
    im.add(
        name,
        op,
        vec![x, inputs[1].clone(), bias],
        &node.out(),
        shape,
    );
    Ok(())
}

fn batch_norm(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let inputs = node.inputs();
    let shape = im.shape(&node.x())?;
    for (i, what) in [(1, "scale"), (2, "bias"), (3, "mean"), (4, "variance")] {
        let t = im.need_const(inputs.get(i).map_or("", |s| s), what)?;
        if shape.len() < 2 || t.len() != shape[1] {
            return Err(format!("its {what} does not have one value per channel"));
        }
    }
    let epsilon = node.attrs.f("epsilon").unwrap_or(1e-5);
    let op = Op::BatchNorm { epsilon };
    im.add(node.name, op, inputs[..5].to_vec(), &node.out(), shape);
    Ok(())
}

fn pool(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (attrs, x) = (&node.attrs, node.x());
    let xs = im.shape(&x)?;
    if xs.len() != 4 {
        return Err(format!("only 2-D pooling is supported (input {xs:?})"));
    }
    if node.outputs().len() > 1 && !node.outputs()[1].is_empty() {
        return Err("MaxPool's indices output is not supported".into());
    }
    let kernel = attrs.pair("kernel_shape", 0)?;
    let strides = attrs.pair("strides", 1)?;
    let dilations = attrs.pair("dilations", 1)?;
    if dilations != [1, 1] {
        return Err("dilated pooling is not supported".into());
    }
    let pads = attrs.pads(&xs[2..], &kernel, &strides, &dilations)?;
    let mut out_hw = conv_out(&xs[2..], &kernel, &strides, &dilations, &pads)?;
    if attrs.i("ceil_mode") == Some(1) {
        for a in 0..2 {
            let span = xs[2 + a] + pads[a] + pads[a + 2] - kernel[a];
            let mut o = span.div_ceil(strides[a]) + 1;
            // The last window must start inside the input or its left padding.
            if (o - 1) * strides[a] >= xs[2 + a] + pads[a] {
                o -= 1;
            }
            out_hw[a] = o;
        }
    }
    let kind = pool_kind(node.op(), attrs);
    // The output shape carries ceil_mode; the pads stay as declared, which is what
    // count_include_pad counts.
    let pool = Pool2d {
        kind,
        kernel,
        strides,
        pads,
    };
    let shape = vec![xs[0], xs[1], out_hw[0], out_hw[1]];
    im.add(node.name, Op::Pool(pool), vec![x], &node.out(), shape);
    Ok(())
}

fn pool_kind(op: &str, attrs: &Attrs) -> PoolKind {
    if op == "MaxPool" {
        PoolKind::Max
    } else {
        PoolKind::Avg {
            count_include_pad: attrs.i("count_include_pad") == Some(1),
        }
    }
}

fn global_pool(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let x = node.x();
    let xs = im.shape(&x)?;
    if xs.len() != 4 {
        return Err(format!("only 2-D pooling is supported (input {xs:?})"));
    }
    let op = if node.op() == "GlobalAveragePool" {
        Op::GlobalAvgPool
    } else {
        Op::Pool(Pool2d {
            kind: PoolKind::Max,
            kernel: [xs[2], xs[3]],
            strides: [1, 1],
            pads: [0; 4],
        })
    };
    im.add(
        node.name,
        op,
        vec![x],
        &node.out(),
        vec![xs[0], xs[1], 1, 1],
    );
    Ok(())
}

/// The output size of a window of `kernel` sliding over `input` (height, width).
fn conv_out(
    input: &[usize],
    kernel: &[usize; 2],
    strides: &[usize; 2],
    dilations: &[usize; 2],
    pads: &[usize; 4],
) -> Result<[usize; 2], String> {
    let mut out = [0; 2];
    for a in 0..2 {
        let span = (kernel[a] - 1) * dilations[a] + 1;
        let padded = input[a] + pads[a] + pads[a + 2];
        if kernel[a] == 0 || padded < span {
            return Err(format!(
                "a kernel of {span} does not fit an input of {padded} (padded)"
            ));
        }
        out[a] = (padded - span) / strides[a] + 1;
    }
    Ok(out)
}
