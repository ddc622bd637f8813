// SPDX-License-Identifier: MPL-2.0
//! What the element has done since it started, for its read-only `stats` property: frames in
//! and out and what became of them, the engine's batches, the time frames spend in the
//! element, and the engine that runs. Kept apart from the element's state, which is held
//! while a batch runs, so that reading `stats` never waits for one.

use std::time::Duration;

use super::batcher::Unscored;
use super::latency::Latencies;
use crate::engine::ModelInfo;
use crate::instance::{InstanceStats, Joined, Stream};

/// The name of the `stats` structure.
pub(crate) const NAME: &str = "application/x-trtclassify-stats";

/// The element's counts since it started.
#[derive(Default)]
pub(crate) struct Stats {
    frames_in: u64,
    frames_out: u64,
    classified: u64,
    carried: u64,
    late: u64,
    qos: u64,
    /// Passed on unclassified: the server did not answer (`backend=kserve`).
    unanswered: u64,
    /// Time in the element.
    pub(crate) latency: Latencies,
    /// Frames of a live source: how long after they were due they left.
    pub(crate) lateness: Latencies,
    /// The engine the element uses, and its figures.
    engine: Option<EngineSummary>,
    instance: Option<std::sync::Arc<crate::instance::Instance>>,
    /// Engines the element switched to while running (live model updates).
    updates: u64,
}

/// What the element tells of the engine it runs.
struct EngineSummary {
    model: String,
    backend: String,
    precision: String,
    /// The GPU it runs on (GPU backends).
    gpu: Option<u32>,
    /// How the element got it: "built", "loaded" (from its engine file), "shared".
    origin: &'static str,
    ready_in: Duration,
    engine_file: Option<String>,
    /// Full batches it may hold unanswered while the next gathers (a GPU's, a server's).
    batches_in_flight: usize,
}

impl Stats {
    /// A frame came in.
    pub(crate) fn frame_in(&mut self) {
        self.frames_in += 1;
    }

    /// A frame left: inferred (`None`), or carrying the last result for a reason.
    pub(crate) fn frame_out(&mut self, unscored: Option<Unscored>) {
        self.frames_out += 1;
        match unscored {
            None => self.classified += 1,
            Some(Unscored::Carried) => self.carried += 1,
            Some(Unscored::Late) => self.late += 1,
            Some(Unscored::Qos) => self.qos += 1,
            Some(Unscored::Unanswered) => self.unanswered += 1,
        }
    }

    /// Frames classified, and passed on unclassified by the overload policy (late or QoS)
    /// or for want of a server's answer.
    pub(crate) fn processed_and_dropped(&self) -> (u64, u64) {
        (self.classified, self.late + self.qos + self.unanswered)
    }

    /// Frames classified, passed on unclassified late, and passed on unclassified by QoS.
    pub(crate) fn outcomes(&self) -> (u64, u64, u64) {
        (self.classified, self.late, self.qos)
    }

    /// The element runs `stream`'s engine now, on `gpu` (GPU backends), got `how` in
    /// `ready_in`, for `model`.
    pub(crate) fn engine(
        &mut self,
        model: &str,
        stream: &Stream,
        gpu: Option<u32>,
        how: Joined,
        ready_in: Duration,
    ) {
        let info: &ModelInfo = stream.info();
        let loaded = info.engine_file.as_ref().map(|f| f.loaded);
        if self.engine.is_some() {
            self.updates += 1;
        }
        self.engine = Some(EngineSummary {
            model: model.to_owned(),
            backend: format!("{:?}", info.backend).to_lowercase(),
            precision: format!("{:?}", info.precision).to_lowercase(),
            gpu,
            origin: match (how, loaded) {
                (Joined::Shared, _) => "shared",
                (Joined::Built, Some(true)) => "loaded",
                (Joined::Built, _) => "built",
            },
            ready_in,
            engine_file: info
                .engine_file
                .as_ref()
                .map(|f| f.path.display().to_string()),
            batches_in_flight: info.batches_in_flight.max(1),
        });
        self.instance = Some(stream.instance());
    }

    /// The `stats` structure.
    pub(crate) fn to_structure(&self) -> gst::Structure {
        let shared = self
            .instance
            .as_ref()
            .map(|i| i.stats())
            .unwrap_or_default();
        let InstanceStats {
            streams,
            batch_size,
            batches,
            items,
            batch_time,
            rebuilds,
            failures,
        } = shared;
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let steady = &self.latency.steady;
        let latency = match steady.frames() {
            0 => &self.latency.all,
            _ => steady,
        };
        let mut s = gst::Structure::builder(NAME)
            .field("frames-in", self.frames_in)
            .field("frames-out", self.frames_out)
            .field("classified", self.classified)
            .field("carried", self.carried)
            .field("unclassified-late", self.late)
            .field("unclassified-qos", self.qos)
            .field("unclassified-server", self.unanswered)
            .field("latency-p50", ns(latency.quantile(0.5)))
            .field("latency-p99", ns(latency.quantile(0.99)))
            .field("latency-max", ns(self.latency.all.max()))
            .field("lateness-p50", ns(self.lateness.all.quantile(0.5)))
            .field("lateness-p99", ns(self.lateness.all.quantile(0.99)))
            .field("lateness-max", ns(self.lateness.all.max()))
            .field("batches", batches)
            // Items per batch over the batch size: how full the engine's batches ran.
            .field(
                "mean-batch-fill",
                match batches {
                    0 => 0.0,
                    n => items as f64 / (n as f64 * batch_size as f64),
                },
            )
            .field("batch-time", ns(batch_time))
            .field("streams", streams as u32)
            .field("engine-rebuilds", rebuilds)
            .field("engine-failures", failures)
            .field("model-updates", self.updates)
            .build();
        if let Some(e) = &self.engine {
            s.set("model", &e.model);
            s.set("backend", &e.backend);
            s.set("precision", &e.precision);
            if let Some(gpu) = e.gpu {
                s.set("gpu", gpu);
            }
            s.set("engine", e.origin);
            s.set("engine-ready-time", ns(e.ready_in));
            s.set("batches-in-flight", e.batches_in_flight as u32);
            if let Some(file) = &e.engine_file {
                s.set("engine-file", file);
            }
        }
        s
    }
}
