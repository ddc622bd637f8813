// SPDX-License-Identifier: MPL-2.0
//! Matrix products: Gemm and MatMul by a constant matrix (fully connected layers, the
//! projections of attention), MatMul of two computed tensors (attention itself), and the
//! Einsums that are such products.

use super::{Handled, Importer, OnnxNode};
use crate::ir::{Act, Op, Tensor};

pub(super) const OPS: &[&str] = &["Gemm", "MatMul", "Einsum"];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(super) fn required_inputs(op: &str, _opset: i64) -> usize {
    match op {
        "Einsum" => 1,
        _ => 2,
    }
}

pub(super) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
    match node.op() {
        "Gemm" => gemm(im, node)?,
        "MatMul" => matmul(im, node)?,
        "Einsum" => einsum(im, node)?,
        _ => return Ok(Handled::NotMine),
    }
    Ok(Handled::Yes)
}

fn gemm(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (name, attrs, x) = (node.name, &node.attrs, node.x());
    let xs = im.shape(&x)?;
    if attrs.i("transA").unwrap_or(0) != 0 || xs.len() != 2 {
        return Err("only Gemm with a 2-D, untransposed A is supported".into());
    }
    let w = im.need_const(&node.inputs()[1], "B")?.clone();
    if w.shape.len() != 2 {
        return Err(format!("B must be a matrix; it has shape {:?}", w.shape));
    }
    let alpha = attrs.f("alpha").unwrap_or(1.0);
    let beta = attrs.f("beta").unwrap_or(1.0);
    let w = if attrs.i("transB").unwrap_or(0) != 0 {
        transpose2(&w)
    } else {
        w
    };
    let w = scale(&w, alpha);
    let n = w.shape[1];
    if w.shape[0] != xs[1] {
        return Err(format!("A is {xs:?} but B is {:?}", w.shape));
    }
    let w_name = format!("{name}.weight");
    im.set_const(&w_name, w);
    let mut node_inputs = vec![x, w_name];
    if let Some(c) = node.input(2) {
        let c = im.need_const(&c, "C")?;
        let bias = match c.len() {
            1 => vec![c.data[0] * beta; n],
            len if len == n => c.data.iter().map(|v| v * beta).collect(),
            _ => {
                return Err(format!(
                    "C has shape {:?}; one value per output is supported",
                    c.shape
                ));
            }
        };
        let b_name = format!("{name}.bias");
        im.set_const(&b_name, Tensor::new(vec![n], bias));
        node_inputs.push(b_name);
    }
    let op = Op::Gemm { act: Act::None };
    im.add(name, op, node_inputs, &node.out(), vec![xs[0], n]);
    Ok(())
}

fn matmul(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (x, w_name, out) = (node.x(), node.inputs()[1].clone(), node.out());
    let xs = im.shape(&x)?;
    let Some(w) = im.constant(&w_name).cloned() else {
        let ws = im.shape(&w_name)?;
        let r = xs.len();
        if r < 2 || ws.len() != r || xs[..r - 2] != ws[..r - 2] || xs[r - 1] != ws[r - 2] {
            return Err(format!(
                "a MatMul of {xs:?} and {ws:?}: only products with the same leading axes \
                 are supported"
            ));
        }
        let mut shape = xs.clone();
        shape[r - 1] = ws[r - 1];
        let op = Op::MatMul { alpha: 1.0 };
        im.add(node.name, op, vec![x, w_name], &out, shape);
        return Ok(());
    };
    if w.shape.len() != 2 || xs.last() != Some(&w.shape[0]) {
        return Err(format!("shapes {xs:?} and {:?} do not multiply", w.shape));
    }
    let mut shape = xs.clone();
    *shape.last_mut().expect("rank checked") = w.shape[1];
    let op = Op::Gemm { act: Act::None };
    im.add(node.name, op, vec![x, w_name], &out, shape);
    Ok(())
}

/// An Einsum of two tensors that is a batched matrix product, as MaxViT's attention
/// (`bghid,bghjd->bghij`): letters of both inputs and the output are batch axes, letters of
/// both inputs only are summed over, and a letter of one input and the output is a row (the
/// first input's) or a column (the second's). The inputs are transposed to [batch, rows,
/// summed] and [batch, summed, columns] and reshaped to three axes; their product, reshaped
/// back, is transposed to the output's order. Each transpose that keeps the order is left
/// out, so MaxViT's second product is a plain MatMul.
fn einsum(im: &mut Importer, node: &OnnxNode) -> Result<(), String> {
    let (name, out) = (node.name, node.out());
    let equation: String = (node.attrs.s("equation"))
        .ok_or("an Einsum without an equation")?
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let unsupported = || {
        format!(
            "the Einsum `{equation}`: only batched matrix products of two tensors (each \
             letter once per operand, no `...`) are supported"
        )
    };
    let (lhs, output) = equation.split_once("->").ok_or_else(unsupported)?;
    let operands: Vec<&str> = lhs.split(',').collect();
    let (&[a_axes, b_axes], [a, b]) = (operands.as_slice(), node.inputs()) else {
        return Err(unsupported());
    };
    let distinct = |s: &str| {
        s.chars().all(|c| c.is_ascii_alphabetic())
            && s.chars().enumerate().all(|(i, c)| !s[..i].contains(c))
    };
    if ![a_axes, b_axes, output].into_iter().all(distinct)
        || output
            .chars()
            .any(|c| !a_axes.contains(c) && !b_axes.contains(c))
    {
        return Err(unsupported());
    }
    let (a_shape, b_shape) = (im.shape(a)?, im.shape(b)?);
    if im.constant(a).is_some() != im.constant(b).is_some() {
        return Err(format!(
            "the Einsum `{equation}` of a constant and the image's activations: only products \
             of two computed tensors (attention) are supported"
        ));
    }
    if a_shape.len() != a_axes.len() || b_shape.len() != b_axes.len() {
        return Err(format!(
            "the Einsum `{equation}` names {} and {} axes of inputs of shapes {a_shape:?} and \
             {b_shape:?}",
            a_axes.len(),
            b_axes.len()
        ));
    }
    let size = |c: char| -> usize {
        match a_axes.find(c) {
            Some(i) => a_shape[i],
            None => b_shape[b_axes.find(c).expect("a letter of an input")],
        }
    };
    let pick = |f: &dyn Fn(char) -> bool, from: &str| -> String {
        from.chars().filter(|&c| f(c)).collect()
    };
    let batch = pick(&|c| b_axes.contains(c) && output.contains(c), a_axes);
    let summed = pick(&|c| b_axes.contains(c) && !output.contains(c), a_axes);
    let rows = pick(&|c| !b_axes.contains(c), a_axes);
    let cols = pick(&|c| !a_axes.contains(c), b_axes);
    // A letter of one input that the output drops would be a sum over it first.
    if rows
        .chars()
        .chain(cols.chars())
        .any(|c| !output.contains(c))
        || batch
            .chars()
            .chain(summed.chars())
            .any(|c| size(c) != b_shape[b_axes.find(c).expect("in b")])
    {
        return Err(unsupported());
    }
    let product = |letters: &str| -> usize { letters.chars().map(size).product() };
    let (nb, m, k, n) = (
        product(&batch),
        product(&rows),
        product(&summed),
        product(&cols),
    );
    let a3 = arrange(
        im,
        name,
        a,
        a_axes,
        &[&batch, &rows, &summed],
        vec![nb, m, k],
        "a",
    )?;
    let b3 = arrange(
        im,
        name,
        b,
        b_axes,
        &[&batch, &summed, &cols],
        vec![nb, k, n],
        "b",
    )?;
    let product_name = format!("{out}.product");
    let op = Op::MatMul { alpha: 1.0 };
    im.add(name, op, vec![a3, b3], &product_name, vec![nb, m, n]);
    // [batch, rows, cols] as the output's letters say.
    let order = format!("{batch}{rows}{cols}");
    arrange_into(im, name, &product_name, &order, output, &out, size)
}

/// `value` (whose axes are `letters`) transposed so that the groups come in order, then
/// reshaped to `shape` (one axis per group); the name of the result.
fn arrange(
    im: &mut Importer,
    name: &str,
    value: &str,
    letters: &str,
    groups: &[&str],
    shape: Vec<usize>,
    tag: &str,
) -> Result<String, String> {
    let order: String = groups.concat();
    let perm: Vec<usize> = order
        .chars()
        .map(|c| letters.find(c).expect("a letter of the value"))
        .collect();
    let mut current = value.to_owned();
    if perm.iter().enumerate().any(|(i, &p)| i != p) {
        let transposed = format!("{name}.{tag}.transposed");
        let dims = perm
            .iter()
            .map(|&p| im.shape(value).map(|s| s[p]))
            .collect::<Result<_, _>>()?;
        im.add(
            name,
            Op::Transpose { perm },
            vec![current],
            &transposed,
            dims,
        );
        current = transposed;
    }
    let reshaped = format!("{name}.{tag}.3d");
    im.add(name, Op::Reshape, vec![current], &reshaped, shape);
    Ok(reshaped)
}

/// The product `value` (axes `order` once split) reshaped to one axis per letter and
/// transposed to `output`'s order, as `out`.
fn arrange_into(
    im: &mut Importer,
    name: &str,
    value: &str,
    order: &str,
    output: &str,
    out: &str,
    size: impl Fn(char) -> usize,
) -> Result<(), String> {
    let split: Vec<usize> = order.chars().map(&size).collect();
    let perm: Vec<usize> = output
        .chars()
        .map(|c| order.find(c).expect("a letter of the product"))
        .collect();
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        im.add(name, Op::Reshape, vec![value.to_owned()], out, split);
        return Ok(());
    }
    let unflat = format!("{out}.split");
    im.add(
        name,
        Op::Reshape,
        vec![value.to_owned()],
        &unflat,
        split.clone(),
    );
    let dims = perm.iter().map(|&p| split[p]).collect();
    im.add(name, Op::Transpose { perm }, vec![unflat], out, dims);
    Ok(())
}

fn transpose2(w: &Tensor) -> Tensor {
    let (r, c) = (w.shape[0], w.shape[1]);
    let mut data = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            data[j * r + i] = w.data[i * c + j];
        }
    }
    Tensor::new(vec![c, r], data)
}

fn scale(w: &Tensor, alpha: f32) -> Tensor {
    if alpha == 1.0 {
        return w.clone();
    }
    Tensor::new(w.shape.clone(), w.data.iter().map(|v| v * alpha).collect())
}
