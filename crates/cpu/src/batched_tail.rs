// SPDX-License-Identifier: MPL-2.0
//! Several frames on one thread in two parts: each frame alone through the plan's first
//! steps, whose activations are large (one frame's stay in the caches, a batch's would not),
//! then the frames together through the last steps, whose activations are small and whose
//! weights are large. MobileNetV2's 7×7 layers and classifier hold 2.9 of its 3.5 million
//! weights: run frame by frame, each frame reads them from the L3 cache (the classifier
//! alone, 5 MB, took 0.3 of 9 ms a frame); run on 8 frames at once, each weight is read
//! once for the 8 (docs/benchmarks.md).
//!
//! The last steps (the tail) come from the plan compiled for the whole batch, its arena cut
//! down to the part they touch. What they read that the first steps wrote (the carries) is
//! copied there from the one-frame plan's arena as each frame finishes the first steps.

use std::ops::Range;

use trtclassify_compiler::plan::{GemmStep, Loc, Plan, Span, Step};

/// A step of the batch plan whose buffers hold more values than this (4 MB) runs frame by
/// frame, unless its weights are many (`runs_alone`): MobileNetV2's 28×28 layers (4.8 MB a
/// tensor for 8 frames) ran 1.1–3× slower per frame in a batch than alone, its 7×7 ones
/// (1.5 MB) 10–15 % faster and its 14×14 ones (3.6 MB) alike.
const MAX_TOUCHED: i128 = 1 << 20;

/// Whether `step` of the batch plan (`frames` frames) runs frame by frame: its buffers are
/// larger than `MAX_TOUCHED` and its weights fewer than half a frame's values, so that the
/// batch gains little by reading them once. Steps whose weights are that many gain more
/// than their large buffers cost: ResNet-50's 14×14 layers (1–2.4 MB of weights, 6.4 MB a
/// tensor for 8 frames) on the Xeon made batch 8 on one thread 44.1–44.5 ms a frame with
/// them in the tail against 49.6–50.0 without; MobileNetV2's and EfficientNet-B0's
/// depthwise layers, whose weights are few, stay out.
fn runs_alone(step: &Step, frames: usize) -> bool {
    let touched = touched(step);
    touched > MAX_TOUCHED && 2 * weights(step) * (frames as i128) < touched
}

/// The batch plan's last steps, and how the values they read get there.
pub struct Tail {
    /// The first step of the one-frame plan that the tail runs instead.
    pub first: usize,
    /// The batch plan's steps from `first` on, the arena theirs alone.
    pub plan: Plan,
    /// For each frame of the batch, what to copy from the one-frame plan's arena to the
    /// tail's once the frame has run the first steps.
    pub carries: Vec<Vec<Carry>>,
}

/// `len` values from `from` in the one-frame plan's arena to `to` in the tail's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Carry {
    pub from: usize,
    pub to: usize,
    pub len: usize,
}

impl Tail {
    /// The tail of `batch`, the plan compiled for several frames from the model (and the
    /// passes) that `frame` was compiled from for one, both checked. `None` where none can be
    /// cut out safely: plans whose steps differ (a channels-first split along the channels,
    /// read in place for one frame and copied for several), steps that
    /// may hold a frame's values apart (attention, products of several matrices), or nowhere
    /// to cut between steps that `fused(i)` says were fused with the step before. `at`, for
    /// tests: the cut there, whatever the steps' sizes.
    pub fn find(
        frame: &Plan,
        batch: &Plan,
        fused: impl Fn(usize) -> bool,
        at: Option<usize>,
    ) -> Option<Tail> {
        let n = batch.steps.len();
        let alike = |(a, b): (&Step, &Step)| std::mem::discriminant(a) == std::mem::discriminant(b);
        if n == 0
            || frame.batch != 1
            || batch.batch < 2
            || frame.steps.len() != n
            || frame.origins != batch.origins
            || !frame.steps.iter().zip(&batch.steps).all(alike)
            || batch.steps.iter().any(holds_frames_apart)
        {
            return None;
        }
        let large = batch.steps.iter().rposition(|s| runs_alone(s, batch.batch));
        let earliest = at.unwrap_or(large.map_or(1, |i| i + 1)).max(1);
        // Nothing before the cut may touch the scores, which the tail writes for the batch.
        let scores = |s: &Step| s.spans().iter().any(|s| matches!(s.loc, Loc::Output(_)));
        let latest = [frame, batch]
            .iter()
            .filter_map(|p| p.steps.iter().position(scores))
            .min()
            .unwrap_or(n - 1)
            .min(at.unwrap_or(n));
        (earliest..=latest)
            .filter(|&first| !fused(first))
            .find_map(|first| Self::cut(frame, batch, first))
    }

    /// The tail from step `first` on, if every value it reads from before comes from a step
    /// that wrote whole frames.
    fn cut(frame: &Plan, batch: &Plan, first: usize) -> Option<Tail> {
        let frames = batch.batch as i128;
        let mut written = Ranges::default();
        let mut needed = Ranges::default();
        for step in &batch.steps[first..] {
            for read in step.reads().iter().filter_map(in_arena) {
                for part in written.outside(read) {
                    needed.add(part);
                }
            }
            if step.writes_all()
                && let Some(w) = in_arena(&step.written())
            {
                written.add(w);
            }
        }
        // Each value the tail needs, from the last step before it that wrote it: that
        // step's output in the one-frame plan, which the tail (the same steps) reads there
        // too, so it is still there after the first steps.
        let (base, end) = window(&batch.steps[first..]);
        let mut carries = vec![Vec::new(); batch.batch];
        for j in (0..first).rev() {
            let Some(w) = in_arena(&batch.steps[j].written()) else {
                continue;
            };
            let parts = needed.inside(w.clone());
            if parts.is_empty() {
                continue;
            }
            let one = in_arena(&frame.steps[j].written())?;
            let per = one.end - one.start;
            if !batch.steps[j].writes_all() || per * frames != w.end - w.start {
                return None;
            }
            for part in parts {
                let mut at = part.start;
                while at < part.end {
                    let f = (at - w.start) / per;
                    let stop = part.end.min(w.start + (f + 1) * per);
                    carries[f as usize].push(Carry {
                        from: usize::try_from(one.start + at - w.start - f * per).ok()?,
                        to: usize::try_from(at - base).ok()?,
                        len: usize::try_from(stop - at).ok()?,
                    });
                    at = stop;
                }
            }
            needed.remove(w);
        }
        // What is left no step wrote before the tail: a span read wider than the values it
        // uses (a strided operand), nothing to carry.
        let mut steps = batch.steps[first..].to_vec();
        for step in &mut steps {
            for loc in step.locs_mut() {
                if let Loc::Arena(o) = loc {
                    *o = o.checked_sub(base as usize)?;
                }
            }
        }
        let plan = Plan {
            batch: batch.batch,
            dtype: batch.dtype,
            arena_len: (end - base) as usize,
            wide_len: 0,
            input_len: batch.input_len,
            output_len: batch.output_len,
            steps,
            origins: batch.origins[first..].to_vec(),
        };
        Some(Tail {
            first,
            plan,
            carries,
        })
    }
}

/// Steps whose outputs need not hold each frame's values together after the frame before's:
/// attention's, a product of several matrices (the heads of a frame's attention).
fn holds_frames_apart(step: &Step) -> bool {
    matches!(
        step,
        Step::Attention(_) | Step::Gemm(GemmStep { batch: 2.., .. })
    )
}

/// Arena values the step's buffers hold, in and out.
fn touched(step: &Step) -> i128 {
    step.spans()
        .iter()
        .filter_map(in_arena)
        .map(|r| r.end - r.start)
        .sum()
}

/// The weights that `step` reads.
fn weights(step: &Step) -> i128 {
    step.spans()
        .iter()
        .filter(|s| matches!(s.loc, Loc::Weight { .. }))
        .map(|s| s.end - s.start)
        .sum()
}

/// The arena values `span` covers, absolutely.
fn in_arena(span: &Span) -> Option<Range<i128>> {
    match span.loc {
        Loc::Arena(o) => Some(o as i128 + span.start..o as i128 + span.end),
        _ => None,
    }
}

/// The part of the arena `steps` touch: from a multiple of 16 values (64 bytes, so that
/// every buffer keeps its alignment) to the last value.
fn window(steps: &[Step]) -> (i128, i128) {
    let spans: Vec<Range<i128>> = steps
        .iter()
        .flat_map(|s| s.spans())
        .filter_map(|s| in_arena(&s))
        .collect();
    let start = spans.iter().map(|r| r.start).min().unwrap_or(0);
    let end = spans.iter().map(|r| r.end).max().unwrap_or(0);
    (start.max(0) / 16 * 16, end.max(0))
}

/// Disjoint ranges of the arena, in order.
#[derive(Default)]
struct Ranges(Vec<Range<i128>>);

impl Ranges {
    fn add(&mut self, r: Range<i128>) {
        if r.is_empty() {
            return;
        }
        let (mut start, mut end) = (r.start, r.end);
        self.0.retain(|o| {
            let apart = o.end < start || end < o.start;
            if !apart {
                start = start.min(o.start);
                end = end.max(o.end);
            }
            apart
        });
        let at = self.0.partition_point(|o| o.start < start);
        self.0.insert(at, start..end);
    }

    fn remove(&mut self, r: Range<i128>) {
        let kept = std::mem::take(&mut self.0);
        for o in kept {
            for part in [o.start..o.end.min(r.start), o.start.max(r.end)..o.end] {
                if !part.is_empty() {
                    self.0.push(part);
                }
            }
        }
    }

    /// The parts of `r` inside these ranges.
    fn inside(&self, r: Range<i128>) -> Vec<Range<i128>> {
        self.0
            .iter()
            .map(|o| o.start.max(r.start)..o.end.min(r.end))
            .filter(|p| !p.is_empty())
            .collect()
    }

    /// The parts of `r` outside these ranges.
    fn outside(&self, r: Range<i128>) -> Vec<Range<i128>> {
        let mut parts = Ranges(vec![r.clone()]);
        for o in &self.0 {
            parts.remove(o.clone());
        }
        parts.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trtclassify_compiler::ir::Act;

    /// A 1×1 convolution of `pixels` pixels (of all the frames), `k` channels to `n`.
    fn pointwise(pixels: usize, k: usize, n: usize) -> Step {
        Step::Gemm(GemmStep {
            batch: 1,
            alpha: 1.0,
            rows: pixels,
            n,
            k,
            x: Loc::Arena(0),
            x_batch: 0,
            w: Loc::Weight {
                index: 0,
                offset: 0,
            },
            w_transposed: false,
            bias: None,
            residual: None,
            act: Act::None,
            y: Loc::Arena(pixels * k),
            y_batch: 0,
            quant: None,
            algo: None,
        })
    }

    #[test]
    fn steps_of_many_weights_or_small_buffers_join_the_tail() {
        // 8 frames: MobileNetV2's 28×28 expansion (6 K weights, 1.4 M values) alone;
        // ResNet-50's 14×14 reduction (262 K weights, 2 M values) and MobileNetV2's 7×7
        // projection (154 K weights, 0.4 M values) in the tail.
        assert!(runs_alone(&pointwise(8 * 784, 32, 192), 8));
        assert!(!runs_alone(&pointwise(8 * 196, 1024, 256), 8));
        assert!(!runs_alone(&pointwise(8 * 49, 960, 160), 8));
        // ResNet-50's 28×28 expansion (65 K weights, 4 M values) alone.
        assert!(runs_alone(&pointwise(8 * 784, 128, 512), 8));
    }

    #[test]
    fn ranges_join_cut_and_split() {
        let mut r = Ranges::default();
        r.add(10..20);
        r.add(30..40);
        r.add(18..31);
        r.add(50..50);
        assert_eq!(r.0, vec![10..40]);
        r.add(0..5);
        r.remove(12..14);
        assert_eq!(r.0, vec![0..5, 10..12, 14..40]);
        assert_eq!(r.inside(3..16), vec![3..5, 10..12, 14..16]);
        assert_eq!(r.outside(3..16), vec![5..10, 12..14]);
        assert_eq!(r.outside(41..45), vec![41..45]);
    }
}
