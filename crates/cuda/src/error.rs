// SPDX-License-Identifier: MPL-2.0
//! What can go wrong on the GPU: each variant names the call or the plan that failed, and its
//! message is the one the element reports (through `EngineError` at the engine's seam).

use cudarc::cublaslt::result::CublasError;
use cudarc::cudnn::sys as dnn;
use cudarc::driver::DriverError;

/// A failure of the CUDA runtime: of a library call, or of a plan it cannot run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A CUDA driver call failed; `what` says which.
    #[error("CUDA {what}: {source}")]
    Driver {
        /// The call, in a word or two ("context", "synchronize").
        what: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// A cuDNN call failed; `what` says which, or the convolution it describes.
    #[error("cuDNN {what}: {message}")]
    Cudnn {
        /// The call, or the convolution it was made for.
        what: String,
        /// cuDNN's status code.
        status: dnn::cudnnStatus_t,
        /// cuDNN's own words for `status`, read when the error is made.
        message: String,
    },
    /// A cuBLASLt call failed; `what` says which.
    #[error("cuBLASLt {what}: {source:?}")]
    Cublas {
        /// The call, in a word or two.
        what: &'static str,
        /// cuBLASLt's status.
        source: CublasError,
    },
    /// cuBLASLt's heuristic has no algorithm for a matrix product of this shape.
    #[error("cuBLASLt found no algorithm for {rows}x{k}x{n}: {source:?}")]
    NoGemmAlgorithm {
        /// Rows of the left matrix and of the result.
        rows: usize,
        /// The dimension summed over.
        k: usize,
        /// Columns of the right matrix and of the result.
        n: usize,
        /// cuBLASLt's status.
        source: CublasError,
    },
    /// No algorithm cuDNN offers runs a convolution within the workspace; what each try
    /// found.
    #[error("cuDNN found no algorithm for a convolution ({0})")]
    NoConvAlgorithm(String),
    /// NVRTC did not compile the kernels (the log is in the error).
    #[error("NVRTC could not compile the kernels: {0:?}")]
    Nvrtc(cudarc::nvrtc::CompileError),
    /// The `gpu-id` property names a device this machine does not have.
    #[error("gpu-id={ordinal}, but this machine has {count} CUDA device(s)")]
    NoSuchGpu {
        /// The device asked for, counted from 0.
        ordinal: u32,
        /// The CUDA devices the driver reports.
        count: i32,
    },
    /// More frames than the largest plan's batch.
    #[error("no plan runs {0} frames at once")]
    NoPlanHolding(usize),
    /// A batch size the engine was not built for.
    #[error("no plan of batch size {0}")]
    NoPlanOfBatch(usize),
    /// A frame staged past the end of the batch.
    #[error("frame {slot} of a batch; the engine runs at most {max}")]
    SlotOutOfRange {
        /// The frame's place in the batch, counted from 0.
        slot: usize,
        /// Frames in the engine's largest batch.
        max: usize,
    },
    /// A host frame longer than a slot of the model input.
    #[error("a frame larger than the model input")]
    FrameTooLarge,
    /// A batched matrix product whose count cuBLASLt cannot take.
    #[error("{0} products")]
    TooManyProducts(usize),
    /// What the plan asks of the GPU that it does not have (FP8 on a GPU before Ada).
    #[error("{0}")]
    Unsupported(String),
    /// A plan the runtime cannot run as it stands (a step not prepared, a graph missing).
    #[error("{0}")]
    Plan(&'static str),
}

/// The runtime's results.
pub(crate) type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether a graph capture was invalidated by another thread of the context.
    pub(crate) fn is_capture_invalidated(&self) -> bool {
        matches!(self, Error::Driver { source, .. }
            if source.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    }

    /// A `map_err` for driver calls: `CUDA {what}: {error}`.
    pub(crate) fn driver(what: &'static str) -> impl Fn(DriverError) -> Error {
        move |source| Error::Driver { what, source }
    }

    /// A `map_err` for cuBLASLt calls: `cuBLASLt {what}: {error:?}`.
    pub(crate) fn cublas(what: &'static str) -> impl Fn(CublasError) -> Error {
        move |source| Error::Cublas { what, source }
    }
}
