// SPDX-License-Identifier: MPL-2.0
//! Convolutions and matrix products: cuDNN convolutions, and cuBLASLt products (Gemm,
//! MatMul, and 1×1 convolutions over NHWC) with their epilogues.

use super::arena::ALIGN;
use super::{Lowering, NHWC, Val, dims4, identity};
use crate::ir::{Act, Conv2d, Node, Op, Tensor};
use crate::plan::{Cast, ConvStep, DType, GemmStep, Loc, Step, ZeroStep};

impl Lowering<'_> {
    pub(super) fn conv(&mut self, node: &Node, c: &Conv2d, shape: &[usize]) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let mut x = self.require(&x, &NHWC)?;
        let [n, ci, mut h, mut w] = dims4(&x.shape);
        let [top, left, bottom, right] = c.pads;
        let mut pads = [top, left];
        if top != bottom || left != right {
            // cuDNN pads symmetrically: pad explicitly into a zeroed buffer.
            let padded_shape = vec![n, ci, h + top + bottom, w + left + right];
            let padded = self.alloc(&padded_shape, NHWC.to_vec());
            self.push(
                Step::Zero(ZeroStep {
                    loc: padded.loc,
                    len: padded.len(),
                }),
                &[padded.loc],
            );
            let ps = padded.strides();
            let interior = padded.loc.offset(top * ps[2] + left * ps[3]);
            self.ew(
                None,
                Act::None,
                Cast::None,
                &x.shape,
                &NHWC,
                interior,
                &ps,
                &[&x],
            )?;
            (h, w, pads) = (padded_shape[2], padded_shape[3], [0, 0]);
            x = Val {
                loc: padded.loc,
                shape: padded_shape,
                perm: NHWC.to_vec(),
            };
        }
        let krsc = to_krsc(&self.graph.consts[&node.inputs[1]]);
        let bias = self.get(&node.inputs[2])?;
        let residual = match node.inputs.get(3) {
            Some(z) => {
                let z = self.get(z)?;
                Some(self.require(&z, &NHWC)?)
            }
            None => None,
        };
        let y = self.alloc(shape, NHWC.to_vec());
        // A convolution whose patches neither overlap nor leave gaps is a matrix product
        // [patches, kh·kw·c] · [kh·kw·c, k], which cuBLASLt runs many times faster than cuDNN
        // runs the convolution: a 1×1 one over NHWC as it lies ([pixels, c]), a larger one (a
        // ViT's 16×16 patches, Swin's and ConvNeXt's 4×4 stems, ConvNeXt's 2×2 downsampling:
        // 0.52 ms for ViT-B/16's at batch 64) after a copy that unfolds its patches.
        let [_, k, oh, ow] = dims4(shape);
        let [kh, kw] = c.kernel;
        let tiled = c.kernel == c.strides
            && pads == [0, 0]
            && c.group == 1
            && (c.kernel == [1, 1] || c.dilations == [1, 1]);
        if tiled {
            let matrix = match c.kernel {
                [1, 1] => x.loc,
                _ => {
                    let patches = self.alloc(&[n, oh, ow, kh, kw, ci], identity(6));
                    let xs = x.strides();
                    let (sh, sw) = (xs[2], xs[3]);
                    let from = [xs[0], kh * sh, kw * sw, sh, sw, xs[1]];
                    self.strided_copy(
                        &[n, oh, ow, kh, kw, ci],
                        (patches.loc, &patches.strides()),
                        (x.loc, &from),
                    );
                    patches.loc
                }
            };
            let depth = kh * kw * ci;
            let weight = transpose2(&krsc.data, k, depth);
            let weight = self.constant(&format!("{}.ck", node.inputs[1]), &weight);
            let reads: Vec<Loc> = [matrix, y.loc]
                .into_iter()
                .chain(residual.as_ref().map(|z| z.loc))
                .collect();
            self.push(
                Step::Gemm(GemmStep {
                    batch: 1,
                    alpha: 1.0,
                    rows: n * oh * ow,
                    n: k,
                    k: depth,
                    x: matrix,
                    x_batch: n * oh * ow * depth,
                    w: weight.loc,
                    w_transposed: false,
                    bias: Some(bias.loc),
                    residual: residual.map(|z| z.loc),
                    act: self.epilogue(c.act),
                    y: y.loc,
                    y_batch: y.len(),
                }),
                &reads,
            );
            self.gemm_activation(c.act, &y)?;
            return Ok(y);
        }
        let weight = self.constant(&format!("{}.krsc", node.inputs[1]), &krsc);
        let reads: Vec<Loc> = [x.loc, y.loc]
            .into_iter()
            .chain(residual.as_ref().map(|z| z.loc))
            .collect();
        self.push(
            Step::Conv(ConvStep {
                n,
                c: ci,
                h,
                w,
                k,
                oh,
                ow,
                kernel: c.kernel,
                pads,
                strides: c.strides,
                dilations: c.dilations,
                group: c.group,
                act: c.act,
                x: x.loc,
                weight: weight.loc,
                bias: bias.loc,
                residual: residual.map(|z| z.loc),
                y: y.loc,
                algo: None,
            }),
            &reads,
        );
        Ok(y)
    }

    pub(super) fn gemm(&mut self, node: &Node, act: Act, shape: &[usize]) -> Result<Val, String> {
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
            }),
            &reads,
        );
        self.gemm_activation(act, &y)?;
        Ok(y)
    }

    /// Batched products of two computed tensors, one per leading index.
    pub(super) fn matmul(
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
    fn epilogue(&self, act: Act) -> Act {
        match act {
            Act::Relu => act,
            Act::Gelu if self.dtype == DType::F16 && !self.wide => act,
            _ => Act::None,
        }
    }

    /// The activation a matrix product's epilogue cannot apply, as an element-wise pass over
    /// its output `y`, in place.
    fn gemm_activation(&mut self, act: Act, y: &Val) -> Result<(), String> {
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
}

/// A row-major `rows × cols` matrix transposed.
fn transpose2(data: &[f32], rows: usize, cols: usize) -> Tensor {
    let mut t = vec![0.0; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = data[r * cols + c];
        }
    }
    Tensor::new(vec![cols, rows], t)
}

/// ONNX's KCRS weights to cuDNN's NHWC filter layout, KRSC.
fn to_krsc(w: &Tensor) -> Tensor {
    let [k, c, r, s] = dims4(&w.shape);
    let mut data = vec![0.0; w.len()];
    for kk in 0..k {
        for cc in 0..c {
            for rr in 0..r {
                for ss in 0..s {
                    data[((kk * r + rr) * s + ss) * c + cc] =
                        w.data[((kk * c + cc) * r + rr) * s + ss];
                }
            }
        }
    }
    Tensor::new(vec![k, r, s, c], data)
}
