// SPDX-License-Identifier: MPL-2.0
//! Runs a plan on the CPU in f32, step by step as the GPU would: the same arena offsets,
//! layouts and strides. A lowering bug (a wrong stride, two live buffers sharing memory)
//! shows here as a result that differs from `reference`.

use super::plan::{Loc, Plan, Step, Strided, Weights};

struct Memory<'a> {
    arena: Vec<f32>,
    wide: Vec<f32>,
    weights: &'a Weights,
    input: &'a [f32],
    output: Vec<f32>,
}

impl Memory<'_> {
    fn read(&self, loc: Loc, i: usize) -> f32 {
        match loc {
            Loc::Arena(o) => self.arena[o + i],
            Loc::Wide(o) => self.wide[o + i],
            Loc::Weight { index, offset } => self.weights.data[index][offset + i],
            Loc::Input(o) => self.input[o + i],
            Loc::Output(o) => self.output[o + i],
            Loc::Temp { .. } => panic!("an unplaced buffer in a plan"),
        }
    }

    fn write(&mut self, loc: Loc, i: usize, v: f32) {
        match loc {
            Loc::Arena(o) => self.arena[o + i] = v,
            Loc::Wide(o) => self.wide[o + i] = v,
            Loc::Output(o) => self.output[o + i] = v,
            other => panic!("a write to {other:?}"),
        }
    }
}

/// Runs `plan` on `input` (one batch in the plan's input layout) and returns its output.
pub fn run(plan: &Plan, weights: &Weights, input: &[f32]) -> Vec<f32> {
    assert_eq!(input.len(), plan.input_len);
    let mut m = Memory {
        // NaN marks memory no step has written: reading it shows in the result.
        arena: vec![f32::NAN; plan.arena_len],
        wide: vec![f32::NAN; plan.wide_len],
        weights,
        input,
        output: vec![f32::NAN; plan.output_len],
    };
    for step in &plan.steps {
        run_step(&mut m, step);
    }
    m.output
}

/// Runs `plan` one step at a time over an arena that starts zeroed (as the GPU's does when
/// it looks for an overflow), and returns where its values first pass `limit`.
pub fn first_overflow(
    plan: &Plan,
    weights: &Weights,
    input: &[f32],
    limit: f32,
) -> Option<super::overflow::Overflow> {
    let mut m = Memory {
        arena: vec![0.0; plan.arena_len],
        wide: vec![0.0; plan.wide_len],
        weights,
        input,
        output: vec![0.0; plan.output_len],
    };
    let found = super::overflow::first_overflow(plan, limit, |i| {
        let step = &plan.steps[i];
        run_step(&mut m, step);
        let span = step.written();
        let start = usize::try_from(span.start).map_err(|_| "a span before its buffer")?;
        let end = usize::try_from(span.end).map_err(|_| "a negative span")?;
        Ok::<_, &str>((start..end).map(|j| m.read(span.loc, j)).collect())
    });
    found.expect("spans within their buffers")
}

fn offset(s: &Strided, dims: &[usize], mut i: usize) -> usize {
    let mut o = 0i64;
    for d in (0..dims.len()).rev() {
        o += (i % dims[d]) as i64 * s.strides[d];
        i /= dims[d];
    }
    o as usize
}

fn run_step(m: &mut Memory, step: &Step) {
    match step {
        Step::Ew {
            op,
            act,
            cast: _,
            dims,
            out,
            a,
            b,
        } => {
            for i in 0..dims.iter().product() {
                let va = m.read(a.loc, offset(a, dims, i));
                let v = match (op, b) {
                    (Some(op), Some(b)) => op.apply(va, m.read(b.loc, offset(b, dims, i))),
                    _ => va,
                };
                m.write(out.loc, offset(out, dims, i), act.apply(v));
            }
        }
        Step::Zero { loc, len } => (0..*len).for_each(|i| m.write(*loc, i, 0.0)),
        Step::Conv(c) => {
            let (cig, kg) = (c.c / c.group, c.k / c.group);
            for n in 0..c.n {
                for oy in 0..c.oh {
                    for ox in 0..c.ow {
                        for k in 0..c.k {
                            let g = k / kg;
                            let mut acc = m.read(c.bias, k);
                            for r in 0..c.kernel[0] {
                                let y = (oy * c.strides[0] + r * c.dilations[0]) as isize
                                    - c.pads[0] as isize;
                                for s in 0..c.kernel[1] {
                                    let x = (ox * c.strides[1] + s * c.dilations[1]) as isize
                                        - c.pads[1] as isize;
                                    if y < 0 || x < 0 || y >= c.h as isize || x >= c.w as isize {
                                        continue;
                                    }
                                    let base = ((n * c.h + y as usize) * c.w + x as usize) * c.c;
                                    for cc in 0..cig {
                                        let wv = m.read(
                                            c.weight,
                                            ((k * c.kernel[0] + r) * c.kernel[1] + s) * cig + cc,
                                        );
                                        acc += wv * m.read(c.x, base + g * cig + cc);
                                    }
                                }
                            }
                            let o = ((n * c.oh + oy) * c.ow + ox) * c.k + k;
                            if let Some(z) = c.residual {
                                acc += m.read(z, o);
                            }
                            m.write(c.y, o, c.act.apply(acc));
                        }
                    }
                }
            }
        }
        Step::Gemm {
            batch,
            alpha,
            rows,
            n,
            k,
            x,
            x_batch,
            w,
            bias,
            residual,
            act,
            y,
            y_batch,
            w_transposed,
        } => {
            let (w_row, w_col) = if *w_transposed { (1, *k) } else { (*n, 1) };
            for p in 0..*batch {
                let (xo, wo, yo) = (p * x_batch, p * k * n, p * y_batch);
                for r in 0..*rows {
                    for j in 0..*n {
                        let mut dot = 0.0;
                        for i in 0..*k {
                            dot +=
                                m.read(*x, xo + r * k + i) * m.read(*w, wo + i * w_row + j * w_col);
                        }
                        let mut acc = alpha * dot + bias.map_or(0.0, |b| m.read(b, p * n + j));
                        if let Some(z) = residual {
                            acc += m.read(*z, yo + r * n + j);
                        }
                        m.write(*y, yo + r * n + j, act.apply(acc));
                    }
                }
            }
        }
        Step::Pool {
            n,
            h,
            w,
            c,
            oh,
            ow,
            kernel,
            strides,
            pads,
            max,
            count_include_pad,
            x,
            y,
        } => {
            for b in 0..*n {
                for oy in 0..*oh {
                    for ox in 0..*ow {
                        for ch in 0..*c {
                            let (mut acc, mut best, mut count, mut padded) =
                                (0.0, f32::NEG_INFINITY, 0, 0);
                            for ky in 0..kernel[0] {
                                for kx in 0..kernel[1] {
                                    let yy = (oy * strides[0] + ky) as isize - pads[0] as isize;
                                    let xx = (ox * strides[1] + kx) as isize - pads[1] as isize;
                                    if yy < 0 || xx < 0 || yy >= *h as isize || xx >= *w as isize {
                                        padded += usize::from(
                                            yy < (h + pads[2]) as isize
                                                && xx < (w + pads[3]) as isize,
                                        );
                                        continue;
                                    }
                                    let v = m.read(
                                        *x,
                                        ((b * h + yy as usize) * w + xx as usize) * c + ch,
                                    );
                                    acc += v;
                                    best = f32::max(best, v);
                                    count += 1;
                                }
                            }
                            let v = match (max, count_include_pad) {
                                (true, _) => best,
                                (false, true) => acc / (count + padded) as f32,
                                (false, false) => acc / count as f32,
                            };
                            m.write(*y, ((b * oh + oy) * ow + ox) * c + ch, v);
                        }
                    }
                }
            }
        }
        Step::GlobalAvgPool { n, hw, c, x, y } => {
            for b in 0..*n {
                for ch in 0..*c {
                    let sum: f32 = (0..*hw).map(|p| m.read(*x, (b * hw + p) * c + ch)).sum();
                    m.write(*y, b * c + ch, sum / *hw as f32);
                }
            }
        }
        Step::Softmax { rows, len, x, y } => {
            for r in 0..*rows {
                let row: Vec<f32> = (0..*len).map(|i| m.read(*x, r * len + i)).collect();
                let max = row.iter().copied().fold(f32::MIN, f32::max);
                let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
                for (i, v) in row.iter().enumerate() {
                    m.write(*y, r * len + i, (v - max).exp() / sum);
                }
            }
        }
        Step::LayerNorm {
            rows,
            len,
            epsilon,
            x,
            scale,
            bias,
            y,
        } => {
            for r in 0..*rows {
                let row: Vec<f32> = (0..*len).map(|i| m.read(*x, r * len + i)).collect();
                let mean = row.iter().sum::<f32>() / *len as f32;
                let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / *len as f32;
                for (i, v) in row.iter().enumerate() {
                    let b = bias.map_or(0.0, |b| m.read(b, i));
                    let out = (v - mean) / (var + epsilon).sqrt() * m.read(*scale, i) + b;
                    m.write(*y, r * len + i, out);
                }
            }
        }
        Step::RowMean { rows, len, x, y } => {
            for r in 0..*rows {
                let sum: f32 = (0..*len).map(|i| m.read(*x, r * len + i)).sum();
                m.write(*y, r, sum / *len as f32);
            }
        }
        Step::Attention(a) => {
            for (loc, v) in a.run(|loc| m.read(loc, 0)) {
                m.write(loc, 0, v);
            }
        }
        Step::Lrn {
            pixels,
            c,
            size,
            alpha,
            beta,
            bias,
            x,
            y,
        } => {
            for p in 0..*pixels {
                for ch in 0..*c {
                    let lo = ch.saturating_sub((size - 1) / 2);
                    let hi = (ch + size / 2).min(c - 1);
                    let sq: f32 = (lo..=hi).map(|cc| m.read(*x, p * c + cc).powi(2)).sum();
                    let v = m.read(*x, p * c + ch) / (bias + alpha / *size as f32 * sq).powf(*beta);
                    m.write(*y, p * c + ch, v);
                }
            }
        }
    }
}
