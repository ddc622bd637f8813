// SPDX-License-Identifier: MPL-2.0
//! The element as a camera server runs it: live sources that send more frames than the
//! engine can classify (the overload policy), downstream QoS, and engines replaced while
//! playing (live model updates).
//!
//! The overload tests share a slow engine between live test sources: the test joins the
//! elements' engine instance first (`TrtClassify::instance_key`) with an engine that takes a
//! fixed time per frame, so that the engine's capacity is known on any machine.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{COLORS, index_and_result, rgb_caps, solid_rgb};
use gst::prelude::*;
use gsttrtclassify::engine::frame::FrameView;
use gsttrtclassify::engine::{Backend, Engine, EngineError, ModelInfo, Precision};
use gsttrtclassify::instance::{self, Stream};
use gsttrtclassify::meta::Classification;
use gsttrtclassify::preprocess::{Crop, InputSpec, Layout};
use gsttrtclassify::trtclassify::TrtClassify;

/// An engine that takes `per_item` for each item it runs and `per_push` for each frame it is
/// given (an upload that waits for the GPU), and scores every item as class 0.
struct SlowEngine {
    info: ModelInfo,
    cost: Cost,
    pushed: usize,
    runs: Arc<AtomicUsize>,
}

/// What a `SlowEngine`'s work takes.
#[derive(Clone, Copy)]
struct Cost {
    per_item: Duration,
    per_push: Duration,
}

/// An engine whose runs take `ms` milliseconds an item, and pushes no time.
fn per_item(ms: u64) -> Cost {
    Cost {
        per_item: Duration::from_millis(ms),
        per_push: Duration::ZERO,
    }
}

impl Engine for SlowEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn infer(&mut self, _: &[f32], _: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        Err(EngineError::Inference("not used by the element".into()))
    }

    fn push(&mut self, _: &FrameView, crops: &[Crop]) -> Result<(), EngineError> {
        std::thread::sleep(self.cost.per_push);
        self.pushed += crops.len();
        Ok(())
    }

    fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        let n = std::mem::take(&mut self.pushed);
        std::thread::sleep(self.cost.per_item * n as u32);
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(vec![vec![1.0, 0.0]; n])
    }

    fn discard(&mut self) {
        self.pushed = 0;
    }

    fn pending(&self) -> usize {
        self.pushed
    }
}

/// Joins the instance of `element` (and of every element with its settings) with a
/// `SlowEngine` of `cost`; the stream keeps it alive.
fn slow_engine(element: &gst::Element, cost: Cost) -> Stream {
    let key = element
        .downcast_ref::<TrtClassify>()
        .expect("a trtclassify")
        .instance_key()
        .expect("a key");
    let batch = key.options.batch_size;
    let runs = Arc::new(AtomicUsize::new(0));
    let (stream, _) = instance::join(key, Arc::new(|| ()), move || {
        Ok(Box::new(SlowEngine {
            info: ModelInfo {
                input: InputSpec {
                    layout: Layout::Nchw,
                    channels: 3,
                    height: 24,
                    width: 32,
                },
                num_classes: 2,
                model_batch: batch,
                outputs_probabilities: true,
                backend: Backend::Cpu,
                precision: Precision::Fp32,
                precision_note: None,
                quant_report: None,
                reads_device_frames: false,
                batches_in_flight: 1,
                non_finite: Default::default(),
                engine_file: None,
            },
            cost,
            pushed: 0,
            runs: runs.clone(),
        }))
    })
    .expect("the slow engine");
    stream
}

/// What reached a branch's appsink: each frame's number, whether it was classified, and how
/// late it came against the pipeline clock (its arrival's running time less its own).
#[derive(Debug, Clone, Copy)]
struct Arrival {
    frame: u64,
    fresh: bool,
    late: Duration,
}

/// Collects what reaches the appsink `name` of `pipeline`.
fn record(pipeline: &gst::Pipeline, name: &str) -> Arc<Mutex<Vec<Arrival>>> {
    let arrivals: Arc<Mutex<Vec<Arrival>>> = Default::default();
    let sink = common::appsink(pipeline, name);
    let (into, pipeline) = (arrivals.clone(), pipeline.downgrade());
    sink.set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                let pipeline = pipeline.upgrade().ok_or(gst::FlowError::Flushing)?;
                let now = pipeline.current_running_time().unwrap_or_default();
                let buffer = sample.buffer().expect("a buffer");
                let running_time = sample
                    .segment()
                    .and_then(|s| s.downcast_ref::<gst::ClockTime>())
                    .and_then(|s| s.to_running_time(buffer.pts()))
                    .unwrap_or_default();
                let result = Classification::from_buffer(buffer).expect("a classification");
                into.lock().unwrap().push(Arrival {
                    frame: buffer.offset(),
                    fresh: result.fresh,
                    late: Duration::from_nanos(now.saturating_sub(running_time).nseconds()),
                });
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    arrivals
}

/// `n` branches of `frames` frames each from live (or not) test sources at 30 fps into
/// elements sharing a slow engine of `cost` (properties `properties`), each into an
/// appsink `sinkN` that does not sync (so the lateness measured is the element's); the
/// pipeline, its elements' stats, and what reached each sink.
fn run_cameras(
    n: usize,
    frames: u32,
    live: bool,
    cost: Cost,
    properties: &str,
) -> (Vec<gst::Structure>, Vec<Vec<Arrival>>, Vec<gst::Message>) {
    common::init();
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let branches: Vec<String> = (0..n)
        .map(|i| {
            format!(
                "videotestsrc is-live={live} num-buffers={frames} ! \
                 video/x-raw,format=RGB,width=32,height=24,framerate=30/1 ! \
                 trtclassify name=c{i} onnx-location={} model-instance-id=live-{id} {properties} ! \
                 appsink name=sink{i} sync=false",
                common::model("colors.onnx")
            )
        })
        .collect();
    let pipeline = common::launch(&branches.join(" "));
    let _engine = slow_engine(&pipeline.by_name("c0").unwrap(), cost);
    let arrivals: Vec<_> = (0..n)
        .map(|i| record(&pipeline, &format!("sink{i}")))
        .collect();
    let qos: Vec<gst::Message> = common::play_to_eos(&pipeline)
        .into_iter()
        .filter(|m| matches!(m.view(), gst::MessageView::Qos(_)))
        .collect();
    let stats = (0..n)
        .map(|i| {
            pipeline
                .by_name(&format!("c{i}"))
                .unwrap()
                .property::<gst::Structure>("stats")
        })
        .collect();
    pipeline.set_state(gst::State::Null).unwrap();
    let arrivals = arrivals
        .iter()
        .map(|a| std::mem::take(&mut *a.lock().unwrap()))
        .collect();
    (stats, arrivals, qos)
}

fn count(stats: &gst::Structure, field: &str) -> u64 {
    stats
        .get::<u64>(field)
        .unwrap_or_else(|e| panic!("{field}: {e}"))
}

/// The latest any frame left after it was due, once the cameras run (the first second, while
/// the first frames go through CUDA's and GStreamer's first uses, is start-up), with the
/// branch and frame.
fn latest(arrivals: &[Vec<Arrival>]) -> (Duration, usize, u64) {
    arrivals
        .iter()
        .enumerate()
        .flat_map(|(i, a)| a.iter().map(move |a| (a.late, i, a.frame)))
        .filter(|&(_, _, frame)| frame >= 30)
        .max()
        .expect("frames after the first second")
}

/// Every frame of each branch reached its sink once, in order.
fn assert_every_frame_in_order(arrivals: &[Vec<Arrival>], frames: u64) {
    for (i, a) in arrivals.iter().enumerate() {
        let got: Vec<u64> = a.iter().map(|a| a.frame).collect();
        assert_eq!(got, (0..frames).collect::<Vec<_>>(), "branch {i}");
    }
}

#[test]
fn live_cameras_beyond_the_engine_stay_real_time_and_share_it() {
    // Four 30 fps cameras into an engine that classifies 25 frames a second (40 ms a frame,
    // batches of one): 4.8 times its capacity. Before the overload policy, every frame
    // waited for the engine and the last ones left seconds after they were due.
    let frames = 90;
    let (stats, arrivals, qos) = run_cameras(4, frames, true, per_item(40), "");
    assert_every_frame_in_order(&arrivals, frames.into());
    // The automatic deadline: batch-timeout (100 ms) plus a batch (40 ms), from when a
    // frame was due; scheduling on a busy machine is given a generous margin.
    let (worst, branch, frame) = latest(&arrivals);
    assert!(
        worst < Duration::from_millis(500),
        "frame {frame} of branch {branch} left {worst:?} after it was due"
    );
    let classified: Vec<u64> = stats.iter().map(|s| count(s, "classified")).collect();
    for (i, s) in stats.iter().enumerate() {
        let fresh = arrivals[i].iter().filter(|a| a.fresh).count() as u64;
        assert_eq!(classified[i], fresh, "branch {i}: stats against the frames");
        assert_eq!(count(s, "frames-in"), u64::from(frames));
        assert_eq!(count(s, "frames-out"), u64::from(frames));
        assert_eq!(
            classified[i] + count(s, "unclassified-late") + count(s, "unclassified-qos"),
            u64::from(frames),
            "branch {i}: {s}"
        );
        assert!(count(s, "unclassified-late") > 0, "branch {i}: {s}");
    }
    println!("classified per camera: {classified:?}, latest after the first second {worst:?}");
    // Every camera gets its share of the engine: none starved.
    let (least, most) = (
        *classified.iter().min().unwrap(),
        *classified.iter().max().unwrap(),
    );
    assert!(
        least >= 3 && least * 2 >= most,
        "classified per camera: {classified:?}"
    );
    // The overload is said on the bus, with the counts so far.
    let msg = qos.last().expect("a QoS message");
    let gst::MessageView::Qos(q) = msg.view() else {
        unreachable!()
    };
    let (processed, dropped) = q.stats();
    assert!(processed.value() > 0 && dropped.value() > 0, "{msg:?}");
    assert!(msg.src().unwrap().name().starts_with('c'));
}

#[test]
fn live_cameras_filling_shared_batches_stay_real_time() {
    // The same with batches of 4 filled by all four cameras, partial batches on the timer
    // and frames given up in the engine's queue: 160 ms a batch, 25 frames a second.
    let frames = 90;
    let (stats, arrivals, _) = run_cameras(
        4,
        frames,
        true,
        per_item(40),
        "batch-size=4 batch-timeout=50",
    );
    assert_every_frame_in_order(&arrivals, frames.into());
    // batch-timeout (50 ms) plus a batch (160 ms), and a margin.
    let (worst, branch, frame) = latest(&arrivals);
    assert!(
        worst < Duration::from_millis(600),
        "frame {frame} of branch {branch} left {worst:?} after it was due"
    );
    let classified: Vec<u64> = stats.iter().map(|s| count(s, "classified")).collect();
    println!("classified per camera: {classified:?}, latest after the first second {worst:?}");
    let (least, most) = (
        *classified.iter().min().unwrap(),
        *classified.iter().max().unwrap(),
    );
    assert!(
        least >= 3 && least * 2 >= most,
        "classified per camera: {classified:?}"
    );
    for (i, s) in stats.iter().enumerate() {
        assert!(count(s, "unclassified-late") > 0, "branch {i}: {s}");
    }
}

#[test]
fn frames_the_engine_took_are_classified_when_its_pushes_are_slow() {
    // 64 cameras into an engine whose pushes each take 3 ms (an upload that waits for the
    // GPU) and whose batches of up to 64 take 1 ms a frame: the pushes cap it near 300
    // frames a second, of the 1,920 sent, and a batch fills in about 200 ms. A frame the engine took must get its result, its
    // batch run in its turn: before, the partial batches waited behind new pushes, the frames
    // in them were given up at their deadline, and the engine's work on them was lost
    // (on the GPU host: 6 of the 300 frames a second it could classify).
    let frames = 90;
    let cost = Cost {
        per_item: Duration::from_millis(1),
        per_push: Duration::from_millis(3),
    };
    let (stats, arrivals, _) =
        run_cameras(64, frames, true, cost, "batch-size=64 batch-timeout=50");
    assert_every_frame_in_order(&arrivals, frames.into());
    let classified: u64 = stats.iter().map(|s| count(s, "classified")).sum();
    let batches = count(&stats[0], "batches");
    let fill = stats[0].get::<f64>("mean-batch-fill").unwrap();
    let run = (batches as f64 * fill * 64.0).round() as u64;
    println!("{classified} frames classified of {run} the engine ran");
    // Of the frames the engine ran, nearly all came back to a frame still waiting for them.
    assert!(
        classified * 10 >= run * 9,
        "{classified} frames classified of {run} the engine ran"
    );
    let (worst, branch, frame) = latest(&arrivals);
    assert!(
        worst < Duration::from_millis(700),
        "frame {frame} of branch {branch} left {worst:?} after it was due"
    );
}

#[test]
fn sources_that_are_not_live_keep_back_pressure_and_every_frame_is_classified() {
    let frames = 10;
    let (stats, arrivals, qos) = run_cameras(4, frames, false, per_item(20), "");
    assert_every_frame_in_order(&arrivals, frames.into());
    assert!(arrivals.iter().flatten().all(|a| a.fresh));
    for s in &stats {
        assert_eq!(count(s, "classified"), u64::from(frames), "{s}");
    }
    assert!(qos.is_empty(), "nothing passed on unclassified");
}

#[test]
fn max_lateness_minus_one_waits_for_every_result_of_a_live_source() {
    let frames = 12;
    let (stats, arrivals, _) = run_cameras(2, frames, true, per_item(40), "max-lateness=-1");
    assert_every_frame_in_order(&arrivals, frames.into());
    assert!(arrivals.iter().flatten().all(|a| a.fresh));
    for s in &stats {
        assert_eq!(count(s, "classified"), u64::from(frames), "{s}");
    }
}

/// A playing element with `properties`, told by downstream's QoS that frames up to 200 ms
/// of running time are late (the harness's source answers the latency query as live).
fn told_frames_are_late(properties: &str) -> gst_check::Harness {
    common::init();
    let mut h = gst_check::Harness::new_parse(&common::colors_element(properties));
    h.set_src_caps(rgb_caps(32, 24));
    h.play();
    h.push_upstream_event(gst::event::Qos::new(
        gst::QOSType::Overflow,
        1.5,
        0,
        gst::ClockTime::from_mseconds(200),
    ));
    h
}

#[test]
fn frames_downstream_reports_late_are_passed_on_unclassified() {
    let mut h = told_frames_are_late("model-instance-id=live-qos batch-size=1 max-lateness=0");
    // 40 ms a frame: frames 0 to 5 (up to 200 ms) are late, 6 and 7 are not.
    for i in 0..8 {
        let (_, rgb) = COLORS[i as usize % COLORS.len()];
        h.push(solid_rgb(32, 24, rgb, i)).unwrap();
    }
    let fresh: Vec<bool> = (0..8)
        .map(|_| index_and_result(&h.pull().unwrap()).1.fresh)
        .collect();
    assert_eq!(
        fresh,
        [false, false, false, false, false, false, true, true]
    );
    let stats = h
        .find_element("trtclassify")
        .unwrap()
        .property::<gst::Structure>("stats");
    assert_eq!(count(&stats, "unclassified-qos"), 6, "{stats}");
    assert_eq!(count(&stats, "classified"), 2, "{stats}");
    // With qos=false, the reports are not read.
    let mut h = told_frames_are_late("model-instance-id=live-qos max-lateness=0 qos=false");
    h.push(solid_rgb(32, 24, COLORS[0].1, 0)).unwrap();
    assert!(index_and_result(&h.pull().unwrap()).1.fresh);
}

/// What reached the sink of `run_with_update`: the frame, the model its result names, its
/// top label, how many classes it lists, and when it came.
type Seen = (u64, String, Option<String>, usize, std::time::Instant);

/// A live pipeline of `frames` frames at 30 fps into one element with `onnx-location` set
/// to `model` (and `extra` properties), which `change` alters after `after` frames came out;
/// what reached the sink, the element, the warnings posted and the "engine ready" progress
/// messages.
fn run_with_update(
    model: &str,
    extra: &str,
    frames: u32,
    after: usize,
    change: impl FnOnce(&gst::Element) + Send + 'static,
) -> (Vec<Seen>, gst::Element, Vec<String>, usize) {
    common::init();
    let pipeline = common::launch(&format!(
        "videotestsrc is-live=true num-buffers={frames} pattern=blue ! \
         video/x-raw,format=RGB,width=32,height=24,framerate=30/1 ! \
         trtclassify name=c onnx-location={model} {extra} ! \
         appsink name=sink sync=false"
    ));
    let element = pipeline.by_name("c").unwrap();
    let seen: Arc<Mutex<Vec<Seen>>> = Default::default();
    let change = Mutex::new(Some(change));
    {
        let (seen, element) = (seen.clone(), element.clone());
        common::appsink(&pipeline, "sink").set_callbacks(
            gst_app::AppSinkCallbacks::builder()
                .new_sample(move |sink| {
                    let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                    let (frame, result) = index_and_result(sample.buffer().unwrap());
                    let mut seen = seen.lock().unwrap();
                    seen.push((
                        frame,
                        result.model.clone(),
                        result.top().map(|c| c.label.clone()),
                        result.classes.len(),
                        std::time::Instant::now(),
                    ));
                    if seen.len() == after
                        && let Some(change) = change.lock().unwrap().take()
                    {
                        change(&element);
                    }
                    Ok(gst::FlowSuccess::Ok)
                })
                .build(),
        );
    }
    let bus = pipeline.bus().unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let (mut warnings, mut ready) = (Vec::new(), 0);
    loop {
        let msg = bus
            .timed_pop(gst::ClockTime::from_seconds(60))
            .expect("EOS within a minute");
        match msg.view() {
            gst::MessageView::Eos(_) => break,
            gst::MessageView::Error(e) => panic!("{} ({:?})", e.error(), e.debug()),
            gst::MessageView::Warning(_) => warnings.push(common::message_text(&msg)),
            gst::MessageView::Progress(p) if p.get().2 == "engine ready" => ready += 1,
            _ => (),
        }
    }
    pipeline.set_state(gst::State::Null).unwrap();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    (seen, element, warnings, ready)
}

#[test]
fn a_model_set_while_playing_takes_over_between_batches_and_no_frame_is_lost() {
    // colors.onnx, then colors_logits.onnx (the same classes, another file): before, the
    // change was refused with a warning and the old model ran on.
    let labels = format!("labels-location={}", common::model("colors.txt"));
    let (seen, element, warnings, ready) =
        run_with_update(&common::model("colors.onnx"), &labels, 60, 10, |element| {
            element.set_property("onnx-location", common::model("colors_logits.onnx"));
        });
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(ready, 2, "the engine at start, and the new one");
    let frames: Vec<u64> = seen.iter().map(|s| s.0).collect();
    assert_eq!(frames, (0..60).collect::<Vec<_>>(), "every frame, in order");
    let models: Vec<&str> = seen.iter().map(|s| s.1.as_str()).collect();
    let switch = models
        .iter()
        .position(|m| *m == "colors_logits.onnx")
        .expect("results name the new model");
    assert!(switch >= 10, "not before the change");
    assert!(models[..switch].iter().all(|m| *m == "colors.onnx"));
    assert!(
        models[switch..].iter().all(|m| *m == "colors_logits.onnx"),
        "{models:?}"
    );
    assert!(seen.iter().all(|s| s.2.as_deref() == Some("blue")));
    // No frame waited for the new engine: the stream went on at its rate.
    let longest = seen.windows(2).map(|w| w[1].4 - w[0].4).max().unwrap();
    assert!(longest < Duration::from_millis(300), "a gap of {longest:?}");
    let stats = element.property::<gst::Structure>("stats");
    assert_eq!(count(&stats, "model-updates"), 1, "{stats}");
    assert_eq!(
        stats.get::<String>("model").unwrap(),
        common::model("colors_logits.onnx")
    );
}

#[test]
fn a_model_that_fails_to_load_leaves_the_old_one_running_with_a_warning() {
    let (seen, element, warnings, _) =
        run_with_update(&common::model("colors.onnx"), "", 30, 5, |element| {
            element.set_property("onnx-location", "/nonexistent/model.onnx");
        });
    assert_eq!(seen.len(), 30);
    assert!(seen.iter().all(|s| s.1 == "colors.onnx"));
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("/nonexistent/model.onnx"),
        "{}",
        warnings[0]
    );
    assert!(
        warnings[0].contains("the running engine goes on"),
        "{}",
        warnings[0]
    );
    let stats = element.property::<gst::Structure>("stats");
    assert_eq!(count(&stats, "model-updates"), 0);
}

#[test]
fn the_same_path_set_again_loads_the_file_replaced_on_disk() {
    // A model file replaced by a retrained one (here: another model with other classes),
    // then the same onnx-location set again.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("classifier.onnx");
    std::fs::copy(common::model("colors.onnx"), &path).unwrap();
    let path_text = path.to_str().unwrap().to_owned();
    let (seen, element, warnings, ready) =
        run_with_update(&path_text, "top-k=10", 45, 5, move |element| {
            let new = path.with_extension("new");
            std::fs::copy(common::model("cnn.onnx"), &new).unwrap();
            std::fs::rename(&new, &path).unwrap();
            element.set_property("onnx-location", path.to_str().unwrap());
        });
    assert_eq!(seen.len(), 45);
    assert_eq!(ready, 2, "{warnings:?}");
    // colors.onnx scores 6 classes, cnn.onnx 10: the element tells the new model's, and
    // the results list as many classes (top-k=10) as the model of their frame scored.
    assert_eq!(element.property::<u32>("num-classes"), 10);
    let counts: Vec<usize> = seen.iter().map(|s| s.3).collect();
    let switch = counts
        .iter()
        .position(|&n| n == 10)
        .expect("the new model's results");
    assert!(switch >= 5, "{counts:?}");
    assert!(counts[..switch].iter().all(|&n| n == 6), "{counts:?}");
    assert!(counts[switch..].iter().all(|&n| n == 10), "{counts:?}");
}
