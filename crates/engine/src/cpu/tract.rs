// SPDX-License-Identifier: MPL-2.0
//! The CPU backend's general path: tract, for the models the plan importer does not take
//! (operators it lacks). It runs on the calling thread, one model batch per call.

use std::panic::{AssertUnwindSafe, catch_unwind};

use tract_onnx::prelude::*;

use crate::preprocess::InputSpec;
use crate::{EngineError, OnnxModel};

pub struct TractRunner {
    plan: Arc<TypedRunnableModel>,
    input: InputSpec,
    batch: usize,
    num_classes: usize,
}

impl TractRunner {
    pub fn new(model: &OnnxModel, input: InputSpec, batch: usize) -> Result<Self, EngineError> {
        // tract is written to return errors, but a malformed graph can still trip an
        // assertion deep inside; a panic must not take the pipeline down.
        let (plan, num_classes) = catch_unwind(AssertUnwindSafe(|| optimise(model, &input, batch)))
            .unwrap_or_else(|panic| {
                Err(OptimiseError::Other(format!(
                    "internal error in tract: {}",
                    crate::panic_message(&*panic)
                )))
            })
            .map_err(|e| match e {
                OptimiseError::Unsupported(ops) => EngineError::UnsupportedOps {
                    path: model.path.clone(),
                    backend: "cpu",
                    ops,
                },
                OptimiseError::Other(reason) => EngineError::Build {
                    path: model.path.clone(),
                    reason,
                },
            })?;
        Ok(TractRunner {
            plan,
            input,
            batch,
            num_classes,
        })
    }

    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    /// The scores of the `n` frames of `input` (at most one model batch), one after the other.
    pub fn run(&self, input: &[f32], n: usize) -> Result<Vec<f32>, EngineError> {
        let spec = &self.input;
        let b = self.batch;
        let shape = spec.batch_shape(b);
        // A partial batch is padded with zeros: the plan is optimised for one batch size.
        let mut data = vec![0.0f32; b * spec.frame_len()];
        data[..input.len()].copy_from_slice(input);
        let tensor = Tensor::from_shape(&shape, &data)
            .map_err(|e| EngineError::Inference(format!("{e:#}")))?;
        let outputs = catch_unwind(AssertUnwindSafe(|| self.plan.run(tvec!(tensor.into()))))
            .unwrap_or_else(|panic| {
                Err(anyhow::anyhow!(
                    "internal error in tract: {}",
                    crate::panic_message(&*panic)
                ))
            })
            .map_err(|e| EngineError::Inference(format!("{e:#}")))?;
        let scores = outputs[0]
            .to_plain_array_view::<f32>()
            .map_err(|e| EngineError::Inference(format!("{e:#}")))?;
        let scores = scores
            .as_slice()
            .ok_or_else(|| EngineError::Inference("output is not contiguous".into()))?;
        Ok(scores[..n * self.num_classes].to_vec())
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

    let shape: TVec<usize> = input.batch_shape(batch).into_iter().collect();
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
    let num_classes = crate::class_count(dims, batch).map_err(OptimiseError::Other)?;
    let plan = typed.into_runnable().map_err(other)?;
    Ok((plan, num_classes))
}
