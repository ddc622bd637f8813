// SPDX-License-Identifier: MPL-2.0
//! A frame's way out of the element: the engine's scores handed to the batcher, each frame
//! that may leave given its result (top classes, regions, the last result carried for a frame
//! passed on unclassified), the result put on the buffer (`TrtClassifyMeta`, ROI metas,
//! analytics) and into `results-location`, and the QoS message for frames passed on
//! unclassified.

use std::time::{Duration, Instant};

use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;

use super::batcher::{Released, Unscored};
use super::imp::{CAT, TrtClassify};
use super::settings::Tunables;
use super::state::{Held, Outputs, State};
use crate::engine::{self, ModelInfo};
use crate::outputs::meta::{ClassEntry, Classification, RegionResult};
use crate::outputs::postprocess;
use crate::outputs::results::ResultsWriter;
use crate::regions;

/// The shortest time between two warnings that the server did not answer.
const SERVER_WARNING_EVERY: Duration = Duration::from_secs(60);

impl TrtClassify {
    /// Takes the scores that have arrived for this element's frames, then sends on (into
    /// `ready`) every frame at the front that has its result.
    pub(super) fn collect(
        &self,
        state: &mut State,
        tunables: &Tunables,
    ) -> Result<(), gst::FlowError> {
        if state.failure.failed {
            return Err(gst::FlowError::Error);
        }
        self.take_scores(state)?;
        let mut lines = Vec::new();
        // The first and last frame sent on, for an error about their lines.
        let mut sent: Option<(u64, u64)> = None;
        // The last frame passed on unclassified by the overload policy, for a QoS message.
        let mut unclassified = None;
        for released in state.queue.batcher.release() {
            let (frame, arrived, due, unscored) = (
                released.number,
                released.arrived,
                released.due,
                released.unscored,
            );
            let (mut buffer, result, places) = self.classify(state, tunables, released);
            if state.outputs.results.is_some() {
                lines.push(ResultsWriter::format(&result, buffer.pts()));
            }
            sent = Some((sent.map_or(frame, |(first, _)| first), frame));
            self.attach_results(state, buffer.make_mut(), &result, places);
            {
                let mut stats = self.stats.lock().unwrap();
                stats.frame_out(unscored);
                stats.latency.record(frame, arrived);
                if let Some(due) = due {
                    stats.lateness.record(frame, due);
                }
            }
            if matches!(
                unscored,
                Some(Unscored::Late | Unscored::Qos | Unscored::Unanswered)
            ) {
                unclassified = Some((buffer.clone(), arrived));
            }
            state.queue.ready.push_back(buffer);
        }
        if let Some((buffer, arrived)) = unclassified {
            self.post_qos(&buffer, arrived);
        }
        self.write_results(state, &lines, sent)
    }

    /// Says on the bus that frames pass on unclassified (QoS message, at most one per
    /// `overload::QOS_MESSAGE_EVERY`), with the counts of frames classified ("processed") and
    /// passed on unclassified ("dropped": their results, not the frames), and how long the
    /// last one, `buffer`, stayed (its jitter).
    fn post_qos(&self, buffer: &gst::BufferRef, arrived: Instant) {
        let proportion = {
            let mut qos = self.qos.lock().unwrap();
            if !qos.message_due(Instant::now()) {
                return;
            }
            qos.proportion
        };
        let (processed, dropped) = self.stats.lock().unwrap().processed_and_dropped();
        let obj = self.obj();
        let segment = obj.segment();
        let segment = segment.downcast_ref::<gst::ClockTime>();
        let pts = buffer.pts();
        let quality = match processed + dropped {
            0 => 1_000_000,
            all => (processed as f64 / all as f64 * 1e6) as i32,
        };
        let jitter = i64::try_from(arrived.elapsed().as_nanos()).unwrap_or(i64::MAX);
        let msg = gst::message::Qos::builder(true)
            .running_time(segment.and_then(|s| s.to_running_time(pts)))
            .stream_time(segment.and_then(|s| s.to_stream_time(pts)))
            .timestamp(pts)
            .duration(buffer.duration())
            .values(
                jitter,
                if proportion > 0.0 { proportion } else { 1.0 },
                quality,
            )
            .stats(
                gst::format::Buffers::from_u64(processed),
                gst::format::Buffers::from_u64(dropped),
            )
            .src(&*obj)
            .build();
        let _ = obj.post_message(msg);
    }

    /// Hands the scores that the engine returned for this stream to the batcher, which gives
    /// them to its fresh frames in order.
    fn take_scores(&self, state: &mut State) -> Result<(), gst::FlowError> {
        let taken = state.stream.take_scores();
        if !taken.is_empty() {
            state.queue.engine_busy = false;
        }
        for scores in taken {
            let refused = match scores {
                Ok(scores) if scores.is_empty() => {
                    self.server_unanswered(state);
                    state.queue.batcher.unanswered().err()
                }
                Ok(scores) => {
                    if std::mem::take(&mut state.queue.server_away) {
                        gst::info!(CAT, imp = self, "the server answers again");
                    }
                    state.queue.batcher.score(scores).err().map(|_| ())
                }
                Err(e) => return Err(self.fail(state, &e.to_string())),
            };
            if refused.is_some() {
                let problem = "the engine returned scores for frames it was not given";
                return Err(self.fail(state, problem));
            }
        }
        Ok(())
    }

    /// The server (`backend=kserve`) did not answer for an item: said in a warning when it
    /// goes away, at most once a minute (a flaky server would otherwise warn on every flip);
    /// the frames pass on unclassified, counted.
    fn server_unanswered(&self, state: &mut State) {
        if std::mem::replace(&mut state.queue.server_away, true)
            || state
                .queue
                .server_warned
                .is_some_and(|t| t.elapsed() < SERVER_WARNING_EVERY)
        {
            return;
        }
        state.queue.server_warned = Some(Instant::now());
        // Copied out: a bus handler that reads a property must not find the settings locked.
        let url = self.settings.lock().unwrap().server.url.clone();
        gst::element_imp_warning!(
            self,
            gst::ResourceError::Read,
            [
                "{}: the server {} did not answer; frames pass on unclassified (stats: unclassified-server) until it does (GST_DEBUG=trtclassify-engine:2 says why)",
                state.outputs.model_name,
                url.unwrap_or_default()
            ]
        );
    }

    /// The result of a frame that may leave: the top classes of each of its items (or the
    /// last whole-frame result for a carried frame), with where each region's result goes
    /// (its ROI meta and detection).
    fn classify(
        &self,
        state: &mut State,
        tunables: &Tunables,
        released: Released<Held>,
    ) -> (gst::Buffer, Classification, Vec<RegionPlace>) {
        let Released {
            frame: Held { buffer, regions },
            number: frame,
            scores,
            unscored: _,
            arrived: _,
            due: _,
        } = released;
        let fresh = scores.is_some();
        let mut region_results = Vec::new();
        let mut places = Vec::new();
        if let Some(items) = scores {
            let info = state.stream.info();
            let outputs = &mut state.outputs;
            let mut items = items.into_iter();
            if state.input.roi.whole_frame() {
                let whole = items.next().expect("the whole frame is the first item");
                outputs.last = self.top_classes(outputs, info, tunables, frame, whole);
            }
            for (region, scores) in regions.into_iter().zip(items) {
                places.push(RegionPlace {
                    meta_index: region.meta_index,
                    detection: region.detection,
                });
                let r = region.rect;
                region_results.push(RegionResult {
                    id: region.id,
                    roi_type: region.roi_type,
                    rect: (r.x as u32, r.y as u32, r.w as u32, r.h as u32),
                    classes: self.top_classes(outputs, info, tunables, frame, scores),
                });
            }
        }
        let result = Classification {
            model: state.outputs.model_name.clone(),
            frame,
            fresh,
            classes: state.outputs.last.clone(),
            regions: region_results,
        };
        (buffer, result, places)
    }

    /// Puts a frame's result on its buffer: `TrtClassifyMeta`, each region's result on its
    /// ROI meta, and with the analytics feature the `GstAnalyticsClsMtd`s.
    fn attach_results(
        &self,
        state: &State,
        buffer: &mut gst::BufferRef,
        result: &Classification,
        places: Vec<RegionPlace>,
    ) {
        for (region, place) in result.regions.iter().zip(places) {
            if let Some(index) = place.meta_index {
                regions::attach(
                    buffer,
                    index,
                    &state.outputs.model_name,
                    &state.outputs.element_name,
                    &region.classes,
                );
            }
            // Without the analytics feature, regions have no detection.
            #[cfg(feature = "analytics")]
            if let Some(id) = place.detection {
                self.attach_analytics(buffer, Some(id), &region.classes);
            }
        }
        #[cfg(feature = "analytics")]
        if state.input.roi.whole_frame() {
            self.attach_analytics(buffer, None, &result.classes);
        }
        result.attach(buffer);
    }

    /// Appends the lines of the frames just sent on (`sent`: the first and last) to
    /// `results-location`. A write error stops the stream, as an engine failure does.
    fn write_results(
        &self,
        state: &mut State,
        lines: &[String],
        sent: Option<(u64, u64)>,
    ) -> Result<(), gst::FlowError> {
        let Some((path, writer)) = state.outputs.results.as_mut() else {
            return Ok(());
        };
        let Err(e) = writer.write_lines(lines) else {
            return Ok(());
        };
        // These frames still go on with their meta (see `submit_input_buffer` and
        // `finish_batch`); their lines are lost, and so would every later frame's be:
        // the stream stops here, as on an engine failure.
        gst::element_imp_error!(
            self,
            gst::ResourceError::Write,
            [
                "{}: cannot write results: {}; the lines of frames {} to {} are lost",
                path,
                e,
                sent.map_or(0, |(first, _)| first),
                sent.map_or(0, |(_, last)| last)
            ]
        );
        state.failure.failed = true;
        state.queue.disarm_timer();
        Err(gst::FlowError::Error)
    }

    /// The top-k classes of one item's scores (the whole frame or a region of frame `frame`),
    /// through the softmax when the scores are not probabilities yet.
    fn top_classes(
        &self,
        outputs: &mut Outputs,
        info: &ModelInfo,
        tunables: &Tunables,
        frame: u64,
        mut scores: Vec<f32>,
    ) -> Vec<ClassEntry> {
        if scores.iter().any(|v| !v.is_finite()) {
            self.report_non_finite(outputs, info, frame);
        }
        let apply = *outputs.apply_softmax.get_or_insert_with(|| {
            let apply = !postprocess::is_distribution(&scores);
            gst::info!(
                CAT,
                imp = self,
                "softmax=auto: scores {} probabilities",
                if apply { "are not" } else { "already are" }
            );
            apply
        });
        if apply {
            postprocess::softmax_in_place(&mut scores);
        }
        postprocess::top_k(&scores, tunables.top_k as usize, tunables.threshold as f32)
            .into_iter()
            .map(|(id, confidence)| ClassEntry {
                class_id: id as u32,
                label: outputs.labels.get(id),
                confidence,
            })
            .collect()
    }

    /// Adds `classes` to the buffer's analytics relation meta, related to the detection
    /// `detection` when given; a failure to add is a warning, not the frame's loss.
    #[cfg(feature = "analytics")]
    fn attach_analytics(
        &self,
        buffer: &mut gst::BufferRef,
        detection: Option<u32>,
        classes: &[ClassEntry],
    ) {
        if let Err(e) = crate::analytics::attach(buffer, detection, classes) {
            gst::warning!(CAT, imp = self, "cannot add a GstAnalyticsClsMtd: {e}");
        }
    }

    /// Says, once per start, that a frame's scores are not all finite: top-k leaves such
    /// classes out, so without a word the frame would leave with fewer classes or none.
    fn report_non_finite(&self, outputs: &mut Outputs, info: &ModelInfo, frame: u64) {
        outputs.non_finite += 1;
        if outputs.non_finite > 1 {
            return;
        }
        let mut hint = match info.precision {
            engine::Precision::Fp16 if info.backend == engine::Backend::Cuda => {
                "; with precision=fp16 this is usually a value beyond fp16's range: try precision=fp32".to_owned()
            }
            _ => String::new(),
        };
        if let Some(found) = info.non_finite.get() {
            hint = format!("; {found}{hint}");
        }
        gst::element_imp_warning!(
            self,
            gst::StreamError::Decode,
            [
                "{}: the scores of frame {} are not all finite numbers (NaN or infinity){}; its result leaves those classes out; later such frames are counted in the log at stop",
                outputs.model_name,
                frame,
                hint
            ]
        );
    }
}

/// Where a region's result goes besides the frame's meta: its ROI meta (by its place among
/// the buffer's ROI metas) and its detection (the `analytics` feature).
struct RegionPlace {
    meta_index: Option<usize>,
    #[cfg_attr(not(feature = "analytics"), allow(dead_code))]
    detection: Option<u32>,
}
