// SPDX-License-Identifier: MPL-2.0
//! Calibrating int8 and FP8 engines on frames: images and videos that GStreamer decodes, or
//! model inputs already preprocessed (`.bin`, float32 NCHW), run through the model's f32 CPU
//! plan (`engine::calibration`). `trtclassify-engine calibrate` writes the table a user names;
//! the element, whose `calibration-location` may name the frames instead of a table, keeps
//! the table it makes in the engine cache, beside the engines built with it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use gst::prelude::*;

use crate::engine::calibration::Calibration;
use crate::engine::compiler::quant::{CalibrationTable, HeldOut, TABLE_HEADER};
use crate::engine::{EngineOptions, cuda};

/// The frames the element calibrates on, at most: `trtclassify-engine calibrate`'s default.
pub const FRAMES: usize = 256;

/// What a calibration wrote.
pub struct Calibrated {
    /// Each quantizable layer's input range and error.
    pub table: CalibrationTable,
    /// The frames held out for the build's accuracy guard, written beside the table.
    pub held_out: usize,
}

/// Whether `path` is a calibration table (its first line says so), rather than frames.
pub fn is_table(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; TABLE_HEADER.len()];
    std::fs::File::open(path).is_ok_and(|mut f| f.read_exact(&mut head).is_ok())
        && head == TABLE_HEADER.as_bytes()
}

/// The files of `sources`: each file, and the files of each folder in name order.
pub fn files(sources: &[PathBuf]) -> Result<Vec<PathBuf>, String> {
    let mut files = Vec::new();
    for source in sources {
        if !source.is_dir() {
            files.push(source.clone());
            continue;
        }
        let mut inside: Vec<PathBuf> = std::fs::read_dir(source)
            .map_err(|e| format!("{}: {e}", source.display()))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        inside.sort();
        files.extend(inside);
    }
    Ok(files)
}

/// Calibrates `options.model` on up to `frames` frames of `sources` (files or folders of
/// them), preprocessed as `options` says, and writes the table to `table` with the held-out
/// frames beside it (`HeldOut::beside`); `progress` hears after each file.
pub fn calibrate(
    options: &EngineOptions,
    sources: &[PathBuf],
    frames: usize,
    table: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<Calibrated, String> {
    let calibration = Calibration::new(options).map_err(|e| e.to_string())?;
    let calibration = Arc::new(Mutex::new(calibration));
    for file in files(sources)? {
        if calibration.lock().unwrap().frames() >= frames {
            break;
        }
        match file.extension().is_some_and(|e| e == "bin") {
            true => read_inputs(&file, frames, &mut calibration.lock().unwrap())?,
            false => decode_frames(&file, frames, &calibration)?,
        }
        progress(&format!(
            "calibration: {}: {} frames so far",
            file.display(),
            calibration.lock().unwrap().frames()
        ));
    }
    let calibration = calibration.lock().unwrap();
    if calibration.frames() == 0 {
        let named: Vec<String> = sources.iter().map(|s| s.display().to_string()).collect();
        return Err(format!("no frame decoded from {}", named.join(", ")));
    }
    save(&calibration, table)
}

/// Writes `calibration`'s table to `table`, and its held-out frames beside it.
pub fn save(calibration: &Calibration, table: &Path) -> Result<Calibrated, String> {
    let written = calibration.table();
    written.save(table).map_err(|e| e.to_string())?;
    let held_out = calibration.held_out();
    let held_out_path = HeldOut::beside(table);
    match held_out.frames() {
        // A stale file beside the table would measure the engine on other frames.
        0 => {
            let _ = std::fs::remove_file(&held_out_path);
        }
        _ => held_out.save(&held_out_path).map_err(|e| e.to_string())?,
    }
    Ok(Calibrated {
        table: written,
        held_out: held_out.frames(),
    })
}

/// The table a calibration of `options.model` on `files` keeps in the cache `dir`: its name
/// holds a digest of `what` (how it calibrates), the preprocessing and input size, and the model's and the
/// files' paths, sizes and modification times, so that a change to any makes another.
pub fn cached_table(
    options: &EngineOptions,
    dir: &Path,
    what: &str,
    files: &[PathBuf],
) -> Result<PathBuf, String> {
    let mut stamp = format!(
        "{what}\n{:?}\n{:?}\n",
        options.preprocess, options.input_size
    );
    for file in std::iter::once(&options.model).chain(files) {
        let meta = std::fs::metadata(file).map_err(|e| format!("{}: {e}", file.display()))?;
        let modified = (meta.modified().ok())
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        stamp += &format!("{}\t{}\t{modified}\n", file.display(), meta.len());
    }
    let stem = options
        .model
        .file_stem()
        .unwrap_or_default()
        .to_string_lossy();
    let digest = cuda::engine_file::sha256_hex(stamp);
    Ok(dir.join(format!("{stem}-{}.calibration.txt", &digest[..16])))
}

/// Marks a table found in the cache, and its held-out frames, as used: the cache's cleanup
/// removes those unused for a month.
pub fn mark_used(table: &Path) {
    cuda::cache::mark_used(table);
    cuda::cache::mark_used(&HeldOut::beside(table));
}

/// Makes `table` with `make` (which writes a table and its held-out frames where it is
/// told): under a temporary name beside it first, then renamed, held-out frames
/// first, so that an element starting meanwhile sees the whole table or none.
pub fn keep(
    table: &Path,
    make: impl FnOnce(&Path) -> Result<Calibrated, String>,
) -> Result<Calibrated, String> {
    let dir = table.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let name = table.file_name().unwrap_or_default().to_string_lossy();
    // A name of its own (two calibrations of one process may overlap), in the pattern of the
    // cache's temporary files, which its cleanup removes if a crash leaves one.
    let partial = dir.join(format!(".{name}.{}.tmp", cuda::cache::random_hex()));
    let renamed = make(&partial).and_then(|done| {
        let held_out = HeldOut::beside(&partial);
        if held_out.exists() {
            std::fs::rename(&held_out, HeldOut::beside(table))
                .map_err(|e| format!("{}: {e}", table.display()))?;
        }
        std::fs::rename(&partial, table).map_err(|e| format!("{}: {e}", table.display()))?;
        Ok(done)
    });
    renamed.inspect_err(|_| {
        let _ = std::fs::remove_file(&partial);
        let _ = std::fs::remove_file(HeldOut::beside(&partial));
    })
}

/// `options` with a calibration table: where an int8 or FP8 engine's `calibration` names
/// frames (a folder, or a file that is neither a table nor `.txt`), the table made from up to
/// `frames` of them, kept in `dir` (the element's: the engine cache) and made now if it is
/// not there yet (`cached_table`: a changed model or frame makes another).
pub fn with_table(
    options: &EngineOptions,
    dir: &Path,
    frames: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<EngineOptions, String> {
    let (Some(source), Some(format)) = (&options.calibration, options.precision.quant_format())
    else {
        return Ok(options.clone());
    };
    // A `.txt` file is taken for a table even when it is not one, so that its reader says
    // what is wrong with it rather than a decoder.
    if is_table(source) || source.extension().is_some_and(|e| e == "txt") {
        return Ok(options.clone());
    }
    if !source.exists() {
        return Err(format!(
            "calibration-location {}: no such file or folder",
            source.display()
        ));
    }
    let sources = vec![source.clone()];
    let table = cached_table(options, dir, &format!("frames {frames}"), &files(&sources)?)?;
    if is_table(&table) {
        mark_used(&table);
    } else {
        progress(&format!(
            "precision={format}: calibrating on up to {frames} frames of {}",
            source.display()
        ));
        let done = keep(&table, |partial| {
            calibrate(options, &sources, frames, partial, progress)
        })?;
        progress(&format!(
            "calibrated {} layers on {} frames ({} held out for the accuracy guard): {}",
            done.table.nodes.len(),
            done.table.frames,
            done.held_out,
            table.display()
        ));
    }
    Ok(EngineOptions {
        calibration: Some(table),
        ..options.clone()
    })
}

/// Takes frames of `file` (`Calibration::take`) until the table has `target` frames: model
/// inputs already preprocessed (float32, little-endian, one frame after another: `bench
/// --check`'s `MODEL.input.bin`).
fn read_inputs(file: &Path, target: usize, calibration: &mut Calibration) -> Result<(), String> {
    let bytes = std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let frame_bytes = calibration.frame_len() * 4;
    if bytes.is_empty() || !bytes.len().is_multiple_of(frame_bytes) {
        return Err(format!(
            "{}: {} bytes, not whole frames of the model's input ({frame_bytes} bytes each)",
            file.display(),
            bytes.len()
        ));
    }
    for frame in bytes.chunks_exact(frame_bytes) {
        if calibration.frames() >= target {
            break;
        }
        let input: Vec<f32> = (frame.chunks_exact(4))
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        calibration.take_input(&input).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Decodes frames of `file` (an image or a video GStreamer reads) as RGB into `calibration`
/// (`Calibration::take`) until its table has `target` frames.
fn decode_frames(
    file: &Path,
    target: usize,
    calibration: &Arc<Mutex<Calibration>>,
) -> Result<(), String> {
    let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", file.display());
    let pipeline = gst::parse::launch(
        "filesrc name=src ! decodebin ! videoconvert ! video/x-raw,format=RGB ! fakesink name=sink sync=false",
    )
    .map_err(|e| fail(&e))?
    .downcast::<gst::Pipeline>()
    .expect("a pipeline");
    let src = pipeline.by_name("src").expect("filesrc");
    src.set_property("location", file.to_string_lossy().as_ref());
    let sink = pipeline.by_name("sink").expect("fakesink");
    let pad = sink.static_pad("sink").expect("a sink pad");
    let failed = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
    let (probed, seen) = (calibration.clone(), failed.clone());
    pad.add_probe(gst::PadProbeType::BUFFER, move |pad, info| {
        let mut seen = seen.lock().unwrap();
        if probed.lock().unwrap().frames() >= target {
            return gst::PadProbeReturn::Drop;
        }
        let Some(buffer) = info.buffer() else {
            return gst::PadProbeReturn::Ok;
        };
        let frame = pad
            .current_caps()
            .ok_or("no caps".to_owned())
            .and_then(|caps| gst_video::VideoInfo::from_caps(&caps).map_err(|e| e.to_string()))
            .and_then(|vinfo| {
                gst_video::VideoFrameRef::from_buffer_ref_readable(buffer, &vinfo)
                    .map_err(|e| e.to_string())
            });
        let added = frame.and_then(|frame| {
            let view = crate::video::view(&frame)?;
            probed
                .lock()
                .unwrap()
                .take(&view)
                .map_err(|e| e.to_string())
        });
        if let Err(e) = added {
            *seen = Some(e);
        }
        gst::PadProbeReturn::Ok
    });
    pipeline
        .set_state(gst::State::Playing)
        .map_err(|e| fail(&e))?;
    let bus = pipeline.bus().expect("a bus");
    let mut result = Ok(());
    // Until the end of the file, an error, or enough frames (checked between messages).
    loop {
        match bus
            .timed_pop(gst::ClockTime::from_mseconds(100))
            .as_ref()
            .map(|m| m.view())
        {
            Some(gst::MessageView::Eos(..)) => break,
            Some(gst::MessageView::Error(err)) => {
                result = Err(fail(&err.error()));
                break;
            }
            _ => {}
        }
        let failed = failed.lock().unwrap().is_some();
        if calibration.lock().unwrap().frames() >= target || failed {
            break;
        }
    }
    let _ = pipeline.set_state(gst::State::Null);
    if let Some(e) = failed.lock().unwrap().take() {
        return Err(fail(&e));
    }
    result
}
