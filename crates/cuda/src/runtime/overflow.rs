// SPDX-License-Identifier: MPL-2.0
//! A plan run step by step on the GPU, each step's output read back, for
//! `compiler::overflow`: where the values leave fp16's range. The build runs it on sample
//! frames before it trusts an fp16 engine, and the engine runs it once on the batch whose
//! scores first came out not finite, so that both can name the step and the ONNX node
//! instead of leaving a user with empty results.

use cudarc::driver::DevicePtr;

use super::Runtime;
use crate::error::{Error, Result};
use trtclassify_compiler::overflow::{Overflow, first_overflow};
use trtclassify_compiler::plan::{DType, Loc};

impl Runtime {
    /// Runs the plan that holds `frames` frames on the input buffer as it is, one step at a
    /// time, and returns the first step that writes a value that is not finite or whose
    /// magnitude is above `limit`.
    pub fn first_overflow(&mut self, frames: usize, limit: f32) -> Result<Option<Overflow>> {
        let i = self.plan_holding(frames)?;
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("context"))?;
        // Memory this run has not written yet holds what earlier runs left there, perhaps the
        // very overflow looked for; a step's span may include such memory between the
        // elements it writes.
        self.stream
            .memset_zeros(&mut self.arena)
            .map_err(Error::driver("memset"))?;
        self.stream
            .memset_zeros(&mut self.wide_arena)
            .map_err(Error::driver("memset"))?;
        let bp = &self.plans[i];
        first_overflow(&bp.plan, limit, |s| {
            let step = &bp.plan.steps[s];
            self.step_alone(step, &bp.prepared[s])?;
            let span = step.written();
            self.read(span.loc, span.start, span.end)
        })
    }

    /// Elements `start..end` of the buffer from `loc`, as f32, once the stream has written
    /// them.
    fn read(&self, loc: Loc, start: i128, end: i128) -> Result<Vec<f32>> {
        let len = usize::try_from(end - start).map_err(|_| Error::Plan("a negative span"))?;
        let dtype = match loc {
            Loc::Input(_) | Loc::Output(_) | Loc::Wide(_) => DType::F32,
            Loc::Weight { index, .. } => self.weight_types[index],
            Loc::Arena(_) | Loc::Temp { .. } => self.dtype,
        };
        let (size, half) = (dtype.size(), dtype == DType::F16);
        let first = self.ptr(loc) as i128 + start * size as i128;
        let first = u64::try_from(first).map_err(|_| Error::Plan("a span before its buffer"))?;
        let mut bytes = vec![0u8; len * size];
        // SAFETY: the span is inside the buffer (the plan passed `check`), and `bytes`
        // outlives the synchronisation below.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut bytes, first, self.stream.cu_stream())
        }
        .map_err(Error::driver("download"))?;
        self.stream.synchronize().map_err(Error::driver("sync"))?;
        let values = match half {
            true => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            false => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        };
        Ok(values)
    }

    /// Copies `input` (frames in the model's layout, f32) into the input buffer, for runs
    /// that do not go through the captured graphs.
    pub fn upload(&mut self, input: &[f32]) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("context"))?;
        if input.len() > self.input.len() {
            return Err(Error::Plan("more input than the input buffer holds"));
        }
        let ptr = self.input.device_ptr(&self.stream).0;
        // SAFETY: `input` fits the device buffer and outlives the synchronisation below.
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, input, self.stream.cu_stream()) }
            .map_err(Error::driver("upload"))?;
        self.stream.synchronize().map_err(Error::driver("sync"))
    }
}
