// SPDX-License-Identifier: MPL-2.0
//! Depthwise convolutions: the choice of rows for the CPU (AVX-512 or AVX2 register tiles,
//! in `x86_64::depthwise`, else loops the compiler vectorises, here), made once a step, and
//! those loops, which every target compiles.

#[cfg(target_arch = "x86_64")]
use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use crate::kernels::x86_64::depthwise::{depthwise_row_avx2, depthwise_row_avx512, taps_inside};
use crate::kernels::{Buffers, Threads, activate_with, fma};
use trtclassify_compiler::plan::ConvStep;

/// Depthwise convolution, NHWC: for each output pixel, each tap's channels multiplied and
/// added along the channel vector.
pub(in crate::kernels) fn depthwise(buf: &Buffers, c: &ConvStep, w: &[f32], threads: Threads) {
    #[cfg(target_arch = "x86_64")]
    {
        // The kernel columns inside the input are the same for every output row.
        let cols: Vec<Range<usize>> = (0..c.ow).map(|ox| taps_inside(c, 1, ox)).collect();
        // SAFETY (both): the CPU has the features the row is compiled for (AVX-512F:
        // `Threads::new`); the weights are the step's, packed by `pack`.
        if threads.avx512 {
            return threads.for_each(c.n * c.oh, |row| unsafe {
                depthwise_row_avx512(buf, c, &cols, w, row)
            });
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return threads.for_each(c.n * c.oh, |row| unsafe {
                depthwise_row_avx2(buf, c, &cols, w, row)
            });
        }
    }
    threads.for_each(c.n * c.oh, |row| depthwise_row(buf, c, w, row));
}

wide! {
    /// One output row of a depthwise convolution.
    fn depthwise_row(buf: &Buffers, c: &ConvStep, w: &[f32], row: usize) => depthwise_row_with
}

#[inline(always)]
fn depthwise_row_with<const FMA: bool>(buf: &Buffers, c: &ConvStep, w: &[f32], row: usize) {
    let (h, wd, ch, oh, ow) = (c.h, c.w, c.k, c.oh, c.ow);
    let (x, y) = (buf.at(c.x), buf.at_mut(c.y));
    // SAFETY: checked spans.
    let bias = unsafe { std::slice::from_raw_parts(buf.at(c.bias), ch) };
    let (n, oy) = (row / oh, row % oh);
    let mut taps: Vec<(usize, usize)> = Vec::with_capacity(c.kernel[0] * c.kernel[1]);
    for ox in 0..ow {
        let o = ((n * oh + oy) * ow + ox) * ch;
        // SAFETY: checked span; each thread writes its own output rows.
        let out = unsafe { std::slice::from_raw_parts_mut(y.add(o), ch) };
        match c.residual.map(|z| buf.at(z)) {
            // The output written over its residual (`arena::over_residuals`) holds it.
            Some(z) if z == y.cast_const() => {
                out.iter_mut().zip(bias).for_each(|(o, &b)| *o += b);
            }
            Some(z) => {
                let z = unsafe { std::slice::from_raw_parts(z.add(o), ch) };
                for ((o, &b), &z) in out.iter_mut().zip(bias).zip(z) {
                    *o = b + z;
                }
            }
            None => out.copy_from_slice(bias),
        }
        taps.clear();
        for r in 0..c.kernel[0] {
            let iy = (oy * c.strides[0] + r * c.dilations[0]) as isize - c.pads[0] as isize;
            if iy < 0 || iy >= h as isize {
                continue;
            }
            for s in 0..c.kernel[1] {
                let ix = (ox * c.strides[1] + s * c.dilations[1]) as isize - c.pads[1] as isize;
                if ix < 0 || ix >= wd as isize {
                    continue;
                }
                let pixel = (n * h + iy as usize) * wd + ix as usize;
                taps.push((pixel * ch, (r * c.kernel[1] + s) * ch));
            }
        }
        for &(xi, wi) in &taps {
            // SAFETY: inside the checked input span.
            let xs = unsafe { std::slice::from_raw_parts(x.add(xi), ch) };
            let ws = &w[wi..wi + ch];
            for ((o, &a), &b) in out.iter_mut().zip(xs).zip(ws) {
                *o = fma::<FMA>(a, b, *o);
            }
        }
        activate_with::<FMA>(c.act, out);
    }
}
