// SPDX-License-Identifier: MPL-2.0
//! The element with an engine that fails on demand (on a push, on a run, or by panicking):
//! one clear element error, no panic, no hang, no frame passed on with another frame's
//! result, and the frames held at that moment named in the error. In a shared engine, a
//! fault stays with the stream it hit: the other streams get every frame with its result,
//! and an engine that failed is built again for them.
//!
//! The test joins the element's engine instance first (`TrtClassify::instance_key`), with
//! the failing engine, so that the element shares it instead of building one.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{index_and_result, rgb_caps, solid_rgb};
use gst::prelude::*;
use gsttrtclassify::engine::frame::FrameView;
use gsttrtclassify::engine::{Backend, Engine, EngineError, ModelInfo, Precision};
use gsttrtclassify::instance::{self, Stream};
use gsttrtclassify::preprocess::{Crop, InputSpec, Layout};
use gsttrtclassify::trtclassify::TrtClassify;

/// When the engine fails: each field is the 1-based number of the push or run that fails,
/// counted over the engine and the engines built again after it failed.
#[derive(Default, Clone, Copy)]
struct Script {
    /// Every push of a frame whose green byte is 255 is refused.
    refuse_marked: bool,
    refuse_push: Option<usize>,
    panic_push: Option<usize>,
    fail_run: Option<usize>,
    panic_run: Option<usize>,
    /// From this run on, every score is NaN.
    nan_from_run: Option<usize>,
    /// Why the engine runs in another precision than the one asked for.
    precision_note: Option<&'static str>,
}

/// What the scripted engine says it found where its scores first went NaN.
const NAN_FOUND: &str = "the first such values came from node `head` (step 3: gemm)";

/// Scores a frame as class `red byte` (one-hot over 256 classes), so that each output buffer
/// shows whose result it carries: frame `i` is pushed with red = `i`.
struct ScriptedEngine {
    info: ModelInfo,
    script: Script,
    counts: Arc<Counts>,
    pushed: Vec<usize>,
}

/// Pushes, runs and builds, over an instance's engines.
#[derive(Default)]
struct Counts {
    pushes: AtomicUsize,
    runs: AtomicUsize,
    builds: AtomicUsize,
}

impl Engine for ScriptedEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn infer(&mut self, _: &[f32], _: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        Err(EngineError::Inference("not used by the element".into()))
    }

    fn push(&mut self, frame: &FrameView, crops: &[Crop]) -> Result<(), EngineError> {
        assert_eq!(
            crops,
            [Crop::Whole],
            "the element classifies whole frames here"
        );
        let pushes = self.counts.pushes.fetch_add(1, Ordering::SeqCst) + 1;
        if self.script.refuse_push == Some(pushes) {
            return Err(EngineError::Inference("CUDA_ERROR_OUT_OF_MEMORY".into()));
        }
        if self.script.refuse_marked && frame.planes[0][1] == 255 {
            return Err(EngineError::Inference(
                "a frame the GPU preprocessing cannot read".into(),
            ));
        }
        if self.script.panic_push == Some(pushes) {
            panic!("index out of bounds in push");
        }
        self.pushed.push(usize::from(frame.planes[0][0]));
        Ok(())
    }

    fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        let runs = self.counts.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let pushed = std::mem::take(&mut self.pushed);
        if self.script.fail_run == Some(runs) {
            return Err(EngineError::Inference("CUDA_ERROR_LAUNCH_FAILED".into()));
        }
        if self.script.panic_run == Some(runs) {
            panic!("index out of bounds in run");
        }
        let nan = self.script.nan_from_run.is_some_and(|r| runs >= r);
        if nan {
            // As the cuda engine does: the finding is in the info before the scores leave.
            let _ = self.info.non_finite.set(NAN_FOUND.into());
        }
        Ok(pushed
            .into_iter()
            .map(|class| {
                let mut scores = vec![if nan { f32::NAN } else { 0.0 }; 256];
                scores[class] = if nan { f32::NAN } else { 1.0 };
                scores
            })
            .collect())
    }

    fn discard(&mut self) {
        self.pushed.clear();
    }

    fn pending(&self) -> usize {
        self.pushed.len()
    }
}

/// An element of batch `batch_size` sharing a `ScriptedEngine`, in a harness whose element
/// posts to `bus`; the returned stream keeps the engine alive.
struct Setup {
    h: gst_check::Harness,
    bus: gst::Bus,
    counts: Arc<Counts>,
    _engine: Stream,
}

fn setup(script: Script, properties: &str) -> Setup {
    let (mut elements, counts, engine) = setup_shared(script, properties, 1);
    let (h, bus) = elements.remove(0);
    Setup {
        h,
        bus,
        counts,
        _engine: engine,
    }
}

/// `n` elements sharing one `ScriptedEngine`, each in a harness of its own and posting to a
/// bus of its own; with the engine's counts and a stream that keeps it alive.
fn setup_shared(
    script: Script,
    properties: &str,
    n: usize,
) -> (Vec<(gst_check::Harness, gst::Bus)>, Arc<Counts>, Stream) {
    common::init();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let elements: Vec<gst::Element> = (0..n)
        .map(|_| {
            gst::parse::launch(&format!(
                "trtclassify onnx-location={} model-instance-id=failures-{id} max-lateness=-1 {} {properties}",
                common::model("colors.onnx"),
                common::test_backend()
                    .map(|b| format!("backend={b}"))
                    .unwrap_or_default()
            ))
            .unwrap()
        })
        .collect();
    let classify = elements[0].downcast_ref::<TrtClassify>().unwrap();
    let key = classify.instance_key().unwrap();
    let batch = key.options.batch_size;
    let counts = Arc::new(Counts::default());
    let built = counts.clone();
    let (engine, _) = instance::join(key, Arc::new(|| ()), move || {
        built.builds.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(ScriptedEngine {
            info: ModelInfo {
                input: InputSpec {
                    layout: Layout::Nchw,
                    channels: 3,
                    height: 24,
                    width: 32,
                },
                num_classes: 256,
                model_batch: batch,
                outputs_probabilities: true,
                backend: Backend::Cpu,
                precision: Precision::Fp32,
                precision_note: script.precision_note.map(String::from),
                quant_report: None,
                reads_device_frames: false,
                batches_in_flight: 1,
                non_finite: Default::default(),
                engine_file: None,
            },
            script,
            counts: built.clone(),
            pushed: Vec::new(),
        }))
    })
    .unwrap();
    let harnesses = elements
        .into_iter()
        .map(|element| {
            let bus = gst::Bus::new();
            element.set_bus(Some(&bus));
            let mut h = gst_check::Harness::with_element(&element, Some("sink"), Some("src"));
            h.set_src_caps(rgb_caps(32, 24));
            (h, bus)
        })
        .collect();
    (harnesses, counts, engine)
}

fn frame(i: u64) -> gst::Buffer {
    solid_rgb(32, 24, [i as u8, 0, 0], i)
}

/// The frames that came out, each checked to carry its own result.
fn pull_all(h: &mut gst_check::Harness) -> Vec<u64> {
    let mut out = Vec::new();
    while let Some(buffer) = h.try_pull() {
        let (i, result) = index_and_result(&buffer);
        assert!(result.fresh, "frame {i} is inferred");
        assert_eq!(
            result.top().map(|c| u64::from(c.class_id)),
            Some(i),
            "frame {i} carries its own result"
        );
        out.push(i);
    }
    out
}

/// The next error the element posts, waiting up to 5 s (a timer thread may post it).
fn next_error(bus: &gst::Bus) -> String {
    let msg = bus
        .timed_pop_filtered(gst::ClockTime::from_seconds(5), &[gst::MessageType::Error])
        .expect("the element posts an error");
    common::message_text(&msg)
}

fn assert_no_more_errors(bus: &gst::Bus) {
    if let Some(msg) = bus.pop_filtered(&[gst::MessageType::Error]) {
        panic!("a second error: {msg:?}");
    }
}

fn flush(h: &mut gst_check::Harness) {
    assert!(h.push_event(gst::event::FlushStart::new()));
    assert!(h.push_event(gst::event::FlushStop::new(true)));
    h.push_event(gst::event::Segment::new(&gst::FormattedSegment::<
        gst::ClockTime,
    >::new()));
}

#[test]
fn a_failed_batch_is_one_error_holds_back_its_frames_and_a_flush_recovers() {
    let mut s = setup(
        Script {
            fail_run: Some(2),
            ..Default::default()
        },
        "batch-size=4 batch-timeout=-1",
    );
    for i in 0..4 {
        assert_eq!(s.h.push(frame(i)), Ok(gst::FlowSuccess::Ok));
    }
    assert_eq!(pull_all(&mut s.h), [0, 1, 2, 3]);
    for i in 4..7 {
        assert_eq!(s.h.push(frame(i)), Ok(gst::FlowSuccess::Ok));
    }
    // The fourth frame completes the batch, which fails.
    assert_eq!(s.h.push(frame(7)), Err(gst::FlowError::Error));
    let error = next_error(&s.bus);
    assert!(error.contains("CUDA_ERROR_LAUNCH_FAILED"), "{error}");
    assert!(error.contains("colors.onnx"), "{error}");
    assert!(
        error.contains("frames 4 to 7 of this stream are held back"),
        "{error}"
    );
    // Later frames fail too, without a second error, and nothing leaves.
    assert_eq!(s.h.push(frame(8)), Err(gst::FlowError::Error));
    assert!(s.h.push_event(gst::event::Eos::new()));
    assert_eq!(pull_all(&mut s.h), Vec::<u64>::new());
    assert_no_more_errors(&s.bus);

    // A flush drops the held frames; the engine works again.
    flush(&mut s.h);
    for i in 20..24 {
        assert_eq!(s.h.push(frame(i)), Ok(gst::FlowSuccess::Ok));
    }
    assert_eq!(pull_all(&mut s.h), [20, 21, 22, 23]);
    assert_no_more_errors(&s.bus);
}

#[test]
fn a_batch_failing_on_the_timer_thread_is_an_error_and_the_next_chain_fails() {
    let mut s = setup(
        Script {
            fail_run: Some(1),
            ..Default::default()
        },
        // Long enough that the timer cannot fire between the two pushes on a busy machine.
        "batch-size=4 batch-timeout=500",
    );
    assert_eq!(s.h.push(frame(0)), Ok(gst::FlowSuccess::Ok));
    assert_eq!(s.h.push(frame(1)), Ok(gst::FlowSuccess::Ok));
    let error = next_error(&s.bus);
    assert!(error.contains("CUDA_ERROR_LAUNCH_FAILED"), "{error}");
    assert!(
        error.contains("frames 0 to 1 of this stream are held back"),
        "{error}"
    );
    assert_eq!(s.h.push(frame(2)), Err(gst::FlowError::Error));
    assert_eq!(pull_all(&mut s.h), Vec::<u64>::new());
    assert_no_more_errors(&s.bus);
}

#[test]
fn a_batch_failing_at_eos_is_an_error() {
    let mut s = setup(
        Script {
            fail_run: Some(2),
            ..Default::default()
        },
        "batch-size=4 batch-timeout=-1",
    );
    for i in 0..5 {
        assert_eq!(s.h.push(frame(i)), Ok(gst::FlowSuccess::Ok));
    }
    assert!(s.h.push_event(gst::event::Eos::new()));
    let error = next_error(&s.bus);
    assert!(
        error.contains("frame 4 of this stream is held back"),
        "{error}"
    );
    assert_eq!(pull_all(&mut s.h), [0, 1, 2, 3]);
    assert_no_more_errors(&s.bus);
}

#[test]
fn a_refused_frame_is_named_with_the_frames_queued_before_it() {
    let mut s = setup(
        Script {
            refuse_push: Some(3),
            ..Default::default()
        },
        "batch-size=4 batch-timeout=-1",
    );
    assert_eq!(s.h.push(frame(0)), Ok(gst::FlowSuccess::Ok));
    assert_eq!(s.h.push(frame(1)), Ok(gst::FlowSuccess::Ok));
    assert_eq!(s.h.push(frame(2)), Err(gst::FlowError::Error));
    let error = next_error(&s.bus);
    assert!(error.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{error}");
    assert!(
        error.contains("frame 2 could not be given to the engine, and is dropped"),
        "{error}"
    );
    assert!(
        error.contains("frames 0 to 1 of this stream are held back"),
        "{error}"
    );
    assert_eq!(pull_all(&mut s.h), Vec::<u64>::new());
    assert_no_more_errors(&s.bus);
}

#[test]
fn an_engine_that_panics_is_an_error_and_is_built_again() {
    for (script, held) in [
        (
            Script {
                panic_run: Some(1),
                ..Default::default()
            },
            "frames 0 to 1 of this stream are held back",
        ),
        (
            Script {
                panic_push: Some(2),
                ..Default::default()
            },
            "frame 1 could not be given to the engine, and is dropped",
        ),
    ] {
        let mut s = setup(script, "batch-size=2 batch-timeout=-1");
        assert_eq!(s.h.push(frame(0)), Ok(gst::FlowSuccess::Ok));
        assert_eq!(s.h.push(frame(1)), Err(gst::FlowError::Error));
        let error = next_error(&s.bus);
        assert!(error.contains("internal error in the engine"), "{error}");
        assert!(error.contains("index out of bounds"), "{error}");
        assert!(error.contains(held), "{error}");
        // The element itself did not panic: after a flush it classifies again, with an
        // engine built again in place of the one whose state the panic left unknown.
        flush(&mut s.h);
        assert_eq!(s.h.push(frame(2)), Ok(gst::FlowSuccess::Ok));
        assert_eq!(s.h.push(frame(3)), Ok(gst::FlowSuccess::Ok));
        assert_eq!(pull_all(&mut s.h), [2, 3]);
        assert_eq!(s.counts.builds.load(Ordering::SeqCst), 2);
        assert_no_more_errors(&s.bus);
    }
}

/// A frame of stream `i` marked for the engine to refuse (`Script::refuse_marked`).
fn marked_frame(i: u64) -> gst::Buffer {
    solid_rgb(32, 24, [i as u8, 255, 0], i)
}

#[test]
fn one_faulty_stream_of_three_fails_alone_and_the_others_get_every_frame() {
    // Three cameras share a batch of 4; the second one's frame 5 cannot be read by the
    // engine. Before, the refused push failed the frames the other two had in the batch,
    // and all three elements posted errors.
    let script = Script {
        refuse_marked: true,
        ..Default::default()
    };
    let (mut streams, counts, _engine) = setup_shared(script, "batch-size=4 batch-timeout=-1", 3);
    let mut faulty_refused = false;
    for i in 0..12 {
        for (n, (h, _)) in streams.iter_mut().enumerate() {
            let result = match (n, i) {
                (1, 5) => h.push(marked_frame(i)),
                _ => h.push(frame(i)),
            };
            match n {
                1 if i >= 5 => {
                    assert_eq!(result, Err(gst::FlowError::Error), "stream 1, frame {i}");
                    faulty_refused = true;
                }
                _ => assert_eq!(result, Ok(gst::FlowSuccess::Ok), "stream {n}, frame {i}"),
            }
        }
    }
    assert!(faulty_refused);
    for (h, _) in streams.iter_mut() {
        assert!(h.push_event(gst::event::Eos::new()));
    }
    let (healthy, faulty): (Vec<_>, Vec<_>) =
        streams.iter_mut().enumerate().partition(|(n, _)| *n != 1);
    for (n, (h, bus)) in healthy {
        assert_eq!(pull_all(h), (0..12).collect::<Vec<_>>(), "stream {n}");
        assert_no_more_errors(bus);
    }
    let (_, (h, bus)) = faulty.into_iter().next().unwrap();
    let error = next_error(bus);
    assert!(error.contains("cannot read"), "{error}");
    assert!(
        error.contains("frame 5 could not be given to the engine, and is dropped"),
        "{error}"
    );
    assert_no_more_errors(bus);
    // Its frames before the fault that came back leave with their results; none after.
    let out = pull_all(h);
    assert!(out.iter().all(|&i| i < 5), "{out:?}");
    assert_eq!(
        counts.builds.load(Ordering::SeqCst),
        1,
        "a refusal is no engine fault"
    );
}

#[test]
fn a_failed_batch_fails_its_streams_and_the_engine_is_built_again_for_the_others() {
    // Stream 0's batch fails on the GPU; stream 1 had no frame in it and goes on, on an
    // engine built again.
    let script = Script {
        fail_run: Some(1),
        ..Default::default()
    };
    let (mut streams, counts, _engine) = setup_shared(script, "batch-size=2 batch-timeout=-1", 2);
    let (first, second) = streams.split_at_mut(1);
    let ((h0, bus0), (h1, bus1)) = (&mut first[0], &mut second[0]);
    assert_eq!(h0.push(frame(0)), Ok(gst::FlowSuccess::Ok));
    assert_eq!(h0.push(frame(1)), Err(gst::FlowError::Error));
    let error = next_error(bus0);
    assert!(error.contains("CUDA_ERROR_LAUNCH_FAILED"), "{error}");
    for i in 0..6 {
        assert_eq!(h1.push(frame(i)), Ok(gst::FlowSuccess::Ok), "frame {i}");
    }
    assert_eq!(pull_all(h1), (0..6).collect::<Vec<_>>());
    assert_eq!(counts.builds.load(Ordering::SeqCst), 2);
    assert_no_more_errors(bus1);
    assert_no_more_errors(bus0);
}

#[test]
fn frames_of_a_working_engine_all_leave_in_order_with_their_own_results() {
    // The control: the same engine without failures passes everything through, so the
    // tests above fail for the failure and not for the set-up.
    let mut s = setup(Script::default(), "batch-size=4 batch-timeout=-1");
    for i in 0..10 {
        assert_eq!(s.h.push(frame(i)), Ok(gst::FlowSuccess::Ok));
    }
    assert!(s.h.push_event(gst::event::Eos::new()));
    assert_eq!(pull_all(&mut s.h), (0..10).collect::<Vec<_>>());
    assert_no_more_errors(&s.bus);
}

#[test]
fn scores_that_are_not_finite_are_one_warning_and_every_frame_leaves() {
    let mut s = setup(
        Script {
            nan_from_run: Some(2),
            ..Default::default()
        },
        "batch-size=4 batch-timeout=-1",
    );
    for i in 0..4 {
        assert_eq!(s.h.push(frame(i)), Ok(gst::FlowSuccess::Ok));
    }
    assert_eq!(pull_all(&mut s.h), [0, 1, 2, 3]);
    for i in 4..12 {
        assert_eq!(s.h.push(frame(i)), Ok(gst::FlowSuccess::Ok));
    }
    // Every frame leaves, with no class (NaN is never a result), and one warning says why.
    let mut out = Vec::new();
    while let Some(buffer) = s.h.try_pull() {
        let (i, result) = index_and_result(&buffer);
        assert!(result.classes.is_empty(), "frame {i}: {result:?}");
        out.push(i);
    }
    assert_eq!(out, (4..12).collect::<Vec<_>>());
    let warning = s
        .bus
        .pop_filtered(&[gst::MessageType::Warning])
        .expect("a warning");
    let text = common::message_text(&warning);
    assert!(
        text.contains("colors.onnx: the scores of frame 4 are not all finite"),
        "{text}"
    );
    assert!(text.contains(NAN_FOUND), "the engine's finding: {text}");
    assert!(
        s.bus.pop_filtered(&[gst::MessageType::Warning]).is_none(),
        "one warning, not one per frame"
    );
    assert_no_more_errors(&s.bus);
}

#[test]
fn an_engine_in_another_precision_than_asked_is_a_warning_at_start() {
    let note =
        "precision=fp16: node `conv_0` reaches 1.2e5 on sample frames; the engine runs in fp32";
    let mut s = setup(
        Script {
            precision_note: Some(note),
            ..Default::default()
        },
        "batch-size=2 batch-timeout=-1",
    );
    for i in 0..2 {
        assert_eq!(s.h.push(frame(i)), Ok(gst::FlowSuccess::Ok));
    }
    assert_eq!(pull_all(&mut s.h), [0, 1], "frames leave as usual");
    let warning = s
        .bus
        .pop_filtered(&[gst::MessageType::Warning])
        .expect("a warning");
    let text = common::message_text(&warning);
    assert!(text.contains(note), "{text}");
    assert_no_more_errors(&s.bus);
}
