// SPDX-License-Identifier: MPL-2.0
//! Matrix products: Gemm, MatMul and the Einsums that are batched products, from their ONNX
//! import to their reference evaluation and their lowering to cuBLASLt products with their
//! epilogues (bias, residual, ReLU or GELU); and the fused attention that `passes` makes of
//! two products and a softmax in fp16 plans, which reads the query, key and value where they
//! lie (the heads of one projection, through strides) and writes the output in the query's
//! layout.

use crate::import::{Handled, Importer, OnnxNode};
use crate::ir::{Node, Op, Tensor};
use crate::lower::arena::ALIGN;
use crate::lower::{Lowering, Val, identity, merge_dims};
use crate::ops::elementwise::{Act, BinOp};
use crate::plan::{AttentionStep, Cast, DType, GemmStep, Loc, Rows, Step};
use crate::reference;

// ONNX import: what each operator becomes, with its output shape.

pub(crate) const OPS: &[&str] = &["Gemm", "MatMul", "Einsum"];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(crate) fn required_inputs(op: &str, _opset: i64) -> usize {
    match op {
        "Einsum" => 1,
        _ => 2,
    }
}

pub(crate) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
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

// Reference evaluation, in f32 (`reference::eval`).

pub(crate) fn eval_gemm(act: Act, inputs: &[&Tensor]) -> Vec<f32> {
    let (x, w) = (inputs[0], inputs[1]);
    let (k, n) = (w.shape[0], w.shape[1]);
    let rows = x.len() / k;
    let mut out = vec![0.0; rows * n];
    for r in 0..rows {
        for j in 0..n {
            let mut acc = inputs.get(2).map_or(0.0, |b| b.data[j]);
            for i in 0..k {
                acc += x.data[r * k + i] * w.data[i * n + j];
            }
            // A residual fused by `passes::fuse_residual`, before the activation.
            if let Some(z) = inputs.get(3) {
                acc += z.data[r * n + j];
            }
            out[r * n + j] = act.apply(acc);
        }
    }
    out
}

pub(crate) fn eval_matmul(alpha: f32, inputs: &[&Tensor], out_shape: &[usize]) -> Vec<f32> {
    let (a, b) = (inputs[0], inputs[1]);
    let r = a.shape.len();
    let (m, k, n) = (a.shape[r - 2], a.shape[r - 1], b.shape[r - 1]);
    let out_len: usize = out_shape.iter().product();
    let mut out = vec![0.0; out_len];
    for p in 0..out_len / (m * n).max(1) {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0;
                for q in 0..k {
                    acc += a.data[(p * m + i) * k + q] * b.data[(p * k + q) * n + j];
                }
                out[(p * m + i) * n + j] = alpha * acc;
            }
        }
    }
    out
}

/// The operators attention fuses, one after the other.
pub(crate) fn eval_attention(
    alpha: f32,
    node: &Node,
    inputs: &[&Tensor],
    out_shape: &[usize],
) -> Vec<f32> {
    let step = |op: Op, inputs: &[&Tensor], shape: &[usize]| {
        let node = Node { op, ..node.clone() };
        reference::eval(&node, inputs, shape)
    };
    let (q, kt) = (inputs[0], inputs[1]);
    let r = q.shape.len();
    let mut scores_shape = q.shape.clone();
    scores_shape[r - 1] = kt.shape[r - 1];
    let mut scores = step(Op::MatMul { alpha }, &[q, kt], &scores_shape);
    if let Some(bias) = inputs.get(3) {
        let add = Op::Binary {
            op: BinOp::Add,
            act: Act::None,
        };
        scores = step(add, &[&scores, bias], &scores_shape);
    }
    let weights = step(Op::Softmax { axis: r - 1 }, &[&scores], &scores_shape);
    let out = step(Op::MatMul { alpha: 1.0 }, &[&weights, inputs[2]], out_shape);
    std::sync::Arc::unwrap_or_clone(out.data)
}

// Lowering to plan steps (`lower::Lowering::node`).

impl Lowering<'_> {
    pub(crate) fn gemm(&mut self, node: &Node, act: Act, shape: &[usize]) -> Result<Val, String> {
        // The product takes rows in any order, as long as each row is contiguous: the output
        // keeps the input's order (attention blocks that transpose between batch-first and
        // sequence-first then copy nothing).
        let x = self.get(&node.inputs[0])?;
        let x = self.innermost(&x, x.shape.len() - 1)?;
        let siblings = self.siblings(node, act);
        if !siblings.is_empty() {
            return self.products_of_one_x(node, &siblings, act, shape, x);
        }
        let w = self.get(&node.inputs[1])?;
        let bias = match node.inputs.get(2) {
            Some(b) => Some(self.get(b)?.loc),
            None => None,
        };
        // A residual (`passes::fuse_residual`) is read in the output's layout.
        let residual = match node.inputs.get(3) {
            Some(z) => {
                let z = self.get(z)?;
                Some(self.require(&z, &x.perm)?.loc)
            }
            None => None,
        };
        let y = self.alloc(shape, x.perm.clone());
        let (k, n) = (w.shape[0], w.shape[1]);
        let reads: Vec<Loc> = [x.loc, y.loc].into_iter().chain(residual).collect();
        self.push(
            Step::Gemm(GemmStep {
                batch: 1,
                alpha: 1.0,
                rows: x.len() / k,
                n,
                k,
                x: x.loc,
                x_batch: x.len(),
                w: w.loc,
                w_transposed: false,
                bias,
                residual,
                act: self.epilogue(act),
                y: y.loc,
                y_batch: y.len(),
                quant: None,
                algo: None,
            }),
            &reads,
        );
        self.gemm_activation(act, &y)?;
        Ok(y)
    }

    /// Batched products of two computed tensors, one per leading index.
    pub(crate) fn matmul(
        &mut self,
        node: &Node,
        alpha: f32,
        shape: &[usize],
    ) -> Result<Val, String> {
        let rank = shape.len();
        let a = self.get(&node.inputs[0])?;
        let a = self.require(&a, &identity(rank))?;
        let b = self.get(&node.inputs[1])?;
        // A right operand whose summed axis lies innermost (attention's keys after a
        // Transpose, which only changes the layout) is read transposed: in place where it
        // is laid out so, else copied with that axis kept innermost, a copy that moves whole
        // rows instead of scattering single values.
        let mut swapped = identity(rank);
        swapped.swap(rank - 2, rank - 1);
        let innermost = b.perm.iter().rev().find(|&&axis| b.shape[axis] != 1);
        let w_transposed = !b.is_laid_out_as(&identity(rank)) && innermost == Some(&(rank - 2));
        let b = match w_transposed {
            true => self.require(&b, &swapped)?,
            false => self.require(&b, &identity(rank))?,
        };
        let (m, k, n) = (a.shape[rank - 2], a.shape[rank - 1], b.shape[rank - 1]);
        let y = self.alloc(shape, identity(rank));
        self.push(
            Step::Gemm(GemmStep {
                batch: shape[..rank - 2].iter().product(),
                alpha,
                rows: m,
                n,
                k,
                x: a.loc,
                x_batch: m * k,
                w: b.loc,
                w_transposed,
                bias: None,
                residual: None,
                act: Act::None,
                y: y.loc,
                y_batch: m * n,
                quant: None,
                algo: None,
            }),
            &[a.loc, b.loc, y.loc],
        );
        Ok(y)
    }

    /// The products after `node` that run with it as one (`products_of_one_x`): in fp16
    /// plans, those that read the same input as it, with constant weights of the same shape,
    /// a bias where it has one, the same activation and the same type. Attention's query,
    /// key and value (`column_split`) are such products; at batch 1 each is too small to
    /// fill the GPU, and three launches cost ViT-B/16 about a tenth of its time. fp32 plans
    /// keep them apart: the CPU packs the weights of single products only.
    fn siblings(&self, node: &Node, act: Act) -> Vec<usize> {
        let graph = self.graph;
        let Some(at) = graph.nodes.iter().position(|n| n.name == node.name) else {
            return Vec::new();
        };
        let first = &graph.nodes[at];
        let consts = |n: &Node| -> Option<Vec<&[usize]>> {
            (n.inputs[1..].iter())
                .map(|i| graph.consts.get(i).map(|t| t.shape.as_slice()))
                .collect()
        };
        let Some(shapes) = consts(first) else {
            return Vec::new();
        };
        if self.dtype != DType::F16 || first.inputs.len() > 3 || shapes[0].len() != 2 {
            return Vec::new();
        }
        let like = |n: &Node| {
            n.op == (Op::Gemm { act })
                && n.inputs.len() == first.inputs.len()
                && n.inputs[0] == first.inputs[0]
                && consts(n).as_ref() == Some(&shapes)
                && self.kept.contains(&n.name) == self.kept.contains(&first.name)
                && !self.values.contains_key(&n.output)
        };
        (at + 1..graph.nodes.len())
            .filter(|&i| like(&graph.nodes[i]))
            .collect()
    }

    /// `node` and the products `siblings` as one batched product of their input `x`: their
    /// weights (and biases) one after the other, and their outputs in one buffer, each
    /// aligned as a buffer of its own would be. The siblings' values are defined here, and
    /// `node` returns at once when the lowering reaches them.
    fn products_of_one_x(
        &mut self,
        node: &Node,
        siblings: &[usize],
        act: Act,
        shape: &[usize],
        x: Val,
    ) -> Result<Val, String> {
        let graph = self.graph;
        let all: Vec<&Node> = std::iter::once(node)
            .chain(siblings.iter().map(|&i| &graph.nodes[i]))
            .collect();
        let joined = |input: usize, shape: Vec<usize>| {
            let data = all
                .iter()
                .flat_map(|m| graph.consts[&m.inputs[input]].data.iter());
            Tensor::new(shape, data.copied().collect())
        };
        let (k, n) = (
            graph.consts[&node.inputs[1]].shape[0],
            shape[shape.len() - 1],
        );
        let count = all.len();
        let w = joined(1, vec![count, k, n]);
        let w = self.constant(&format!("{}.of one x", node.inputs[1]), &w);
        let bias = match node.inputs.get(2) {
            Some(b) => {
                let joined = joined(2, vec![count, n]);
                Some(self.constant(&format!("{b}.of one x"), &joined).loc)
            }
            None => None,
        };
        let rows = x.len() / k;
        let y_batch = (rows * n).div_ceil(ALIGN) * ALIGN;
        let out = self.alloc(&[count * y_batch], vec![0]);
        self.push(
            Step::Gemm(GemmStep {
                batch: count,
                alpha: 1.0,
                rows,
                n,
                k,
                x: x.loc,
                x_batch: 0,
                w: w.loc,
                w_transposed: false,
                bias,
                residual: None,
                act: self.epilogue(act),
                y: out.loc,
                y_batch,
                quant: None,
                algo: None,
            }),
            &[x.loc, out.loc],
        );
        let mut outputs = (0..count).map(|g| Val {
            loc: out.loc.offset(g * y_batch),
            shape: shape.to_vec(),
            perm: x.perm.clone(),
        });
        let first = outputs.next().expect("node itself");
        self.gemm_activation(act, &first)?;
        for (sibling, y) in all[1..].iter().zip(outputs) {
            self.gemm_activation(act, &y)?;
            self.values.insert(sibling.output.clone(), y);
        }
        Ok(first)
    }

    /// The part of `act` that a matrix product's epilogue applies: ReLU, and GELU in fp16
    /// plans (cuBLASLt's tanh form, within one fp16 step of the erf form: see `Step::Gemm`),
    /// which saves a pass over a transformer's widest activations.
    pub(crate) fn epilogue(&self, act: Act) -> Act {
        match act {
            Act::Relu => act,
            Act::Gelu if self.dtype == DType::F16 && !self.wide => act,
            _ => Act::None,
        }
    }

    /// The activation a matrix product's epilogue cannot apply, as an element-wise pass over
    /// its output `y`, in place.
    pub(crate) fn gemm_activation(&mut self, act: Act, y: &Val) -> Result<(), String> {
        if self.epilogue(act) == act {
            return Ok(());
        }
        let strides = y.strides();
        self.ew(
            None,
            act,
            Cast::None,
            &y.shape,
            &y.perm,
            y.loc,
            &strides,
            &[y],
        )
    }

    pub(crate) fn attention(
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
