// SPDX-License-Identifier: MPL-2.0
//! Convolutions, batch normalisation and pooling: the operators on NCHW feature maps, from
//! their ONNX import (with the output shape each gives) to their reference evaluation and
//! their lowering: cuDNN convolutions over NHWC, or cuBLASLt products where the patches tile
//! the input; NHWC pooling windows.

use crate::import::attrs::Attrs;
use crate::import::tensor::sizes;
use crate::import::{Handled, Importer, OnnxNode};
use crate::ir::{Conv2d, Node, Op, Pool2d, PoolKind, Tensor, dims4};
use crate::lower::{Lowering, NHWC, Val, identity};
use crate::ops::elementwise::Act;
use crate::plan::{Cast, ConvStep, GemmStep, GlobalAvgPoolStep, Loc, PoolStep, Step, ZeroStep};

// ONNX import: what each operator becomes, with its output shape.

pub(crate) const OPS: &[&str] = &[
    "Conv",
    "BatchNormalization",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "GlobalMaxPool",
];

/// How many inputs `op` requires (ONNX's operator specs); the rest are optional.
pub(crate) fn required_inputs(op: &str, _opset: i64) -> usize {
    match op {
        "Conv" => 2,
        "BatchNormalization" => 5,
        _ => 1,
    }
}

pub(crate) fn import(im: &mut Importer, node: &OnnxNode) -> Result<Handled, String> {
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
pub(crate) fn conv_out(
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

// Reference evaluation, in f32 (`reference::eval`).

/// The convolution, with its bias, residual and activation.
pub(crate) fn eval_conv(c: &Conv2d, inputs: &[&Tensor], out_shape: &[usize]) -> Vec<f32> {
    let (x, w) = (inputs[0], inputs[1]);
    let (bias, residual) = (inputs[2], inputs.get(3));
    let [n, ci, h, wd] = dims4(&x.shape);
    let [_, co, oh, ow] = dims4(out_shape);
    let (cig, cog) = (ci / c.group, co / c.group);
    let [kh, kw] = c.kernel;
    let mut out = vec![0.0; n * co * oh * ow];
    for b in 0..n {
        for k in 0..co {
            let g = k / cog;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = bias.data[k];
                    for cc in 0..cig {
                        let ch = g * cig + cc;
                        for ky in 0..kh {
                            let y = (oy * c.strides[0] + ky * c.dilations[0]) as isize
                                - c.pads[0] as isize;
                            if y < 0 || y >= h as isize {
                                continue;
                            }
                            for kx in 0..kw {
                                let xx = (ox * c.strides[1] + kx * c.dilations[1]) as isize
                                    - c.pads[1] as isize;
                                if xx < 0 || xx >= wd as isize {
                                    continue;
                                }
                                acc += x.data[((b * ci + ch) * h + y as usize) * wd + xx as usize]
                                    * w.data[((k * cig + cc) * kh + ky) * kw + kx];
                            }
                        }
                    }
                    let o = ((b * co + k) * oh + oy) * ow + ox;
                    if let Some(r) = residual {
                        acc += r.data[o];
                    }
                    out[o] = c.act.apply(acc);
                }
            }
        }
    }
    out
}

pub(crate) fn eval_batch_norm(epsilon: f32, inputs: &[&Tensor]) -> Vec<f32> {
    let (x, [scale, bias, mean, var]) = (inputs[0], [1, 2, 3, 4].map(|i| inputs[i]));
    let channels = x.shape[1];
    let inner: usize = x.shape[2..].iter().product();
    x.data
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let c = (i / inner) % channels;
            (v - mean.data[c]) / (var.data[c] + epsilon).sqrt() * scale.data[c] + bias.data[c]
        })
        .collect()
}

pub(crate) fn eval_pool(p: &Pool2d, inputs: &[&Tensor], out_shape: &[usize]) -> Vec<f32> {
    let x = inputs[0];
    let [n, c, h, w] = dims4(&x.shape);
    let [_, _, oh, ow] = dims4(out_shape);
    let mut out = Vec::with_capacity(n * c * oh * ow);
    for plane in 0..n * c {
        let src = &x.data[plane * h * w..(plane + 1) * h * w];
        for oy in 0..oh {
            for ox in 0..ow {
                let (mut acc, mut count, mut padded) = (0.0f32, 0, 0);
                let mut max = f32::NEG_INFINITY;
                for ky in 0..p.kernel[0] {
                    for kx in 0..p.kernel[1] {
                        let y = (oy * p.strides[0] + ky) as isize - p.pads[0] as isize;
                        let x = (ox * p.strides[1] + kx) as isize - p.pads[1] as isize;
                        // The padded area of count_include_pad excludes ceil_mode's extra
                        // rows, as in ONNX Runtime and PyTorch.
                        let in_pad_area =
                            y < (h + p.pads[2]) as isize && x < (w + p.pads[3]) as isize;
                        if y < 0 || x < 0 || y >= h as isize || x >= w as isize {
                            padded += usize::from(in_pad_area);
                            continue;
                        }
                        let v = src[y as usize * w + x as usize];
                        acc += v;
                        max = max.max(v);
                        count += 1;
                    }
                }
                out.push(match p.kind {
                    PoolKind::Max => max,
                    PoolKind::Avg {
                        count_include_pad: true,
                    } => acc / (count + padded) as f32,
                    PoolKind::Avg { .. } => acc / count as f32,
                });
            }
        }
    }
    out
}

pub(crate) fn eval_global_avg_pool(inputs: &[&Tensor]) -> Vec<f32> {
    let x = inputs[0];
    let inner: usize = x.shape[2..].iter().product();
    x.data
        .chunks(inner)
        .map(|c| c.iter().sum::<f32>() / inner as f32)
        .collect()
}

// Lowering to plan steps (`lower::Lowering::node`).

impl Lowering<'_> {
    pub(crate) fn conv(&mut self, node: &Node, c: &Conv2d, shape: &[usize]) -> Result<Val, String> {
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
                    quant: None,
                    algo: None,
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
                act_in: Act::None,
                x: x.loc,
                weight: weight.loc,
                bias: bias.loc,
                residual: residual.map(|z| z.loc),
                y: y.loc,
                algo: None,
                quant: None,
            }),
            &reads,
        );
        Ok(y)
    }

    pub(crate) fn pool(&mut self, node: &Node, p: &Pool2d, shape: &[usize]) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let x = self.require(&x, &NHWC)?;
        let [n, c, h, w] = dims4(&x.shape);
        let [_, _, oh, ow] = dims4(shape);
        let y = self.alloc(shape, NHWC.to_vec());
        let (max, count_include_pad) = match p.kind {
            PoolKind::Max => (true, false),
            PoolKind::Avg { count_include_pad } => (false, count_include_pad),
        };
        self.push(
            Step::Pool(PoolStep {
                n,
                h,
                w,
                c,
                oh,
                ow,
                kernel: p.kernel,
                strides: p.strides,
                pads: p.pads,
                max,
                count_include_pad,
                x: x.loc,
                y: y.loc,
            }),
            &[x.loc, y.loc],
        );
        Ok(y)
    }

    pub(crate) fn global_avg_pool(&mut self, node: &Node, shape: &[usize]) -> Result<Val, String> {
        let x = self.get(&node.inputs[0])?;
        let x = self.require(&x, &NHWC)?;
        let [n, c, h, w] = dims4(&x.shape);
        let y = self.alloc(shape, NHWC.to_vec());
        self.push(
            Step::GlobalAvgPool(GlobalAvgPoolStep {
                n,
                hw: h * w,
                c,
                x: x.loc,
                y: y.loc,
            }),
            &[x.loc, y.loc],
        );
        Ok(y)
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
