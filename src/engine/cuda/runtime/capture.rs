// SPDX-License-Identifier: MPL-2.0
//! Each plan captured as a CUDA graph, so that a batch is one launch.

use cudarc::driver::sys as drv;

use super::Runtime;
use crate::engine::cuda::error::{Error, Result};

impl Runtime {
    /// Runs plan `i` once (which also loads cuDNN's kernels), then captures it as a graph.
    pub(super) fn capture(&mut self, i: usize) -> Result<()> {
        self.enqueue(i)?;
        self.stream
            .synchronize()
            .map_err(Error::driver("warm-up run"))?;
        self.stream
            .begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(Error::driver("stream capture"))?;
        let enqueued = self.enqueue(i);
        let graph = self
            .stream
            .end_capture(drv::CUgraphInstantiate_flags(0))
            .map_err(Error::driver("graph capture"));
        enqueued?;
        let graph = graph?.ok_or(Error::Plan("the captured graph is empty"))?;
        graph.upload().map_err(Error::driver("graph upload"))?;
        self.plans[i].graph = Some(graph);
        Ok(())
    }
}
