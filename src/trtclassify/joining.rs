// SPDX-License-Identifier: MPL-2.0
//! Getting an engine: at start, and again while running when a property that shapes it
//! changes (a live model update).
//!
//! A live update builds (or joins) the new engine on a thread of its own, with progress
//! messages as at start, while the old one goes on classifying. The streaming thread switches
//! between batches, at its next frame: the old engine's partial batch runs, its frames leave
//! with their results, and every later frame goes to the new engine. A model that fails to
//! load or build is a warning, and the old engine goes on. Elements that share an engine move
//! to another only by their own update: each element's key decides which instance it joins,
//! so elements that all changed to the same settings share the new engine, and the others keep
//! the old one.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;

use super::imp::{CAT, DEVICE_FRAMES_NO, DEVICE_FRAMES_YES, TrtClassify};
use super::settings::Settings;
use super::state::{Outputs, State};
use super::timer::BatchTimer;
use crate::engine::{self, EngineError, ModelError, ModelInfo};
use crate::instance::{self, InstanceKey, Joined};
use crate::outputs::labels::Labels;
use crate::outputs::results::ResultsWriter;
use crate::stream_calibration::{self, Plan, StreamCalibration};

/// Why an engine could not be made: the error `start()` fails with, and its text for the
/// warning of a live update that failed.
pub(super) struct Problem {
    pub(super) error: gst::ErrorMessage,
    pub(super) text: String,
}

impl Problem {
    fn new<T: gst::MessageErrorDomain>(kind: T, text: String) -> Self {
        Self {
            error: gst::ErrorMessage::new(&kind, Some(&text), None, file!(), "", line!()),
            text,
        }
    }
}

/// An engine joined for the element's settings, with what goes with it; what `start()`
/// installs, or what a live update hands to the streaming thread.
pub(super) struct Prepared {
    settings: Settings,
    stream: instance::Stream,
    outputs: Outputs,
    timer: Option<Arc<BatchTimer>>,
    joined: Joined,
    ready_in: Duration,
    /// The GPU it was built for.
    gpu: u32,
    /// The calibration on the stream that a quantized engine waits for.
    calibrating: Option<Arc<StreamCalibration>>,
}

/// Live updates in flight: the latest asked for, and the engine built for it.
#[derive(Default)]
pub(super) struct Updates {
    /// Counts the updates asked for (and starts and stops): a build for an older one is
    /// dropped when it is done.
    generation: u64,
    pending: Option<Prepared>,
}

impl TrtClassify {
    /// The engine instance the element joins at start with its properties as they are now.
    pub(crate) fn instance_key(&self) -> Result<InstanceKey, gst::ErrorMessage> {
        let settings = self.settings.lock().unwrap().clone();
        settings
            .instance_key(engine::Progress::default(), self.choose_gpu(&settings))
            .map_err(|text| Problem::new(gst::LibraryError::Settings, text).error)
    }

    /// Loads the model and builds (or joins) the engine; `start()` wraps it in progress
    /// messages.
    pub(super) fn start_engine(&self) -> Result<(), gst::ErrorMessage> {
        self.forget_updates();
        let settings = self.settings.lock().unwrap().clone();
        let prepared = self.prepare(settings, None).map_err(|p| p.error)?;
        *self.stats.lock().unwrap() = Default::default();
        let state = self.install(prepared, None);
        *self.state.lock().unwrap() = Some(state);
        Ok(())
    }

    /// Drops a live update in flight, and the engine built for it (a stop, a new start).
    pub(super) fn forget_updates(&self) {
        let pending = {
            let mut updates = self.updates.lock().unwrap();
            updates.generation += 1;
            updates.pending.take()
        };
        drop(pending);
    }

    /// Joins the engine for `settings`, with its labels, results file and timer (`timer`:
    /// the running one, which a live update keeps).
    fn prepare(
        &self,
        settings: Settings,
        timer: Option<Arc<BatchTimer>>,
    ) -> Result<Prepared, Problem> {
        let gpu = self.choose_gpu(&settings);
        let key = settings
            .instance_key(self.progress_reporter(), gpu)
            .map_err(|text| Problem::new(gst::LibraryError::Settings, text))?;
        let (key, calibrating) = self.calibration_plan(key, &settings)?;
        let location = settings.model_location();
        let labels = load_labels(&settings)?;
        // The timer thread exists before the engine is joined: another stream's batch can
        // wake it as soon as this element is in.
        let timer = match (settings.batches(), timer) {
            (false, _) => None,
            (true, Some(timer)) => Some(timer),
            (true, None) => Some(self.spawn_timer()?),
        };
        let started = Instant::now();
        let frames = settings.calibration_frames as usize;
        let (stream, joined) = self.join_engine(key, &location, frames, waker(timer.as_ref()))?;
        let ready_in = started.elapsed();
        let info = stream.info();
        self.check_labels(&settings, &labels, info);
        let results = open_results(&settings)?;
        let outputs = Outputs::new(
            &location,
            self.obj().name().to_string(),
            labels,
            settings.apply_softmax(info.outputs_probabilities),
            results,
        );
        Ok(Prepared {
            settings,
            stream,
            outputs,
            timer,
            joined,
            ready_in,
            gpu,
            calibrating,
        })
    }

    /// `key` for an int8 or FP8 engine without `calibration-location`: with the table an
    /// earlier calibration on the stream left in the engine cache, or in fp16 while a
    /// calibration on this stream's frames runs (`stream_calibration`).
    fn calibration_plan(
        &self,
        mut key: InstanceKey,
        settings: &Settings,
    ) -> Result<(InstanceKey, Option<Arc<StreamCalibration>>), Problem> {
        let plan = stream_calibration::plan(
            &key.options,
            key.backend,
            settings.calibration_frames as usize,
            &engine::cuda::cache::dir(),
        )
        .map_err(|text| Problem::new(gst::LibraryError::Settings, text))?;
        Ok(match plan {
            None => (key, None),
            Some(Plan::Table(table)) => {
                gst::info!(
                    CAT,
                    imp = self,
                    "calibration table of the stream: {}",
                    table.display()
                );
                key.options.calibration = Some(table);
                (key, None)
            }
            Some(Plan::Calibrate(calibration)) => {
                let format = key.options.precision.quant_format();
                gst::element_imp_info!(
                    self,
                    gst::LibraryError::Settings,
                    [
                        "precision={}: no calibration-location: fp16 while calibrating on {} frames of the stream (the table goes to {})",
                        format.map(|f| f.to_string()).unwrap_or_default(),
                        settings.calibration_frames,
                        calibration.table().display()
                    ]
                );
                key.options = stream_calibration::meanwhile(&key.options);
                (key, Some(calibration))
            }
        })
    }

    /// Makes the state of a prepared engine, and tells queries and `stats` about it.
    fn install(&self, prepared: Prepared, old: Option<&State>) -> State {
        let Prepared {
            settings,
            stream,
            outputs,
            timer,
            joined,
            ready_in,
            gpu,
            calibrating,
        } = prepared;
        self.publish_model_info(stream.info());
        let gpu = (stream.info().backend == engine::Backend::Cuda).then_some(gpu);
        if gpu.is_some() {
            *self.gpu.lock().unwrap() = gpu;
        }
        let location = settings.model_location();
        self.stats
            .lock()
            .unwrap()
            .engine(&location, &stream, gpu, joined, ready_in);
        let mut state = State::new(stream, &settings, timer, outputs);
        state.calibrating = calibrating;
        if let Some(old) = old {
            state.input.info = old.input.info.clone();
        }
        state
    }

    /// Builds (or joins) the engine for the settings as they are now on a thread of its own,
    /// for the streaming thread to switch to (`apply_update`); said at once by a warning
    /// where the thread cannot start.
    pub(super) fn schedule_update(&self, property: &str) {
        let generation = {
            let mut updates = self.updates.lock().unwrap();
            updates.generation += 1;
            updates.generation
        };
        gst::info!(
            CAT,
            imp = self,
            "{property} changed while running: preparing the engine for the new settings"
        );
        let element = self.obj().downgrade();
        let spawned = std::thread::Builder::new()
            .name("trtclassify-update".into())
            .spawn(move || {
                if let Some(element) = element.upgrade() {
                    element.imp().build_update(generation);
                }
            });
        if let Err(e) = spawned {
            gst::element_imp_warning!(
                self,
                gst::CoreError::Thread,
                [
                    "cannot start the thread that builds the engine for the new {}: {}; the running engine goes on",
                    property,
                    e
                ]
            );
        }
    }

    /// The live update's thread: prepares the engine, and hands it to the streaming thread
    /// unless a newer update (or a stop) came meanwhile.
    fn build_update(&self, generation: u64) {
        let settings = self.settings.lock().unwrap().clone();
        // The running timer goes on serving the new engine: frames held by the old one may
        // still wait for it.
        let timer = self
            .state
            .lock()
            .unwrap()
            .as_ref()
            .and_then(|s| s.queue.timer.clone());
        let prepared = match self.prepare(settings, timer) {
            Ok(prepared) => prepared,
            Err(problem) => {
                self.post_progress(gst::ProgressType::Error, "engine build failed");
                gst::element_imp_warning!(
                    self,
                    gst::LibraryError::Settings,
                    [
                        "the new settings cannot be applied: {}; the running engine goes on",
                        problem.text
                    ]
                );
                return;
            }
        };
        self.post_progress(gst::ProgressType::Complete, "engine ready");
        let superseded = {
            let mut updates = self.updates.lock().unwrap();
            match updates.generation == generation {
                true => updates.pending.replace(prepared),
                false => Some(prepared),
            }
        };
        drop(superseded);
    }

    /// Switches to the engine of a live update, if one is ready: the old engine's held frames
    /// get their results first (their partial batch runs now), then the new one takes over.
    /// On the streaming thread, between two frames.
    pub(super) fn apply_update(&self, state: &mut State) -> Result<(), gst::FlowError> {
        let Some(prepared) = self.updates.lock().unwrap().pending.take() else {
            return Ok(());
        };
        let tunables = prepared.settings.tunables;
        if state.queue.batcher.unscored() > 0 {
            state.stream.run_now(None);
        }
        self.collect(state, &tunables)?;
        if state.queue.batcher.unscored() > 0 {
            let problem = format!(
                "{} frames were given to the old engine and never came back",
                state.queue.batcher.unscored()
            );
            return Err(self.fail(state, &problem));
        }
        let reads_device_frames = state.stream.info().reads_device_frames;
        let mut new = self.install(prepared, Some(state));
        // Frames numbered on, the last result carried until the new engine's first, the
        // frames already sent on (`ready`) still to leave.
        std::mem::swap(&mut new.queue.batcher, &mut state.queue.batcher);
        std::mem::swap(&mut new.queue.ready, &mut state.queue.ready);
        new.outputs.last = std::mem::take(&mut state.outputs.last);
        let old = std::mem::replace(state, new);
        gst::info!(
            CAT,
            imp = self,
            "switched to the engine for {} ({:?}, batch {})",
            state.outputs.model_name,
            state.stream.info().backend,
            state.stream.batch_size()
        );
        if state.stream.info().reads_device_frames != reads_device_frames {
            // Whether CUDA memory is read where it is changed: upstream may choose again.
            self.obj().reconfigure_sink();
        }
        // Leaving the old engine may free it (GPU memory, threads): not on this thread.
        let _ = std::thread::Builder::new()
            .name("trtclassify-drop".into())
            .spawn(move || {
                drop(old);
                instance::return_freed_memory();
            });
        Ok(())
    }

    /// The batch-timeout thread, for elements whose frames wait for batch-mates.
    fn spawn_timer(&self) -> Result<Arc<BatchTimer>, Problem> {
        let element = self.obj().downgrade();
        let timer = BatchTimer::spawn(move || {
            if let Some(element) = element.upgrade() {
                element.imp().on_timer();
            }
        })
        .map_err(|e| {
            Problem::new(
                gst::CoreError::Thread,
                format!("cannot start the batch timer: {e}"),
            )
        })?;
        Ok(Arc::new(timer))
    }

    /// Joins (or builds) the shared engine for `key`, and says which it did.
    fn join_engine(
        &self,
        key: InstanceKey,
        location: &str,
        frames: usize,
        wake: instance::Waker,
    ) -> Result<(instance::Stream, Joined), Problem> {
        let started = Instant::now();
        let (backend, options) = (key.backend, key.options.clone());
        let (stream, joined) = instance::join(key, wake, move || {
            // A calibration-location of frames, not a table: the GPU engine's table is made
            // (or found in the engine cache) first. The CPU backend runs f32 anyway.
            if matches!(backend, engine::Backend::Cpu | engine::Backend::Kserve) {
                return engine::build(backend, &options);
            }
            let cache = engine::cuda::cache::dir();
            let options = crate::calibrate::with_table(&options, &cache, frames, &mut |msg| {
                options.progress.report(msg)
            })
            .map_err(|reason| EngineError::Build {
                path: options.model.clone(),
                reason,
            })?;
            engine::build(backend, &options)
        })
        .map_err(start_problem)?;
        let info = stream.info();
        match joined {
            Joined::Built => gst::info!(
                CAT,
                imp = self,
                "{location}: {:?} engine built in {:.1?}: {} classes, input {}x{}",
                info.backend,
                started.elapsed(),
                info.num_classes,
                info.input.width,
                info.input.height
            ),
            Joined::Shared => gst::info!(
                CAT,
                imp = self,
                "{location}: sharing the {:?} engine of {} other element(s)",
                info.backend,
                stream.streams() - 1
            ),
        }
        if let Some(note) = &info.precision_note {
            gst::element_imp_warning!(self, gst::LibraryError::Settings, ["{location}: {note}"]);
        }
        if let Some(report) = &info.quant_report {
            gst::element_imp_info!(self, gst::LibraryError::Settings, ["{location}: {report}"]);
        }
        Ok((stream, joined))
    }

    /// Warns when the labels file does not name as many classes as the model scores.
    fn check_labels(&self, settings: &Settings, labels: &Labels, info: &ModelInfo) {
        if !labels.is_empty() && labels.len() != info.num_classes {
            gst::element_imp_warning!(
                self,
                gst::LibraryError::Settings,
                [
                    "{}: {} labels for {} classes; numbers stand in for missing labels",
                    settings.labels_location.as_deref().unwrap_or_default(),
                    labels.len(),
                    info.num_classes
                ]
            );
        }
    }

    /// What the running engine tells queries and caps: `num-classes`, whether frames in
    /// CUDA memory are read where they are, and the batches it holds.
    fn publish_model_info(&self, info: &ModelInfo) {
        self.num_classes
            .store(info.num_classes as u32, Ordering::Relaxed);
        self.batches_in_flight
            .store(info.batches_in_flight as u32, Ordering::Relaxed);
        self.device_frames.store(
            match info.reads_device_frames {
                true => DEVICE_FRAMES_YES,
                false => DEVICE_FRAMES_NO,
            },
            Ordering::Relaxed,
        );
    }

    /// Posts a progress message (GStreamer's `GST_MESSAGE_PROGRESS`) about the engine build.
    pub(super) fn post_progress(&self, kind: gst::ProgressType, text: &str) {
        let obj = self.obj();
        let msg = gst::message::Progress::builder(kind, "engine-build", text)
            .src(&*obj)
            .build();
        let _ = obj.post_message(msg);
    }

    /// Turns the engine's progress reports into bus messages.
    fn progress_reporter(&self) -> engine::Progress {
        self.post_progress(gst::ProgressType::Start, "building the engine");
        let element = self.obj().downgrade();
        engine::Progress::new(move |text| {
            if let Some(element) = element.upgrade() {
                element
                    .imp()
                    .post_progress(gst::ProgressType::Continue, text);
            }
        })
    }
}

/// `labels-location` read, or no labels (class numbers stand in).
fn load_labels(settings: &Settings) -> Result<Labels, Problem> {
    match &settings.labels_location {
        Some(path) => Labels::load(path.as_ref())
            .map_err(|e| Problem::new(gst::ResourceError::OpenRead, e.to_string())),
        None => Ok(Labels::default()),
    }
}

/// `results-location` opened for appending, with its path for messages.
fn open_results(settings: &Settings) -> Result<Option<(String, ResultsWriter)>, Problem> {
    let Some(path) = &settings.results_location else {
        return Ok(None);
    };
    let writer = ResultsWriter::open(path).map_err(|e| {
        Problem::new(
            gst::ResourceError::OpenWrite,
            format!("{path}: cannot open the results file: {e}"),
        )
    })?;
    Ok(Some((path.clone(), writer)))
}

/// What the shared engine calls when it has run a batch with this element's frames in it
/// from another stream's thread: a wake of the timer thread.
fn waker(timer: Option<&Arc<BatchTimer>>) -> instance::Waker {
    match timer {
        Some(timer) => {
            let timer = Arc::downgrade(timer);
            Arc::new(move || {
                if let Some(timer) = timer.upgrade() {
                    timer.wake();
                }
            })
        }
        // Batches of one run in the pushing stream's own call: nothing to wake.
        None => Arc::new(|| ()),
    }
}

/// The error for an engine that could not be built.
fn start_problem(err: EngineError) -> Problem {
    let text = err.to_string();
    match &err {
        EngineError::Model(ModelError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            Problem::new(gst::ResourceError::NotFound, text)
        }
        EngineError::Model(ModelError::Io { .. }) => {
            Problem::new(gst::ResourceError::OpenRead, text)
        }
        EngineError::Model(_) => Problem::new(gst::StreamError::WrongType, text),
        EngineError::Unavailable { .. } => Problem::new(gst::LibraryError::Init, text),
        EngineError::UnsupportedOps { .. } => Problem::new(gst::CoreError::NotImplemented, text),
        _ => Problem::new(gst::LibraryError::Settings, text),
    }
}
