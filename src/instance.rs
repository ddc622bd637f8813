// SPDX-License-Identifier: MPL-2.0
//! Model instances: one engine shared by every element of the process with the same
//! `model-instance-id` and the same engine settings (and the same model file on disk), so
//! that an added camera costs its frames, not another engine, and the frames of all cameras
//! fill the engine's batches.
//!
//! Each element joins an instance as a *stream*. A stream's fresh frames are pushed into the
//! engine as they arrive, in any interleaving with the other streams' frames; when a batch is
//! full (or a stream asks for its frames: batch timeout, serialized event, drain) the engine
//! runs everything pushed so far and each stream's scores go to its own mailbox, in the order
//! of its frames. A stream whose scores arrive while its own thread is elsewhere is woken
//! through the callback it joined with. Nothing here knows about GStreamer elements.
//!
//! Streams take turns at the engine (`Gate`): of those waiting, the one served longest ago
//! goes first, so that when the engine has more frames than it can classify, each stream gets
//! its share. The engine is held while a batch runs; a stream of a live source gives up
//! waiting for its turn at a deadline (`Pushed::Busy`), so that an overloaded engine never
//! holds a camera back. Mailboxes have locks of their own: taking scores, or giving up frames
//! whose deadline passed (`Stream::abandon`), never waits for a batch.
//!
//! An engine whose batches run while the next gather (the GPU's: `batches_in_flight` more
//! than one) hands their scores out as they finish: at the next push, or at once through
//! the instance's collector thread, which the engine signals when a batch is done.
//!
//! Faults stay where they happen: a push refused for its own frame fails that frame only; a
//! failed batch fails the frames in it, and the engine is built again for the streams that go
//! on (at once the first time, then after a growing pause while it keeps failing).
//!
//! A flushing stream starts a new epoch: scores of frames pushed before it are dropped, and
//! the other streams' frames are not touched. A stream that leaves (the element stops) drops
//! its frames' scores in the same way; the last stream to leave drops the engine.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::MutexGuard;

use crate::engine::frame::FrameView;
use crate::engine::{
    Backend, BatchDone, DevicePlanes, Engine, EngineError, EngineOptions, ModelInfo, unpanic,
};
use crate::logging::ENGINE_CAT as CAT;
use crate::preprocess::Crop;

/// What makes two elements' engines interchangeable.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceKey {
    /// The elements' `model-instance-id`.
    pub id: String,
    /// The elements' `backend` property as set, `Auto` unresolved.
    pub backend: Backend,
    /// The model and everything else the engine is built from.
    pub options: EngineOptions,
    /// The frames an int8 or FP8 engine is calibrated on (`calibration-frames`); 0 for the
    /// other precisions, which it does not shape.
    pub calibration_frames: u32,
    /// The model file as it was on disk when the key was made: an element that loads a model
    /// file replaced since gets an engine of its own, not the one built from the old file.
    pub model_file: Option<FileStamp>,
}

/// A file's identity and version as its metadata tells them, without reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStamp {
    len: u64,
    modified: Option<SystemTime>,
    /// Device and inode: a file replaced by a rename is another file, even at the same size
    /// and time.
    id: (u64, u64),
}

impl FileStamp {
    /// The stamp of the file at `path`; `None` where it cannot be read (the engine build
    /// then says why).
    pub fn of(path: &Path) -> Option<Self> {
        let meta = std::fs::metadata(path).ok()?;
        #[cfg(unix)]
        let id = {
            use std::os::unix::fs::MetadataExt;
            (meta.dev(), meta.ino())
        };
        #[cfg(not(unix))]
        let id = (0, 0);
        Some(Self {
            len: meta.len(),
            modified: meta.modified().ok(),
            id,
        })
    }
}

/// Scores of one frame, or why its batch failed (shared by the streams of that batch).
pub type Scores = Result<Vec<f32>, Arc<EngineError>>;

/// Called when scores for a stream arrive from another stream's thread; it runs with the
/// instance locked, so it must only signal (never block or call back into the instance).
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Makes the instance's engine: at the first join, and again after the engine failed.
type Build = Box<dyn Fn() -> Result<Box<dyn Engine>, EngineError> + Send + Sync>;

type StreamId = u64;

/// A frame in GPU memory (its buffer), kept from its push until the engine can no longer
/// read it: its batch's scores are handed out, or the engine has forgotten it. The GPU reads
/// such a frame when it gets to the frame's preprocessing, after the push returns; a frame
/// may leave before that (its stream gave up on it, flushed, or stopped), and without this
/// its decoder could reuse or free the memory under the read.
pub type KeptFrame = Arc<dyn std::any::Any + Send + Sync>;

/// A frame's place in the engine's batch: whose it is, and of which epoch.
#[derive(Clone)]
struct Ticket {
    stream: StreamId,
    epoch: u64,
    /// Kept until the ticket is dropped; see `KeptFrame`.
    _frame: Option<KeptFrame>,
}

/// A stream's scores, kept apart from the engine's lock.
struct Slot {
    mailbox: Mutex<Mailbox>,
    wake: Waker,
}

#[derive(Default)]
struct Mailbox {
    /// Frames pushed in an earlier epoch (before a flush) get no scores.
    epoch: u64,
    scores: Vec<Scores>,
    /// Scores still to come for frames the stream gave up on (`Stream::abandon`): dropped.
    skip: usize,
}

impl Slot {
    fn mailbox(&self) -> std::sync::MutexGuard<'_, Mailbox> {
        // Nothing that can panic runs under this lock.
        self.mailbox.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Inner {
    /// `None` before the first build, after the last stream left, and after a failure until
    /// the engine is built again.
    engine: Option<Box<dyn Engine>>,
    build: Option<Build>,
    /// What the first engine was built as: a rebuilt engine must be the same model.
    built_info: Option<ModelInfo>,
    /// Frames pushed into the engine and not yet run.
    queued: Vec<Ticket>,
    streams: HashMap<StreamId, Arc<Slot>>,
    next_stream: StreamId,
    /// The engine failed: why, and when it may be built again.
    fault: Option<(Arc<EngineError>, Instant)>,
    /// Failures since the last batch that ran, for the pause before the next rebuild.
    failures: u32,
    /// What an engine with batches in flight calls when one has finished: wakes the
    /// collector (made with the first such engine, given to each rebuilt one).
    batch_done: Option<BatchDone>,
}

/// Counts kept outside the lock, for `stats` while a batch runs.
#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    items: AtomicU64,
    /// The time of a batch, a moving average in nanoseconds.
    batch_ns: AtomicU64,
    rebuilds: AtomicU64,
    failures: AtomicU64,
    streams: AtomicUsize,
}

/// An engine and the streams that feed it.
pub struct Instance {
    key: InstanceKey,
    /// Held by the stream whose turn it is (see `gate`), briefly to join or leave, and by the
    /// collector to hand out finished batches.
    inner: parking_lot::Mutex<Inner>,
    /// Whose turn it is at the engine.
    gate: Gate,
    counters: Counters,
    collector: Arc<Collector>,
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.collector.close();
    }
}

/// Wakes the collector thread of an instance whose engine runs batches in flight: a batch
/// that finished is handed out at once, not at the next push (which may be a frame
/// interval away, or never come before `batch-timeout`).
#[derive(Default)]
struct Collector {
    state: Mutex<CollectorState>,
    wake: Condvar,
}

#[derive(Default)]
struct CollectorState {
    /// A batch finished since the collector last looked.
    due: bool,
    /// The instance is gone.
    closed: bool,
}

impl Collector {
    fn state(&self) -> std::sync::MutexGuard<'_, CollectorState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The engine's `BatchDone`: only signals (it runs on the GPU driver's thread).
    fn signal(&self) {
        self.state().due = true;
        self.wake.notify_one();
    }

    fn close(&self) {
        self.state().closed = true;
        self.wake.notify_one();
    }

    /// The collector thread: hands out what finished each time it is signalled, until the
    /// instance is gone.
    fn run(&self, instance: &Weak<Instance>) {
        loop {
            {
                let mut state = self.state();
                while !state.due && !state.closed {
                    state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
                }
                if state.closed {
                    return;
                }
                state.due = false;
            }
            let Some(instance) = instance.upgrade() else {
                return;
            };
            instance
                .inner
                .lock()
                .deliver_ready(&instance.counters, NO_STREAM);
        }
    }
}

/// The caller of a hand-out that is no stream (the collector): every stream is woken.
const NO_STREAM: StreamId = StreamId::MAX;

impl Instance {
    /// Gives `engine` the signal of this instance's collector, whose thread starts with the
    /// first engine that will call it.
    fn adopt(self: &Arc<Self>, inner: &mut Inner, engine: &mut dyn Engine) {
        if engine.info().batches_in_flight <= 1 || inner.batch_done.is_some() {
            return;
        }
        let collector = self.collector.clone();
        let signal: BatchDone = Arc::new(move || collector.signal());
        if !engine.on_batch_done(signal.clone()) {
            return;
        }
        inner.batch_done = Some(signal);
        let weak = Arc::downgrade(self);
        let collector = self.collector.clone();
        let spawned = std::thread::Builder::new()
            .name("trtclassify-collect".into())
            .spawn(move || collector.run(&weak));
        if let Err(e) = spawned {
            // Finished batches are then handed out at the next push or run.
            gst::warning!(CAT, "no thread to collect finished batches: {e}");
        }
    }
}

static INSTANCES: LazyLock<Mutex<Vec<Weak<Instance>>>> = LazyLock::new(Default::default);

/// Whose turn it is at the engine: a stream waits until the engine is free and no stream
/// waiting was served longer ago (first come, first served would let a stream that pushes
/// again at once, its next frame ready, take turn after turn; and a stream of a live source
/// that gave up a turn would come back at the end of the line with a frame late already, and
/// starve). A stream that comes to run a partial batch (its frames' wait for batch-mates is
/// over) goes before those that come to push: the frames in that batch are the engine's work
/// already, and where pushes are slow (uploads that wait for the GPU) a batch could take
/// longer to fill than its frames may wait, and the engine's work on them would be lost.
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    turn: Condvar,
}

#[derive(Default)]
struct GateState {
    /// A stream has the engine.
    busy: bool,
    /// The streams waiting: those that come to run before those that come to push, then by
    /// when each was last served, then by id.
    waiting: BTreeSet<Place>,
}

/// A stream's place in the line: `(0, ..)` to run, `(1, ..)` to push; when it was last
/// served; its id.
type Place = (u8, Instant, StreamId);

/// A stream's turn at the engine; dropping it ends the turn.
struct Turn<'a>(&'a Gate);

impl Gate {
    fn state(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for the turn of the stream at `place`, until `until` at the latest (`None`: as
    /// long as it takes).
    fn enter(&self, place: Place, until: Option<Instant>) -> Option<Turn<'_>> {
        let mut state = self.state();
        state.waiting.insert(place);
        loop {
            if !state.busy && state.waiting.first() == Some(&place) {
                state.waiting.remove(&place);
                state.busy = true;
                return Some(Turn(self));
            }
            state = match until {
                None => self.turn.wait(state).unwrap_or_else(|e| e.into_inner()),
                Some(until) => {
                    let now = Instant::now();
                    if now >= until {
                        state.waiting.remove(&place);
                        drop(state);
                        // It may have been first in line: the next one is now.
                        self.turn.notify_all();
                        return None;
                    }
                    self.turn
                        .wait_timeout(state, until - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.state().busy = false;
        self.0.turn.notify_all();
    }
}

/// A stream's turn at the engine, with the instance locked.
struct Engaged<'a> {
    // Unlocked before the turn ends (fields drop in order).
    inner: MutexGuard<'a, Inner>,
    _turn: Turn<'a>,
}

impl std::ops::Deref for Engaged<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.inner
    }
}

impl std::ops::DerefMut for Engaged<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.inner
    }
}

/// A stream's membership of an instance; leaving is dropping it.
pub struct Stream {
    instance: Arc<Instance>,
    id: StreamId,
    /// When it last had its turn at the engine (see `Gate`).
    served: Mutex<Instant>,
    slot: Arc<Slot>,
    info: ModelInfo,
    batch_size: usize,
    /// Queued items that make the engine run: `batch_size` times the batches the engine may
    /// hold in flight.
    run_at: usize,
    /// The longest this stream waited for the instance's lock, in nanoseconds.
    longest_wait: AtomicU64,
}

/// How `join` got its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Joined {
    /// Built (or loaded from its engine file) by this call.
    Built,
    /// Already running for other streams, which now share it.
    Shared,
}

/// What became of a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// The frame's items are in the engine's batch; their scores will come.
    Queued,
    /// The engine was busy with other streams' batches until the deadline: nothing was
    /// pushed.
    Busy,
}

/// The instance's figures, for the element's `stats`.
#[derive(Debug, Clone, Default)]
pub struct InstanceStats {
    /// Streams sharing the engine.
    pub streams: usize,
    /// The most items a batch holds.
    pub batch_size: usize,
    /// Batches run.
    pub batches: u64,
    /// Items (frames and regions) in them.
    pub items: u64,
    /// The time of a batch (a moving average).
    pub batch_time: Duration,
    /// Times the engine was built again after a failure.
    pub rebuilds: u64,
    /// Batches (or pushes) the engine failed.
    pub failures: u64,
}

impl Instance {
    /// The instance's figures; never waits for a batch.
    pub fn stats(&self) -> InstanceStats {
        let c = &self.counters;
        InstanceStats {
            streams: c.streams.load(Ordering::Relaxed),
            batch_size: self.key.options.batch_size.max(1),
            batches: c.batches.load(Ordering::Relaxed),
            items: c.items.load(Ordering::Relaxed),
            batch_time: Duration::from_nanos(c.batch_ns.load(Ordering::Relaxed)),
            rebuilds: c.rebuilds.load(Ordering::Relaxed),
            failures: c.failures.load(Ordering::Relaxed),
        }
    }
}

/// The streams of the process's GPU engines (backend `cuda`, or `auto`), by GPU: where an
/// element with `gpu-id=-1` goes when its frames do not say.
pub fn streams_per_gpu() -> std::collections::BTreeMap<u32, usize> {
    let mut per_gpu = std::collections::BTreeMap::new();
    let instances = INSTANCES.lock().unwrap_or_else(|e| e.into_inner());
    for instance in instances.iter().filter_map(Weak::upgrade) {
        if !matches!(instance.key.backend, Backend::Cpu | Backend::Kserve) {
            *per_gpu.entry(instance.key.options.gpu_id).or_default() +=
                instance.counters.streams.load(Ordering::Relaxed);
        }
    }
    per_gpu
}

/// Joins the instance for `key`, building its engine with `build` when no stream of the
/// process has it yet. Joiners of an instance whose engine is being built wait for it; a
/// failed build is the failing joiner's error, and the next joiner tries again. `build` is
/// kept to build the engine again after a failure.
pub fn join(
    key: InstanceKey,
    wake: Waker,
    build: impl Fn() -> Result<Box<dyn Engine>, EngineError> + Send + Sync + 'static,
) -> Result<(Stream, Joined), EngineError> {
    let instance = {
        let mut instances = INSTANCES.lock().unwrap_or_else(|e| e.into_inner());
        instances.retain(|w| w.strong_count() > 0);
        match instances
            .iter()
            .filter_map(Weak::upgrade)
            .find(|i| i.key == key)
        {
            Some(instance) => instance,
            None => {
                let instance = Arc::new(Instance {
                    key,
                    inner: parking_lot::Mutex::new(Inner {
                        engine: None,
                        build: None,
                        built_info: None,
                        queued: Vec::new(),
                        streams: HashMap::new(),
                        next_stream: 0,
                        fault: None,
                        failures: 0,
                        batch_done: None,
                    }),
                    gate: Gate::default(),
                    counters: Counters::default(),
                    collector: Default::default(),
                });
                instances.push(Arc::downgrade(&instance));
                instance
            }
        }
    };
    let batch_size = instance.key.options.batch_size.max(1);
    let mut inner = instance.inner.lock();
    let joined = match (&inner.engine, &inner.fault) {
        (Some(_), _) => Joined::Shared,
        // The engine failed: built again now (or the joiner hears why not yet).
        (None, Some(_)) => {
            inner.ensure_engine(&instance.counters).map_err(unshare)?;
            Joined::Built
        }
        (None, None) => {
            let mut engine = build()?;
            instance.adopt(&mut inner, engine.as_mut());
            inner.built_info = Some(engine.info().clone());
            inner.engine = Some(engine);
            inner.build = Some(Box::new(build));
            inner.failures = 0;
            Joined::Built
        }
    };
    let info = inner.engine.as_ref().expect("built above").info().clone();
    let id = inner.next_stream;
    inner.next_stream += 1;
    let slot = Arc::new(Slot {
        mailbox: Mutex::new(Mailbox::default()),
        wake,
    });
    inner.streams.insert(id, slot.clone());
    instance
        .counters
        .streams
        .store(inner.streams.len(), Ordering::Relaxed);
    drop(inner);
    Ok((
        Stream {
            instance,
            id,
            slot,
            served: Mutex::new(Instant::now()),
            run_at: batch_size * info.batches_in_flight.max(1),
            info,
            batch_size,
            longest_wait: AtomicU64::new(0),
        },
        joined,
    ))
}

/// An engine error as the joiner's own.
fn unshare(e: Arc<EngineError>) -> EngineError {
    Arc::try_unwrap(e).unwrap_or_else(|e| EngineError::Inference(e.to_string()))
}

/// How a call into the engine failed.
enum CallError {
    /// There is no engine to call: it failed, and may not be built again yet.
    NoEngine(Arc<EngineError>),
    /// The call returned an error.
    Failed(Arc<EngineError>),
    /// The call panicked: the engine's state is unknown.
    Panicked(Arc<EngineError>),
}

/// The pause before the engine is built again after `failures` failures in a row: none after
/// the first (a fault of one batch), then 1 s, doubling, up to a minute, so that an engine
/// that cannot work does not rebuild in a loop.
fn rebuild_pause(failures: u32) -> Duration {
    match failures {
        0 | 1 => Duration::ZERO,
        n => Duration::from_secs(1 << (n - 2).min(6)).min(Duration::from_secs(60)),
    }
}

impl Inner {
    /// Calls the engine, turning a panic inside it into an error.
    fn call<T>(
        &mut self,
        counters: &Counters,
        f: impl FnOnce(&mut dyn Engine) -> Result<T, EngineError>,
    ) -> Result<T, CallError> {
        self.ensure_engine(counters).map_err(CallError::NoEngine)?;
        let engine = self.engine.as_deref_mut().expect("ensured above");
        let mut panicked = false;
        let result = unpanic(
            || f(engine),
            |panic| {
                panicked = true;
                EngineError::Inference(format!("internal error in the engine: {panic}"))
            },
        );
        result.map_err(|e| match panicked {
            true => CallError::Panicked(Arc::new(e)),
            false => CallError::Failed(Arc::new(e)),
        })
    }

    /// The engine, built again if it failed and its pause is over.
    fn ensure_engine(&mut self, counters: &Counters) -> Result<(), Arc<EngineError>> {
        if self.engine.is_some() {
            return Ok(());
        }
        let Some((error, retry_at)) = self.fault.clone() else {
            return Err(Arc::new(EngineError::Inference(
                "the engine has been dropped".into(),
            )));
        };
        let now = Instant::now();
        if now < retry_at {
            return Err(Arc::new(EngineError::Inference(format!(
                "the engine failed {} times in a row and is built again in {:.1?}; the last failure: {error}",
                self.failures,
                retry_at - now
            ))));
        }
        let Some(build) = &self.build else {
            return Err(error);
        };
        let rebuilt = unpanic(build, |panic| {
            EngineError::Inference(format!("internal error in the engine build: {panic}"))
        })
        .and_then(|engine| match &self.built_info {
            Some(first) if !same_model(first, engine.info()) => Err(EngineError::Inference(
                "the model file changed on disk since the engine was first built; set onnx-location again to load it".into(),
            )),
            _ => Ok(engine),
        });
        match rebuilt {
            Ok(mut engine) => {
                if let Some(signal) = &self.batch_done {
                    // Where it does not take it (a failed context), its scores are handed out
                    // at each push and run instead.
                    engine.on_batch_done(signal.clone());
                }
                gst::info!(CAT, "engine built again after a failure: {error}");
                counters.rebuilds.fetch_add(1, Ordering::Relaxed);
                self.engine = Some(engine);
                self.fault = None;
                Ok(())
            }
            Err(e) => {
                let e = Arc::new(e);
                gst::warning!(CAT, "the engine could not be built again: {e}");
                self.failures += 1;
                self.fault = Some((e.clone(), now + rebuild_pause(self.failures)));
                Err(e)
            }
        }
    }

    /// The engine failed with `error`: it is dropped, to be built again (see
    /// `rebuild_pause`).
    fn failed(&mut self, counters: &Counters, error: Arc<EngineError>) {
        counters.failures.fetch_add(1, Ordering::Relaxed);
        self.failures += 1;
        gst::warning!(
            CAT,
            "the engine failed ({error}); it is built again for the streams that go on"
        );
        self.fault = Some((error, Instant::now() + rebuild_pause(self.failures)));
        if let Some(engine) = self.engine.take() {
            discard_and_drop(engine);
        }
    }

    /// Forgets the frames pushed into the engine.
    fn discard(&mut self, counters: &Counters) {
        if self.engine.is_none() {
            return;
        }
        if let Err(CallError::Panicked(e)) = self.call(counters, |engine| {
            engine.discard();
            Ok(())
        }) {
            self.failed(counters, e);
        }
    }

    /// Runs every queued frame and hands out the scores; wakes the streams that got some,
    /// except `caller`, which collects its own. A failed batch fails its frames, and the
    /// engine is built again before the next. `started`: when the batch's run began, for its
    /// time (an engine may run a full batch within the push that fills it).
    fn run(&mut self, counters: &Counters, caller: StreamId, started: Instant) {
        if self.queued.is_empty() {
            return;
        }
        let tickets = std::mem::take(&mut self.queued);
        // An engine with batches in flight ran one for each model batch of the run.
        let batches = match &self.engine {
            Some(e) if e.info().batches_in_flight > 1 => {
                tickets.len().div_ceil(e.info().model_batch.max(1))
            }
            _ => 1,
        };
        let scores = match self.call(counters, |engine| engine.run_pushed()) {
            Ok(scores) if scores.len() == tickets.len() => {
                self.failures = 0;
                counters.record_batch(batches, tickets.len(), started.elapsed());
                Ok(scores)
            }
            Ok(scores) => Err(Arc::new(EngineError::Inference(format!(
                "the engine returned {} score vectors for {} frames",
                scores.len(),
                tickets.len()
            )))),
            Err(CallError::NoEngine(e)) => Err(e),
            Err(CallError::Failed(e) | CallError::Panicked(e)) => Err(e),
        };
        let scores: Vec<Scores> = match scores {
            Ok(scores) => scores.into_iter().map(Ok).collect(),
            Err(e) => {
                if self.engine.is_some() {
                    self.failed(counters, e.clone());
                }
                tickets.iter().map(|_| Err(e.clone())).collect()
            }
        };
        self.deliver(tickets.into_iter().zip(scores), caller);
    }

    /// Hands out the scores of batches that finished in flight (engines with
    /// `batches_in_flight` above 1), without waiting; wakes the streams that got some,
    /// except `caller`. A batch that failed in flight fails every queued frame, as a failed
    /// run does.
    fn deliver_ready(&mut self, counters: &Counters, caller: StreamId) {
        if self
            .engine
            .as_ref()
            .is_none_or(|e| e.info().batches_in_flight <= 1)
        {
            return;
        }
        let error = match self.call(counters, |engine| engine.take_ready()) {
            Ok(ready) if ready.scores.is_empty() => return,
            Ok(ready) if ready.scores.len() <= self.queued.len() => {
                self.failures = 0;
                counters.record_batch(ready.batches, ready.scores.len(), ready.took);
                let tickets: Vec<Ticket> = self.queued.drain(..ready.scores.len()).collect();
                self.deliver(
                    tickets.into_iter().zip(ready.scores.into_iter().map(Ok)),
                    caller,
                );
                return;
            }
            Ok(ready) => Arc::new(EngineError::Inference(format!(
                "the engine returned {} score vectors for {} frames",
                ready.scores.len(),
                self.queued.len()
            ))),
            Err(CallError::NoEngine(e) | CallError::Failed(e) | CallError::Panicked(e)) => e,
        };
        if self.engine.is_some() {
            self.failed(counters, error.clone());
        }
        let lost = std::mem::take(&mut self.queued);
        self.deliver(lost.into_iter().map(|t| (t, Err(error.clone()))), caller);
    }

    /// Hands each frame's scores to its stream, when the stream is still there and in the
    /// same epoch; wakes each other stream that got any.
    fn deliver(&self, scored: impl IntoIterator<Item = (Ticket, Scores)>, caller: StreamId) {
        let mut woken = Vec::new();
        for (ticket, scores) in scored {
            // Scores mean the GPU has read the frame: released before they are handed out,
            // so that the buffer is its element's alone again when the frame leaves (else
            // attaching the results would copy it).
            let Ticket {
                stream,
                epoch,
                _frame: frame,
            } = ticket;
            drop(frame);
            let Some(slot) = self.streams.get(&stream) else {
                continue;
            };
            let mut mailbox = slot.mailbox();
            if mailbox.epoch != epoch {
                continue;
            }
            if mailbox.skip > 0 {
                mailbox.skip -= 1;
                continue;
            }
            mailbox.scores.push(scores);
            if stream != caller && !woken.contains(&stream) {
                woken.push(stream);
            }
        }
        for id in woken {
            (self.streams[&id].wake)();
        }
    }

    /// Forgets queued frames when none of them will be wanted, so that they take no place in
    /// the next batch.
    fn discard_unwanted(&mut self, counters: &Counters) {
        let wanted = self.queued.iter().any(|t| {
            self.streams
                .get(&t.stream)
                .is_some_and(|s| s.mailbox().epoch == t.epoch)
        });
        if !wanted && !self.queued.is_empty() {
            // The engine first, then the tickets: their frames are released once it is done
            // reading them.
            self.discard(counters);
            self.queued.clear();
        }
    }
}

/// Drops `engine` after it has forgotten its frames (the CUDA engine waits there until the
/// GPU no longer reads them), so that their tickets may release them next. A failed engine
/// may fail its discard or drop too; that is no reason to unwind (nor, from a discard, to
/// drop the engine while unwinding, where a panic in its drop would abort).
fn discard_and_drop(mut engine: Box<dyn Engine>) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.discard()));
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(engine)));
}

/// Whether a rebuilt engine runs the model its streams were told of.
fn same_model(a: &ModelInfo, b: &ModelInfo) -> bool {
    a.input == b.input && a.num_classes == b.num_classes && a.backend == b.backend
}

impl Counters {
    /// `batches` model batches of `items` in all ran in `took`.
    fn record_batch(&self, batches: usize, items: usize, took: Duration) {
        self.batches.fetch_add(batches as u64, Ordering::Relaxed);
        self.items.fetch_add(items as u64, Ordering::Relaxed);
        // A moving average over about the last 8 batches: recent enough to follow a change
        // of load, steady enough not to follow one slow batch.
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .batch_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |avg| {
                Some(match avg {
                    0 => ns,
                    avg => avg - avg / 8 + ns / 8,
                })
            });
    }
}

impl Stream {
    /// Waits for this stream's turn at the engine (`to_run`: to run its partial batch, else
    /// to push), giving up at `until` (`None`: waits as long as it takes); keeps the longest
    /// wait.
    fn engage(&self, to_run: bool, until: Option<Instant>) -> Option<Engaged<'_>> {
        let started = Instant::now();
        let mut served = self.served.lock().unwrap_or_else(|e| e.into_inner());
        let place = (u8::from(!to_run), *served, self.id);
        let turn = self.instance.gate.enter(place, until);
        let waited = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.longest_wait.fetch_max(waited, Ordering::Relaxed);
        if waited > 250_000_000 {
            gst::debug!(
                CAT,
                "stream {} waited {:.1?} for its turn at the engine (until {until:?}, got it: {})",
                self.id,
                started.elapsed(),
                turn.is_some()
            );
        }
        let turn = turn?;
        *served = Instant::now();
        Some(Engaged {
            inner: self.instance.inner.lock(),
            _turn: turn,
        })
    }

    /// The longest this stream has waited for other streams' use of the engine (their pushes
    /// and the batches they run).
    pub fn longest_wait(&self) -> Duration {
        Duration::from_nanos(self.longest_wait.load(Ordering::Relaxed))
    }

    /// The engine's model, input and backend.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The time of one batch, as the last batches took (zero before the first).
    pub fn batch_time(&self) -> Duration {
        Duration::from_nanos(self.instance.counters.batch_ns.load(Ordering::Relaxed))
    }

    /// The instance's figures; never waits for a batch.
    pub fn stats(&self) -> InstanceStats {
        self.instance.stats()
    }

    /// The instance, for its figures after the stream has gone.
    pub fn instance(&self) -> Arc<Instance> {
        self.instance.clone()
    }

    /// The batch size the engine was built for.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Pushes `crops` of a frame in system memory (read within the push); see `push_with`.
    pub fn push(
        &self,
        frame: &FrameView,
        crops: &[Crop],
        until: Option<Instant>,
    ) -> Result<Pushed, Arc<EngineError>> {
        self.push_with(crops.len(), until, None, |engine| engine.push(frame, crops))
    }

    /// Pushes `crops` of a frame in GPU memory, which the engine reads after the push: `kept`
    /// (its buffer) is held until it no longer can (see `KeptFrame`); see `push_with`.
    pub fn push_device(
        &self,
        frame: &DevicePlanes,
        crops: &[Crop],
        until: Option<Instant>,
        kept: KeptFrame,
    ) -> Result<Pushed, Arc<EngineError>> {
        self.push_with(crops.len(), until, Some(kept), |engine| {
            engine.push_device(frame, crops)
        })
    }

    /// Pushes `items` items (crops) of one fresh frame of this stream into the engine; runs
    /// the batch when it is full. Each item gets its own scores, in push order. Gives up with
    /// `Busy` when the engine is not free by `until`.
    ///
    /// A push refused for this frame alone is this stream's error, and the frames queued
    /// before it, of every stream, stay in the batch. A failure that lost them (a model
    /// batch that failed inside the push, a panic) reaches every stream with frames queued,
    /// through their mailboxes, and the engine is built again for the next push.
    fn push_with(
        &self,
        items: usize,
        until: Option<Instant>,
        kept: Option<KeptFrame>,
        push: impl FnOnce(&mut dyn Engine) -> Result<(), EngineError>,
    ) -> Result<Pushed, Arc<EngineError>> {
        if items == 0 {
            return Ok(Pushed::Queued);
        }
        let Some(mut inner) = self.engage(false, until) else {
            return Ok(Pushed::Busy);
        };
        let started = Instant::now();
        let counters = &self.instance.counters;
        let epoch = self.slot.mailbox().epoch;
        let before = inner.queued.len();
        match inner.call(counters, push) {
            Ok(()) => (),
            Err(CallError::NoEngine(e)) => return Err(e),
            Err(CallError::Failed(e))
                if inner.engine.as_ref().is_some_and(|e| e.pending() == before) =>
            {
                return Err(e);
            }
            Err(CallError::Failed(e) | CallError::Panicked(e)) => {
                inner.failed(counters, e.clone());
                let lost = std::mem::take(&mut inner.queued);
                inner.deliver(lost.into_iter().map(|t| (t, Err(e.clone()))), self.id);
                return Err(e);
            }
        }
        inner.queued.extend(std::iter::repeat_n(
            Ticket {
                stream: self.id,
                epoch,
                _frame: kept,
            },
            items,
        ));
        inner.deliver_ready(counters, self.id);
        if inner.queued.len() >= self.run_at {
            inner.run(counters, self.id, started);
        }
        Ok(Pushed::Queued)
    }

    /// Runs the partial batch now, so that this stream's queued frames get their scores
    /// (batch timeout, serialized event, drain); other streams' frames in it get theirs.
    /// `false`: the engine was not free by `until`, and nothing ran.
    pub fn run_now(&self, until: Option<Instant>) -> bool {
        let Some(mut inner) = self.engage(true, until) else {
            return false;
        };
        if inner.queued.iter().any(|t| t.stream == self.id) {
            inner.run(&self.instance.counters, self.id, Instant::now());
        }
        true
    }

    /// The scores that arrived for this stream's frames since the last call, in push order.
    /// Never waits for a batch.
    pub fn take_scores(&self) -> Vec<Scores> {
        std::mem::take(&mut self.slot.mailbox().scores)
    }

    /// Gives up the oldest `items` items of this stream still waiting for their scores (their
    /// frames' deadline passed): their scores are dropped, whether they have arrived since
    /// the last `take_scores` or come later. Never waits for a batch.
    pub fn abandon(&self, items: usize) {
        let mut mailbox = self.slot.mailbox();
        let arrived = items.min(mailbox.scores.len());
        mailbox.scores.drain(..arrived);
        mailbox.skip += items - arrived;
    }

    /// Forgets this stream's frames pushed so far (a flush dropped them); the other streams'
    /// frames are not touched.
    pub fn flush(&self) {
        {
            let mut mailbox = self.slot.mailbox();
            mailbox.epoch += 1;
            mailbox.scores.clear();
            mailbox.skip = 0;
        }
        // Freeing their places in the batch can wait for a batch that runs now: they run and
        // their scores are dropped.
        if let Some(mut inner) = self.instance.inner.try_lock() {
            inner.discard_unwanted(&self.instance.counters);
        }
    }

    /// How many streams share this stream's engine, itself included.
    pub fn streams(&self) -> usize {
        self.instance.counters.streams.load(Ordering::Relaxed)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let counters = &self.instance.counters;
        let mut inner = self.instance.inner.lock();
        inner.streams.remove(&self.id);
        counters
            .streams
            .store(inner.streams.len(), Ordering::Relaxed);
        if inner.streams.is_empty() {
            // The last stream takes the engine with it, outside the lock, and releases the
            // frames in it once the engine is done reading them.
            let queued = std::mem::take(&mut inner.queued);
            inner.fault = None;
            let engine = inner.engine.take();
            drop(inner);
            if let Some(engine) = engine {
                discard_and_drop(engine);
            }
            drop(queued);
            return_freed_memory();
        } else {
            inner.discard_unwanted(counters);
        }
    }
}

/// Hands the heap memory freed by an engine and its build back to the system. A model's load
/// and build take hundreds of MiB for a moment (the parsed model, the weights as imported,
/// then packed); glibc keeps what they free in its arenas, so without this a server whose
/// model is updated every day, or whose pipelines restart as cameras come and go, would hold
/// each load's peak (tests/memory.rs: +19 MiB over 180 restarts of a CUDA engine without it).
pub(crate) fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks and trims glibc's own heaps.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::frame::PixelFormat;
    use crate::preprocess::{InputSpec, Layout};

    /// What the fake engines of one instance share: counts, and failures on demand.
    #[derive(Default)]
    struct Script {
        builds: AtomicUsize,
        runs: AtomicUsize,
        /// How many of the next runs fail.
        failing_runs: AtomicUsize,
        /// How many of the next builds fail.
        failing_builds: AtomicUsize,
    }

    /// An engine whose "score" for a frame is the frame's first byte, so a test can tell
    /// which frame a result belongs to; it fails on demand: runs and builds as its script
    /// says, a push of 255 is refused, a push of 254 panics, and a run with a 253 in it
    /// panics. A push of 252 takes 30 ms, as the push that fills a GPU engine's batch runs
    /// that batch.
    struct Fake {
        info: ModelInfo,
        pushed: Vec<f32>,
        script: Arc<Script>,
    }

    impl Engine for Fake {
        fn info(&self) -> &ModelInfo {
            &self.info
        }
        fn infer(&mut self, _: &[f32], _: usize) -> Result<Vec<Vec<f32>>, EngineError> {
            unreachable!()
        }
        /// Each crop's score is the frame's first byte plus 1000 times the crop's place.
        fn push(&mut self, frame: &FrameView, crops: &[Crop]) -> Result<(), EngineError> {
            let first = frame.planes[0][0];
            match first {
                255 => return Err(EngineError::Inference("a frame the engine refuses".into())),
                254 => panic!("a bug in push"),
                252 => std::thread::sleep(Duration::from_millis(30)),
                _ => (),
            }
            for i in 0..crops.len() {
                self.pushed.push(f32::from(first) + 1000.0 * i as f32);
            }
            Ok(())
        }
        fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
            self.script.runs.fetch_add(1, Ordering::SeqCst);
            let pushed = std::mem::take(&mut self.pushed);
            assert!(!pushed.contains(&253.0), "a bug in run");
            let failing = &self.script.failing_runs;
            match failing.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) {
                Ok(_) => Err(EngineError::Inference("the GPU fell off the bus".into())),
                Err(_) => Ok(pushed.into_iter().map(|v| vec![v]).collect()),
            }
        }
        fn discard(&mut self) {
            self.pushed.clear();
        }
        fn pending(&self) -> usize {
            self.pushed.len()
        }
    }

    fn key(id: &str, batch_size: usize) -> InstanceKey {
        InstanceKey {
            calibration_frames: 0,
            id: id.into(),
            backend: Backend::Cpu,
            options: EngineOptions {
                model: "fake.onnx".into(),
                batch_size,
                input_size: None,
                precision: crate::engine::Precision::Fp32,
                calibration: None,
                min_agreement: crate::engine::DEFAULT_MIN_AGREEMENT,
                strict_precision: false,
                gpu_id: 0,
                threads: 0,
                engine_location: None,
                preprocess: Default::default(),
                progress: Default::default(),
                server: Default::default(),
            },
            model_file: None,
        }
    }

    /// A build of fake engines following `script`.
    fn fake(
        script: &Arc<Script>,
    ) -> impl Fn() -> Result<Box<dyn Engine>, EngineError> + Send + Sync + 'static {
        let script = script.clone();
        move || {
            script.builds.fetch_add(1, Ordering::SeqCst);
            let failing = &script.failing_builds;
            if failing
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(EngineError::Inference("no GPU today".into()));
            }
            Ok(Box::new(Fake {
                info: ModelInfo {
                    input: InputSpec {
                        layout: Layout::Nchw,
                        channels: 1,
                        height: 1,
                        width: 1,
                    },
                    num_classes: 1,
                    model_batch: 1,
                    outputs_probabilities: true,
                    backend: Backend::Cpu,
                    precision: crate::engine::Precision::Fp32,
                    precision_note: None,
                    quant_report: None,
                    reads_device_frames: false,
                    batches_in_flight: 1,
                    non_finite: Default::default(),
                    engine_file: None,
                },
                pushed: Vec::new(),
                script: script.clone(),
            }))
        }
    }

    fn never() -> impl Fn() -> Result<Box<dyn Engine>, EngineError> + Send + Sync + 'static {
        || panic!("the engine is built once")
    }

    fn push(stream: &Stream, value: u8) -> Result<Pushed, Arc<EngineError>> {
        push_crops(stream, value, 1)
    }

    fn push_crops(stream: &Stream, value: u8, crops: usize) -> Result<Pushed, Arc<EngineError>> {
        push_until(stream, value, crops, None)
    }

    fn push_until(
        stream: &Stream,
        value: u8,
        crops: usize,
        until: Option<Instant>,
    ) -> Result<Pushed, Arc<EngineError>> {
        let mut pixels = [0; 16];
        pixels[0] = value;
        let frame = FrameView::packed_frame(PixelFormat::Gray8, 4, 4, &pixels);
        stream.push(&frame, &vec![Crop::Whole; crops], until)
    }

    fn values(scores: Vec<Scores>) -> Vec<f32> {
        scores.into_iter().map(|s| s.unwrap()[0]).collect()
    }

    fn error(scores: &Scores) -> String {
        scores.as_ref().unwrap_err().to_string()
    }

    fn counter() -> (Waker, Arc<AtomicUsize>) {
        let n = Arc::new(AtomicUsize::new(0));
        let m = n.clone();
        (
            Arc::new(move || {
                m.fetch_add(1, Ordering::SeqCst);
            }),
            n,
        )
    }

    fn runs(script: &Script) -> usize {
        script.runs.load(Ordering::SeqCst)
    }

    #[test]
    fn streams_fill_one_batch_and_get_their_own_scores() {
        let script = Arc::new(Script::default());
        let (wake_a, woken_a) = counter();
        let (wake_b, woken_b) = counter();
        let k = key("fill", 4);
        let (a, how_a) = join(k.clone(), wake_a, fake(&script)).unwrap();
        let (b, how_b) = join(k, wake_b, never()).unwrap();
        assert_eq!(
            (how_a, how_b, a.streams()),
            (Joined::Built, Joined::Shared, 2)
        );
        push(&a, 1).unwrap();
        push(&b, 2).unwrap();
        push(&a, 3).unwrap();
        assert_eq!(runs(&script), 0, "the batch is not full yet");
        push(&b, 4).unwrap();
        assert_eq!(runs(&script), 1, "one run for both streams");
        assert_eq!(values(a.take_scores()), [1.0, 3.0]);
        assert_eq!(values(b.take_scores()), [2.0, 4.0]);
        // b's push ran the batch: a was woken, b collects its own.
        assert_eq!(woken_a.load(Ordering::SeqCst), 1);
        assert_eq!(woken_b.load(Ordering::SeqCst), 0);
        assert!(a.take_scores().is_empty());
        let stats = a.stats();
        assert_eq!((stats.streams, stats.batches, stats.items), (2, 1, 4));
        assert!(stats.batch_time > Duration::ZERO);
    }

    #[test]
    fn each_crop_of_a_frame_is_an_item_with_scores_of_its_own() {
        let script = Arc::new(Script::default());
        let k = key("crops", 4);
        let (a, _) = join(k.clone(), counter().0, fake(&script)).unwrap();
        let (b, _) = join(k, counter().0, never()).unwrap();
        push_crops(&a, 1, 3).unwrap();
        assert_eq!(runs(&script), 0, "3 items of 4");
        push_crops(&b, 2, 0).unwrap();
        assert_eq!(runs(&script), 0, "a frame of no crops adds nothing");
        push_crops(&b, 2, 2).unwrap();
        assert_eq!(runs(&script), 1, "the items filled the batch");
        assert_eq!(values(a.take_scores()), [1.0, 1001.0, 2001.0]);
        assert_eq!(values(b.take_scores()), [2.0, 1002.0]);
    }

    #[test]
    fn run_now_runs_a_partial_batch_only_for_a_stream_with_frames_in_it() {
        let script = Arc::new(Script::default());
        let k = key("partial", 8);
        let (a, _) = join(k.clone(), counter().0, fake(&script)).unwrap();
        let (b, _) = join(k, counter().0, never()).unwrap();
        push(&a, 5).unwrap();
        assert!(b.run_now(None));
        assert_eq!(runs(&script), 0, "b has nothing queued");
        assert!(a.run_now(None));
        assert_eq!(runs(&script), 1);
        assert_eq!(values(a.take_scores()), [5.0]);
        assert!(b.take_scores().is_empty());
    }

    #[test]
    fn a_flush_drops_that_streams_frames_only() {
        let script = Arc::new(Script::default());
        let k = key("flush", 4);
        let (a, _) = join(k.clone(), counter().0, fake(&script)).unwrap();
        let (b, _) = join(k, counter().0, never()).unwrap();
        push(&a, 1).unwrap();
        push(&b, 2).unwrap();
        a.flush();
        push(&a, 3).unwrap();
        push(&b, 4).unwrap();
        assert_eq!(runs(&script), 1);
        assert_eq!(values(a.take_scores()), [3.0], "frame 1 was flushed");
        assert_eq!(values(b.take_scores()), [2.0, 4.0]);
        // A flush of the only stream with queued frames frees their places in the batch.
        push(&a, 6).unwrap();
        a.flush();
        for v in [7, 8, 9] {
            push(&b, v).unwrap();
        }
        assert_eq!(runs(&script), 1, "three frames do not fill a batch of 4");
        b.run_now(None);
        assert_eq!(values(b.take_scores()), [7.0, 8.0, 9.0]);
        assert!(a.take_scores().is_empty());
    }

    #[test]
    fn a_leaving_stream_leaves_the_others_running_and_the_last_drops_the_engine() {
        let script = Arc::new(Script::default());
        let k = key("leave", 2);
        let (a, _) = join(k.clone(), counter().0, fake(&script)).unwrap();
        let (b, _) = join(k.clone(), counter().0, never()).unwrap();
        push(&a, 1).unwrap();
        drop(a);
        push(&b, 2).unwrap();
        push(&b, 3).unwrap();
        assert_eq!(values(b.take_scores()), [2.0, 3.0]);
        drop(b);
        let (c, how) = join(k, counter().0, fake(&script)).unwrap();
        assert_eq!((how, c.streams()), (Joined::Built, 1));
        assert_eq!(script.builds.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn other_ids_settings_and_model_files_get_engines_of_their_own() {
        let script = Arc::new(Script::default());
        let (_a, _) = join(key("x", 4), counter().0, fake(&script)).unwrap();
        let (_b, how_b) = join(key("y", 4), counter().0, fake(&script)).unwrap();
        let (_c, how_c) = join(key("x", 8), counter().0, fake(&script)).unwrap();
        // The same settings, but the model file was replaced since the first joined.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("m.onnx");
        std::fs::write(&file, b"one").unwrap();
        let stamped = |stamp| InstanceKey {
            model_file: stamp,
            ..key("x", 4)
        };
        let first = FileStamp::of(&file);
        let (_d, how_d) = join(stamped(first.clone()), counter().0, fake(&script)).unwrap();
        let (_e, how_e) = join(stamped(first), counter().0, never()).unwrap();
        std::fs::write(dir.path().join("new"), b"two!").unwrap();
        std::fs::rename(dir.path().join("new"), &file).unwrap();
        let (_f, how_f) = join(stamped(FileStamp::of(&file)), counter().0, fake(&script)).unwrap();
        assert_eq!(
            [how_b, how_c, how_d, how_e, how_f],
            [
                Joined::Built,
                Joined::Built,
                Joined::Built,
                Joined::Shared,
                Joined::Built
            ]
        );
    }

    #[test]
    fn a_failed_run_fails_its_batch_and_the_engine_is_built_again() {
        let script = Arc::new(Script::default());
        let (wake_a, woken_a) = counter();
        let k = key("fail", 2);
        let (a, _) = join(k.clone(), wake_a, fake(&script)).unwrap();
        let (b, _) = join(k, counter().0, never()).unwrap();
        script.failing_runs.store(1, Ordering::SeqCst);
        push(&a, 1).unwrap();
        push(&b, 2).unwrap();
        let (sa, sb) = (a.take_scores(), b.take_scores());
        assert_eq!((sa.len(), sb.len()), (1, 1));
        assert!(error(&sa[0]).contains("fell off"), "{}", error(&sa[0]));
        assert!(error(&sb[0]).contains("fell off"));
        assert_eq!(woken_a.load(Ordering::SeqCst), 1);
        // The next push builds the engine again (with the first joiner's build), and the
        // streams that go on get their scores.
        push(&b, 3).unwrap();
        push(&a, 4).unwrap();
        assert_eq!(script.builds.load(Ordering::SeqCst), 2);
        assert_eq!(values(b.take_scores()), [3.0]);
        assert_eq!(values(a.take_scores()), [4.0]);
        let stats = a.stats();
        assert_eq!((stats.failures, stats.rebuilds, stats.batches), (1, 1, 1));
    }

    #[test]
    fn an_engine_that_keeps_failing_is_built_again_after_a_growing_pause() {
        assert_eq!(rebuild_pause(1), Duration::ZERO);
        assert_eq!(rebuild_pause(2), Duration::from_secs(1));
        assert_eq!(rebuild_pause(3), Duration::from_secs(2));
        assert_eq!(rebuild_pause(40), Duration::from_secs(60));
        let script = Arc::new(Script::default());
        let k = key("keeps-failing", 1);
        let (a, _) = join(k, counter().0, fake(&script)).unwrap();
        // The run fails; the rebuild right after fails too: the next try waits a second.
        script.failing_runs.store(1, Ordering::SeqCst);
        script.failing_builds.store(1, Ordering::SeqCst);
        push(&a, 1).unwrap();
        assert!(error(&a.take_scores()[0]).contains("fell off"));
        let err = push(&a, 2).unwrap_err().to_string();
        assert!(err.contains("no GPU today"), "{err}");
        let err = push(&a, 3).unwrap_err().to_string();
        assert!(
            err.contains("failed 2 times in a row and is built again in"),
            "{err}"
        );
        assert_eq!(
            script.builds.load(Ordering::SeqCst),
            2,
            "no build in the pause"
        );
        std::thread::sleep(Duration::from_millis(1100));
        assert_eq!(push(&a, 4).ok(), Some(Pushed::Queued));
        assert_eq!(values(a.take_scores()), [4.0]);
        assert_eq!(script.builds.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn the_batch_time_counts_a_batch_run_within_the_push_that_filled_it() {
        let script = Arc::new(Script::default());
        let (wake, _) = counter();
        let (stream, _) = join(key("slow-push", 2), wake, fake(&script)).unwrap();
        push(&stream, 1).unwrap();
        push(&stream, 252).unwrap();
        assert_eq!(values(stream.take_scores()), [1.0, 252.0]);
        let took = stream.batch_time();
        assert!(took >= Duration::from_millis(30), "{took:?}");
    }

    #[test]
    fn a_refused_push_fails_that_frame_only() {
        let script = Arc::new(Script::default());
        let k = key("refused", 4);
        let (a, _) = join(k.clone(), counter().0, fake(&script)).unwrap();
        let (b, _) = join(k, counter().0, never()).unwrap();
        push(&a, 1).unwrap();
        let err = push(&b, 255).unwrap_err().to_string();
        assert!(err.contains("refuses"), "{err}");
        // a's frame is still in the batch, and the engine was not built again.
        push(&b, 2).unwrap();
        a.run_now(None);
        assert_eq!(values(a.take_scores()), [1.0]);
        assert_eq!(values(b.take_scores()), [2.0]);
        assert_eq!(script.builds.load(Ordering::SeqCst), 1);
        assert_eq!(a.stats().failures, 0);
    }

    #[test]
    fn a_failed_build_is_the_joiners_error_and_the_next_joiner_builds() {
        let script = Arc::new(Script::default());
        let k = key("build", 4);
        let err = join(k.clone(), counter().0, || {
            Err(EngineError::Inference("no".into()))
        });
        assert!(err.is_err());
        let (_a, how) = join(k, counter().0, fake(&script)).unwrap();
        assert_eq!(how, Joined::Built);
    }

    #[test]
    fn a_panic_in_push_fails_the_queued_frames_and_the_engine_is_built_again() {
        let script = Arc::new(Script::default());
        let k = key("panic-push", 4);
        let (a, _) = join(k.clone(), counter().0, fake(&script)).unwrap();
        let (b, _) = join(k, counter().0, never()).unwrap();
        push(&a, 1).unwrap();
        let err = push(&b, 254).unwrap_err();
        assert!(err.to_string().contains("a bug in push"), "{err}");
        // The engine's state is unknown: a's queued frame fails with the same error.
        let lost = a.take_scores();
        assert_eq!(lost.len(), 1);
        assert!(error(&lost[0]).contains("a bug in push"));
        // Then a fresh engine serves both.
        push(&a, 2).unwrap();
        push(&b, 3).unwrap();
        a.run_now(None);
        assert_eq!(values(a.take_scores()), [2.0]);
        assert_eq!(values(b.take_scores()), [3.0]);
        assert_eq!(script.builds.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_panic_in_a_run_fails_that_batch_and_new_joiners_get_a_working_engine() {
        let script = Arc::new(Script::default());
        let (wake_a, woken_a) = counter();
        let k = key("panic-run", 2);
        let (a, _) = join(k.clone(), wake_a, fake(&script)).unwrap();
        let (b, _) = join(k.clone(), counter().0, never()).unwrap();
        push(&a, 253).unwrap();
        push(&b, 2).unwrap();
        let (sa, sb) = (a.take_scores(), b.take_scores());
        assert_eq!((sa.len(), sb.len()), (1, 1));
        assert!(error(&sa[0]).contains("a bug in run"));
        assert!(error(&sb[0]).contains("a bug in run"));
        assert_eq!(woken_a.load(Ordering::SeqCst), 1);
        // A new element joins while the engine is down: it is built for it.
        let (c, how) = join(k, counter().0, never()).unwrap();
        assert_eq!(how, Joined::Built);
        push(&c, 5).unwrap();
        push(&b, 6).unwrap();
        assert_eq!(values(c.take_scores()), [5.0]);
        assert_eq!(values(b.take_scores()), [6.0]);
        assert_eq!(script.builds.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_push_gives_up_when_the_engine_is_busy_until_its_deadline() {
        let script = Arc::new(Script::default());
        let k = key("busy", 4);
        let (a, _) = join(k.clone(), counter().0, fake(&script)).unwrap();
        let (b, _) = join(k, counter().0, never()).unwrap();
        let started = Instant::now();
        let result = {
            // Another stream's batch holds the engine.
            let _running = a.engage(false, None).unwrap();
            std::thread::scope(|s| {
                s.spawn(|| {
                    (
                        push_until(&b, 7, 1, Some(Instant::now() + Duration::from_millis(30))),
                        b.run_now(Some(Instant::now() + Duration::from_millis(10))),
                    )
                })
                .join()
                .unwrap()
            })
        };
        assert_eq!((result.0.ok(), result.1), (Some(Pushed::Busy), false));
        assert!(started.elapsed() >= Duration::from_millis(40));
        // Nothing was pushed: the next batch holds only what comes next.
        push(&b, 8).unwrap();
        b.run_now(None);
        assert_eq!(values(b.take_scores()), [8.0]);
    }

    #[test]
    fn abandoned_items_lose_their_scores_whenever_they_come() {
        let script = Arc::new(Script::default());
        let k = key("abandon", 8);
        let (a, _) = join(k.clone(), counter().0, fake(&script)).unwrap();
        let (b, _) = join(k, counter().0, never()).unwrap();
        // Two of a's items are given up before their batch runs, one after.
        for v in [1, 2, 3, 4] {
            push(&a, v).unwrap();
        }
        push(&b, 9).unwrap();
        a.abandon(2);
        b.run_now(None);
        a.abandon(1);
        assert_eq!(values(a.take_scores()), [4.0]);
        assert_eq!(values(b.take_scores()), [9.0], "other streams keep theirs");
        // Nothing is skipped beyond what was given up.
        push(&a, 5).unwrap();
        a.run_now(None);
        assert_eq!(values(a.take_scores()), [5.0]);
    }

    /// An engine whose full batches of 2 run "in flight" until the test finishes them; it
    /// keeps the signal it was given where the test calls it, as a GPU's driver would.
    struct Flying {
        info: ModelInfo,
        gathering: Vec<f32>,
        flights: Arc<Mutex<Flights>>,
        signal: Arc<Mutex<Option<BatchDone>>>,
    }

    #[derive(Default)]
    struct Flights {
        running: std::collections::VecDeque<Vec<f32>>,
        finished: Vec<f32>,
        runs: usize,
        /// The frames in GPU memory a test pushed, and how many of them were still kept
        /// when the engine last forgot its frames.
        frames: Vec<std::sync::Weak<u8>>,
        kept_at_discard: Option<usize>,
        /// The next `take_ready` fails, as a batch whose GPU work failed.
        fail: bool,
    }

    impl Flying {
        fn land(&mut self) -> Vec<Vec<f32>> {
            let mut flights = self.flights.lock().unwrap();
            std::mem::take(&mut flights.finished)
                .into_iter()
                .map(|v| vec![v])
                .collect()
        }

        fn take(&mut self, value: f32) {
            self.gathering.push(value);
            if self.gathering.len() == 2 {
                let batch = std::mem::take(&mut self.gathering);
                self.flights.lock().unwrap().running.push_back(batch);
            }
        }
    }

    impl Engine for Flying {
        fn info(&self) -> &ModelInfo {
            &self.info
        }
        fn infer(&mut self, _: &[f32], _: usize) -> Result<Vec<Vec<f32>>, EngineError> {
            unreachable!()
        }
        fn push(&mut self, frame: &FrameView, _: &[Crop]) -> Result<(), EngineError> {
            self.take(f32::from(frame.planes[0][0]));
            Ok(())
        }
        /// A frame "in GPU memory" is its first plane's address.
        fn push_device(&mut self, frame: &DevicePlanes, _: &[Crop]) -> Result<(), EngineError> {
            self.take(frame.ptrs[0] as f32);
            Ok(())
        }
        fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
            let mut flights = self.flights.lock().unwrap();
            flights.runs += 1;
            while let Some(batch) = flights.running.pop_front() {
                flights.finished.extend(batch);
            }
            flights.finished.append(&mut self.gathering);
            drop(flights);
            Ok(self.land())
        }
        fn take_ready(&mut self) -> Result<crate::engine::Ready, EngineError> {
            if std::mem::take(&mut self.flights.lock().unwrap().fail) {
                return Err(EngineError::Inference("the GPU fell off the bus".into()));
            }
            let scores = self.land();
            Ok(crate::engine::Ready {
                batches: scores.len() / 2,
                took: Duration::from_millis(1),
                scores,
            })
        }
        fn on_batch_done(&mut self, signal: BatchDone) -> bool {
            *self.signal.lock().unwrap() = Some(signal);
            true
        }
        fn discard(&mut self) {
            self.gathering.clear();
            let mut flights = self.flights.lock().unwrap();
            flights.running.clear();
            flights.finished.clear();
            let kept = flights
                .frames
                .iter()
                .filter(|f| f.strong_count() > 0)
                .count();
            flights.kept_at_discard = Some(kept);
        }
        fn pending(&self) -> usize {
            let flights = self.flights.lock().unwrap();
            self.gathering.len()
                + flights.running.iter().map(Vec::len).sum::<usize>()
                + flights.finished.len()
        }
    }

    /// Builds of `Flying` engines (batches of 2, in flight) that share `flights` and `signal`.
    fn flying(
        flights: &Arc<Mutex<Flights>>,
        signal: &Arc<Mutex<Option<BatchDone>>>,
    ) -> impl Fn() -> Result<Box<dyn Engine>, EngineError> + Send + Sync + 'static {
        let (flights, signal) = (flights.clone(), signal.clone());
        move || {
            let mut info = fake(&Arc::new(Script::default()))()?.info().clone();
            (info.model_batch, info.batches_in_flight) = (2, 3);
            info.reads_device_frames = true;
            Ok(Box::new(Flying {
                info,
                gathering: Vec::new(),
                flights: flights.clone(),
                signal: signal.clone(),
            }))
        }
    }

    /// Lands the oldest batch in flight, as the GPU finishing it.
    fn land(flights: &Mutex<Flights>) {
        let mut flights = flights.lock().unwrap();
        let landed = flights.running.pop_front().expect("a batch in flight");
        flights.finished.extend(landed);
    }

    /// Pushes a frame "in GPU memory" whose value is `value`; the returned reference tells
    /// whether the instance still keeps it.
    fn push_device(stream: &Stream, flights: &Mutex<Flights>, value: u8) -> std::sync::Weak<u8> {
        let frame = Arc::new(value);
        let watched = Arc::downgrade(&frame);
        flights.lock().unwrap().frames.push(watched.clone());
        let planes = DevicePlanes {
            format: FrameView::packed_frame(PixelFormat::Gray8, 1, 1, &[0]).format,
            ptrs: vec![u64::from(value)],
            strides: vec![1],
            context: 0,
        };
        stream
            .push_device(&planes, &[Crop::Whole], None, frame)
            .unwrap();
        watched
    }

    #[test]
    fn frames_in_gpu_memory_are_kept_while_the_engine_may_read_them() {
        let flights = Arc::new(Mutex::new(Flights::default()));
        let signal: Arc<Mutex<Option<BatchDone>>> = Default::default();
        let k = key("kept", 2);
        let (a, _) = join(k.clone(), counter().0, flying(&flights, &signal)).unwrap();
        let (b, _) = join(k, counter().0, never()).unwrap();
        let alive = |f: &std::sync::Weak<u8>| f.strong_count() > 0;

        // Given up while its batch is in flight: kept until the batch has landed.
        let one = push_device(&a, &flights, 1);
        let two = push_device(&b, &flights, 2);
        a.abandon(1);
        assert!(alive(&one) && alive(&two), "the batch in flight reads both");
        land(&flights);
        push(&b, 3).unwrap();
        assert!(!alive(&one) && !alive(&two), "released with their scores");
        assert_eq!(values(b.take_scores()), [2.0]);
        assert!(a.take_scores().is_empty(), "a gave its frame up");

        // Its stream flushed: kept until the engine has forgotten it, which it does once no
        // stream wants what it holds.
        let four = push_device(&b, &flights, 4);
        assert_eq!(flights.lock().unwrap().running.len(), 1);
        b.flush();
        assert!(!alive(&four));
        assert_eq!(
            flights.lock().unwrap().kept_at_discard.take(),
            Some(1),
            "the engine forgot frame 4 before it was released"
        );

        // Its stream left while its batch flies: kept for the batch.
        let five = push_device(&a, &flights, 5);
        let six = push_device(&b, &flights, 6);
        drop(b);
        assert!(alive(&five) && alive(&six), "a still wants frame 5");
        land(&flights);
        a.run_now(None);
        assert!(!alive(&five) && !alive(&six));
        assert_eq!(values(a.take_scores()), [5.0]);

        // A batch failed: the failed engine forgets the frames before they are released.
        let eight = push_device(&a, &flights, 8);
        flights.lock().unwrap().fail = true;
        push(&a, 9).unwrap();
        assert!(!alive(&eight));
        assert_eq!(flights.lock().unwrap().kept_at_discard.take(), Some(1));
        assert_eq!(a.take_scores().iter().filter(|s| s.is_err()).count(), 2);

        // The last stream left: the engine forgets the frames before they are released.
        let seven = push_device(&a, &flights, 7);
        drop(a);
        assert!(!alive(&seven));
        assert_eq!(flights.lock().unwrap().kept_at_discard, Some(1));
    }

    #[test]
    fn batches_that_finish_in_flight_reach_their_streams_without_a_run() {
        let flights = Arc::new(Mutex::new(Flights::default()));
        let signal: Arc<Mutex<Option<BatchDone>>> = Default::default();
        let (wake_a, woken_a) = counter();
        let k = key("in-flight", 2);
        let (a, _) = join(k.clone(), wake_a, flying(&flights, &signal)).unwrap();
        let (b, _) = join(k, counter().0, never()).unwrap();
        push(&a, 1).unwrap();
        push(&b, 2).unwrap();
        push(&a, 3).unwrap();
        assert!(a.take_scores().is_empty(), "the batch is in flight");
        // The GPU finishes it: the collector hands it out, with no push and no run.
        land(&flights);
        let signal = signal
            .lock()
            .unwrap()
            .clone()
            .expect("the instance gave a signal");
        signal();
        let waited = Instant::now();
        while woken_a.load(Ordering::SeqCst) == 0 {
            assert!(
                waited.elapsed() < Duration::from_secs(10),
                "never handed out"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(values(a.take_scores()), [1.0], "frame 3 still gathers");
        assert_eq!(values(b.take_scores()), [2.0]);
        assert_eq!(flights.lock().unwrap().runs, 0, "nothing ran");
        assert_eq!((a.stats().batches, a.stats().items), (1, 2));
        // A batch finished before a push is handed out by that push, with the pushing
        // stream's own scores in its mailbox.
        push(&b, 4).unwrap();
        land(&flights);
        push(&b, 5).unwrap();
        assert_eq!(values(a.take_scores()), [3.0]);
        assert_eq!(values(b.take_scores()), [4.0]);
        b.run_now(None);
        assert_eq!(values(b.take_scores()), [5.0]);
        assert_eq!(flights.lock().unwrap().runs, 1);
    }
}
