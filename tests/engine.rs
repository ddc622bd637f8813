// SPDX-License-Identifier: MPL-2.0
//! The CPU engine against onnxruntime's reference outputs, and the model checks.

mod common;

use gsttrtclassify::engine::cpu::CpuEngine;
use gsttrtclassify::engine::{Engine, EngineError, EngineOptions, Precision};
use gsttrtclassify::preprocess::{Crop, Layout, PreprocessOptions};

fn options(model: &str, batch_size: usize) -> EngineOptions {
    EngineOptions {
        model: common::model(model).into(),
        batch_size,
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
    }
}

struct Reference {
    input_shape: Vec<usize>,
    input: Vec<f32>,
    output_shape: Vec<usize>,
    output: Vec<f32>,
}

fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(common::model(name)).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let floats = |key: &str| -> Vec<f32> {
        json[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect()
    };
    let dims = |key: &str| -> Vec<usize> {
        json[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect()
    };
    Reference {
        input_shape: dims("input_shape"),
        input: floats("input"),
        output_shape: dims("output_shape"),
        output: floats("output"),
    }
}

/// Runs the reference input through the engine built at `batch_size` and compares with
/// onnxruntime.
fn check_against_reference(model: &str, reference_file: &str, batch_size: usize) {
    common::init();
    let r = reference(reference_file);
    let mut engine = CpuEngine::build(&options(model, batch_size)).unwrap();
    assert_eq!(engine.info().num_classes, r.output_shape[1]);
    let n = r.input_shape[0];
    let scores = engine.infer(&r.input, n).unwrap();
    assert_eq!(scores.len(), n, "one score vector per frame");
    assert_eq!(
        r.output.len(),
        n * r.output_shape[1],
        "the reference scores every input frame"
    );
    for (i, (got, want)) in scores
        .iter()
        .zip(r.output.chunks(r.output_shape[1]))
        .enumerate()
    {
        assert_eq!(got.len(), want.len(), "frame {i}: one score per class");
        for (c, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 + 1e-4 * w.abs(),
                "{model} batch {batch_size}: frame {i} class {c}: tract {g} vs onnxruntime {w}"
            );
        }
    }
}

#[test]
fn small_cnn_matches_onnxruntime_at_every_batch_size() {
    // 3 reference frames, whatever the element's batch size.
    for batch in [1, 2, 4] {
        check_against_reference("cnn.onnx", "cnn_reference.json", batch);
    }
}

#[test]
fn colour_classifier_matches_onnxruntime() {
    check_against_reference("colors.onnx", "colors_reference.json", 2);
}

/// The operators no other committed model has (Abs, Elu, LeakyRelu, Neg, Reciprocal,
/// Softplus, Max, Min, GlobalMaxPool, GatherND) through the CPU engine's plan and kernels.
#[test]
fn rare_operators_match_onnxruntime() {
    for batch in [1, 4] {
        check_against_reference("ops_rare.onnx", "ops_rare_reference.json", batch);
    }
}

#[test]
fn vision_transformers_run_on_the_cpu_as_onnxruntime_does() {
    // torchvision's ViT, Swin v1/v2 and MaxViT, the hybrids' patterns and the dynamo
    // exporter's graphs, small (`models/transformers/export.py`), through the CPU engine.
    common::init();
    let input = common::transformer_input();
    for &name in common::TRANSFORMERS {
        let reference = common::model(&format!("transformers/{name}.ref.json"));
        let (_, wanted) = common::reference_json(reference.as_ref());
        let mut engine =
            CpuEngine::build(&options(&format!("transformers/{name}.onnx"), 2)).unwrap();
        let scores = engine.infer(&input, 2).unwrap();
        assert_eq!(
            scores.len(),
            wanted.len(),
            "{name}: one score vector per frame"
        );
        for (frame, (got, want)) in scores.iter().zip(&wanted).enumerate() {
            assert_eq!(got.len(), want.len(), "{name}: one score per class");
            for (c, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4,
                    "{name}: frame {frame} class {c}: cpu {g} vs onnxruntime {w}"
                );
            }
        }
    }
}

#[test]
fn fixed_batch_model_runs_frames_one_by_one() {
    common::init();
    let r = reference("colors_reference.json");
    let mut engine = CpuEngine::build(&options("colors_b1.onnx", 8)).unwrap();
    assert_eq!(engine.info().model_batch, 1);
    let scores = engine.infer(&r.input, 2).unwrap();
    assert_eq!(scores.len(), 2, "one score vector per frame");
    assert_eq!(scores.concat().len(), r.output.len());
    for (got, want) in scores.iter().flatten().zip(&r.output) {
        assert!((got - want).abs() < 1e-4, "{got} vs {want}");
    }
}

/// Frames pushed one by one come back in order, each with its own result, and a discard
/// forgets the frames pushed before it.
#[test]
fn pushed_frames_run_in_order_and_discard_forgets() {
    common::init();
    let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Rgb, 32, 24)
        .build()
        .unwrap();
    let buffers: Vec<gst::Buffer> = (0..9)
        .map(|i| common::solid_rgb(32, 24, common::COLORS[i % 6].1, i as u64))
        .collect();
    let frames: Vec<_> = buffers
        .iter()
        .map(|b| gst_video::VideoFrameRef::from_buffer_ref_readable(b.as_ref(), &info).unwrap())
        .collect();
    let frame = |i: usize| gsttrtclassify::video::view(&frames[i]).unwrap();
    let label = |scores: &[f32]| {
        let best = (0..scores.len())
            .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
            .unwrap();
        common::COLORS[best].0
    };
    // colors.onnx runs one frame per call; colors_b1.onnx too, as its batch is fixed at 1.
    for model in ["colors.onnx", "colors_b1.onnx"] {
        let mut engine = CpuEngine::build(&options(model, 4)).unwrap();
        engine.push(&frame(7), &[Crop::Whole]).unwrap();
        engine.push(&frame(8), &[Crop::Whole]).unwrap();
        engine.discard();
        for i in 0..6 {
            engine.push(&frame(i), &[Crop::Whole]).unwrap();
        }
        let scores = engine.run_pushed().unwrap();
        let labels: Vec<&str> = scores.iter().map(|s| label(s)).collect();
        let want: Vec<&str> = common::COLORS.iter().map(|c| c.0).collect();
        assert_eq!(labels, want, "{model}");
        assert!(engine.run_pushed().unwrap().is_empty(), "{model}: all run");
        let again = engine.classify(&[frame(2), frame(3)]).unwrap();
        assert_eq!(
            again,
            scores[2..4].to_vec(),
            "{model}: same frames, same scores"
        );
    }
}

/// Frames pushed are preprocessed straight into the CPU plan's channels-last input; the
/// same frames preprocessed in the model's NCHW layout and given to `infer` score the same,
/// bit for bit, at the model's size and resized, one frame a call and in batches.
#[test]
fn pushed_frames_score_as_the_same_frames_given_in_the_model_layout() {
    use gsttrtclassify::preprocess::Preprocessor;
    common::init();
    // Pixels that differ everywhere, in every channel: a layout mix-up changes the scores.
    let frame_of = |width: u32, height: u32, seed: usize| {
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Rgb, width, height)
            .build()
            .unwrap();
        let mut buffer = gst::Buffer::with_size(info.size()).unwrap();
        {
            let buffer = buffer.get_mut().unwrap();
            let mut frame =
                gst_video::VideoFrameRef::from_buffer_ref_writable(buffer, &info).unwrap();
            for (i, v) in frame.plane_data_mut(0).unwrap().iter_mut().enumerate() {
                *v = ((i * 7919 + seed * 104_729) % 251) as u8;
            }
        }
        (buffer, info)
    };
    let frames: Vec<_> = (0..5)
        .map(|i| match i % 2 {
            0 => frame_of(32, 32, i),
            _ => frame_of(48, 40, i),
        })
        .collect();
    let views: Vec<_> = frames
        .iter()
        .map(|(b, info)| {
            gst_video::VideoFrameRef::from_buffer_ref_readable(b.as_ref(), info).unwrap()
        })
        .collect();
    let views: Vec<_> = views
        .iter()
        .map(|f| gsttrtclassify::video::view(f).unwrap())
        .collect();
    for (model, batch) in [("cnn.onnx", 1), ("cnn.onnx", 4), ("ops.onnx", 2)] {
        let mut engine = CpuEngine::build(&options(model, batch)).unwrap();
        let input = engine.info().input;
        assert_eq!(input.layout, Layout::Nchw, "{model}");
        let mut pre = Preprocessor::new(PreprocessOptions::default(), input).unwrap();
        let mut planar = vec![0.0; views.len() * input.frame_len()];
        for (view, out) in views.iter().zip(planar.chunks_exact_mut(input.frame_len())) {
            pre.run(view, &[Crop::Whole], out).unwrap();
        }
        let want = engine.infer(&planar, views.len()).unwrap();
        for view in &views {
            engine.push(view, &[Crop::Whole]).unwrap();
        }
        let got = engine.run_pushed().unwrap();
        assert_eq!(got.len(), views.len(), "{model}, batch {batch}");
        assert_eq!(got, want, "{model}, batch {batch}");
        // The frames differ, and so do their scores: the comparison can fail.
        assert_ne!(got[0], got[1], "{model}");
    }
}

#[test]
fn layouts_are_recognised() {
    common::init();
    let nchw = CpuEngine::build(&options("colors.onnx", 1)).unwrap();
    assert_eq!(nchw.info().input.layout, Layout::Nchw);
    let nhwc = CpuEngine::build(&options("colors_nhwc.onnx", 1)).unwrap();
    assert_eq!(nhwc.info().input.layout, Layout::Nhwc);
    assert_eq!(
        (
            nhwc.info().input.height,
            nhwc.info().input.width,
            nhwc.info().input.channels
        ),
        (16, 16, 3)
    );
    assert!(
        nchw.info().outputs_probabilities,
        "colors.onnx ends in Softmax"
    );
    let logits = CpuEngine::build(&options("colors_logits.onnx", 1)).unwrap();
    assert!(!logits.info().outputs_probabilities);
}

#[test]
fn dynamic_spatial_size_needs_an_input_size() {
    common::init();
    let err = CpuEngine::build(&options("colors_dynamic.onnx", 1))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("colors_dynamic.onnx") && err.contains("set input-width and input-height"),
        "{err}"
    );
    let mut o = options("colors_dynamic.onnx", 1);
    o.input_size = Some((24, 40));
    let engine = CpuEngine::build(&o).unwrap();
    assert_eq!(
        (engine.info().input.height, engine.info().input.width),
        (24, 40)
    );
    let mut o = options("colors.onnx", 1);
    o.input_size = Some((24, 40));
    let err = CpuEngine::build(&o).err().unwrap().to_string();
    assert!(err.contains("fixes its height at 16"), "{err}");
}

/// Every bad model fails with an error that names the file and the problem.
#[test]
fn bad_models_get_clear_errors() {
    common::init();
    let cases: &[(&str, &str)] = &[
        ("bad/does_not_exist.onnx", "No such file or directory"),
        ("bad", "it is a directory"),
        ("bad/empty.onnx", "not an ONNX model: the file is empty"),
        (
            "bad/random.bin",
            "not an ONNX model: the protobuf does not decode",
        ),
        (
            "bad/truncated.onnx",
            "not an ONNX model: the protobuf does not decode",
        ),
        ("bad/two_inputs.onnx", "the model has 2 inputs"),
        (
            "bad/int_input.onnx",
            "holds int64; an image input of float32 is expected",
        ),
        (
            "bad/rank3_input.onnx",
            "(3 axes); an image input has 4 axes",
        ),
        ("bad/no_output.onnx", "the model has no output"),
        (
            "bad/unsupported_op.onnx",
            "does not support the operator(s) FrobnicateImage",
        ),
        ("bad/external_data.onnx", "external_data.weights"),
        // Found by the fuzzer: tract 0.23 panicked on it.
        (
            "bad/fuzz_undefined_output.onnx",
            "is not produced by any node",
        ),
        // Found by the fuzzer: tract 0.23 panicked on an axis beyond the tensor's rank.
        (
            "bad/flatten_axis.onnx",
            "Flatten node `flatten_0` has axis 5, but its input has 4 axes",
        ),
        // Found by the fuzzer: a 1×1 convolution padded on one side feeds an Add of widths
        // 17 and 16; tract 0.23's optimiser ran for minutes and took gigabytes on it.
        (
            "bad/fuzz_inconsistent_shapes.onnx",
            "node `add_0` (Add): its output shape",
        ),
        // Readable by no one, root included: the kernel answers EIO.
        (
            "/proc/self/mem",
            "cannot read the model: Input/output error",
        ),
        (
            "bad/huge_input.onnx",
            "the height of input `image` is 100000; at most 8192 is supported",
        ),
        (
            "bad/five_channels.onnx",
            "neither axis 1 (NCHW) nor axis 3 (NHWC) holds 1 or 3 colour channels",
        ),
    ];
    for (file, problem) in cases {
        let err = match CpuEngine::build(&options(file, 1)) {
            Ok(_) => panic!("{file} was accepted"),
            Err(err) => err,
        };
        let msg = err.to_string();
        let path = common::model(file);
        assert!(
            msg.contains(&path),
            "{file}: the error does not name the file: {msg}"
        );
        assert!(
            msg.contains(problem),
            "{file}: expected «{problem}» in «{msg}»"
        );
        if *file == "bad/unsupported_op.onnx" {
            assert!(matches!(err, EngineError::UnsupportedOps { .. }));
        }
    }
}

/// `colors.onnx` with its scores reshaped to `[N, dims...]`, saved in `dir`.
fn reshaped_colors(dir: &std::path::Path, dims: &[i64]) -> String {
    use prost::Message;
    use tract_onnx::pb;
    let path = std::path::PathBuf::from(common::model("colors.onnx"));
    let mut proto = gsttrtclassify::engine::OnnxModel::load(&path)
        .unwrap()
        .proto;
    let graph = proto.graph.as_mut().unwrap();
    let scores = graph.output[0].name.clone();
    graph.initializer.push(pb::TensorProto {
        name: "reshaped_dims".into(),
        dims: vec![dims.len() as i64 + 1],
        data_type: 7,
        int64_data: [&[-1][..], dims].concat(),
        ..Default::default()
    });
    graph.node.push(pb::NodeProto {
        name: "reshape_scores".into(),
        op_type: "Reshape".into(),
        input: vec![scores, "reshaped_dims".into()],
        output: vec!["reshaped".into()],
        ..Default::default()
    });
    graph.output[0].name = "reshaped".into();
    graph.output[0].r#type = None;
    let file = dir.join(format!("colors_{dims:?}.onnx"));
    std::fs::write(&file, proto.encode_to_vec()).unwrap();
    file.to_str().unwrap().to_owned()
}

#[test]
fn outputs_of_one_score_vector_per_image_are_read_and_others_refused() {
    common::init();
    let dir = tempfile::tempdir().unwrap();
    let r = reference("colors_reference.json");
    // [N, 6, 1, 1], as a convolutional head leaves it: the same 6 classes and scores.
    let file = reshaped_colors(dir.path(), &[6, 1, 1]);
    let mut engine = CpuEngine::build(&options(&file, 2)).unwrap();
    assert_eq!(engine.info().num_classes, 6);
    let scores = engine.infer(&r.input, 2).unwrap();
    assert_eq!(scores.concat().len(), r.output.len());
    for (got, want) in scores.iter().flatten().zip(&r.output) {
        assert!((got - want).abs() < 1e-4, "{got} vs {want}");
    }
    // [N, 2, 3] is not a score vector per image: refused, not read as 6 classes.
    let file = reshaped_colors(dir.path(), &[2, 3]);
    let err = CpuEngine::build(&options(&file, 2))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("is not one vector of class scores per image"),
        "{err}"
    );
    assert!(err.contains("colors_[2, 3].onnx"), "{err}");
}

/// A model past protobuf's 2 GiB limit, its weights in a file beside it as exporters write
/// such models: read in full, with values and an offset past 2 GiB into the file, and scored
/// exactly.
#[test]
fn a_model_with_over_2_gib_of_external_weights_runs() {
    use common::large_model;
    common::init();
    let dir = tempfile::tempdir().unwrap();
    let path = large_model::write(dir.path());
    let mut engine = CpuEngine::build(&options(path.to_str().unwrap(), 4)).unwrap();
    assert_eq!(engine.info().num_classes, large_model::CLASSES);
    let (input, tops) = large_model::images();
    let scores = engine.infer(&input, tops.len()).unwrap();
    assert_eq!(scores.len(), tops.len(), "one score vector per image");
    for (i, got) in scores.iter().enumerate() {
        assert_eq!(got, &large_model::expected_scores(i), "image {i}");
    }
}

#[test]
fn exported_families_run_on_the_cpu_plan_as_onnxruntime_does() {
    // The exports of `bench/gpu/torch_models.py export` (torchvision's CNNs and transformers,
    // the hybrids, other opsets and the dynamo exporter; 5 MB to 1.2 GB, not in the
    // repository): each must run on the compiler's plan, the path the GPU engine shares,
    // not on tract, and give onnxruntime's probabilities.
    let Some(dir) = std::env::var_os("TRTCLASSIFY_TORCHVISION_DIR") else {
        common::skipped(
            "exported_families_run_on_the_cpu_plan_as_onnxruntime_does: \
             TRTCLASSIFY_TORCHVISION_DIR is not set",
        );
        return;
    };
    common::init();
    let dir = std::path::Path::new(&dir);
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("exports folder")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".ref.json").map(str::to_owned))
        .filter(|n| {
            std::env::var("TRTCLASSIFY_MODELS").map_or(true, |only| only.split(',').any(|m| m == n))
        })
        .collect();
    names.sort();
    assert!(!names.is_empty(), "no *.ref.json in {}", dir.display());
    let mut failed = Vec::new();
    for name in &names {
        let (_, want) = common::reference_json(&dir.join(format!("{name}.ref.json")));
        let input = common::read_f32(&dir.join(format!("{name}.input.bin")));
        let mut opts = options("colors.onnx", 1);
        opts.model = dir.join(format!("{name}.onnx"));
        let mut engine = match CpuEngine::build(&opts) {
            Ok(engine) => engine,
            Err(e) => {
                failed.push(format!("{name}: {e}"));
                continue;
            }
        };
        let frame = engine.info().input.frame_len();
        if engine.profile(&input[..frame]).is_none() {
            failed.push(format!(
                "{name}: ran on tract, not on the plan (see the info log)"
            ));
            continue;
        }
        let got = engine.infer(&input, want.len()).expect("inference");
        if common::scores_shape(&got) != common::scores_shape(&want) {
            failed.push(format!(
                "{name}: scores per frame {:?}, onnxruntime's {:?}",
                common::scores_shape(&got),
                common::scores_shape(&want)
            ));
            continue;
        }
        let worst = common::largest_difference(&got, &want);
        let top1 = |s: &[f32]| {
            (0..s.len())
                .max_by(|&a, &b| s[a].total_cmp(&s[b]))
                .expect("classes")
        };
        let same_top1 = got
            .iter()
            .zip(&want)
            .filter(|(g, w)| top1(g) == top1(w))
            .count();
        eprintln!(
            "{name}: largest probability error {worst:.2e}, top-1 {same_top1}/{}",
            want.len()
        );
        if worst > 1e-3 || same_top1 != want.len() {
            failed.push(format!(
                "{name}: largest error {worst:.2e} (at most 1e-3), top-1 {same_top1}/{}",
                want.len()
            ));
        }
        // The frames in one call on one thread: the plan's last steps run on all of them at
        // once (where they can be cut out), to the scores of one frame at a time.
        opts.batch_size = want.len();
        opts.threads = 1;
        let mut engine = CpuEngine::build(&opts).expect("built once already");
        let together = engine.infer(&input, want.len()).expect("inference");
        if common::scores_shape(&together) != common::scores_shape(&got) {
            failed.push(format!(
                "{name}: scores per frame in one call {:?}, apart {:?}",
                common::scores_shape(&together),
                common::scores_shape(&got)
            ));
            continue;
        }
        let apart = common::largest_difference(&together, &got);
        let tail = engine
            .batched_tail()
            .map_or("none".into(), |(steps, frames)| {
                format!("{steps} steps on {frames} frames")
            });
        eprintln!(
            "{name}: {} frames in one call on one thread (batched tail: {tail}): largest \
             difference {apart:.2e}",
            want.len()
        );
        if apart > 1e-5 {
            failed.push(format!(
                "{name}: {} frames in one call differ from them apart by {apart:.2e} (at most 1e-5)",
                want.len()
            ));
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

/// Runs `pipeline` (a `gst-launch` description) to its end.
fn run_to_eos(description: &str) {
    use gst::prelude::*;
    let pipeline = common::launch(description);
    pipeline.set_state(gst::State::Playing).expect("playing");
    let bus = pipeline.bus().expect("a bus");
    for msg in bus.iter_timed(gst::ClockTime::from_seconds(30)) {
        match msg.view() {
            gst::MessageView::Eos(..) => break,
            gst::MessageView::Error(e) => panic!("{description}: {}", e.error()),
            _ => {}
        }
    }
    pipeline.set_state(gst::State::Null).expect("stopped");
}

/// `trtclassify-engine calibrate` decodes a folder of images and a video with GStreamer, runs
/// the digits classifier over at most `--frames` of them and writes the table of its two
/// quantizable convolutions; a missing source is named.
#[test]
fn trtclassify_engine_calibrate_writes_the_table() {
    use gsttrtclassify::engine::compiler::quant::{CalibrationTable, HeldOut};
    // A cross build's tests run under qemu through cargo's runner (scripts/aarch64.sh), and
    // the kernel cannot start the arm64 program they would spawn (no binfmt_misc there).
    if cfg!(target_arch = "aarch64")
        && std::env::var_os("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER").is_some()
    {
        common::skipped(
            "trtclassify_engine_calibrate_writes_the_table: under qemu, no arm64 program starts",
        );
        return;
    }
    common::init();
    let dir = tempfile::tempdir().expect("a temporary folder");
    let images = dir.path().join("images");
    std::fs::create_dir(&images).expect("a folder");
    run_to_eos(&format!(
        "videotestsrc num-buffers=3 pattern=ball ! video/x-raw,width=64,height=48 ! pngenc ! \
         multifilesink location={}/frame%02d.png",
        images.display()
    ));
    let video = dir.path().join("clip.mkv");
    run_to_eos(&format!(
        "videotestsrc num-buffers=30 pattern=smpte ! video/x-raw,format=I420,width=64,height=48 ! \
         matroskamux ! filesink location={}",
        video.display()
    ));
    let table = dir.path().join("digits.calibration.txt");
    let calibrate = |sources: &[&std::path::Path], frames: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_trtclassify-engine"))
            .arg("calibrate")
            .arg(common::model("digits/digits.onnx"))
            .args(sources)
            .args(["--frames", frames, "--table"])
            .arg(&table)
            .output()
            .expect("trtclassify-engine runs")
    };
    // Three images, then 8 of the video's 30 frames: every eighth frame is held out.
    let out = calibrate(&[&images, &video], "10");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written = CalibrationTable::load(&table).expect("the table reads back");
    assert_eq!(written.frames, 10);
    assert_eq!(written.nodes.keys().collect::<Vec<_>>(), ["conv2", "conv3"]);
    for (name, range) in &written.nodes {
        assert!(
            range.amax > 0.0 && range.int8 <= range.amax,
            "{name}: {range:?}"
        );
        assert!(stdout.contains(&format!("| {name} | ")), "{stdout}");
    }
    assert!(
        stdout.contains("2 quantizable nodes calibrated on 10 frames")
            && stdout.contains("1 held-out frames"),
        "{stdout}"
    );
    let held = HeldOut::load(&HeldOut::beside(&table)).expect("the held-out frames read back");
    assert_eq!(
        (held.frames(), held.classes, held.frame_len),
        (1, 10, 3 * 32 * 32)
    );
    let sum: f32 = held.scores.iter().sum();
    assert!(
        (sum - 1.0).abs() < 1e-4,
        "the digits' scores are probabilities: {sum}"
    );

    let missing = dir.path().join("no-such.png");
    let out = calibrate(&[&missing], "10");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("no-such.png"), "{stderr}");
}

/// The element's `calibration-location` may name frames instead of a table: the table is
/// made from them once, kept in the cache folder under a digest of the model, the frames and
/// the preprocessing, and found there the next time; a table, or a precision that is not
/// quantized, is left as it is; a changed frame file makes another table; a missing source
/// is named.
#[test]
fn calibration_from_frames_is_made_once_and_kept_in_the_cache() {
    use gsttrtclassify::calibrate::with_table;
    use gsttrtclassify::engine::compiler::quant::{CalibrationTable, HeldOut};
    common::init();
    let dir = tempfile::tempdir().expect("a temporary folder");
    let cache = dir.path().join("cache");
    // Theora in Ogg: gst-plugins-base's, which the aarch64 run under qemu has too.
    let video = dir.path().join("clip.ogv");
    let clip = |frames: u32| {
        run_to_eos(&format!(
            "videotestsrc num-buffers={frames} pattern=smpte ! \
             video/x-raw,format=I420,width=64,height=48 ! theoraenc ! oggmux ! \
             filesink location={}",
            video.display()
        ))
    };
    clip(20);
    let mut o = options("digits/digits.onnx", 1);
    o.precision = Precision::Int8;
    o.calibration = Some(video.clone());
    let mut heard = Vec::new();
    let made = with_table(&o, &cache, 256, &mut |m| heard.push(m.to_owned())).expect("calibrated");
    let table = made.calibration.clone().expect("a table");
    assert_eq!(table.parent(), Some(cache.as_path()), "{}", table.display());
    assert!(
        heard
            .iter()
            .any(|m| m.contains("calibrating on up to 256 frames")),
        "{heard:?}"
    );
    let written = CalibrationTable::load(&table).expect("the table reads back");
    // 20 frames: every eighth (the 8th and 16th) held out for the accuracy guard.
    assert_eq!(written.frames, 18);
    assert_eq!(written.nodes.keys().collect::<Vec<_>>(), ["conv2", "conv3"]);
    let held = HeldOut::load(&HeldOut::beside(&table)).expect("the held-out frames");
    assert_eq!(held.frames(), 2);
    let names = |dir: &std::path::Path| {
        let mut n: Vec<String> = std::fs::read_dir(dir)
            .expect("the cache folder")
            .map(|e| {
                e.expect("an entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        n.sort();
        n
    };
    assert_eq!(
        names(&cache).len(),
        2,
        "the table and its held-out frames only"
    );

    // Again: found, not made.
    heard.clear();
    let again = with_table(&o, &cache, 256, &mut |m| heard.push(m.to_owned())).expect("found");
    assert_eq!(again.calibration.as_deref(), Some(table.as_path()));
    assert!(heard.is_empty(), "{heard:?}");
    // A table, or fp16, is left as it is.
    let mut given = o.clone();
    given.calibration = Some(table.clone());
    let kept = with_table(&given, &cache, 256, &mut |_| {}).expect("a table");
    assert_eq!(kept.calibration.as_deref(), Some(table.as_path()));
    let mut fp16 = o.clone();
    fp16.precision = Precision::Fp16;
    let kept = with_table(&fp16, &cache, 256, &mut |_| {}).expect("fp16");
    assert_eq!(kept.calibration.as_deref(), Some(video.as_path()));

    // Other frames in the same file: another table.
    clip(12);
    let other = with_table(&o, &cache, 256, &mut |_| {}).expect("calibrated again");
    let other = other.calibration.expect("a table");
    assert_ne!(other, table);
    assert_eq!(CalibrationTable::load(&other).expect("reads").frames, 11);

    // A damaged table is left for the table's reader to name, not decoded as frames.
    let damaged = dir.path().join("damaged.txt");
    std::fs::write(&damaged, "not a table\n").expect("written");
    let mut given = o.clone();
    given.calibration = Some(damaged.clone());
    let kept = with_table(&given, &cache, 256, &mut |_| {}).expect("left as it is");
    assert_eq!(kept.calibration.as_deref(), Some(damaged.as_path()));

    let mut missing = o.clone();
    missing.calibration = Some(dir.path().join("no-such-folder"));
    let err = with_table(&missing, &cache, 256, &mut |_| {}).expect_err("a missing source");
    assert!(err.contains("no-such-folder"), "{err}");
}

/// An int8 engine without `calibration-location` calibrates on the stream: the plan is fp16
/// meanwhile and one calibration that every stream of the model shares; frames offered while
/// it is busy are skipped; the table lands in the cache, where the next start finds it; a
/// backend that runs f32, another precision or a table given needs none; another frame count
/// makes another table.
#[test]
fn calibration_on_the_stream_is_shared_kept_and_found() {
    use gsttrtclassify::engine::compiler::quant::{CalibrationTable, HeldOut};
    use gsttrtclassify::engine::frame::FrameView;
    use gsttrtclassify::engine::{Backend, OnnxModel};
    use gsttrtclassify::stream_calibration::{Plan, meanwhile, plan};
    common::init();
    let dir = tempfile::tempdir().expect("a temporary folder");
    let cache = dir.path().join("cache");
    let mut o = options("digits/digits.onnx", 1);
    o.precision = Precision::Int8;
    for backend in [Backend::Cpu, Backend::Kserve] {
        assert!(plan(&o, backend, 16, &cache).expect("a plan").is_none());
    }
    let fp16 = EngineOptions {
        precision: Precision::Fp16,
        ..o.clone()
    };
    assert!(
        plan(&fp16, Backend::Cuda, 16, &cache)
            .expect("a plan")
            .is_none()
    );
    let given = EngineOptions {
        calibration: Some(dir.path().join("table.txt")),
        ..o.clone()
    };
    assert!(
        plan(&given, Backend::Cuda, 16, &cache)
            .expect("a plan")
            .is_none()
    );

    let Some(Plan::Calibrate(first)) = plan(&o, Backend::Cuda, 16, &cache).expect("a plan") else {
        panic!("no table yet: a calibration");
    };
    let Some(Plan::Calibrate(second)) = plan(&o, Backend::Cuda, 16, &cache).expect("a plan") else {
        panic!("the running calibration");
    };
    assert!(std::sync::Arc::ptr_eq(&first, &second), "one calibration");
    assert_eq!(meanwhile(&o).precision, Precision::Fp16);
    assert_eq!(first.table().parent(), Some(cache.as_path()));

    // Frames as a stream brings them, as fast as they come: each a different picture.
    let input = OnnxModel::load(&o.model)
        .expect("the model")
        .input_spec(None)
        .expect("its input");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let (mut offered, mut taken) = (0, 0);
    while first.outcome().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "calibrated within 2 minutes"
        );
        let rgb: Vec<u8> = (0..32 * 32 * 3)
            .map(|i| ((i * 7 + offered * 31) % 256) as u8)
            .collect();
        taken += usize::from(first.wants_frame());
        first
            .offer(&FrameView::rgb(32, 32, &rgb), Crop::Whole, input)
            .expect("offered");
        offered += 1;
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    let summary = first.outcome().expect("ended").clone().expect("calibrated");
    assert!(summary.contains("on 16 frames of the stream"), "{summary}");
    // 16 frames in the table and every eighth (the 8th and 16th seen) held out.
    let table = first.table().to_path_buf();
    let written = CalibrationTable::load(&table).expect("the table reads back");
    assert_eq!(written.frames, 16);
    assert_eq!(written.nodes.keys().collect::<Vec<_>>(), ["conv2", "conv3"]);
    assert_eq!(
        HeldOut::load(&HeldOut::beside(&table))
            .expect("held out")
            .frames(),
        2
    );
    assert!(taken >= 18, "{taken} frames taken of {offered}");
    assert!(!first.wants_frame(), "done: no more frames");

    // The next start finds it; another frame count is another calibration.
    match plan(&o, Backend::Cuda, 16, &cache).expect("a plan") {
        Some(Plan::Table(found)) => assert_eq!(found, table),
        _ => panic!("the table in the cache"),
    }
    let Some(Plan::Calibrate(other)) = plan(&o, Backend::Cuda, 24, &cache).expect("a plan") else {
        panic!("24 frames: another calibration");
    };
    assert_ne!(other.table(), table);
}
