// SPDX-License-Identifier: MPL-2.0
//! Property-based test: random batch sizes, timeouts, intervals, frame counts, flushes and
//! caps changes. Every frame pushed comes out exactly once, in order, with its own result,
//! except frames that a flush dropped while they were held.

mod common;

use common::{COLORS, index_and_result, rgb_caps, solid_rgb};
use proptest::prelude::*;

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

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_frame_leaves_once_in_order_with_its_result((batch, timeout, interval, ops) in scenario()) {
        common::init();
        let mut h = gst_check::Harness::new_parse(&common::colors_element(&format!(
            "batch-size={batch} batch-timeout={timeout} interval={interval} top-k=1"
        )));
        let mut size = SIZES[0];
        h.set_src_caps(rgb_caps(size.0 as i32, size.1 as i32));
        let mut pushed: Vec<Pushed> = Vec::new();
        let mut out = Vec::new();
        let mut next = 0u64;
        let mut total = 0u64;
        let mut epoch = 0u32;
        // `interval`: a frame is inferred, the next interval-1 carry its result; a flush
        // starts over with an inferred frame.
        let mut carry_left = 0u32;
        for op in ops {
            match op {
                Op::Frames(n) => {
                    let n = n.min(200 - total);
                    total += n;
                    for _ in 0..n {
                        h.push(solid_rgb(size.0, size.1, colour(next).1, next)).unwrap();
                        let fresh = carry_left == 0;
                        carry_left = if fresh { interval - 1 } else { carry_left - 1 };
                        pushed.push(Pushed { index: next, flushed_after: false, epoch, fresh });
                        next += 1;
                    }
                }
                Op::Flush => {
                    prop_assert!(h.push_event(gst::event::FlushStart::new()));
                    prop_assert!(h.push_event(gst::event::FlushStop::new(true)));
                    h.push_event(gst::event::Segment::new(&gst::FormattedSegment::<gst::ClockTime>::new()));
                    if let Some(last) = pushed.last_mut() {
                        last.flushed_after = true;
                    }
                    epoch += 1;
                    carry_left = 0;
                }
                Op::Caps(n) => {
                    size = SIZES[n];
                    h.set_src_caps(rgb_caps(size.0 as i32, size.1 as i32));
                }
            }
            while let Some(buffer) = h.try_pull() {
                out.push(buffer);
            }
        }
        prop_assert!(h.push_event(gst::event::Eos::new()));
        while let Some(buffer) = h.try_pull() {
            out.push(buffer);
        }

        // Out: strictly increasing indices, each frame at most once.
        let results: Vec<_> = out.iter().map(|b| index_and_result(b)).collect();
        let indices: Vec<u64> = results.iter().map(|(i, _)| *i).collect();
        prop_assert!(indices.windows(2).all(|w| w[0] < w[1]), "order: {:?}", indices);

        // A frame missing from the output must have been held when a flush came: every frame
        // from it up to the flush is missing too.
        let mut came_out = indices.iter().peekable();
        let mut dropped_run = false;
        for p in &pushed {
            if came_out.peek() == Some(&&p.index) {
                came_out.next();
                prop_assert!(!dropped_run, "frame {} came out after an earlier frame was lost", p.index);
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
                Some(s) => prop_assert_eq!(&r.top().unwrap().label, colour(s).0, "frame {} carries {}", i, s),
                None => prop_assert!(r.classes.is_empty(), "frame {} has no result to carry", i),
            }
            if r.fresh {
                last_fresh = Some(*i);
            }
        }
    }
}
