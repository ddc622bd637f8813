// SPDX-License-Identifier: MPL-2.0
//! Each plan captured as a CUDA graph, so that a batch is one launch.

use cudarc::driver::{CudaGraph, sys as drv};

use super::Runtime;
use crate::error::{Error, Result};

/// Captures tried before an invalidated one is an error.
const CAPTURE_TRIES: u32 = 5;

impl Runtime {
    /// Runs plan `i` once (which also loads cuDNN's kernels), then captures it as a graph.
    ///
    /// Engines set up together take turns (`device::setup_lock`), but a thread of the same
    /// context can still invalidate a capture (an engine dropped elsewhere frees its
    /// memory, an upstream decoder sharing our context synchronises it).
    pub(super) fn capture(&mut self, i: usize) -> Result<()> {
        self.enqueue(i)?;
        self.stream
            .synchronize()
            .map_err(Error::driver("warm-up run"))?;
        let graph = self.record(|| self.enqueue(i))?;
        graph.upload().map_err(Error::driver("graph upload"))?;
        self.plans[i].graph = Some(graph);
        Ok(())
    }

    /// What `enqueue` enqueues, captured as a graph. A capture that another thread of the
    /// context invalidated is tried again a few times.
    pub(super) fn record(&self, enqueue: impl Fn() -> Result<()>) -> Result<CudaGraph> {
        let mut tries = 1;
        loop {
            match self.record_once(&enqueue) {
                Err(e) if e.is_capture_invalidated() && tries < CAPTURE_TRIES => {
                    log::debug!(target: trtclassify_compiler::LOG_TARGET,
                        "a capture was invalidated by another thread ({tries} of {CAPTURE_TRIES})");
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(10 * tries as u64));
                }
                result => return result,
            }
        }
    }

    fn record_once(&self, enqueue: &impl Fn() -> Result<()>) -> Result<CudaGraph> {
        self.stream
            .begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(Error::driver("stream capture"))?;
        let enqueued = enqueue();
        let graph = self
            .stream
            .end_capture(drv::CUgraphInstantiate_flags(0))
            .map_err(Error::driver("graph capture"));
        // An invalidated capture also fails the launches after it (cuDNN's in its own
        // words), so the capture's error is the one that says what happened.
        let graph = match (graph, enqueued) {
            (Err(e), _) if e.is_capture_invalidated() => return Err(e),
            (graph, enqueued) => {
                enqueued?;
                graph?
            }
        };
        graph.ok_or(Error::Plan("the captured graph is empty"))
    }
}
