// SPDX-License-Identifier: MPL-2.0
//! `backend=cuda`: our own fp16 engine on NVIDIA GPUs.
//!
//! The ONNX model is imported into a small graph IR (`ir`, `import`), rewritten (`passes`:
//! batch norm folded, activations and residual adds fused), lowered to a plan of GPU steps
//! (`plan`), tuned and captured as one CUDA graph per batch size (`runtime`), and cached on
//! disk (`cache`). Everything up to the plan runs on the CPU and is checked there against
//! `reference`; the GPU part only needs the driver, NVRTC, cuBLASLt and cuDNN, which are
//! loaded when the engine is built, so the plugin loads where there is no CUDA at all.

pub mod import;
pub mod ir;
pub mod lower;
pub mod passes;
pub mod plan;
pub mod reference;
pub mod runtime;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

use std::time::Instant;

use super::{Backend, Engine, EngineError, EngineOptions, ModelInfo, OnnxModel, Precision};
use crate::preprocess::Preprocessor;
use crate::trtclassify::CAT;
use plan::{DType, Weights};

/// Why the cuda engine cannot run here, or `None` when the libraries it needs load.
pub fn unavailable_reason() -> Option<String> {
    let missing = runtime::missing_libraries();
    (!missing.is_empty()).then(|| {
        format!(
            "the CUDA engine needs {} and cannot load {}",
            "the NVIDIA driver, NVRTC, cuBLASLt and cuDNN",
            missing.join(", ")
        )
    })
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

pub struct CudaEngine {
    info: ModelInfo,
    runtime: runtime::Runtime,
    preprocessor: Preprocessor,
    input: Vec<f32>,
}

impl CudaEngine {
    /// Fails with `Unavailable` before reading the model where the CUDA libraries are missing,
    /// so that `backend=auto` costs nothing on machines without a GPU.
    pub fn build(options: &EngineOptions) -> Result<Self, EngineError> {
        if let Some(reason) = unavailable_reason() {
            return Err(EngineError::Unavailable {
                backend: "cuda",
                reason,
            });
        }
        let model = OnnxModel::load(&options.model)?;
        Self::from_model(&model, options)
    }

    pub fn from_model(model: &OnnxModel, options: &EngineOptions) -> Result<Self, EngineError> {
        let fail = |reason: String| EngineError::Build {
            path: model.path.clone(),
            reason,
        };
        let unsupported = import::unsupported_ops(model);
        if !unsupported.is_empty() {
            return Err(EngineError::UnsupportedOps {
                path: model.path.clone(),
                backend: "cuda",
                ops: unsupported,
            });
        }
        let spec = model.input_spec(options.input_size).map_err(fail)?;
        let gpu = runtime::open_gpu(options.gpu_id).map_err(|reason| EngineError::Unavailable {
            backend: "cuda",
            reason,
        })?;
        let dtype = match options.precision {
            Precision::Fp16 => DType::F16,
            Precision::Fp32 => DType::F32,
        };
        let started = Instant::now();
        let sizes = batch_sizes(options.batch_size, model.input.batch.fixed());
        let mut weights = Weights::default();
        let mut plans = Vec::new();
        for &batch in &sizes {
            let mut graph = import::import(model, batch, spec.height, spec.width).map_err(fail)?;
            passes::optimise(&mut graph);
            plans.push(lower::lower(&graph, dtype, &mut weights).map_err(fail)?);
        }
        let num_classes = plans[0].output_len / plans[0].batch;
        gst::info!(
            CAT,
            "{}: graph of {} steps for batch sizes {sizes:?} in {:.1?}",
            model.path.display(),
            plans[0].steps.len(),
            started.elapsed()
        );
        let ptx = runtime::compile(dtype, gpu.arch).map_err(fail)?;
        let mut progress = |msg: &str| {
            gst::info!(
                CAT,
                "{}: {msg} ({:.1?})",
                model.path.display(),
                started.elapsed()
            );
            options.progress.report(msg);
        };
        let runtime = runtime::Runtime::new(&gpu, &ptx, dtype, &weights, plans, &mut progress)
            .map_err(fail)?;
        gst::info!(
            CAT,
            "{}: cuda engine built in {:.1?} on {} (sm_{}{}, {}), {dtype:?}",
            model.path.display(),
            started.elapsed(),
            gpu.name,
            gpu.arch.0,
            gpu.arch.1,
            runtime::library_versions()
        );
        let preprocessor = Preprocessor::new(options.preprocess.clone(), spec).map_err(fail)?;
        let info = ModelInfo {
            input: spec,
            num_classes,
            model_batch: *sizes.last().expect("one size at least"),
            outputs_probabilities: matches!(
                model.output_op.as_deref(),
                Some("Softmax" | "Sigmoid")
            ),
            backend: Backend::Cuda,
            precision: options.precision,
        };
        Ok(CudaEngine {
            info,
            runtime,
            preprocessor,
            input: Vec::new(),
        })
    }

    /// Mean seconds per replay of the captured graph of `batch`; for benchmarks.
    pub fn time_graph(&self, batch: usize, runs: usize) -> Result<f64, String> {
        self.runtime.replay(batch, runs)
    }
}

impl Engine for CudaEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn infer(&mut self, input: &[f32], n: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let (frame_len, batch) = (self.info.input.frame_len(), self.info.model_batch);
        let classes = self.info.num_classes;
        super::infer_in_calls(input, n, frame_len, batch, |chunk, frames| {
            let out = self
                .runtime
                .run(chunk, frames)
                .map_err(EngineError::Inference)?;
            Ok(out.chunks(classes).map(<[f32]>::to_vec).collect())
        })
    }

    fn classify(
        &mut self,
        frames: &[gst_video::VideoFrameRef<&gst::BufferRef>],
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let mut input = std::mem::take(&mut self.input);
        super::preprocess_frames(&mut self.preprocessor, frames, &mut input)?;
        let scores = self.infer(&input, frames.len());
        self.input = input;
        scores
    }
}
