// SPDX-License-Identifier: MPL-2.0
//! Builds GPU engines ahead of time, and benchmarks them.
//!
//!   trtclassify-engine build MODEL.onnx [--engine FILE] [--batch-size 8] [--precision fp16]
//!                            [--calibration TABLE] [--min-agreement 0.95] [--strict-precision]
//!                            [--input-size HxW] [--gpu-id 0]
//!   trtclassify-engine bench MODEL.onnx... [--batches 1,8,64] [--precision fp16] [--runs 200]
//!                            [--calibration TABLE] [--strict-precision] [--engine-dir DIR]
//!                            [--check] [--profile] [--hold-gpu-memory MIB]
//!   trtclassify-engine calibrate MODEL.onnx SOURCE... [--table FILE] [--frames 256]
//!                            [--input-size HxW]
//!
//! `build` writes the engine where the element looks for it (`--engine`, or the per-user
//! cache that `engine-location` defaults to), so that a pipeline starts without building.
//! `--precision int8` and `fp8` read the calibration table `calibrate` wrote (`--calibration`,
//! or MODEL's name with `.calibration.txt` in the current folder, `calibrate`'s default);
//! each quantized layer runs in the faster of 8 bits and fp16 on this GPU, or always in 8
//! bits with `--strict-precision`.
//! `bench` builds each model for each batch size from scratch, loads it again from its file,
//! and prints a markdown table: build time, cached start, graph latency (median of single
//! replays), images/s (graph replays back to back) and the median `infer()` call (upload,
//! graph, download). `--check` runs `MODEL.input.bin` (4 float32 NCHW images) at every batch
//! size and compares with `MODEL.ref.json` (written by `bench/gpu/torch_models.py export`);
//! `--profile` prints the GPU time of each plan by kind of step, and its costliest steps (the
//! same step in every block of a transformer counted together), timed inside the plan's graph;
//! every step in order goes to standard error. `--hold-gpu-memory` takes MIB of GPU memory
//! from the device's pool before the first engine is built and holds it to the end, as
//! another program's memory would: it moves where the engines' weights and buffers lie,
//! which the engine's debug log gives (`GST_DEBUG=trtclassify-engine:5`), so that a batch-1
//! latency can be compared across placements (docs/benchmarks.md, "what the two states are
//! not").
//! `calibrate` runs the model on the CPU over frames decoded by GStreamer from SOURCE (image
//! or video files, or folders of them; at most `--frames`; `.bin` files are model inputs
//! already preprocessed, float32 NCHW, as `bench --check` reads), preprocessed as the element's
//! defaults do, and writes the calibration table of the int8 and FP8 precisions (`--table`,
//! or MODEL's name with `.calibration.txt` in the current folder), with a line per
//! quantizable node on standard output.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use gsttrtclassify::engine::cuda::CudaEngine;
use gsttrtclassify::engine::{Engine, EngineOptions, Precision, Progress};
use gsttrtclassify::preprocess::PreprocessOptions;

const USAGE: &str = "usage:
  trtclassify-engine build MODEL.onnx [--engine FILE] [--batch-size N]
                           [--precision fp16|fp32|int8|fp8] [--calibration TABLE]
                           [--min-agreement 0.95] [--strict-precision] [--input-size HxW]
                           [--gpu-id N]
  trtclassify-engine bench MODEL.onnx... [--batches 1,8,64] [--precision fp16|fp32|int8|fp8]
                           [--calibration TABLE] [--strict-precision] [--runs N]
                           [--engine-dir DIR] [--check] [--profile] [--hold-gpu-memory MIB]
  trtclassify-engine calibrate MODEL.onnx SOURCE... [--table FILE] [--frames N]
                           [--input-size HxW]";

struct Args {
    command: String,
    /// The models; for `calibrate`, the model then its sources.
    models: Vec<PathBuf>,
    table: Option<PathBuf>,
    /// The calibration table of int8 and FP8 engines.
    calibration: Option<PathBuf>,
    min_agreement: f64,
    /// Every quantized layer in 8 bits, even where fp16 is faster.
    strict_precision: bool,
    frames: usize,
    engine: Option<PathBuf>,
    engine_dir: Option<PathBuf>,
    batch_size: usize,
    batches: Vec<usize>,
    precision: Precision,
    input_size: Option<(usize, usize)>,
    gpu_id: u32,
    runs: usize,
    check: bool,
    profile: bool,
    /// MiB of GPU memory `bench` holds before its first engine.
    hold_mib: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let command = it.next().ok_or("no command")?;
    if !matches!(command.as_str(), "build" | "bench" | "calibrate") {
        return Err(format!("unknown command `{command}`"));
    }
    let mut a = Args {
        command,
        models: Vec::new(),
        table: None,
        calibration: None,
        min_agreement: gsttrtclassify::engine::DEFAULT_MIN_AGREEMENT,
        strict_precision: false,
        frames: 256,
        engine: None,
        engine_dir: None,
        batch_size: 8,
        batches: vec![1, 8, 64],
        precision: Precision::Fp16,
        input_size: None,
        gpu_id: 0,
        runs: 200,
        check: false,
        profile: false,
        hold_mib: 0,
    };
    fn number<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T, String> {
        let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
        v.parse().map_err(|_| format!("{flag} {v}: not a number"))
    }
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--engine" => a.engine = Some(it.next().ok_or("--engine needs a file")?.into()),
            "--engine-dir" => {
                a.engine_dir = Some(it.next().ok_or("--engine-dir needs a folder")?.into())
            }
            "--batch-size" => a.batch_size = number(&arg, it.next())?,
            "--gpu-id" => a.gpu_id = number(&arg, it.next())?,
            "--runs" => a.runs = number::<usize>(&arg, it.next())?.max(1),
            "--batches" => {
                let list = it.next().ok_or("--batches needs a list such as 1,8,64")?;
                a.batches = list
                    .split(',')
                    .map(|b| number(&arg, Some(b.to_owned())))
                    .collect::<Result<_, _>>()?;
            }
            "--precision" => {
                a.precision = match it.next().as_deref() {
                    Some("fp16") => Precision::Fp16,
                    Some("fp32") => Precision::Fp32,
                    Some("int8") => Precision::Int8,
                    Some("fp8") => Precision::Fp8,
                    other => return Err(format!("--precision {other:?}: fp16, fp32, int8 or fp8")),
                }
            }
            "--input-size" => {
                let v = it.next().ok_or("--input-size needs HxW")?;
                let (h, w) = v.split_once('x').ok_or("--input-size needs HxW")?;
                a.input_size = Some((number(&arg, Some(h.into()))?, number(&arg, Some(w.into()))?));
            }
            "--table" => a.table = Some(it.next().ok_or("--table needs a file")?.into()),
            "--min-agreement" => a.min_agreement = number(&arg, it.next())?,
            "--strict-precision" => a.strict_precision = true,
            "--calibration" => {
                a.calibration = Some(it.next().ok_or("--calibration needs a table")?.into())
            }
            "--frames" => a.frames = number::<usize>(&arg, it.next())?.max(1),
            "--check" => a.check = true,
            "--profile" => a.profile = true,
            "--hold-gpu-memory" => a.hold_mib = number(&arg, it.next())?,
            flag if flag.starts_with("--") => return Err(format!("unknown option {flag}")),
            model => a.models.push(model.into()),
        }
    }
    if a.models.is_empty() {
        return Err("no model given".into());
    }
    if a.command == "calibrate" && a.models.len() < 2 {
        return Err("no frames to calibrate with: give image or video files, or folders".into());
    }
    if a.batch_size == 0 || a.batches.contains(&0) {
        return Err("batch sizes start at 1".into());
    }
    Ok(a)
}

fn options(args: &Args, model: &Path, batch_size: usize, engine: Option<PathBuf>) -> EngineOptions {
    EngineOptions {
        model: model.into(),
        batch_size,
        input_size: args.input_size,
        precision: args.precision,
        calibration: args
            .precision
            .quant_format()
            .map(|_| (args.calibration.clone()).unwrap_or_else(|| default_table(model))),
        min_agreement: args.min_agreement,
        strict_precision: args.strict_precision,
        gpu_id: args.gpu_id,
        threads: 0,
        engine_location: engine,
        preprocess: PreprocessOptions::default(),
        progress: Progress::new(|msg| eprintln!("  {msg}")),
        server: Default::default(),
    }
}

/// Where `calibrate` writes `model`'s table by default: its name with `.calibration.txt`, in
/// the current folder.
fn default_table(model: &Path) -> PathBuf {
    let stem = model.file_stem().unwrap_or_default().to_string_lossy();
    PathBuf::from(format!("{stem}.calibration.txt"))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("trtclassify-engine: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = gst::init() {
        eprintln!("trtclassify-engine: GStreamer: {e}");
        return ExitCode::FAILURE;
    }
    gsttrtclassify::logging::forward_engine_logs();
    let result = match args.command.as_str() {
        "build" => build(&args),
        "calibrate" => calibrate(&args),
        _ => bench(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("trtclassify-engine: {e}");
            ExitCode::FAILURE
        }
    }
}

fn build(args: &Args) -> Result<(), String> {
    for model in &args.models {
        let started = Instant::now();
        let engine = CudaEngine::build(&options(args, model, args.batch_size, args.engine.clone()))
            .map_err(|e| e.to_string())?;
        let info = engine.info();
        println!(
            "{}: engine for batch sizes up to {} ready in {:.2} s ({} classes, input {}x{})",
            model.display(),
            info.model_batch,
            started.elapsed().as_secs_f64(),
            info.num_classes,
            info.input.height,
            info.input.width
        );
        if let Some(note) = &info.precision_note {
            println!("  {note}");
        }
        if let Some(report) = &info.quant_report {
            println!("  {report}");
        }
    }
    Ok(())
}

/// Calibrates `args.models[0]` on frames of the rest, and writes the table.
fn calibrate(args: &Args) -> Result<(), String> {
    use gsttrtclassify::engine::compiler::quant::{HeldOut, LAYER_ERROR_BOUND, QuantFormat};

    let (model, sources) = args.models.split_first().expect("checked by parse_args");
    let path = args.table.clone().unwrap_or_else(|| default_table(model));
    let started = Instant::now();
    let options = options(args, model, 1, None);
    let done =
        gsttrtclassify::calibrate::calibrate(&options, sources, args.frames, &path, &mut |msg| {
            eprintln!("  {msg}")
        })?;
    println!("| node | largest input | int8 range | int8 error | fp8 error |");
    println!("|---|---|---|---|---|");
    for (name, r) in &done.table.nodes {
        let error = |format: QuantFormat| {
            let e = r.error(format);
            let kept = if e > LAYER_ERROR_BOUND {
                " (stays fp16)"
            } else {
                ""
            };
            format!("{:.2} %{kept}", e * 100.0)
        };
        println!(
            "| {name} | {:.4} | {:.4} | {} | {} |",
            r.amax,
            r.int8,
            error(QuantFormat::Int8),
            error(QuantFormat::Fp8)
        );
    }
    println!(
        "{}: {} quantizable nodes calibrated on {} frames in {:.1} s; wrote {}{}",
        model.display(),
        done.table.nodes.len(),
        done.table.frames,
        started.elapsed().as_secs_f64(),
        path.display(),
        match done.held_out {
            0 => " (no frame held out for the build's accuracy guard: give more frames)".into(),
            n => format!(
                " and {n} held-out frames for the build's accuracy guard ({})",
                HeldOut::beside(&path).display()
            ),
        }
    );
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `--hold-gpu-memory`: MiB taken from the device's default memory pool, from which the
/// engine allocates its weights and buffers too (stream-ordered allocations), so that they
/// lie past it.
fn hold_gpu_memory(args: &Args) -> Result<Option<cudarc::driver::CudaSlice<u8>>, String> {
    use gsttrtclassify::engine::cuda::{runtime, unavailable_reason};
    if args.hold_mib == 0 {
        return Ok(None);
    }
    let bytes = args.hold_mib.checked_mul(1 << 20).ok_or_else(|| {
        format!(
            "--hold-gpu-memory {}: more bytes than this machine can address",
            args.hold_mib
        )
    })?;
    if let Some(reason) = unavailable_reason() {
        return Err(format!("--hold-gpu-memory: {reason}"));
    }
    let gpu = runtime::open_gpu(args.gpu_id).map_err(|e| e.to_string())?;
    let stream = gpu.ctx.default_stream();
    let held = stream
        .alloc_zeros::<u8>(bytes)
        .map_err(|e| format!("--hold-gpu-memory {}: {e}", args.hold_mib))?;
    let (at, _) = cudarc::driver::DevicePtr::device_ptr(&held, &stream);
    eprintln!("holding {} MiB of GPU memory at {at:#x}", args.hold_mib);
    Ok(Some(held))
}

fn bench(args: &Args) -> Result<(), String> {
    let dir = match &args.engine_dir {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!("trtclassify-bench-{}", std::process::id())),
    };
    let mut table = vec![
        "| model | precision | batch | build | cached start | latency (median) | images/s | infer() median | check |".to_owned(),
        "|---|---|---|---|---|---|---|---|---|".to_owned(),
    ];
    let _held = hold_gpu_memory(args)?;
    let mut preprocess = vec![
        "| model | batch | frame in GPU memory | preprocessing per frame (mean of 20 batches) |"
            .to_owned(),
        "|---|---|---|---|".to_owned(),
    ];
    for model in &args.models {
        let stem = model
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned());
        let reference = if args.check {
            Some(Reference::load(model)?)
        } else {
            None
        };
        for &batch in &args.batches {
            let file = dir.join(format!("{stem}-b{batch}.engine"));
            let _ = std::fs::remove_file(&file);
            eprintln!("{stem} batch {batch}: building");
            let started = Instant::now();
            let built = CudaEngine::build(&options(args, model, batch, Some(file.clone())))
                .map_err(|e| e.to_string())?;
            let build_s = started.elapsed().as_secs_f64();
            drop(built);
            eprintln!("{stem} batch {batch}: loading the engine file");
            let started = Instant::now();
            let mut engine = CudaEngine::build(&options(args, model, batch, Some(file.clone())))
                .map_err(|e| e.to_string())?;
            let cached_s = started.elapsed().as_secs_f64();

            let frame = engine.info().input.frame_len();
            let input = vec![0.1f32; batch * frame];
            engine.infer(&input, batch).map_err(|e| e.to_string())?;
            let rt = engine.runtime();
            let text = |e: gsttrtclassify::engine::cuda::Error| e.to_string();
            let latency = median(rt.latencies(batch, args.runs).map_err(text)?);
            let throughput = median(
                (0..5)
                    .map(|_| rt.replay(batch, args.runs))
                    .collect::<Result<_, _>>()
                    .map_err(text)?,
            );
            let infer = median(
                (0..args.runs.min(50))
                    .map(|_| {
                        let t = Instant::now();
                        engine
                            .infer(&input, batch)
                            .map(|_| t.elapsed().as_secs_f64())
                    })
                    .collect::<Result<_, _>>()
                    .map_err(|e| e.to_string())?,
            );
            let check = match &reference {
                Some(r) => r.check(&mut engine, batch)?,
                None => "-".into(),
            };
            if args.profile {
                print_profile(
                    &stem,
                    batch,
                    engine.runtime().profile(batch, 20).map_err(text)?,
                );
            }
            // Decoded frames as the element gets them from NVDEC (CUDA memory, NV12).
            for (w, h) in [(1920, 1080), (3840, 2160)] {
                let info =
                    gst_video::VideoInfo::builder(gst_video::VideoFormat::Nv12, w, h).build();
                let ms = info.map_err(|e| e.to_string()).and_then(|info| {
                    let format = gsttrtclassify::video::frame_format(&info)?;
                    let offsets: Vec<i64> = info.offset().iter().map(|&o| o as i64).collect();
                    engine
                        .time_device_preprocess(&format, &offsets, info.stride(), 20)
                        .map_err(|e| e.to_string())
                })?;
                preprocess.push(format!(
                    "| {stem} | {batch} | {w}x{h} NV12 | {:.1} µs |",
                    ms * 1e3
                ));
            }
            table.push(format!(
                "| {stem} | {:?} | {batch} | {build_s:.2} s | {:.3} s | {:.3} ms | {:.0} | {:.3} ms | {check} |",
                args.precision,
                cached_s,
                latency * 1e3,
                batch as f64 / throughput,
                infer * 1e3,
            ));
            let _ = std::fs::remove_file(&file);
        }
    }
    if args.engine_dir.is_none() {
        let _ = std::fs::remove_dir(&dir);
    }
    println!("{}", table.join("\n"));
    println!();
    println!("{}", preprocess.join("\n"));
    Ok(())
}

fn print_profile(model: &str, batch: usize, steps: Vec<(String, f64)>) {
    let total: f64 = steps.iter().map(|(_, ms)| ms).sum();
    println!(
        "\n{model} batch {batch}: {} steps, {total:.3} ms in the plan's graph, step by step",
        steps.len()
    );
    // Every step in the plan's order goes to the log, the summary below to the table.
    eprintln!("{model} batch {batch}, the plan's steps in order (ms):");
    for (what, ms) in &steps {
        eprintln!("  {ms:8.4}  {what}");
    }
    let mut by_kind = std::collections::BTreeMap::<String, (usize, f64)>::new();
    for (what, ms) in &steps {
        let kind = what.split(' ').next().unwrap_or("?").to_owned();
        let e = by_kind.entry(kind).or_default();
        e.0 += 1;
        e.1 += ms;
    }
    for (kind, (n, ms)) in by_kind {
        println!("  {kind:<12} {n:>4} steps {ms:8.3} ms");
    }
    // The same step repeats in every block of a transformer: grouped by what it computes
    // (the description without the node), the costly kinds of step stand out.
    let mut by_step = std::collections::HashMap::<&str, (usize, f64)>::new();
    for (what, ms) in &steps {
        let step = what
            .rsplit_once(" (")
            .map_or(what.as_str(), |(step, _)| step);
        let e = by_step.entry(step).or_default();
        e.0 += 1;
        e.1 += ms;
    }
    let mut slowest: Vec<_> = by_step.into_iter().collect();
    slowest.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
    for (what, (n, ms)) in slowest.iter().take(15) {
        println!("  {ms:8.4} ms  {n:>3}x  {what}");
    }
}

/// The reference input and onnxruntime's outputs for it, from `torch_models.py export`.
struct Reference {
    input: Vec<f32>,
    output: Vec<Vec<f32>>,
}

impl Reference {
    fn load(model: &Path) -> Result<Self, String> {
        let input_file = model.with_extension("input.bin");
        let ref_file = model.with_extension("ref.json");
        let bytes =
            std::fs::read(&input_file).map_err(|e| format!("{}: {e}", input_file.display()))?;
        let input = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let text = std::fs::read_to_string(&ref_file)
            .map_err(|e| format!("{}: {e}", ref_file.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", ref_file.display()))?;
        let output = json["output"]
            .as_array()
            .ok_or_else(|| format!("{}: no output", ref_file.display()))?
            .iter()
            .map(|row| {
                row.as_array()
                    .into_iter()
                    .flatten()
                    .map(|v| v.as_f64().unwrap_or(f64::NAN) as f32)
                    .collect()
            })
            .collect();
        Ok(Reference { input, output })
    }

    /// Fills a batch of `batch` with the reference images in turn; reports the largest
    /// error and how many frames kept the reference's top-1.
    fn check(&self, engine: &mut CudaEngine, batch: usize) -> Result<String, String> {
        let frame = engine.info().input.frame_len();
        let images = self.output.len();
        let mut input = Vec::with_capacity(batch * frame);
        for i in 0..batch {
            let j = i % images;
            input.extend_from_slice(&self.input[j * frame..(j + 1) * frame]);
        }
        let got = engine.infer(&input, batch).map_err(|e| e.to_string())?;
        let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b]));
        let (mut worst, mut same) = (0.0f32, 0);
        for (i, g) in got.iter().enumerate() {
            let want = &self.output[i % images];
            for (a, b) in g.iter().zip(want) {
                worst = worst.max((a - b).abs());
            }
            same += usize::from(argmax(g) == argmax(want));
        }
        Ok(format!("max err {worst:.1e}, top-1 {same}/{batch}"))
    }
}
