// SPDX-License-Identifier: MPL-2.0
//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod large_model;

use std::path::PathBuf;
use std::sync::Once;

use gst::prelude::*;
use gst_video::prelude::*;
use gsttrtclassify::meta::Classification;

/// The largest absolute difference between two batches of scores, frame by frame.
pub fn largest_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(a, b)| a.iter().zip(b).map(|(a, b)| (a - b).abs()))
        .fold(0.0, f32::max)
}

/// Says a test did not run, on stderr directly: the test harness captures `println!` and
/// `eprintln!`, and a skip must show in CI's log (`.ci/run` counts these lines as skipped
/// tests).
pub fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {why}");
}

/// An error or warning message's text and debug string, for a test to search.
pub fn message_text(msg: &gst::Message) -> String {
    match msg.view() {
        gst::MessageView::Error(e) => format!("{} ({:?})", e.error(), e.debug()),
        gst::MessageView::Warning(w) => format!("{} ({:?})", w.error(), w.debug()),
        other => panic!("not an error or a warning: {other:?}"),
    }
}

/// The small transformer and hybrid exports of `models/transformers/export.py`, each with
/// its onnxruntime reference (`NAME.ref.json`) for the input of `transformer_input`.
pub const TRANSFORMERS: &[&str] = &[
    "vit",
    "swin",
    "swin_v2",
    "maxvit",
    "hybrid",
    "hybrid.dynamo",
    "swin.dynamo",
];

/// The transformer references' input: x[i] = ((i * 7919) % 1000) / 500 - 1 over NCHW
/// [2, 3, 224, 224].
pub fn transformer_input() -> Vec<f32> {
    (0..2 * 3 * 224 * 224u64)
        .map(|i| (((i * 7919) % 1000) as f64 / 500.0 - 1.0) as f32)
        .collect()
}

/// An onnxruntime reference file (`NAME.ref.json`, from `models/transformers/export.py` or
/// `bench/gpu/torch_models.py export`): the whole document, and its `output` rows, one score
/// vector per frame.
pub fn reference_json(path: &std::path::Path) -> (serde_json::Value, Vec<Vec<f32>>) {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reference {}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    let rows = json["output"]
        .as_array()
        .expect("output")
        .iter()
        .map(|row| {
            row.as_array()
                .expect("row")
                .iter()
                .map(|v| v.as_f64().expect("number") as f32)
                .collect()
        })
        .collect();
    (json, rows)
}

/// A file of little-endian f32 values (an export's `NAME.input.bin`).
pub fn read_f32(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect()
}

pub fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        gst::init().unwrap();
        gsttrtclassify::plugin_register_static().expect("the plugin registers");
    });
}

/// A file of `models/`; `TRTCLASSIFY_MODELS_DIR` moves the folder, for test binaries run on
/// another machine (the GPU host).
pub fn model(name: &str) -> String {
    repo_file("TRTCLASSIFY_MODELS_DIR", "models", name)
}

/// The repository's root: these helpers also serve the tests of the crates under `crates/`.
pub fn repo() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if here.join("models").is_dir() {
        here
    } else {
        here.join("../..")
    }
}

/// `name` in `folder` of the repository, or in the folder that `variable` names.
fn repo_file(variable: &str, folder: &str, name: &str) -> String {
    std::env::var_os(variable)
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(folder))
        .join(name)
        .to_str()
        .unwrap()
        .to_owned()
}

/// The colour classes of `models/colors.onnx`, in class order, with their RGB values.
pub const COLORS: [(&str, [u8; 3]); 6] = [
    ("black", [0, 0, 0]),
    ("white", [255, 255, 255]),
    ("red", [255, 0, 0]),
    ("green", [0, 255, 0]),
    ("blue", [0, 0, 255]),
    ("yellow", [255, 255, 0]),
];

/// The RGB value of one of `COLORS`.
pub fn rgb_of(name: &str) -> [u8; 3] {
    COLORS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no colour {name}"))
        .1
}

/// Paints the rectangle x, y, width, height of an RGB frame of `width`×`height` in `rgb`;
/// what lies outside the frame is left out.
pub fn fill_rgb(
    buffer: &mut gst::BufferRef,
    (width, height): (u32, u32),
    (x, y, w, h): (i32, i32, i32, i32),
    rgb: [u8; 3],
) {
    let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Rgb, width, height)
        .build()
        .unwrap();
    let mut frame = gst_video::VideoFrameRef::from_buffer_ref_writable(buffer, &info).unwrap();
    let stride = frame.plane_stride()[0] as usize;
    let data = frame.plane_data_mut(0).unwrap();
    for row in y.max(0)..(y + h).min(height as i32) {
        for col in x.max(0)..(x + w).min(width as i32) {
            let at = row as usize * stride + col as usize * 3;
            data[at..at + 3].copy_from_slice(&rgb);
        }
    }
}

pub fn rgb_caps(width: i32, height: i32) -> gst::Caps {
    gst_video::VideoCapsBuilder::new()
        .format(gst_video::VideoFormat::Rgb)
        .width(width)
        .height(height)
        .framerate(gst::Fraction::new(25, 1))
        .build()
}

/// A solid RGB frame, stamped with `index` as its offset and 40 ms per frame as its PTS.
pub fn solid_rgb(width: u32, height: u32, rgb: [u8; 3], index: u64) -> gst::Buffer {
    let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Rgb, width, height)
        .build()
        .unwrap();
    let mut buffer = gst::Buffer::with_size(info.size()).unwrap();
    {
        let buffer = buffer.get_mut().unwrap();
        buffer.set_pts(gst::ClockTime::from_mseconds(40 * index));
        buffer.set_duration(gst::ClockTime::from_mseconds(40));
        buffer.set_offset(index);
        let mut frame = gst_video::VideoFrameRef::from_buffer_ref_writable(buffer, &info).unwrap();
        let stride = frame.plane_stride()[0] as usize;
        let data = frame.plane_data_mut(0).unwrap();
        for row in data.chunks_mut(stride) {
            for px in row[..width as usize * 3].chunks_mut(3) {
                px.copy_from_slice(&rgb);
            }
        }
    }
    buffer
}

/// The frame index that `solid_rgb` put on a buffer, with its classification.
pub fn index_and_result(buffer: &gst::BufferRef) -> (u64, Classification) {
    let result =
        Classification::from_buffer(buffer).expect("every output buffer carries a classification");
    (buffer.offset(), result)
}

/// A pipeline from a `gst-launch` description that is known to parse.
pub fn launch(description: &str) -> gst::Pipeline {
    gst::parse::launch(description)
        .unwrap_or_else(|e| panic!("{description}: {e}"))
        .downcast::<gst::Pipeline>()
        .expect("a pipeline")
}

/// The appsink called `name` in `pipeline`.
pub fn appsink(pipeline: &gst::Pipeline, name: &str) -> gst_app::AppSink {
    pipeline
        .by_name(name)
        .unwrap_or_else(|| panic!("no element {name}"))
        .downcast::<gst_app::AppSink>()
        .expect("an appsink")
}

/// Runs a `gst-launch` style pipeline ending in `appsink name=sink` to EOS and returns the
/// classifications of all buffers, or the error message text.
pub fn run_pipeline(description: &str) -> Result<Vec<Classification>, String> {
    run_pipeline_sinks(description, &["sink"]).map(|mut sinks| sinks.remove(0).0)
}

/// What reached one appsink: the classifications of its buffers in order, and the caps they
/// came with.
pub type SinkResults = (Vec<Classification>, Option<gst::Caps>);

/// Runs a pipeline whose branches end in the appsinks `sinks` to EOS; what reached each.
pub fn run_pipeline_sinks(description: &str, sinks: &[&str]) -> Result<Vec<SinkResults>, String> {
    init();
    let pipeline = gst::parse::launch(description)
        .map_err(|e| e.to_string())?
        .downcast::<gst::Pipeline>()
        .unwrap();
    type Collected = std::sync::Arc<std::sync::Mutex<SinkResults>>;
    let collected: Vec<Collected> = sinks.iter().map(|_| Default::default()).collect();
    for (name, results) in sinks.iter().zip(&collected) {
        let results = results.clone();
        appsink(&pipeline, name).set_callbacks(
            gst_app::AppSinkCallbacks::builder()
                .new_sample(move |sink| {
                    let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                    let buffer = sample.buffer().expect("samples hold buffers");
                    let mut results = results.lock().unwrap();
                    results.0.push(
                        Classification::from_buffer(buffer).expect("buffer without classification"),
                    );
                    results.1 = sample.caps_owned();
                    Ok(gst::FlowSuccess::Ok)
                })
                .build(),
        );
    }
    let outcome = run_to_eos(&pipeline);
    let results = collected
        .iter()
        .map(|c| std::mem::take(&mut *c.lock().unwrap()))
        .collect();
    outcome.map(|_| results)
}

/// Plays `pipeline` to EOS, panicking on an error (or a minute without a message), and
/// returns the warnings and QoS messages it posted on the way; leaves it playing, so that
/// the caller can still read its elements' `stats`.
pub fn play_to_eos(pipeline: &gst::Pipeline) -> Vec<gst::Message> {
    let bus = pipeline.bus().unwrap();
    pipeline.set_state(gst::State::Playing).unwrap();
    let mut posted = Vec::new();
    loop {
        let msg = bus
            .timed_pop(gst::ClockTime::from_seconds(60))
            .expect("EOS within a minute");
        match msg.view() {
            gst::MessageView::Eos(_) => return posted,
            gst::MessageView::Error(_) => panic!("{}", message_text(&msg)),
            gst::MessageView::Warning(_) | gst::MessageView::Qos(_) => posted.push(msg.clone()),
            _ => (),
        }
    }
}

/// Plays `pipeline` until EOS (Ok) or an error (Err with the error and its debug text).
pub fn run_to_eos(pipeline: &gst::Pipeline) -> Result<(), String> {
    let bus = pipeline.bus().unwrap();
    // A failed state change leaves its reason on the bus.
    let _ = pipeline.set_state(gst::State::Playing);
    let msg = bus.timed_pop_filtered(
        gst::ClockTime::from_seconds(60),
        &[gst::MessageType::Eos, gst::MessageType::Error],
    );
    let outcome = match msg.as_ref().map(|m| m.view()) {
        None => Err("timed out waiting for EOS".to_owned()),
        Some(gst::MessageView::Error(err)) => Err(format!(
            "{} ({})",
            err.error(),
            err.debug().unwrap_or_default()
        )),
        Some(_) => Ok(()),
    };
    pipeline.set_state(gst::State::Null).unwrap();
    outcome
}

/// The backend the element and pipeline tests run on: `TRTCLASSIFY_TEST_BACKEND` (the GPU
/// host runs them with `cuda` too), else the element's default.
pub fn test_backend() -> Option<String> {
    std::env::var("TRTCLASSIFY_TEST_BACKEND")
        .ok()
        .filter(|b| !b.is_empty())
}

/// The launch-line fragment for the colour model with its labels.
///
/// Every frame waits for its result (`max-lateness=-1`): the harness's source, and the live
/// test sources of these tests, are live, and on a busy machine the overload policy would
/// pass a late frame on unclassified, where these tests check every frame's result. The
/// tests of the policy itself (live.rs) set `max-lateness` in `extra`, which comes last and
/// wins.
pub fn colors_element(extra: &str) -> String {
    let backend = test_backend()
        .map(|b| format!("backend={b}"))
        .unwrap_or_default();
    format!(
        "trtclassify onnx-location={} labels-location={} {backend} max-lateness=-1 {extra}",
        model("colors.onnx"),
        model("colors.txt")
    )
}

/// A clip of `tests/clips` (made by its `make.sh`); `TRTCLASSIFY_CLIPS_DIR` moves the folder,
/// as `TRTCLASSIFY_MODELS_DIR` does `models/`.
pub fn clip(name: &str) -> String {
    repo_file("TRTCLASSIFY_CLIPS_DIR", "tests/clips", name)
}

/// Checks the colour model's results on a clip of `tests/clips`: 24 frames, in order, the
/// first 8 red, then 8 green, then 8 blue.
pub fn assert_clip_colours(what: &str, results: &[Classification]) {
    assert_eq!(results.len(), 24, "{what}: every frame comes out");
    for (i, r) in results.iter().enumerate() {
        let want = ["red", "green", "blue"][i / 8];
        let top = r
            .top()
            .unwrap_or_else(|| panic!("{what} frame {i}: no result"));
        assert_eq!(r.frame, i as u64, "{what}: frames in order");
        assert_eq!(top.label, want, "{what} frame {i}: {r:?}");
        assert!(top.confidence > 0.9, "{what} frame {i}: {r:?}");
    }
}

/// How many scores each frame of a batch of scores holds: two batches compared by
/// `largest_difference` (or any `zip`) must have the same, since a `zip` stops at the shorter
/// list and a frame or score missing from one would pass unseen.
pub fn scores_shape(scores: &[Vec<f32>]) -> Vec<usize> {
    scores.iter().map(Vec::len).collect()
}
