// SPDX-License-Identifier: MPL-2.0
#![warn(missing_docs)]
//! The model compiler that both backends run: an ONNX model to one plan per batch size.
//!
//! The ONNX model is imported into a small graph IR (`ir`, by `import`; shape arithmetic is
//! evaluated at import by `fold`, constant subgraphs by `reference`), rewritten (`passes`:
//! batch norm folded, activations and residual adds fused), and lowered (`lower`) to a
//! `plan`: NHWC steps over one arena, with the weights they read. `check`
//! validates a plan before anything runs it with raw pointers (the GPU runtime, the engine
//! file loader and the CPU plan runner all do). Everything here runs on the CPU and is
//! tested there against `reference` (the graph evaluated node by node) and `sim` (the plan
//! run step by step). What fails is a `CompileError`, naming the node or the plan's step.
//!
//! Each family of operators is one module of `ops/`: the ONNX operators it takes, their
//! import (with the output shape each gives), their evaluation for `reference` and their
//! lowering to plan steps. Adding an ONNX operator: its name in the `OPS` of the family it
//! belongs to (with its required inputs) and its import there; where it needs a new
//! `ir::Op`, its evaluation and lowering in the same module, each called from one arm of
//! `reference::eval` and `Lowering::node`. A new kind of plan step is a module of `plan/` (a
//! type implementing `plan::StepKind` and `sim::Simulate`, a `Step` variant and its line in
//! `with_step!`), and a kernel in each runtime (`trtclassify-cpu`'s `kernels/`;
//! `trtclassify-cuda`'s `runtime/steps/<family>.cu` and its `GpuStep` in
//! `runtime/steps/<family>.rs`). Then `TRTCLASSIFY_BLESS=1 cargo test -p trtclassify-compiler
//! --lib the_documented_operator_table`. The full checklist is in docs/architecture.md.

pub mod check;
mod column_split;
pub mod external_data;
mod fold;
pub mod frame;
pub mod import;
pub mod ir;
mod lower;
pub mod onnx;
mod ops;
pub mod overflow;
mod passes;
pub mod plan;
pub mod quant;
mod ranks;
mod reference;
pub mod spec;

#[cfg(any(test, feature = "testing"))]
pub mod sim;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;

pub use onnx::{Dim, ModelError, ModelFacts, OnnxModel, class_count};

/// The `log` target of the engines' lines (builds, engine files, fallbacks), from every
/// crate of the engine. The plugin shows them in its `trtclassify-engine` debug category
/// (`GST_DEBUG=trtclassify-engine:4`); a program without GStreamer sees them through its own
/// `log` logger.
pub const LOG_TARGET: &str = "trtclassify-engine";
use plan::{DType, Plan, Weights};

/// Why a model does not compile, or a plan does not pass its checks.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CompileError {
    /// The model as a whole: no graph, an output that does not depend on the image or is
    /// not class scores.
    #[error("{0}")]
    Model(String),
    /// An initializer that cannot be read (its data type, its size, its external data); the
    /// message names the tensor.
    #[error("{0}")]
    Weights(String),
    /// One node of the model, which the import or the lowering does not take.
    #[error("node `{node}` ({op}): {problem}")]
    Node {
        /// The node's name (made unique in the graph).
        node: String,
        /// Its ONNX operator, or the IR operator it became for the lowering.
        op: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A plan whose buffers do not hold the frames and scores it is said to.
    #[error("the plan for batch {batch}: {problem}")]
    Plan {
        /// The plan's batch size.
        batch: usize,
        /// What is wrong with it.
        problem: String,
    },
    /// A step of a plan that its kernel cannot take or that reaches outside its buffers.
    #[error("the plan for batch {batch}: step {step} ({kind}): {problem}")]
    Step {
        /// The plan's batch size.
        batch: usize,
        /// The step's index in the plan.
        step: usize,
        /// The step described (`Step::describe`).
        kind: String,
        /// What is wrong with it.
        problem: String,
    },
}

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
    spec: spec::InputSpec,
    dtype: DType,
) -> Result<(Vec<Plan>, Weights), CompileError> {
    compile_mixed(model, batch_sizes, spec, dtype, &[])
}

/// `compile`, with the nodes named in `kept` (by `Plan::origins`: values past fp16's range)
/// and the nodes that read their values computed in f32 in an fp16 plan, the rest in fp16.
/// The plans say which steps run in f32 (`Step::is_wide`).
pub fn compile_mixed(
    model: &OnnxModel,
    batch_sizes: &[usize],
    spec: spec::InputSpec,
    dtype: DType,
    kept: &[String],
) -> Result<(Vec<Plan>, Weights), CompileError> {
    compile_with(model, batch_sizes, spec, dtype, kept, false)
}

/// `compile` in f32 for the CPU runner, whose kernels may write a product's output over
/// the residual it adds (`lower::lower`).
pub fn compile_for_cpu(
    model: &OnnxModel,
    batch_sizes: &[usize],
    spec: spec::InputSpec,
) -> Result<(Vec<Plan>, Weights), CompileError> {
    compile_with(model, batch_sizes, spec, DType::F32, &[], true)
}

fn compile_with(
    model: &OnnxModel,
    batch_sizes: &[usize],
    spec: spec::InputSpec,
    dtype: DType,
    kept: &[String],
    in_place: bool,
) -> Result<(Vec<Plan>, Weights), CompileError> {
    let mut weights = Weights::default();
    let mut plans = Vec::new();
    let initializers = import::initializers(model)?;
    // Frames given channels-last for a channels-first model (the CPU engine's preprocessing
    // writes them so) are read where they lie instead of copied into that layout.
    let frames = match (model.input.layout, spec.layout) {
        (spec::Layout::Nchw, spec::Layout::Nhwc) => lower::Frames::ChannelsLast,
        _ => lower::Frames::AsModel,
    };
    for &batch in batch_sizes {
        let mut graph = import::import_with(model, &initializers, batch, spec.height, spec.width)?;
        class_count(graph.shape(&graph.output), batch).map_err(CompileError::Model)?;
        passes::optimise(&mut graph);
        // fp32 plans have nothing to keep apart.
        let kept = match dtype {
            DType::F16 => passes::kept_in_f32(&graph, kept),
            DType::F32 => Default::default(),
        };
        // The fused attention kernel runs on fp16's tensor cores; fp32 plans (and the CPU
        // runner) keep the products and the softmax.
        if dtype == DType::F16 {
            passes::fuse_attention(&mut graph, &kept);
        }
        plans.push(lower::lower_frames(
            &graph,
            dtype,
            &kept,
            &mut weights,
            in_place,
            frames,
        )?);
    }
    Ok((plans, weights))
}

/// The text a panic was raised with.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
