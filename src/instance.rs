// SPDX-License-Identifier: MPL-2.0
//! Model instances: one engine shared by every element of the process with the same
//! `model-instance-id` and the same engine settings, so that an added camera costs its
//! frames, not another engine, and the frames of all cameras fill the engine's batches.
//!
//! Each element joins an instance as a *stream*. A stream's fresh frames are pushed into the
//! engine as they arrive, in any interleaving with the other streams' frames; when a batch is
//! full (or a stream asks for its frames: batch timeout, serialized event, drain) the engine
//! runs everything pushed so far and each stream's scores go to its own mailbox, in the order
//! of its frames. A stream whose scores arrive while its own thread is elsewhere is woken
//! through the callback it joined with. Nothing here knows about GStreamer elements.
//!
//! A flushing stream starts a new epoch: scores of frames pushed before it are dropped, and
//! the other streams' frames are not touched. A stream that leaves (the element stops) drops
//! its frames' scores in the same way; the last stream to leave drops the engine.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::{Duration, Instant};

use parking_lot::MutexGuard;

use crate::engine::{
    Backend, DevicePlanes, Engine, EngineError, EngineOptions, ModelInfo, unpanic,
};
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
}

/// Scores of one frame, or why its batch failed (shared by the streams of that batch).
pub type Scores = Result<Vec<f32>, Arc<EngineError>>;

/// Called when scores for a stream arrive from another stream's thread; it runs with the
/// instance locked, so it must only signal (never block or call back into the instance).
pub type Waker = Arc<dyn Fn() + Send + Sync>;

type StreamId = u64;

struct StreamSlot {
    epoch: u64,
    mailbox: Vec<Scores>,
    wake: Waker,
}

#[derive(Default)]
struct Inner {
    engine: Option<Box<dyn Engine>>,
    /// Frames pushed into the engine and not yet run: whose, and of which epoch.
    queued: Vec<(StreamId, u64)>,
    streams: HashMap<StreamId, StreamSlot>,
    next_stream: StreamId,
    /// Set when the engine panicked: its state is unknown, so it is not called again and
    /// every later push fails with this error.
    broken: Option<Arc<EngineError>>,
}

/// An engine and the streams that feed it.
pub struct Instance {
    key: InstanceKey,
    /// parking_lot's lock hands itself to a waiting thread at least every half millisecond,
    /// so that no stream's thread is overtaken by the others' for long (std's lock has no
    /// such bound), with its frames waiting all that time.
    inner: parking_lot::Mutex<Inner>,
}

static INSTANCES: LazyLock<Mutex<Vec<Weak<Instance>>>> = LazyLock::new(Default::default);

/// A stream's membership of an instance; leaving is dropping it.
pub struct Stream {
    instance: Arc<Instance>,
    id: StreamId,
    info: ModelInfo,
    batch_size: usize,
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

/// Joins the instance for `key`, building its engine with `build` when no stream of the
/// process has it yet. Joiners of an instance whose engine is being built wait for it; a
/// failed build is the failing joiner's error, and the next joiner tries again.
pub fn join(
    key: InstanceKey,
    wake: Waker,
    build: impl FnOnce() -> Result<Box<dyn Engine>, EngineError>,
) -> Result<(Stream, Joined), EngineError> {
    let instance = {
        let mut instances = INSTANCES.lock().unwrap();
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
                    inner: Default::default(),
                });
                instances.push(Arc::downgrade(&instance));
                instance
            }
        }
    };
    let batch_size = instance.key.options.batch_size.max(1);
    let mut inner = instance.lock();
    let joined = match inner.engine {
        Some(_) => Joined::Shared,
        None => {
            inner.engine = Some(build()?);
            // A fresh engine: what broke the last one (if this instance outlived it) is gone.
            inner.broken = None;
            Joined::Built
        }
    };
    let info = inner.engine.as_ref().expect("built above").info().clone();
    let id = inner.next_stream;
    inner.next_stream += 1;
    inner.streams.insert(
        id,
        StreamSlot {
            epoch: 0,
            mailbox: Vec::new(),
            wake,
        },
    );
    drop(inner);
    Ok((
        Stream {
            instance,
            id,
            info,
            batch_size,
            longest_wait: AtomicU64::new(0),
        },
        joined,
    ))
}

impl Instance {
    /// The lock has no poisoning: a panic inside an engine call (see `Inner::call`) does not
    /// stop every other stream for good.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }
}

impl Inner {
    /// Calls the engine, turning a panic inside it into an error (see `broken`).
    fn call<T>(
        &mut self,
        f: impl FnOnce(&mut dyn Engine) -> Result<T, EngineError>,
    ) -> Result<T, Arc<EngineError>> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        let Some(engine) = self.engine.as_deref_mut() else {
            return Err(Arc::new(EngineError::Inference(
                "the engine has been dropped".into(),
            )));
        };
        let mut panicked = false;
        let result = unpanic(
            || f(engine),
            |panic| {
                panicked = true;
                EngineError::Inference(format!(
                    "internal error in the engine, which is not used again: {panic}"
                ))
            },
        );
        result.map_err(|e| {
            let e = Arc::new(e);
            if panicked {
                self.broken = Some(e.clone());
            }
            e
        })
    }

    /// Forgets the frames pushed into the engine.
    fn discard(&mut self) {
        // A discard that panics has marked the engine broken: nothing else to do.
        let _ = self.call(|engine| {
            engine.discard();
            Ok(())
        });
    }

    /// Runs every queued frame and hands out the scores; wakes the streams that got some,
    /// except `caller`, which collects its own.
    fn run(&mut self, caller: StreamId) {
        if self.queued.is_empty() {
            return;
        }
        let tickets = std::mem::take(&mut self.queued);
        let scores: Vec<Scores> = match self.call(|engine| engine.run_pushed()) {
            Ok(scores) if scores.len() == tickets.len() => scores.into_iter().map(Ok).collect(),
            Ok(scores) => {
                let e = Arc::new(EngineError::Inference(format!(
                    "the engine returned {} score vectors for {} frames",
                    scores.len(),
                    tickets.len()
                )));
                tickets.iter().map(|_| Err(e.clone())).collect()
            }
            Err(e) => tickets.iter().map(|_| Err(e.clone())).collect(),
        };
        self.deliver(tickets.into_iter().zip(scores), caller);
    }

    /// Hands each frame's scores to its stream, when the stream is still there and in the
    /// same epoch; wakes each other stream that got any.
    fn deliver(
        &mut self,
        scored: impl IntoIterator<Item = ((StreamId, u64), Scores)>,
        caller: StreamId,
    ) {
        let mut woken = Vec::new();
        for ((id, epoch), scores) in scored {
            if let Some(slot) = self.streams.get_mut(&id)
                && slot.epoch == epoch
            {
                slot.mailbox.push(scores);
                if id != caller && !woken.contains(&id) {
                    woken.push(id);
                }
            }
        }
        for id in woken {
            (self.streams[&id].wake)();
        }
    }

    /// Forgets queued frames when none of them will be wanted, so that they take no place in
    /// the next batch.
    fn discard_unwanted(&mut self) {
        let wanted = self
            .queued
            .iter()
            .any(|(id, epoch)| self.streams.get(id).is_some_and(|s| s.epoch == *epoch));
        if !wanted && !self.queued.is_empty() {
            self.queued.clear();
            self.discard();
        }
    }
}

impl Stream {
    /// Locks the instance, keeping the longest wait.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        let started = Instant::now();
        let inner = self.instance.lock();
        let waited = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.longest_wait.fetch_max(waited, Ordering::Relaxed);
        inner
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

    /// Pushes `crops` of a frame in system memory; see `push_with`.
    pub fn push(
        &self,
        frame: &gst_video::VideoFrameRef<&gst::BufferRef>,
        crops: &[Crop],
    ) -> Result<(), Arc<EngineError>> {
        self.push_with(crops.len(), |engine| engine.push(frame, crops))
    }

    /// Pushes `crops` of a frame in GPU memory; see `push_with`.
    pub fn push_device(
        &self,
        frame: &DevicePlanes,
        crops: &[Crop],
    ) -> Result<(), Arc<EngineError>> {
        self.push_with(crops.len(), |engine| engine.push_device(frame, crops))
    }

    /// Pushes `items` items (crops) of one fresh frame of this stream into the engine; runs
    /// the batch when it is full. Each item gets its own scores, in push order. An engine
    /// error fails every item queued at that moment, of every stream: the engine may have
    /// lost them; the others hear of it through their mailboxes.
    fn push_with(
        &self,
        items: usize,
        push: impl FnOnce(&mut dyn Engine) -> Result<(), EngineError>,
    ) -> Result<(), Arc<EngineError>> {
        if items == 0 {
            return Ok(());
        }
        let mut inner = self.lock();
        let epoch = inner.streams[&self.id].epoch;
        if let Err(e) = inner.call(push) {
            inner.discard();
            let lost = std::mem::take(&mut inner.queued);
            inner.deliver(lost.into_iter().map(|t| (t, Err(e.clone()))), self.id);
            return Err(e);
        }
        inner
            .queued
            .extend(std::iter::repeat_n((self.id, epoch), items));
        if inner.queued.len() >= self.batch_size {
            inner.run(self.id);
        }
        Ok(())
    }

    /// Runs the partial batch now, so that this stream's queued frames get their scores
    /// (batch timeout, serialized event, drain); other streams' frames in it get theirs.
    pub fn run_now(&self) {
        let mut inner = self.lock();
        if inner.queued.iter().any(|(id, _)| *id == self.id) {
            inner.run(self.id);
        }
    }

    /// The scores that arrived for this stream's frames since the last call, in push order.
    pub fn take_scores(&self) -> Vec<Scores> {
        let mut inner = self.lock();
        inner
            .streams
            .get_mut(&self.id)
            .map(|s| std::mem::take(&mut s.mailbox))
            .unwrap_or_default()
    }

    /// Forgets this stream's frames pushed so far (a flush dropped them); the other streams'
    /// frames are not touched.
    pub fn flush(&self) {
        let mut inner = self.lock();
        if let Some(slot) = inner.streams.get_mut(&self.id) {
            slot.epoch += 1;
            slot.mailbox.clear();
        }
        inner.discard_unwanted();
    }

    /// How many streams share this stream's engine, itself included.
    pub fn streams(&self) -> usize {
        self.lock().streams.len()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let mut inner = self.lock();
        inner.streams.remove(&self.id);
        if inner.streams.is_empty() {
            // The last stream takes the engine with it, outside the registry's lock.
            inner.queued.clear();
            inner.broken = None;
            let engine = inner.engine.take();
            drop(inner);
            drop(engine);
        } else {
            inner.discard_unwanted();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::{InputSpec, Layout};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// An engine whose "score" for a frame is the frame's first byte, so a test can tell
    /// which frame a result belongs to; it counts its runs and fails on demand: a run fails
    /// with `fail_run`, a push of 255 is refused, a push of 254 panics, and a run with a 253
    /// in it panics.
    struct Fake {
        info: ModelInfo,
        pushed: Vec<f32>,
        runs: Arc<AtomicUsize>,
        fail_run: bool,
    }

    impl Engine for Fake {
        fn info(&self) -> &ModelInfo {
            &self.info
        }
        fn infer(&mut self, _: &[f32], _: usize) -> Result<Vec<Vec<f32>>, EngineError> {
            unreachable!()
        }
        /// Each crop's score is the frame's first byte plus 1000 times the crop's place.
        fn push(
            &mut self,
            frame: &gst_video::VideoFrameRef<&gst::BufferRef>,
            crops: &[Crop],
        ) -> Result<(), EngineError> {
            let first = frame.plane_data(0).unwrap()[0];
            match first {
                255 => return Err(EngineError::Inference("a frame the engine refuses".into())),
                254 => panic!("a bug in push"),
                _ => (),
            }
            for i in 0..crops.len() {
                self.pushed.push(f32::from(first) + 1000.0 * i as f32);
            }
            Ok(())
        }
        fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
            self.runs.fetch_add(1, Ordering::SeqCst);
            let pushed = std::mem::take(&mut self.pushed);
            assert!(!pushed.contains(&253.0), "a bug in run");
            match self.fail_run {
                true => Err(EngineError::Inference("the GPU fell off the bus".into())),
                false => Ok(pushed.into_iter().map(|v| vec![v]).collect()),
            }
        }
        fn discard(&mut self) {
            self.pushed.clear();
        }
    }

    fn key(id: &str, batch_size: usize) -> InstanceKey {
        InstanceKey {
            id: id.into(),
            backend: Backend::Cpu,
            options: EngineOptions {
                model: "fake.onnx".into(),
                batch_size,
                input_size: None,
                precision: crate::engine::Precision::Fp32,
                gpu_id: 0,
                threads: 0,
                engine_location: None,
                preprocess: Default::default(),
                progress: Default::default(),
            },
        }
    }

    fn fake(runs: &Arc<AtomicUsize>, fail_run: bool) -> Result<Box<dyn Engine>, EngineError> {
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
                reads_device_frames: false,
                non_finite: Default::default(),
            },
            pushed: Vec::new(),
            runs: runs.clone(),
            fail_run,
        }))
    }

    fn push(stream: &Stream, value: u8) -> Result<(), Arc<EngineError>> {
        push_crops(stream, value, 1)
    }

    fn push_crops(stream: &Stream, value: u8, crops: usize) -> Result<(), Arc<EngineError>> {
        gst::init().unwrap();
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::Gray8, 4, 4)
            .build()
            .unwrap();
        let mut buffer = gst::Buffer::with_size(info.size()).unwrap();
        buffer.get_mut().unwrap().map_writable().unwrap()[0] = value;
        let frame = gst_video::VideoFrameRef::from_buffer_ref_readable(&buffer, &info).unwrap();
        stream.push(&frame, &vec![Crop::Whole; crops])
    }

    fn values(scores: Vec<Scores>) -> Vec<f32> {
        scores.into_iter().map(|s| s.unwrap()[0]).collect()
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

    #[test]
    fn streams_fill_one_batch_and_get_their_own_scores() {
        let runs = Arc::new(AtomicUsize::new(0));
        let (wake_a, woken_a) = counter();
        let (wake_b, woken_b) = counter();
        let k = key("fill", 4);
        let (a, how_a) = join(k.clone(), wake_a, || fake(&runs, false)).unwrap();
        let (b, how_b) = join(k, wake_b, || panic!("the engine is built once")).unwrap();
        assert_eq!(
            (how_a, how_b, a.streams()),
            (Joined::Built, Joined::Shared, 2)
        );
        push(&a, 1).unwrap();
        push(&b, 2).unwrap();
        push(&a, 3).unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the batch is not full yet");
        push(&b, 4).unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 1, "one run for both streams");
        assert_eq!(values(a.take_scores()), [1.0, 3.0]);
        assert_eq!(values(b.take_scores()), [2.0, 4.0]);
        // b's push ran the batch: a was woken, b collects its own.
        assert_eq!(woken_a.load(Ordering::SeqCst), 1);
        assert_eq!(woken_b.load(Ordering::SeqCst), 0);
        assert!(a.take_scores().is_empty());
    }

    #[test]
    fn each_crop_of_a_frame_is_an_item_with_scores_of_its_own() {
        let runs = Arc::new(AtomicUsize::new(0));
        let k = key("crops", 4);
        let (a, _) = join(k.clone(), counter().0, || fake(&runs, false)).unwrap();
        let (b, _) = join(k, counter().0, || unreachable!()).unwrap();
        push_crops(&a, 1, 3).unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 0, "3 items of 4");
        push_crops(&b, 2, 0).unwrap();
        assert_eq!(
            runs.load(Ordering::SeqCst),
            0,
            "a frame of no crops adds nothing"
        );
        push_crops(&b, 2, 2).unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the items filled the batch");
        assert_eq!(values(a.take_scores()), [1.0, 1001.0, 2001.0]);
        assert_eq!(values(b.take_scores()), [2.0, 1002.0]);
    }

    #[test]
    fn run_now_runs_a_partial_batch_only_for_a_stream_with_frames_in_it() {
        let runs = Arc::new(AtomicUsize::new(0));
        let k = key("partial", 8);
        let (a, _) = join(k.clone(), counter().0, || fake(&runs, false)).unwrap();
        let (b, _) = join(k, counter().0, || unreachable!()).unwrap();
        push(&a, 5).unwrap();
        b.run_now();
        assert_eq!(runs.load(Ordering::SeqCst), 0, "b has nothing queued");
        a.run_now();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(values(a.take_scores()), [5.0]);
        assert!(b.take_scores().is_empty());
    }

    #[test]
    fn a_flush_drops_that_streams_frames_only() {
        let runs = Arc::new(AtomicUsize::new(0));
        let k = key("flush", 4);
        let (a, _) = join(k.clone(), counter().0, || fake(&runs, false)).unwrap();
        let (b, _) = join(k, counter().0, || unreachable!()).unwrap();
        push(&a, 1).unwrap();
        push(&b, 2).unwrap();
        a.flush();
        push(&a, 3).unwrap();
        push(&b, 4).unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(values(a.take_scores()), [3.0], "frame 1 was flushed");
        assert_eq!(values(b.take_scores()), [2.0, 4.0]);
        // A flush of the only stream with queued frames frees their places in the batch.
        push(&a, 6).unwrap();
        a.flush();
        for v in [7, 8, 9] {
            push(&b, v).unwrap();
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "three frames do not fill a batch of 4"
        );
        b.run_now();
        assert_eq!(values(b.take_scores()), [7.0, 8.0, 9.0]);
        assert!(a.take_scores().is_empty());
    }

    #[test]
    fn a_leaving_stream_leaves_the_others_running_and_the_last_drops_the_engine() {
        let runs = Arc::new(AtomicUsize::new(0));
        let k = key("leave", 2);
        let (a, _) = join(k.clone(), counter().0, || fake(&runs, false)).unwrap();
        let (b, _) = join(k.clone(), counter().0, || unreachable!()).unwrap();
        push(&a, 1).unwrap();
        drop(a);
        push(&b, 2).unwrap();
        push(&b, 3).unwrap();
        assert_eq!(values(b.take_scores()), [2.0, 3.0]);
        drop(b);
        let (c, how) = join(k, counter().0, || fake(&runs, false)).unwrap();
        assert_eq!((how, c.streams()), (Joined::Built, 1));
    }

    #[test]
    fn other_ids_and_settings_get_engines_of_their_own() {
        let runs = Arc::new(AtomicUsize::new(0));
        let (_a, _) = join(key("x", 4), counter().0, || fake(&runs, false)).unwrap();
        let (_b, how_b) = join(key("y", 4), counter().0, || fake(&runs, false)).unwrap();
        let (_c, how_c) = join(key("x", 8), counter().0, || fake(&runs, false)).unwrap();
        assert_eq!((how_b, how_c), (Joined::Built, Joined::Built));
    }

    #[test]
    fn a_failed_run_reaches_every_stream_of_the_batch() {
        let runs = Arc::new(AtomicUsize::new(0));
        let (wake_a, woken_a) = counter();
        let k = key("fail", 2);
        let (a, _) = join(k.clone(), wake_a, || fake(&runs, true)).unwrap();
        let (b, _) = join(k, counter().0, || unreachable!()).unwrap();
        push(&a, 1).unwrap();
        push(&b, 2).unwrap();
        let (sa, sb) = (a.take_scores(), b.take_scores());
        assert_eq!((sa.len(), sb.len()), (1, 1));
        assert!(sa[0].as_ref().unwrap_err().to_string().contains("fell off"));
        assert!(sb[0].is_err());
        assert_eq!(woken_a.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_refused_push_fails_the_queued_frames_and_the_pusher() {
        let runs = Arc::new(AtomicUsize::new(0));
        let k = key("refused", 4);
        let (a, _) = join(k.clone(), counter().0, || fake(&runs, false)).unwrap();
        let (b, _) = join(k, counter().0, || unreachable!()).unwrap();
        push(&a, 1).unwrap();
        assert!(push(&b, 255).is_err());
        let lost = a.take_scores();
        assert_eq!(lost.len(), 1);
        assert!(lost[0].is_err());
        // The instance goes on.
        push(&a, 2).unwrap();
        a.run_now();
        assert_eq!(values(a.take_scores()), [2.0]);
    }

    #[test]
    fn a_failed_build_is_the_joiners_error_and_the_next_joiner_builds() {
        let runs = Arc::new(AtomicUsize::new(0));
        let k = key("build", 4);
        let err = join(k.clone(), counter().0, || {
            Err(EngineError::Inference("no".into()))
        });
        assert!(err.is_err());
        let (_a, how) = join(k, counter().0, || fake(&runs, false)).unwrap();
        assert_eq!(how, Joined::Built);
    }

    #[test]
    fn a_panic_in_push_is_an_error_and_the_engine_is_not_called_again() {
        let runs = Arc::new(AtomicUsize::new(0));
        let k = key("panic-push", 4);
        let (a, _) = join(k.clone(), counter().0, || fake(&runs, false)).unwrap();
        let (b, _) = join(k, counter().0, || unreachable!()).unwrap();
        push(&a, 1).unwrap();
        let err = push(&b, 254).unwrap_err();
        assert!(err.to_string().contains("a bug in push"), "{err}");
        // a's queued frame fails with the same error; later pushes fail without a call.
        let lost = a.take_scores();
        assert_eq!(lost.len(), 1);
        assert!(
            lost[0]
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("a bug in push")
        );
        assert!(
            push(&a, 2)
                .unwrap_err()
                .to_string()
                .contains("not used again")
        );
        a.run_now();
        assert_eq!(runs.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_panic_in_a_run_fails_that_batch_for_every_stream() {
        let runs = Arc::new(AtomicUsize::new(0));
        let (wake_a, woken_a) = counter();
        let k = key("panic-run", 2);
        let (a, _) = join(k.clone(), wake_a, || fake(&runs, false)).unwrap();
        let (b, _) = join(k, counter().0, || unreachable!()).unwrap();
        push(&a, 253).unwrap();
        push(&b, 2).unwrap();
        let (sa, sb) = (a.take_scores(), b.take_scores());
        assert_eq!((sa.len(), sb.len()), (1, 1));
        assert!(
            sa[0]
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("a bug in run")
        );
        assert!(
            sb[0]
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("a bug in run")
        );
        assert_eq!(woken_a.load(Ordering::SeqCst), 1);
        assert!(push(&b, 3).is_err());
    }
}
