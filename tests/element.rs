// SPDX-License-Identifier: MPL-2.0
//! The element through `gst_check::Harness`: frame counts, order, batching, EOS, flushes,
//! latency, caps changes, interval and top-k.

mod common;

use common::{COLORS, index_and_result, rgb_caps, solid_rgb};
use gst::prelude::*;
use gsttrtclassify::meta::Classification;

/// An element with an engine of its own: the tests of this binary run in parallel, and
/// elements with the same settings would otherwise fill each other's batches.
fn harness(extra: &str) -> gst_check::Harness {
    common::init();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut h = gst_check::Harness::new_parse(&common::colors_element(&format!(
        "{extra} model-instance-id=element-test-{id}"
    )));
    h.set_src_caps(rgb_caps(32, 24));
    h
}

/// The colour of frame `i` in the tests: cycles through the classes so that a result given to
/// the wrong frame shows.
fn colour_of(i: u64) -> (&'static str, [u8; 3]) {
    COLORS[(i as usize * 5 + 1) % COLORS.len()]
}

fn push_frames(h: &mut gst_check::Harness, range: std::ops::Range<u64>) {
    for i in range {
        h.push(solid_rgb(32, 24, colour_of(i).1, i)).unwrap();
    }
}

/// Pulls everything that came out and checks each frame carries its own colour.
fn pull_all(h: &mut gst_check::Harness) -> Vec<(u64, Classification)> {
    let mut out = Vec::new();
    while let Some(buffer) = try_pull_settled(h) {
        let (i, result) = index_and_result(&buffer);
        // Only `interval` makes carried frames (its own test checks which).
        if interval_of(h) == 1 {
            assert!(result.fresh, "frame {i} is inferred");
        }
        if result.fresh {
            let top = result.top().expect("a top class");
            assert_eq!(
                top.label,
                colour_of(i).0,
                "frame {i} got another frame's result"
            );
            assert!(top.confidence > 0.9, "frame {i}: {top:?}");
        }
        out.push((i, result));
    }
    out
}

/// The next buffer out, waiting until none has come for 100 ms: on a GPU a full batch runs
/// while the next gathers, and its frames leave from the element's own thread once it is
/// done, not within the push that filled it.
fn try_pull_settled(h: &mut gst_check::Harness) -> Option<gst::Buffer> {
    let started = std::time::Instant::now();
    loop {
        if let Some(buffer) = h.try_pull() {
            return Some(buffer);
        }
        if started.elapsed() > std::time::Duration::from_millis(100) {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// The element's `interval`: every how many frames one is inferred.
fn interval_of(h: &mut gst_check::Harness) -> u64 {
    u64::from(
        h.find_element("trtclassify")
            .unwrap()
            .property::<u32>("interval"),
    )
}

fn indices(out: &[(u64, Classification)]) -> Vec<u64> {
    out.iter().map(|(i, _)| *i).collect()
}

#[test]
fn batch_of_one_passes_every_frame_at_once() {
    let mut h = harness("");
    for i in 0..7 {
        h.push(solid_rgb(32, 24, colour_of(i).1, i)).unwrap();
        let out = pull_all(&mut h);
        assert_eq!(indices(&out), vec![i], "frame {i} left at once");
        assert_eq!(out[0].1.frame, i);
        assert_eq!(out[0].1.model, "colors.onnx");
        assert_eq!(out[0].1.classes.len(), 5, "top-k defaults to 5");
    }
}

#[test]
fn frames_wait_for_a_full_batch_and_leave_in_order() {
    let mut h = harness("batch-size=4 batch-timeout=-1");
    push_frames(&mut h, 0..3);
    assert_eq!(h.buffers_in_queue(), 0, "a partial batch is held");
    push_frames(&mut h, 3..4);
    assert_eq!(indices(&pull_all(&mut h)), vec![0, 1, 2, 3]);
    push_frames(&mut h, 4..10);
    assert_eq!(indices(&pull_all(&mut h)), vec![4, 5, 6, 7]);
    // EOS drains the partial batch before the EOS itself.
    assert!(h.push_event(gst::event::Eos::new()));
    assert_eq!(indices(&pull_all(&mut h)), vec![8, 9]);
    let mut saw_eos = false;
    while let Some(event) = h.try_pull_event() {
        saw_eos |= event.type_() == gst::EventType::Eos;
    }
    assert!(saw_eos, "EOS follows the drained frames");
}

#[test]
fn a_batch_spread_over_threads_keeps_each_frame_its_own_result() {
    // With two threads the cpu backend runs the frames of a model batch side by side; each
    // still gets its own colour, in order, and the property reads back.
    let mut h = harness("batch-size=5 batch-timeout=-1 threads=2");
    let element = h.find_element("trtclassify").unwrap();
    assert_eq!(element.property::<u32>("threads"), 2);
    push_frames(&mut h, 0..10);
    assert_eq!(indices(&pull_all(&mut h)), (0..10).collect::<Vec<_>>());
    let default = gst::ElementFactory::make("trtclassify").build().unwrap();
    assert_eq!(
        default.property::<u32>("threads"),
        0,
        "all cores by default"
    );
}

#[test]
fn drain_query_releases_held_frames() {
    let mut h = harness("batch-size=4 batch-timeout=-1");
    push_frames(&mut h, 0..3);
    assert_eq!(h.buffers_in_queue(), 0);
    let mut drain = gst::query::Drain::new();
    h.element()
        .unwrap()
        .static_pad("sink")
        .unwrap()
        .query(&mut drain);
    assert_eq!(indices(&pull_all(&mut h)), vec![0, 1, 2]);
}

#[test]
fn flush_drops_held_frames() {
    let mut h = harness("batch-size=4 batch-timeout=-1");
    push_frames(&mut h, 0..3);
    assert!(h.push_event(gst::event::FlushStart::new()));
    assert!(h.push_event(gst::event::FlushStop::new(true)));
    h.push_event(gst::event::Segment::new(&gst::FormattedSegment::<
        gst::ClockTime,
    >::new()));
    push_frames(&mut h, 10..14);
    assert_eq!(
        indices(&pull_all(&mut h)),
        vec![10, 11, 12, 13],
        "held frames were dropped, none leaked"
    );
}

#[test]
fn batch_timeout_releases_a_partial_batch() {
    let mut h = harness("batch-size=8 batch-timeout=300");
    let pushed = std::time::Instant::now();
    push_frames(&mut h, 0..3);
    let mut out = Vec::new();
    while out.len() < 3 && pushed.elapsed() < std::time::Duration::from_secs(10) {
        if let Some(buffer) = h.try_pull() {
            out.push((index_and_result(&buffer).0, pushed.elapsed()));
        } else {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    let indices: Vec<u64> = out.iter().map(|(i, _)| *i).collect();
    assert_eq!(indices, vec![0, 1, 2], "the stalled partial batch came out");
    // Held until the timeout: none left before 300 ms had passed since the first push (a
    // lower bound, which a busy machine cannot break).
    for (i, left) in &out {
        assert!(
            *left >= std::time::Duration::from_millis(300),
            "frame {i} left after {left:?}, before the batch timeout"
        );
    }
}

#[test]
fn latency_adds_the_batch_wait() {
    // 25 fps: 3 frames of 40 ms wait for the 4th; the timeout bounds it.
    let h = harness("batch-size=4 batch-timeout=-1");
    assert_eq!(h.query_latency(), Some(gst::ClockTime::from_mseconds(120)));
    let h = harness("batch-size=4 batch-timeout=50");
    assert_eq!(h.query_latency(), Some(gst::ClockTime::from_mseconds(50)));
    let h = harness("batch-size=1");
    assert_eq!(h.query_latency(), Some(gst::ClockTime::ZERO));
}

#[test]
fn caps_change_mid_stream() {
    let mut h = harness("batch-size=3 batch-timeout=-1");
    push_frames(&mut h, 0..2);
    // New resolution: the two held frames leave first, at the old size.
    h.set_src_caps(rgb_caps(64, 48));
    let first = pull_all(&mut h);
    assert_eq!(indices(&first), vec![0, 1]);
    for i in 2..5 {
        h.push(solid_rgb(64, 48, colour_of(i).1, i)).unwrap();
    }
    let out = h.pull().unwrap();
    assert_eq!(out.size(), 64 * 48 * 3);
    assert_eq!(
        index_and_result(&out).1.top().unwrap().label,
        colour_of(2).0
    );
    assert_eq!(indices(&pull_all(&mut h)), vec![3, 4]);
}

#[test]
fn interval_carries_the_last_result() {
    let mut h = harness("interval=3 batch-size=2 batch-timeout=-1");
    push_frames(&mut h, 0..7);
    h.push_event(gst::event::Eos::new());
    let out = pull_all(&mut h);
    assert_eq!(indices(&out), (0..7).collect::<Vec<_>>());
    for (i, result) in &out {
        assert_eq!(result.fresh, i % 3 == 0, "frame {i}");
        let source = i - i % 3;
        assert_eq!(
            result.top().unwrap().label,
            colour_of(source).0,
            "frame {i} carries frame {source}'s result"
        );
        assert_eq!(result.frame, *i);
    }
}

#[test]
fn top_k_and_threshold() {
    let mut h = harness("top-k=2");
    push_frames(&mut h, 0..1);
    let (_, result) = pull_all(&mut h).remove(0);
    assert_eq!(result.classes.len(), 2);
    assert!(result.classes[0].confidence >= result.classes[1].confidence);

    let mut h = harness("threshold=0.5");
    push_frames(&mut h, 0..1);
    let (_, result) = pull_all(&mut h).remove(0);
    assert_eq!(
        result.classes.len(),
        1,
        "only the confident class passes 0.5"
    );
}

#[test]
fn pixels_are_never_changed() {
    let mut h = harness("");
    let input = solid_rgb(32, 24, [12, 34, 56], 0);
    let bytes = input.map_readable().unwrap().to_vec();
    h.push(input).unwrap();
    let out = h.pull().unwrap();
    assert_eq!(out.map_readable().unwrap().as_slice(), bytes.as_slice());
}

/// The buffers the element asks upstream to allocate for frames of 25 fps (`rgb_caps`), with
/// properties `extra`: the smallest pool size in its answer to an allocation query.
fn pool_minimum(extra: &str) -> u32 {
    let mut h = harness(extra);
    let element = h.find_element("trtclassify").expect("the element");
    let mut query = gst::query::Allocation::new(Some(&rgb_caps(32, 24)), true);
    assert!(element.static_pad("sink").unwrap().query(&mut query));
    query
        .allocation_pools()
        .map(|(_, _, min, _)| min)
        .min()
        .expect("a pool proposed")
}

#[test]
fn the_allocation_query_asks_for_what_the_batch_timeout_holds() {
    // batch-size 16, interval 30: 450 frames between the first and the last of a batch,
    // but the partial batch runs after 100 ms, 3 frames at 25 fps (and one more while it
    // runs). Before, the element asked for 450 more buffers per camera.
    assert_eq!(pool_minimum("batch-size=16 interval=30"), 4 + 2);
    assert_eq!(
        pool_minimum("batch-size=16 interval=30 batch-timeout=1000"),
        26 + 2
    );
    // Without a timeout, the whole batch's frames wait; on a GPU also those of the batches
    // running while it gathers.
    let mut h = harness("batch-size=4");
    let stats = h
        .find_element("trtclassify")
        .unwrap()
        .property::<gst::Structure>("stats");
    let batches = match stats.get::<String>("backend").unwrap().as_str() {
        "cuda" => gsttrtclassify::engine::cuda::runtime::IN_FLIGHT as u32 + 1,
        _ => 1,
    };
    assert_eq!(
        pool_minimum("batch-size=4 batch-timeout=-1"),
        4 * batches - 1 + 2
    );
}
