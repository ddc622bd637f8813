// SPDX-License-Identifier: MPL-2.0
//! Launching convolutions: cuDNN's call, then, where cuDNN's fused call cannot take the
//! epilogue, conv.cu's bias and activation.

use std::ffi::c_void;

use cudarc::cudnn::sys as dnn;

use cudarc::driver::PushKernelArg;

use super::super::Runtime;
use super::super::cudnn::{self, ConvDescs};
use super::super::kernels::kernel_set;
use super::{EightBit, GpuStep, launch};
use crate::abi::{EwParams, act_params};
use crate::error::{Error, Result};
use crate::runtime::Prepared;
use trtclassify_compiler::plan::{Cast, ConvStep, Strided, Tuned};

kernel_set! {
    /// conv.cu's kernels: the epilogue of cuDNN's unfused convolution.
    ConvKernels {
        bias_act: "bias_act",
        /// 16 bytes a thread.
        bias_act_vec: "bias_act_vec",
    }
}

impl GpuStep for ConvStep {
    fn enqueue(&self, rt: &Runtime, prepared: &Prepared) -> Result<()> {
        if let Some(enqueued) = rt.quantized(EightBit::of_conv(self), prepared) {
            return enqueued;
        }
        let Prepared::Conv(d) = prepared else {
            return Err(Error::Plan("a step without its prepared descriptors"));
        };
        let tuned = self.algo.ok_or(Error::Plan("an untuned convolution"))?;
        rt.conv(self, d, &tuned)
    }
}

impl Runtime {
    /// The convolution `c` as `tuned` says: cuDNN's fused call, cuDNN's convolution then
    /// our bias + activation (+ residual) kernel, or the engine's own stem or depthwise
    /// kernel.
    pub(in crate::runtime) fn conv(
        &self,
        c: &ConvStep,
        d: &ConvDescs,
        tuned: &Tuned,
    ) -> Result<()> {
        if tuned.is_own_stem() {
            return self.stem_conv(c);
        }
        if tuned.is_own_depthwise() {
            return self.depthwise_conv(c);
        }
        if !c.act_in.is_none() {
            self.activate_input(c)?;
        }
        let (one, zero) = (1.0f32, 0.0f32);
        let ws = self.ptr_u8(&self.workspace) as *mut c_void;
        let (x, w, y) = (
            self.ptr(c.x) as *const c_void,
            self.ptr(c.weight) as *const c_void,
            self.ptr(c.y) as *mut c_void,
        );
        let algo = cudnn::algo_from(tuned.algo);
        d.set_math(cudnn::math_from(tuned.math), "math type")?;
        // SAFETY: live device buffers of the sizes the descriptors state.
        unsafe {
            if tuned.fused {
                let (z, alpha2) = match c.residual {
                    Some(z) => (self.ptr(z) as *const c_void, 1.0f32),
                    None => (y as *const c_void, 0.0f32),
                };
                return cudnn::check(
                    dnn::cudnnConvolutionBiasActivationForward(
                        self.cudnn.raw(),
                        &one as *const f32 as *const c_void,
                        d.x.raw(),
                        x,
                        d.w.raw(),
                        w,
                        d.conv.raw(),
                        algo,
                        ws,
                        tuned.workspace,
                        &alpha2 as *const f32 as *const c_void,
                        d.y.raw(),
                        z,
                        d.bias.raw(),
                        self.ptr(c.bias) as *const c_void,
                        d.act.raw(),
                        d.y.raw(),
                        y,
                    ),
                    "fused convolution",
                );
            }
            cudnn::check(
                dnn::cudnnConvolutionForward(
                    self.cudnn.raw(),
                    &one as *const f32 as *const c_void,
                    d.x.raw(),
                    x,
                    d.w.raw(),
                    w,
                    d.conv.raw(),
                    algo,
                    ws,
                    tuned.workspace,
                    &zero as *const f32 as *const c_void,
                    d.y.raw(),
                    y,
                ),
                "convolution",
            )?;
        }
        self.bias_act(c)
    }

    /// The activation of the input of the convolution `c` (`ConvStep::act_in`), in place
    /// before cuDNN's call: the plan has the convolution read that buffer last, and the step
    /// before write it afresh each run. (The build's timing runs the convolution alone many
    /// times over, activating the buffer again each time: harmless, as its values are not
    /// kept.)
    fn activate_input(&self, c: &ConvStep) -> Result<()> {
        let dims = [c.n * c.h * c.w * c.c];
        let whole = Strided {
            loc: c.x,
            strides: vec![1],
        };
        let dtype = self.writes(c.x).1;
        let p = EwParams::new(None, c.act_in, dtype, &dims, &whole, &whole, None);
        self.elementwise(&p, Cast::None, &dims, &whole, &whole, None)
    }

    /// The bias, activation and residual of the convolution `c`, after cuDNN's unfused call.
    fn bias_act(&self, c: &ConvStep) -> Result<()> {
        let n = c.n * c.k * c.oh * c.ow;
        let (kernels, dtype) = self.writes(c.y);
        let (id, p0, p1) = act_params(c.act, dtype);
        let z = c.residual.map_or(0u64, |z| self.ptr(z));
        let (y, bias) = (self.ptr(c.y), self.ptr(c.bias));
        let (len, channels) = (n as i64, c.k as i32);
        let vec = 16 / dtype.size();
        let (func, threads) =
            match c.k.is_multiple_of(vec) && [y, bias, z].iter().all(|p| p.is_multiple_of(16)) {
                true => (&kernels?.conv.bias_act_vec, n / vec),
                false => (&kernels?.conv.bias_act, n),
            };
        let mut b = self.stream.launch_builder(func);
        b.arg(&y).arg(&bias).arg(&z).arg(&len).arg(&channels);
        b.arg(&id).arg(&p0).arg(&p1);
        launch(b, self.launch_cfg(threads))
    }
}
