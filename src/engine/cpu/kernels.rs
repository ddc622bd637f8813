// SPDX-License-Identifier: MPL-2.0
//! The steps of a plan (`cuda::plan`, lowered in f32) run on the CPU: matrix products and
//! convolutions through the `gemm` crate, which picks AVX2/AVX-512/NEON kernels at run time,
//! and the rest (depthwise convolution, pooling, element-wise steps) as loops over NHWC
//! channels that the compiler vectorises.
//!
//! Steps read and write through raw pointers: the plan places several tensors in one arena,
//! and an element-wise step may write where it reads. `Plan` checks (`check_plan` in
//! `plan_runner`) keep every span a step touches inside its buffer before anything runs.

use std::sync::Arc;

use super::vector::activate;
use crate::engine::cuda::ir::{Act, BinOp};
use crate::engine::cuda::plan::{Cast, ConvStep, Loc, Step, Strided};

/// Where the plan's buffers are for one run.
pub struct Buffers<'a> {
    pub arena: *mut f32,
    pub input: *const f32,
    pub output: *mut f32,
    pub weights: &'a [Arc<Vec<f32>>],
}

impl Buffers<'_> {
    fn at(&self, loc: Loc) -> *const f32 {
        // SAFETY (for every `add` here): the plan was checked to keep each span inside its
        // buffer, so the offset lies within the allocation.
        unsafe {
            match loc {
                Loc::Arena(o) => self.arena.add(o),
                Loc::Input(o) => self.input.add(o),
                Loc::Output(o) => self.output.add(o),
                Loc::Weight { index, offset } => self.weights[index].as_ptr().add(offset),
                Loc::Temp { .. } => unreachable!("checked: plans hold no unplaced buffers"),
            }
        }
    }

    fn at_mut(&self, loc: Loc) -> *mut f32 {
        match loc {
            Loc::Arena(_) | Loc::Output(_) => self.at(loc) as *mut f32,
            _ => unreachable!("checked: steps write the arena and the scores only"),
        }
    }
}

/// Weights of a convolution rearranged once, when the plan is loaded, for its kernel.
pub enum Packed {
    None,
    /// Depthwise: `[kernel positions][channels]`, so that the channel loop reads both
    /// operands in order.
    Depthwise(Vec<f32>),
    /// Per group, `[kernel positions × input channels of the group][output channels of
    /// the group]`: the right-hand matrix of the product with the unfolded input.
    Gemm(Vec<f32>),
    /// A product whose output the next step activates in place: done here, on data still
    /// in the cache, and that step skipped.
    Activated(Act),
    Skip,
}

/// Moves an activation that follows a matrix product in place (the lowering's form of
/// everything but ReLU, which cuBLASLt's epilogue takes) into the product's own epilogue.
pub fn fuse_activations(steps: &[Step], packed: &mut [Packed]) {
    for i in 1..steps.len() {
        let (
            Step::Gemm {
                batch, rows, n, y, ..
            },
            Step::Ew {
                op: None,
                act,
                cast: Cast::None,
                dims,
                out,
                a,
                b: None,
            },
        ) = (&steps[i - 1], &steps[i])
        else {
            continue;
        };
        let in_place = out == a && out.loc == *y;
        if in_place
            && covers_once(dims, &out.strides, batch * rows * n)
            && matches!(packed[i - 1], Packed::None)
        {
            packed[i - 1] = Packed::Activated(*act);
            packed[i] = Packed::Skip;
        }
    }
}

/// Whether `dims` walked with `strides` touch each of `len` consecutive values once.
fn covers_once(dims: &[usize], strides: &[i64], len: usize) -> bool {
    let mut axes: Vec<(i64, usize)> = strides
        .iter()
        .copied()
        .zip(dims.iter().copied())
        .filter(|&(_, d)| d > 1)
        .collect();
    axes.sort_unstable();
    let mut next = 1i64;
    for (stride, dim) in axes {
        if stride != next {
            return false;
        }
        next *= dim as i64;
    }
    next == len as i64
}

pub fn is_depthwise(c: &ConvStep) -> bool {
    c.group == c.c && c.group == c.k
}

/// A 1×1 convolution with stride 1 and no padding reads the NHWC input as a matrix
/// as it is; the others unfold it first.
fn is_pointwise(c: &ConvStep) -> bool {
    c.kernel == [1, 1] && c.strides == [1, 1] && c.pads == [0, 0]
}

pub fn pack(step: &Step, weights: &[Arc<Vec<f32>>]) -> Packed {
    let Step::Conv(c) = step else {
        return Packed::None;
    };
    let Loc::Weight { index, offset } = c.weight else {
        // A weight computed by the plan is read as it is, at run time.
        return Packed::None;
    };
    let krsc = &weights[index][offset..];
    let taps = c.kernel[0] * c.kernel[1];
    if is_depthwise(c) {
        let mut packed = vec![0.0; taps * c.k];
        for k in 0..c.k {
            for t in 0..taps {
                packed[t * c.k + k] = krsc[k * taps + t];
            }
        }
        return Packed::Depthwise(packed);
    }
    let (cg, kg) = (c.c / c.group, c.k / c.group);
    let rows = taps * cg;
    let mut packed = vec![0.0; c.group * rows * kg];
    for g in 0..c.group {
        for kk in 0..kg {
            let k = g * kg + kk;
            for i in 0..rows {
                packed[(g * rows + i) * kg + kk] = krsc[k * rows + i];
            }
        }
    }
    Packed::Gemm(packed)
}

/// How a step may use threads: `gemm`'s own split over the machine's shared pool, and
/// rows of the direct kernels spread over it.
#[derive(Clone, Copy)]
pub struct Threads(pub usize);

impl Threads {
    fn gemm(self) -> gemm::Parallelism {
        match self.0 {
            0 | 1 => gemm::Parallelism::None,
            n => gemm::Parallelism::Rayon(n),
        }
    }

    /// Runs `f` on each of `0..n`, spread over the threads.
    fn for_each(self, n: usize, f: impl Fn(usize) + Sync + Send) {
        use rayon::prelude::*;
        match self.0 {
            0 | 1 => (0..n).for_each(f),
            t => (0..n)
                .into_par_iter()
                .with_min_len(n.div_ceil(t * 4).max(1))
                .for_each(f),
        }
    }
}

// SAFETY: the buffers are read by every thread of a step and written by each in its own
// rows of the output only (`Threads::for_each` hands out disjoint rows).
unsafe impl Sync for Buffers<'_> {}

/// Defines `$name(args)` to run `$imp::<true>(args)` compiled for AVX2 and FMA where the
/// CPU has them, and `$imp::<FMA>` for the target's baseline elsewhere (aarch64 always has
/// NEON and FMA). Code that threads run (closures) does not inherit the features of the
/// function it is written in, so each row of a parallel kernel dispatches for itself.
macro_rules! wide {
    ($(#[$m:meta])* fn $name:ident($($arg:ident: $ty:ty),*) => $imp:ident) => {
        $(#[$m])*
        fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide($($arg: $ty),*) {
                    $imp::<true>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has the features `wide` is compiled for.
                    return unsafe { wide($($arg),*) };
                }
            }
            $imp::<{ cfg!(target_arch = "aarch64") }>($($arg),*)
        }
    };
}

/// Runs `step`, picking the widest SIMD the CPU has for the loops written here.
pub fn run(step: &Step, packed: &Packed, buf: &Buffers, col: &mut Vec<f32>, threads: Threads) {
    run_step(step, packed, buf, col, threads)
}

wide! {
    fn run_step(step: &Step, packed: &Packed, buf: &Buffers, col: &mut Vec<f32>, threads: Threads) => run_with
}

/// `a·b + c`, fused where the CPU does it in one instruction (elsewhere `mul_add` is a
/// slow library call).
#[inline(always)]
fn fma<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

#[inline(always)]
fn run_with<const FMA: bool>(
    step: &Step,
    packed: &Packed,
    buf: &Buffers,
    col: &mut Vec<f32>,
    threads: Threads,
) {
    if matches!(packed, Packed::Skip) {
        return;
    }
    match step {
        Step::Ew {
            op,
            act,
            cast: _,
            dims,
            out,
            a,
            b,
        } => elementwise(buf, *op, *act, dims, out, a, b.as_ref()),
        Step::Zero { loc, len } => {
            // SAFETY: checked span.
            unsafe { std::slice::from_raw_parts_mut(buf.at_mut(*loc), *len) }.fill(0.0)
        }
        Step::Conv(c) => match packed {
            Packed::Depthwise(w) => depthwise(buf, c, w, threads),
            Packed::Gemm(w) => conv_gemm(buf, c, w.as_ptr(), col, threads),
            _ => {
                // Weights computed by the plan: packed on the fly.
                let weights = krsc_of(buf, c);
                match pack(&Step::Conv(c.clone()), &[Arc::new(weights)]) {
                    Packed::Depthwise(w) => depthwise(buf, c, &w, threads),
                    Packed::Gemm(w) => conv_gemm(buf, c, w.as_ptr(), col, threads),
                    _ => unreachable!("a convolution's weight packs"),
                }
            }
        },
        Step::Gemm {
            batch,
            alpha,
            rows,
            n,
            k,
            x,
            w,
            bias,
            residual,
            relu,
            y,
        } => {
            let (x, w, y) = (buf.at(*x), buf.at(*w), buf.at_mut(*y));
            let act = match packed {
                Packed::Activated(act) => *act,
                _ if *relu => Act::Relu,
                _ => Act::None,
            };
            for p in 0..*batch {
                // SAFETY: checked spans of `batch` matrices each.
                let product = unsafe {
                    Product {
                        rows: *rows,
                        n: *n,
                        k: *k,
                        x: x.add(p * rows * k),
                        x_stride: *k,
                        w: w.add(p * k * n),
                        y: y.add(p * rows * n),
                        y_stride: *n,
                        alpha: *alpha,
                        bias: bias.map(|b| buf.at(b)),
                        residual: residual.map(|z| buf.at(z).add(p * rows * n)),
                        act,
                    }
                };
                product.run(threads);
            }
        }
        Step::Pool { n, oh, .. } => threads.for_each(n * oh, |row| pool_row(buf, step, row)),
        Step::GlobalAvgPool { n, hw, c, x, y } => {
            let (x, y) = (buf.at(*x), buf.at_mut(*y));
            for b in 0..*n {
                // SAFETY: checked spans.
                let out = unsafe { std::slice::from_raw_parts_mut(y.add(b * c), *c) };
                out.fill(0.0);
                for p in 0..*hw {
                    let row = unsafe { std::slice::from_raw_parts(x.add((b * hw + p) * c), *c) };
                    out.iter_mut().zip(row).for_each(|(o, &v)| *o += v);
                }
                let scale = 1.0 / *hw as f32;
                out.iter_mut().for_each(|o| *o *= scale);
            }
        }
        Step::Softmax { rows, len, x, y } => {
            for r in 0..*rows {
                let (x, y) = (rows_in(buf, *x, r, *len), rows_out(buf, *y, r, *len));
                let max = x.iter().copied().fold(f32::MIN, f32::max);
                y.iter_mut().zip(x).for_each(|(o, &v)| *o = v - max);
                activate(Act::Exp, y);
                let scale = 1.0 / y.iter().sum::<f32>();
                y.iter_mut().for_each(|o| *o *= scale);
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
        Step::RowMean { rows, len, x, y } => {
            let y = buf.at_mut(*y);
            for r in 0..*rows {
                let mean = rows_in(buf, *x, r, *len).iter().sum::<f32>() / *len as f32;
                unsafe { *y.add(r) = mean };
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
}

wide! {
    /// One output row of a pooling step.
    fn pool_row(buf: &Buffers, step: &Step, row: usize) => pool_row_with
}

#[inline(always)]
fn pool_row_with<const FMA: bool>(buf: &Buffers, step: &Step, row: usize) {
    let Step::Pool {
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
        ..
    } = step
    else {
        unreachable!("a pooling step");
    };
    let (h, w, c, oh, ow) = (*h, *w, *c, *oh, *ow);
    let (x, y) = (buf.at(*x), buf.at_mut(*y));
    let (b, oy) = (row / oh, row % oh);
    for ox in 0..ow {
        // SAFETY: checked span; rows are disjoint between threads.
        let out =
            unsafe { std::slice::from_raw_parts_mut(y.add(((b * oh + oy) * ow + ox) * c), c) };
        out.fill(if *max { f32::NEG_INFINITY } else { 0.0 });
        let (mut count, mut padded) = (0, 0);
        for ky in 0..kernel[0] {
            for kx in 0..kernel[1] {
                let yy = (oy * strides[0] + ky) as isize - pads[0] as isize;
                let xx = (ox * strides[1] + kx) as isize - pads[1] as isize;
                if yy < 0 || xx < 0 || yy >= h as isize || xx >= w as isize {
                    padded +=
                        usize::from(yy < (h + pads[2]) as isize && xx < (w + pads[3]) as isize);
                    continue;
                }
                count += 1;
                let input = unsafe {
                    std::slice::from_raw_parts(
                        x.add(((b * h + yy as usize) * w + xx as usize) * c),
                        c,
                    )
                };
                if *max {
                    out.iter_mut().zip(input).for_each(|(o, &v)| *o = o.max(v));
                } else {
                    out.iter_mut().zip(input).for_each(|(o, &v)| *o += v);
                }
            }
        }
        if !*max {
            let divisor = if *count_include_pad {
                count + padded
            } else {
                count
            };
            let scale = 1.0 / divisor as f32;
            out.iter_mut().for_each(|o| *o *= scale);
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

/// A convolution's KRSC weights, copied from wherever the plan keeps them.
fn krsc_of(buf: &Buffers, c: &ConvStep) -> Vec<f32> {
    let len = c.k * c.kernel[0] * c.kernel[1] * (c.c / c.group);
    // SAFETY: checked span.
    unsafe { std::slice::from_raw_parts(buf.at(c.weight), len) }.to_vec()
}

/// Fills the `rows × n` output (row stride `stride`) with the bias and the residual, which
/// the product is then added to; returns whether there was anything to add to.
fn epilogue_init(
    y: *mut f32,
    rows: usize,
    n: usize,
    stride: usize,
    bias: Option<*const f32>,
    residual: Option<*const f32>,
) -> bool {
    if bias.is_none() && residual.is_none() {
        return false;
    }
    for r in 0..rows {
        // SAFETY: checked spans. The residual may be the output itself (added in place).
        unsafe {
            let out = y.add(r * stride);
            for j in 0..n {
                let z = residual.map_or(0.0, |z| *z.add(r * stride + j));
                *out.add(j) = z + bias.map_or(0.0, |b| *b.add(j));
            }
        }
    }
    true
}

/// Depthwise convolution, NHWC: for each output pixel, each tap's channels multiplied and
/// added along the channel vector.
fn depthwise(buf: &Buffers, c: &ConvStep, w: &[f32], threads: Threads) {
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
        match c.residual {
            Some(z) => {
                let z = unsafe { std::slice::from_raw_parts(buf.at(z).add(o), ch) };
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
        // SAFETY: FMA is true on x86_64 only where the CPU has AVX2 and FMA (`wide!`);
        // the taps lie inside the checked input span and the packed weights.
        #[cfg(target_arch = "x86_64")]
        let done = if FMA {
            unsafe { accumulate_avx2(out, x, w, &taps) }
        } else {
            0
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        for &(xi, wi) in &taps {
            // SAFETY: inside the checked input span.
            let xs = unsafe { std::slice::from_raw_parts(x.add(xi + done), ch - done) };
            let ws = &w[wi + done..wi + ch];
            for ((o, &a), &b) in out[done..].iter_mut().zip(xs).zip(ws) {
                *o = fma::<FMA>(a, b, *o);
            }
        }
        activate(c.act, out);
    }
}

/// Adds each tap's inputs times its weights to `out`, 32 channels at a time in registers
/// over all the taps; returns how many leading channels it did (a multiple of 8).
///
/// # Safety
/// The CPU has AVX2 and FMA; each tap's `x` offset starts `out.len()` readable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate_avx2(
    out: &mut [f32],
    x: *const f32,
    w: &[f32],
    taps: &[(usize, usize)],
) -> usize {
    use std::arch::x86_64::*;
    let ch = out.len();
    let o = out.as_mut_ptr();
    let mut cb = 0;
    // SAFETY: the caller's; every load and store lies within `cb + 32 <= ch` (or `+ 8`).
    unsafe {
        while cb + 32 <= ch {
            let mut acc = [
                _mm256_loadu_ps(o.add(cb)),
                _mm256_loadu_ps(o.add(cb + 8)),
                _mm256_loadu_ps(o.add(cb + 16)),
                _mm256_loadu_ps(o.add(cb + 24)),
            ];
            for &(xi, wi) in taps {
                let (xp, wp) = (x.add(xi + cb), w.as_ptr().add(wi + cb));
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(
                        _mm256_loadu_ps(xp.add(8 * j)),
                        _mm256_loadu_ps(wp.add(8 * j)),
                        *a,
                    );
                }
            }
            for (j, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(cb + 8 * j), *a);
            }
            cb += 32;
        }
        while cb + 8 <= ch {
            let mut acc = _mm256_loadu_ps(o.add(cb));
            for &(xi, wi) in taps {
                acc = _mm256_fmadd_ps(
                    _mm256_loadu_ps(x.add(xi + cb)),
                    _mm256_loadu_ps(w.as_ptr().add(wi + cb)),
                    acc,
                );
            }
            _mm256_storeu_ps(o.add(cb), acc);
            cb += 8;
        }
    }
    cb
}

/// Any other convolution: the input unfolded (im2col, NHWC patches in `col`) times the
/// packed weights, with bias, residual and activation; an ungrouped one block of output
/// pixels at a time, so that the unfolded block and the output stay in the cache.
fn conv_gemm(buf: &Buffers, c: &ConvStep, w: *const f32, col: &mut Vec<f32>, threads: Threads) {
    let (x, y) = (buf.at(c.x), buf.at_mut(c.y));
    let (cg, kg) = (c.c / c.group, c.k / c.group);
    let rows = c.kernel[0] * c.kernel[1] * cg;
    let pixels = c.oh * c.ow;
    let pointwise = is_pointwise(c);
    for n in 0..c.n {
        // SAFETY: checked spans.
        let (xb, yb) = unsafe { (x.add(n * c.h * c.w * c.c), y.add(n * pixels * c.k)) };
        let residual = c
            .residual
            .map(|z| unsafe { buf.at(z).add(n * pixels * c.k) });
        if c.group == 1 {
            // An unfolded block of about 1 MB, at least 64 pixels (the weights are packed
            // again for each block).
            let block = match (pointwise, threads.0) {
                (true, _) | (_, 2..) => pixels,
                _ => (1 << 20) / rows.max(1),
            };
            for start in (0..pixels).step_by(block.max(1)) {
                let count = block.min(pixels - start);
                let (lhs, lhs_stride) = if pointwise {
                    (xb, c.c)
                } else {
                    unfold(xb, c, 0, start, count, col);
                    (col.as_ptr(), rows)
                };
                // SAFETY: checked spans; `col` holds `count × rows` values.
                let product = unsafe {
                    Product {
                        rows: count,
                        n: c.k,
                        k: rows,
                        x: if pointwise { lhs.add(start * c.c) } else { lhs },
                        x_stride: lhs_stride,
                        w,
                        y: yb.add(start * c.k),
                        y_stride: c.k,
                        alpha: 1.0,
                        bias: Some(buf.at(c.bias)),
                        residual: residual.map(|z| z.add(start * c.k)),
                        act: c.act,
                    }
                };
                product.run(threads);
            }
            continue;
        }
        epilogue_init(yb, pixels, c.k, c.k, Some(buf.at(c.bias)), residual);
        for g in 0..c.group {
            let (lhs, lhs_rs) = if pointwise {
                (unsafe { xb.add(g * cg) }, c.c)
            } else {
                unfold(xb, c, g, 0, pixels, col);
                (col.as_ptr(), rows)
            };
            // SAFETY: checked spans; `col` holds `pixels × rows` values.
            unsafe {
                gemm::gemm(
                    pixels,
                    kg,
                    rows,
                    yb.add(g * kg),
                    1,
                    c.k as isize,
                    true,
                    lhs,
                    1,
                    lhs_rs as isize,
                    w.add(g * rows * kg),
                    1,
                    kg as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    threads.gemm(),
                )
            };
        }
        // SAFETY: checked span.
        activate(c.act, unsafe {
            std::slice::from_raw_parts_mut(yb, pixels * c.k)
        });
    }
}

/// `y = act(alpha · x·w + bias + residual)`, `x` being `rows × k` and `w` `k × n` (rows
/// `n` apart), in blocks of rows whose output stays in the cache for the epilogue.
#[derive(Clone, Copy)]
struct Product {
    rows: usize,
    n: usize,
    k: usize,
    x: *const f32,
    x_stride: usize,
    w: *const f32,
    y: *mut f32,
    y_stride: usize,
    alpha: f32,
    bias: Option<*const f32>,
    residual: Option<*const f32>,
    act: Act,
}

// SAFETY: the pointers are into buffers checked for the whole product; the threads of
// `run` each write their own rows of the output.
unsafe impl Sync for Product {}

impl Product {
    /// With several threads and enough rows, each thread takes a share of the rows (the
    /// weights are packed by each): `gemm`'s own split leaves the small products of a
    /// network's late layers on one thread.
    fn run(&self, threads: Threads) {
        let t = threads.0;
        if t < 2 || self.rows < 64 {
            return run_product(self, threads);
        }
        let share = self.rows.div_ceil(t);
        threads.for_each(self.rows.div_ceil(share), |i| {
            let start = i * share;
            // SAFETY: rows `start..start + share` of the same checked buffers.
            let part = unsafe {
                Product {
                    rows: share.min(self.rows - start),
                    x: self.x.add(start * self.x_stride),
                    y: self.y.add(start * self.y_stride),
                    residual: self.residual.map(|z| z.add(start * self.y_stride)),
                    ..*self
                }
            };
            run_product(&part, Threads(1));
        });
    }
}

wide! {
    /// The epilogue (an activation such as SiLU over every output) is worth the wide SIMD.
    fn run_product(product: &Product, threads: Threads) => run_product_with
}

#[inline(always)]
fn run_product_with<const FMA: bool>(product: &Product, threads: Threads) {
    let p = product;
    {
        let (n, rows) = (p.n, p.rows);
        // A residual that is the output itself is added before the product, which then
        // adds to it; otherwise the product writes and the epilogue adds.
        let in_place = p.residual == Some(p.y as *const f32);
        // About 64 KB of output per block; one block where threads split the product.
        let block = match threads.0 {
            0 | 1 => (1 << 20) / n.max(1),
            _ => rows.max(1),
        };
        for start in (0..rows).step_by(block) {
            let m = block.min(rows - start);
            // SAFETY (the whole block): the caller's spans hold `rows` rows of each.
            unsafe {
                let y = p.y.add(start * p.y_stride);
                if in_place {
                    epilogue_init(y, m, n, p.y_stride, p.bias, Some(y));
                }
                if m == 1 {
                    // A vector times a matrix (squeeze-and-excitation, a classifier at
                    // batch 1): rows of `w` added up along `n`, where `gemm` spends more
                    // on setting up than on the arithmetic.
                    let out = std::slice::from_raw_parts_mut(y, n);
                    if !in_place {
                        out.fill(0.0);
                    }
                    let x = p.x.add(start * p.x_stride);
                    for i in 0..p.k {
                        let xi = p.alpha * *x.add(i);
                        let w = std::slice::from_raw_parts(p.w.add(i * n), n);
                        out.iter_mut().zip(w).for_each(|(o, &w)| *o += xi * w);
                    }
                } else {
                    gemm::gemm(
                        m,
                        n,
                        p.k,
                        y,
                        1,
                        p.y_stride as isize,
                        in_place,
                        p.x.add(start * p.x_stride),
                        1,
                        p.x_stride as isize,
                        p.w,
                        1,
                        n as isize,
                        1.0,
                        p.alpha,
                        false,
                        false,
                        false,
                        threads.gemm(),
                    );
                }
                for r in 0..m {
                    let out = std::slice::from_raw_parts_mut(y.add(r * p.y_stride), n);
                    if !in_place {
                        if let Some(b) = p.bias {
                            let b = std::slice::from_raw_parts(b, n);
                            out.iter_mut().zip(b).for_each(|(o, &b)| *o += b);
                        }
                        if let Some(z) = p.residual {
                            let z = std::slice::from_raw_parts(z.add((start + r) * p.y_stride), n);
                            out.iter_mut().zip(z).for_each(|(o, &z)| *o += z);
                        }
                    }
                    activate(p.act, out);
                }
            }
        }
    }
}

/// im2col for group `g` of one image, output pixels `start..start + count`: for each, its
/// kernel's taps in order, each the group's input channels (zeros outside the image).
fn unfold(x: *const f32, c: &ConvStep, g: usize, start: usize, count: usize, col: &mut Vec<f32>) {
    let cg = c.c / c.group;
    let rows = c.kernel[0] * c.kernel[1] * cg;
    col.resize(count * rows, 0.0);
    let mut dst = 0;
    for pixel in start..start + count {
        let (oy, ox) = (pixel / c.ow, pixel % c.ow);
        {
            for r in 0..c.kernel[0] {
                let iy = (oy * c.strides[0] + r * c.dilations[0]) as isize - c.pads[0] as isize;
                for s in 0..c.kernel[1] {
                    let ix = (ox * c.strides[1] + s * c.dilations[1]) as isize - c.pads[1] as isize;
                    let out = &mut col[dst..dst + cg];
                    if iy < 0 || ix < 0 || iy >= c.h as isize || ix >= c.w as isize {
                        out.fill(0.0);
                    } else {
                        let at = (iy as usize * c.w + ix as usize) * c.c + g * cg;
                        // SAFETY: inside the checked input span.
                        out.copy_from_slice(unsafe { std::slice::from_raw_parts(x.add(at), cg) });
                    }
                    dst += cg;
                }
            }
        }
    }
}

/// `out = act(op(a, b))` over `dims` with each operand's strides: the innermost dimension
/// runs as a loop over contiguous or broadcast values where it can.
#[inline(always)]
fn elementwise(
    buf: &Buffers,
    op: Option<BinOp>,
    act: Act,
    dims: &[usize],
    out: &Strided,
    a: &Strided,
    b: Option<&Strided>,
) {
    let (po, pa) = (buf.at_mut(out.loc), buf.at(a.loc));
    let pb = b.map(|b| buf.at(b.loc));
    if dims.contains(&0) {
        return;
    }
    // The order of the iteration does not matter to an element-wise step: the output's
    // smallest stride goes innermost, so that the loop there runs along memory (an NHWC
    // tensor's channels rather than its width).
    let mut order: Vec<usize> = (0..dims.len()).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(out.strides[d].unsigned_abs()));
    let reorder = |s: &Strided| Strided {
        loc: s.loc,
        strides: order.iter().map(|&d| s.strides[d]).collect(),
    };
    let dims: Vec<usize> = order.iter().map(|&d| dims[d]).collect();
    let (out, a, b) = (&reorder(out), &reorder(a), b.map(reorder));
    let b = b.as_ref();
    let rank = dims.len();
    let (inner, outer) = match dims.split_last() {
        Some((&inner, outer)) => (inner, outer),
        None => (1, &[][..]),
    };
    let stride = |s: &Strided| s.strides.last().copied().unwrap_or(0) as isize;
    let (so, sa, sb) = (stride(out), stride(a), b.map_or(0, stride));
    let mut index = vec![0usize; outer.len()];
    loop {
        let base = |s: &Strided| -> isize {
            index
                .iter()
                .zip(&s.strides)
                .map(|(&i, &st)| i as isize * st as isize)
                .sum()
        };
        // SAFETY: checked spans (negative strides included).
        unsafe {
            let o = po.offset(base(out));
            let x = pa.offset(base(a));
            let y = pb.map(|p| p.offset(base(b.expect("b with pb"))));
            line(op, inner, o, so, x, sa, y, sb);
            if act != Act::None {
                if so == 1 {
                    activate(act, std::slice::from_raw_parts_mut(o, inner));
                } else {
                    for i in 0..inner as isize {
                        *o.offset(i * so) = act.apply(*o.offset(i * so));
                    }
                }
            }
        }
        // The next index of the outer dimensions, last fastest.
        let mut d = rank.saturating_sub(1);
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < outer[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// One line of an element-wise step.
///
/// # Safety
/// `n` values at the given strides from each pointer lie inside their buffers.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn line(
    op: Option<BinOp>,
    n: usize,
    o: *mut f32,
    so: isize,
    a: *const f32,
    sa: isize,
    b: Option<*const f32>,
    sb: isize,
) {
    let Some((op, b)) = op.zip(b) else {
        for i in 0..n as isize {
            unsafe { *o.offset(i * so) = *a.offset(i * sa) };
        }
        return;
    };
    match op {
        BinOp::Add => unsafe { binary(n, o, so, a, sa, b, sb, |x, y| x + y) },
        BinOp::Sub => unsafe { binary(n, o, so, a, sa, b, sb, |x, y| x - y) },
        BinOp::Mul => unsafe { binary(n, o, so, a, sa, b, sb, |x, y| x * y) },
        BinOp::Div => unsafe { binary(n, o, so, a, sa, b, sb, |x, y| x / y) },
        BinOp::Max => unsafe { binary(n, o, so, a, sa, b, sb, f32::max) },
        BinOp::Min => unsafe { binary(n, o, so, a, sa, b, sb, f32::min) },
        BinOp::Pow => unsafe { binary(n, o, so, a, sa, b, sb, f32::powf) },
    }
}

/// The loop of `line` for one operator, with the common stride patterns (all contiguous,
/// one operand broadcast) written out so that they vectorise.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn binary(
    n: usize,
    o: *mut f32,
    so: isize,
    a: *const f32,
    sa: isize,
    b: *const f32,
    sb: isize,
    f: impl Fn(f32, f32) -> f32,
) {
    // SAFETY: the caller's.
    unsafe {
        match (so, sa, sb) {
            (1, 1, 1) => (0..n).for_each(|i| *o.add(i) = f(*a.add(i), *b.add(i))),
            (1, 1, 0) => {
                let b = *b;
                (0..n).for_each(|i| *o.add(i) = f(*a.add(i), b))
            }
            (1, 0, 1) => {
                let a = *a;
                (0..n).for_each(|i| *o.add(i) = f(a, *b.add(i)))
            }
            _ => (0..n as isize)
                .for_each(|i| *o.offset(i * so) = f(*a.offset(i * sa), *b.offset(i * sb))),
        }
    }
}
