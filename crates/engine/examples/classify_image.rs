// SPDX-License-Identifier: MPL-2.0
//! Classifies image files with an ONNX classifier, without GStreamer: the engine crate on
//! its own.
//!
//! ```text
//! cargo run --release -p trtclassify-engine --example classify_image -- \
//!     MODEL.onnx IMAGE.ppm... [--labels LABELS.txt] [--backend auto|cpu|cuda] [--top-k N]
//! ```
//!
//! Images are binary PPM (`P6`, RGB) or PGM (`P5`, grey) with 8-bit samples, the formats any
//! converter writes (`convert photo.jpg photo.ppm`, `ffmpeg -i photo.jpg photo.ppm`). One line
//! per image: its file name and the top classes with their probabilities.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use trtclassify_engine::frame::{FrameView, PixelFormat};
use trtclassify_engine::{Backend, EngineOptions, build};

struct Args {
    model: PathBuf,
    images: Vec<PathBuf>,
    labels: Option<PathBuf>,
    backend: Backend,
    top_k: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let mut positional = Vec::new();
    let (mut labels, mut backend, mut top_k) = (None, Backend::Auto, 3);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--labels" => labels = Some(PathBuf::from(value()?)),
            "--backend" => {
                backend = match value()?.as_str() {
                    "auto" => Backend::Auto,
                    "cpu" => Backend::Cpu,
                    "cuda" => Backend::Cuda,
                    other => return Err(format!("unknown backend {other:?}: auto, cpu or cuda")),
                }
            }
            "--top-k" => top_k = value()?.parse().map_err(|e| format!("--top-k: {e}"))?,
            _ if arg.starts_with("--") => return Err(format!("unknown option {arg}")),
            _ => positional.push(PathBuf::from(arg)),
        }
    }
    if positional.len() < 2 {
        return Err("give a model and at least one image".into());
    }
    let model = positional.remove(0);
    Ok(Args {
        model,
        images: positional,
        labels,
        backend,
        top_k,
    })
}

/// An 8-bit binary PPM (RGB) or PGM (grey) file: its format, size and pixels.
fn read_image(path: &Path) -> Result<(PixelFormat, u32, u32, Vec<u8>), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let bad = |why: &str| format!("{}: not an 8-bit binary PPM or PGM: {why}", path.display());
    // The header: magic, width, height, maxval, separated by whitespace and `#` comments,
    // then one whitespace byte before the pixels.
    let mut fields = Vec::new();
    let mut at = 0;
    while fields.len() < 4 {
        while at < bytes.len() && (bytes[at].is_ascii_whitespace() || bytes[at] == b'#') {
            if bytes[at] == b'#' {
                while at < bytes.len() && bytes[at] != b'\n' {
                    at += 1;
                }
            }
            at += 1;
        }
        let start = at;
        while at < bytes.len() && !bytes[at].is_ascii_whitespace() {
            at += 1;
        }
        if start == at {
            return Err(bad("the header ends early"));
        }
        fields.push(String::from_utf8_lossy(&bytes[start..at]).into_owned());
    }
    let format = match fields[0].as_str() {
        "P6" => PixelFormat::Rgb,
        "P5" => PixelFormat::Gray8,
        other => return Err(bad(&format!("magic {other:?}"))),
    };
    let number = |s: &str| {
        s.parse::<u32>()
            .map_err(|_| bad(&format!("{s:?} is not a number")))
    };
    let (width, height) = (number(&fields[1])?, number(&fields[2])?);
    if number(&fields[3])? != 255 {
        return Err(bad("samples of more than 8 bits"));
    }
    let channels = if format == PixelFormat::Rgb { 3 } else { 1 };
    let size = width as usize * height as usize * channels;
    let pixels = bytes
        .get(at + 1..at + 1 + size)
        .ok_or_else(|| bad("fewer pixels than its size"))?;
    Ok((format, width, height, pixels.to_vec()))
}

fn run(args: &Args) -> Result<(), String> {
    let labels: Vec<String> = match &args.labels {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .lines()
            .map(str::to_owned)
            .collect(),
        None => Vec::new(),
    };
    let mut engine =
        build(args.backend, &EngineOptions::new(&args.model)).map_err(|e| e.to_string())?;
    eprintln!(
        "{}: {:?} engine, {} classes",
        args.model.display(),
        engine.info().backend,
        engine.info().num_classes
    );
    for path in &args.images {
        let (format, width, height, pixels) = read_image(path)?;
        let frame = FrameView::packed_frame(format, width, height, &pixels);
        let scores = engine
            .classify(&[frame])
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let probabilities = softmax(&scores[0]);
        let mut order: Vec<usize> = (0..probabilities.len()).collect();
        order.sort_by(|&a, &b| probabilities[b].total_cmp(&probabilities[a]));
        let top: Vec<String> = order
            .iter()
            .take(args.top_k)
            .map(|&c| {
                let label = labels.get(c).cloned().unwrap_or_else(|| c.to_string());
                format!("{label} {:.3}", probabilities[c])
            })
            .collect();
        println!("{}: {}", path.display(), top.join(", "));
    }
    Ok(())
}

/// Probabilities of `scores`: the scores themselves where they already are (a model that
/// ends in a softmax), else their softmax.
fn softmax(scores: &[f32]) -> Vec<f32> {
    let sum: f32 = scores.iter().sum();
    if scores.iter().all(|s| (0.0..=1.0).contains(s)) && (sum - 1.0).abs() < 1e-3 {
        return scores.to_vec();
    }
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let total: f32 = exp.iter().sum();
    exp.iter().map(|e| e / total).collect()
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!(
                "classify_image: {e}\nusage: classify_image MODEL.onnx IMAGE.ppm... [--labels LABELS.txt] [--backend auto|cpu|cuda] [--top-k N]"
            );
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("classify_image: {e}");
            ExitCode::FAILURE
        }
    }
}
