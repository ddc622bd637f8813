// SPDX-License-Identifier: MPL-2.0
//! Element-wise steps: any strides, the innermost loop along memory, with the common
//! patterns (contiguous, broadcast) written out so that they vectorise, and the model's
//! input from colour planes to pixels a pixel at a time.

use std::ops::Range;

use super::{Buffers, CpuStep, Packed, Scratch, Threads, activate};
use trtclassify_compiler::ir::{Act, BinOp};
use trtclassify_compiler::plan::{EwStep, Strided, ZeroStep};

impl CpuStep for EwStep {
    #[inline(always)]
    fn run<const FMA: bool>(
        &self,
        _packed: &Packed,
        buf: &Buffers,
        _scratch: &mut Scratch,
        threads: Threads,
    ) {
        let EwStep {
            op,
            act,
            cast: _,
            dims,
            out,
            a,
            b,
        } = self;
        elementwise(buf, *op, *act, dims, out, a, b.as_ref(), threads)
    }
}

impl CpuStep for ZeroStep {
    #[inline(always)]
    fn run<const FMA: bool>(
        &self,
        _packed: &Packed,
        buf: &Buffers,
        _scratch: &mut Scratch,
        _threads: Threads,
    ) {
        // SAFETY: checked span.
        unsafe { std::slice::from_raw_parts_mut(buf.at_mut(self.loc), self.len) }.fill(0.0)
    }
}

/// `out = act(op(a, b))` over `dims` with each operand's strides: the innermost dimension
/// runs as a loop over contiguous or broadcast values where it can, the outermost is shared
/// out over the threads (each its own rows, as the products before it share them).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn elementwise(
    buf: &Buffers,
    op: Option<BinOp>,
    act: Act,
    dims: &[usize],
    out: &Strided,
    a: &Strided,
    b: Option<&Strided>,
    threads: Threads,
) {
    if dims.contains(&0) {
        return;
    }
    if op.is_none()
        && act == Act::None
        && b.is_none()
        && let Some(planes) = Planes::of(buf, dims, out, a)
    {
        return planes.to_pixels(buf, out, a, threads);
    }
    // The order of the iteration does not matter to an element-wise step: the output's
    // smallest stride goes innermost, so that the loop there runs along memory (an NHWC
    // tensor's channels rather than its width).
    let mut order: Vec<usize> = (0..dims.len()).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(out.strides[d].unsigned_abs()));
    // Unless that line is short and `a` runs along memory over a longer one (a transposition:
    // lines of a few channels, or of a whole plane; ShuffleNet's channels of two groups
    // interleaved; `Planes` takes the model's input of 2 to 4 colours): then the long one,
    // written strided.
    if let Some(&inner) = order.last()
        && dims[inner] < 16
        && let Some(long) = (0..dims.len())
            .filter(|&d| a.strides[d].abs() == 1 && dims[d] >= 16)
            .max_by_key(|&d| dims[d])
    {
        order.retain(|&d| d != long);
        order.push(long);
    }
    let reorder = |s: &Strided| Strided {
        loc: s.loc,
        strides: order.iter().map(|&d| s.strides[d]).collect(),
    };
    let dims: Vec<usize> = order.iter().map(|&d| dims[d]).collect();
    let (out, a, b) = (&reorder(out), &reorder(a), b.map(reorder));
    let b = b.as_ref();
    // Sharing out costs microseconds: worth it over tens of thousands of values.
    let total: usize = dims.iter().product();
    let parts = match dims.len() {
        2.. if total >= 1 << 15 => threads.count.min(dims[0]),
        _ => 1,
    };
    if parts < 2 {
        let all = 0..dims.first().copied().unwrap_or(1);
        return lines(buf, op, act, &dims, out, a, b, all);
    }
    threads.for_each(parts, |p| {
        let rows = p * dims[0] / parts..(p + 1) * dims[0] / parts;
        lines(buf, op, act, &dims, out, a, b, rows)
    });
}

/// Frames of a few planes (NCHW's colours) to be copied to pixels (NHWC): the model's input
/// on its way to the first convolution. The general loop wrote a plane at a time, each at a
/// stride of the planes' count, so that every line of the output was written once for each
/// plane. A pixel at a time, a 224×224 frame takes 0.07–0.12 ms instead of 0.10–0.19 in a
/// model's run (Xeon, one thread; MobileNetV2 takes 5.7 ms), 0.017 instead of 0.035 with the
/// frame in the cache.
struct Planes {
    frames: usize,
    planes: usize,
    pixels: usize,
}

impl Planes {
    /// The copy of `a` to `out` over `dims` as frames of planes to pixels, if it is one:
    /// dims `[frames, pixels, planes]` (or without frames), `out` contiguous in that order,
    /// `a` with the planes outside the pixels.
    fn of(buf: &Buffers, dims: &[usize], out: &Strided, a: &Strided) -> Option<Planes> {
        let (frames, pixels, planes) = match *dims {
            [f, p, c] => (f, p, c),
            [p, c] => (1, p, c),
            _ => return None,
        };
        let frame = planes * pixels;
        let strides_are = |s: &Strided, inner: [i64; 2]| {
            s.strides.ends_with(&inner) && (dims.len() == 2 || s.strides[0] == frame as i64)
        };
        // The two as slices: apart, never the same buffer's overlapping values.
        let (o, x) = (buf.at(out.loc) as usize, buf.at(a.loc) as usize);
        let bytes = 4 * frames * frame;
        ((2..=4).contains(&planes)
            && strides_are(out, [planes as i64, 1])
            && strides_are(a, [1, pixels as i64])
            && (o + bytes <= x || x + bytes <= o))
            .then_some(Planes {
                frames,
                planes,
                pixels,
            })
    }

    fn to_pixels(&self, buf: &Buffers, out: &Strided, a: &Strided, threads: Threads) {
        let frame = self.planes * self.pixels;
        // Each thread its own pixels of each frame, over tens of thousands of values (as
        // `elementwise` shares out).
        let parts = match self.frames * frame {
            total if total >= 1 << 15 => threads.count.min(self.pixels / 1024).max(1),
            _ => 1,
        };
        let copy = |part: usize| {
            let (f, p) = (part / parts, part % parts);
            let pixels = p * self.pixels / parts..(p + 1) * self.pixels / parts;
            // SAFETY: the step's checked spans, `frames` frames of `frame` values each, apart
            // (`of`); each part writes its own pixels.
            let (o, x) = unsafe {
                let o = buf
                    .at_mut(out.loc)
                    .add(f * frame + pixels.start * self.planes);
                (
                    std::slice::from_raw_parts_mut(o, pixels.len() * self.planes),
                    std::slice::from_raw_parts(buf.at(a.loc).add(f * frame), frame),
                )
            };
            match self.planes {
                2 => interleave::<2>(o, x, self.pixels, pixels),
                3 => interleave::<3>(o, x, self.pixels, pixels),
                4 => interleave::<4>(o, x, self.pixels, pixels),
                _ => unreachable!("2 to 4 planes (`of`)"),
            }
        };
        match self.frames * parts {
            1 => copy(0),
            n => threads.for_each(n, copy),
        }
    }
}

/// Pixels `range` of the `C` planes of `pixels` values in `x` into `out`, a pixel's values
/// together.
fn interleave<const C: usize>(out: &mut [f32], x: &[f32], pixels: usize, range: Range<usize>) {
    let planes: [&[f32]; C] =
        std::array::from_fn(|c| &x[c * pixels + range.start..c * pixels + range.end]);
    for (i, pixel) in out.chunks_exact_mut(C).enumerate() {
        for (v, plane) in pixel.iter_mut().zip(&planes) {
            *v = plane[i];
        }
    }
}

/// The lines of an element-wise step (after `elementwise`'s reordering) whose outermost
/// index lies in `first`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn lines(
    buf: &Buffers,
    op: Option<BinOp>,
    act: Act,
    dims: &[usize],
    out: &Strided,
    a: &Strided,
    b: Option<&Strided>,
    first: Range<usize>,
) {
    let (po, pa) = (buf.at_mut(out.loc), buf.at(a.loc));
    let pb = b.map(|b| buf.at(b.loc));
    let rank = dims.len();
    let (inner, outer) = match dims.split_last() {
        Some((&inner, outer)) => (inner, outer),
        None => (1, &[][..]),
    };
    let stride = |s: &Strided| s.strides.last().copied().unwrap_or(0) as isize;
    let (so, sa, sb) = (stride(out), stride(a), b.map_or(0, stride));
    let mut index = vec![0usize; outer.len()];
    if let Some(i) = index.first_mut() {
        if first.is_empty() {
            return;
        }
        *i = first.start;
    }
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
        // The next index of the outer dimensions, last fastest; the first stops at the end
        // of `first`.
        let mut d = rank.saturating_sub(1);
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            let end = if d == 0 { first.end } else { outer[d] };
            if index[d] < end {
                break;
            }
            if d == 0 {
                return;
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
            (1, 1, 1) if fits_slices(n, o, a, b) => contiguous(n, o, a, b, f),
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

/// Whether `n` values at `o` are `a`'s or `b`'s own (in place) or lie apart from each:
/// what `contiguous` needs.
fn fits_slices(n: usize, o: *mut f32, a: *const f32, b: *const f32) -> bool {
    let apart = |p: *const f32| {
        let (o, p) = (o as usize, p as usize);
        o == p || o + 4 * n <= p || p + 4 * n <= o
    };
    apart(a) && apart(b)
}

/// `o[i] = f(a[i], b[i])` over `n` contiguous values, as slices: the compiler vectorises
/// those without checking at run time that they do not overlap, a check that it gave up on
/// for raw pointers inside the large function the steps inline into (the loop stayed scalar:
/// squeeze-and-excitation's scalings at 0.8 ns a value).
///
/// # Safety
/// `n` values at each pointer; `fits_slices`.
#[inline(always)]
unsafe fn contiguous(
    n: usize,
    o: *mut f32,
    a: *const f32,
    b: *const f32,
    f: impl Fn(f32, f32) -> f32,
) {
    // SAFETY: the caller's: the output is an operand itself or apart from it, so that no
    // shared slice overlaps the mutable one.
    unsafe {
        let out = std::slice::from_raw_parts_mut(o, n);
        let other = |p: *const f32| std::slice::from_raw_parts(p, n);
        match (std::ptr::eq(o, a), std::ptr::eq(o, b)) {
            (true, true) => out.iter_mut().for_each(|x| *x = f(*x, *x)),
            (true, false) => out
                .iter_mut()
                .zip(other(b))
                .for_each(|(x, &y)| *x = f(*x, y)),
            (false, true) => out
                .iter_mut()
                .zip(other(a))
                .for_each(|(x, &y)| *x = f(y, *x)),
            (false, false) => out
                .iter_mut()
                .zip(other(a).iter().zip(other(b)))
                .for_each(|(x, (&y, &z))| *x = f(y, z)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Contiguous lines in place over either operand, over both, apart from both, and
    /// overlapping one partly (which takes the pointer loop, read before written).
    #[test]
    fn contiguous_lines_in_place_and_apart() {
        let n = 37;
        let start: Vec<f32> = (0..4 * n).map(|i| i as f32 * 0.5 - 20.0).collect();
        let sub = |x: f32, y: f32| x - y;
        // (output, a, b) as offsets into one buffer.
        for (o, a, b) in [
            (0, 0, n),
            (n, 0, n),
            (0, 0, 0),
            (2 * n, 0, n),
            (3, 0, 2 * n),
        ] {
            let mut v = start.clone();
            let p = v.as_mut_ptr();
            // SAFETY: every line lies inside `v`.
            unsafe { binary(n, p.add(o), 1, p.add(a), 1, p.add(b), 1, sub) };
            let mut want = start.clone();
            for i in 0..n {
                want[o + i] = want[a + i] - want[b + i];
            }
            assert_eq!(v, want, "output at {o}, a at {a}, b at {b}");
        }
    }
}
