// SPDX-License-Identifier: MPL-2.0
//! CPU backend benchmark: engine latency and throughput on a model, preprocessing cost, and a
//! whole pipeline's frame rate. Prints one `name value` line per figure (medians).
//!
//! cargo run --release --example bench_cpu -- MODEL.onnx [RUNS]
//! (bench/cpu.sh runs it beside onnxruntime and prints the comparison.)

use std::time::Instant;

use gst::prelude::*;
use gsttrtclassify::engine::cpu::CpuEngine;
use gsttrtclassify::engine::{Engine, EngineOptions, Precision};
use gsttrtclassify::preprocess::{Crop, PreprocessOptions, Preprocessor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time_ms(mut f: impl FnMut()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e3
}

fn main() {
    let mut args = std::env::args().skip(1);
    let model = args.next().expect("usage: bench_cpu MODEL.onnx [RUNS]");
    let runs: usize = args.next().map(|r| r.parse().unwrap()).unwrap_or(30);
    gst::init().unwrap();
    gsttrtclassify::plugin_register_static().unwrap();

    for batch in [1usize, 8] {
        let options = EngineOptions {
            model: model.clone().into(),
            batch_size: batch,
            input_size: None,
            precision: Precision::Fp32,
            gpu_id: 0,
            engine_location: None,
            progress: Default::default(),
            preprocess: PreprocessOptions::default(),
        };
        let mut engine = CpuEngine::build(&options).unwrap();
        let input: Vec<f32> = (0..batch * engine.info().input.frame_len())
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        for _ in 0..3 {
            engine.infer(&input, batch).unwrap();
        }
        let times: Vec<f64> = (0..runs)
            .map(|_| time_ms(|| drop(engine.infer(&input, batch).unwrap())))
            .collect();
        let ms = median(times);
        println!("tract_b{batch}_ms {ms:.2}");
        println!("tract_b{batch}_img_s {:.1}", batch as f64 * 1e3 / ms);
    }

    // Preprocessing of a 1280x720 I420 frame to 224x224 NCHW float.
    let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::I420, 1280, 720)
        .build()
        .unwrap();
    let buffer = gst::Buffer::from_mut_slice(vec![128u8; info.size()]);
    let frame = gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), &info).unwrap();
    let input = gsttrtclassify::preprocess::InputSpec {
        layout: gsttrtclassify::preprocess::Layout::Nchw,
        channels: 3,
        height: 224,
        width: 224,
    };
    let mut pre = Preprocessor::new(PreprocessOptions::default(), input).unwrap();
    let mut out = vec![0f32; input.frame_len()];
    pre.run(&frame, &[Crop::Whole], &mut out).unwrap();
    let times: Vec<f64> = (0..runs.max(50))
        .map(|_| time_ms(|| pre.run(&frame, &[Crop::Whole], &mut out).unwrap()))
        .collect();
    println!("preprocess_720p_ms {:.2}", median(times));

    // The whole element: 720p I420 frames through trtclassify, batch 1 and 8.
    for batch in [1, 8] {
        let frames = 4 * runs;
        let pipeline = gst::parse::launch(&format!(
            "videotestsrc num-buffers={frames} pattern=ball ! video/x-raw,format=I420,width=1280,height=720 ! \
             trtclassify onnx-location={model} batch-size={batch} batch-timeout=-1 ! fakesink name=sink sync=false"
        ))
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
        pipeline.set_state(gst::State::Paused).unwrap();
        let bus = pipeline.bus().unwrap();
        // Engine build happens in start(); time only the streaming.
        bus.timed_pop_filtered(
            gst::ClockTime::NONE,
            &[gst::MessageType::AsyncDone, gst::MessageType::Error],
        );
        let t = Instant::now();
        pipeline.set_state(gst::State::Playing).unwrap();
        let msg = bus
            .timed_pop_filtered(
                gst::ClockTime::NONE,
                &[gst::MessageType::Eos, gst::MessageType::Error],
            )
            .unwrap();
        assert!(matches!(msg.view(), gst::MessageView::Eos(_)), "{msg:?}");
        let secs = t.elapsed().as_secs_f64();
        pipeline.set_state(gst::State::Null).unwrap();
        println!("pipeline_720p_b{batch}_fps {:.1}", frames as f64 / secs);
    }
}
