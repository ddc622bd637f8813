// SPDX-License-Identifier: MPL-2.0
//! Property-based tests: random batch sizes, timeouts, intervals, frame counts, flushes and
//! caps changes, for one element and for several elements sharing one engine. Every frame
//! pushed comes out exactly once, in order, with its own result, except frames that a flush
//! dropped while they were held.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};

use common::{COLORS, index_and_result, rgb_caps, solid_rgb};
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

/// What the test pushed: frame index, whether a flush followed before the next frame, how
/// many flushes came before it, and whether the element must infer it.
struct Pushed {
    index: u64,
    flushed_after: bool,
    epoch: u32,
    fresh: bool,
}

/// One element in a harness, with what the test pushed into it and what came out.
struct Driver {
    h: gst_check::Harness,
    interval: u32,
    size: (u32, u32),
    pushed: Vec<Pushed>,
    out: Vec<gst::Buffer>,
    next: u64,
    epoch: u32,
    // `interval`: a frame is inferred, the next interval-1 carry its result; a flush
    // starts over with an inferred frame.
    carry_left: u32,
}

impl Driver {
    fn new(properties: &str, interval: u32) -> Self {
        common::init();
        let mut h = gst_check::Harness::new_parse(&common::colors_element(&format!(
            "{properties} interval={interval} top-k=1"
        )));
        let size = SIZES[0];
        h.set_src_caps(rgb_caps(size.0 as i32, size.1 as i32));
        Driver {
            h,
            interval,
            size,
            pushed: Vec::new(),
            out: Vec::new(),
            next: 0,
            epoch: 0,
            carry_left: 0,
        }
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
                    self.pushed.push(Pushed {
                        index: self.next,
                        flushed_after: false,
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
                if let Some(last) = self.pushed.last_mut() {
                    last.flushed_after = true;
                }
                self.epoch += 1;
                self.carry_left = 0;
            }
            Op::Caps(n) => {
                self.size = SIZES[n];
                self.h
                    .set_src_caps(rgb_caps(self.size.0 as i32, self.size.1 as i32));
            }
        }
        self.pull();
        Ok(())
    }

    fn pull(&mut self) {
        while let Some(buffer) = self.h.try_pull() {
            self.out.push(buffer);
        }
    }

    /// Sends EOS and checks what came out: every frame once, in order, with its own result,
    /// except frames that a flush dropped while they were held.
    fn finish(mut self) -> Result<(), TestCaseError> {
        prop_assert!(self.h.push_event(gst::event::Eos::new()));
        self.pull();
        let pushed = &self.pushed;

        // Out: strictly increasing indices, each frame at most once.
        let results: Vec<_> = self.out.iter().map(|b| index_and_result(b)).collect();
        let indices: Vec<u64> = results.iter().map(|(i, _)| *i).collect();
        prop_assert!(
            indices.windows(2).all(|w| w[0] < w[1]),
            "order: {:?}",
            indices
        );

        // A frame missing from the output must have been held when a flush came: every frame
        // from it up to the flush is missing too.
        let mut came_out = indices.iter().peekable();
        let mut dropped_run = false;
        for p in pushed {
            if came_out.peek() == Some(&&p.index) {
                came_out.next();
                prop_assert!(
                    !dropped_run,
                    "frame {} came out after an earlier frame was lost",
                    p.index
                );
            } else {
                dropped_run = true;
            }
            if p.flushed_after {
                dropped_run = false;
            }
        }
        prop_assert!(!dropped_run, "frames lost at the end without a flush");

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
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn every_frame_leaves_once_in_order_with_its_result((batch, timeout, interval, ops) in scenario()) {
        let mut d = Driver::new(
            &format!("batch-size={batch} batch-timeout={timeout} model-instance-id={}", instance_id()),
            interval,
        );
        for op in &ops {
            d.apply(op)?;
        }
        d.finish()?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Several elements share one engine (same settings, same `model-instance-id`), each with
    /// its own timeout, interval, flushes, caps changes and EOS, some stopping in the middle:
    /// each stream still gets all its frames once, in order, with its own results.
    #[test]
    fn streams_sharing_an_engine_each_get_their_own_frames((batch, plans, ops) in shared_scenario()) {
        let id = instance_id();
        let mut streams: Vec<Option<Driver>> = plans
            .iter()
            .map(|p| {
                Some(Driver::new(
                    &format!("batch-size={batch} batch-timeout={} model-instance-id={id}", p.timeout),
                    p.interval,
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
