// SPDX-License-Identifier: MPL-2.0
//! Property-based tests: random batch sizes, timeouts, intervals, frame counts, flushes and
//! caps changes, for one element and for several elements sharing one engine. Every frame
//! pushed comes out exactly once, in order, with its own result, except frames that a flush
//! dropped while they were held: none at batch 1, at most the frames its batcher held
//! otherwise (see `Driver::finish`).
//!
//! `PROPTEST_CASES` sets how many scenarios each test runs (by default 500 and 200).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};

use common::{COLORS, index_and_result, rgb_caps, solid_rgb};
use gst::prelude::*;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

#[derive(Debug, Clone)]
enum Op {
    Frames(u64),
    Flush,
    /// Switch to frame size number `n`.
    Caps(usize),
}

const SIZES: [(u32, u32); 3] = [(32, 24), (64, 48), (17, 9)];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..40).prop_map(Op::Frames),
        1 => Just(Op::Flush),
        1 => (0..SIZES.len()).prop_map(Op::Caps),
    ]
}

fn colour(i: u64) -> (&'static str, [u8; 3]) {
    COLORS[((i * 7 + 3) % COLORS.len() as u64) as usize]
}

fn scenario() -> impl Strategy<Value = (u32, i32, u32, Vec<Op>)> {
    (
        1u32..=16,
        prop_oneof![Just(-1i32), 0i32..20],
        1u32..=4,
        prop::collection::vec(op(), 0..12),
    )
}

/// How many scenarios a test runs: `PROPTEST_CASES`, else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}

/// What the test pushed: frame index, how many flushes came before it, and whether the
/// element must infer it.
struct Pushed {
    index: u64,
    epoch: u32,
    fresh: bool,
}

/// A flush, and the frames it may drop: those the element held when it came.
struct Flush {
    /// How many frames were pushed before it.
    after: usize,
    /// The first frame (an index into `Driver::pushed`) that the element may still hold: a
    /// caps change or a flush before it sent or dropped everything before, and the frames
    /// held are the last ones pushed.
    may_hold_from: usize,
    /// Where the element's frames are known (see `Driver::exact`), the first frame held at
    /// the flush, which it drops with all after it (`after` where none is held).
    held_from: Option<usize>,
}

/// One element in a harness, with what the test pushed into it and what came out.
struct Driver {
    h: gst_check::Harness,
    interval: u32,
    batch: u32,
    size: (u32, u32),
    pushed: Vec<Pushed>,
    flushes: Vec<Flush>,
    out: Vec<gst::Buffer>,
    next: u64,
    epoch: u32,
    // `interval`: a frame is inferred, the next interval-1 carry its result; a flush
    // starts over with an inferred frame.
    carry_left: u32,
    /// Whether the test knows which frames the element holds: one element alone on its
    /// engine, without a batch timeout, sends frames on only when `batch` fresh frames have
    /// been pushed since the last batch ran, and at a caps change (any serialized event) or
    /// EOS; with a timeout, or other streams on the engine, a batch may also run between two
    /// of the test's operations, on another thread.
    exact: bool,
    /// The first frame the element holds (an index into `pushed`; the frames after it are
    /// held too), and how many fresh frames since it wait for their batch, where `exact`.
    held_from: Option<usize>,
    unbatched: u32,
    /// The first frame pushed since the last caps change or flush.
    drained_up_to: usize,
}

impl Driver {
    /// An element of `batch`, `interval` and other `properties`; `exact`: see the field.
    fn new(properties: &str, batch: u32, interval: u32, exact: bool) -> Self {
        common::init();
        let mut h = gst_check::Harness::new_parse(&common::colors_element(&format!(
            "{properties} name=classifier batch-size={batch} interval={interval} top-k=1"
        )));
        let size = SIZES[0];
        h.set_src_caps(rgb_caps(size.0 as i32, size.1 as i32));
        Driver {
            h,
            interval,
            batch,
            size,
            pushed: Vec::new(),
            flushes: Vec::new(),
            out: Vec::new(),
            next: 0,
            epoch: 0,
            carry_left: 0,
            exact,
            held_from: None,
            unbatched: 0,
            drained_up_to: 0,
        }
    }

    /// The element sent or dropped every frame pushed so far (a caps change, a flush).
    fn drained(&mut self) {
        self.held_from = None;
        self.unbatched = 0;
        self.drained_up_to = self.pushed.len();
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Frames(n) => {
                let n = n.min(200 - self.next);
                for _ in 0..n {
                    let (w, h) = self.size;
                    self.h
                        .push(solid_rgb(w, h, colour(self.next).1, self.next))
                        .unwrap();
                    let fresh = self.carry_left == 0;
                    self.carry_left = if fresh {
                        self.interval - 1
                    } else {
                        self.carry_left - 1
                    };
                    // A fresh frame waits for its batch, and every frame after it behind it;
                    // the one that fills the batch sends them all on, itself included. A
                    // carried frame with nothing held before it leaves at once.
                    if fresh {
                        self.held_from.get_or_insert(self.pushed.len());
                        self.unbatched += 1;
                        if self.unbatched == self.batch {
                            (self.held_from, self.unbatched) = (None, 0);
                        }
                    }
                    self.pushed.push(Pushed {
                        index: self.next,
                        epoch: self.epoch,
                        fresh,
                    });
                    self.next += 1;
                }
            }
            Op::Flush => {
                prop_assert!(self.h.push_event(gst::event::FlushStart::new()));
                prop_assert!(self.h.push_event(gst::event::FlushStop::new(true)));
                self.h
                    .push_event(gst::event::Segment::new(&gst::FormattedSegment::<
                        gst::ClockTime,
                    >::new()));
                self.flushes.push(Flush {
                    after: self.pushed.len(),
                    may_hold_from: self.drained_up_to,
                    held_from: self
                        .exact
                        .then(|| self.held_from.unwrap_or(self.pushed.len())),
                });
                self.drained();
                self.epoch += 1;
                self.carry_left = 0;
            }
            Op::Caps(n) => {
                self.size = SIZES[n];
                self.h
                    .set_src_caps(rgb_caps(self.size.0 as i32, self.size.1 as i32));
                // A serialized event: the element runs its partial batch and sends every
                // frame on before it.
                self.drained();
            }
        }
        self.pull();
        Ok(())
    }

    /// Full batches the element's engine may hold unanswered (`stats`' `batches-in-flight`;
    /// 1 where no engine ran): a flush drops the frames in them too.
    fn batches_in_flight(&self) -> u32 {
        let bin = self.h.element().expect("the harness's bin");
        let bin = bin.downcast::<gst::Bin>().expect("a bin");
        let element = bin.by_name("classifier").expect("the classifier");
        let stats = element.property::<gst::Structure>("stats");
        match stats.has_field("backend") {
            true => stats.get("batches-in-flight").expect("batches-in-flight"),
            false => 1,
        }
    }

    fn pull(&mut self) {
        while let Some(buffer) = self.h.try_pull() {
            self.out.push(buffer);
        }
    }

    /// Sends EOS and checks what came out: every frame once, in order, with its own result,
    /// except frames that a flush dropped while they were held.
    ///
    /// A flush drops the frames the element holds (its batcher's, and any that a batch
    /// timeout or another stream's batch had just released when the flush began): the last
    /// frames pushed before it, since the last caps change or flush, with at most
    /// `batch - 1` fresh ones (a batch of `batch` runs in the push that fills it), or fewer
    /// than `batch` times the engine's batches in flight where it runs batches while the next
    /// gather (a GPU's: a full batch still running is dropped too). At batch 1 every frame is
    /// scored in its own push, so nothing is held and nothing lost. Where the test knows what
    /// the element holds (`exact`, and an engine without batches in flight), the flush drops
    /// exactly those frames.
    fn finish(mut self) -> Result<(), TestCaseError> {
        prop_assert!(self.h.push_event(gst::event::Eos::new()));
        self.pull();
        let pushed = &self.pushed;
        let in_flight = self.batches_in_flight();
        let held = self.batch * in_flight;

        // Out: strictly increasing indices, each frame at most once.
        let results: Vec<_> = self.out.iter().map(|b| index_and_result(b)).collect();
        let indices: Vec<u64> = results.iter().map(|(i, _)| *i).collect();
        prop_assert!(
            indices.windows(2).all(|w| w[0] < w[1]),
            "order: {:?}",
            indices
        );

        // A frame missing from the output must have been held when a flush came: the frames
        // lost before a flush are the last ones pushed before it, as many as it may drop.
        let mut came_out = indices.iter().peekable();
        let lost: Vec<bool> = pushed
            .iter()
            .map(|p| {
                let out = came_out.peek() == Some(&&p.index);
                if out {
                    came_out.next();
                }
                !out
            })
            .collect();
        let mut start = 0;
        for flush in &self.flushes {
            let before = &lost[start..flush.after];
            // The frames lost before this flush: from the first lost to the flush, all lost.
            let first = before
                .iter()
                .position(|&l| l)
                .map_or(flush.after, |i| start + i);
            if let Some(out) = (first..flush.after).find(|&i| !lost[i]) {
                return Err(TestCaseError::fail(format!(
                    "frame {out} came out after an earlier frame ({first}) was lost"
                )));
            }
            let dropped = flush.after - first;
            let fresh = pushed[first..flush.after]
                .iter()
                .filter(|p| p.fresh)
                .count();
            prop_assert!(
                self.batch > 1 || dropped == 0,
                "batch 1: a flush lost {} frames from frame {}; none is ever held",
                dropped,
                first
            );
            prop_assert!(
                first >= flush.may_hold_from,
                "a flush lost frame {}, pushed before the caps change or flush at frame {}, which sent everything on",
                first,
                flush.may_hold_from
            );
            prop_assert!(
                fresh < held as usize,
                "a flush lost {} fresh frames from frame {}; a batch of {} runs when it fills, \
                 {} batch(es) in flight",
                fresh,
                first,
                self.batch,
                in_flight
            );
            if let Some(held_from) = flush.held_from.filter(|_| in_flight == 1) {
                prop_assert_eq!(
                    first,
                    held_from,
                    "a flush after {} frames lost frames from {}, but the element held them from {}",
                    flush.after,
                    first,
                    held_from
                );
            }
            start = flush.after;
        }
        if let Some(first) = lost[start..].iter().position(|&l| l) {
            return Err(TestCaseError::fail(format!(
                "frame {} lost with no flush after it",
                start + first
            )));
        }

        // Each frame carries its own result; carried ones that of the last fresh frame out
        // since the last flush.
        let mut last_fresh: Option<u64> = None;
        let mut last_epoch = 0;
        for (i, r) in &results {
            let p = &pushed[*i as usize];
            if p.epoch != last_epoch {
                last_fresh = None;
                last_epoch = p.epoch;
            }
            prop_assert_eq!(r.frame, *i);
            prop_assert_eq!(r.fresh, p.fresh, "frame {}", i);
            let source = if r.fresh { Some(*i) } else { last_fresh };
            match source {
                Some(s) => prop_assert_eq!(
                    &r.top().unwrap().label,
                    colour(s).0,
                    "frame {} carries {}",
                    i,
                    s
                ),
                None => prop_assert!(r.classes.is_empty(), "frame {} has no result to carry", i),
            }
            if r.fresh {
                last_fresh = Some(*i);
            }
        }
        Ok(())
    }
}

/// A model instance of its own for each case, so that no other test's elements join it.
fn instance_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("scenario-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// What one stream of a shared engine does: its batch timeout and interval (its own), and
/// its operations; `stop_after`: the element stops (set to NULL) after that many operations,
/// in the middle of the others' streams.
#[derive(Debug, Clone)]
struct StreamPlan {
    timeout: i32,
    interval: u32,
    stop_after: Option<usize>,
}

fn stream_plan() -> impl Strategy<Value = StreamPlan> {
    (
        prop_oneof![Just(-1i32), 0i32..20],
        1u32..=4,
        prop_oneof![3 => Just(None), 1 => (0usize..8).prop_map(Some)],
    )
        .prop_map(|(timeout, interval, stop_after)| StreamPlan {
            timeout,
            interval,
            stop_after,
        })
}

fn shared_scenario() -> impl Strategy<Value = (u32, Vec<StreamPlan>, Vec<(usize, Op)>)> {
    (
        1u32..=16,
        prop::collection::vec(stream_plan(), 2..=4),
        prop::collection::vec((0usize..4, op()), 0..24),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(500), ..ProptestConfig::default() })]

    #[test]
    fn every_frame_leaves_once_in_order_with_its_result((batch, timeout, interval, ops) in scenario()) {
        let mut d = Driver::new(
            &format!("batch-timeout={timeout} model-instance-id={}", instance_id()),
            batch,
            interval,
            timeout < 0,
        );
        for op in &ops {
            d.apply(op)?;
        }
        d.finish()?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(200), ..ProptestConfig::default() })]

    /// Several elements share one engine (same settings, same `model-instance-id`), each with
    /// its own timeout, interval, flushes, caps changes and EOS, some stopping in the middle:
    /// each stream still gets all its frames once, in order, with its own results.
    #[test]
    fn streams_sharing_an_engine_each_get_their_own_frames((batch, plans, ops) in shared_scenario()) {
        let id = instance_id();
        let mut streams: Vec<Option<Driver>> = plans
            .iter()
            .map(|p| {
                // Other streams' batches run this stream's frames when they fill.
                Some(Driver::new(
                    &format!("batch-timeout={} model-instance-id={id}", p.timeout),
                    batch,
                    p.interval,
                    false,
                ))
            })
            .collect();
        let mut done = vec![0usize; plans.len()];
        for (s, op) in &ops {
            let s = s % plans.len();
            let Some(d) = streams[s].as_mut() else { continue };
            d.apply(op)?;
            done[s] += 1;
            if plans[s].stop_after.is_some_and(|n| done[s] >= n) {
                // Stopped mid-stream: its held frames go with it; the others must not stall.
                streams[s] = None;
            }
        }
        for d in streams.into_iter().flatten() {
            d.finish()?;
        }
    }
}
