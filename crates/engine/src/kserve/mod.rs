// SPDX-License-Identifier: MPL-2.0
//! `backend=kserve`: inference on a remote server that speaks the KServe v2 / Open Inference
//! Protocol over gRPC (NVIDIA Triton, KServe, Seldon MLServer, OpenVINO Model Server).
//!
//! Frames are preprocessed here, as for a local engine, and sent in requests of
//! `model_batch` images; up to `IN_FLIGHT` requests are on the wire at once, so that the
//! network's round trip overlaps the gathering of the next batch and the server never idles
//! for it. Scores come back in push order. A request the server does not answer within
//! `server-timeout` (retries included) leaves its items without scores (empty score vectors):
//! their frames pass on unclassified, in order, and the engine stays; after such a failure,
//! requests are not sent for a pause that doubles while the server stays away (`Outage`),
//! so that frames do not each wait `server-timeout` for a server that is down.

mod client;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use prost::bytes::Bytes;

use super::{Backend, Engine, EngineError, EngineOptions, ModelInfo, OnnxModel, Precision};
use crate::preprocess::{Crop, InputSpec, Layout, Preprocessor};
pub use client::ServerOptions;
use client::{Client, Pending};

#[allow(clippy::all, clippy::pedantic)]
mod proto {
    tonic::include_proto!("inference");
}

use proto::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use proto::model_metadata_response::TensorMetadata;
use proto::{ModelInferRequest, ModelInferResponse, ModelMetadataResponse};

/// Requests on the wire at once: the answers to the first come back while the last gathers
/// (`ModelInfo::batches_in_flight`); a push that would send one more first waits for the
/// oldest.
pub const IN_FLIGHT: usize = 4;

/// The first pause after a request failed; doubled while the server stays away.
const FIRST_OUTAGE_PAUSE: Duration = Duration::from_millis(500);
/// The longest pause between two tries of a server that is away.
const LONGEST_OUTAGE_PAUSE: Duration = Duration::from_secs(2);

/// The tensor types an image goes as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DataType {
    Fp32,
    Fp16,
}

impl DataType {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "FP32" => Some(Self::Fp32),
            "FP16" => Some(Self::Fp16),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "FP32",
            Self::Fp16 => "FP16",
        }
    }

    fn size(self) -> usize {
        match self {
            Self::Fp32 => 4,
            Self::Fp16 => 2,
        }
    }
}

/// What the server's metadata says of the model, checked for an image classifier.
#[derive(Debug, Clone, PartialEq)]
struct RemoteModel {
    input_name: String,
    input_type: DataType,
    input: InputSpec,
    /// The batch the model fixes; `None`: any.
    fixed_batch: Option<usize>,
    output_name: String,
    output_type: DataType,
    num_classes: usize,
}

/// Reads the server's metadata as an image classifier: one image input (FP32 or FP16,
/// NCHW or NHWC, 1 or 3 channels), one output of class scores. `input_size`: the height and
/// width for a model that leaves them open.
fn remote_model(
    metadata: &ModelMetadataResponse,
    input_size: Option<(usize, usize)>,
) -> Result<RemoteModel, String> {
    let [input] = metadata.inputs.as_slice() else {
        return Err(format!(
            "the server's model has {} inputs ({}); an image classifier has one",
            metadata.inputs.len(),
            names(&metadata.inputs)
        ));
    };
    let [output] = metadata.outputs.as_slice() else {
        return Err(format!(
            "the server's model has {} outputs ({}); an image classifier has one",
            metadata.outputs.len(),
            names(&metadata.outputs)
        ));
    };
    let input_type = DataType::parse(&input.datatype).ok_or_else(|| {
        format!(
            "the server's input `{}` takes {}; images go as FP32 or FP16",
            input.name, input.datatype
        )
    })?;
    let output_type = DataType::parse(&output.datatype).ok_or_else(|| {
        format!(
            "the server's output `{}` is {}; scores are read as FP32 or FP16",
            output.name, output.datatype
        )
    })?;
    let shape = &input.shape;
    let [batch, a, b, c] = shape[..] else {
        return Err(format!(
            "the server's input `{}` has the shape {shape:?}; an image batch has 4 axes",
            input.name
        ));
    };
    let channels = |n: i64| n == 1 || n == 3;
    let (layout, channel_count, h, w) = if channels(a) && !channels(c) {
        (Layout::Nchw, a, b, c)
    } else if channels(c) && !channels(a) {
        (Layout::Nhwc, c, a, b)
    } else if channels(a) {
        (Layout::Nchw, a, b, c)
    } else {
        return Err(format!(
            "the server's input `{}` has the shape {shape:?}: no axis of 1 or 3 colour channels",
            input.name
        ));
    };
    let side = |name: &str, n: i64, forced: Option<usize>| match (usize::try_from(n), forced) {
        (Ok(n), None) => Ok(n),
        (Ok(n), Some(m)) if n == m => Ok(n),
        (Ok(n), Some(m)) => Err(format!(
            "input-{name} is {m} but the server's input `{}` fixes its {name} at {n}",
            input.name
        )),
        (Err(_), Some(m)) => Ok(m),
        (Err(_), None) => Err(format!(
            "the {name} of the server's input `{}` is variable; set input-width and input-height",
            input.name
        )),
    };
    let spec = InputSpec {
        layout,
        channels: channel_count as usize,
        height: side("height", h, input_size.map(|s| s.0))?,
        width: side("width", w, input_size.map(|s| s.1))?,
    };
    let num_classes = match output.shape.split_first() {
        Some((_, rest)) if !rest.is_empty() && rest.iter().all(|&d| d > 0) => {
            let big = rest.iter().filter(|&&d| d != 1).count();
            if big > 1 {
                return Err(format!(
                    "the server's output `{}` has the shape {:?}: not one vector of class scores per image",
                    output.name, output.shape
                ));
            }
            rest.iter().product::<i64>() as usize
        }
        _ => {
            return Err(format!(
                "the server's output `{}` has the shape {:?}: the number of classes must be fixed",
                output.name, output.shape
            ));
        }
    };
    Ok(RemoteModel {
        input_name: input.name.clone(),
        input_type,
        input: spec,
        fixed_batch: usize::try_from(batch).ok().filter(|&n| n > 0),
        output_name: output.name.clone(),
        output_type,
        num_classes,
    })
}

fn names(tensors: &[TensorMetadata]) -> String {
    let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    if names.is_empty() {
        "none declared".into()
    } else {
        names.join(", ")
    }
}

/// Checks that the server runs the model of the local ONNX file: the same input and output
/// names, image layout and size.
fn compare(remote: &RemoteModel, local: &OnnxModel, local_input: InputSpec) -> Result<(), String> {
    let path = local.path.display();
    if remote.input_name != local.input.name {
        return Err(format!(
            "the server's model takes the input `{}`, {path} takes `{}`: not the same model",
            remote.input_name, local.input.name
        ));
    }
    if remote.output_name != local.output {
        return Err(format!(
            "the server's model has the output `{}`, {path} has `{}`: not the same model",
            remote.output_name, local.output
        ));
    }
    if remote.input != local_input {
        return Err(format!(
            "the server's input is {:?} {}x{}x{}, {path}'s is {:?} {}x{}x{}: not the same model",
            remote.input.layout,
            remote.input.channels,
            remote.input.height,
            remote.input.width,
            local_input.layout,
            local_input.channels,
            local_input.height,
            local_input.width
        ));
    }
    Ok(())
}

/// A request on the wire, in push order: its items, when it was sent, and its answer when it
/// comes (`None`: not sent, the server being away; its items get no scores).
struct InFlight {
    items: usize,
    sent: Instant,
    answer: Option<Pending<Result<ModelInferResponse, String>>>,
}

/// A server that did not answer: when it is tried again, and the pause before that.
#[derive(Debug, Clone, Copy)]
struct Outage {
    retry_at: Instant,
    pause: Duration,
}

impl Outage {
    /// The outage after a request sent at `sent` failed at `at`, `self` being the one known
    /// before (if any). Only a request sent to try the server again (at or past `retry_at`)
    /// doubles the pause; those on the wire when the server went away fail in their turn
    /// and leave it as it is. The pause counts from the failure, not from when the element
    /// collects it, which may be much later (a stream that paused): collected late, it must
    /// not keep the server away for a pause that has already passed.
    fn after_failure(known: Option<&Outage>, sent: Instant, at: Instant) -> Outage {
        let pause = match known {
            None => FIRST_OUTAGE_PAUSE,
            Some(o) if sent < o.retry_at => return *o,
            Some(o) => (o.pause * 2).min(LONGEST_OUTAGE_PAUSE),
        };
        Outage {
            retry_at: at + pause,
            pause,
        }
    }
}

/// The engine of `backend=kserve` (see the module's documentation).
pub struct KserveEngine {
    info: ModelInfo,
    client: Client,
    remote: RemoteModel,
    preprocessor: Preprocessor,
    /// Items gathered for the next request, preprocessed.
    input: Vec<f32>,
    in_flight: VecDeque<InFlight>,
    /// Scores of the items whose requests came back (empty: no answer), in push order.
    ran: Vec<Vec<f32>>,
    outage: Option<Outage>,
}

impl KserveEngine {
    /// Connects to the server, checks that it is live and the model ready, and reads the
    /// model's metadata; compares it with the ONNX file at `options.model` where one is set.
    pub fn build(options: &EngineOptions) -> Result<Self, EngineError> {
        let server = &options.server;
        // Messages name the ONNX file, or the server's model (their text names the server).
        let fail = |reason: String| EngineError::Build {
            path: if options.model.as_os_str().is_empty() {
                server.model.clone().into()
            } else {
                options.model.clone()
            },
            reason,
        };
        if server.url.is_empty() || server.model.is_empty() {
            return Err(EngineError::Unavailable {
                backend: "kserve",
                reason: "set server-url (grpc://host:port) and server-model".into(),
            });
        }
        let local = if options.model.as_os_str().is_empty() {
            None
        } else {
            Some(OnnxModel::load(&options.model)?)
        };
        let client = Client::new(server).map_err(fail)?;
        let metadata = client.check().map_err(fail)?;
        let remote = remote_model(&metadata, options.input_size).map_err(fail)?;
        if let Some(local) = &local {
            let local_input = local.input_spec(options.input_size).map_err(fail)?;
            compare(&remote, local, local_input).map_err(fail)?;
        }
        let model_batch = remote.fixed_batch.unwrap_or(options.batch_size.max(1));
        if model_batch != options.batch_size.max(1) {
            log::warn!(target: crate::LOG_TARGET, "kserve: {} fixes its batch at {model_batch}; batch-size is {}: requests go as batches of {model_batch}{}",
                server.model,
                options.batch_size,
                if model_batch > options.batch_size {
                    ", padded"
                } else {
                    ""
                }
            );
        }
        let preprocessor =
            Preprocessor::new(options.preprocess.clone(), remote.input).map_err(fail)?;
        let info = ModelInfo {
            input: remote.input,
            num_classes: remote.num_classes,
            model_batch,
            outputs_probabilities: local.as_ref().is_some_and(OnnxModel::outputs_probabilities),
            backend: Backend::Kserve,
            precision: match remote.input_type {
                DataType::Fp32 => Precision::Fp32,
                DataType::Fp16 => Precision::Fp16,
            },
            precision_note: None,
            quant_report: None,
            reads_device_frames: false,
            batches_in_flight: IN_FLIGHT,
            non_finite: Default::default(),
            engine_file: None,
        };
        log::info!(target: crate::LOG_TARGET, "kserve: {}{} on {}: input `{}` {} {:?} {}x{}x{}, {} classes, {model_batch} image(s) a request",
            server.model,
            if server.version.is_empty() {
                String::new()
            } else {
                format!(" version {}", server.version)
            },
            server.url,
            remote.input_name,
            remote.input_type.name(),
            remote.input.layout,
            remote.input.channels,
            remote.input.height,
            remote.input.width,
            remote.num_classes
        );
        let mut engine = Self {
            info,
            client,
            remote,
            preprocessor,
            input: Vec::new(),
            in_flight: VecDeque::new(),
            ran: Vec::new(),
            outage: None,
        };
        engine.try_request(model_batch).map_err(fail)?;
        Ok(engine)
    }

    /// Sends one request of `n` blank images and reads its answer: a server that refuses the
    /// element's requests (a batch above its maximum, a datatype it does not take) fails the
    /// start, rather than every frame later.
    fn try_request(&mut self, n: usize) -> Result<(), String> {
        self.input = vec![0.0; n * self.info.input.frame_len()];
        let request = self.request(n);
        self.input.clear();
        self.client
            .infer(request)
            .wait()
            .unwrap_or_else(|| Err("the gRPC client stopped".into()))
            .and_then(|response| self.scores(&response, n))
            .map(drop)
            .map_err(|e| {
                format!(
                    "server-model {}: a request of {n} image(s) failed: {e}",
                    self.client.options.model
                )
            })
    }

    /// The request for the `n` images in `input`, padded to the model's fixed batch.
    fn request(&self, n: usize) -> ModelInferRequest {
        let batch = self.remote.fixed_batch.unwrap_or(n);
        let frame_len = self.info.input.frame_len();
        let mut raw = Vec::with_capacity(batch * frame_len * self.remote.input_type.size());
        match self.remote.input_type {
            DataType::Fp32 => self.input.iter().for_each(|v| raw.extend(v.to_le_bytes())),
            DataType::Fp16 => self
                .input
                .iter()
                .for_each(|v| raw.extend(half::f16::from_f32(*v).to_le_bytes())),
        }
        raw.resize(batch * frame_len * self.remote.input_type.size(), 0);
        let shape = self.info.input.batch_shape(batch);
        ModelInferRequest {
            model_name: self.client.options.model.clone(),
            model_version: self.client.options.version.clone(),
            inputs: vec![InferInputTensor {
                name: self.remote.input_name.clone(),
                datatype: self.remote.input_type.name().into(),
                shape: shape.iter().map(|&d| d as i64).collect(),
                ..Default::default()
            }],
            outputs: vec![InferRequestedOutputTensor {
                name: self.remote.output_name.clone(),
                ..Default::default()
            }],
            raw_input_contents: vec![Bytes::from(raw)],
            ..Default::default()
        }
    }

    /// Sends the items gathered in `input` as one request, after waiting for the oldest
    /// request on the wire if `IN_FLIGHT` are; while the server is away, they are not sent,
    /// and get no scores in their turn.
    fn send(&mut self) {
        let n = self.input.len() / self.info.input.frame_len();
        if n == 0 {
            return;
        }
        if self.in_flight.len() >= IN_FLIGHT {
            self.receive_oldest();
        }
        let away = self
            .outage
            .as_ref()
            .is_some_and(|o| Instant::now() < o.retry_at);
        let answer = (!away).then(|| {
            let request = self.request(n);
            self.client.infer(request)
        });
        self.input.clear();
        self.in_flight.push_back(InFlight {
            items: n,
            sent: Instant::now(),
            answer,
        });
    }

    /// Waits for the oldest request on the wire and keeps its scores (or, where it failed,
    /// empty ones).
    fn receive_oldest(&mut self) {
        let Some(request) = self.in_flight.pop_front() else {
            return;
        };
        let Some(answer) = request.answer else {
            self.ran
                .extend(std::iter::repeat_n(Vec::new(), request.items));
            return;
        };
        let (answer, at) = answer
            .wait_timed()
            .unwrap_or_else(|| (Err("the request was given up".into()), Instant::now()));
        match answer.and_then(|response| self.scores(&response, request.items)) {
            Ok(scores) => {
                if self.outage.take().is_some() {
                    log::info!(target: crate::LOG_TARGET, "kserve: {} answers again", self.client.options.url);
                }
                self.ran.extend(scores);
            }
            Err(e) => {
                self.failed(&e, request.sent, at);
                self.ran
                    .extend(std::iter::repeat_n(Vec::new(), request.items));
            }
        }
    }

    /// A request sent at `sent` failed at `at` with `problem`: the server is left alone for
    /// a while (see `Outage::after_failure`).
    fn failed(&mut self, problem: &str, sent: Instant, at: Instant) {
        let outage = Outage::after_failure(self.outage.as_ref(), sent, at);
        let again = outage.retry_at.saturating_duration_since(Instant::now());
        log::warn!(target: crate::LOG_TARGET, "kserve: {} model {}: {problem}; frames pass on unclassified, the server is tried again in {again:.1?}",
            self.client.options.url,
            self.client.options.model
        );
        self.outage = Some(outage);
    }

    /// The `items` score vectors of `response`.
    fn scores(&self, response: &ModelInferResponse, items: usize) -> Result<Vec<Vec<f32>>, String> {
        let index = response
            .outputs
            .iter()
            .position(|o| o.name == self.remote.output_name)
            .ok_or_else(|| {
                format!(
                    "the answer has no output `{}` (it has {})",
                    self.remote.output_name,
                    response
                        .outputs
                        .iter()
                        .map(|o| o.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
        let output = &response.outputs[index];
        let classes = self.info.num_classes;
        let values: Vec<f32> = match response.raw_output_contents.get(index) {
            Some(raw) if response.raw_output_contents.len() == response.outputs.len() => {
                match DataType::parse(&output.datatype) {
                    Some(DataType::Fp32) => raw
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                    Some(DataType::Fp16) => raw
                        .chunks_exact(2)
                        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                    None => {
                        return Err(format!(
                            "the output `{}` came as {}, not FP32 or FP16",
                            output.name, output.datatype
                        ));
                    }
                }
            }
            _ => output
                .contents
                .as_ref()
                .map(|c| c.fp32_contents.clone())
                .unwrap_or_default(),
        };
        let sent = self.remote.fixed_batch.unwrap_or(items);
        if values.len() != sent * classes {
            return Err(format!(
                "the answer holds {} scores for {sent} image(s) of {classes} classes",
                values.len()
            ));
        }
        Ok(values[..items * classes]
            .chunks(classes)
            .map(<[f32]>::to_vec)
            .collect())
    }
}

impl Engine for KserveEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn infer(&mut self, input: &[f32], n: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let frame_len = self.info.input.frame_len();
        let batch = self.info.model_batch;
        super::infer_in_calls(input, n, frame_len, batch, |chunk, frames| {
            self.input.extend_from_slice(chunk);
            self.send();
            let scores = self.run_pushed()?;
            match scores.len() == frames && scores.iter().all(|s| !s.is_empty()) {
                true => Ok(scores),
                false => Err(EngineError::Inference(format!(
                    "{} did not answer",
                    self.client.options.url
                ))),
            }
        })
    }

    fn push(&mut self, frame: &crate::frame::FrameView, crops: &[Crop]) -> Result<(), EngineError> {
        let (frame_len, batch) = (self.info.input.frame_len(), self.info.model_batch);
        let mut crops = crops;
        let mut gathered = self.input.len() / frame_len;
        let before = gathered;
        let mut sent = false;
        while !crops.is_empty() {
            let (now, rest) = crops.split_at(crops.len().min(batch - gathered));
            self.input.resize((gathered + now.len()) * frame_len, 0.0);
            if let Err(e) =
                self.preprocessor
                    .run(frame, now, &mut self.input[gathered * frame_len..])
            {
                // The items pushed before this frame stay (pending() tells a refused push),
                // unless this frame's first crops went out with them in a request.
                self.input
                    .truncate(if sent { 0 } else { before * frame_len });
                return Err(e.into());
            }
            gathered += now.len();
            if gathered == batch {
                self.send();
                (gathered, sent) = (0, true);
            }
            crops = rest;
        }
        Ok(())
    }

    fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        self.send();
        while !self.in_flight.is_empty() {
            self.receive_oldest();
        }
        Ok(std::mem::take(&mut self.ran))
    }

    fn discard(&mut self) {
        self.input.clear();
        for request in self.in_flight.drain(..) {
            if let Some(answer) = request.answer {
                answer.cancel();
            }
        }
        self.ran.clear();
    }

    fn pending(&self) -> usize {
        self.ran.len()
            + self.in_flight.iter().map(|r| r.items).sum::<usize>()
            + self.input.len() / self.info.input.frame_len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, datatype: &str, shape: &[i64]) -> TensorMetadata {
        TensorMetadata {
            name: name.into(),
            datatype: datatype.into(),
            shape: shape.to_vec(),
        }
    }

    fn metadata(input: TensorMetadata, output: TensorMetadata) -> ModelMetadataResponse {
        ModelMetadataResponse {
            name: "m".into(),
            inputs: vec![input],
            outputs: vec![output],
            ..Default::default()
        }
    }

    #[test]
    fn an_outage_counts_from_the_failure_and_only_failed_retries_lengthen_it() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // The first failure: the first pause, from when it failed.
        let first = Outage::after_failure(None, t0, t0 + ms(100));
        assert_eq!(
            (first.retry_at, first.pause),
            (t0 + ms(100) + FIRST_OUTAGE_PAUSE, FIRST_OUTAGE_PAUSE)
        );
        // Requests on the wire before the server went away fail in their turn, however
        // late: the outage stays as it was.
        let late = Outage::after_failure(Some(&first), t0 + ms(50), t0 + ms(900));
        assert_eq!((late.retry_at, late.pause), (first.retry_at, first.pause));
        // A retry that fails doubles the pause, counted from its failure, not from when
        // it is read.
        let retry = Outage::after_failure(Some(&first), first.retry_at, first.retry_at + ms(10));
        assert_eq!(retry.pause, FIRST_OUTAGE_PAUSE * 2);
        assert_eq!(
            retry.retry_at,
            first.retry_at + ms(10) + FIRST_OUTAGE_PAUSE * 2
        );
        // Up to the longest pause.
        let mut outage = retry;
        for _ in 0..8 {
            outage = Outage::after_failure(Some(&outage), outage.retry_at, outage.retry_at);
        }
        assert_eq!(outage.pause, LONGEST_OUTAGE_PAUSE);
    }

    #[test]
    fn the_servers_metadata_is_read_as_an_image_classifier() {
        let m = metadata(
            tensor("input", "FP32", &[-1, 3, 224, 224]),
            tensor("logits", "FP32", &[-1, 1000]),
        );
        let r = remote_model(&m, None).unwrap();
        assert_eq!(
            (
                r.input.layout,
                r.input.channels,
                r.input.height,
                r.input.width
            ),
            (Layout::Nchw, 3, 224, 224)
        );
        assert_eq!((r.num_classes, r.fixed_batch), (1000, None));
        let m = metadata(
            tensor("x", "FP16", &[8, 224, 160, 3]),
            tensor("y", "FP32", &[8, 10, 1, 1]),
        );
        let r = remote_model(&m, None).unwrap();
        assert_eq!(r.input.layout, Layout::Nhwc);
        assert_eq!((r.input.height, r.input.width), (224, 160));
        assert_eq!(
            (r.input_type, r.num_classes, r.fixed_batch),
            (DataType::Fp16, 10, Some(8))
        );
    }

    #[test]
    fn metadata_that_is_no_image_classifier_is_refused_with_the_reason() {
        let cases = [
            (
                metadata(
                    tensor("i", "INT64", &[-1, 3, 8, 8]),
                    tensor("o", "FP32", &[-1, 2]),
                ),
                "takes INT64",
            ),
            (
                metadata(tensor("i", "FP32", &[-1, 6]), tensor("o", "FP32", &[-1, 2])),
                "4 axes",
            ),
            (
                metadata(
                    tensor("i", "FP32", &[-1, 3, -1, -1]),
                    tensor("o", "FP32", &[-1, 2]),
                ),
                "set input-width and input-height",
            ),
            (
                metadata(
                    tensor("i", "FP32", &[-1, 3, 8, 8]),
                    tensor("o", "FP32", &[-1, -1]),
                ),
                "must be fixed",
            ),
            (
                metadata(
                    tensor("i", "FP32", &[-1, 3, 8, 8]),
                    tensor("o", "FP32", &[-1, 4, 5]),
                ),
                "not one vector",
            ),
            (ModelMetadataResponse::default(), "0 inputs (none declared)"),
        ];
        for (m, expected) in cases {
            let e = remote_model(&m, None).unwrap_err();
            assert!(e.contains(expected), "{e}");
        }
        let m = metadata(
            tensor("i", "FP32", &[-1, 3, -1, -1]),
            tensor("o", "FP32", &[-1, 2]),
        );
        assert_eq!(remote_model(&m, Some((32, 48))).unwrap().input.width, 48);
    }
}
