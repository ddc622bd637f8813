// SPDX-License-Identifier: MPL-2.0
//! Whole pipelines: labels and confidences from real sources, the JSON lines, the meta through
//! other elements, Python access, and start errors on the bus.

mod common;

use common::{colors_element, model, run_pipeline};
use gst::prelude::*;

/// videotestsrc patterns and the class the colour model must give them.
const PATTERNS: [(&str, &str); 5] = [
    ("red", "red"),
    ("green", "green"),
    ("blue", "blue"),
    ("white", "white"),
    ("black", "black"),
];

#[test]
fn test_patterns_get_their_colour_in_every_format() {
    for format in [
        "RGB",
        "BGRx",
        "xRGB",
        "RGBA",
        "NV12",
        "I420",
        "P010_10LE",
        "GRAY8",
    ] {
        for (pattern, label) in PATTERNS {
            // GRAY8 has no colour: only white and black are meaningful there.
            if format == "GRAY8" && !matches!(pattern, "white" | "black") {
                continue;
            }
            let results = run_pipeline(&format!(
                "videotestsrc num-buffers=3 pattern={pattern} ! video/x-raw,format={format},width=160,height=120 ! \
                 {} ! appsink name=sink sync=false",
                colors_element("batch-size=2")
            ))
            .unwrap();
            assert_eq!(
                results.len(),
                3,
                "{format} {pattern}: every frame comes out"
            );
            for (i, r) in results.iter().enumerate() {
                let top = r.top().unwrap();
                assert_eq!(top.label, label, "{format} {pattern} frame {i}: {r:?}");
                assert!(
                    top.confidence > 0.9,
                    "{format} {pattern}: confidence {}",
                    top.confidence
                );
                assert_eq!(r.frame, i as u64);
                assert!(r.fresh);
            }
        }
    }
}

/// The committed clips (`tests/clips/make.sh`: 8 red, 8 green, 8 blue frames) decoded in
/// software: compressed video in, every frame out in order with its colour. The GPU host
/// runs the same clips through NVDEC (tests/cuda.rs).
#[test]
fn decoded_clips_give_each_frame_its_colour() {
    let mut tested = Vec::new();
    for (clip, decode) in [
        ("h264.mp4", "qtdemux ! h264parse ! openh264dec"),
        ("h265.mp4", "qtdemux ! h265parse ! libde265dec"),
        ("vp9.mkv", "matroskademux ! vp9dec"),
        ("av1.mkv", "matroskademux ! av1parse ! av1dec"),
    ] {
        common::init();
        let decoder = decode.rsplit(' ').next().unwrap();
        if gst::ElementFactory::find(decoder).is_none() {
            common::skipped(&format!("{clip}: no {decoder} here"));
            continue;
        }
        let results = run_pipeline(&format!(
            "filesrc location={} ! {decode} ! {} ! appsink name=sink sync=false",
            common::clip(clip),
            colors_element("batch-size=4 top-k=1")
        ))
        .unwrap_or_else(|e| panic!("{clip}: {e}"));
        common::assert_clip_colours(clip, &results);
        tested.push(clip);
    }
    // openh264 comes with the GStreamer of every machine the tests run on.
    assert!(tested.contains(&"h264.mp4"), "{tested:?}");
}

#[test]
fn bgr_channel_order_swaps_red_and_blue() {
    let results = run_pipeline(&format!(
        "videotestsrc num-buffers=2 pattern=red ! {} ! appsink name=sink sync=false",
        colors_element("channel-order=bgr mean=<0.406,0.456,0.485> std=<0.225,0.224,0.229>")
    ))
    .unwrap();
    assert_eq!(
        results[0].top().unwrap().label,
        "blue",
        "the model sees red in the blue slot"
    );
}

#[test]
fn nhwc_fixed_batch_and_logit_models_classify_alike() {
    for (file, extra) in [
        ("colors_nhwc.onnx", "batch-size=3"),
        ("colors_b1.onnx", "batch-size=4"),
        ("colors_logits.onnx", ""),
        (
            "colors_dynamic.onnx",
            "input-width=20 input-height=12 resize-mode=letterbox",
        ),
    ] {
        let results = run_pipeline(&format!(
            "videotestsrc num-buffers=5 pattern=green ! video/x-raw,width=64,height=48 ! \
             trtclassify onnx-location={} labels-location={} {extra} ! appsink name=sink sync=false",
            model(file),
            model("colors.txt")
        ))
        .unwrap();
        assert_eq!(results.len(), 5, "{file}");
        for r in &results {
            let top = r.top().unwrap();
            assert_eq!(top.label, "green", "{file}: {r:?}");
            // colors_logits.onnx has no Softmax: softmax=auto must apply one.
            assert!(
                top.confidence > 0.9 && top.confidence <= 1.0,
                "{file}: {top:?}"
            );
            let sum: f32 = r.classes.iter().map(|c| c.confidence).sum();
            assert!(sum <= 1.0 + 1e-5, "{file}: confidences add up to {sum}");
        }
    }
}

#[test]
fn results_location_writes_one_json_line_per_frame() {
    let path =
        std::env::temp_dir().join(format!("trtclassify-results-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let results = run_pipeline(&format!(
        "videotestsrc num-buffers=6 pattern=blue ! {} ! appsink name=sink sync=false",
        colors_element(&format!(
            "interval=2 batch-size=2 top-k=3 results-location={}",
            path.display()
        ))
    ))
    .unwrap();
    assert_eq!(results.len(), 6);
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["frame"], i as u64);
        assert_eq!(
            line["pts_ns"],
            i as u64 * 1_000_000_000 / 30,
            "videotestsrc runs at 30 fps"
        );
        assert_eq!(line["fresh"], i % 2 == 0);
        assert_eq!(line["model"], "colors.onnx");
        let topk = line["topk"].as_array().unwrap();
        assert_eq!(topk.len(), 3);
        assert_eq!(topk[0]["label"], "blue");
        assert_eq!(topk[0]["class_id"], 4);
        assert!(topk[0]["confidence"].as_f64().unwrap() > 0.9);
    }
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn meta_survives_queue_tee_videoconvert_and_videoscale() {
    let results = run_pipeline(&format!(
        "videotestsrc num-buffers=4 pattern=white ! video/x-raw,format=I420 ! {} ! queue ! tee ! \
         videoconvert ! video/x-raw,format=RGBA ! videoscale ! video/x-raw,width=80,height=60 ! \
         appsink name=sink sync=false",
        colors_element("")
    ))
    .unwrap();
    assert_eq!(results.len(), 4);
    assert!(results.iter().all(|r| r.top().unwrap().label == "white"));
}

#[test]
fn start_errors_name_the_file_and_the_problem() {
    let cases = [
        (
            format!("onnx-location={}", model("missing.onnx")),
            "missing.onnx: cannot read the model: No such file",
        ),
        (
            format!("onnx-location={}", model("bad/random.bin")),
            "random.bin: not an ONNX model",
        ),
        (
            format!("onnx-location={}", model("bad/unsupported_op.onnx")),
            "FrobnicateImage",
        ),
        (
            format!(
                "onnx-location={} labels-location=/nonexistent/labels.txt",
                model("colors.onnx")
            ),
            "/nonexistent/labels.txt: cannot read the labels file",
        ),
        (
            format!("onnx-location={} backend=tensorrt", model("colors.onnx")),
            "backend=tensorrt is not available",
        ),
        (
            format!("onnx-location={} mean=<0.1,0.2>", model("colors.onnx")),
            "mean: 2 values given",
        ),
        (
            format!("onnx-location={} std=<0.1,0,0.2>", model("colors.onnx")),
            "std: 0 is not allowed",
        ),
        ("".to_owned(), "onnx-location is not set"),
        (
            format!(
                "onnx-location={} results-location=/nonexistent/dir/out.jsonl",
                model("colors.onnx")
            ),
            "/nonexistent/dir/out.jsonl: cannot open the results file",
        ),
    ];
    // Where CUDA works (the GPU host), backend=cuda starts.
    let cuda_case = gsttrtclassify::engine::cuda::unavailable_reason().map(|_| {
        (
            format!("onnx-location={} backend=cuda", model("colors.onnx")),
            "backend=cuda is not available",
        )
    });
    for (props, expected) in cases.into_iter().chain(cuda_case) {
        let err = run_pipeline(&format!(
            "videotestsrc num-buffers=2 ! trtclassify {props} ! appsink name=sink"
        ))
        .expect_err(&props);
        assert!(
            err.contains(expected),
            "{props}: expected «{expected}» in «{err}»"
        );
    }
}

#[test]
fn a_results_file_on_a_full_disk_is_one_error_naming_it() {
    // /dev/full: every write fails with ENOSPC.
    let err = run_pipeline(&format!(
        "videotestsrc num-buffers=5 ! {} ! appsink name=sink",
        colors_element("results-location=/dev/full")
    ))
    .expect_err("a full disk is an error");
    assert!(err.contains("/dev/full: cannot write results"), "{err}");
    assert!(err.contains("No space left on device"), "{err}");
}

#[test]
fn out_of_range_property_values_are_refused() {
    common::init();
    let element = gst::ElementFactory::make("trtclassify").build().unwrap();
    // GObject refuses values outside the documented range and keeps the old one.
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        element.set_property("batch-size", 0u32)
    }));
    assert!(refused.is_err(), "batch-size=0 is out of range");
    assert_eq!(element.property::<u32>("batch-size"), 1);
}

/// Runs `script` (of examples/) with Debian's Python and the plugin that cargo built beside
/// the test binary, with `args`; its standard output, or `None` (said as skipped) where that
/// Python has no GObject introspection.
fn run_python(script: &str, args: &[&str]) -> Option<String> {
    let python = std::path::Path::new("/usr/bin/python3");
    let has_gi = python.exists()
        && std::process::Command::new(python)
            .args(["-c", "import gi; gi.require_version('Gst', '1.0')"])
            .status()
            .is_ok_and(|s| s.success());
    if !has_gi {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must install python3-gi and python3-gst-1.0"
        );
        common::skipped(&format!(
            "{script}: /usr/bin/python3 lacks python3-gi/python3-gst-1.0"
        ));
        return None;
    }
    let exe = std::env::current_exe().unwrap();
    let plugin_dir = exe.parent().unwrap().parent().unwrap();
    assert!(
        plugin_dir.join("libgsttrtclassify.so").exists(),
        "no plugin in {}",
        plugin_dir.display()
    );
    let out = std::process::Command::new(python)
        .arg(script)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("GST_PLUGIN_PATH", plugin_dir)
        .env(
            "GST_REGISTRY",
            std::env::temp_dir().join(format!("trtclassify-registry-{}.bin", std::process::id())),
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(stdout)
}

#[test]
fn python_reads_the_meta_without_the_crate() {
    let Some(stdout) = run_python("examples/read_meta.py", &["green"]) else {
        return;
    };
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 5, "{stdout}");
    for (i, line) in lines.iter().enumerate() {
        assert!(
            line.starts_with(&format!("frame {i} fresh=True green 1.000")),
            "{line}"
        );
    }
}

#[test]
fn python_reads_the_stats_of_a_running_element() {
    // 22 frames in batches of 4: five full batches and a partial one of 2 at EOS.
    let Some(stdout) = run_python("examples/read_stats.py", &["22"]) else {
        return;
    };
    let fields: std::collections::HashMap<&str, &str> = stdout
        .lines()
        .filter_map(|line| line.split_once('='))
        .collect();
    let field = |name: &str| {
        *fields
            .get(name)
            .unwrap_or_else(|| panic!("no {name} in {stdout}"))
    };
    assert_eq!(field("name"), "application/x-trtclassify-stats");
    for (name, value) in [
        ("frames-in", "22"),
        ("frames-out", "22"),
        ("classified", "22"),
        ("carried", "0"),
        ("unclassified-late", "0"),
        ("unclassified-qos", "0"),
        ("batches", "6"),
        ("streams", "1"),
        ("engine-rebuilds", "0"),
        ("model-updates", "0"),
        ("backend", "cpu"),
        ("precision", "fp32"),
        ("engine", "built"),
    ] {
        assert_eq!(field(name), value, "{name} in {stdout}");
    }
    assert!(field("model").ends_with("colors.onnx"), "{stdout}");
    // 22 items in 6 batches of 4 places.
    let fill: f64 = field("mean-batch-fill").parse().unwrap();
    assert!((fill - 22.0 / 24.0).abs() < 1e-9, "{fill}");
    let p50: u64 = field("latency-p50").parse().unwrap();
    let p99: u64 = field("latency-p99").parse().unwrap();
    let ready: u64 = field("engine-ready-time").parse().unwrap();
    assert!(p50 > 0 && p50 <= p99, "{stdout}");
    assert!(ready > 0, "{stdout}");
}

#[test]
fn odd_and_tiny_frame_sizes_are_read_in_the_subsampled_formats() {
    // 4:2:0 chroma planes round up: a width or height of 1, 25 or 33 has a half chroma row or
    // column that the preprocessing must read without going past the plane.
    for format in ["NV12", "I420"] {
        for (width, height) in [(33, 25), (1, 1), (3, 2), (2, 3)] {
            let results = run_pipeline(&format!(
                "videotestsrc num-buffers=2 pattern=blue ! video/x-raw,format={format},width={width},height={height} ! \
                 {} ! appsink name=sink sync=false",
                colors_element("batch-size=2")
            ))
            .unwrap_or_else(|e| panic!("{format} {width}x{height}: {e}"));
            assert_eq!(results.len(), 2, "{format} {width}x{height}");
            for r in &results {
                let top = r.top().unwrap();
                assert_eq!(top.label, "blue", "{format} {width}x{height}: {r:?}");
            }
        }
    }
}

#[test]
fn a_results_file_that_breaks_mid_stream_is_one_error_naming_it() {
    // A FIFO whose reader leaves after the first line: later writes fail with EPIPE (the test
    // harness, like every Rust program, ignores SIGPIPE).
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("results.fifo");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            let mut line = String::new();
            std::io::BufReader::new(std::fs::File::open(fifo).unwrap())
                .read_line(&mut line)
                .unwrap();
            line
        })
    };
    // A live source: 30 frames over a second, so that most lines come after the reader left.
    let err = run_pipeline(&format!(
        "videotestsrc is-live=true num-buffers=30 pattern=red ! {} ! appsink name=sink",
        colors_element(&format!("results-location={}", fifo.display()))
    ))
    .expect_err("a broken results pipe is an error");
    let first = reader.join().unwrap();
    assert!(first.contains(r#""frame":0"#), "{first}");
    assert!(err.contains("results.fifo: cannot write results"), "{err}");
    assert!(err.contains("Broken pipe"), "{err}");
}

#[test]
fn caps_with_a_zero_size_are_never_offered() {
    // The pad templates ask for 1×1 and up, so a zero width or height never negotiates: the
    // element never sees a frame it would have to divide by zero for.
    common::init();
    let element = gst::ElementFactory::make("trtclassify").build().unwrap();
    for pad in ["sink", "src"] {
        let template = element.static_pad(pad).unwrap().pad_template_caps();
        for (width, height, fits) in [(0, 24, false), (32, 0, false), (1, 1, true)] {
            for format in ["RGB", "NV12", "I420"] {
                let caps = gst_video::VideoCapsBuilder::new()
                    .format(gst_video::VideoFormat::from_string(format))
                    .width(width)
                    .height(height)
                    .build();
                assert_eq!(
                    template.can_intersect(&caps),
                    fits,
                    "{pad} {format} {width}x{height}"
                );
            }
        }
    }
}
