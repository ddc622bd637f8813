// SPDX-License-Identifier: MPL-2.0
//! Steps over rows: softmax, layer normalisation, row means, local response normalisation
//! (over each pixel's channels), and fused attention (an fp16 plan's; computed plainly).

use super::{Buffers, CpuStep, Packed, Scratch, Threads};
use crate::vector::activate as activate_with;
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{
    AttentionStep, LayerNormStep, Loc, LrnStep, RowMeanStep, SoftmaxStep,
};

impl CpuStep for SoftmaxStep {
    #[inline(always)]
    fn run<const FMA: bool>(
        &self,
        _packed: &Packed,
        buf: &Buffers,
        _scratch: &mut Scratch,
        _threads: Threads,
    ) {
        let SoftmaxStep {
            rows,
            len,
            x: x_loc,
            bias,
            y: y_loc,
        } = self;
        let bias = bias.map(|b| unsafe { std::slice::from_raw_parts(buf.at(b), *len) });
        for r in 0..*rows {
            let (x, y) = (
                rows_in(buf, *x_loc, r, *len),
                rows_out(buf, *y_loc, r, *len),
            );
            match bias {
                Some(b) => {
                    (y.iter_mut().zip(x).zip(b)).for_each(|((o, &v), &b)| *o = v + b);
                    let max = y.iter().copied().fold(f32::MIN, f32::max);
                    y.iter_mut().for_each(|o| *o -= max);
                }
                None => {
                    let max = x.iter().copied().fold(f32::MIN, f32::max);
                    y.iter_mut().zip(x).for_each(|(o, &v)| *o = v - max);
                }
            }
            activate_with::<FMA>(Act::Exp, y);
            let scale = 1.0 / y.iter().sum::<f32>();
            y.iter_mut().for_each(|o| *o *= scale);
        }
    }
}

impl CpuStep for LayerNormStep {
    #[inline(always)]
    fn run<const FMA: bool>(
        &self,
        _packed: &Packed,
        buf: &Buffers,
        _scratch: &mut Scratch,
        _threads: Threads,
    ) {
        let LayerNormStep {
            rows,
            len,
            epsilon,
            x,
            scale,
            bias,
            y,
        } = self;
        let scale = unsafe { std::slice::from_raw_parts(buf.at(*scale), *len) };
        let bias = bias.map(|b| unsafe { std::slice::from_raw_parts(buf.at(b), *len) });
        for r in 0..*rows {
            let x = rows_in(buf, *x, r, *len);
            let mean = x.iter().sum::<f32>() / *len as f32;
            let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / *len as f32;
            let inv = 1.0 / (var + epsilon).sqrt();
            let y = rows_out(buf, *y, r, *len);
            for i in 0..*len {
                y[i] = (x[i] - mean) * inv * scale[i] + bias.map_or(0.0, |b| b[i]);
            }
        }
    }
}

impl CpuStep for RowMeanStep {
    #[inline(always)]
    fn run<const FMA: bool>(
        &self,
        _packed: &Packed,
        buf: &Buffers,
        _scratch: &mut Scratch,
        _threads: Threads,
    ) {
        let RowMeanStep { rows, len, x, y } = self;
        let y = buf.at_mut(*y);
        for r in 0..*rows {
            let mean = rows_in(buf, *x, r, *len).iter().sum::<f32>() / *len as f32;
            unsafe { *y.add(r) = mean };
        }
    }
}

impl CpuStep for AttentionStep {
    // Fused attention comes in fp16 plans only (`check_plan` refuses it in the f32 plans
    // this runner takes); computed plainly all the same.
    #[inline(always)]
    fn run<const FMA: bool>(
        &self,
        _packed: &Packed,
        buf: &Buffers,
        _scratch: &mut Scratch,
        _threads: Threads,
    ) {
        let a = self;
        // SAFETY: checked spans.
        for (loc, v) in a.run(|loc| unsafe { *buf.at(loc) }) {
            unsafe { *buf.at_mut(loc) = v };
        }
    }
}

impl CpuStep for LrnStep {
    #[inline(always)]
    fn run<const FMA: bool>(
        &self,
        _packed: &Packed,
        buf: &Buffers,
        _scratch: &mut Scratch,
        _threads: Threads,
    ) {
        let LrnStep {
            pixels,
            c,
            size,
            alpha,
            beta,
            bias,
            x,
            y,
        } = self;
        for p in 0..*pixels {
            let (x, y) = (rows_in(buf, *x, p, *c), rows_out(buf, *y, p, *c));
            for ch in 0..*c {
                let lo = ch.saturating_sub((size - 1) / 2);
                let hi = (ch + size / 2).min(c - 1);
                let sq: f32 = x[lo..=hi].iter().map(|v| v * v).sum();
                y[ch] = x[ch] / (bias + alpha / *size as f32 * sq).powf(*beta);
            }
        }
    }
}

/// Row `r` of a `[rows, len]` operand.
fn rows_in<'a>(buf: &Buffers, loc: Loc, r: usize, len: usize) -> &'a [f32] {
    // SAFETY: checked span; the plan never writes an operand it reads in the same
    // row step (those steps read `x` and write another `y`).
    unsafe { std::slice::from_raw_parts(buf.at(loc).add(r * len), len) }
}

fn rows_out<'a>(buf: &Buffers, loc: Loc, r: usize, len: usize) -> &'a mut [f32] {
    // SAFETY: as `rows_in`.
    unsafe { std::slice::from_raw_parts_mut(buf.at_mut(loc).add(r * len), len) }
}
