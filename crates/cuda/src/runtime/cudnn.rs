// SPDX-License-Identifier: MPL-2.0
//! Owners of cuDNN's handle and descriptors: each is destroyed by its `Drop`, from the
//! moment it is created, so that no error path leaks one.
//!
//! cudarc's safe cuDNN types (`Cudnn`, `TensorDescriptor`, `ConvDescriptor`, ...) are not
//! used: their raw descriptors are private to cudarc, so neither
//! `cudnnFindConvolutionForwardAlgorithmEx` on the arena's raw addresses nor the fused
//! `cudnnConvolutionBiasActivationForward` can be called with them; their data type is a
//! Rust type parameter where ours is chosen at run time, and fp16 convolutions compute in
//! fp32 here (cudarc's `create_conv2d::<f16>` would make them compute in fp16); and
//! `Cudnn::new` binds the context and panics on failure, calls the engine does not make.
//! The calls that run a convolution on device addresses stay with their callers, in
//! `unsafe` blocks: their soundness rests on the plan's addresses, not on these types.

use cudarc::cudnn::sys as dnn;
use cudarc::driver::CudaStream;

use crate::error::{Error, Result};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{ConvStep, DType};

/// `Ok` for success, or the error cuDNN describes, for the call `what`.
pub(super) fn check(status: dnn::cudnnStatus_t, what: &str) -> Result<()> {
    if status == dnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: cuDNN returns a static string.
    let msg = unsafe { std::ffi::CStr::from_ptr(dnn::cudnnGetErrorString(status)) };
    Err(Error::Cudnn {
        what: what.to_owned(),
        status,
        message: msg.to_string_lossy().into_owned(),
    })
}

/// A cuDNN handle whose work goes to one stream.
pub(super) struct Handle(dnn::cudnnHandle_t);

impl Handle {
    /// A handle that enqueues on `stream`.
    pub(super) fn new(stream: &CudaStream) -> Result<Self> {
        let handle = Self::unbound()?;
        // SAFETY: a live handle and stream; the stream outlives the runtime's use of it.
        check(
            unsafe { dnn::cudnnSetStream(handle.0, stream.cu_stream() as dnn::cudaStream_t) },
            "stream",
        )?;
        Ok(handle)
    }

    /// A handle on the context's default stream: for queries, which enqueue nothing.
    pub(super) fn unbound() -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes the new handle, owned by `Handle` from here on.
        check(unsafe { dnn::cudnnCreate(&mut raw) }, "handle")?;
        Ok(Handle(raw))
    }

    /// The handle, for calls on it.
    pub(super) fn raw(&self) -> dnn::cudnnHandle_t {
        self.0
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created in `Handle::new` and used by nothing now; the descriptors made with
        // it are independent objects.
        unsafe { dnn::cudnnDestroy(self.0) };
    }
}

/// A cuDNN descriptor type that owns one descriptor: created by `$create`, destroyed by
/// `$destroy`.
macro_rules! descriptor {
    ($(#[$doc:meta])* $name:ident, $raw:ty, $create:ident, $destroy:ident) => {
        $(#[$doc])*
        pub(super) struct $name($raw);

        impl $name {
            fn new() -> Result<Self> {
                let mut raw = std::ptr::null_mut();
                // SAFETY: writes the new descriptor, owned by the value from here on.
                check(unsafe { dnn::$create(&mut raw) }, "descriptor")?;
                Ok($name(raw))
            }

            /// The descriptor, for calls on it.
            pub(super) fn raw(&self) -> $raw {
                self.0
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: created by `new` and used by nothing else.
                unsafe { dnn::$destroy(self.0) };
            }
        }
    };
}

descriptor!(
    /// A tensor's shape, layout and type.
    TensorDesc,
    dnn::cudnnTensorDescriptor_t,
    cudnnCreateTensorDescriptor,
    cudnnDestroyTensorDescriptor
);
descriptor!(
    /// A convolution's filter.
    FilterDesc,
    dnn::cudnnFilterDescriptor_t,
    cudnnCreateFilterDescriptor,
    cudnnDestroyFilterDescriptor
);
descriptor!(
    /// A convolution's geometry, compute type and math.
    ConvDesc,
    dnn::cudnnConvolutionDescriptor_t,
    cudnnCreateConvolutionDescriptor,
    cudnnDestroyConvolutionDescriptor
);
descriptor!(
    /// The activation of a fused convolution.
    ActivationDesc,
    dnn::cudnnActivationDescriptor_t,
    cudnnCreateActivationDescriptor,
    cudnnDestroyActivationDescriptor
);

/// cuDNN descriptors of one convolution (destroyed in field order).
pub(super) struct ConvDescs {
    pub(super) x: TensorDesc,
    pub(super) y: TensorDesc,
    pub(super) bias: TensorDesc,
    pub(super) w: FilterDesc,
    pub(super) conv: ConvDesc,
    pub(super) act: ActivationDesc,
}

impl ConvDescs {
    /// The descriptors of `c` in `dtype`: NHWC tensors, fp32 compute, and the math that
    /// `dtype` allows until a tuned algorithm says otherwise.
    pub(super) fn new(c: &ConvStep, dtype: DType) -> Result<Self> {
        let ty = match dtype {
            DType::F16 => dnn::cudnnDataType_t::CUDNN_DATA_HALF,
            DType::F32 => dnn::cudnnDataType_t::CUDNN_DATA_FLOAT,
        };
        let nhwc = dnn::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC;
        let i = |v: usize| v as i32;
        let d = ConvDescs {
            x: TensorDesc::new()?,
            y: TensorDesc::new()?,
            bias: TensorDesc::new()?,
            w: FilterDesc::new()?,
            conv: ConvDesc::new()?,
            act: ActivationDesc::new()?,
        };
        let shape = format!(
            "convolution {}x{}x{}x{} -> {} channels, kernel {:?}, group {}",
            c.n, c.c, c.h, c.w, c.k, c.kernel, c.group
        );
        // SAFETY: each call sets a descriptor created above, with values of the types cuDNN
        // documents for it.
        unsafe {
            check(
                dnn::cudnnSetTensor4dDescriptor(
                    d.x.raw(),
                    nhwc,
                    ty,
                    i(c.n),
                    i(c.c),
                    i(c.h),
                    i(c.w),
                ),
                &shape,
            )?;
            check(
                dnn::cudnnSetTensor4dDescriptor(
                    d.y.raw(),
                    nhwc,
                    ty,
                    i(c.n),
                    i(c.k),
                    i(c.oh),
                    i(c.ow),
                ),
                &shape,
            )?;
            check(
                dnn::cudnnSetTensor4dDescriptor(d.bias.raw(), nhwc, ty, 1, i(c.k), 1, 1),
                &shape,
            )?;
            check(
                dnn::cudnnSetFilter4dDescriptor(
                    d.w.raw(),
                    ty,
                    nhwc,
                    i(c.k),
                    i(c.c / c.group),
                    i(c.kernel[0]),
                    i(c.kernel[1]),
                ),
                &shape,
            )?;
            check(
                dnn::cudnnSetConvolution2dDescriptor(
                    d.conv.raw(),
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
            check(
                dnn::cudnnSetConvolutionGroupCount(d.conv.raw(), i(c.group)),
                &shape,
            )?;
        }
        let math = match dtype {
            DType::F16 => dnn::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
            // fp32 means fp32: no TF32 tensor cores.
            DType::F32 => dnn::cudnnMathType_t::CUDNN_FMA_MATH,
        };
        d.set_math(math, &shape)?;
        let mode = if c.act == Act::Relu {
            dnn::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU
        } else {
            dnn::cudnnActivationMode_t::CUDNN_ACTIVATION_IDENTITY
        };
        // SAFETY: sets the activation descriptor created above.
        check(
            unsafe {
                dnn::cudnnSetActivationDescriptor(
                    d.act.raw(),
                    mode,
                    dnn::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
                    0.0,
                )
            },
            &shape,
        )?;
        Ok(d)
    }

    /// Sets the convolution's math type (tensor cores or not); `what` names it in errors.
    pub(super) fn set_math(&self, math: dnn::cudnnMathType_t, what: &str) -> Result<()> {
        // SAFETY: sets the convolution descriptor this value owns.
        check(
            unsafe { dnn::cudnnSetConvolutionMathType(self.conv.raw(), math) },
            what,
        )
    }
}

/// cuDNN's algorithm of a tuned `algo` (`Tuned::algo`, as the engine file stores it).
pub(super) fn algo_from(v: i32) -> dnn::cudnnConvolutionFwdAlgo_t {
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

/// cuDNN's math type of a tuned `math` (`Tuned::math`, as the engine file stores it).
pub(super) fn math_from(v: i32) -> dnn::cudnnMathType_t {
    use dnn::cudnnMathType_t::*;
    match v {
        0 => CUDNN_DEFAULT_MATH,
        1 => CUDNN_TENSOR_OP_MATH,
        2 => CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        _ => CUDNN_FMA_MATH,
    }
}
