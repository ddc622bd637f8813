// SPDX-License-Identifier: MPL-2.0
//! Runs plans on the GPU: weights uploaded once, one activation arena shared by the plans of
//! every batch size (one runs at a time, on one stream), cuDNN convolutions with the
//! algorithm timed fastest, cuBLASLt matrix products with the bias in the epilogue, NVRTC
//! kernels for the rest, and each plan captured as a CUDA graph so a batch is one launch.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::{result as ltr, sys as lt};
use cudarc::cudnn::sys as dnn;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    LaunchConfig, PinnedHostSlice, PushKernelArg, sys as drv,
};

use super::frames::{Pre, RawFrame};
use crate::engine::compiler::ir::{Act, BinOp};
use crate::engine::compiler::plan::{
    Cast, ConvStep, DType, Loc, MAX_RANK, MAX_WORKSPACE, Plan, Step, Tuned,
};

/// The kernels' source, compiled by NVRTC for the GPU at hand.
pub const KERNELS: &str = include_str!("kernels.cu");

/// The longest row that the one-warp-per-row kernels (`softmax_warp`, `layernorm_warp`) hold
/// in registers: `WARP_ROW_MAX` in kernels.cu. Longer rows take a block each.
pub(super) const WARP_ROW_MAX: usize = 1024;

/// The shared libraries the engine loads, by the names cudarc looks for.
pub fn missing_libraries() -> Vec<&'static str> {
    // SAFETY: each call only tries to dlopen the library and closes it again.
    let present = unsafe {
        [
            (
                "libcuda (the NVIDIA driver)",
                cudarc::driver::sys::is_culib_present(),
            ),
            ("libnvrtc", cudarc::nvrtc::sys::is_culib_present()),
            ("libcublasLt", cudarc::cublaslt::sys::is_culib_present()),
            ("libcudnn", cudarc::cudnn::sys::is_culib_present()),
        ]
    };
    present
        .into_iter()
        .filter(|(_, ok)| !ok)
        .map(|(name, _)| name)
        .collect()
}

/// Compiles the kernels for `dtype` and the compute capability `arch` (major, minor).
pub fn compile(dtype: DType, arch: (i32, i32)) -> Result<String, String> {
    let mut options = vec![format!("--gpu-architecture=compute_{}{}", arch.0, arch.1)];
    if dtype == DType::F16 {
        options.push("-DHALF".into());
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options,
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts)
        .map(|ptx| ptx.to_src())
        .map_err(|e| format!("NVRTC could not compile the kernels: {e:?}"))
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct EwParams {
    n: i64,
    rank: i32,
    op: i32,
    act: i32,
    p0: f32,
    p1: f32,
    dims: [i32; MAX_RANK],
    so: [i64; MAX_RANK],
    sa: [i64; MAX_RANK],
    sb: [i64; MAX_RANK],
}
// SAFETY: plain old data laid out as the kernels' `struct Ew`.
unsafe impl DeviceRepr for EwParams {}
// The layout of the C struct in kernels.cu, which asserts the same size: a field changed on
// one side only stops a build.
const _: () = assert!(
    size_of::<EwParams>() == 200
        && std::mem::offset_of!(EwParams, p1) == 24
        && std::mem::offset_of!(EwParams, so) == 56
        && std::mem::offset_of!(EwParams, sb) == 152
);

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PoolParams {
    v: [i32; 16],
}
// SAFETY: sixteen ints, as the kernels' `struct Pool`.
unsafe impl DeviceRepr for PoolParams {}
const _: () = assert!(size_of::<PoolParams>() == 64);

/// The kernel id of a binary operator (`binop` in kernels.cu), spelled out so that the
/// order of `BinOp` in ir.rs may change.
fn binop_id(op: BinOp) -> i32 {
    match op {
        BinOp::Add => 0,
        BinOp::Sub => 1,
        BinOp::Mul => 2,
        BinOp::Div => 3,
        BinOp::Pow => 4,
        BinOp::Max => 5,
        BinOp::Min => 6,
    }
}

/// The kernel id and parameters of an activation (`act` in kernels.cu).
pub(super) fn act_params(act: Act, dtype: DType) -> (i32, f32, f32) {
    match act {
        Act::None => (0, 0.0, 0.0),
        Act::Relu => (1, 0.0, 0.0),
        Act::LeakyRelu(a) => (2, a, 0.0),
        // A positive floor keeps a divisor from 0 (`x / max(‖x‖, 1e-12)`, Swin v2's cosine
        // attention): below fp16's smallest value it would round to 0 and give 0/0, so it
        // stays the smallest positive fp16 instead.
        Act::Clip(lo, hi) if dtype == DType::F16 && lo > 0.0 && lo < F16_SMALLEST => {
            (3, F16_SMALLEST, hi)
        }
        Act::Clip(lo, hi) => (3, lo, hi),
        Act::Sigmoid => (4, 0.0, 0.0),
        Act::HardSigmoid(a, b) => (5, a, b),
        Act::HardSwish => (6, 0.0, 0.0),
        Act::Silu => (7, 0.0, 0.0),
        Act::Tanh => (8, 0.0, 0.0),
        Act::Erf => (9, 0.0, 0.0),
        Act::Gelu => (10, 0.0, 0.0),
        Act::Exp => (11, 0.0, 0.0),
        Act::Sqrt => (12, 0.0, 0.0),
        Act::Neg => (13, 0.0, 0.0),
        Act::Abs => (14, 0.0, 0.0),
        Act::Reciprocal => (15, 0.0, 0.0),
        Act::Softplus => (16, 0.0, 0.0),
        Act::Elu(a) => (17, a, 0.0),
    }
}

/// 2⁻²⁴, the smallest positive (subnormal) fp16 value.
const F16_SMALLEST: f32 = 5.960_464_5e-8;

fn dnn_check(status: dnn::cudnnStatus_t, what: &str) -> Result<(), String> {
    if status == dnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: cuDNN returns a static string.
    let msg = unsafe { std::ffi::CStr::from_ptr(dnn::cudnnGetErrorString(status)) };
    Err(format!("cuDNN {what}: {}", msg.to_string_lossy()))
}

fn lt_check(status: Result<(), ltr::CublasError>, what: &str) -> Result<(), String> {
    status.map_err(|e| format!("cuBLASLt {what}: {e:?}"))
}

fn drv_err(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> String {
    move |e| format!("CUDA {what}: {e}")
}

struct Kernels {
    ew: CudaFunction,
    ew_from_f32: CudaFunction,
    ew_to_f32: CudaFunction,
    ew_vec: CudaFunction,
    bias_act: CudaFunction,
    bias_act_vec: CudaFunction,
    pool: CudaFunction,
    pool_vec: CudaFunction,
    global_avg: CudaFunction,
    softmax: CudaFunction,
    softmax_warp: CudaFunction,
    layernorm: CudaFunction,
    layernorm_warp: CudaFunction,
    mean: CudaFunction,
    lrn: CudaFunction,
    preprocess_rows: CudaFunction,
    preprocess_cols: CudaFunction,
}

/// cuDNN descriptors of one convolution.
struct ConvDescs {
    x: dnn::cudnnTensorDescriptor_t,
    y: dnn::cudnnTensorDescriptor_t,
    bias: dnn::cudnnTensorDescriptor_t,
    w: dnn::cudnnFilterDescriptor_t,
    conv: dnn::cudnnConvolutionDescriptor_t,
    act: dnn::cudnnActivationDescriptor_t,
}

impl Drop for ConvDescs {
    fn drop(&mut self) {
        // SAFETY: created by `ConvDescs::new` and used by nothing else.
        unsafe {
            dnn::cudnnDestroyTensorDescriptor(self.x);
            dnn::cudnnDestroyTensorDescriptor(self.y);
            dnn::cudnnDestroyTensorDescriptor(self.bias);
            dnn::cudnnDestroyFilterDescriptor(self.w);
            dnn::cudnnDestroyConvolutionDescriptor(self.conv);
            dnn::cudnnDestroyActivationDescriptor(self.act);
        }
    }
}

impl ConvDescs {
    fn new(c: &ConvStep, dtype: DType) -> Result<Self, String> {
        let ty = match dtype {
            DType::F16 => dnn::cudnnDataType_t::CUDNN_DATA_HALF,
            DType::F32 => dnn::cudnnDataType_t::CUDNN_DATA_FLOAT,
        };
        let nhwc = dnn::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC;
        let i = |v: usize| v as i32;
        let mut d = ConvDescs {
            x: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            bias: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
            act: std::ptr::null_mut(),
        };
        // SAFETY: descriptors are created before use and destroyed by Drop.
        unsafe {
            dnn_check(dnn::cudnnCreateTensorDescriptor(&mut d.x), "descriptor")?;
            dnn_check(dnn::cudnnCreateTensorDescriptor(&mut d.y), "descriptor")?;
            dnn_check(dnn::cudnnCreateTensorDescriptor(&mut d.bias), "descriptor")?;
            dnn_check(dnn::cudnnCreateFilterDescriptor(&mut d.w), "descriptor")?;
            dnn_check(
                dnn::cudnnCreateConvolutionDescriptor(&mut d.conv),
                "descriptor",
            )?;
            dnn_check(
                dnn::cudnnCreateActivationDescriptor(&mut d.act),
                "descriptor",
            )?;
            let shape = format!(
                "convolution {}x{}x{}x{} -> {} channels, kernel {:?}, group {}",
                c.n, c.c, c.h, c.w, c.k, c.kernel, c.group
            );
            dnn_check(
                dnn::cudnnSetTensor4dDescriptor(d.x, nhwc, ty, i(c.n), i(c.c), i(c.h), i(c.w)),
                &shape,
            )?;
            dnn_check(
                dnn::cudnnSetTensor4dDescriptor(d.y, nhwc, ty, i(c.n), i(c.k), i(c.oh), i(c.ow)),
                &shape,
            )?;
            dnn_check(
                dnn::cudnnSetTensor4dDescriptor(d.bias, nhwc, ty, 1, i(c.k), 1, 1),
                &shape,
            )?;
            dnn_check(
                dnn::cudnnSetFilter4dDescriptor(
                    d.w,
                    ty,
                    nhwc,
                    i(c.k),
                    i(c.c / c.group),
                    i(c.kernel[0]),
                    i(c.kernel[1]),
                ),
                &shape,
            )?;
            dnn_check(
                dnn::cudnnSetConvolution2dDescriptor(
                    d.conv,
                    i(c.pads[0]),
                    i(c.pads[1]),
                    i(c.strides[0]),
                    i(c.strides[1]),
                    i(c.dilations[0]),
                    i(c.dilations[1]),
                    dnn::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                    dnn::cudnnDataType_t::CUDNN_DATA_FLOAT,
                ),
                &shape,
            )?;
            dnn_check(
                dnn::cudnnSetConvolutionGroupCount(d.conv, i(c.group)),
                &shape,
            )?;
            let math = match dtype {
                DType::F16 => dnn::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
                // fp32 means fp32: no TF32 tensor cores.
                DType::F32 => dnn::cudnnMathType_t::CUDNN_FMA_MATH,
            };
            dnn_check(dnn::cudnnSetConvolutionMathType(d.conv, math), &shape)?;
            dnn_check(
                dnn::cudnnSetActivationDescriptor(
                    d.act,
                    if c.act == Act::Relu {
                        dnn::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU
                    } else {
                        dnn::cudnnActivationMode_t::CUDNN_ACTIVATION_IDENTITY
                    },
                    dnn::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
                    0.0,
                ),
                &shape,
            )?;
        }
        Ok(d)
    }
}

fn algo_from(v: i32) -> dnn::cudnnConvolutionFwdAlgo_t {
    use dnn::cudnnConvolutionFwdAlgo_t::*;
    match v {
        0 => CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        1 => CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        2 => CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        3 => CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        4 => CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        5 => CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        6 => CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        _ => CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    }
}

fn math_from(v: i32) -> dnn::cudnnMathType_t {
    use dnn::cudnnMathType_t::*;
    match v {
        0 => CUDNN_DEFAULT_MATH,
        1 => CUDNN_TENSOR_OP_MATH,
        2 => CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        _ => CUDNN_FMA_MATH,
    }
}

/// cuBLASLt descriptors and the chosen algorithm of one matrix product.
struct GemmDescs {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    c: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
}

impl Drop for GemmDescs {
    fn drop(&mut self) {
        // SAFETY: created by `Runtime::gemm_descs` and used by nothing else.
        unsafe {
            let _ = ltr::destroy_matmul_desc(self.desc);
            let _ = ltr::destroy_matrix_layout(self.a);
            let _ = ltr::destroy_matrix_layout(self.b);
            let _ = ltr::destroy_matrix_layout(self.c);
        }
    }
}

enum Prepared {
    Conv(Box<ConvDescs>),
    Gemm(Box<GemmDescs>),
    None,
}

struct BatchPlan {
    plan: Plan,
    prepared: Vec<Prepared>,
    graph: Option<CudaGraph>,
}

pub struct Runtime {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    dtype: DType,
    kernels: Kernels,
    cudnn: dnn::cudnnHandle_t,
    cublaslt: lt::cublasLtHandle_t,
    arena: CudaSlice<u8>,
    weights: Vec<CudaSlice<u8>>,
    input: CudaSlice<f32>,
    output: CudaSlice<f32>,
    workspace: CudaSlice<u8>,
    lt_workspace: CudaSlice<u8>,
    plans: Vec<BatchPlan>,
    sm_count: u32,
    /// Page-locked staging buffers, so that copies run at full speed and asynchronously.
    host_in: PinnedHostSlice<f32>,
    host_out: PinnedHostSlice<f32>,
    /// Raw frames: staged in page-locked memory, uploaded, preprocessed on the GPU; sized
    /// for a full batch of the largest frames seen.
    raw_host: Option<PinnedHostSlice<u8>>,
    raw: Option<CudaSlice<u8>>,
    /// Kernels read staged frames from page-locked host memory where they are, with no
    /// upload into `raw`: on integrated GPUs (Jetson), whose memory is the host's, the upload
    /// would only copy within the same memory. `TRTCLASSIFY_ZERO_COPY=1` forces it on a
    /// discrete GPU too, where the kernels then read over PCIe (for tests).
    zero_copy: bool,
    /// Bytes of `raw_host` holding frames whose copies may still be in flight.
    raw_used: usize,
    /// Frames in GPU memory of another CUDA context, copied here slot by slot before the
    /// preprocessing kernel reads them; and the bytes each slot holds.
    peer: Option<(CudaSlice<u8>, usize)>,
    /// The preprocessing's first pass, the frame's rows at the model's width; one frame at a
    /// time (the passes run in stream order), sized for the largest frame seen.
    pre_rows: Option<CudaSlice<f32>>,
}

// SAFETY: the cuDNN and cuBLASLt handles may be used from any thread, one at a time; the
// engine is only used through `&mut self`, and every call binds the context first.
unsafe impl Send for Runtime {}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Graphs and descriptors go before the handles they were made with.
        self.plans.clear();
        // SAFETY: the handles were created in `Runtime::new` and nothing uses them now.
        unsafe {
            dnn::cudnnDestroy(self.cudnn);
            let _ = ltr::destroy_handle(self.cublaslt);
        }
    }
}

/// A GPU that answers: its context, name and compute capability.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub name: String,
    pub arch: (i32, i32),
}

pub fn open_gpu(ordinal: u32) -> Result<Gpu, String> {
    let count = CudaContext::device_count().map_err(drv_err("device count"))?;
    if ordinal as i32 >= count {
        return Err(format!(
            "gpu-id={ordinal}, but this machine has {count} CUDA device(s)"
        ));
    }
    let ctx = CudaContext::new(ordinal as usize).map_err(drv_err("context"))?;
    let name = ctx.name().map_err(drv_err("device name"))?;
    let arch = ctx
        .compute_capability()
        .map_err(drv_err("compute capability"))?;
    Ok(Gpu { ctx, name, arch })
}

/// The versions that an engine file must match.
#[derive(Debug, Clone, Copy)]
pub struct Versions {
    pub driver: i32,
    pub cudnn: usize,
    pub cublaslt: usize,
}

impl std::fmt::Display for Versions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CUDA driver {}, cuDNN {}, cuBLASLt {}",
            self.driver, self.cudnn, self.cublaslt
        )
    }
}

pub fn library_versions() -> Versions {
    let mut driver = 0;
    // SAFETY: writes one int.
    unsafe { drv::cuDriverGetVersion(&mut driver) };
    Versions {
        driver,
        cudnn: cudarc::cudnn::result::get_version(),
        // SAFETY: no arguments.
        cublaslt: unsafe { lt::cublasLtGetVersion() },
    }
}

impl Runtime {
    /// Uploads the weights, loads the kernels and prepares every plan; plans without tuned
    /// algorithms are tuned now. `progress` hears about each plan tuned.
    pub fn new(
        gpu: &Gpu,
        ptx: &str,
        dtype: DType,
        weights: &[Vec<u8>],
        plans: Vec<Plan>,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Self, String> {
        let ctx = gpu.ctx.clone();
        // One stream, one user: cudarc's cross-stream event tracking is not needed, and
        // its events would end up in the captured graphs.
        // SAFETY: no other stream touches these buffers.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv_err("stream"))?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(drv_err("module load"))?;
        let f = |name: &str| module.load_function(name).map_err(drv_err("kernel"));
        let kernels = Kernels {
            ew: f("ew")?,
            ew_from_f32: f("ew_from_f32")?,
            ew_to_f32: f("ew_to_f32")?,
            ew_vec: f("ew_vec")?,
            bias_act: f("bias_act")?,
            bias_act_vec: f("bias_act_vec")?,
            pool: f("pool_nhwc")?,
            pool_vec: f("pool_nhwc_vec")?,
            global_avg: f("global_avg_nhwc")?,
            softmax: f("softmax_rows")?,
            softmax_warp: f("softmax_warp")?,
            layernorm: f("layernorm_rows")?,
            layernorm_warp: f("layernorm_warp")?,
            mean: f("mean_rows")?,
            lrn: f("lrn_nhwc")?,
            preprocess_rows: f("preprocess_rows")?,
            preprocess_cols: f("preprocess_cols")?,
        };
        let sm_count = ctx
            .attribute(drv::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv_err("attribute"))? as u32;
        let integrated = ctx
            .attribute(drv::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)
            .map_err(drv_err("attribute"))?
            != 0;
        let zero_copy =
            integrated || std::env::var_os("TRTCLASSIFY_ZERO_COPY").is_some_and(|v| v == "1");
        if zero_copy {
            gst::info!(
                crate::engine::CAT,
                "{}: the preprocessing reads frames from page-locked host memory, with no upload",
                if integrated {
                    "an integrated GPU"
                } else {
                    "TRTCLASSIFY_ZERO_COPY=1"
                }
            );
        }

        let weights = weights
            .iter()
            .map(|w| stream.clone_htod(w).map_err(drv_err("weight upload")))
            .collect::<Result<Vec<_>, _>>()?;
        let max = |f: fn(&Plan) -> usize| plans.iter().map(f).max().unwrap_or(1).max(1);
        let arena = stream
            .alloc_zeros::<u8>(max(|p| p.arena_len) * dtype.size())
            .map_err(drv_err("arena allocation"))?;
        let input = stream
            .alloc_zeros::<f32>(max(|p| p.input_len))
            .map_err(drv_err("input allocation"))?;
        let output = stream
            .alloc_zeros::<f32>(max(|p| p.output_len))
            .map_err(drv_err("output allocation"))?;
        let lt_workspace = stream
            .alloc_zeros::<u8>(32 << 20)
            .map_err(drv_err("workspace allocation"))?;
        let mut cudnn = std::ptr::null_mut();
        // SAFETY: the handle is created once here and destroyed in Drop (or below on error).
        unsafe {
            dnn_check(dnn::cudnnCreate(&mut cudnn), "handle")?;
            let attached = dnn_check(
                dnn::cudnnSetStream(cudnn, stream.cu_stream() as dnn::cudaStream_t),
                "stream",
            );
            if let Err(e) = attached {
                dnn::cudnnDestroy(cudnn);
                return Err(e);
            }
        }
        let cublaslt = match ltr::create_handle() {
            Ok(h) => h,
            Err(e) => {
                // SAFETY: created just above.
                unsafe { dnn::cudnnDestroy(cudnn) };
                return Err(format!("cuBLASLt handle: {e:?}"));
            }
        };
        let ctx_for_pinned = ctx.clone();
        let mut rt = Runtime {
            ctx,
            stream: stream.clone(),
            dtype,
            kernels,
            cudnn,
            cublaslt,
            arena,
            weights,
            input,
            output,
            workspace: stream.alloc_zeros::<u8>(1).map_err(drv_err("allocation"))?,
            lt_workspace,
            plans: Vec::new(),
            sm_count,
            // SAFETY: both are written before they are read (`run`). The input is only written
            // by the host, so write-combined memory suits it; the output is read by the host.
            host_in: unsafe { ctx_for_pinned.alloc_pinned::<f32>(max(|p| p.input_len)) }
                .map_err(drv_err("pinned allocation"))?,
            host_out: unsafe {
                ctx_for_pinned.alloc_pinned_with_flags::<f32>(max(|p| p.output_len), 0)
            }
            .map_err(drv_err("pinned allocation"))?,
            raw_host: None,
            raw: None,
            zero_copy,
            raw_used: 0,
            peer: None,
            pre_rows: None,
        };
        let tune = plans.iter().any(|p| {
            p.steps
                .iter()
                .any(|s| matches!(s, Step::Conv(c) if c.algo.is_none()))
        });
        if tune {
            rt.workspace = stream
                .alloc_zeros::<u8>(MAX_WORKSPACE)
                .map_err(drv_err("tuning workspace allocation"))?;
        }
        for plan in plans {
            let batch = plan.batch;
            let prepared = rt.prepare(plan)?;
            rt.plans.push(prepared);
            if tune {
                progress(&format!("tuned batch size {batch}"));
            }
        }
        // Keep only the workspace the chosen algorithms need.
        let needed = rt
            .plans
            .iter()
            .flat_map(|p| &p.plan.steps)
            .filter_map(|s| match s {
                Step::Conv(c) => c.algo.map(|a| a.workspace),
                _ => None,
            })
            .max()
            .unwrap_or(0)
            .max(1);
        if needed != rt.workspace.len() {
            rt.workspace = stream
                .alloc_zeros::<u8>(needed)
                .map_err(drv_err("workspace allocation"))?;
        }
        for i in 0..rt.plans.len() {
            rt.capture(i)?;
        }
        Ok(rt)
    }

    fn ptr(&self, loc: Loc) -> u64 {
        let base = |s: &CudaSlice<u8>| s.device_ptr(&self.stream).0;
        let size = self.dtype.size() as u64;
        match loc {
            Loc::Arena(o) => base(&self.arena) + o as u64 * size,
            Loc::Weight { index, offset } => base(&self.weights[index]) + offset as u64 * size,
            Loc::Input(o) => self.input.device_ptr(&self.stream).0 + o as u64 * 4,
            Loc::Output(o) => self.output.device_ptr(&self.stream).0 + o as u64 * 4,
            Loc::Temp { .. } => unreachable!("plans hold placed buffers only"),
        }
    }

    fn prepare(&mut self, mut plan: Plan) -> Result<BatchPlan, String> {
        let mut prepared = Vec::with_capacity(plan.steps.len());
        for step in &mut plan.steps {
            prepared.push(match step {
                Step::Conv(c) => {
                    let descs = ConvDescs::new(c, self.dtype)?;
                    if c.algo.is_none() {
                        c.algo = Some(self.tune(c, &descs)?);
                    }
                    Prepared::Conv(Box::new(descs))
                }
                Step::Gemm {
                    batch,
                    rows,
                    n,
                    k,
                    bias,
                    relu,
                    ..
                } => Prepared::Gemm(Box::new(
                    self.gemm_descs(*batch, *rows, *n, *k, *bias, *relu)?,
                )),
                _ => Prepared::None,
            });
        }
        Ok(BatchPlan {
            plan,
            prepared,
            graph: None,
        })
    }

    /// Times cuDNN's algorithms for `c` on its real shapes and keeps the fastest that fits
    /// the workspace; then checks whether the fused call takes it.
    fn tune(&mut self, c: &ConvStep, d: &ConvDescs) -> Result<Tuned, String> {
        let mut perf: [dnn::cudnnConvolutionFwdAlgoPerf_t; 8] =
            // SAFETY: a plain C struct for cuDNN to fill.
            unsafe { std::mem::zeroed() };
        let mut returned = 0;
        let ws = self.ptr_u8(&self.workspace);
        // SAFETY: the pointers are live device buffers of the sizes the descriptors state.
        unsafe {
            dnn_check(
                dnn::cudnnFindConvolutionForwardAlgorithmEx(
                    self.cudnn,
                    d.x,
                    self.ptr(c.x) as *const c_void,
                    d.w,
                    self.ptr(c.weight) as *const c_void,
                    d.conv,
                    d.y,
                    self.ptr(c.y) as *mut c_void,
                    perf.len() as i32,
                    &mut returned,
                    perf.as_mut_ptr(),
                    ws as *mut c_void,
                    self.workspace.len(),
                ),
                "algorithm search",
            )?;
        }
        // cuDNN ranks the algorithms by its own timing of the plain convolution; what runs is
        // that convolution followed by our bias + activation kernel, or cuDNN's fused call,
        // whose speed can differ a lot. So the leading candidates are timed as they will run.
        let candidates = perf[..returned as usize]
            .iter()
            .filter(|p| {
                p.status == dnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS
                    && p.memory <= self.workspace.len()
            })
            .take(3)
            .flat_map(|p| {
                [false, true].map(|fused| Tuned {
                    algo: p.algo as i32,
                    math: p.mathType as i32,
                    workspace: p.memory,
                    fused,
                })
            })
            // The fused call applies ReLU or nothing; other activations need our kernel.
            .filter(|t| !t.fused || matches!(c.act, Act::Relu | Act::None));
        let mut best: Option<(f32, Tuned)> = None;
        for tuned in candidates {
            // The fused call refuses some algorithms and activations: those are skipped.
            let Ok(ms) = self.time_conv(c, d, &tuned) else {
                continue;
            };
            if best.is_none_or(|(fastest, _)| ms < fastest) {
                best = Some((ms, tuned));
            }
        }
        best.map(|(_, tuned)| tuned)
            .ok_or_else(|| "cuDNN found no algorithm for a convolution".into())
    }

    /// GPU milliseconds of five runs of the convolution `c` as `tuned` says, after one to
    /// warm up.
    fn time_conv(&self, c: &ConvStep, d: &ConvDescs, tuned: &Tuned) -> Result<f32, String> {
        let timing = Some(drv::CUevent_flags::CU_EVENT_DEFAULT);
        let ran = self.conv(c, d, tuned);
        self.stream.synchronize().map_err(drv_err("synchronize"))?;
        ran?;
        let start = self.stream.record_event(timing).map_err(drv_err("event"))?;
        for _ in 0..5 {
            self.conv(c, d, tuned)?;
        }
        let end = self.stream.record_event(timing).map_err(drv_err("event"))?;
        start.elapsed_ms(&end).map_err(drv_err("event"))
    }

    fn ptr_u8(&self, s: &CudaSlice<u8>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    fn gemm_descs(
        &self,
        batch: usize,
        rows: usize,
        n: usize,
        k: usize,
        bias: Option<Loc>,
        relu: bool,
    ) -> Result<GemmDescs, String> {
        let ty = match self.dtype {
            DType::F16 => lt::cudaDataType_t::CUDA_R_16F,
            DType::F32 => lt::cudaDataType_t::CUDA_R_32F,
        };
        // Row-major y[rows, n] = x[rows, k] · w[k, n] is, column-major, yᵀ = wᵀ · xᵀ:
        // A = w as n×k (ld n), B = x as k×rows (ld k), C = y as n×rows (ld n); the bias runs
        // along C's rows, one value per output.
        let desc = ltr::create_matmul_desc(
            lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt::cudaDataType_t::CUDA_R_32F,
        );
        let desc = desc.map_err(|e| format!("cuBLASLt descriptor: {e:?}"))?;
        let layout = |r: usize, c: usize, ld: usize| {
            ltr::create_matrix_layout(ty, r as u64, c as u64, ld as i64)
                .map_err(|e| format!("cuBLASLt layout: {e:?}"))
        };
        let mut g = GemmDescs {
            desc,
            a: layout(n, k, n)?,
            b: layout(k, rows, k)?,
            c: layout(n, rows, n)?,
            // SAFETY: a plain C struct, filled by the heuristic below.
            algo: unsafe { std::mem::zeroed() },
        };
        if batch > 1 {
            // One product per consecutive matrix of each operand.
            let count = i32::try_from(batch).map_err(|_| format!("{batch} products"))?;
            for (layout, stride) in [(g.a, n * k), (g.b, k * rows), (g.c, n * rows)] {
                let stride = stride as i64;
                // SAFETY: attributes of the types cuBLASLt documents for them.
                unsafe {
                    lt_check(
                        ltr::set_matrix_layout_attribute(
                            layout,
                            lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                            &count as *const i32 as *const c_void,
                            std::mem::size_of::<i32>(),
                        ),
                        "batch count",
                    )?;
                    lt_check(
                        ltr::set_matrix_layout_attribute(
                            layout,
                            lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                            &stride as *const i64 as *const c_void,
                            std::mem::size_of::<i64>(),
                        ),
                        "batch stride",
                    )?;
                }
            }
        }
        let epilogue = match (bias.is_some(), relu) {
            (true, true) => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS,
            (true, false) => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            (false, true) => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU,
            (false, false) => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
        };
        // SAFETY: attributes of the types cuBLASLt documents for them.
        unsafe {
            lt_check(
                ltr::set_matmul_desc_attribute(
                    g.desc,
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    &epilogue as *const _ as *const c_void,
                    std::mem::size_of_val(&epilogue),
                ),
                "epilogue",
            )?;
            if let Some(bias) = bias {
                let ptr = self.ptr(bias);
                lt_check(
                    ltr::set_matmul_desc_attribute(
                        g.desc,
                        lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                        &ptr as *const u64 as *const c_void,
                        std::mem::size_of::<u64>(),
                    ),
                    "bias",
                )?;
            }
            let pref = ltr::create_matmul_pref().map_err(|e| format!("cuBLASLt: {e:?}"))?;
            let size = self.lt_workspace.len();
            let found = lt_check(
                ltr::set_matmul_pref_attribute(
                    pref,
                    lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &size as *const usize as *const c_void,
                    std::mem::size_of::<usize>(),
                ),
                "preference",
            )
            .and_then(|()| {
                ltr::get_matmul_algo_heuristic(
                    self.cublaslt,
                    g.desc,
                    g.a,
                    g.b,
                    g.c,
                    g.c,
                    pref,
                )
                .map_err(|e| format!("cuBLASLt found no algorithm for {rows}x{k}x{n}: {e:?}"))
            });
            let _ = ltr::destroy_matmul_pref(pref);
            g.algo = found?.algo;
        }
        Ok(g)
    }

    fn launch_cfg(&self, n: usize) -> LaunchConfig {
        grid(self.sm_count, n)
    }

    /// One warp per row, 8 rows a block (the `*_warp` kernels).
    fn warp_rows_cfg(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn rows_cfg(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn conv(&self, c: &ConvStep, d: &ConvDescs, tuned: &Tuned) -> Result<(), String> {
        let (one, zero) = (1.0f32, 0.0f32);
        let ws = self.ptr_u8(&self.workspace) as *mut c_void;
        let (x, w, y) = (
            self.ptr(c.x) as *const c_void,
            self.ptr(c.weight) as *const c_void,
            self.ptr(c.y) as *mut c_void,
        );
        let algo = algo_from(tuned.algo);
        // SAFETY: live device buffers of the sizes the descriptors state.
        unsafe {
            dnn_check(
                dnn::cudnnSetConvolutionMathType(d.conv, math_from(tuned.math)),
                "math type",
            )?;
            if tuned.fused {
                let (z, alpha2) = match c.residual {
                    Some(z) => (self.ptr(z) as *const c_void, 1.0f32),
                    None => (y as *const c_void, 0.0f32),
                };
                return dnn_check(
                    dnn::cudnnConvolutionBiasActivationForward(
                        self.cudnn,
                        &one as *const f32 as *const c_void,
                        d.x,
                        x,
                        d.w,
                        w,
                        d.conv,
                        algo,
                        ws,
                        tuned.workspace,
                        &alpha2 as *const f32 as *const c_void,
                        d.y,
                        z,
                        d.bias,
                        self.ptr(c.bias) as *const c_void,
                        d.act,
                        d.y,
                        y,
                    ),
                    "fused convolution",
                );
            }
            dnn_check(
                dnn::cudnnConvolutionForward(
                    self.cudnn,
                    &one as *const f32 as *const c_void,
                    d.x,
                    x,
                    d.w,
                    w,
                    d.conv,
                    algo,
                    ws,
                    tuned.workspace,
                    &zero as *const f32 as *const c_void,
                    d.y,
                    y,
                ),
                "convolution",
            )?;
        }
        let n = c.n * c.k * c.oh * c.ow;
        let (id, p0, p1) = act_params(c.act, self.dtype);
        let z = c.residual.map_or(0u64, |z| self.ptr(z));
        let (y, bias) = (self.ptr(c.y), self.ptr(c.bias));
        let (len, channels) = (n as i64, c.k as i32);
        let vec = 16 / self.dtype.size();
        let (func, threads) =
            match c.k.is_multiple_of(vec) && [y, bias, z].iter().all(|p| p.is_multiple_of(16)) {
                true => (&self.kernels.bias_act_vec, n / vec),
                false => (&self.kernels.bias_act, n),
            };
        let mut b = self.stream.launch_builder(func);
        b.arg(&y).arg(&bias).arg(&z).arg(&len).arg(&channels);
        b.arg(&id).arg(&p0).arg(&p1);
        // SAFETY: argument types match the kernel's signature.
        unsafe { b.launch(self.launch_cfg(threads)) }
            .map(drop)
            .map_err(drv_err("kernel launch"))
    }

    /// Enqueues every step of plan `i` on the stream.
    fn enqueue(&self, i: usize) -> Result<(), String> {
        let bp = &self.plans[i];
        for (step, prepared) in bp.plan.steps.iter().zip(&bp.prepared) {
            self.step(step, prepared)?;
        }
        Ok(())
    }

    fn step(&self, step: &Step, prepared: &Prepared) -> Result<(), String> {
        let launch = |mut b: cudarc::driver::LaunchArgs, cfg: LaunchConfig| {
            // SAFETY: argument types match the kernel's signature (kernels.cu).
            unsafe { b.launch(cfg) }
                .map(drop)
                .map_err(drv_err("kernel launch"))
        };
        match (step, prepared) {
            (
                Step::Ew {
                    op,
                    act,
                    cast,
                    dims,
                    out,
                    a,
                    b,
                },
                _,
            ) => {
                let (id, p0, p1) = act_params(*act, self.dtype);
                let mut p = EwParams {
                    n: dims.iter().product::<usize>() as i64,
                    rank: dims.len() as i32,
                    op: op.map_or(-1, binop_id),
                    act: id,
                    p0,
                    p1,
                    ..Default::default()
                };
                for (j, &d) in dims.iter().enumerate() {
                    p.dims[j] = d as i32;
                    p.so[j] = out.strides[j];
                    p.sa[j] = a.strides[j];
                    p.sb[j] = b.as_ref().map_or(0, |b| b.strides[j]);
                }
                let (o, x, y) = (
                    self.ptr(out.loc),
                    self.ptr(a.loc),
                    b.as_ref().map_or(0, |b| self.ptr(b.loc)),
                );
                let vec = 16 / self.dtype.size();
                let vectorised = *cast == Cast::None
                    && vectorisable(
                        dims,
                        vec,
                        &[(&out.strides, o), (&a.strides, x)],
                        b.as_ref().map(|b| (&b.strides[..], y)),
                    );
                let (func, threads) = match cast {
                    Cast::None if vectorised => (&self.kernels.ew_vec, p.n as usize / vec),
                    Cast::None => (&self.kernels.ew, p.n as usize),
                    Cast::FromF32 => (&self.kernels.ew_from_f32, p.n as usize),
                    Cast::ToF32 => (&self.kernels.ew_to_f32, p.n as usize),
                };
                let mut l = self.stream.launch_builder(func);
                l.arg(&p).arg(&o).arg(&x).arg(&y);
                launch(l, self.launch_cfg(threads))
            }
            (Step::Zero { loc, len }, _) => {
                // SAFETY: a live region of the arena.
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        self.ptr(*loc),
                        0,
                        len * self.dtype.size(),
                        self.stream.cu_stream(),
                    )
                }
                .map_err(drv_err("memset"))
            }
            (Step::Conv(c), Prepared::Conv(d)) => {
                let tuned = c.algo.ok_or("an untuned convolution")?;
                self.conv(c, d, &tuned)
            }
            (
                Step::Gemm {
                    alpha,
                    x,
                    w,
                    residual,
                    y,
                    ..
                },
                Prepared::Gemm(g),
            ) => {
                // A residual comes in as C: d = alpha·a·b + 1·c (+ bias, ReLU in the epilogue).
                let beta = if residual.is_some() { 1.0f32 } else { 0.0 };
                let (a, b, d) = (self.ptr(*w), self.ptr(*x), self.ptr(*y));
                let c = residual.map_or(d, |z| self.ptr(z));
                // SAFETY: live device buffers of the sizes the layouts state.
                let r = unsafe {
                    ltr::matmul(
                        self.cublaslt,
                        g.desc,
                        alpha as *const f32 as *const c_void,
                        &beta as *const f32 as *const c_void,
                        a as *const c_void,
                        g.a,
                        b as *const c_void,
                        g.b,
                        c as *const c_void,
                        g.c,
                        d as *mut c_void,
                        g.c,
                        &g.algo,
                        self.ptr_u8(&self.lt_workspace) as *mut c_void,
                        self.lt_workspace.len(),
                        self.stream.cu_stream() as *mut _,
                    )
                };
                lt_check(r, "matmul")
            }
            (
                Step::Pool {
                    n,
                    h,
                    w,
                    c,
                    oh,
                    ow,
                    kernel,
                    strides,
                    pads,
                    max,
                    count_include_pad,
                    x,
                    y,
                },
                _,
            ) => {
                let v = [
                    *n,
                    *h,
                    *w,
                    *c,
                    *oh,
                    *ow,
                    kernel[0],
                    kernel[1],
                    strides[0],
                    strides[1],
                    pads[0],
                    pads[1],
                    pads[2],
                    pads[3],
                    usize::from(*max),
                    usize::from(*count_include_pad),
                ];
                let p = PoolParams {
                    v: v.map(|x| x as i32),
                };
                let (xp, yp) = (self.ptr(*x), self.ptr(*y));
                let vec = 16 / self.dtype.size();
                let outputs = n * oh * ow * c;
                let (func, threads) =
                    match c.is_multiple_of(vec) && xp.is_multiple_of(16) && yp.is_multiple_of(16) {
                        true => (&self.kernels.pool_vec, outputs / vec),
                        false => (&self.kernels.pool, outputs),
                    };
                let mut l = self.stream.launch_builder(func);
                l.arg(&p).arg(&xp).arg(&yp);
                launch(l, self.launch_cfg(threads))
            }
            (Step::GlobalAvgPool { n, hw, c, x, y }, _) => {
                let (xp, yp) = (self.ptr(*x), self.ptr(*y));
                let (ni, hwi, ci) = (*n as i32, *hw as i32, *c as i32);
                let mut l = self.stream.launch_builder(&self.kernels.global_avg);
                l.arg(&xp).arg(&yp).arg(&ni).arg(&hwi).arg(&ci);
                let cfg = LaunchConfig {
                    grid_dim: ((n * c.div_ceil(32)) as u32, 1, 1),
                    block_dim: (32, 32, 1),
                    shared_mem_bytes: 0,
                };
                launch(l, cfg)
            }
            (Step::Softmax { rows, len, x, y }, _) if *len <= WARP_ROW_MAX => {
                let (xp, yp) = (self.ptr(*x), self.ptr(*y));
                let (rowsi, leni) = (*rows as i32, *len as i32);
                let mut l = self.stream.launch_builder(&self.kernels.softmax_warp);
                l.arg(&xp).arg(&yp).arg(&rowsi).arg(&leni);
                launch(l, Self::warp_rows_cfg(*rows))
            }
            (Step::Softmax { rows, len, x, y }, _) | (Step::RowMean { rows, len, x, y }, _) => {
                let (xp, yp, leni) = (self.ptr(*x), self.ptr(*y), *len as i32);
                let func = if matches!(step, Step::Softmax { .. }) {
                    &self.kernels.softmax
                } else {
                    &self.kernels.mean
                };
                let mut l = self.stream.launch_builder(func);
                l.arg(&xp).arg(&yp).arg(&leni);
                launch(l, Self::rows_cfg(*rows))
            }
            (
                Step::LayerNorm {
                    rows,
                    len,
                    epsilon,
                    x,
                    scale,
                    bias,
                    y,
                },
                _,
            ) => {
                let (xp, yp, sp) = (self.ptr(*x), self.ptr(*y), self.ptr(*scale));
                let bp = bias.map_or(0, |b| self.ptr(b));
                let (rowsi, leni) = (*rows as i32, *len as i32);
                if *len <= WARP_ROW_MAX {
                    let mut l = self.stream.launch_builder(&self.kernels.layernorm_warp);
                    l.arg(&xp)
                        .arg(&yp)
                        .arg(&sp)
                        .arg(&bp)
                        .arg(&rowsi)
                        .arg(&leni)
                        .arg(epsilon);
                    return launch(l, Self::warp_rows_cfg(*rows));
                }
                let mut l = self.stream.launch_builder(&self.kernels.layernorm);
                l.arg(&xp)
                    .arg(&yp)
                    .arg(&sp)
                    .arg(&bp)
                    .arg(&leni)
                    .arg(epsilon);
                launch(l, Self::rows_cfg(*rows))
            }
            (
                Step::Lrn {
                    pixels,
                    c,
                    size,
                    alpha,
                    beta,
                    bias,
                    x,
                    y,
                },
                _,
            ) => {
                let (xp, yp) = (self.ptr(*x), self.ptr(*y));
                let (pi, ci, si) = (*pixels as i64, *c as i32, *size as i32);
                let mut l = self.stream.launch_builder(&self.kernels.lrn);
                l.arg(&xp).arg(&yp).arg(&pi).arg(&ci).arg(&si);
                l.arg(alpha).arg(beta).arg(bias);
                launch(l, self.launch_cfg(pixels * c))
            }
            _ => Err("a step without its prepared descriptors".into()),
        }
    }

    /// Runs plan `i` once (which also loads cuDNN's kernels), then captures it as a graph.
    fn capture(&mut self, i: usize) -> Result<(), String> {
        self.enqueue(i)?;
        self.stream.synchronize().map_err(drv_err("warm-up run"))?;
        self.stream
            .begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv_err("stream capture"))?;
        let enqueued = self.enqueue(i);
        let graph = self
            .stream
            .end_capture(drv::CUgraphInstantiate_flags(0))
            .map_err(drv_err("graph capture"));
        enqueued?;
        let graph = graph?.ok_or("the captured graph is empty")?;
        graph.upload().map_err(drv_err("graph upload"))?;
        self.plans[i].graph = Some(graph);
        Ok(())
    }

    /// Runs `n` frames (f32, the model's input layout, one after the other) through the
    /// smallest plan that holds them; returns the scores, `n` times the output per frame.
    pub fn run(&mut self, input: &[f32], n: usize) -> Result<&[f32], String> {
        let i = self.plan_holding(n)?;
        let plan = &self.plans[i].plan;
        let len_in = n * plan.input_len / plan.batch;
        self.ctx.bind_to_thread().map_err(drv_err("context"))?;
        let input_ptr = self.input.device_ptr(&self.stream).0;
        let host_in = self.host_in.as_mut_slice().map_err(drv_err("staging"))?;
        host_in[..len_in].copy_from_slice(&input[..len_in]);
        // SAFETY: the device buffer holds the plan's input; the pinned buffer lives as long
        // as the runtime, and the stream is synchronised before it is written again.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                input_ptr,
                &host_in[..len_in],
                self.stream.cu_stream(),
            )
        }
        .map_err(drv_err("upload"))?;
        self.launch_and_download(i, n)
    }

    /// The index of the smallest plan that runs `n` frames at once.
    fn plan_holding(&self, n: usize) -> Result<usize, String> {
        self.plans
            .iter()
            .position(|p| p.plan.batch >= n)
            .ok_or_else(|| format!("no plan runs {n} frames at once"))
    }

    /// Replays plan `i` on the input buffer, downloads the scores of its first `n` frames and
    /// waits for them.
    fn launch_and_download(&mut self, i: usize, n: usize) -> Result<&[f32], String> {
        let plan = &self.plans[i].plan;
        let len_out = n * plan.output_len / plan.batch;
        let output_ptr = self.output.device_ptr(&self.stream).0;
        let host_out = self.host_out.as_mut_slice().map_err(drv_err("staging"))?;
        // SAFETY: the device buffer holds the plan's output; the pinned buffer outlives the
        // synchronisation below.
        unsafe {
            self.plans[i]
                .graph
                .as_ref()
                .ok_or("the plan has no graph")?
                .launch()
                .map_err(drv_err("graph launch"))?;
            cudarc::driver::result::memcpy_dtoh_async(
                &mut host_out[..len_out],
                output_ptr,
                self.stream.cu_stream(),
            )
            .map_err(drv_err("download"))?;
        }
        self.stream.synchronize().map_err(drv_err("inference"))?;
        Ok(&host_out[..len_out])
    }

    /// Uploads one raw frame (its planes, one after the other) and preprocesses it on the GPU
    /// into frames `slot..slot + pres.len()` of the input, one per crop's parameters,
    /// asynchronously: the planes are copied to page-locked staging first, so the caller may
    /// release the frame on return, and the copy and the kernels run while the host waits for
    /// the next frame. The frame is uploaded once for all its crops.
    pub fn stage_frame(
        &mut self,
        slot: usize,
        pres: &[Pre],
        planes: &[&[u8]],
    ) -> Result<(), String> {
        if pres.is_empty() {
            return Ok(());
        }
        self.check_slot(slot + pres.len() - 1)?;
        self.ctx.bind_to_thread().map_err(drv_err("context"))?;
        let len: usize = planes.iter().map(|p| p.len()).sum();
        let capacity = self.raw_host.as_ref().map_or(0, |r| r.len());
        if slot == 0 || self.raw_used + len > capacity {
            // The staging is reused from its start once the frames in it are on the GPU (at
            // the start of a batch the stream is idle but for a discarded batch's copies).
            self.stream.synchronize().map_err(drv_err("sync"))?;
            self.raw_used = 0;
            let want = len * self.max_batch();
            if capacity < want {
                // SAFETY: each range is written before the copy that reads it.
                self.raw_host = Some(
                    unsafe { self.ctx.alloc_pinned::<u8>(want) }
                        .map_err(drv_err("pinned allocation"))?,
                );
                if !self.zero_copy {
                    self.raw = Some(
                        // SAFETY: each range is written by an upload before a kernel reads it.
                        unsafe { self.stream.alloc::<u8>(want) }.map_err(drv_err("allocation"))?,
                    );
                }
            }
        }
        let host = self
            .raw_host
            .as_mut()
            .expect("allocated above")
            .as_mut_slice()
            .map_err(drv_err("staging"))?;
        let start = self.raw_used;
        let mut end = start;
        for plane in planes {
            host[end..end + plane.len()].copy_from_slice(plane);
            end += plane.len();
        }
        let raw_dev = match &self.raw {
            // With unified addressing (every 64-bit CUDA platform), page-locked host memory
            // has the same address on the device as on the host.
            None => host.as_ptr() as u64,
            Some(raw) => {
                let raw_dev = raw.device_ptr(&self.stream).0;
                // SAFETY: the staging range stays untouched until the stream is
                // synchronised: `raw_used` only moves back after a synchronisation.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        raw_dev + start as u64,
                        &host[start..end],
                        self.stream.cu_stream(),
                    )
                }
                .map_err(drv_err("frame upload"))?;
                raw_dev
            }
        };
        self.raw_used = end;
        for (i, pre) in pres.iter().enumerate() {
            self.launch_preprocess(slot + i, pre, raw_dev + start as u64)?;
        }
        Ok(())
    }

    /// Preprocesses one frame that is already in GPU memory (GStreamer's CUDA memory, at
    /// device address `src`, in CUDA context `context`) into frame `slot` of the input,
    /// asynchronously. A frame of our own context is read where it is; one of another
    /// context is first copied into ours on the GPU. The caller keeps the frame's memory
    /// untouched until the batch has run.
    pub fn stage_device_frame(
        &mut self,
        slot: usize,
        pre: &Pre,
        src: u64,
        context: usize,
    ) -> Result<(), String> {
        self.check_slot(slot)?;
        self.ctx.bind_to_thread().map_err(drv_err("context"))?;
        let src = if context == self.context_handle() {
            src
        } else {
            self.copy_from_peer(slot, pre, src, context)?
        };
        self.launch_preprocess(slot, pre, src)
    }

    /// The CUDA context (`CUcontext`) the runtime runs in.
    pub fn context_handle(&self) -> usize {
        self.ctx.cu_ctx() as usize
    }

    /// Copies a frame of another CUDA context into slot `slot` of `peer`; returns its address.
    fn copy_from_peer(
        &mut self,
        slot: usize,
        pre: &Pre,
        src: u64,
        context: usize,
    ) -> Result<u64, String> {
        let len = pre.extent();
        if self
            .peer
            .as_ref()
            .is_none_or(|(_, per_slot)| *per_slot < len)
        {
            // Earlier slots' kernels may still read the old buffer.
            self.stream.synchronize().map_err(drv_err("sync"))?;
            let buffer =
                // SAFETY: each slot is written by the copy below before a kernel reads it.
                unsafe { self.stream.alloc::<u8>(len * self.max_batch()) }
                    .map_err(drv_err("allocation"))?;
            self.peer = Some((buffer, len));
        }
        let (buffer, per_slot) = self.peer.as_ref().expect("allocated above");
        let dst = buffer.device_ptr(&self.stream).0 + (slot * per_slot) as u64;
        // SAFETY: both ranges are `len` bytes of live device memory (the source is the mapped
        // frame); the copy is ordered on our stream before the kernel that reads it.
        unsafe {
            drv::cuMemcpyPeerAsync(
                dst,
                self.ctx.cu_ctx(),
                src,
                context as drv::CUcontext,
                len,
                self.stream.cu_stream(),
            )
            .result()
        }
        .map_err(drv_err("copy from another CUDA context"))?;
        Ok(dst)
    }

    /// The mean time in milliseconds of preprocessing one frame already in GPU memory, over
    /// `runs` full batches queued back to back; for benchmarks.
    pub fn time_device_preprocess(&mut self, pre: &Pre, runs: usize) -> Result<f64, String> {
        self.ctx.bind_to_thread().map_err(drv_err("context"))?;
        let frame = self
            .stream
            .alloc_zeros::<u8>(pre.extent())
            .map_err(drv_err("allocation"))?;
        let src = frame.device_ptr(&self.stream).0;
        let batch = self.max_batch();
        self.launch_preprocess(0, pre, src)?;
        self.stream.synchronize().map_err(drv_err("sync"))?;
        let started = std::time::Instant::now();
        for _ in 0..runs {
            for slot in 0..batch {
                self.launch_preprocess(slot, pre, src)?;
            }
        }
        self.stream.synchronize().map_err(drv_err("sync"))?;
        Ok(started.elapsed().as_secs_f64() * 1e3 / (runs * batch) as f64)
    }

    /// Launches the two preprocessing passes on a frame at device address `src`, into `slot`.
    fn launch_preprocess(&mut self, slot: usize, pre: &Pre, src: u64) -> Result<(), String> {
        let pixels = (pre.out_w * pre.out_h) as usize;
        let input = self.input.device_ptr(&self.stream).0;
        let out = input + (slot * pixels * 3 * 4) as u64;
        let (crop_h, dst_w) = (pre.crop[3].max(0) as usize, pre.dst[2].max(1) as usize);
        let rows_len = crop_h * dst_w * 3;
        if self.pre_rows.as_ref().is_none_or(|r| r.len() < rows_len) {
            // The last frame's passes may still use the old buffer.
            self.stream.synchronize().map_err(drv_err("sync"))?;
            self.pre_rows = Some(
                // SAFETY: the first pass writes every value the second reads.
                unsafe { self.stream.alloc::<f32>(rows_len) }.map_err(drv_err("allocation"))?,
            );
        }
        let rows = self.pre_rows.as_ref().expect("allocated above");
        let rows = rows.device_ptr(&self.stream).0;
        let cols = columns_per_block(pre);
        let mut l = self.stream.launch_builder(&self.kernels.preprocess_rows);
        l.arg(pre).arg(&src).arg(&rows).arg(&cols);
        let cfg = LaunchConfig {
            grid_dim: (
                dst_w.div_ceil(cols as usize) as u32,
                crop_h.clamp(1, 65_535) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match the kernel's signature (kernels.cu); `rows` holds
        // the crop's rows at the destination's width.
        unsafe { l.launch(cfg) }.map_err(drv_err("kernel launch"))?;
        let mut l = self.stream.launch_builder(&self.kernels.preprocess_cols);
        l.arg(pre).arg(&rows).arg(&out);
        // SAFETY: argument types match the kernel's signature (kernels.cu); one thread a pixel.
        unsafe { l.launch(grid(self.sm_count, pixels)) }.map_err(drv_err("kernel launch"))?;
        Ok(())
    }

    /// Uploads one frame preprocessed on the host (f32, the model's input layout) into
    /// frame `slot` of the input, asynchronously.
    pub fn stage_input(&mut self, slot: usize, frame: &[f32]) -> Result<(), String> {
        self.check_slot(slot)?;
        self.ctx.bind_to_thread().map_err(drv_err("context"))?;
        if slot == 0 {
            // A discarded batch's copies may still read the staging.
            self.stream.synchronize().map_err(drv_err("sync"))?;
        }
        let input_ptr = self.input.device_ptr(&self.stream).0;
        let host_in = self.host_in.as_mut_slice().map_err(drv_err("staging"))?;
        let range = slot * frame.len()..(slot + 1) * frame.len();
        let host = host_in
            .get_mut(range.clone())
            .ok_or("a frame larger than the model input")?;
        host.copy_from_slice(frame);
        // SAFETY: each slot is written once per batch, and the stream is synchronised
        // before the next batch, so the range stays untouched while the copy reads it.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                input_ptr + (range.start * 4) as u64,
                &host_in[range],
                self.stream.cu_stream(),
            )
        }
        .map_err(drv_err("upload"))
    }

    fn check_slot(&self, slot: usize) -> Result<(), String> {
        match slot < self.max_batch() {
            true => Ok(()),
            false => Err(format!(
                "frame {slot} of a batch; the engine runs at most {}",
                self.max_batch()
            )),
        }
    }

    /// Runs the first `n` staged frames through the smallest plan that holds them; returns the
    /// scores as `run` does.
    pub fn run_staged(&mut self, n: usize) -> Result<&[f32], String> {
        let i = self.plan_holding(n)?;
        self.ctx.bind_to_thread().map_err(drv_err("context"))?;
        self.launch_and_download(i, n)
    }

    /// The model input that staging `frames` makes; for tests.
    pub fn preprocess_frames(&mut self, frames: &[RawFrame]) -> Result<Vec<f32>, String> {
        for (slot, (pre, planes)) in frames.iter().enumerate() {
            self.stage_frame(slot, std::slice::from_ref(pre), planes)?;
        }
        let len: usize = frames
            .iter()
            .map(|(p, _)| (p.out_w * p.out_h * 3) as usize)
            .sum();
        let mut out = vec![0.0f32; len];
        let input = self.input.device_ptr(&self.stream).0;
        // SAFETY: `out` outlives the synchronisation below.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut out, input, self.stream.cu_stream())
        }
        .map_err(drv_err("download"))?;
        self.stream.synchronize().map_err(drv_err("sync"))?;
        Ok(out)
    }

    /// The plans, tuned.
    pub fn plans(&self) -> impl Iterator<Item = &Plan> {
        self.plans.iter().map(|p| &p.plan)
    }

    /// The most frames one call runs.
    pub fn max_batch(&self) -> usize {
        self.plans.iter().map(|p| p.plan.batch).max().unwrap_or(1)
    }

    fn plan_index(&self, batch: usize) -> Result<usize, String> {
        self.plans
            .iter()
            .position(|p| p.plan.batch == batch)
            .ok_or_else(|| format!("no plan of batch size {batch}"))
    }

    /// Seconds per replay of the graph of `batch` when `runs` are queued back to back: the
    /// throughput; for benchmarks.
    pub fn replay(&self, batch: usize, runs: usize) -> Result<f64, String> {
        let graph = self.plans[self.plan_index(batch)?]
            .graph
            .as_ref()
            .ok_or("no graph")?;
        self.stream.synchronize().map_err(drv_err("sync"))?;
        let start = std::time::Instant::now();
        for _ in 0..runs {
            graph.launch().map_err(drv_err("graph launch"))?;
        }
        self.stream.synchronize().map_err(drv_err("sync"))?;
        Ok(start.elapsed().as_secs_f64() / runs as f64)
    }

    /// Seconds from launch to completion of each of `runs` single replays: the latency.
    pub fn latencies(&self, batch: usize, runs: usize) -> Result<Vec<f64>, String> {
        let graph = self.plans[self.plan_index(batch)?]
            .graph
            .as_ref()
            .ok_or("no graph")?;
        (0..runs)
            .map(|_| {
                let start = std::time::Instant::now();
                graph.launch().map_err(drv_err("graph launch"))?;
                self.stream.synchronize().map_err(drv_err("sync"))?;
                Ok(start.elapsed().as_secs_f64())
            })
            .collect()
    }

    /// GPU milliseconds of each step of the plan of `batch`, timed with events around each
    /// step (outside the graph, so launch gaps are not counted); a median of `runs`.
    pub fn profile(&self, batch: usize, runs: usize) -> Result<Vec<(String, f64)>, String> {
        let bp = &self.plans[self.plan_index(batch)?];
        let timing = Some(drv::CUevent_flags::CU_EVENT_DEFAULT);
        let mut times = vec![Vec::new(); bp.plan.steps.len()];
        for _ in 0..runs {
            let mut events = vec![self.stream.record_event(timing).map_err(drv_err("event"))?];
            for (step, prepared) in bp.plan.steps.iter().zip(&bp.prepared) {
                self.step(step, prepared)?;
                events.push(self.stream.record_event(timing).map_err(drv_err("event"))?);
            }
            self.stream.synchronize().map_err(drv_err("sync"))?;
            for (t, pair) in times.iter_mut().zip(events.windows(2)) {
                t.push(pair[0].elapsed_ms(&pair[1]).map_err(drv_err("event"))? as f64);
            }
        }
        Ok(bp
            .plan
            .steps
            .iter()
            .zip(times)
            .map(|(step, mut t)| {
                t.sort_by(f64::total_cmp);
                (step.describe(), t[t.len() / 2])
            })
            .collect())
    }
}

/// A grid-stride launch over `n` elements: blocks of 256 threads, at most 16 per SM.
/// Whether the `ew_vec` kernel can run an element-wise step over `dims`: `vec` elements
/// (16 bytes) per thread along the last dimension, which must be a multiple of `vec`,
/// contiguous and 16-byte aligned in each operand (strides, device address), except that
/// `b` may instead be constant along it.
fn vectorisable(
    dims: &[usize],
    vec: usize,
    operands: &[(&[i64], u64)],
    b: Option<(&[i64], u64)>,
) -> bool {
    let Some(&last) = dims.last() else {
        return false;
    };
    let aligned = |(strides, ptr): (&[i64], u64)| {
        matches!(strides.split_last(), Some((1, outer))
            if ptr.is_multiple_of(16) && outer.iter().all(|s| s % vec as i64 == 0))
    };
    last.is_multiple_of(vec)
        && operands.iter().all(|&o| aligned(o))
        && b.is_none_or(|b| b.0.last() == Some(&0) || aligned(b))
}

/// How many destination columns one block of `preprocess_rows` filters: as many as read at
/// most `PRE_SPAN` (kernels.cu) source pixels, which the block converts once and keeps.
fn columns_per_block(pre: &Pre) -> i32 {
    const PRE_SPAN: f32 = 2048.0;
    let scale = pre.crop[2].max(1) as f32 / pre.dst[2].max(1) as f32;
    let support = scale.max(1.0);
    // Columns c0..c0 + n read about (n − 1)·scale + 2·support + 1 pixels.
    let n = ((PRE_SPAN - 2.0 - 2.0 * support) / scale).floor() as i32 + 1;
    n.clamp(1, pre.dst[2].max(1))
}

fn grid(sm_count: u32, n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, sm_count as usize * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Constants as the plan's type, little-endian, ready to upload.
pub fn to_bytes(data: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => data
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::{Pre, columns_per_block, vectorisable};

    #[test]
    fn vector_kernel_needs_a_contiguous_aligned_last_dimension() {
        // SiLU over a whole tensor, fp16 (8 elements in 16 bytes).
        let flat: &[i64] = &[1];
        assert!(vectorisable(
            &[77_070_336],
            8,
            &[(flat, 256), (flat, 512)],
            None
        ));
        assert!(!vectorisable(
            &[77_070_335],
            8,
            &[(flat, 256), (flat, 512)],
            None
        ));
        assert!(!vectorisable(&[64], 8, &[(flat, 256), (flat, 514)], None));
        // A squeeze-excitation scale: [n, hw, c] times [n, 1, c].
        let x: &[i64] = &[3136 * 144, 144, 1];
        let se: &[i64] = &[144, 0, 1];
        assert!(vectorisable(
            &[64, 3136, 144],
            8,
            &[(x, 0), (x, 4096)],
            Some((se, 32))
        ));
        // 20 channels: rows of 20 halves start off 16-byte boundaries.
        let odd: &[i64] = &[3136 * 20, 20, 1];
        assert!(!vectorisable(
            &[64, 3136, 16],
            8,
            &[(odd, 0), (odd, 0)],
            None
        ));
        // b constant along the last dimension (one value per row): read as a scalar.
        let row: &[i64] = &[1, 0];
        let m: &[i64] = &[16, 1];
        assert!(vectorisable(&[4, 16], 8, &[(m, 0), (m, 0)], Some((row, 2))));
        // b strided along the last dimension, or a transposed operand: scalar kernel.
        assert!(!vectorisable(
            &[4, 16],
            8,
            &[(m, 0), (m, 0)],
            Some((&[1, 4], 0))
        ));
        assert!(!vectorisable(&[16, 16], 8, &[(m, 0), (&[1, 16], 0)], None));
        // fp32: 4 elements.
        assert!(vectorisable(
            &[4, 12],
            4,
            &[(&[12, 1], 0), (&[12, 1], 16)],
            None
        ));
        assert!(!vectorisable(&[], 8, &[], None));
    }

    /// The source pixels a block of `preprocess_rows` reads, with the kernel's `taps`, fit
    /// the pixels it keeps (`PRE_SPAN`), so each is converted once; rows up to 8K wide.
    #[test]
    fn a_preprocessing_block_reads_what_it_keeps() {
        // kernels.cu's `taps`, in the same f32 arithmetic: (first, count).
        let taps = |i: i32, n_in: i32, n_out: i32| {
            let scale = n_in as f32 / n_out as f32;
            let fs = scale.max(1.0);
            let center = (i as f32 + 0.5) * scale;
            let lo = ((center - fs + 0.5).floor() as i32).max(0);
            let hi = ((center + fs + 0.5).floor() as i32).min(n_in);
            (lo, hi - lo)
        };
        for src_w in [34, 320, 1280, 1920, 2560, 3840, 7680] {
            for dst_w in [96, 224, 299, 384, 518] {
                let pre = Pre {
                    crop: [0, 0, src_w, 1],
                    dst: [0, 0, dst_w, 1],
                    ..Default::default()
                };
                let cols = columns_per_block(&pre);
                assert!((1..=dst_w).contains(&cols));
                for c0 in (0..dst_w).step_by(cols as usize) {
                    let c1 = (c0 + cols).min(dst_w);
                    let (lo, _) = taps(c0, src_w, dst_w);
                    let (last, n) = taps(c1 - 1, src_w, dst_w);
                    assert!(
                        last + n - lo <= 2048,
                        "{src_w} -> {dst_w}: columns {c0}..{c1} read {} pixels",
                        last + n - lo
                    );
                }
                if src_w <= 1920 {
                    assert_eq!(cols, dst_w, "{src_w} -> {dst_w}: one block a row");
                }
            }
        }
    }
}
