// SPDX-License-Identifier: MPL-2.0
//! Preparing a plan: each step's library descriptors, and for each convolution not tuned yet
//! the fastest of cuDNN's algorithms, timed on its real shapes as it will run.

use std::ffi::c_void;

use cudarc::cudnn::sys as dnn;
use cudarc::driver::sys as drv;

use super::cublaslt::{GemmDescs, GemmShape};
use super::cudnn::{self, ConvDescs};
use super::steps::EightBit;
use super::{BatchPlan, Prepared, Runtime};
use crate::error::{Error, Result};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{ConvStep, GemmStep, Loc, Plan, Step, Tuned};

impl Runtime {
    /// The descriptors of every step of `plan`; convolutions without an algorithm are tuned.
    pub(super) fn prepare(&mut self, mut plan: Plan) -> Result<BatchPlan> {
        let mut prepared = Vec::with_capacity(plan.steps.len());
        for step in &mut plan.steps {
            let eight_bit = match step {
                Step::Gemm(g) => EightBit::of_gemm(g),
                Step::Conv(c) => EightBit::of_conv(c),
                _ => None,
            };
            if let Some(e) = eight_bit {
                prepared.push(self.prepare_eight_bit(&e)?);
                continue;
            }
            prepared.push(match step {
                Step::Conv(c) => {
                    let descs = ConvDescs::new(c, self.writes(c.y).1)?;
                    if c.algo.is_none() {
                        c.algo = Some(self.tune(c, &descs)?);
                    }
                    Prepared::Conv(Box::new(descs))
                }
                Step::Gemm(GemmStep {
                    batch,
                    rows,
                    n,
                    k,
                    x_batch,
                    bias,
                    act,
                    w_transposed,
                    y,
                    y_batch,
                    ..
                }) => {
                    let shape = GemmShape {
                        batch: *batch,
                        rows: *rows,
                        n: *n,
                        k: *k,
                        x_batch: *x_batch,
                        y_batch: *y_batch,
                        w_transposed: *w_transposed,
                        y_f32: matches!(y, Loc::Output(_)),
                    };
                    let bias = bias.map(|b| self.ptr(b));
                    Prepared::Gemm(Box::new(GemmDescs::new(
                        &self.cublaslt,
                        self.writes(*y).1,
                        &shape,
                        bias,
                        *act,
                        self.lt_workspace.len(),
                    )?))
                }
                _ => Prepared::None,
            });
        }
        Ok(BatchPlan {
            plan,
            prepared,
            graph: None,
        })
    }

    /// The product's descriptors of the 8-bit step `e`, and where its rounded weights are.
    fn prepare_eight_bit(&self, e: &EightBit) -> Result<Prepared> {
        let format = e.quant.format;
        let weights = (self.eight_bit_weights.iter())
            .find(|(key, _)| *key == (e.w, format))
            .map(|(_, w)| self.ptr_u8(w))
            .ok_or(Error::Plan("an 8-bit step without its rounded weights"))?;
        let shape = [e.rows, e.summed(), e.n];
        let descs = GemmDescs::eight_bit(&self.cublaslt, format, shape, self.lt_workspace.len())?;
        Ok(Prepared::EightBit(Box::new(descs), weights))
    }

    /// Times cuDNN's algorithms for `c` on its real shapes and keeps the fastest that fits
    /// the workspace. A search that finds none is tried again a few times: with other
    /// engines busy on the GPU, one was seen to come back empty where the next finds
    /// several; the error says what each search found.
    fn tune(&mut self, c: &ConvStep, d: &ConvDescs) -> Result<Tuned> {
        const SEARCHES: u64 = 3;
        let mut found = Vec::new();
        for search in 1..=SEARCHES {
            match self.search(c, d)? {
                Ok(tuned) => return Ok(tuned),
                Err(why) => found.push(format!("search {search}: {why}")),
            }
            std::thread::sleep(std::time::Duration::from_millis(20 * search));
        }
        Err(Error::NoConvAlgorithm(found.join("; ")))
    }

    /// One search for `tune`: the fastest algorithm, or what the search found instead.
    fn search(
        &mut self,
        c: &ConvStep,
        d: &ConvDescs,
    ) -> Result<std::result::Result<Tuned, String>> {
        let mut perf: [dnn::cudnnConvolutionFwdAlgoPerf_t; 8] =
            // SAFETY: a plain C struct for cuDNN to fill.
            unsafe { std::mem::zeroed() };
        let mut returned = 0;
        let ws = self.ptr_u8(&self.workspace);
        // SAFETY: the pointers are live device buffers of the sizes the descriptors state.
        unsafe {
            cudnn::check(
                dnn::cudnnFindConvolutionForwardAlgorithmEx(
                    self.cudnn.raw(),
                    d.x.raw(),
                    self.ptr(c.x) as *const c_void,
                    d.w.raw(),
                    self.ptr(c.weight) as *const c_void,
                    d.conv.raw(),
                    d.y.raw(),
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
        let offered = &perf[..returned as usize];
        let candidates = offered
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
        let mut refused = Vec::new();
        for tuned in candidates {
            // The fused call refuses some algorithms and activations: those are skipped.
            let ms = match self.time_conv(c, d, &tuned) {
                Ok(ms) => ms,
                Err(e) => {
                    refused.push(format!(
                        "algorithm {} (fused: {}): {e}",
                        tuned.algo, tuned.fused
                    ));
                    continue;
                }
            };
            if best.is_none_or(|(fastest, _)| ms < fastest) {
                best = Some((ms, tuned));
            }
        }
        Ok(best.map(|(_, tuned)| tuned).ok_or_else(|| {
            let offered: Vec<String> = offered
                .iter()
                .map(|p| format!("{} {:?} {} B", p.algo as i32, p.status, p.memory))
                .collect();
            format!(
                "offered [{}] for a workspace of {} B; timing refused [{}]",
                offered.join(", "),
                self.workspace.len(),
                refused.join(", ")
            )
        }))
    }

    /// GPU milliseconds of five runs of the convolution `c` as `tuned` says, after one to
    /// warm up.
    fn time_conv(&self, c: &ConvStep, d: &ConvDescs, tuned: &Tuned) -> Result<f32> {
        let timing = Some(drv::CUevent_flags::CU_EVENT_DEFAULT);
        let ran = self.conv(c, d, tuned);
        self.stream
            .synchronize()
            .map_err(Error::driver("synchronize"))?;
        ran?;
        let start = self
            .stream
            .record_event(timing)
            .map_err(Error::driver("event"))?;
        for _ in 0..5 {
            self.conv(c, d, tuned)?;
        }
        let end = self
            .stream
            .record_event(timing)
            .map_err(Error::driver("event"))?;
        start.elapsed_ms(&end).map_err(Error::driver("event"))
    }
}
