// SPDX-License-Identifier: MPL-2.0
//! The arenas: every temporary buffer placed at an offset, by lifetime, so that buffers
//! alive at different times share memory. The buffers of nodes kept in f32 in an fp16 plan
//! have an arena of their own.

use crate::engine::compiler::plan::{Loc, Step};

/// Buffers start at multiples of this many elements (256 bytes in fp16), as cuDNN and
/// cuBLASLt prefer.
pub(super) const ALIGN: usize = 128;

/// A temporary buffer: its length, and the first and last steps that touch it.
pub(super) struct Storage {
    pub(super) len: usize,
    pub(super) first: usize,
    pub(super) last: usize,
    /// Whether it holds f32 values of a node kept in f32 (`Loc::Wide`).
    pub(super) wide: bool,
}

/// Places every buffer in its arena: largest first, at the lowest offset free during its
/// lifetime. Returns the lengths of the arena and of the f32 arena, and each buffer's offset
/// in its own.
pub(super) fn place(storages: &[Storage]) -> (usize, usize, Vec<usize>) {
    let (narrow, placed) = place_where(storages, false);
    let (wide, wide_placed) = place_where(storages, true);
    let offsets = storages
        .iter()
        .zip(placed.iter().zip(wide_placed))
        .map(|(s, (&o, w))| if s.wide { w } else { o })
        .collect();
    (narrow, wide, offsets)
}

/// `place` for the buffers whose `wide` is `wide`.
fn place_where(storages: &[Storage], wide: bool) -> (usize, Vec<usize>) {
    let mut order: Vec<usize> = (0..storages.len())
        .filter(|&i| storages[i].wide == wide)
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
pub(super) fn resolve(mut step: Step, storages: &[Storage], offsets: &[usize]) -> Step {
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
