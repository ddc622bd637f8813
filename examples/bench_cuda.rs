// SPDX-License-Identifier: MPL-2.0
//! Builds the cuda engine for each model and times it: build time, then the median time of
//! one captured-graph replay per batch size (GPU time of the model), and the median latency
//! of a whole `infer` call at batch 1 (upload, graph, download).
//!
//! cargo run --release --example bench_cuda -- [--runs 50] [--batches 1,8,64] MODEL.onnx...

use std::time::Instant;

use gsttrtclassify::engine::cuda::CudaEngine;
use gsttrtclassify::engine::{Engine, EngineOptions, Precision};
use gsttrtclassify::preprocess::PreprocessOptions;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    gst::init().expect("gstreamer");
    let mut args = std::env::args().skip(1);
    let (mut runs, mut batches, mut models) = (50, vec![1, 8, 64], Vec::new());
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--runs" => runs = args.next().and_then(|v| v.parse().ok()).expect("--runs N"),
            "--batches" => {
                batches = args
                    .next()
                    .expect("--batches 1,8,64")
                    .split(',')
                    .map(|b| b.parse().expect("a number"))
                    .collect()
            }
            model => models.push(model.to_owned()),
        }
    }
    let max_batch = *batches.iter().max().expect("a batch size");
    println!(
        "| model | precision | build (batches 1..{max_batch}) | batch | graph median | images/s | infer() median |"
    );
    println!("|---|---|---|---|---|---|---|");
    for model in &models {
        for precision in [Precision::Fp16] {
            let options = EngineOptions {
                model: model.into(),
                batch_size: max_batch,
                input_size: None,
                precision,
                gpu_id: 0,
                progress: Default::default(),
                preprocess: PreprocessOptions::default(),
            };
            let started = Instant::now();
            let mut engine = match CudaEngine::build(&options) {
                Ok(e) => e,
                Err(e) => {
                    println!("| {model} | {precision:?} | failed: {e} | | | | |");
                    continue;
                }
            };
            let build = started.elapsed().as_secs_f64();
            let frame = engine.info().input.frame_len();
            for &batch in &batches {
                let input = vec![0.1f32; batch * frame];
                engine.infer(&input, batch).expect("inference");
                let graph: Vec<f64> = (0..runs)
                    .map(|_| engine.time_graph(batch, 1).expect("replay"))
                    .collect();
                let infer: Vec<f64> = (0..runs.min(20))
                    .map(|_| {
                        let t = Instant::now();
                        engine.infer(&input, batch).expect("inference");
                        t.elapsed().as_secs_f64()
                    })
                    .collect();
                let g = median(graph);
                println!(
                    "| {} | {precision:?} | {build:.2} s | {batch} | {:.3} ms | {:.0} | {:.3} ms |",
                    std::path::Path::new(model)
                        .file_stem()
                        .map_or_else(|| model.clone(), |s| s.to_string_lossy().into_owned()),
                    g * 1e3,
                    batch as f64 / g,
                    median(infer) * 1e3
                );
            }
        }
    }
}
