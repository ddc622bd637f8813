// SPDX-License-Identifier: MPL-2.0
//! Element-wise steps: any strides, the innermost loop along memory, with the common
//! patterns (contiguous, broadcast) written out so that they vectorise.

use std::ops::Range;

use super::{Buffers, Threads};
use crate::engine::compiler::ir::{Act, BinOp};
use crate::engine::compiler::plan::Strided;
use crate::engine::cpu::vector::activate;

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
    // The order of the iteration does not matter to an element-wise step: the output's
    // smallest stride goes innermost, so that the loop there runs along memory (an NHWC
    // tensor's channels rather than its width).
    let mut order: Vec<usize> = (0..dims.len()).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(out.strides[d].unsigned_abs()));
    // Unless that line is short and `a` runs along memory over a long one (NCHW frames to
    // NHWC: lines of 3 channels, or of a whole plane): then the long one, written strided.
    if let Some(&inner) = order.last()
        && dims[inner] < 16
        && let Some(long) = (0..dims.len())
            .filter(|&d| a.strides[d].abs() == 1 && dims[d] >= 64)
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
