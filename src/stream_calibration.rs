// SPDX-License-Identifier: MPL-2.0
//! Calibration on the stream: an int8 or FP8 element given no `calibration-location`
//! classifies in fp16 while its first frames (`calibration-frames`) are calibrated on, then
//! switches to the quantized engine as a live model update does. The table is kept in the
//! engine cache under a name made of the model and the preprocessing, so later starts find it
//! and build the quantized engine at once.
//!
//! The streaming thread only preprocesses a frame when the calibration thread is waiting for
//! one (each frame runs through the model's f32 CPU plan there, far slower than the stream),
//! so frames are sampled from the stream rather than held up. Elements that share an engine
//! share one calibration.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::calibrate;
use crate::engine::calibration::Calibration;
use crate::engine::frame::FrameView;
use crate::engine::{Backend, EngineOptions, Precision};
use crate::preprocess::{Crop, InputSpec, PreprocessOptions, Preprocessor};

/// What an int8 or FP8 engine without `calibration-location` is built with.
pub enum Plan {
    /// The table an earlier calibration on the stream left in the cache.
    Table(PathBuf),
    /// None yet: fp16 while this calibration runs.
    Calibrate(Arc<StreamCalibration>),
}

/// A calibration on the frames of one or more streams, on a thread of its own.
pub struct StreamCalibration {
    /// Where the table goes, in the engine cache.
    table: PathBuf,
    /// The calibration thread's mailbox: one frame at a time; `None` once it has enough.
    sender: Mutex<Option<SyncSender<Vec<f32>>>>,
    /// Whether the thread is busy with a frame (the streaming thread then hands none).
    busy: Arc<AtomicBool>,
    /// The frames' preprocessing, as the engine's: its options, and the preprocessor made
    /// for the model input by the first stream that offers a frame.
    preprocess: PreprocessOptions,
    preprocessor: Mutex<Option<Preprocessor>>,
    /// What it ended with: the table's summary, or why there is none.
    outcome: OnceLock<Result<String, String>>,
}

/// The calibrations running in this process, by table: streams of one engine share one.
static RUNNING: Mutex<Vec<Weak<StreamCalibration>>> = Mutex::new(Vec::new());

/// The plan for an int8 or FP8 engine of `options` on `backend` that has no calibration table:
/// `None` where calibration on the stream does not apply (another precision, a table or
/// frames given, a backend that runs f32, no GPU for `auto`). `frames`: how many frames to
/// calibrate on; `dir`: the engine cache.
pub fn plan(
    options: &EngineOptions,
    backend: Backend,
    frames: usize,
    dir: &Path,
) -> Result<Option<Plan>, String> {
    let quantized = options.precision.quant_format().is_some();
    let gpu = match backend {
        Backend::Cuda => true,
        Backend::Auto => crate::engine::cuda::gpu_count() > 0,
        Backend::Cpu | Backend::Kserve | Backend::Tensorrt => false,
    };
    if !quantized || options.calibration.is_some() || !gpu {
        return Ok(None);
    }
    let table = calibrate::cached_table(options, dir, &format!("stream {frames}"), &[])?;
    // Looked for under the lock: a calibration that has just written it is then seen.
    let mut running = RUNNING.lock().unwrap();
    if calibrate::is_table(&table) {
        calibrate::mark_used(&table);
        return Ok(Some(Plan::Table(table)));
    }
    running.retain(|c| c.strong_count() > 0);
    // A failed one is not joined: this start tries again.
    let same =
        |c: &Arc<StreamCalibration>| c.table == table && !matches!(c.outcome(), Some(Err(_)));
    if let Some(c) = running.iter().filter_map(Weak::upgrade).find(same) {
        return Ok(Some(Plan::Calibrate(c)));
    }
    let calibration = StreamCalibration::start(options, table, frames)?;
    running.push(Arc::downgrade(&calibration));
    Ok(Some(Plan::Calibrate(calibration)))
}

/// `options` of an engine that runs while the calibration does: fp16, where it was asked for
/// int8 or FP8.
pub fn meanwhile(options: &EngineOptions) -> EngineOptions {
    EngineOptions {
        precision: Precision::Fp16,
        ..options.clone()
    }
}

impl StreamCalibration {
    /// Starts the calibration thread of `options.model` for `frames` frames, the table to
    /// be written to `table`.
    fn start(options: &EngineOptions, table: PathBuf, frames: usize) -> Result<Arc<Self>, String> {
        let (sender, frames_in) = std::sync::mpsc::sync_channel(1);
        let calibration = Arc::new(StreamCalibration {
            table: table.clone(),
            sender: Mutex::new(Some(sender)),
            busy: Arc::new(AtomicBool::new(false)),
            preprocess: options.preprocess.clone(),
            preprocessor: Mutex::new(None),
            outcome: OnceLock::new(),
        });
        let (weak, busy, options) = (
            Arc::downgrade(&calibration),
            calibration.busy.clone(),
            options.clone(),
        );
        std::thread::Builder::new()
            .name("trtclassify-calibrate".into())
            .spawn(move || {
                let outcome = calibrate_on(&options, frames_in, &busy, frames, &table);
                match weak.upgrade() {
                    Some(calibration) => {
                        // Frames offered from now on would wait for nobody.
                        calibration.sender.lock().unwrap().take();
                        let _ = calibration.outcome.set(outcome);
                    }
                    None => match outcome {
                        Ok(summary) => log::info!(target: crate::engine::LOG_TARGET, "{summary}"),
                        Err(e) => log::info!(target: crate::engine::LOG_TARGET, "calibration on the stream stopped: {e}"),
                    },
                }
            })
            .map_err(|e| format!("cannot start the calibration thread: {e}"))?;
        Ok(calibration)
    }

    /// The table it writes.
    pub fn table(&self) -> &Path {
        &self.table
    }

    /// Whether it takes a frame now: it is running and not busy with the last one.
    pub fn wants_frame(&self) -> bool {
        self.outcome.get().is_none() && !self.busy.load(Ordering::Acquire)
    }

    /// Hands `crop` of `frame` to the calibration where it wants one (`wants_frame`),
    /// preprocessed as the engine of input `input` preprocesses it; a frame it is too busy
    /// for is skipped.
    pub fn offer(&self, frame: &FrameView, crop: Crop, input: InputSpec) -> Result<(), String> {
        if !self.wants_frame() {
            return Ok(());
        }
        // Another stream preprocessing a frame for it: this one is not needed.
        let Ok(mut preprocessor) = self.preprocessor.try_lock() else {
            return Ok(());
        };
        if preprocessor.is_none() {
            *preprocessor = Some(Preprocessor::new(self.preprocess.clone(), input)?);
        }
        let mut values = vec![0.0; input.frame_len()];
        (preprocessor.as_mut().expect("made above"))
            .run(frame, &[crop], &mut values)
            .map_err(|e| e.to_string())?;
        drop(preprocessor);
        let sender = self.sender.lock().unwrap();
        let Some(sender) = sender.as_ref() else {
            return Ok(());
        };
        self.busy.store(true, Ordering::Release);
        match sender.try_send(values) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Ok(()),
            Err(TrySendError::Disconnected(_)) => {
                self.busy.store(false, Ordering::Release);
                Ok(())
            }
        }
    }

    /// How it ended, once it has: a summary of the table, or why there is none.
    pub fn outcome(&self) -> Option<&Result<String, String>> {
        self.outcome.get()
    }
}

/// The calibration thread: takes frames from `frames_in` until the table has `frames`, then
/// writes it (and its held-out frames) to `table`.
fn calibrate_on(
    options: &EngineOptions,
    frames_in: Receiver<Vec<f32>>,
    busy: &AtomicBool,
    frames: usize,
    table: &Path,
) -> Result<String, String> {
    let mut calibration = Calibration::new(options).map_err(|e| e.to_string())?;
    let report = |msg: &str| options.progress.report(msg);
    report(&format!(
        "precision={}: no calibration-location: calibrating on {frames} frames of the stream, fp16 until then",
        options
            .precision
            .quant_format()
            .map(|f| f.to_string())
            .unwrap_or_default()
    ));
    while calibration.frames() < frames {
        busy.store(false, Ordering::Release);
        let Ok(input) = frames_in.recv() else {
            return Err(format!(
                "the stream stopped after {} of {frames} calibration frames",
                calibration.frames()
            ));
        };
        calibration.take_input(&input).map_err(|e| e.to_string())?;
        if calibration.frames().is_multiple_of(32) {
            report(&format!(
                "calibration: {} of {frames} frames",
                calibration.frames()
            ));
        }
    }
    drop(frames_in);
    let done = calibrate::keep(table, |partial| calibrate::save(&calibration, partial))?;
    Ok(format!(
        "calibrated {} layers on {} frames of the stream ({} held out for the accuracy guard): {}",
        done.table.nodes.len(),
        done.table.frames,
        done.held_out,
        table.display()
    ))
}
