// SPDX-License-Identifier: MPL-2.0
//! Reliability: many pipelines in one process, a stalled live source, batch sizes. (Memory
//! under state churn and the live wait bound run alone: memory.rs, timing.rs.)

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{colors_element, run_pipeline};
use gst::prelude::*;

/// 16 pipelines on the same model in one process, started in two waves with some stopped
/// while the others run; every pipeline that runs to the end has every frame, correctly
/// classified.
#[test]
fn sixteen_pipelines_in_one_process() {
    common::init();
    let patterns = ["red", "green", "blue", "white", "black"];
    let make = |i: usize| {
        let pattern = patterns[i % patterns.len()];
        let pipeline = common::launch(&format!(
            "videotestsrc is-live=true num-buffers=40 pattern={pattern} ! video/x-raw,width=96,height=64,framerate=100/1 ! \
             {} ! appsink name=sink sync=false",
            colors_element(&format!(
                "batch-size={} batch-timeout=20 top-k=1",
                1 + i % 4
            ))
        ));
        let sink = common::appsink(&pipeline, "sink");
        let labels = Arc::new(Mutex::new(Vec::new()));
        let collected = labels.clone();
        sink.set_callbacks(
            gst_app::AppSinkCallbacks::builder()
                .new_sample(move |sink| {
                    let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                    let r =
                        gsttrtclassify::meta::Classification::from_buffer(sample.buffer().unwrap())
                            .unwrap();
                    collected
                        .lock()
                        .unwrap()
                        .push(r.top().unwrap().label.clone());
                    Ok(gst::FlowSuccess::Ok)
                })
                .build(),
        );
        (pipeline, pattern, labels)
    };
    let mut running: Vec<_> = (0..8).map(make).collect();
    for (p, _, _) in &running {
        p.set_state(gst::State::Playing).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    for i in 8..16 {
        let (p, pattern, labels) = make(i);
        p.set_state(gst::State::Playing).unwrap();
        running.push((p, pattern, labels));
    }
    // Stop four of the first wave mid-stream.
    for (p, _, _) in running.drain(0..4) {
        p.set_state(gst::State::Null).unwrap();
    }
    for (p, pattern, labels) in running {
        let msg = p
            .bus()
            .unwrap()
            .timed_pop_filtered(
                gst::ClockTime::from_seconds(60),
                &[gst::MessageType::Eos, gst::MessageType::Error],
            )
            .expect("EOS");
        assert!(matches!(msg.view(), gst::MessageView::Eos(_)), "{msg:?}");
        p.set_state(gst::State::Null).unwrap();
        let labels = labels.lock().unwrap();
        assert_eq!(labels.len(), 40, "{pattern}: every frame came out");
        assert!(labels.iter().all(|l| l == pattern), "{pattern}: {labels:?}");
    }
}

/// A live source that stalls (pushes 3 frames, then nothing, without EOS) does not hold its
/// frames: they come out once batch-timeout passes.
#[test]
fn stalled_source_releases_held_frames() {
    common::init();
    let pipeline = common::launch(&format!(
        "appsrc name=src is-live=true format=time ! {} ! appsink name=sink sync=false",
        colors_element("batch-size=8 batch-timeout=40")
    ));
    let src = pipeline
        .by_name("src")
        .unwrap()
        .downcast::<gst_app::AppSrc>()
        .unwrap();
    src.set_caps(Some(&common::rgb_caps(32, 24)));
    let sink = common::appsink(&pipeline, "sink");
    pipeline.set_state(gst::State::Playing).unwrap();
    let started = Instant::now();
    for i in 0..3 {
        src.push_buffer(common::solid_rgb(32, 24, common::COLORS[2].1, i))
            .unwrap();
    }
    let mut got = Vec::new();
    while got.len() < 3 {
        let sample = sink
            .try_pull_sample(gst::ClockTime::from_seconds(5))
            .expect("held frames came out without more input");
        got.push(sample.buffer().unwrap().offset());
    }
    let waited = started.elapsed();
    pipeline.set_state(gst::State::Null).unwrap();
    assert_eq!(got, vec![0, 1, 2]);
    assert!(
        waited < Duration::from_secs(2),
        "frames were held {waited:?}"
    );
}

#[test]
fn batch_size_does_not_change_results() {
    // Batch size does not change results: the same stream at batch 1 and 7.
    let run = |batch: u32| {
        run_pipeline(&format!(
            "videotestsrc num-buffers=20 pattern=smpte ! video/x-raw,width=80,height=60 ! {} ! appsink name=sink sync=false",
            colors_element(&format!("batch-size={batch} batch-timeout=-1 top-k=6"))
        ))
        .unwrap()
    };
    let (a, b) = (run(1), run(7));
    assert_eq!((a.len(), b.len()), (20, 20));
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((x.classes.len(), y.classes.len()), (6, 6));
        for (cx, cy) in x.classes.iter().zip(&y.classes) {
            assert_eq!(cx.class_id, cy.class_id);
            assert!((cx.confidence - cy.confidence).abs() < 1e-5);
        }
    }
}
