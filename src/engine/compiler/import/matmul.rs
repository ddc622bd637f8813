// SPDX-License-Identifier: MPL-2.0
//! Matrix products: Gemm and MatMul by a constant matrix (fully connected layers, the
//! projections of attention), and MatMul of two computed tensors (attention itself).

use super::{Handled, Importer, OnnxNode};
use crate::engine::compiler::ir::{Act, Op, Tensor};

pub(super) const OPS: &[&str] = &["Gemm", "MatMul"];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(super) fn required_inputs(_op: &str, _opset: i64) -> usize {
    2
}

pub(super) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
    match node.op() {
        "Gemm" => gemm(im, node)?,
        "MatMul" => matmul(im, node)?,
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
