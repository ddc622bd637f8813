// SPDX-License-Identifier: MPL-2.0
//! Memory under state churn. Alone in its binary: it measures the whole process's RSS, which
//! other tests of the same binary would move.

mod common;

use common::colors_element;
use gst::prelude::*;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// 200 cycles NULL → PLAYING → NULL with the model loaded each time. Memory after the warm-up
/// cycles may grow by at most 16 MiB over the remaining 180 cycles (under 100 KiB a cycle).
#[test]
fn state_churn_is_bounded() {
    common::init();
    let pipeline = common::launch(&format!(
        "videotestsrc num-buffers=4 pattern=red ! video/x-raw,width=64,height=48 ! {} ! fakesink name=sink",
        colors_element("batch-size=2 batch-timeout=5")
    ));
    let bus = pipeline.bus().unwrap();
    let mut warm = 0;
    for cycle in 0..200 {
        if cycle == 20 {
            warm = rss_bytes();
        }
        pipeline.set_state(gst::State::Playing).unwrap();
        let msg = bus
            .timed_pop_filtered(
                gst::ClockTime::from_seconds(30),
                &[gst::MessageType::Eos, gst::MessageType::Error],
            )
            .expect("cycle finished");
        assert!(
            matches!(msg.view(), gst::MessageView::Eos(_)),
            "cycle {cycle}: {msg:?}"
        );
        pipeline.set_state(gst::State::Null).unwrap();
    }
    let growth = rss_bytes().saturating_sub(warm);
    eprintln!(
        "state churn: RSS grew {} KiB over 180 cycles",
        growth / 1024
    );
    assert!(
        growth < 16 << 20,
        "RSS grew {} KiB over 180 cycles",
        growth / 1024
    );
}
