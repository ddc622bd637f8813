// SPDX-License-Identifier: MPL-2.0
//! Launching int8 and FP8 products and convolutions (`plan::Quant`): the input rounded to
//! 8 bits into patches (quant.cu), then cuBLASLt's 8-bit product of the patches and the
//! 8-bit weights. An FP8 product writes the step's output itself where cuBLASLt takes
//! per-channel scales (CUDA 12.9 on): the scales, bias, residual and activation in its
//! epilogue. Otherwise it writes sums (int32 for int8, f32 for FP8) and quant.cu's epilogue
//! scales them back per output channel and adds the bias, the residual and the activation.
//! Or, for int8 where the build timed it faster, all of that in one launch of quant.cu's own
//! kernel (`OwnStep`), which passes values in int8 between such steps (`chain_int8`).
//!
//! The weights are rounded once, on the host, as the engine is opened (`EightBitWeights`),
//! from the plan-type weights and the per-channel scales the engine file holds.

use std::ffi::c_void;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use super::super::cublaslt::GemmDescs;
use super::super::kernels::kernel_set;
use super::super::{Prepared, Runtime};
use super::launch;
use crate::abi::{
    Conv8Params, ConvShape, OWN_ROWS, OWN_THREADS, OWN_WIDE_THREADS, PatchParams, act_params,
    divider, own_shared_bytes,
};
use crate::error::{Error, Result};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{
    ConvStep, DType, EightBitKernel, GemmStep, Loc, OwnTile, Quant, QuantFormat, Span, Step,
};

kernel_set! {
    /// quant.cu's kernels: the input of 8-bit products and their epilogue, and the own int8
    /// kernel.
    QuantKernels {
        /// 8 channels a thread, into rows of patches.
        patches: "quantize_patches",
        dequantize_int32: "dequantize_int32",
        dequantize_f32: "dequantize_f32",
        /// An int8 step in one kernel, blocks of 64 or 128 output channels, its input in the
        /// plan's type or in int8 already (`Runtime::chain_int8`): `Runtime::own_eight_bit`.
        conv8_64: "conv8_64",
        conv8_64_int8_input: "conv8_64_int8_input",
        conv8_128: "conv8_128",
        conv8_128_int8_input: "conv8_128_int8_input",
        /// An int8 step in one kernel in warps of 64 × 64 outputs, its input in int8.
        conv8_wide_256x64: "conv8_wide_256x64",
        conv8_wide_128x128: "conv8_wide_128x128",
    }
}

/// How a block of the own int8 kernel is launched.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(in crate::runtime) struct OwnLaunch {
    /// The kernel's name in quant.cu.
    pub(in crate::runtime) name: &'static str,
    /// Its outputs: rows (output pixels) × output channels.
    pub(in crate::runtime) rows: usize,
    pub(in crate::runtime) cols: usize,
    pub(in crate::runtime) threads: usize,
    /// Bytes of dynamic shared memory.
    pub(in crate::runtime) shared: usize,
}

impl OwnLaunch {
    /// The blocks of `kernel`, one of `EightBitKernel::OWN`, reading an int8 input where
    /// `int8_input` (always for those that read int8).
    pub(in crate::runtime) fn of(kernel: EightBitKernel, int8_input: bool) -> Self {
        let int8_input = int8_input || kernel.reads_int8();
        let (name, rows, threads) = match (kernel.wide_tile(), kernel.cols(), int8_input) {
            (Some(OwnTile::Rows256Cols64), ..) => ("conv8_wide_256x64", 256, OWN_WIDE_THREADS),
            (Some(OwnTile::Rows128Cols128), ..) => ("conv8_wide_128x128", 128, OWN_WIDE_THREADS),
            (None, 64, false) => ("conv8_64", OWN_ROWS, OWN_THREADS),
            (None, 64, true) => ("conv8_64_int8_input", OWN_ROWS, OWN_THREADS),
            (None, _, false) => ("conv8_128", OWN_ROWS, OWN_THREADS),
            (None, _, true) => ("conv8_128_int8_input", OWN_ROWS, OWN_THREADS),
        };
        let cols = kernel.cols();
        OwnLaunch {
            name,
            rows,
            cols,
            threads,
            shared: own_shared_bytes(rows, cols, int8_input),
        }
    }

    /// The most rows a block of any way computes.
    fn most_rows() -> usize {
        (OwnTile::ALL.iter().map(|t| t.rows())).fold(OWN_ROWS, usize::max)
    }

    /// Whether the blocks of `kernel` fit where a block may have `shared_optin` bytes of
    /// shared memory, whatever their input.
    fn fits(kernel: EightBitKernel, shared_optin: usize) -> bool {
        [false, true].map(|int8_input| OwnLaunch::of(kernel, int8_input).shared <= shared_optin)
            == [true, true]
    }
}

impl QuantKernels {
    /// The own int8 kernel that `launch` runs.
    fn own(&self, launch: &OwnLaunch) -> &CudaFunction {
        match launch.name {
            "conv8_64" => &self.conv8_64,
            "conv8_64_int8_input" => &self.conv8_64_int8_input,
            "conv8_128" => &self.conv8_128,
            "conv8_128_int8_input" => &self.conv8_128_int8_input,
            "conv8_wide_256x64" => &self.conv8_wide_256x64,
            "conv8_wide_128x128" => &self.conv8_wide_128x128,
            name => unreachable!("no own int8 kernel {name}"),
        }
    }

    /// Lets the own int8 kernels (sm_80 on) take the shared memory they are launched with,
    /// beyond the 48 KiB a kernel gets unasked: those of the ways that fit in `shared_optin`
    /// (`Gpu::shared_optin`; the others never run here).
    pub(in crate::runtime) fn allow_own_shared_memory(&self, shared_optin: usize) -> Result<()> {
        let ways = EightBitKernel::OWN.into_iter();
        for kernel in ways.filter(|&k| OwnLaunch::fits(k, shared_optin)) {
            for int8_input in [false, true] {
                let launch = OwnLaunch::of(kernel, int8_input);
                self.own(&launch)
                    .set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        launch.shared as i32,
                    )
                    .map_err(Error::driver("the own int8 kernel's shared memory"))?;
            }
        }
        Ok(())
    }
}

/// A quantized product or convolution as the GPU runs it: patches of its input times its
/// weights as `[n, summed]` rows. A product is a 1×1 convolution over one image of
/// 1×`rows` pixels.
pub(in crate::runtime) struct EightBit {
    pub(in crate::runtime) quant: Quant,
    /// Rows of patches and of the output: output pixels, or the product's rows.
    pub(in crate::runtime) rows: usize,
    /// Output channels: the product's columns, the convolution's filters.
    pub(in crate::runtime) n: usize,
    /// Input height, width and channels.
    hwc: [usize; 3],
    /// Output height and width.
    out: [usize; 2],
    kernel: [usize; 2],
    pads: [usize; 2],
    strides: [usize; 2],
    dilations: [usize; 2],
    /// Scales the sums (a product's `alpha`; 1 for a convolution).
    alpha: f32,
    pub(in crate::runtime) act: Act,
    x: Loc,
    /// The weights in the plan's order: KRSC, `[k, n]`, or `[n, k]` where `transposed`.
    pub(in crate::runtime) w: Loc,
    transposed: bool,
    pub(in crate::runtime) bias: Option<Loc>,
    pub(in crate::runtime) residual: Option<Loc>,
    pub(in crate::runtime) y: Loc,
}

impl EightBit {
    /// The quantized product or convolution `step`, or `None`.
    pub(in crate::runtime) fn of(step: &Step) -> Option<Self> {
        match step {
            Step::Gemm(g) => Self::of_gemm(g),
            Step::Conv(c) => Self::of_conv(c),
            _ => None,
        }
    }

    /// Whether the engine's own kernel runs it as `kernel` says on a GPU of compute
    /// capability `arch` whose blocks may have `shared_optin` bytes of shared memory.
    pub(in crate::runtime) fn own_way_fits(
        &self,
        kernel: EightBitKernel,
        arch: (i32, i32),
        shared_optin: usize,
    ) -> bool {
        self.own_kernel_fits(arch) && OwnLaunch::fits(kernel, shared_optin)
    }

    /// The quantized product `g`, or `None` where it is not quantized.
    pub(in crate::runtime) fn of_gemm(g: &GemmStep) -> Option<Self> {
        Some(EightBit {
            quant: g.quant?,
            rows: g.rows,
            n: g.n,
            hwc: [1, g.rows, g.k],
            out: [1, g.rows],
            kernel: [1, 1],
            pads: [0, 0],
            strides: [1, 1],
            dilations: [1, 1],
            alpha: g.alpha,
            act: g.act,
            x: g.x,
            w: g.w,
            transposed: g.w_transposed,
            bias: g.bias,
            residual: g.residual,
            y: g.y,
        })
    }

    /// The quantized convolution `c`, or `None` where it is not quantized.
    pub(in crate::runtime) fn of_conv(c: &ConvStep) -> Option<Self> {
        Some(EightBit {
            quant: c.quant?,
            rows: c.n * c.oh * c.ow,
            n: c.k,
            hwc: [c.h, c.w, c.c],
            out: [c.oh, c.ow],
            kernel: c.kernel,
            pads: c.pads,
            strides: c.strides,
            dilations: c.dilations,
            alpha: 1.0,
            act: c.act,
            x: c.x,
            w: c.weight,
            transposed: true,
            bias: Some(c.bias),
            residual: c.residual,
            y: c.y,
        })
    }

    /// The dimension summed over: a patch's length.
    pub(in crate::runtime) fn summed(&self) -> usize {
        self.kernel[0] * self.kernel[1] * self.hwc[2]
    }

    /// Whether quant.cu's `conv8_*` run it on a GPU of compute capability `arch`: int8 on
    /// sm_80's tensor-core instructions, its input channels a multiple of 16 and its output
    /// channels of 8 (as `input_of` takes them), its rows (and a block past them) counted in
    /// an int.
    pub(in crate::runtime) fn own_kernel_fits(&self, arch: (i32, i32)) -> bool {
        self.quant.format == QuantFormat::Int8
            && arch >= (8, 0)
            && self.rows.max(self.input_pixels()) + OwnLaunch::most_rows() <= i32::MAX as usize
            && self.hwc[2].is_multiple_of(16)
            && self.n.is_multiple_of(8)
    }

    /// What decides how fast each way of running it is: its shapes, its epilogue, its
    /// format. Steps of the same key run the same way (`Runtime::prepare`).
    pub(in crate::runtime) fn kernel_key(&self) -> String {
        format!(
            "{:?} {:?} {:?} {:?} {:?} {:?} rows {} n {} {:?} bias {} residual {} {}",
            self.hwc,
            self.out,
            self.kernel,
            self.pads,
            self.strides,
            self.dilations,
            self.rows,
            self.n,
            self.act,
            self.bias.is_some(),
            self.residual.is_some(),
            self.quant.format
        )
    }

    /// Its shape as the kernels take it.
    pub(in crate::runtime) fn shape(&self) -> ConvShape {
        let i = |v: usize| v as i32;
        let [h, w, c] = self.hwc.map(i);
        let [oh, ow] = self.out.map(i);
        let [kh, kw] = self.kernel.map(i);
        let [ph, pw] = self.pads.map(i);
        let [sh, sw] = self.strides.map(i);
        let [dh, dw] = self.dilations.map(i);
        ConvShape {
            rows: self.rows as i64,
            h,
            w,
            c,
            oh,
            ow,
            kh,
            kw,
            ph,
            pw,
            sh,
            sw,
            dh,
            dw,
        }
    }

    /// Bytes of patches it reads.
    pub(in crate::runtime) fn patch_bytes(&self) -> usize {
        self.rows * self.summed()
    }

    /// Its input's pixels (a product's rows).
    fn input_pixels(&self) -> usize {
        self.rows / (self.out[0] * self.out[1]).max(1) * self.hwc[0] * self.hwc[1]
    }

    /// Its input as a product's 1×1 shape over all its pixels: the patches of that are the
    /// input rounded to 8 bits as it lies.
    fn input_shape(&self) -> ConvShape {
        let pixels = self.input_pixels() as i32;
        ConvShape {
            rows: i64::from(pixels),
            h: 1,
            w: pixels,
            c: self.hwc[2] as i32,
            oh: 1,
            ow: pixels,
            kh: 1,
            kw: 1,
            ph: 0,
            pw: 0,
            sh: 1,
            sw: 1,
            dh: 1,
            dw: 1,
        }
    }

    /// The bytes of patches and of sums it needs, run as `kernel` says (`None`: not chosen
    /// yet, so any way).
    pub(in crate::runtime) fn scratch_bytes(&self, kernel: Option<EightBitKernel>) -> [usize; 2] {
        let input = self.input_pixels() * self.hwc[2];
        match kernel {
            None => [self.patch_bytes().max(input), self.sum_bytes()],
            Some(EightBitKernel::Library) => [self.patch_bytes(), self.sum_bytes()],
            Some(k) if k.reads_int8() => [input, 0],
            Some(_) => [0, 0],
        }
    }

    /// Bytes of the sums it writes (int32 or f32).
    pub(in crate::runtime) fn sum_bytes(&self) -> usize {
        self.rows * self.n * 4
    }

    /// Its weights as 8-bit `[n, summed]` rows, each channel divided by its scale and
    /// rounded: `weights` holds them in the plan's type `dtype`, `scales` is the f32 scales.
    pub(in crate::runtime) fn rounded_weights(
        &self,
        weights: &[u8],
        dtype: DType,
        scales: &[f32],
    ) -> Vec<u8> {
        let Loc::Weight { offset, .. } = self.w else {
            unreachable!("quantized steps read constant weights")
        };
        let read = |i: usize| {
            let at = (offset + i) * dtype.size();
            match dtype {
                DType::F16 => half::f16::from_le_bytes([weights[at], weights[at + 1]]).to_f32(),
                DType::F32 => f32::from_le_bytes(weights[at..at + 4].try_into().expect("4 bytes")),
            }
        };
        let (n, summed, format) = (self.n, self.summed(), self.quant.format);
        let round = |channels: &mut [u8], first: usize| {
            let rows = channels.chunks_exact_mut(summed).zip(&scales[first..]);
            for (j, (row, &scale)) in rows.enumerate().map(|(j, r)| (first + j, r)) {
                for (i, b) in row.iter_mut().enumerate() {
                    let v = match self.transposed {
                        true => read(j * summed + i),
                        false => read(i * n + j),
                    };
                    let q = match scale > 0.0 {
                        true => format.round(v / scale),
                        false => 0.0,
                    };
                    *b = format.encode(q);
                }
            }
        };
        let mut rows = vec![0u8; n * summed];
        // Every weight of every 8-bit step is rounded as the engine opens: the channels are
        // spread over the cores, for a quick start.
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let per = match rows.len() < 1 << 20 {
            true => n.max(1),
            false => n.div_ceil(cores),
        };
        match per >= n {
            true => round(&mut rows, 0),
            false => std::thread::scope(|s| {
                for (t, channels) in rows.chunks_mut(per * summed).enumerate() {
                    let round = &round;
                    s.spawn(move || round(channels, t * per));
                }
            }),
        }
        rows
    }
}

impl Runtime {
    /// Enqueues the 8-bit step `e` as `prepared` says: `None` where it was prepared in the
    /// plan's type (or is not quantized).
    pub(in crate::runtime) fn quantized(
        &self,
        e: Option<EightBit>,
        prepared: &Prepared,
    ) -> Option<Result<()>> {
        match (e, prepared) {
            (Some(e), Prepared::EightBit(g, w)) => Some(self.eight_bit(&e, g, *w)),
            (Some(e), Prepared::OwnEightBit(own)) => Some(self.own_eight_bit(&e, own)),
            _ => None,
        }
    }

    /// Enqueues the 8-bit step `e`: its input into patches, then the product into `y`
    /// (`g.scaled`) or into the sums and the epilogue into `y`. `g` is its product's
    /// descriptors, `w` its 8-bit weights.
    pub(in crate::runtime) fn eight_bit(&self, e: &EightBit, g: &GemmDescs, w: u64) -> Result<()> {
        let (kernels, dtype) = self.writes(e.y);
        let quant = &kernels?.quant;
        let (patches, sums) = (self.ptr_u8(&self.patches), self.ptr_u8(&self.sums));

        self.round_patches(e, e.shape(), patches)?;

        if g.scaled {
            // y = act(alpha·(w·patchesᵀ ⊙ channel scales) + z + bias), z the residual.
            let alpha = e.alpha * e.quant.x_scale;
            return self.product(g, alpha, [w, patches], e.residual, e.y);
        }
        // d = 1·w·patchesᵀ: int32 scalars for int8 (its scale type), f32 for FP8.
        let (one_i, zero_i, one_f, zero_f) = (1i32, 0i32, 1.0f32, 0.0f32);
        let (alpha, beta) = match e.quant.format {
            QuantFormat::Int8 => (
                &one_i as *const i32 as *const c_void,
                &zero_i as *const i32 as *const c_void,
            ),
            QuantFormat::Fp8 => (
                &one_f as *const f32 as *const c_void,
                &zero_f as *const f32 as *const c_void,
            ),
        };
        // SAFETY: live device buffers of the sizes the layouts state: the weights of
        // `EightBitWeights`, the patches and sums sized for the largest 8-bit step; scalars
        // of the descriptors' scale type.
        unsafe { self.matmul(g, [alpha, beta], [w, patches, sums, sums]) }?;

        let func = match e.quant.format {
            QuantFormat::Int8 => &quant.dequantize_int32,
            QuantFormat::Fp8 => &quant.dequantize_f32,
        };
        let (id, p0, p1) = act_params(e.act, dtype);
        let (y, w_scales) = (self.ptr(e.y), self.ptr(e.quant.w_scales));
        let bias = e.bias.map_or(0u64, |b| self.ptr(b));
        let z = e.residual.map_or(0u64, |z| self.ptr(z));
        let (len, n) = ((e.rows * e.n) as i64, e.n as i32);
        let (n_mul, n_shift) = divider(e.n as u32);
        let scale = e.alpha * e.quant.x_scale;
        let mut b = self.stream.launch_builder(func);
        b.arg(&sums).arg(&y).arg(&w_scales).arg(&bias).arg(&z);
        b.arg(&len).arg(&n).arg(&n_mul).arg(&n_shift);
        b.arg(&scale).arg(&id).arg(&p0).arg(&p1);
        launch(b, self.launch_cfg(e.rows * e.n))
    }
}

impl Runtime {
    /// Enqueues the rounding of `e`'s input to 8 bits into `patches`, as the patches of
    /// `shape` (`e.shape()`: its im2col; `e.input_shape()`: the input as it lies).
    fn round_patches(&self, e: &EightBit, shape: ConvShape, patches: u64) -> Result<()> {
        let (kernels, dtype) = self.writes(e.y);
        let x = self.ptr(e.x);
        let p = PatchParams {
            shape,
            scale: e.quant.x_scale,
            fp8: i32::from(e.quant.format == QuantFormat::Fp8),
            ..Default::default()
        };
        let p = p.with_dividers(dtype == DType::F16 && x.is_multiple_of(16));
        let mut b = self.stream.launch_builder(&kernels?.quant.patches);
        b.arg(&p).arg(&x).arg(&patches);
        let bytes = shape.rows as usize * (shape.kh * shape.kw * shape.c) as usize;
        launch(b, self.launch_cfg(bytes / 8))
    }
}

/// An int8 step as the engine's own kernel runs it (`Prepared::OwnEightBit`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(in crate::runtime) struct OwnStep {
    /// The device address of its int8 weights.
    pub(in crate::runtime) w: u64,
    /// How it runs: one of `EightBitKernel::OWN`.
    pub(in crate::runtime) kernel: EightBitKernel,
    /// Whether its input is in int8 already, written by the step before (`chain_int8`).
    pub(in crate::runtime) int8_input: bool,
    /// Where it writes its output in int8 for the one step that reads it: that step's input
    /// scale.
    pub(in crate::runtime) int8_output: Option<f32>,
    /// Where it writes its output a second time, in int8, for the steps that read it as their
    /// input (`int8_copies`): the slot of `Runtime::int8_copies`, and their input scale.
    pub(in crate::runtime) int8_copy: Option<(usize, f32)>,
    /// Where it reads its input in int8 from such a copy: the slot.
    pub(in crate::runtime) int8_from: Option<usize>,
}

impl OwnStep {
    /// The step whose int8 weights are at `w`, run as `kernel` says (one of
    /// `EightBitKernel::OWN`), its input and output in the plan's type.
    pub(in crate::runtime) fn new(w: u64, kernel: EightBitKernel) -> Self {
        OwnStep {
            w,
            kernel,
            int8_input: false,
            int8_output: None,
            int8_copy: None,
            int8_from: None,
        }
    }
}

impl Runtime {
    /// Has the int8 steps of the engine's own kernel (`prepared`, parallel to `steps`) pass
    /// a value in int8 where one writes it and every later reader reads it as its input
    /// (`int8_readers`): the writer then writes it as they would round it, and they read it
    /// as it is, with nothing to round (the scores are the same bits). The value's buffer
    /// holds it in its first bytes. Where other steps read it too, a copy in int8 for those
    /// that take it as input (`int8_copies`). Returns how many values pass either way.
    pub(in crate::runtime) fn chain_int8(
        &mut self,
        steps: &[Step],
        prepared: &mut [Prepared],
    ) -> usize {
        let own: Vec<bool> = (prepared.iter())
            .map(|p| matches!(p, Prepared::OwnEightBit(_)))
            .collect();
        let scales: Vec<Option<f32>> = (steps.iter())
            .map(|s| EightBit::of(s).map(|e| e.quant.x_scale))
            .collect();
        let mut alone = Vec::new();
        for (w, readers) in int8_chains(steps, &own, &scales) {
            // Every reader takes all of the value as its input, so its first byte.
            let Some(reader) = EightBit::of(&steps[readers[0]]) else {
                continue;
            };
            // cp.async copies 16 aligned bytes.
            if !self.ptr(reader.x).is_multiple_of(16) {
                continue;
            }
            for &r in &readers {
                if let Prepared::OwnEightBit(own) = &mut prepared[r] {
                    own.int8_input = true;
                }
            }
            if let Prepared::OwnEightBit(own) = &mut prepared[w] {
                own.int8_output = Some(reader.quant.x_scale);
            }
            alone.push(w);
        }
        let mut passed = alone.len();
        // The values others read too: a copy in int8 for the own steps that take them as input.
        for (w, readers, slot) in int8_copies(steps, &own, &scales, &alone) {
            let (Some(writer), Some(scale)) = (EightBit::of(&steps[w]), scales[readers[0]]) else {
                continue;
            };
            if let Prepared::OwnEightBit(own) = &mut prepared[w] {
                own.int8_copy = Some((slot, scale));
            }
            for r in readers {
                if let Prepared::OwnEightBit(own) = &mut prepared[r] {
                    own.int8_from = Some(slot);
                }
            }
            self.int8_copy_bytes[slot] = self.int8_copy_bytes[slot].max(writer.rows * writer.n);
            passed += 1;
        }
        passed
    }

    /// The bytes of patches and of sums that the 8-bit steps need at most, as they were
    /// prepared (1 where none needs any).
    pub(in crate::runtime) fn eight_bit_scratch_bytes(&self) -> [usize; 2] {
        let mut most = [1, 1];
        for (step, prepared) in
            (self.plans.iter()).flat_map(|p| p.plan.steps.iter().zip(&p.prepared))
        {
            let kernel = match prepared {
                Prepared::EightBit(..) => EightBitKernel::Library,
                Prepared::OwnEightBit(own) => own.kernel,
                _ => continue,
            };
            if let Some(e) = EightBit::of(step) {
                let bytes = e.scratch_bytes(Some(kernel));
                most = [most[0].max(bytes[0]), most[1].max(bytes[1])];
            }
        }
        most
    }

    /// Enqueues `step`, with `prepared` for it, writing its output in the plan's type: as
    /// `step` does, but an int8 step of the engine's own kernel reads and writes its values
    /// as if it passed none in int8 (`chain_int8`): for runs that read each step's output.
    pub(in crate::runtime) fn step_alone(&self, step: &Step, prepared: &Prepared) -> Result<()> {
        match (EightBit::of(step), prepared) {
            (Some(e), Prepared::OwnEightBit(own)) => {
                self.own_eight_bit(&e, &OwnStep::new(own.w, own.kernel))
            }
            _ => self.step(step, prepared),
        }
    }

    /// Enqueues the int8 step `e` as one kernel of ours (`EightBit::own_kernel_fits`), after
    /// a pass that rounds its input where its kernel reads int8 that the step before does
    /// not pass, as `own` says: the same output as `eight_bit`'s three launches, to the bit
    /// (in int8 where `own.int8_output`, as the next step would round it).
    pub(in crate::runtime) fn own_eight_bit(&self, e: &EightBit, own: &OwnStep) -> Result<()> {
        let (kernels, dtype) = self.writes(e.y);
        let quant = &kernels?.quant;
        let int8_input = own.int8_input || own.int8_from.is_some() || own.kernel.reads_int8();
        let x = match own.int8_from {
            Some(slot) => self.ptr_u8(&self.int8_copies[slot]),
            None if own.kernel.reads_int8() && !own.int8_input => {
                let rounded = self.ptr_u8(&self.patches);
                self.round_patches(e, e.input_shape(), rounded)?;
                rounded
            }
            None => self.ptr(e.x),
        };
        let i = |v: usize| v as i32;
        let (act_id, p0, p1) = act_params(e.act, dtype);
        let p = Conv8Params {
            shape: e.shape(),
            n: i(e.n),
            summed: i(e.summed()),
            x_scale: e.quant.x_scale,
            // As `eight_bit` passes it to `dequantize`: the same product, the same bits.
            scale: e.alpha * e.quant.x_scale,
            act_id,
            p0,
            p1,
            vec: i32::from(dtype == DType::F16 && x.is_multiple_of(16)),
            y_int8: i32::from(own.int8_output.is_some()),
            y_scale: (own.int8_output.or(own.int8_copy.map(|(_, scale)| scale))).unwrap_or(0.0),
            // A slot's start: aligned for the kernels' 8- and 16-byte stores.
            y8: own
                .int8_copy
                .map_or(0, |(slot, _)| self.ptr_u8(&self.int8_copies[slot])),
        };
        debug_assert!(p.y8.is_multiple_of(16));
        let (y, w_scales) = (self.ptr(e.y), self.ptr(e.quant.w_scales));
        let bias = e.bias.map_or(0u64, |b| self.ptr(b));
        let z = e.residual.map_or(0u64, |z| self.ptr(z));
        let block = OwnLaunch::of(own.kernel, int8_input);
        let mut b = self.stream.launch_builder(quant.own(&block));
        b.arg(&p)
            .arg(&x)
            .arg(&own.w)
            .arg(&w_scales)
            .arg(&bias)
            .arg(&z)
            .arg(&y);
        let blocks = |len: usize, tile: usize| len.div_ceil(tile) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks(e.rows, block.rows), blocks(e.n, block.cols), 1),
            block_dim: (block.threads as u32, 1, 1),
            shared_mem_bytes: block.shared as u32,
        };
        launch(b, cfg)
    }
}

/// The steps of `steps` that may pass a value in int8, among those the engine's own kernel
/// runs (`own`, parallel; `scales`: each 8-bit step's input scale): the writer, and its
/// readers (`int8_readers`).
fn int8_chains(steps: &[Step], own: &[bool], scales: &[Option<f32>]) -> Vec<(usize, Vec<usize>)> {
    (0..steps.len())
        .filter_map(|w| Some((w, int8_readers(steps, own, scales, w)?)))
        .collect()
}

/// The readers of the value that step `w` writes in the arena, where it may write it in
/// int8 alone: each later step that reads it before it is written over reads all of it as
/// its input, nothing else of it (not as its residual), at one scale, and runs in the own
/// kernel, as `w` does. One reader, or several: a stage's first block, whose first product
/// and downsampling both take the stage's input.
fn int8_readers(
    steps: &[Step],
    own: &[bool],
    scales: &[Option<f32>],
    w: usize,
) -> Option<Vec<usize>> {
    if !own[w] {
        return None;
    }
    let writer = &steps[w];
    let out = arena_range(writer.written())?;
    // Its int8 bytes would land on a residual it reads in the plan's type.
    if (writer.reads().into_iter()).any(|s| overlaps(arena_range(s), out)) {
        return None;
    }
    let readers = readers_of(steps, w, out);
    let scale = |r: usize| scales[r].map(f32::to_bits);
    let first = *readers.first()?;
    (readers.iter())
        .all(|&r| own[r] && takes_as_input(&steps[r], out) && scale(r) == scale(first))
        .then_some(readers)
}

/// The steps after `w` that read any of `out` (its output's place in the arena) before it is
/// written over: the arena places nothing over a value before its last read, so the first
/// step that writes over any of it comes after every reader.
fn readers_of(steps: &[Step], w: usize, out: (i128, i128)) -> Vec<usize> {
    let mut readers = Vec::new();
    for (r, step) in steps.iter().enumerate().skip(w + 1) {
        if (step.reads().into_iter()).any(|s| overlaps(arena_range(s), out)) {
            readers.push(r);
        }
        if overlaps(arena_range(step.written()), out) {
            break;
        }
    }
    readers
}

/// Whether `step` reads all of `out` as its input and nothing else of it (not as its
/// residual). A product's and a convolution's first span is their input (`StepKind::spans`).
fn takes_as_input(step: &Step, out: (i128, i128)) -> bool {
    let reads_of_it = (step.reads().into_iter())
        .filter(|s| overlaps(arena_range(*s), out))
        .count();
    reads_of_it == 1 && step.spans().first().and_then(|s| arena_range(*s)) == Some(out)
}

/// The values that a step of the engine's own kernel (`own`, parallel to `steps`) may write
/// a second time in int8, beside the plan's type, for the own steps that read all of it as
/// their input at one scale (`scales`: each 8-bit step's input scale), where it has more than
/// one reader and does not pass in int8 alone (`alone`: the writers of those that do): the
/// writer, those readers, and the slot of `Runtime::int8_copies` the copy goes in. A slot
/// holds a copy from its writer to its last reader; two, so that a copy may be written before
/// the last reader of the one before has run.
fn int8_copies(
    steps: &[Step],
    own: &[bool],
    scales: &[Option<f32>],
    alone: &[usize],
) -> Vec<(usize, Vec<usize>, usize)> {
    let mut copies = Vec::new();
    // The last reader of each slot's copy.
    let mut held_until: [Option<usize>; 2] = [None; 2];
    for (w, writer) in steps.iter().enumerate() {
        if !own[w] {
            continue;
        }
        let Some(out) = arena_range(writer.written()) else {
            continue;
        };
        let readers = readers_of(steps, w, out);
        if readers.len() < 2 || alone.contains(&w) {
            continue;
        }
        let takes_int8 = |&r: &usize| own[r] && takes_as_input(&steps[r], out);
        let Some(&first) = readers.iter().find(|r| takes_int8(r)) else {
            continue;
        };
        let bits = |r: usize| scales[r].map(f32::to_bits);
        let int8: Vec<usize> = (readers.iter().copied())
            .filter(|r| takes_int8(r) && bits(*r) == bits(first))
            .collect();
        let Some(slot) = (0..2).find(|&s| held_until[s].is_none_or(|last| last < w)) else {
            continue;
        };
        held_until[slot] = int8.last().copied();
        copies.push((w, int8, slot));
    }
    copies
}

/// The elements of the arena that `span` covers, where it is in the arena.
fn arena_range(span: Span) -> Option<(i128, i128)> {
    match span.loc {
        Loc::Arena(at) => Some((at as i128 + span.start, at as i128 + span.end)),
        _ => None,
    }
}

/// Whether two ranges of the arena share an element.
fn overlaps(a: Option<(i128, i128)>, b: (i128, i128)) -> bool {
    a.is_some_and(|a| a.0 < b.1 && b.0 < a.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// quant.cu's `quantize_int8` before its rounding to an integer: v / s as v · (1 / s) and
    /// Markstein's correction, v first held to ±128·s.
    fn divided_by_the_inverse(v: f32, s: f32, inv: f32) -> f32 {
        let held = v.clamp(-128.0 * s, 128.0 * s);
        let q = held * inv;
        (-q).mul_add(s, held).mul_add(inv, q)
    }

    #[test]
    fn int8_rounding_by_the_inverse_is_the_division() {
        // Every finite fp16 value, and every f32 one of a spread of exponents, over scales
        // from 2⁻³⁰ to 2¹⁵ with varied mantissas (normal numbers, as `QuantFormat::scale`
        // makes them), give the quotient of IEEE division to the bit (as a byte: the signed
        // zero aside) wherever it is within the int8 range's ±128.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let fp16 = (0..=u16::MAX).map(|b| half::f16::from_bits(b).to_f32());
        let values: Vec<f32> = fp16
            .chain((0..65_536).map(|_| {
                let bits = (next() as u32 & 0x807f_ffff) | ((87 + next() as u32 % 60) << 23);
                f32::from_bits(bits)
            }))
            .filter(|v| v.is_finite())
            .collect();
        for _ in 0..96 {
            let mantissa = next() as u32 & 0x007f_ffff;
            let s = f32::from_bits(mantissa | ((97 + next() as u32 % 45) << 23));
            let inv = 1.0 / s;
            for &v in &values {
                let (got, want) = (divided_by_the_inverse(v, s, inv), v / s);
                if want.abs() < 128.0 {
                    assert!(got == want, "{v:e} / {s:e}: {got:e}, not {want:e}");
                } else {
                    assert_eq!(got, 128f32.copysign(v), "{v:e} / {s:e}");
                }
            }
        }
    }

    /// A product of k = 2, n = 3 whose weights are stored `[k, n]` (or `[n, k]`, transposed).
    fn product(w_transposed: bool, format: QuantFormat) -> EightBit {
        let g = GemmStep {
            batch: 1,
            alpha: 1.0,
            rows: 4,
            n: 3,
            k: 2,
            x: Loc::Arena(0),
            x_batch: 0,
            w: Loc::Weight {
                index: 0,
                offset: 1,
            },
            w_transposed,
            bias: None,
            residual: None,
            act: Act::None,
            y: Loc::Arena(8),
            y_batch: 12,
            quant: Some(Quant {
                format,
                x_scale: 0.1,
                w_scales: Loc::Weight {
                    index: 1,
                    offset: 0,
                },
                algo: None,
                kernel: None,
            }),
            algo: None,
        };
        EightBit::of_gemm(&g).expect("quantized")
    }

    #[test]
    fn weights_become_rows_of_output_channels_rounded_by_their_scales() {
        // w = [[1, -0.5, 0.25], [0.5, 1, -0.25]] after one value of padding; each column's
        // scale is its largest magnitude / 127. Halves round to even: 63.5 → 64, −63.5 → −64.
        let w = [9.0f32, 1.0, -0.5, 0.25, 0.5, 1.0, -0.25];
        let wt = [9.0f32, 1.0, 0.5, -0.5, 1.0, 0.25, -0.25];
        let scales = [1.0 / 127.0, 1.0 / 127.0, 0.25 / 127.0];
        let int8 = |v: [i8; 6]| v.map(|q| q as u8).to_vec();
        let want = int8([127, 64, -64, 127, 127, -127]);
        for (transposed, weights) in [(false, w), (true, wt)] {
            let e = product(transposed, QuantFormat::Int8);
            assert_eq!((e.summed(), e.patch_bytes(), e.sum_bytes()), (2, 8, 48));
            let f16: Vec<u8> = (weights.iter())
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect();
            assert_eq!(e.rounded_weights(&f16, DType::F16, &scales), want);
            let f32: Vec<u8> = weights.iter().flat_map(|v| v.to_le_bytes()).collect();
            assert_eq!(e.rounded_weights(&f32, DType::F32, &scales), want);
        }
        // FP8: scales of largest / 448 put each column's largest at 448 (0x7e), and a channel
        // whose scale is 0 (all zeros) reads 0.
        let e = product(false, QuantFormat::Fp8);
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let got = e.rounded_weights(&bytes, DType::F32, &[1.0 / 448.0, 1.0 / 448.0, 0.0]);
        let f = QuantFormat::Fp8;
        assert_eq!(got, [0x7e, f.encode(224.0), f.encode(-224.0), 0x7e, 0, 0]);
    }

    #[test]
    fn int8_passes_from_a_step_to_its_only_reader() {
        use trtclassify_compiler::{OnnxModel, quant::input_of, testing::models};
        let model = OnnxModel::load(&models().join("ops.onnx")).expect("ops.onnx");
        let spec = model.input_spec(None).expect("an image input");
        let (plans, _) =
            trtclassify_compiler::compile(&model, &[2], spec, DType::F16).expect("compiles");
        let steps = &plans[0].steps;
        // Every step that may be quantized taken as run by the own kernel.
        let own: Vec<bool> = steps.iter().map(|s| input_of(s).is_some()).collect();
        let scales: Vec<Option<f32>> = steps.iter().map(|_| Some(0.5)).collect();
        let chains = int8_chains(steps, &own, &scales);
        let described: Vec<(String, String)> = (chains.iter())
            .map(|(w, r)| (steps[*w].describe(), steps[r[0]].describe()))
            .collect();
        // A 3×3 convolution into the next, and an MLP's GELU product into its second; not
        // the values also read as a residual, nor those read by several steps.
        assert_eq!(chains.len(), 2, "{described:?}");
        assert!(described[0].0.starts_with("conv") && described[0].1.starts_with("conv"));
        assert!(described[1].0.contains("Gelu") && described[1].1.starts_with("gemm"));
        for (w, readers) in &chains {
            assert_eq!(readers.len(), 1, "{described:?}");
            assert_eq!(
                steps[readers[0]].spans()[0],
                steps[*w].written(),
                "{described:?}"
            );
        }
        // A reader the own kernel does not run takes its input in the plan's type.
        let mut fewer = own.clone();
        fewer[chains[0].1[0]] = false;
        assert_eq!(int8_chains(steps, &fewer, &scales), chains[1..]);
    }

    #[test]
    fn int8_passes_to_several_readers_where_each_takes_it_as_input_at_one_scale() {
        let chains = |steps: &[Step], scales: &[f32]| {
            let own = vec![true; steps.len()];
            let scales: Vec<Option<f32>> = scales.iter().map(|&s| Some(s)).collect();
            let chains = int8_chains(steps, &own, &scales);
            (chains, copies_beside_chains(steps, &own, &scales))
        };
        // A value (100) read by two products as their input, then the last step.
        let after = |last: Step| {
            [
                product_at(0, 100, None),
                product_at(100, 200, None),
                product_at(100, 300, None),
                last,
            ]
        };
        // A stage's first block: its input read by its first product and by its
        // downsampling, which the block's last product reads as its residual.
        let steps = after(product_at(200, 400, Some(300)));
        let (passed, copied) = chains(&steps, &[0.5; 4]);
        assert_eq!(passed[0], (0, vec![1, 2]));
        // Passed alone, so not copied as well; where it cannot pass (its buffer misaligned
        // for cp.async), copied for both readers instead.
        assert!(copied.iter().all(|c| c.0 != 0), "{copied:?}");
        let scales = [Some(0.5); 4];
        let own = [true; 4];
        assert_eq!(
            int8_copies(&steps, &own, &scales, &[])[0],
            (0, vec![1, 2], 0)
        );
        // At two scales it cannot pass alone: a copy at the first reader's, for it.
        let (passed, copied) = chains(&steps, &[0.5, 0.5, 0.25, 0.5]);
        assert!(passed.iter().all(|c| c.0 != 0), "{passed:?}");
        assert_eq!(copied[0], (0, vec![1], 0));
        // Nor where another reader takes it as its residual: each reader then reads what
        // it read before (the copy, or the plan's type).
        let steps = after(product_at(300, 400, Some(100)));
        let (passed, copied) = chains(&steps, &[0.5; 4]);
        assert!(passed.iter().all(|c| c.0 != 0), "{passed:?}");
        assert_eq!(copied[0], (0, vec![1, 2], 0));
    }

    /// `int8_copies` beside the values that `int8_chains` passes alone (all of them, as a
    /// runtime whose buffers are all aligned passes them).
    fn copies_beside_chains(
        steps: &[Step],
        own: &[bool],
        scales: &[Option<f32>],
    ) -> Vec<(usize, Vec<usize>, usize)> {
        let alone: Vec<usize> = (int8_chains(steps, own, scales).iter())
            .map(|c| c.0)
            .collect();
        int8_copies(steps, own, scales, &alone)
    }

    #[test]
    fn values_several_steps_read_are_copied_in_int8_for_those_that_take_them_as_input() {
        use trtclassify_compiler::{OnnxModel, quant::input_of, testing::models};
        let model = OnnxModel::load(&models().join("ops.onnx")).expect("ops.onnx");
        let spec = model.input_spec(None).expect("an image input");
        let (plans, _) =
            trtclassify_compiler::compile(&model, &[2], spec, DType::F16).expect("compiles");
        let steps = &plans[0].steps;
        let own: Vec<bool> = steps.iter().map(|s| input_of(s).is_some()).collect();
        let scales: Vec<Option<f32>> = steps.iter().map(|_| Some(0.5)).collect();
        let copies = copies_beside_chains(steps, &own, &scales);
        // The transformer blocks' residual stream, written by a product with a residual and
        // read again as a residual: a copy for the product that takes it as its input.
        assert_eq!(copies.len(), 2, "{copies:?}");
        let mut last_in_slot = [None; 2];
        for (w, readers, slot) in &copies {
            let out = arena_range(steps[*w].written()).expect("in the arena");
            let all = readers_of(steps, *w, out);
            assert!(
                all.len() >= 2 && !readers.is_empty(),
                "{}",
                steps[*w].describe()
            );
            for r in readers {
                assert!(own[*r] && takes_as_input(&steps[*r], out));
                assert_eq!(steps[*r].spans()[0], steps[*w].written());
            }
            // Some reader takes it in the plan's type (its residual).
            assert!(all.iter().any(|r| !readers.contains(r)));
            // A slot holds one copy at a time.
            assert!(last_in_slot[*slot].is_none_or(|last| last < *w));
            last_in_slot[*slot] = readers.last().copied();
        }
        // A reader the own kernel does not run reads as before.
        let (w, readers, _) = &copies[0];
        let mut fewer = own.clone();
        fewer[readers[0]] = false;
        assert!(
            copies_beside_chains(steps, &fewer, &scales)
                .iter()
                .all(|c| c.0 != *w)
        );
        // Nor is a value copied that passes in int8 alone.
        let chains = int8_chains(steps, &own, &scales);
        assert!(
            chains
                .iter()
                .all(|(cw, _)| copies.iter().all(|c| c.0 != *cw))
        );
    }

    /// A 4 × 16 · 16 × 16 int8 product of the arena's values at `x` (and the residual at
    /// `residual`) into `y`.
    fn product_at(x: usize, y: usize, residual: Option<usize>) -> Step {
        Step::Gemm(GemmStep {
            batch: 1,
            alpha: 1.0,
            rows: 4,
            n: 16,
            k: 16,
            x: Loc::Arena(x),
            x_batch: 0,
            w: Loc::Weight {
                index: 0,
                offset: 0,
            },
            w_transposed: true,
            bias: None,
            residual: residual.map(Loc::Arena),
            act: Act::None,
            y: Loc::Arena(y),
            y_batch: 0,
            quant: Some(Quant {
                format: QuantFormat::Int8,
                x_scale: 0.5,
                w_scales: Loc::Weight {
                    index: 1,
                    offset: 0,
                },
                algo: None,
                kernel: None,
            }),
            algo: None,
        })
    }

    #[test]
    fn int8_copies_take_a_free_slot_and_hold_it_to_their_last_reader() {
        let copies = |steps: &[Step], scales: &[f32]| {
            let own = vec![true; steps.len()];
            let scales: Vec<Option<f32>> = scales.iter().map(|&s| Some(s)).collect();
            copies_beside_chains(steps, &own, &scales)
        };
        // a block's output (100) read as input by the next product and as its residual; that
        // product's output (300) the same: each copy frees slot 0 before the next needs it,
        // and the second's writer reads the first copy.
        let steps = [
            product_at(0, 100, None),
            product_at(100, 200, None),
            product_at(200, 300, Some(100)),
            product_at(300, 400, None),
            product_at(400, 500, Some(300)),
        ];
        assert_eq!(
            copies(&steps, &[0.5; 5]),
            [(0, vec![1], 0), (2, vec![3], 0)]
        );
        // Three values written before any is read: two slots, so the third is not copied.
        let steps = [
            product_at(0, 100, None),
            product_at(0, 300, None),
            product_at(0, 800, None),
            product_at(100, 400, None),
            product_at(300, 500, None),
            product_at(800, 900, None),
            product_at(400, 600, Some(100)),
            product_at(500, 700, Some(300)),
            product_at(900, 1000, Some(800)),
        ];
        assert_eq!(
            copies(&steps, &[0.5; 9]),
            [(0, vec![3], 0), (1, vec![4], 1)]
        );
        // Two readers at different scales: the copy is at the first's, for it alone.
        let steps = [
            product_at(0, 100, None),
            product_at(100, 200, None),
            product_at(100, 300, None),
            product_at(200, 400, Some(100)),
        ];
        assert_eq!(copies(&steps, &[0.5, 0.5, 0.25, 0.5]), [(0, vec![1], 0)]);
        assert_eq!(copies(&steps, &[0.5; 4]), [(0, vec![1, 2], 0)]);
    }

    #[test]
    fn large_weights_are_rounded_in_parts_as_in_one() {
        // 1024 × 1024 weights: past the size from which the channels are spread over threads.
        let (k, n) = (1024, 1024);
        let mut g = product(true, QuantFormat::Fp8);
        (g.hwc[2], g.n) = (k, n);
        let weights: Vec<f32> = (0..1 + k * n)
            .map(|i| ((i * 7919) % 2003) as f32 - 1001.0)
            .collect();
        let bytes: Vec<u8> = weights.iter().flat_map(|v| v.to_le_bytes()).collect();
        let scales: Vec<f32> = (0..n).map(|j| (1 + j % 5) as f32 / 448.0).collect();
        let got = g.rounded_weights(&bytes, DType::F32, &scales);
        let f = QuantFormat::Fp8;
        let want: Vec<u8> = (0..n * k)
            .map(|i| f.encode(f.round(weights[1 + i] / scales[i / k])))
            .collect();
        assert!(got == want, "the rows rounded in parts differ");
    }
}
