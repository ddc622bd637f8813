// SPDX-License-Identifier: MPL-2.0
//! The model compiler that both backends run: an ONNX model to one plan per batch size.
//!
//! The ONNX model is imported into a small graph IR (`ir`, `import`; shape arithmetic is
//! evaluated at import by `fold`, constant subgraphs by `reference`), rewritten (`passes`:
//! batch norm folded, activations and residual adds fused), and lowered (`lower`) to a
//! `plan`: NHWC steps over one arena, with the weights they read. `check` validates a plan
//! before anything runs it with raw pointers (the GPU runtime, the engine file loader and
//! the CPU plan runner all do). Everything here runs on the CPU and is tested there
//! against `reference` (the graph evaluated node by node) and `sim` (the plan run step by
//! step).

pub mod check;
mod fold;
pub mod import;
pub mod ir;
pub mod lower;
pub mod passes;
pub mod plan;
pub mod reference;

#[cfg(test)]
pub(crate) mod sim;
#[cfg(test)]
mod tests;

use crate::engine::OnnxModel;
use plan::{DType, Plan, Weights};

/// The batch sizes an engine serves for the element's `batch_size`: powers of two below it
/// and itself, so that a partial batch runs on the smallest plan that holds it.
pub fn batch_sizes(batch_size: usize, fixed: Option<usize>) -> Vec<usize> {
    if let Some(n) = fixed {
        return vec![n];
    }
    let mut sizes: Vec<usize> = std::iter::successors(Some(1), |b| Some(b * 2))
        .take_while(|&b| b < batch_size)
        .collect();
    sizes.push(batch_size.max(1));
    sizes
}

/// The plans of `model` for each of `batch_sizes` and the weights they share: the part of
/// the build that runs on the CPU (import, passes, lowering).
pub fn compile(
    model: &OnnxModel,
    batch_sizes: &[usize],
    spec: crate::preprocess::InputSpec,
    dtype: DType,
) -> Result<(Vec<Plan>, Weights), String> {
    let mut weights = Weights::default();
    let mut plans = Vec::new();
    let initializers = import::initializers(model)?;
    for &batch in batch_sizes {
        let mut graph = import::import_with(model, &initializers, batch, spec.height, spec.width)?;
        crate::engine::class_count(graph.shape(&graph.output), batch)?;
        passes::optimise(&mut graph);
        plans.push(lower::lower(&graph, dtype, &mut weights)?);
    }
    Ok((plans, weights))
}
