// SPDX-License-Identifier: MPL-2.0
//! The element's runtime state, made in `start()` and dropped in `stop()`, in parts: the
//! shared engine, what of a frame is classified, the frames held until they leave, what
//! becomes of their scores, and the failure relay. Each of the element's functions takes
//! the part it needs.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use super::batcher::Batcher;
use super::settings::{Settings, Tunables};
use super::timer::BatchTimer;
use crate::instance;
use crate::outputs::labels::Labels;
use crate::outputs::meta::ClassEntry;
use crate::outputs::results::ResultsWriter;
use crate::preprocess::Crop;
use crate::regions::{self, Region, RegionFilter, RoiMode};
use crate::stream_calibration::StreamCalibration;

/// A frame held in the element, with the regions it is classified in (see `roi`).
pub(crate) struct Held {
    pub(crate) buffer: gst::Buffer,
    pub(crate) regions: Vec<Region>,
}

/// What a started element holds, in parts.
pub(crate) struct State {
    /// This element's place in the engine it shares with other elements.
    pub(crate) stream: instance::Stream,
    /// What of each frame is classified.
    pub(crate) input: Input,
    /// The frames held, the frames ready to go, the timer.
    pub(crate) queue: Queue,
    /// What becomes of the scores.
    pub(crate) outputs: Outputs,
    /// The failure relay.
    pub(crate) failure: Failure,
    /// The calibration on this stream's frames that the quantized engine waits for; the
    /// engine meanwhile runs in fp16.
    pub(crate) calibrating: Option<Arc<StreamCalibration>>,
}

impl State {
    /// The state of an element that has just joined its engine as `stream`.
    pub(crate) fn new(
        stream: instance::Stream,
        settings: &Settings,
        timer: Option<Arc<BatchTimer>>,
        outputs: Outputs,
    ) -> Self {
        Self {
            stream,
            input: Input {
                info: None,
                roi: settings.roi,
                roi_filter: settings.roi_filter.clone(),
            },
            queue: Queue {
                batcher: Batcher::default(),
                ready: VecDeque::new(),
                timer,
                engine_busy: false,
                server_away: false,
                server_warned: None,
            },
            outputs,
            failure: Failure::default(),
            calibrating: None,
        }
    }
}

/// What of each frame is classified: the caps it came with, and its items (`roi`).
pub(crate) struct Input {
    /// The input caps, once negotiated.
    pub(crate) info: Option<gst_video::VideoInfo>,
    /// `roi`: the whole frame, its regions, or both.
    pub(crate) roi: RoiMode,
    /// `roi-types`, `roi-min-width`, `roi-min-height`.
    pub(crate) roi_filter: RegionFilter,
}

impl Input {
    /// What of a fresh frame is classified (`roi`): the whole frame first, then each region
    /// it is classified in, which `held` keeps for the results.
    pub(crate) fn crops(&self, held: &mut Held) -> Vec<Crop> {
        let mut crops = Vec::new();
        if self.roi.whole_frame() {
            crops.push(Crop::Whole);
        }
        if self.roi.regions()
            && let Some(info) = self.info.as_ref()
        {
            held.regions = regions::regions_of(
                held.buffer.as_ref(),
                info.width(),
                info.height(),
                &self.roi_filter,
            );
            crops.extend(held.regions.iter().map(Region::crop));
        }
        crops
    }
}

/// The frames from their arrival until they leave, and the timer that ends their wait.
pub(crate) struct Queue {
    /// Frames in arrival order, until they have their results.
    pub(crate) batcher: Batcher<Held>,
    /// Frames with their results, to be sent on.
    pub(crate) ready: VecDeque<gst::Buffer>,
    /// Wakes the element when a partial batch has waited `batch-timeout`, or when another
    /// stream's batch brought scores for this element's frames; `None` for batches of one.
    pub(crate) timer: Option<Arc<BatchTimer>>,
    /// The engine was busy with other streams' batches when this stream's partial batch was
    /// due: the timer waits for the frames' deadline before it tries again.
    pub(crate) engine_busy: bool,
    /// The server (`backend=kserve`) did not answer the last item.
    pub(crate) server_away: bool,
    /// When the element last warned that the server did not answer.
    pub(crate) server_warned: Option<Instant>,
}

impl Queue {
    /// Sets the timer to the moment the oldest frame still waiting for its scores has waited
    /// `batch-timeout`, or its deadline (a live source) comes, whichever is first.
    pub(crate) fn arm_timer(&self, tunables: &Tunables) {
        let Some(timer) = &self.timer else { return };
        match self.partial_batch_due(tunables) {
            Some(at) => timer.arm(at),
            None => timer.disarm(),
        }
    }

    /// When the partial batch holding this element's frames is next due to run: its oldest
    /// frame has waited `batch-timeout` (unless the engine was found busy), or a frame's
    /// deadline comes.
    pub(crate) fn partial_batch_due(&self, tunables: &Tunables) -> Option<Instant> {
        let batch = self.deadline(tunables).filter(|_| !self.engine_busy);
        [batch, self.batcher.next_expiry()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Cancels the timer's deadline (nothing waits any more, or the stream failed).
    pub(crate) fn disarm_timer(&self) {
        if let Some(timer) = &self.timer {
            timer.disarm();
        }
    }

    /// When the oldest frame still waiting for its scores will have waited `batch-timeout`;
    /// `None` when no frame waits or the timeout is off.
    pub(crate) fn deadline(&self, tunables: &Tunables) -> Option<Instant> {
        self.batcher.deadline(tunables.batch_timeout())
    }

    /// Drops every held frame (a flush).
    pub(crate) fn flush(&mut self) {
        self.batcher.flush();
        self.ready.clear();
        self.engine_busy = false;
        self.disarm_timer();
    }
}

/// From scores to results, and where the results go.
pub(crate) struct Outputs {
    /// `labels-location`, read at start.
    pub(crate) labels: Labels,
    /// The model's file name, which results carry.
    pub(crate) model_name: String,
    /// The element's name when it started, which results on ROI metas carry.
    pub(crate) element_name: String,
    /// Whether scores go through a softmax; for `softmax=auto` settled on the first result.
    pub(crate) apply_softmax: Option<bool>,
    /// `results-location` and its writer.
    pub(crate) results: Option<(String, ResultsWriter)>,
    /// The last fresh frame's whole-frame result, which carried frames (`interval`) take.
    pub(crate) last: Vec<ClassEntry>,
    /// Fresh frames whose scores held NaN or infinity (the first one is a warning).
    pub(crate) non_finite: u64,
}

impl Outputs {
    /// The outputs of the model at `location` (a path), for the element named `element_name`.
    pub(crate) fn new(
        location: &str,
        element_name: String,
        labels: Labels,
        apply_softmax: Option<bool>,
        results: Option<(String, ResultsWriter)>,
    ) -> Self {
        // The model's file name, for the metadata and the JSON lines.
        let model_name = std::path::Path::new(location)
            .file_name()
            .map_or_else(|| location.to_owned(), |n| n.to_string_lossy().into_owned());
        Self {
            labels,
            model_name,
            element_name,
            apply_softmax,
            results,
            last: Vec::new(),
            non_finite: 0,
        }
    }
}

/// Failures on one thread that the streaming thread answers with.
#[derive(Default)]
pub(crate) struct Failure {
    /// An error from a push made outside the streaming thread, returned by the next chain.
    pub(crate) flow_error: Option<gst::FlowError>,
    /// The engine failed a batch of this stream's frames, and said so in an element error:
    /// from the first frame of that batch on, frames are held back (and dropped at the next
    /// flush or stop) and every chain fails, so that no frame leaves with another's result.
    pub(crate) failed: bool,
}

impl Failure {
    /// What a new buffer gets: the error relayed from outside the streaming thread (once),
    /// or an error while the stream has failed.
    pub(crate) fn check(&mut self) -> Result<(), gst::FlowError> {
        if let Some(err) = self.flow_error.take() {
            return Err(err);
        }
        if self.failed {
            return Err(gst::FlowError::Error);
        }
        Ok(())
    }
}
