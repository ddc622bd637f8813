// SPDX-License-Identifier: MPL-2.0
//! `backend=kserve` against a real KServe v2 server on loopback: Seldon MLServer (from PyPI,
//! in the virtual environment the README's install line makes) running the repository's
//! models with onnxruntime (`tests/kserve/onnx_runtime.py`). Without MLServer the tests say
//! SKIPPED. `TRTCLASSIFY_MLSERVER` names another `mlserver` executable.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gst::prelude::*;
use gsttrtclassify::meta::Classification;

/// The `mlserver` executable, where it is installed.
fn mlserver() -> Option<PathBuf> {
    let path = match std::env::var_os("TRTCLASSIFY_MLSERVER") {
        Some(path) => PathBuf::from(path),
        None => PathBuf::from(std::env::var_os("HOME")?)
            .join(".local/share/trtclassify/mlserver/bin/mlserver"),
    };
    path.exists().then_some(path)
}

/// A loopback port nothing listens on, below Linux's ephemeral range (32768 on): a port the
/// kernel hands out for port 0 comes from that range, where client connections take their
/// own too, and one was seen to take a server's port between this test choosing it and
/// MLServer binding it. Each call of the process tries other ports than the calls before.
fn free_port() -> u16 {
    static CALLS: AtomicU32 = AtomicU32::new(0);
    let seed = std::process::id()
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
    for _ in 0..100 {
        // 7919 is prime to 12,000: 12,000 calls in a row name 12,000 different ports.
        let call = CALLS.fetch_add(1, Ordering::Relaxed);
        let port = 20_000 + (seed.wrapping_add(call.wrapping_mul(7919)) % 12_000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A model as the server declares it.
struct Served {
    name: &'static str,
    onnx: &'static str,
    input: (&'static str, &'static [i64]),
    output: (&'static str, &'static [i64]),
    /// The datatype the server declares for the input.
    input_type: &'static str,
    /// How late the answers after the first `fast_requests` come.
    delay_ms: u32,
    fast_requests: u32,
    /// Where the runtime keeps its record (`onnx_runtime.py`).
    record_file: Option<PathBuf>,
    /// While this file exists, the runtime fails every request.
    fail_file: Option<PathBuf>,
}

/// The colour model, as it is.
fn colors() -> Served {
    Served {
        name: "colors",
        onnx: "colors.onnx",
        input: ("image", &[-1, 3, 16, 16]),
        output: ("scores", &[-1, 6]),
        input_type: "FP32",
        delay_ms: 0,
        fast_requests: 0,
        record_file: None,
        fail_file: None,
    }
}

/// An MLServer on loopback, killed when dropped.
struct Server {
    child: Option<Child>,
    dir: tempfile::TempDir,
    grpc: u16,
    http: u16,
}

impl Server {
    /// Starts MLServer with `models`; `None` (and a SKIPPED line) where it is not installed.
    fn start(test: &str, models: &[Served]) -> Option<Self> {
        let Some(_) = mlserver() else {
            common::skipped(&format!(
                "{test}: no MLServer (the README's install line puts it in ~/.local/share/trtclassify/mlserver)"
            ));
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        for model in models {
            let folder = dir.path().join("models").join(model.name);
            std::fs::create_dir_all(&folder).unwrap();
            std::fs::copy(common::model(model.onnx), folder.join("model.onnx")).unwrap();
            std::fs::copy(
                runtime_file("onnx_runtime.py"),
                folder.join("onnx_runtime.py"),
            )
            .unwrap();
            let tensor = |(name, shape): (&str, &[i64]), datatype: &str| serde_json::json!({"name": name, "datatype": datatype, "shape": shape});
            let settings = serde_json::json!({
                "name": model.name,
                "implementation": "onnx_runtime.OnnxModel",
                "parameters": {"uri": "./model.onnx", "extra": {
                    "delay_ms": model.delay_ms,
                    "fast_requests": model.fast_requests,
                    "record_file": model.record_file,
                    "fail_file": model.fail_file,
                }},
                "inputs": [tensor(model.input, model.input_type)],
                "outputs": [tensor(model.output, "FP32")],
            });
            std::fs::write(folder.join("model-settings.json"), settings.to_string()).unwrap();
        }
        let mut server = Self {
            child: None,
            dir,
            grpc: 0,
            http: 0,
        };
        // A port taken by another process between its choice and the server's bind means
        // other ports, not a failed test.
        for _ in 0..3 {
            let (grpc, http, metrics) = (free_port(), free_port(), free_port());
            let settings = serde_json::json!({
                "host": "127.0.0.1", "http_port": http, "grpc_port": grpc, "metrics_port": metrics,
                // Inference in the server's own process: MLServer 1.7's worker processes fail
                // to start with uvloop 0.22 (SeldonIO/MLServer#2286).
                "parallel_workers": 0,
                "grpc_max_message_length": 64 << 20,
            });
            let path = server.dir.path().join("settings.json");
            std::fs::write(path, settings.to_string()).unwrap();
            (server.grpc, server.http) = (grpc, http);
            if server.try_run(models[0].name) {
                return Some(server);
            }
            server.kill();
        }
        panic!("MLServer found each of three sets of ports taken");
    }

    /// Starts (again) the server process, and waits until `model` is ready.
    fn run(&mut self, model: &str) {
        assert!(self.try_run(model), "MLServer found its ports taken");
    }

    /// `run`, or false where the server could not bind a port it was given.
    fn try_run(&mut self, model: &str) -> bool {
        let log = std::fs::File::create(self.dir.path().join("log.txt")).unwrap();
        let child = Command::new(mlserver().unwrap())
            .arg("start")
            .arg(self.dir.path())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("mlserver starts");
        self.child = Some(child);
        let started = Instant::now();
        while !self.ready(model) {
            let log = std::fs::read_to_string(self.dir.path().join("log.txt"));
            if log
                .as_ref()
                .is_ok_and(|l| l.contains("address already in use"))
            {
                return false;
            }
            if started.elapsed() > Duration::from_secs(120) {
                panic!("MLServer not ready in 2 minutes: {log:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        true
    }

    /// Whether the server's REST endpoint says `model` is ready.
    fn ready(&self, model: &str) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.http)) else {
            return false;
        };
        let request = format!(
            "GET /v2/models/{model}/ready HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        );
        let mut answer = String::new();
        s.write_all(request.as_bytes()).is_ok()
            && s.read_to_string(&mut answer).is_ok()
            && answer.starts_with("HTTP/1.1 200")
    }

    /// Kills the server process at once, as a crash would.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn url(&self) -> String {
        format!("grpc://127.0.0.1:{}", self.grpc)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The record the model runtime keeps (`record_file`).
fn record(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn runtime_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/kserve")
        .join(name)
}

/// The frames of a moving test pattern through the colour model on `backend` (`extra`:
/// more properties), every class's confidence.
fn classify(extra: &str) -> Result<Vec<Classification>, String> {
    common::run_pipeline(&format!(
        "videotestsrc num-buffers=24 pattern=ball ! video/x-raw,format=RGB,width=64,height=48 ! \
         trtclassify labels-location={} top-k=6 batch-size=4 {extra} ! appsink name=sink",
        common::model("colors.txt")
    ))
}

/// The largest difference between two runs' confidences of the same classes.
fn largest_difference(a: &[Classification], b: &[Classification]) -> f32 {
    assert_eq!(a.len(), b.len(), "frames");
    let mut largest = 0f32;
    for (a, b) in a.iter().zip(b) {
        assert!(a.fresh && b.fresh, "frame {}: fresh", a.frame);
        assert_eq!(a.classes.len(), 6);
        for class in &a.classes {
            let other = b
                .classes
                .iter()
                .find(|c| c.class_id == class.class_id)
                .expect("the same classes");
            assert_eq!(class.label, other.label);
            largest = largest.max((class.confidence - other.confidence).abs());
        }
    }
    largest
}

#[test]
fn the_servers_scores_equal_the_cpu_backends() {
    let Some(server) = Server::start("the_servers_scores_equal_the_cpu_backends", &[colors()])
    else {
        return;
    };
    let onnx = common::model("colors.onnx");
    let cpu = classify(&format!("onnx-location={onnx} backend=cpu")).unwrap();
    assert_eq!(cpu.len(), 24);
    let remote = format!(
        "backend=kserve server-url={} server-model=colors",
        server.url()
    );
    let checked = classify(&format!("onnx-location={onnx} {remote}")).unwrap();
    let d = largest_difference(&cpu, &checked);
    println!("largest difference from backend=cpu: {d:e}");
    assert!(d <= 1e-5, "{d}");
    // Without a local model, the server's metadata says what it takes.
    let alone = classify(&remote).unwrap();
    assert!(largest_difference(&cpu, &alone) <= 1e-5);
    assert!(alone.iter().all(|c| c.model == "colors"), "{:?}", alone[0]);
}

#[test]
fn a_model_that_takes_fp16_gets_fp16_images() {
    let file = tempfile::NamedTempFile::new().unwrap();
    let half = Served {
        name: "half",
        input_type: "FP16",
        record_file: Some(file.path().into()),
        ..colors()
    };
    let Some(server) = Server::start("a_model_that_takes_fp16_gets_fp16_images", &[half]) else {
        return;
    };
    let onnx = common::model("colors.onnx");
    let cpu = classify(&format!("onnx-location={onnx} backend=cpu")).unwrap();
    let remote = classify(&format!(
        "onnx-location={onnx} backend=kserve server-url={} server-model=half name=c",
        server.url()
    ))
    .unwrap();
    assert_eq!(record(file.path())["input_datatype"], "FP16");
    let d = largest_difference(&cpu, &remote);
    println!("largest difference from backend=cpu with FP16 images: {d:e}");
    assert!(d < 1e-3, "{d}");
}

#[test]
fn a_model_the_server_lacks_or_that_differs_fails_at_start_naming_it() {
    let other = Served {
        name: "bigger",
        input: ("image", &[-1, 3, 32, 32]),
        ..colors()
    };
    let liar = Served {
        name: "liar",
        onnx: "cnn.onnx",
        ..colors()
    };
    let Some(server) = Server::start(
        "a_model_the_server_lacks_or_that_differs_fails_at_start_naming_it",
        &[colors(), other, liar],
    ) else {
        return;
    };
    let onnx = common::model("colors.onnx");
    let url = server.url();
    let e = classify(&format!(
        "onnx-location={onnx} backend=kserve server-url={url} server-model=nope"
    ))
    .unwrap_err();
    assert!(e.contains("server-model nope"), "{e}");
    let e = classify(&format!(
        "onnx-location={onnx} backend=kserve server-url={url} server-model=bigger"
    ))
    .unwrap_err();
    assert!(
        e.contains("3x32x32") && e.contains("3x16x16") && e.contains("not the same model"),
        "{e}"
    );
    let e = classify(&format!(
        "onnx-location={onnx} backend=kserve server-url=grpc://127.0.0.1:{} server-model=colors server-timeout=500",
        free_port()
    ))
    .unwrap_err();
    assert!(e.contains("does not answer"), "{e}");
    // Metadata that says 16×16 images of 6 classes, for a model that takes 32×32: the
    // request the element tries at start fails, with the server's reason.
    let e = classify(&format!(
        "backend=kserve server-url={url} server-model=liar"
    ))
    .unwrap_err();
    assert!(
        e.contains("server-model liar: a request of 4 image(s) failed"),
        "{e}"
    );
    let e = classify(&format!(
        "onnx-location={onnx} backend=kserve server-url=127.0.0.1:{} server-model=colors",
        server.grpc
    ))
    .unwrap_err();
    assert!(e.contains("expected grpc://host:port"), "{e}");
}

/// Stats of the element `name` once `pipeline` has run to EOS, with the warnings on the bus.
fn run_with_stats(pipeline: &gst::Pipeline, name: &str) -> (gst::Structure, Vec<String>) {
    let warnings = common::play_to_eos(pipeline)
        .iter()
        .filter(|m| matches!(m.view(), gst::MessageView::Warning(_)))
        .map(common::message_text)
        .collect();
    let stats = pipeline
        .by_name(name)
        .unwrap()
        .property::<gst::Structure>("stats");
    pipeline.set_state(gst::State::Null).unwrap();
    (stats, warnings)
}

fn count(stats: &gst::Structure, field: &str) -> u64 {
    stats.get::<u64>(field).unwrap()
}

#[test]
fn frames_keep_flowing_while_the_server_is_away_and_classification_resumes() {
    let Some(server) = Server::start(
        "frames_keep_flowing_while_the_server_is_away_and_classification_resumes",
        &[colors()],
    ) else {
        return;
    };
    common::init();
    // 12 s of a live 30 fps camera; the server is killed after 2 s and started again after
    // 3 s (it then takes its start-up time to come back).
    let frames = 360u64;
    let pipeline = common::launch(&format!(
        "videotestsrc is-live=true num-buffers={frames} pattern=blue ! \
         video/x-raw,format=RGB,width=32,height=24,framerate=30/1 ! \
         trtclassify name=c onnx-location={} labels-location={} batch-size=4 batch-timeout=50 \
         backend=kserve server-url={} server-model=colors server-timeout=500 ! \
         appsink name=sink sync=false",
        common::model("colors.onnx"),
        common::model("colors.txt"),
        server.url()
    ));
    let arrivals: Arc<Mutex<Vec<(u64, bool, String)>>> = Default::default();
    let into = arrivals.clone();
    common::appsink(&pipeline, "sink").set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                let (frame, result) = common::index_and_result(sample.buffer().unwrap());
                let label = result.classes.first().map(|c| c.label.clone());
                into.lock()
                    .unwrap()
                    .push((frame, result.fresh, label.unwrap_or_default()));
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    let server = Arc::new(Mutex::new(server));
    let restarter = {
        let server = server.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(2));
            server.lock().unwrap().kill();
            std::thread::sleep(Duration::from_secs(1));
            server.lock().unwrap().run("colors");
        })
    };
    let (stats, warnings) = run_with_stats(&pipeline, "c");
    restarter.join().unwrap();
    println!("{stats}");
    let arrivals = arrivals.lock().unwrap();
    // Every frame left, once, in order.
    let order: Vec<u64> = arrivals.iter().map(|a| a.0).collect();
    assert_eq!(order, (0..frames).collect::<Vec<_>>());
    assert_eq!(count(&stats, "frames-out"), frames);
    let unanswered = count(&stats, "unclassified-server");
    assert!(unanswered > 0, "{stats}");
    assert_eq!(
        count(&stats, "classified")
            + unanswered
            + count(&stats, "unclassified-late")
            + count(&stats, "unclassified-qos"),
        frames,
        "{stats}"
    );
    // Classified before the server went, and again once it came back.
    let fresh: Vec<u64> = arrivals.iter().filter(|a| a.1).map(|a| a.0).collect();
    assert!(fresh.first().is_some_and(|&f| f < 60), "{fresh:?}");
    assert!(fresh.last().is_some_and(|&f| f >= frames - 30), "{fresh:?}");
    assert!(
        arrivals.iter().filter(|a| a.1).all(|a| a.2 == "blue"),
        "fresh results are the model's"
    );
    // Said once, not once a frame.
    let said: Vec<&String> = warnings
        .iter()
        .filter(|w| w.contains("did not answer"))
        .collect();
    assert!(!said.is_empty() && said.len() <= 3, "{warnings:?}");
}

#[test]
fn a_server_slower_than_server_timeout_leaves_frames_unclassified_in_order() {
    // The element's request at start is answered at once; then the server slows down.
    let slow = Served {
        delay_ms: 2_000,
        fast_requests: 1,
        ..colors()
    };
    let Some(server) = Server::start(
        "a_server_slower_than_server_timeout_leaves_frames_unclassified_in_order",
        &[slow],
    ) else {
        return;
    };
    common::init();
    let frames = 16u64;
    let pipeline = common::launch(&format!(
        "videotestsrc num-buffers={frames} pattern=red ! video/x-raw,format=RGB,width=32,height=24 ! \
         trtclassify name=c onnx-location={} batch-size=4 backend=kserve server-url={} \
         server-model=colors server-timeout=200 ! fakesink",
        common::model("colors.onnx"),
        server.url()
    ));
    let started = Instant::now();
    let (stats, warnings) = run_with_stats(&pipeline, "c");
    println!("{stats} in {:.1?}", started.elapsed());
    assert_eq!(count(&stats, "frames-out"), frames);
    assert_eq!(count(&stats, "unclassified-server"), frames, "{stats}");
    assert!(warnings.iter().any(|w| w.contains("did not answer")));
}

#[test]
fn batches_are_in_flight_together_and_answered_in_order() {
    // Each answer takes 300 ms: the element sends the next batches while it waits, and the
    // server has several at once; every frame still gets its own result, in order.
    let file = tempfile::NamedTempFile::new().unwrap();
    let slow = Served {
        delay_ms: 300,
        record_file: Some(file.path().into()),
        ..colors()
    };
    let Some(server) = Server::start(
        "batches_are_in_flight_together_and_answered_in_order",
        &[slow],
    ) else {
        return;
    };
    let patterns = ["red", "green", "blue", "white"];
    let branches: Vec<String> = patterns
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "videotestsrc num-buffers=16 pattern={p} ! video/x-raw,format=RGB,width=32,height=24 ! \
                 trtclassify onnx-location={} labels-location={} batch-size=4 batch-timeout=-1 \
                 backend=kserve server-url={} server-model=colors ! appsink name=sink{i}",
                common::model("colors.onnx"),
                common::model("colors.txt"),
                server.url()
            )
        })
        .collect();
    let sinks: Vec<String> = (0..patterns.len()).map(|i| format!("sink{i}")).collect();
    let sinks: Vec<&str> = sinks.iter().map(String::as_str).collect();
    let results = common::run_pipeline_sinks(&branches.join(" "), &sinks).unwrap();
    for (pattern, (results, _)) in patterns.iter().zip(&results) {
        let frames: Vec<u64> = results.iter().map(|r| r.frame).collect();
        assert_eq!(frames, (0..16).collect::<Vec<_>>());
        assert!(
            results
                .iter()
                .all(|r| r.fresh && r.classes[0].label == *pattern),
            "{pattern}: {:?}",
            results.iter().find(|r| r.classes[0].label != *pattern)
        );
    }
    let most = record(file.path())["most_at_once"].as_u64().unwrap();
    println!("the server had up to {most} requests at once");
    assert!(most >= 2, "{most} request(s) at once");
}

#[test]
fn answers_keep_their_frames_when_requests_fail_among_those_in_flight() {
    // A server that takes one image a request: a batch of 8 goes as 8 requests, and a run
    // collects 32, more than are on the wire at once. The server fails every request for a
    // while in the middle; each frame of its own colour must get its own colour back, or
    // none.
    let dir = tempfile::tempdir().unwrap();
    let fail = dir.path().join("fail");
    let one = Served {
        input: ("image", &[1, 3, 16, 16]),
        output: ("scores", &[1, 6]),
        fail_file: Some(fail.clone()),
        ..colors()
    };
    let Some(server) = Server::start(
        "answers_keep_their_frames_when_requests_fail_among_those_in_flight",
        &[one],
    ) else {
        return;
    };
    common::init();
    let frames = 240u64;
    let pipeline = common::launch(&format!(
        "appsrc name=src format=time block=true max-bytes=1536 \
         caps=video/x-raw,format=RGB,width=16,height=16,framerate=25/1 ! \
         trtclassify name=c onnx-location={} labels-location={} batch-size=8 batch-timeout=-1 \
         backend=kserve server-url={} server-model=colors server-timeout=1000 ! appsink name=sink",
        common::model("colors.onnx"),
        common::model("colors.txt"),
        server.url()
    ));
    let src = pipeline
        .by_name("src")
        .unwrap()
        .downcast::<gst_app::AppSrc>()
        .unwrap();
    let arrivals: Arc<Mutex<Vec<(u64, Classification)>>> = Default::default();
    let into = arrivals.clone();
    common::appsink(&pipeline, "sink").set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                let sample = sink.pull_sample().map_err(|_| gst::FlowError::Eos)?;
                into.lock()
                    .unwrap()
                    .push(common::index_and_result(sample.buffer().unwrap()));
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    let feeder = std::thread::spawn(move || {
        for i in 0..frames {
            // Requests fail from frame 60 to 120, while others are on the wire.
            if i == 60 {
                std::fs::write(&fail, b"").unwrap();
            }
            if i == 120 {
                std::fs::remove_file(&fail).unwrap();
                // Past the element's pause before it tries the server again.
                std::thread::sleep(Duration::from_secs(3));
            }
            let (_, rgb) = common::COLORS[i as usize % common::COLORS.len()];
            src.push_buffer(common::solid_rgb(16, 16, rgb, i)).unwrap();
            std::thread::sleep(Duration::from_millis(10));
        }
        src.end_of_stream().unwrap();
    });
    let (stats, _) = run_with_stats(&pipeline, "c");
    feeder.join().unwrap();
    println!("{stats}");
    let arrivals = arrivals.lock().unwrap();
    let order: Vec<u64> = arrivals.iter().map(|a| a.0).collect();
    assert_eq!(order, (0..frames).collect::<Vec<_>>());
    for (i, result) in arrivals.iter() {
        let (colour, _) = common::COLORS[*i as usize % common::COLORS.len()];
        if result.fresh {
            assert_eq!(result.classes[0].label, colour, "frame {i}");
        }
    }
    let unanswered = count(&stats, "unclassified-server");
    assert!(unanswered > 0, "{stats}");
    assert_eq!(count(&stats, "classified") + unanswered, frames, "{stats}");
    assert!(arrivals.iter().rev().take(40).all(|a| a.1.fresh), "resumed");
}

/// A CA and a certificate for `localhost` signed by it, made with openssl in `dir`.
fn certificates(dir: &Path) -> Option<(PathBuf, PathBuf, PathBuf)> {
    let openssl = |args: &[&str]| {
        Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    std::fs::write(
        dir.join("san.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .unwrap();
    let made = openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]) && openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]) && openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.cnf",
        "-out",
        "server.pem",
    ]);
    made.then(|| {
        (
            dir.join("ca.pem"),
            dir.join("server.pem"),
            dir.join("server.key"),
        )
    })
}

#[test]
fn grpcs_with_the_servers_ca_classifies_and_without_it_fails_at_start() {
    let test = "grpcs_with_the_servers_ca_classifies_and_without_it_fails_at_start";
    let Some(server) = Server::start(test, &[colors()]) else {
        return;
    };
    let certs = tempfile::tempdir().unwrap();
    let Some((ca, cert, key)) = certificates(certs.path()) else {
        common::skipped(&format!("{test}: openssl could not make certificates"));
        return;
    };
    let python = mlserver().unwrap().with_file_name("python");
    let port = free_port();
    let mut proxy = Command::new(python)
        .arg(runtime_file("tls_proxy.py"))
        .args([&port.to_string(), &server.grpc.to_string()])
        .args([&cert, &key])
        .stdout(Stdio::piped())
        // It logs the refused handshake, which the test makes on purpose.
        .stderr(Stdio::null())
        .spawn()
        .expect("the TLS front starts");
    let mut ready = [0u8; 5];
    proxy
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut ready)
        .expect("the TLS front says ready");
    let url = format!("grpcs://localhost:{port}");
    let onnx = common::model("colors.onnx");
    let results = classify(&format!(
        "onnx-location={onnx} backend=kserve server-url={url} server-model=colors server-ca-location={}",
        ca.display()
    ));
    let refused = classify(&format!(
        "onnx-location={onnx} backend=kserve server-url={url} server-model=colors server-timeout=3000"
    ));
    let _ = proxy.kill();
    let _ = proxy.wait();
    let results = results.unwrap();
    assert_eq!(results.len(), 24);
    assert!(results.iter().all(|r| r.fresh));
    let e = refused.unwrap_err();
    assert!(e.contains("does not answer"), "{e}");
}
