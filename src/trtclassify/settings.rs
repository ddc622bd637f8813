// SPDX-License-Identifier: MPL-2.0
//! The element's settings: what its properties hold, their defaults, the checks a value
//! gets, and what the settings make of the engine it joins (`InstanceKey`), of
//! post-processing and of batching. No GObject in here: `imp.rs` declares the properties
//! (their ranges and blurbs, with the defaults from here) and stores their values here.

use std::time::Duration;

use gst::prelude::*;

use crate::engine::{self, Backend, EngineOptions, Precision};
use crate::instance::InstanceKey;
use crate::outputs::postprocess::Softmax;
use crate::preprocess::{ChannelOrder, PreprocessOptions, ResizeMode};
use crate::regions::{RegionFilter, RoiMode};

// The defaults of the properties, which `imp.rs` declares with them.
pub(crate) const DEFAULT_BACKEND: Backend = Backend::Auto;
pub(crate) const DEFAULT_PRECISION: Precision = Precision::Fp16;
pub(crate) const DEFAULT_GPU_ID: u32 = 0;
pub(crate) const DEFAULT_BATCH_SIZE: u32 = 1;
/// The largest `batch-size`.
pub(crate) const MAX_BATCH_SIZE: u32 = 64;
pub(crate) const DEFAULT_BATCH_TIMEOUT_MS: i32 = 100;
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

/// The values of the element's properties, each field the property of the same name (`_ms`
/// and `roi_filter` aside); copied out of its lock before any work.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) onnx_location: Option<String>,
    pub(crate) labels_location: Option<String>,
    pub(crate) results_location: Option<String>,
    pub(crate) engine_location: Option<String>,
    pub(crate) model_instance_id: Option<String>,
    pub(crate) backend: Backend,
    pub(crate) precision: Precision,
    pub(crate) gpu_id: u32,
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
    /// A property value that was refused; `start()` fails with it, so that a typo in a
    /// launch line never runs silently with the old value.
    refused: Option<String>,
}

/// What may change while playing; copied out for every buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tunables {
    pub(crate) batch_timeout_ms: i32,
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
                top_k: DEFAULT_TOP_K,
                threshold: DEFAULT_THRESHOLD,
                interval: DEFAULT_INTERVAL,
            },
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
        match parse_channel_values(name, value) {
            Ok(values) if name == "mean" => self.mean = values,
            Ok(values) => self.std = values,
            Err(problem) => {
                self.refused = Some(problem.clone());
                return Err(problem);
            }
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

    /// What the properties make of the engine the element joins: its options, checked, and
    /// the instance they share.
    pub(crate) fn instance_key(
        &self,
        progress: engine::Progress,
    ) -> Result<InstanceKey, gst::ErrorMessage> {
        if let Some(problem) = &self.refused {
            return Err(gst::error_msg!(
                gst::LibraryError::Settings,
                ["Invalid property value: {}", problem]
            ));
        }
        let Some(location) = self.onnx_location.clone() else {
            return Err(gst::error_msg!(
                gst::LibraryError::Settings,
                ["onnx-location is not set: give the path of an ONNX image classifier"]
            ));
        };
        let input_size = match (self.input_height, self.input_width) {
            (0, 0) => None,
            (0, _) | (_, 0) => {
                return Err(gst::error_msg!(
                    gst::LibraryError::Settings,
                    ["set both input-width and input-height, or neither"]
                ));
            }
            (h, w) => Some((h as usize, w as usize)),
        };
        Ok(InstanceKey {
            id: self.model_instance_id.clone().unwrap_or_default(),
            backend: self.backend,
            options: EngineOptions {
                model: location.into(),
                batch_size: self.batch_size as usize,
                input_size,
                precision: self.precision,
                gpu_id: self.gpu_id,
                threads: self.threads as usize,
                engine_location: self.engine_location.clone().map(Into::into),
                progress,
                preprocess: self.preprocess_options(),
            },
        })
    }

    /// `scale`, `mean`, `std`, `channel-order` and `resize-mode`, as the engine takes them.
    fn preprocess_options(&self) -> PreprocessOptions {
        PreprocessOptions {
            scale: self.scale as f32,
            mean: self.mean.iter().map(|v| *v as f32).collect(),
            std: self.std.iter().map(|v| *v as f32).collect(),
            channel_order: self.channel_order,
            resize: self.resize_mode,
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
        self.batch_size > 1
    }

    /// How many frames the element may hold beyond the one being pushed: `batch-size − 1`
    /// fresh frames, and the carried frames (`interval`) between them.
    pub(crate) fn held_frames(&self) -> u32 {
        (self.batch_size - 1) * self.tunables.interval
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
