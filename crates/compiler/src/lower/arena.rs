// SPDX-License-Identifier: MPL-2.0
//! The arenas: every temporary buffer placed at an offset, by lifetime, so that buffers
//! alive at different times share memory. The buffers of nodes kept in f32 in an fp16 plan
//! have an arena of their own.

use crate::ir::Act;
use crate::plan::{Cast, EwStep, GemmStep, Loc, Step};

/// Buffers start at multiples of this many elements (256 bytes in fp16), as cuDNN and
/// cuBLASLt prefer.
pub(crate) const ALIGN: usize = 128;

/// A temporary buffer: its length, and the first and last steps that touch it.
#[derive(Clone)]
pub(crate) struct Storage {
    pub(crate) len: usize,
    pub(crate) first: usize,
    pub(crate) last: usize,
    /// Whether it holds f32 values of a node kept in f32 (`Loc::Wide`).
    pub(crate) wide: bool,
}

/// For each buffer, the buffer whose place it takes, if any: a product's output takes the
/// place of the residual it adds where that is the same size and the product is the last
/// step to read it and reads it for nothing else. The product then writes its output over
/// the residual, each element after reading it, which saves the caches one buffer:
/// ResNet-50's residual products on one core took 1.36 ms where the same product without
/// the residual took 1.12. Only for runners whose kernels read a residual's element before
/// writing the output's (the CPU runner's).
pub(crate) fn over_residuals(steps: &[Step], storages: &[Storage]) -> Vec<Option<usize>> {
    let mut shared = vec![None; storages.len()];
    for (s, step) in steps.iter().enumerate() {
        let (residual, y) = match step {
            Step::Conv(c) => (c.residual, c.y),
            Step::Gemm(GemmStep { residual, y, .. }) => (*residual, *y),
            _ => continue,
        };
        let (Some(Loc::Temp { id: z, offset: 0 }), Loc::Temp { id: out, offset: 0 }) =
            (residual, y)
        else {
            continue;
        };
        let (zs, outs) = (&storages[z], &storages[out]);
        let read_once = step
            .clone()
            .locs_mut()
            .into_iter()
            .filter(|loc| matches!(**loc, Loc::Temp { id, .. } if id == z))
            .count()
            == 1;
        if z != out
            && read_once
            && zs.last == s
            && outs.first == s
            && zs.len == outs.len
            && zs.wide == outs.wide
        {
            shared[out] = Some(z);
        }
    }
    shared
}

/// Makes each concatenation's buffer alive from the first product or convolution whose
/// output a copy into it reads for the last time: the CPU runner writes such a product's output straight
/// into its place in the concatenation (`write_into_concats` in `trtclassify-cpu`), which
/// it can only where nothing alive in between shares that place. Placed from the copies
/// on, the concatenation took the place of the buffers its branches read (SqueezeNet's
/// squeeze layer), and no fire module could. Only for the CPU runner's plans.
pub(crate) fn early_concats(steps: &[Step], storages: &mut [Storage]) {
    for (i, step) in steps.iter().enumerate() {
        let Step::Ew(EwStep {
            op: None,
            act: Act::None,
            cast: Cast::None,
            out,
            a,
            b: None,
            ..
        }) = step
        else {
            continue;
        };
        let (
            Loc::Temp {
                id: from,
                offset: 0,
            },
            Loc::Temp { id: to, .. },
        ) = (a.loc, out.loc)
        else {
            continue;
        };
        // The products the runner may redirect: of constant weights, adding no residual,
        // not depthwise. (It checks the rest, and some of these it may still not redirect:
        // their concatenation then lives a few steps longer than it needs.)
        let first = storages[from].first;
        let written = match &steps[first] {
            Step::Conv(c)
                if c.residual.is_none()
                    && c.group != c.c
                    && matches!(c.weight, Loc::Weight { .. }) =>
            {
                c.y
            }
            Step::Gemm(g)
                if g.batch == 1 && g.residual.is_none() && matches!(g.w, Loc::Weight { .. }) =>
            {
                g.y
            }
            _ => continue,
        };
        if from != to && storages[from].last == i && written == a.loc {
            storages[to].first = storages[to].first.min(first);
        }
    }
}

/// Places every buffer in its arena: largest first, at the lowest offset free during its
/// lifetime; a buffer that takes another's place (`shared`) at that one's offset, the two
/// placed as one over both lifetimes. Returns the lengths of the arena and of the f32
/// arena, and each buffer's offset in its own.
pub(crate) fn place(storages: &[Storage], shared: &[Option<usize>]) -> (usize, usize, Vec<usize>) {
    let root = |mut i: usize| {
        while let Some(j) = shared[i] {
            i = j;
        }
        i
    };
    let mut joined = storages.to_vec();
    for (i, s) in storages.iter().enumerate() {
        let r = &mut joined[root(i)];
        (r.first, r.last, r.len) = (r.first.min(s.first), r.last.max(s.last), r.len.max(s.len));
    }
    let roots: Vec<bool> = shared.iter().map(Option::is_none).collect();
    let (narrow, placed) = place_where(&joined, &roots, false);
    let (wide, wide_placed) = place_where(&joined, &roots, true);
    let offsets = (0..storages.len())
        .map(|i| {
            let r = root(i);
            if joined[r].wide {
                wide_placed[r]
            } else {
                placed[r]
            }
        })
        .collect();
    (narrow, wide, offsets)
}

/// `place` for the buffers of `roots` whose `wide` is `wide`.
fn place_where(storages: &[Storage], roots: &[bool], wide: bool) -> (usize, Vec<usize>) {
    let mut order: Vec<usize> = (0..storages.len())
        .filter(|&i| roots[i] && storages[i].wide == wide)
        .collect();
    order.sort_by_key(|&i| std::cmp::Reverse(storages[i].len));
    let mut offsets = vec![usize::MAX; storages.len()];
    let mut placed: Vec<usize> = Vec::new();
    let mut arena = 0;
    for i in order {
        let s = &storages[i];
        let size = s.len.div_ceil(ALIGN) * ALIGN;
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&p| storages[p].first <= s.last && s.first <= storages[p].last)
            .map(|&p| {
                (
                    offsets[p],
                    offsets[p] + storages[p].len.div_ceil(ALIGN) * ALIGN,
                )
            })
            .collect();
        busy.sort_unstable();
        let mut offset = 0;
        for (start, end) in busy {
            if offset + size <= start {
                break;
            }
            offset = offset.max(end);
        }
        offsets[i] = offset;
        arena = arena.max(offset + size);
        placed.push(i);
    }
    (arena, offsets)
}

/// `step` with its temporary buffers replaced by their places in their arenas.
pub(crate) fn resolve(mut step: Step, storages: &[Storage], offsets: &[usize]) -> Step {
    for loc in step.locs_mut() {
        if let Loc::Temp { id, offset } = *loc {
            *loc = match storages[id].wide {
                true => Loc::Wide(offsets[id] + offset),
                false => Loc::Arena(offsets[id] + offset),
            };
        }
    }
    step
}
