// SPDX-License-Identifier: MPL-2.0
//! The element with an engine that fails on demand (on a push, on a run, or by panicking):
//! one clear element error, no panic, no hang, no frame passed on with another frame's
//! result, and the frames held at that moment named in the error.
//!
//! The test joins the element's engine instance first (`TrtClassify::instance_key`), with
//! the failing engine, so that the element shares it instead of building one.

mod common;

use std::sync::Arc;

use common::{index_and_result, rgb_caps, solid_rgb};
use gst::prelude::*;
use gsttrtclassify::engine::{Backend, Engine, EngineError, ModelInfo, Precision};
use gsttrtclassify::instance::{self, Stream};
use gsttrtclassify::preprocess::{Crop, InputSpec, Layout};
use gsttrtclassify::trtclassify::TrtClassify;

/// When the engine fails: each field is the 1-based number of the push or run that fails.
#[derive(Default, Clone, Copy)]
struct Script {
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
    pushes: usize,
    runs: usize,
    pushed: Vec<usize>,
}

impl Engine for ScriptedEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn infer(&mut self, _: &[f32], _: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        Err(EngineError::Inference("not used by the element".into()))
    }

    fn push(
        &mut self,
        frame: &gst_video::VideoFrameRef<&gst::BufferRef>,
        crops: &[Crop],
    ) -> Result<(), EngineError> {
        assert_eq!(
            crops,
            [Crop::Whole],
            "the element classifies whole frames here"
        );
        self.pushes += 1;
        if self.script.refuse_push == Some(self.pushes) {
            return Err(EngineError::Inference("CUDA_ERROR_OUT_OF_MEMORY".into()));
        }
        if self.script.panic_push == Some(self.pushes) {
            panic!("index out of bounds in push");
        }
        self.pushed
            .push(usize::from(frame.plane_data(0).unwrap()[0]));
        Ok(())
    }

    fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        self.runs += 1;
        let pushed = std::mem::take(&mut self.pushed);
        if self.script.fail_run == Some(self.runs) {
            return Err(EngineError::Inference("CUDA_ERROR_LAUNCH_FAILED".into()));
        }
        if self.script.panic_run == Some(self.runs) {
            panic!("index out of bounds in run");
        }
        let nan = self.script.nan_from_run.is_some_and(|r| self.runs >= r);
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
}

/// An element of batch `batch_size` sharing a `ScriptedEngine`, in a harness whose element
/// posts to `bus`; the returned stream keeps the engine alive.
struct Setup {
    h: gst_check::Harness,
    bus: gst::Bus,
    _engine: Stream,
}

fn setup(script: Script, properties: &str) -> Setup {
    common::init();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let element = gst::parse::launch(&format!(
        "trtclassify onnx-location={} model-instance-id=failures-{id} {properties}",
        common::model("colors.onnx")
    ))
    .unwrap();
    let classify = element.downcast_ref::<TrtClassify>().unwrap();
    let key = classify.instance_key().unwrap();
    let batch = key.options.batch_size;
    let (engine, _) = instance::join(key, Arc::new(|| ()), || {
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
                reads_device_frames: false,
                non_finite: Default::default(),
            },
            script,
            pushes: 0,
            runs: 0,
            pushed: Vec::new(),
        }))
    })
    .unwrap();
    let bus = gst::Bus::new();
    element.set_bus(Some(&bus));
    let mut h = gst_check::Harness::with_element(&element, Some("sink"), Some("src"));
    h.set_src_caps(rgb_caps(32, 24));
    Setup {
        h,
        bus,
        _engine: engine,
    }
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
fn an_engine_that_panics_is_an_error_and_is_not_called_again() {
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
        // The element itself did not panic: after a flush it answers again, with an error
        // from the engine it no longer calls.
        flush(&mut s.h);
        assert_eq!(s.h.push(frame(2)), Err(gst::FlowError::Error));
        let error = next_error(&s.bus);
        assert!(error.contains("not used again"), "{error}");
        assert_eq!(pull_all(&mut s.h), Vec::<u64>::new());
        assert_no_more_errors(&s.bus);
    }
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
