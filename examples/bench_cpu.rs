// SPDX-License-Identifier: MPL-2.0
//! CPU backend benchmark: per-frame time of the engine on each model at batch 1 and 8, with
//! one thread and with all cores, and of the whole element on 224×224 RGB frames at the same
//! settings (`elem_` lines: the pipeline's time less its source's, so conversion,
//! normalisation, batching and metadata count); preprocessing cost; and the whole element's
//! frame rate at 720p and 1080p. Prints one `name value` line per figure (medians).
//!
//! cargo run --release --example bench_cpu -- RUNS MODEL.onnx...
//! cargo run --release --example bench_cpu -- RUNS --element MODEL.onnx
//! cargo run --release --example bench_cpu -- 0 --scores MODEL.onnx   (two frames' scores)
//! (bench/cpu.sh runs it beside onnxruntime and prints the comparison;
//! TRTCLASSIFY_CPU=tract measures the tract path instead.)

use std::time::Instant;

use gst::prelude::*;
use gsttrtclassify::engine::cpu::{CpuEngine, cores};
use gsttrtclassify::engine::{Engine, EngineOptions, Precision};
use gsttrtclassify::preprocess::{Crop, InputSpec, Layout, PreprocessOptions, Preprocessor};

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
    let usage = "usage: bench_cpu RUNS MODEL.onnx...";
    let runs: usize = args.next().expect(usage).parse().expect(usage);
    let mut models: Vec<String> = args.collect();
    let element = models.first().is_some_and(|m| m == "--element");
    if models.first().is_some_and(|m| m == "--scores") {
        return print_scores(&models[1]);
    }
    gst::init().unwrap();
    gsttrtclassify::plugin_register_static().unwrap();
    let tag = match std::env::var("TRTCLASSIFY_CPU").as_deref() {
        Ok("tract") => "tract",
        _ => "ours",
    };

    if element {
        models.remove(0);
        return bench_element(&models[0], runs, tag);
    }
    for model in &models {
        let name = std::path::Path::new(model)
            .file_stem()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        for threads in [1, cores()] {
            for batch in [1usize, 8] {
                let options = EngineOptions {
                    model: model.into(),
                    batch_size: batch,
                    input_size: None,
                    precision: Precision::Fp32,
                    calibration: None,
                    min_agreement: gsttrtclassify::engine::DEFAULT_MIN_AGREEMENT,
                    strict_precision: false,
                    gpu_id: 0,
                    threads,
                    engine_location: None,
                    progress: Default::default(),
                    server: Default::default(),
                    preprocess: PreprocessOptions::default(),
                };
                let mut engine = CpuEngine::build(&options).unwrap();
                let input: Vec<f32> = (0..batch * engine.info().input.frame_len())
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                for _ in 0..3 {
                    engine.infer_in_runner_layout(&input, batch).unwrap();
                }
                if std::env::var_os("PROFILE").is_some() && batch == 1 {
                    eprintln!("{threads} thread(s):");
                    print_profile(&mut engine, &input);
                }
                // Frames as the element's preprocessing writes them (channels-last for the
                // plan), so that the figure is the model's alone.
                let times: Vec<f64> = (0..runs)
                    .map(|_| {
                        time_ms(|| drop(engine.infer_in_runner_layout(&input, batch).unwrap()))
                    })
                    .collect();
                // Per frame: a batch's time over its frames.
                let ms = median(times) / batch as f64;
                println!("{tag}_{name}_t{threads}_b{batch}_ms {ms:.2}");
                drop(engine);
                // About as many frames as the engine ran, and at least 1.5 s of them.
                let frames = (runs * batch)
                    .max((1500.0 / ms) as usize)
                    .next_multiple_of(batch);
                let ms = element_ms(model, threads, batch, frames);
                println!("elem_{name}_t{threads}_b{batch}_ms {ms:.2}");
            }
        }
    }
}

/// The element's time per frame on 224×224 RGB frames at `threads` and `batch`: the
/// pipeline's, less that of the same source into `fakesink` alone, each over `frames` frames
/// after the first batch (the first run's warm-up).
fn element_ms(model: &str, threads: usize, batch: usize, frames: usize) -> f64 {
    let source = format!(
        "videotestsrc num-buffers={} pattern=ball ! \
         video/x-raw,format=RGB,width=224,height=224,framerate=30/1",
        frames + batch
    );
    let whole = ms_per_frame(
        &format!(
            "{source} ! trtclassify backend=cpu onnx-location={model} threads={threads} \
             batch-size={batch} batch-timeout=-1 ! fakesink name=sink sync=false"
        ),
        batch,
    );
    let alone = ms_per_frame(&format!("{source} ! fakesink name=sink sync=false"), batch);
    whole - alone
}

/// Milliseconds per buffer into the pipeline `description`'s `sink` after its first `batch`
/// buffers: the median of the intervals between batches over the batch size, as the engine's
/// and onnxruntime's figures are medians of their calls (a mean would count the moments a
/// shared machine's host takes the core, which a median of the others leaves out).
fn ms_per_frame(description: &str, batch: usize) -> f64 {
    let pipeline = gst::parse::launch(description)
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
    let sink = pipeline.by_name("sink").unwrap();
    // When each buffer reached the sink.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let probe = seen.clone();
    sink.static_pad("sink")
        .unwrap()
        .add_probe(gst::PadProbeType::BUFFER, move |_, _| {
            probe.lock().unwrap().push(Instant::now());
            gst::PadProbeReturn::Ok
        });
    pipeline.set_state(gst::State::Playing).unwrap();
    let bus = pipeline.bus().unwrap();
    let msg = bus
        .timed_pop_filtered(
            gst::ClockTime::NONE,
            &[gst::MessageType::Eos, gst::MessageType::Error],
        )
        .unwrap();
    if let gst::MessageView::Error(e) = msg.view() {
        panic!("{description}: {} ({:?})", e.error(), e.debug());
    }
    pipeline.set_state(gst::State::Null).unwrap();
    let seen = seen.lock().unwrap();
    let timed = seen.get(batch - 1..).filter(|t| t.len() > batch);
    let timed = timed.unwrap_or_else(|| panic!("{description}: fewer than {} buffers", 2 * batch));
    // A batch's frames leave together: the time from one batch's leaving to the next's.
    let batches = timed.iter().step_by(batch).collect::<Vec<_>>();
    let intervals = batches
        .windows(2)
        .map(|w| (*w[1] - *w[0]).as_secs_f64() * 1e3);
    median(intervals.collect()) / batch as f64
}

/// The scores of two frames of the benchmark's input pattern, one line each, for a check
/// against onnxruntime.
fn print_scores(model: &str) {
    let options = EngineOptions {
        model: model.into(),
        batch_size: 2,
        input_size: None,
        precision: Precision::Fp32,
        calibration: None,
        min_agreement: gsttrtclassify::engine::DEFAULT_MIN_AGREEMENT,
        strict_precision: false,
        gpu_id: 0,
        threads: 0,
        engine_location: None,
        progress: Default::default(),
        server: Default::default(),
        preprocess: PreprocessOptions::default(),
    };
    let mut engine = CpuEngine::build(&options).unwrap();
    let input: Vec<f32> = (0..2 * engine.info().input.frame_len())
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    for scores in engine.infer(&input, 2).unwrap() {
        let text: Vec<String> = scores.iter().map(|v| v.to_string()).collect();
        println!("{}", text.join(" "));
    }
}

/// PROFILE=1: the steps that take the most time, summed by kind, to stderr; PROFILE=steps
/// also each step, the median of 15 runs.
fn print_profile(engine: &mut CpuEngine, input: &[f32]) {
    let Some(steps) = engine.profile(input) else {
        return;
    };
    if std::env::var("PROFILE").as_deref() == Ok("steps") {
        let runs: Vec<_> = (0..15).map(|_| engine.profile(input).unwrap()).collect();
        for (i, (step, _)) in steps.iter().enumerate() {
            let ms = median(runs.iter().map(|r| r[i].1.as_secs_f64() * 1e3).collect());
            eprintln!("STEP {i:3} {ms:8.3} {step}");
        }
    }
    let mut total = std::collections::BTreeMap::<String, (f64, usize)>::new();
    for (step, time) in steps {
        // "conv 1x32x112x112 k3x3 s1 g32 -> 32 ..." summed as "conv k3x3 s1 g32".
        let words: Vec<&str> = step.split_whitespace().collect();
        let kind = match words[0] {
            "conv" => format!(
                "conv {} {} {}",
                words[2],
                words[3],
                if words[4] == "g1" { "g1" } else { "grouped" }
            ),
            "gemm" => "gemm".to_string(),
            other => format!("{other} {}", words.get(1).unwrap_or(&"")),
        };
        let entry = total.entry(kind).or_default();
        entry.0 += time.as_secs_f64() * 1e3;
        entry.1 += 1;
    }
    let mut rows: Vec<_> = total.into_iter().collect();
    rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    for (kind, (ms, n)) in rows.iter().take(12) {
        eprintln!("  {ms:8.2} ms  {n:3}x  {kind}");
    }
}

/// Preprocessing alone, then the whole element in a pipeline.
fn bench_element(model: &str, runs: usize, tag: &str) {
    // Preprocessing to 224x224 NCHW float: of a 224x224 RGB frame (the model set's element
    // input: normalisation alone), and of a 1280x720 and a 1920x1080 I420 frame.
    use gst_video::VideoFormat::{I420, Rgb};
    for (format, width, height, name) in [
        (Rgb, 224, 224, "224_rgb"),
        (I420, 1280, 720, "720p"),
        (I420, 1920, 1080, "1080p"),
    ] {
        let info = gst_video::VideoInfo::builder(format, width, height)
            .build()
            .unwrap();
        let buffer = gst::Buffer::from_mut_slice(vec![128u8; info.size()]);
        let frame =
            gst_video::VideoFrameRef::from_buffer_ref_readable(buffer.as_ref(), &info).unwrap();
        let view = gsttrtclassify::video::view(&frame).unwrap();
        let input = InputSpec {
            layout: Layout::Nchw,
            channels: 3,
            height: 224,
            width: 224,
        };
        let mut pre = Preprocessor::new(PreprocessOptions::default(), input).unwrap();
        let mut out = vec![0f32; input.frame_len()];
        pre.run(&view, &[Crop::Whole], &mut out).unwrap();
        let times: Vec<f64> = (0..runs.max(50))
            .map(|_| time_ms(|| pre.run(&view, &[Crop::Whole], &mut out).unwrap()))
            .collect();
        println!("preprocess_{name}_ms {:.3}", median(times));
    }

    // The whole element: I420 frames through trtclassify (all cores).
    for (width, height) in [(1280, 720), (1920, 1080)] {
        for batch in [1, 8] {
            let frames = 4 * runs + batch;
            let ms = ms_per_frame(
                &format!(
                    "videotestsrc num-buffers={frames} pattern=ball ! \
                     video/x-raw,format=I420,width={width},height={height} ! \
                     trtclassify onnx-location={model} batch-size={batch} batch-timeout=-1 ! \
                     fakesink name=sink sync=false"
                ),
                batch,
            );
            println!("{tag}_pipeline_{height}p_b{batch}_fps {:.1}", 1e3 / ms);
        }
    }
}
