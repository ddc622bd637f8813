// SPDX-License-Identifier: MPL-2.0
//! Timings for the bench binary (`trtclassify-engine`): graph replays back to back, single
//! replays, each step of a plan, and the GPU preprocessing.

use cudarc::driver::{CudaEvent, CudaGraph, DevicePtr, sys as drv};

use super::Runtime;
use crate::error::{Error, Result};
use crate::frames::Pre;

impl Runtime {
    /// The index of the plan of batch size `batch`.
    fn plan_index(&self, batch: usize) -> Result<usize> {
        self.plans
            .iter()
            .position(|p| p.plan.batch == batch)
            .ok_or(Error::NoPlanOfBatch(batch))
    }

    /// The captured graph of the plan of batch size `batch`.
    fn graph(&self, batch: usize) -> Result<&CudaGraph> {
        self.plans[self.plan_index(batch)?]
            .graph
            .as_ref()
            .ok_or(Error::Plan("no graph"))
    }

    /// Seconds per replay of the graph of `batch` when `runs` are queued back to back: the
    /// throughput; for benchmarks.
    pub fn replay(&self, batch: usize, runs: usize) -> Result<f64> {
        let graph = self.graph(batch)?;
        self.stream.synchronize().map_err(Error::driver("sync"))?;
        let start = std::time::Instant::now();
        for _ in 0..runs {
            graph.launch().map_err(Error::driver("graph launch"))?;
        }
        self.stream.synchronize().map_err(Error::driver("sync"))?;
        Ok(start.elapsed().as_secs_f64() / runs as f64)
    }

    /// Seconds from launch to completion of each of `runs` single replays: the latency.
    pub fn latencies(&self, batch: usize, runs: usize) -> Result<Vec<f64>> {
        let graph = self.graph(batch)?;
        (0..runs)
            .map(|_| {
                let start = std::time::Instant::now();
                graph.launch().map_err(Error::driver("graph launch"))?;
                self.stream.synchronize().map_err(Error::driver("sync"))?;
                Ok(start.elapsed().as_secs_f64())
            })
            .collect()
    }

    /// Each step of the plan of `batch` (described, with its ONNX node) and its GPU
    /// milliseconds, a median of `runs` replays of the plan captured with an event between
    /// its steps. Timed inside a graph, as the plan runs, each step's time includes the gap
    /// before it: launched one by one, a small batch's steps would time the host's calls
    /// instead, far longer than the steps themselves.
    pub fn profile(&self, batch: usize, runs: usize) -> Result<Vec<(String, f64)>> {
        let bp = &self.plans[self.plan_index(batch)?];
        let events = (0..=bp.plan.steps.len())
            .map(|_| {
                self.ctx
                    .new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(Error::driver("event"))
            })
            .collect::<Result<Vec<_>>>()?;
        // Captured as event nodes of the graph (an ordinary record would only order the
        // capture), so that each replay records them.
        let record = |event: &CudaEvent| {
            // SAFETY: a live event and stream of this context.
            unsafe {
                drv::cuEventRecordWithFlags(
                    event.cu_event(),
                    self.stream.cu_stream(),
                    drv::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32,
                )
            }
            .result()
            .map_err(Error::driver("event"))
        };
        let graph = self.record(|| {
            record(&events[0])?;
            for ((step, prepared), event) in
                bp.plan.steps.iter().zip(&bp.prepared).zip(&events[1..])
            {
                self.step(step, prepared)?;
                record(event)?;
            }
            Ok(())
        })?;
        let mut times = vec![Vec::new(); bp.plan.steps.len()];
        for _ in 0..runs {
            graph.launch().map_err(Error::driver("graph launch"))?;
            self.stream.synchronize().map_err(Error::driver("sync"))?;
            for (t, pair) in times.iter_mut().zip(events.windows(2)) {
                t.push(
                    pair[0]
                        .elapsed_ms(&pair[1])
                        .map_err(Error::driver("event"))? as f64,
                );
            }
        }
        Ok(bp
            .plan
            .steps
            .iter()
            .zip(&bp.plan.origins)
            .zip(times)
            .map(|((step, node), mut t)| {
                t.sort_by(f64::total_cmp);
                (format!("{} ({node})", step.describe()), t[t.len() / 2])
            })
            .collect())
    }

    /// The mean time in milliseconds of preprocessing one frame already in GPU memory, over
    /// `runs` full batches queued back to back; for benchmarks.
    pub fn time_device_preprocess(&mut self, pre: &Pre, runs: usize) -> Result<f64> {
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("context"))?;
        let frame = self
            .stream
            .alloc_zeros::<u8>(pre.extent())
            .map_err(Error::driver("allocation"))?;
        let src = frame.device_ptr(&self.stream).0;
        let batch = self.max_batch();
        self.queue_preprocess(0, pre, src)?;
        self.flush_preprocess()?;
        self.stream.synchronize().map_err(Error::driver("sync"))?;
        let started = std::time::Instant::now();
        for _ in 0..runs {
            for slot in 0..batch {
                self.queue_preprocess(slot, pre, src)?;
            }
            self.flush_preprocess()?;
        }
        self.stream.synchronize().map_err(Error::driver("sync"))?;
        Ok(started.elapsed().as_secs_f64() * 1e3 / (runs * batch) as f64)
    }
}
