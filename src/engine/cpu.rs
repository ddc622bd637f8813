// SPDX-License-Identifier: MPL-2.0
//! The embedded CPU backend: tract, pure Rust, nothing to install.

use std::panic::{AssertUnwindSafe, catch_unwind};

use tract_onnx::prelude::*;

use super::{Backend, Dim, Engine, EngineError, EngineOptions, ModelInfo, OnnxModel, Precision};
use crate::engine::CAT;
use crate::preprocess::{Crop, InputSpec, Preprocessor};

/// A fixed batch above this is taken for a broken model rather than allocated.
const MAX_MODEL_BATCH: usize = 256;

pub struct CpuEngine {
    info: ModelInfo,
    plan: Arc<TypedRunnableModel>,
    preprocessor: Preprocessor,
    /// The frames pushed and not yet run, preprocessed; reused.
    input: Vec<f32>,
    /// Scores of the pushed frames that have run.
    ran: super::Ran,
}

impl CpuEngine {
    pub fn build(options: &EngineOptions) -> Result<Self, EngineError> {
        let model = OnnxModel::load(&options.model)?;
        Self::from_model(&model, options)
    }

    pub fn from_model(model: &OnnxModel, options: &EngineOptions) -> Result<Self, EngineError> {
        let fail = |reason: String| EngineError::Build {
            path: model.path.clone(),
            reason,
        };
        if options.precision == Precision::Fp16 {
            gst::info!(
                CAT,
                "the cpu backend runs fp32 (precision=fp16 applies to GPU backends)"
            );
        }
        let input = model.input_spec(options.input_size).map_err(fail)?;
        // tract runs one thread per call; measured on MobileNetV2 (docs/benchmarks.md), a
        // batch of 8 in one call costs twice the time per frame of 8 single-frame calls (the
        // activations leave the cache). So frames run one per call unless the model fixes a
        // larger batch.
        let model_batch = match model.input.batch {
            Dim::Fixed(n) if n > MAX_MODEL_BATCH => {
                return Err(fail(format!(
                    "the model fixes its batch at {n}; at most {MAX_MODEL_BATCH} is supported"
                )));
            }
            Dim::Fixed(n) => n,
            Dim::Dynamic(_) => 1,
        };
        if options.batch_size > model_batch {
            gst::info!(
                CAT,
                "{}: the cpu backend runs batches of {} as {model_batch} frame(s) per call",
                model.path.display(),
                options.batch_size
            );
        }

        // tract is written to return errors, but a malformed graph can still trip an
        // assertion deep inside; a panic must not take the pipeline down.
        let (plan, num_classes) =
            catch_unwind(AssertUnwindSafe(|| optimise(model, &input, model_batch)))
                .unwrap_or_else(|panic| {
                    Err(OptimiseError::Other(format!(
                        "internal error in tract: {}",
                        super::panic_message(&*panic)
                    )))
                })
                .map_err(|e| match e {
                    OptimiseError::Unsupported(ops) => EngineError::UnsupportedOps {
                        path: model.path.clone(),
                        backend: "cpu",
                        ops,
                    },
                    OptimiseError::Other(reason) => fail(reason),
                })?;

        let preprocessor = Preprocessor::new(options.preprocess.clone(), input).map_err(fail)?;
        let info = ModelInfo {
            input,
            num_classes,
            model_batch,
            outputs_probabilities: matches!(
                model.output_op.as_deref(),
                Some("Softmax" | "Sigmoid")
            ),
            backend: Backend::Cpu,
            precision: Precision::Fp32,
            reads_device_frames: false,
        };
        gst::info!(
            CAT,
            "{}: cpu engine ready: input {:?} {}x{}x{}, {} classes, {} frame(s) per call",
            model.path.display(),
            input.layout,
            input.channels,
            input.height,
            input.width,
            num_classes,
            model_batch
        );
        Ok(CpuEngine {
            info,
            plan,
            preprocessor,
            input: Vec::new(),
            ran: Default::default(),
        })
    }

    fn run_call(&self, input: &[f32], n: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let spec = &self.info.input;
        let b = self.info.model_batch;
        let shape = match spec.layout {
            crate::preprocess::Layout::Nchw => [b, spec.channels, spec.height, spec.width],
            crate::preprocess::Layout::Nhwc => [b, spec.height, spec.width, spec.channels],
        };
        // A partial batch is padded with zeros: the plan is optimised for one batch size.
        let mut data = vec![0.0f32; b * spec.frame_len()];
        data[..input.len()].copy_from_slice(input);
        let tensor = Tensor::from_shape(&shape, &data)
            .map_err(|e| EngineError::Inference(format!("{e:#}")))?;
        let outputs = catch_unwind(AssertUnwindSafe(|| self.plan.run(tvec!(tensor.into()))))
            .unwrap_or_else(|panic| {
                Err(anyhow::anyhow!(
                    "internal error in tract: {}",
                    super::panic_message(&*panic)
                ))
            })
            .map_err(|e| EngineError::Inference(format!("{e:#}")))?;
        let scores = outputs[0]
            .to_plain_array_view::<f32>()
            .map_err(|e| EngineError::Inference(format!("{e:#}")))?;
        let scores = scores
            .as_slice()
            .ok_or_else(|| EngineError::Inference("output is not contiguous".into()))?;
        Ok(scores
            .chunks(self.info.num_classes)
            .take(n)
            .map(<[f32]>::to_vec)
            .collect())
    }
}

impl Engine for CpuEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn infer(&mut self, input: &[f32], n: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let (frame_len, batch) = (self.info.input.frame_len(), self.info.model_batch);
        super::infer_in_calls(input, n, frame_len, batch, |chunk, frames| {
            self.run_call(chunk, frames)
        })
    }

    fn push(
        &mut self,
        frame: &gst_video::VideoFrameRef<&gst::BufferRef>,
        crops: &[Crop],
    ) -> Result<(), EngineError> {
        let (frame_len, batch) = (self.info.input.frame_len(), self.info.model_batch);
        let mut crops = crops;
        while !crops.is_empty() {
            // As many crops as the model batch has room for; a full batch runs at once.
            let n = self.input.len() / frame_len;
            let (now, rest) = crops.split_at(crops.len().min(batch - n));
            self.input.resize((n + now.len()) * frame_len, 0.0);
            if let Err(e) = self
                .preprocessor
                .run(frame, now, &mut self.input[n * frame_len..])
            {
                self.input.truncate(n * frame_len);
                return Err(e.into());
            }
            if n + now.len() == batch {
                self.run_input()?;
            }
            crops = rest;
        }
        Ok(())
    }

    fn run_pushed(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        let last = self.run_input();
        self.ran.take(last)
    }

    fn discard(&mut self) {
        self.input.clear();
        self.ran.clear();
    }
}

impl CpuEngine {
    /// Runs the pushed frames waiting in `input` (at most one model batch) into `ran`.
    fn run_input(&mut self) -> Result<(), EngineError> {
        let n = self.input.len() / self.info.input.frame_len();
        if n == 0 {
            return Ok(());
        }
        let scores = self.run_call(&self.input, n);
        self.input.clear();
        self.ran.keep(scores)
    }
}

enum OptimiseError {
    Unsupported(Vec<String>),
    Other(String),
}

/// Parses the graph with tract, pins the input shape, optimises, and returns the runnable
/// plan with the number of classes.
fn optimise(
    model: &OnnxModel,
    input: &InputSpec,
    batch: usize,
) -> Result<(Arc<TypedRunnableModel>, usize), OptimiseError> {
    let other = |e: anyhow::Error| OptimiseError::Other(format!("{e:#}"));
    let folder = model.folder();
    let parsed = tract_onnx::onnx()
        .parse(&model.proto, folder.to_str())
        .map_err(other)?;
    if !parsed.unresolved_inputs.is_empty() {
        return Err(OptimiseError::Other(format!(
            "the graph uses values that nothing defines: {}",
            parsed.unresolved_inputs.join(", ")
        )));
    }
    let mut graph = parsed.model;

    let unsupported: Vec<String> = graph
        .nodes()
        .iter()
        .filter_map(|n| {
            let name = n.op.name();
            name.strip_prefix("Unimplemented(")
                .and_then(|s| s.strip_suffix(')'))
                .map(str::to_owned)
        })
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if !unsupported.is_empty() {
        return Err(OptimiseError::Unsupported(unsupported));
    }

    // Keep only the first output: a classifier's scores.
    let first_output = graph.output_outlets().map_err(other)?[0];
    graph
        .select_output_outlets(&[first_output])
        .map_err(other)?;

    let shape: TVec<usize> = match input.layout {
        crate::preprocess::Layout::Nchw => tvec![batch, input.channels, input.height, input.width],
        crate::preprocess::Layout::Nhwc => tvec![batch, input.height, input.width, input.channels],
    };
    let graph = graph
        .with_input_fact(0, InferenceFact::dt_shape(f32::datum_type(), shape))
        .map_err(other)?;
    let typed = graph.into_typed().map_err(other)?;
    // The input is fixed, so every shape should be. tract keeps shapes it cannot reconcile
    // (say, an Add of widths 17 and 16) as symbolic expressions, on which its optimiser can
    // run for minutes and take gigabytes (a model found by the fuzzer).
    for node in typed.eval_order().map_err(other)? {
        let node = typed.node(node);
        if let Some(fact) = node.outputs.iter().find(|o| !o.fact.shape.is_concrete()) {
            return Err(OptimiseError::Other(format!(
                "node `{}` ({}): its output shape {:?} cannot be worked out from the input's; the model's shapes are inconsistent",
                node.name,
                node.op.name(),
                fact.fact.shape
            )));
        }
    }
    let typed = typed.into_optimized().map_err(other)?;

    let output = typed.output_fact(0).map_err(other)?;
    if output.datum_type != f32::datum_type() {
        return Err(OptimiseError::Other(format!(
            "the output holds {:?}; float32 class scores are expected",
            output.datum_type
        )));
    }
    let dims = output.shape.as_concrete().ok_or_else(|| {
        OptimiseError::Other(format!("the output shape {:?} is not fixed", output.shape))
    })?;
    let num_classes = super::class_count(dims, batch).map_err(OptimiseError::Other)?;
    let plan = typed.into_runnable().map_err(other)?;
    Ok((plan, num_classes))
}
