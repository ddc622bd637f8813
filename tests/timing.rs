// SPDX-License-Identifier: MPL-2.0
//! The wait a live stream's frames see. Alone in its binary: a time bound means little while
//! other tests of the same binary load models and run pipelines on the same cores.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::colors_element;
use gst::prelude::*;

/// When each buffer (by PTS) passed a pad.
type PassLog = Arc<Mutex<Vec<(u64, Instant)>>>;

/// Records when each buffer (by PTS) passes the element's sink and src pads.
fn timing_probes(element: &gst::Element) -> (PassLog, PassLog) {
    let record = |pad: &str| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = log.clone();
        element
            .static_pad(pad)
            .unwrap()
            .add_probe(gst::PadProbeType::BUFFER, move |_, info| {
                if let Some(buffer) = info.buffer() {
                    l.lock()
                        .unwrap()
                        .push((buffer.pts().unwrap().nseconds(), Instant::now()));
                }
                gst::PadProbeReturn::Ok
            });
        log
    };
    (record("sink"), record("src"))
}

/// A live 10 fps source with batch-size 8 and batch-timeout 50 ms: a full batch would take
/// 800 ms to gather, but no frame may wait longer than the timeout plus one inference.
#[test]
fn live_source_waits_are_bounded_by_the_timeout() {
    common::init();
    let pipeline = common::launch(&format!(
        "videotestsrc is-live=true num-buffers=12 pattern=blue ! video/x-raw,width=64,height=48,framerate=10/1 ! \
         {} ! fakesink sync=false",
        colors_element("name=classify batch-size=8 batch-timeout=50")
    ));
    let element = pipeline.by_name("classify").unwrap();
    let (arrived, left) = timing_probes(&element);
    common::run_to_eos(&pipeline).unwrap();
    let arrived = arrived.lock().unwrap();
    let left = left.lock().unwrap();
    assert_eq!(left.len(), 12);
    let longest = arrived
        .iter()
        .map(|(pts, t)| {
            let out = left
                .iter()
                .find(|(p, _)| p == pts)
                .expect("every frame came out")
                .1;
            out - *t
        })
        .max()
        .unwrap();
    eprintln!("live source, batch-size 8, batch-timeout 50 ms: longest wait {longest:?}");
    // 50 ms of timeout; an inference of this model takes well under a millisecond, the rest is
    // scheduling slack on a loaded 2-core CI machine.
    assert!(
        longest < Duration::from_millis(150),
        "a frame waited {longest:?}"
    );
    assert!(
        longest >= Duration::from_millis(45),
        "frames did wait for batch-mates ({longest:?})"
    );
}
