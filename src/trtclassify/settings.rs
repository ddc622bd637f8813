// SPDX-License-Identifier: MPL-2.0
//! The element's settings: what its properties hold, their defaults, the checks a value
//! gets, and what the settings make of the engine it joins (`InstanceKey`), of
//! post-processing and of batching. No GObject in here: `imp.rs` declares the properties
//! (their ranges and blurbs, with the defaults from here) and stores their values here.

use std::time::Duration;

use gst::prelude::*;

use super::enums::{Backend, ChannelOrder, Precision, ResizeMode};
use crate::engine::kserve::ServerOptions;
use crate::engine::{self, EngineOptions};
use crate::instance::{FileStamp, InstanceKey};
use crate::outputs::postprocess::Softmax;
use crate::preprocess::PreprocessOptions;
use crate::regions::{RegionFilter, RoiMode};

// The defaults of the properties, which `imp.rs` declares with them.
pub(crate) const DEFAULT_BACKEND: Backend = Backend::Auto;
pub(crate) const DEFAULT_PRECISION: Precision = Precision::Fp16;
pub(crate) const DEFAULT_GPU_ID: i32 = super::placement::AUTOMATIC;
pub(crate) const DEFAULT_BATCH_SIZE: u32 = 1;
/// The largest `batch-size`.
pub(crate) const MAX_BATCH_SIZE: u32 = 64;
pub(crate) const DEFAULT_BATCH_TIMEOUT_MS: i32 = 100;
pub(crate) const DEFAULT_MAX_LATENESS_MS: i32 = super::overload::AUTOMATIC;
pub(crate) const DEFAULT_TOP_K: u32 = 5;
pub(crate) const DEFAULT_THRESHOLD: f64 = 0.0;
pub(crate) const DEFAULT_SOFTMAX: Softmax = Softmax::Auto;
pub(crate) const DEFAULT_SCALE: f64 = 1.0 / 255.0;
const DEFAULT_MEAN: [f64; 3] = [0.485, 0.456, 0.406];
const DEFAULT_STD: [f64; 3] = [0.229, 0.224, 0.225];
pub(crate) const DEFAULT_CHANNEL_ORDER: ChannelOrder = ChannelOrder::Rgb;
pub(crate) const DEFAULT_RESIZE_MODE: ResizeMode = ResizeMode::Stretch;
pub(crate) const DEFAULT_INTERVAL: u32 = 1;
pub(crate) const DEFAULT_ROI: RoiMode = RoiMode::Frame;
pub(crate) const DEFAULT_SERVER_TIMEOUT_MS: u32 = 2_000;

/// The values of the element's properties, each field the property of the same name (`_ms`
/// and `roi_filter` aside); copied out of its lock before any work.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) onnx_location: Option<String>,
    pub(crate) labels_location: Option<String>,
    pub(crate) results_location: Option<String>,
    pub(crate) engine_location: Option<String>,
    pub(crate) calibration_location: Option<String>,
    /// `calibration-frames`: the frames an int8 or FP8 engine is calibrated on.
    pub(crate) calibration_frames: u32,
    pub(crate) min_agreement: f64,
    pub(crate) model_instance_id: Option<String>,
    pub(crate) backend: Backend,
    pub(crate) precision: Precision,
    /// -1: chosen by the frames (`placement`).
    pub(crate) gpu_id: i32,
    pub(crate) threads: u32,
    pub(crate) batch_size: u32,
    pub(crate) input_width: u32,
    pub(crate) input_height: u32,
    pub(crate) softmax: Softmax,
    pub(crate) scale: f64,
    pub(crate) mean: Vec<f64>,
    pub(crate) std: Vec<f64>,
    pub(crate) channel_order: ChannelOrder,
    pub(crate) resize_mode: ResizeMode,
    pub(crate) roi: RoiMode,
    pub(crate) roi_filter: RegionFilter,
    pub(crate) tunables: Tunables,
    /// The `server-*` properties (`backend=kserve`).
    pub(crate) server: Server,
    /// A property value that was refused, by property name; `start()` fails with it (and a
    /// live update with a warning) until that property is set right, so that a typo in a
    /// launch line never runs silently with the old value.
    refused: Option<(String, String)>,
}

/// The `server-*` properties, as set.
#[derive(Debug, Clone)]
pub(crate) struct Server {
    pub(crate) url: Option<String>,
    pub(crate) model: Option<String>,
    pub(crate) version: Option<String>,
    pub(crate) timeout_ms: u32,
    pub(crate) ca: Option<String>,
    pub(crate) cert: Option<String>,
    pub(crate) key: Option<String>,
}

impl Default for Server {
    fn default() -> Self {
        Self {
            url: None,
            model: None,
            version: None,
            timeout_ms: DEFAULT_SERVER_TIMEOUT_MS,
            ca: None,
            cert: None,
            key: None,
        }
    }
}

impl Server {
    /// The server options of `backend=kserve`, or what is missing.
    fn options(&self) -> Result<ServerOptions, String> {
        let (Some(url), Some(model)) = (&self.url, &self.model) else {
            return Err(
                "backend=kserve needs server-url (grpc://host:port) and server-model".into(),
            );
        };
        let identity = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Some((cert.into(), key.into())),
            (None, None) => None,
            _ => {
                return Err(
                    "set both server-cert-location and server-key-location, or neither".into(),
                );
            }
        };
        Ok(ServerOptions {
            url: url.clone(),
            model: model.clone(),
            version: self.version.clone().unwrap_or_default(),
            timeout: Duration::from_millis(self.timeout_ms.into()),
            ca: self.ca.as_ref().map(Into::into),
            identity,
        })
    }
}

/// What may change while playing; copied out for every buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tunables {
    pub(crate) batch_timeout_ms: i32,
    pub(crate) max_lateness_ms: i32,
    pub(crate) top_k: u32,
    pub(crate) threshold: f64,
    pub(crate) interval: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            onnx_location: None,
            labels_location: None,
            results_location: None,
            engine_location: None,
            calibration_location: None,
            calibration_frames: crate::calibrate::FRAMES as u32,
            min_agreement: crate::engine::DEFAULT_MIN_AGREEMENT,
            model_instance_id: None,
            backend: DEFAULT_BACKEND,
            precision: DEFAULT_PRECISION,
            gpu_id: DEFAULT_GPU_ID,
            threads: 0,
            batch_size: DEFAULT_BATCH_SIZE,
            input_width: 0,
            input_height: 0,
            softmax: DEFAULT_SOFTMAX,
            scale: DEFAULT_SCALE,
            mean: DEFAULT_MEAN.to_vec(),
            std: DEFAULT_STD.to_vec(),
            channel_order: DEFAULT_CHANNEL_ORDER,
            resize_mode: DEFAULT_RESIZE_MODE,
            roi: DEFAULT_ROI,
            roi_filter: RegionFilter::default(),
            tunables: Tunables {
                batch_timeout_ms: DEFAULT_BATCH_TIMEOUT_MS,
                max_lateness_ms: DEFAULT_MAX_LATENESS_MS,
                top_k: DEFAULT_TOP_K,
                threshold: DEFAULT_THRESHOLD,
                interval: DEFAULT_INTERVAL,
            },
            server: Server::default(),
            refused: None,
        }
    }
}

impl Settings {
    /// Sets `mean` or `std` (`name`) from a property value: 1 or 3 finite numbers, std
    /// values above 0. A refused value is kept (see `refused`) and returned, for the log.
    pub(crate) fn set_channel_values(
        &mut self,
        name: &str,
        value: &glib::Value,
    ) -> Result<(), String> {
        let values = parse_channel_values(name, value).inspect_err(|problem| {
            self.refused = Some((name.to_owned(), problem.clone()));
        })?;
        match name {
            "mean" => self.mean = values,
            _ => self.std = values,
        }
        if self
            .refused
            .as_ref()
            .is_some_and(|(which, _)| which == name)
        {
            self.refused = None;
        }
        Ok(())
    }

    /// Sets `roi-types` from its comma-separated list (unset: every type).
    pub(crate) fn set_roi_types(&mut self, list: Option<&str>) {
        self.roi_filter.types = RegionFilter::parse_types(list.unwrap_or(""));
    }

    /// `roi-types` as the property reads: the list, or unset for every type.
    pub(crate) fn roi_types(&self) -> Option<String> {
        (!self.roi_filter.types.is_empty()).then(|| self.roi_filter.types.join(","))
    }

    /// What the properties make of the engine the element joins on GPU `gpu` (`gpu-id`, or
    /// where `placement` put it): its options, checked, and the instance they share; or what
    /// is wrong with them.
    pub(crate) fn instance_key(
        &self,
        progress: engine::Progress,
        gpu: u32,
    ) -> Result<InstanceKey, String> {
        if let Some((_, problem)) = &self.refused {
            return Err(format!("Invalid property value: {problem}"));
        }
        let server = match self.backend {
            Backend::Kserve => self.server.options()?,
            _ => ServerOptions::default(),
        };
        // A server's model may come without a local copy: its metadata says the rest.
        let location = match (self.onnx_location.clone(), self.backend) {
            (Some(location), _) => location,
            (None, Backend::Kserve) => String::new(),
            (None, _) => {
                return Err(
                    "onnx-location is not set: give the path of an ONNX image classifier".into(),
                );
            }
        };
        let input_size = match (self.input_height, self.input_width) {
            (0, 0) => None,
            (0, _) | (_, 0) => {
                return Err("set both input-width and input-height, or neither".into());
            }
            (h, w) => Some((h as usize, w as usize)),
        };
        let eight_bit = matches!(self.precision, Precision::Int8 | Precision::Fp8);
        Ok(InstanceKey {
            model_file: FileStamp::of(location.as_ref()),
            calibration_frames: if eight_bit {
                self.calibration_frames
            } else {
                0
            },
            id: self.model_instance_id.clone().unwrap_or_default(),
            backend: self.backend.into(),
            options: EngineOptions {
                model: location.into(),
                batch_size: self.batch_size as usize,
                input_size,
                precision: self.precision.into(),
                calibration: self.calibration_location.clone().map(Into::into),
                min_agreement: self.min_agreement,
                strict_precision: false,
                gpu_id: gpu,
                threads: self.threads as usize,
                engine_location: self.engine_location.clone().map(Into::into),
                progress,
                preprocess: self.preprocess_options(),
                server,
            },
        })
    }

    /// The model as results and messages name it: `onnx-location`, or for `backend=kserve`
    /// without one, `server-model`.
    pub(crate) fn model_location(&self) -> String {
        match (&self.onnx_location, self.backend) {
            (Some(location), _) => location.clone(),
            (None, Backend::Kserve) => self.server.model.clone().unwrap_or_default(),
            (None, _) => String::new(),
        }
    }

    /// `scale`, `mean`, `std`, `channel-order` and `resize-mode`, as the engine takes them.
    fn preprocess_options(&self) -> PreprocessOptions {
        PreprocessOptions {
            scale: self.scale as f32,
            mean: self.mean.iter().map(|v| *v as f32).collect(),
            std: self.std.iter().map(|v| *v as f32).collect(),
            channel_order: self.channel_order.into(),
            resize: self.resize_mode.into(),
        }
    }

    /// Whether scores go through a softmax, for an engine whose model does (or does not) end
    /// in one; `None` (`softmax=auto` and a model that does not): settled on the first
    /// result.
    pub(crate) fn apply_softmax(&self, outputs_probabilities: bool) -> Option<bool> {
        match self.softmax {
            Softmax::On => Some(true),
            Softmax::Off => Some(false),
            Softmax::Auto if outputs_probabilities => Some(false),
            Softmax::Auto => None,
        }
    }

    /// Whether frames wait for batch-mates, so that the element needs its timer thread.
    pub(crate) fn batches(&self) -> bool {
        self.held_items() > 1
    }

    /// The most fresh frames held for their scores: `batch-size`, times the batches a
    /// remote server may have in flight (`backend=kserve`).
    fn held_items(&self) -> u32 {
        match self.backend {
            Backend::Kserve => self.batch_size * engine::kserve::IN_FLIGHT as u32,
            _ => self.batch_size,
        }
    }

    /// How many frames the element may hold beyond the one being pushed: `held_items − 1`
    /// fresh frames, and the carried frames (`interval`) between them.
    pub(crate) fn held_frames(&self) -> u32 {
        (self.held_items() - 1) * self.tunables.interval
    }

    /// How many frames the element holds at most beyond the one being pushed, at `framerate`,
    /// on an engine that holds `batches_in_flight` batches (its `ModelInfo`'s, once known:
    /// a GPU's batches run while the next gathers): `held_frames`, but no more than arrive
    /// while the oldest waits `batch-timeout` (the partial batch then runs and they leave),
    /// and one more for that batch's run.
    pub(crate) fn held_frames_at(
        &self,
        framerate: Option<gst::Fraction>,
        batches_in_flight: Option<u32>,
    ) -> u32 {
        let held = match batches_in_flight {
            Some(n) => (self.batch_size * n.max(1) - 1) * self.tunables.interval,
            None => self.held_frames(),
        };
        let (Some(timeout), Some(fps)) = (self.tunables.batch_timeout(), framerate) else {
            return held;
        };
        if held == 0 || fps.numer() <= 0 || fps.denom() <= 0 {
            return held;
        }
        let in_timeout = (timeout.as_secs_f64() * fps.numer() as f64 / fps.denom() as f64).ceil();
        held.min(in_timeout as u32 + 1)
    }

    /// The delay that holding frames for a batch adds at `framerate`: up to `batch-size − 1`
    /// frame durations (times `interval`), bounded by `batch-timeout`.
    pub(crate) fn added_latency(&self, framerate: Option<gst::Fraction>) -> gst::ClockTime {
        if !self.batches() {
            return gst::ClockTime::ZERO;
        }
        let waiting_frames = u64::from(self.held_frames());
        let by_rate = framerate.and_then(|fps| {
            gst::ClockTime::SECOND
                .mul_div_ceil(fps.denom() as u64 * waiting_frames, fps.numer() as u64)
        });
        let by_timeout = u64::try_from(self.tunables.batch_timeout_ms)
            .ok()
            .map(gst::ClockTime::from_mseconds);
        match (by_rate, by_timeout) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or(gst::ClockTime::ZERO),
        }
    }
}

impl Tunables {
    /// Whether the property `name` is one of these: read for every frame, so that a change
    /// applies at once, without a new engine.
    pub(crate) fn is_tunable(name: &str) -> bool {
        matches!(
            name,
            "batch-timeout" | "max-lateness" | "top-k" | "threshold" | "interval"
        )
    }

    /// `batch-timeout` as a duration; `None` when frames wait for a full batch (-1).
    pub(crate) fn batch_timeout(&self) -> Option<Duration> {
        u64::try_from(self.batch_timeout_ms)
            .ok()
            .map(Duration::from_millis)
    }
}

/// A `mean` or `std` value: 1 or 3 finite numbers, std values above 0.
fn parse_channel_values(name: &str, value: &glib::Value) -> Result<Vec<f64>, String> {
    let array = value
        .get::<gst::Array>()
        .map_err(|_| format!("{name}: expected an array such as <0.5, 0.5, 0.5>"))?;
    let values = array
        .iter()
        .map(|v| {
            v.get::<f64>()
                .or_else(|_| v.get::<f32>().map(f64::from))
                .or_else(|_| v.get::<i32>().map(f64::from))
                .map_err(|_| format!("{name}: {v:?} is not a number"))
        })
        .collect::<Result<Vec<f64>, _>>()?;
    if !matches!(values.len(), 1 | 3) {
        return Err(format!(
            "{name}: {} values given; give 1 (all channels) or 3 (one per channel)",
            values.len()
        ));
    }
    if let Some(bad) = values
        .iter()
        .find(|v| !v.is_finite() || (name == "std" && **v <= 0.0))
    {
        return Err(format!(
            "{name}: {bad} is not allowed (values must be finite{})",
            if name == "std" { " and above 0" } else { "" }
        ));
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn array(values: &[f64]) -> glib::Value {
        gst::Array::new(values.iter().copied()).to_value()
    }

    #[test]
    fn a_refused_value_holds_until_that_property_is_set_right() {
        gst::init().unwrap();
        let mut s = Settings {
            onnx_location: Some("m.onnx".into()),
            ..Default::default()
        };
        assert!(s.set_channel_values("mean", &array(&[0.5, 0.5])).is_err());
        assert!(s.set_channel_values("std", &array(&[0.5])).is_ok());
        let err = s.instance_key(Default::default(), 0).unwrap_err();
        assert!(err.contains("mean: 2 values given"), "{err}");
        // Set right, the element may start (or update) again.
        assert!(
            s.set_channel_values("mean", &array(&[0.1, 0.2, 0.3]))
                .is_ok()
        );
        assert!(s.instance_key(Default::default(), 0).is_ok());
        assert_eq!(s.mean, [0.1, 0.2, 0.3]);
    }

    #[test]
    fn frames_held_for_the_allocation_query_are_bounded_by_the_batch_timeout() {
        let mut s = Settings {
            batch_size: 16,
            ..Default::default()
        };
        s.tunables.interval = 30;
        let fps = |n| Some(gst::Fraction::new(n, 1));
        assert_eq!(s.held_frames(), 450);
        // 100 ms at 30 fps: 3 frames, and one more while the batch runs.
        assert_eq!(s.held_frames_at(fps(30), None), 4);
        assert_eq!(s.held_frames_at(None, None), 450, "no rate, no bound");
        s.tunables.batch_timeout_ms = -1;
        assert_eq!(s.held_frames_at(fps(30), None), 450, "no timeout, no bound");
        // A GPU engine's two batches in flight and the one gathering.
        assert_eq!(s.held_frames_at(fps(30), Some(3)), (16 * 3 - 1) * 30);
        s.batch_size = 1;
        assert_eq!(s.held_frames_at(fps(30), None), 0);
        assert_eq!(s.held_frames_at(fps(30), Some(1)), 0);
    }

    #[test]
    fn calibration_frames_shape_only_eight_bit_engines() {
        let key = |precision, calibration_frames| {
            Settings {
                onnx_location: Some("m.onnx".into()),
                calibration_location: Some("frames/".into()),
                precision,
                calibration_frames,
                ..Default::default()
            }
            .instance_key(Default::default(), 0)
            .unwrap()
        };
        assert_ne!(key(Precision::Int8, 64), key(Precision::Int8, 256));
        assert_ne!(key(Precision::Fp8, 64), key(Precision::Fp8, 256));
        assert_eq!(key(Precision::Int8, 64), key(Precision::Int8, 64));
        assert_eq!(key(Precision::Fp16, 64), key(Precision::Fp16, 256));
    }

    #[test]
    fn a_remote_server_needs_its_url_and_model_and_no_local_file() {
        let mut s = Settings {
            backend: Backend::Kserve,
            ..Default::default()
        };
        let err = s.instance_key(Default::default(), 0).unwrap_err();
        assert!(err.contains("needs server-url"), "{err}");
        s.server.url = Some("grpc://127.0.0.1:8001".into());
        s.server.model = Some("resnet".into());
        s.server.cert = Some("client.pem".into());
        let err = s.instance_key(Default::default(), 0).unwrap_err();
        assert!(err.contains("server-key-location"), "{err}");
        s.server.key = Some("client.key".into());
        let key = s.instance_key(Default::default(), 0).unwrap();
        assert_eq!(key.options.server.model, "resnet");
        assert_eq!(key.options.server.timeout, Duration::from_secs(2));
        assert!(key.options.model.as_os_str().is_empty(), "no onnx-location");
        assert_eq!(s.model_location(), "resnet");
        // A batch being gathered while the earlier ones are on the wire.
        s.batch_size = 8;
        assert_eq!(s.held_frames(), 8 * engine::kserve::IN_FLIGHT as u32 - 1);
        s.batch_size = 1;
        assert!(s.batches(), "frames wait for the batches in flight");
        s.backend = Backend::Cpu;
        assert!(!s.batches());
        let err = s.instance_key(Default::default(), 0).unwrap_err();
        assert!(err.contains("onnx-location is not set"), "{err}");
    }
}
