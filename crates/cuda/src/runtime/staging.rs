// SPDX-License-Identifier: MPL-2.0
//! Frames into the model input, a slot per frame, asynchronously: raw frames from host
//! memory (staged in page-locked memory, uploaded or read in place, preprocessed on the
//! GPU), frames already in GPU memory (of our CUDA context or copied from another), and
//! frames preprocessed on the host.
//!
//! The GPU preprocessing of frames and crops is queued and launched for up to
//! `GROUP_JOBS` of them at once (one launch of each pass): with regions of interest a
//! frame's crops, eight or more, would otherwise cost two launches each. Groups are small
//! enough that the preprocessing still runs while frames arrive, not all at the batch's end.

use cudarc::driver::{
    CudaEvent, CudaSlice, DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg, sys as drv,
};

use super::kernels::{grid, kernel_set};
use super::{HostStaging, Runtime};
use crate::abi::{self, PreJob};
use crate::error::{Error, Result};
use crate::frames::{Pre, RawFrame};

/// The most frames or crops one preprocessing launch takes.
const GROUP_JOBS: usize = 32;
/// The first-pass rows (f32 values) after which queued jobs are launched: 8 MiB, about
/// three 1080p frames or a few dozen crops; the rows buffer holds a group's.
const GROUP_ROWS: usize = 2 << 20;

/// Preprocessing waiting for its launch, and the buffers a launch uses.
#[derive(Default)]
pub(super) struct PreQueue {
    /// The queued jobs and the slot each writes.
    jobs: Vec<(usize, PreJob)>,
    /// The jobs of a launch, in page-locked memory for their upload (`JOB_ARRAYS` used in
    /// turn, each with an event recorded behind its upload, waited for before it is written
    /// again), and on the device (as many, one after the other); the array the next launch
    /// uses.
    host: Vec<(PinnedHostSlice<PreJob>, CudaEvent)>,
    device: Option<CudaSlice<PreJob>>,
    next: usize,
    /// The first pass's output of a launch's jobs, one after the other; sized for the
    /// largest group seen.
    rows: Option<CudaSlice<f32>>,
}

/// Job arrays a launch may use in turn: a launch queued behind batches in flight keeps its
/// array until they are done, and the next launches must not wait for that.
const JOB_ARRAYS: usize = 8;

/// The f32 values of a job's first pass: its crop's rows at the destination's width.
fn rows_len(pre: &Pre) -> usize {
    pre.crop[3].max(0) as usize * pre.dst[2].max(1) as usize * 3
}

kernel_set! {
    /// preprocess.cu's kernels: the two passes of `launch_preprocess`.
    PreprocessKernels {
        /// Pass 1: the crop's rows filtered to the destination's width.
        preprocess_rows: "preprocess_rows",
        /// Pass 2: each pixel of the input filtered from those rows, normalised.
        preprocess_cols: "preprocess_cols",
    }
}

impl Runtime {
    /// Uploads one raw frame (its planes, one after the other) and preprocesses it on the GPU
    /// into frames `slot..slot + pres.len()` of the input, one per crop's parameters,
    /// asynchronously: the planes are copied to page-locked staging first, so the caller may
    /// release the frame on return, and the copy and the kernels run while the host waits for
    /// the next frame. The frame is uploaded once for all its crops.
    pub fn stage_frame(&mut self, slot: usize, pres: &[Pre], planes: &[&[u8]]) -> Result<()> {
        if pres.is_empty() {
            return Ok(());
        }
        self.check_slot(slot + pres.len() - 1)?;
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("context"))?;
        self.restage_from(slot);
        let len: usize = planes.iter().map(|p| p.len()).sum();
        let capacity = self.raw_host.as_ref().map_or(0, |r| r.len());
        let first = self.host_staging != HostStaging::InUse;
        if first || self.raw_used + len > capacity {
            // The staging is reused from its start once the frames in it are on the GPU and
            // preprocessed: for a batch's first frame staged here, the last launched batch's
            // (its graph may still run); mid-batch (larger frames than the staging was made
            // for), this batch's.
            match first {
                true => self.staging_free()?,
                false => self.settle()?,
            }
            self.raw_used = 0;
            let want = len * self.max_batch();
            if capacity < want {
                // SAFETY: each range is written before the copy that reads it.
                self.raw_host = Some(
                    unsafe { self.ctx.alloc_pinned::<u8>(want) }
                        .map_err(Error::driver("pinned allocation"))?,
                );
                if !self.zero_copy {
                    self.raw = Some(
                        // SAFETY: each range is written by an upload before a kernel reads it.
                        unsafe { self.stream.alloc::<u8>(want) }
                            .map_err(Error::driver("allocation"))?,
                    );
                }
            }
        }
        let host = self
            .raw_host
            .as_mut()
            .expect("allocated above")
            .as_mut_slice()
            .map_err(Error::driver("staging"))?;
        self.host_staging = HostStaging::InUse;
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
                .map_err(Error::driver("frame upload"))?;
                raw_dev
            }
        };
        self.raw_used = end;
        for (i, pre) in pres.iter().enumerate() {
            self.queue_preprocess(slot + i, pre, raw_dev + start as u64)?;
        }
        Ok(())
    }

    /// Preprocesses one frame that is already in GPU memory (GStreamer's CUDA memory, at
    /// device address `src`, in CUDA context `context`) into frame `slot` of the input,
    /// asynchronously (queued: see the module's doc). A frame of our own context is read
    /// where it is; one of another context is first copied into ours on the GPU. The caller
    /// keeps the frame's memory untouched until the batch's scores are collected (or the
    /// batches in flight forgotten); after an error, the GPU no longer reads it.
    pub fn stage_device_frame(
        &mut self,
        slot: usize,
        pre: &Pre,
        src: u64,
        context: usize,
    ) -> Result<()> {
        let staged = self.queue_device_frame(slot, pre, src, context);
        if staged.is_err() {
            // The caller releases a frame it could not stage, whose other crops, staged
            // before this one, work already queued may still read. A refusal is rare: wait.
            let _ = self.stream.synchronize();
        }
        staged
    }

    fn queue_device_frame(
        &mut self,
        slot: usize,
        pre: &Pre,
        src: u64,
        context: usize,
    ) -> Result<()> {
        self.check_slot(slot)?;
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("context"))?;
        self.restage_from(slot);
        let src = if context == self.context_handle() {
            src
        } else {
            self.copy_from_peer(slot, pre, src, context)?
        };
        self.queue_preprocess(slot, pre, src)
    }

    /// The CUDA context (`CUcontext`) the runtime runs in.
    pub fn context_handle(&self) -> usize {
        self.ctx.cu_ctx() as usize
    }

    /// Copies a frame of another CUDA context into slot `slot` of `peer`; returns its address.
    fn copy_from_peer(&mut self, slot: usize, pre: &Pre, src: u64, context: usize) -> Result<u64> {
        let len = pre.extent();
        if self
            .peer
            .as_ref()
            .is_none_or(|(_, per_slot)| *per_slot < len)
        {
            // Earlier slots' kernels, queued or running, may still read the old buffer.
            self.settle()?;
            let buffer =
                // SAFETY: each slot is written by the copy below before a kernel reads it.
                unsafe { self.stream.alloc::<u8>(len * self.max_batch()) }
                    .map_err(Error::driver("allocation"))?;
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
        .map_err(Error::driver("copy from another CUDA context"))?;
        Ok(dst)
    }

    /// Queues the preprocessing of a frame at device address `src` into `slot`; launches the
    /// queue once it holds a group.
    pub(super) fn queue_preprocess(&mut self, slot: usize, pre: &Pre, src: u64) -> Result<()> {
        let pixels = (pre.out_w * pre.out_h) as usize;
        let out = self.input.device_ptr(&self.stream).0 + (slot * pixels * 3 * 4) as u64;
        let job = PreJob {
            pre: *pre,
            src,
            out,
            cols: columns_per_block(pre),
            ..Default::default()
        };
        let jobs = &mut self.pre.jobs;
        jobs.push((slot, job));
        let rows: usize = jobs.iter().map(|(_, j)| rows_len(&j.pre)).sum();
        if jobs.len() >= GROUP_JOBS || rows >= GROUP_ROWS {
            self.flush_preprocess()?;
        }
        Ok(())
    }

    /// Forgets queued preprocessing of slots from `slot` on: a batch staged again from there
    /// (after a refused push, or a discarded batch) writes them anew.
    pub(super) fn restage_from(&mut self, slot: usize) {
        self.pre.jobs.retain(|&(s, _)| s < slot);
    }

    /// Launches the queued preprocessing: both passes, once each, for all its jobs.
    pub(super) fn flush_preprocess(&mut self) -> Result<()> {
        let n = self.pre.jobs.len();
        if n == 0 {
            return Ok(());
        }
        let total: usize = self.pre.jobs.iter().map(|(_, j)| rows_len(&j.pre)).sum();
        if self.pre.rows.as_ref().is_none_or(|r| r.len() < total) {
            // The last launch may still use the old buffer.
            self.stream.synchronize().map_err(Error::driver("sync"))?;
            self.pre.rows = Some(
                // SAFETY: the first pass writes every value the second reads.
                unsafe { self.stream.alloc::<f32>(total) }.map_err(Error::driver("allocation"))?,
            );
        }
        if self.pre.device.is_none() {
            self.pre.host = (0..JOB_ARRAYS)
                .map(|_| {
                    // SAFETY: `PreJob` is plain data, valid as zeros; each is written before
                    // use.
                    let jobs = unsafe { self.ctx.alloc_pinned::<PreJob>(GROUP_JOBS) }?;
                    Ok((jobs, self.ctx.new_event(None)?))
                })
                .collect::<std::result::Result<_, _>>()
                .map_err(Error::driver("pinned allocation"))?;
            self.pre.device = Some(
                self.stream
                    .alloc_zeros::<PreJob>(GROUP_JOBS * JOB_ARRAYS)
                    .map_err(Error::driver("allocation"))?,
            );
        }
        let PreQueue {
            jobs,
            host,
            device,
            rows,
            next,
        } = &mut self.pre;
        let k = std::mem::replace(next, (*next + 1) % JOB_ARRAYS);
        let (host, uploaded) = &mut host[k];
        let mut device = device
            .as_mut()
            .expect("made above")
            .slice_mut(k * GROUP_JOBS..(k + 1) * GROUP_JOBS);
        let mut at = rows
            .as_ref()
            .expect("made above")
            .device_ptr(&self.stream)
            .0;
        // This array's last upload is done unless `JOB_ARRAYS` launches are queued behind
        // batches in flight.
        uploaded.synchronize().map_err(Error::driver("sync"))?;
        let staged = host.as_mut_slice().map_err(Error::driver("staging"))?;
        for (to, (_, job)) in staged.iter_mut().zip(jobs.iter()) {
            *to = PreJob { rows: at, ..*job };
            at += (rows_len(&job.pre) * 4) as u64;
        }
        self.stream
            .memcpy_htod(host, &mut device)
            .map_err(Error::driver("upload"))?;
        uploaded
            .record(&self.stream)
            .map_err(Error::driver("event record"))?;
        // The grid fits the widest and tallest job; other jobs' blocks beyond theirs return.
        let pres = || jobs.iter().map(|(_, j)| j);
        let col_blocks = pres()
            .map(|j| (j.pre.dst[2].max(1) as u32).div_ceil(j.cols.max(1) as u32))
            .max();
        let crop_rows = pres().map(|j| j.pre.crop[3]).max();
        let pixels = pres().map(|j| (j.pre.out_w * j.pre.out_h) as usize).max();
        let jobs_ptr = device.device_ptr(&self.stream).0;
        let kernels = &self.kernels.preprocess;
        let mut l = self.stream.launch_builder(&kernels.preprocess_rows);
        l.arg(&jobs_ptr);
        let cfg = LaunchConfig {
            grid_dim: (
                col_blocks.unwrap_or(1),
                crop_rows.unwrap_or(1).clamp(1, 65_535) as u32,
                n as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the argument matches the kernel's signature (preprocess.cu): `n` jobs, each
        // with its own rows in `rows`, its frame and its slot of the input.
        unsafe { l.launch(cfg) }.map_err(Error::driver("kernel launch"))?;
        let mut l = self.stream.launch_builder(&kernels.preprocess_cols);
        l.arg(&jobs_ptr);
        let mut cfg = grid(self.sm_count, pixels.unwrap_or(1));
        cfg.grid_dim.2 = n as u32;
        // SAFETY: as above; one thread a pixel of each job's frame of the input.
        unsafe { l.launch(cfg) }.map_err(Error::driver("kernel launch"))?;
        jobs.clear();
        Ok(())
    }

    /// Waits until the page-locked staging may be written from its start: after a launch,
    /// until that batch's uploads and preprocessing have read it (its graph may still run).
    /// While a batch is being staged, its own uploads may still read it: the caller knows
    /// which parts it may write.
    pub(super) fn staging_free(&mut self) -> Result<()> {
        if self.host_staging == HostStaging::AfterLaunch {
            if let Some(read) = &self.staged_read {
                read.synchronize().map_err(Error::driver("sync"))?;
            }
            self.host_staging = HostStaging::Free;
        }
        Ok(())
    }

    /// Launches the queued preprocessing and waits for the stream: the staging buffers may
    /// then be reused.
    fn settle(&mut self) -> Result<()> {
        self.flush_preprocess()?;
        self.stream.synchronize().map_err(Error::driver("sync"))
    }

    /// Uploads one frame preprocessed on the host (f32, the model's input layout) into
    /// frame `slot` of the input, asynchronously.
    pub fn stage_input(&mut self, slot: usize, frame: &[f32]) -> Result<()> {
        self.check_slot(slot)?;
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("context"))?;
        self.restage_from(slot);
        // Each slot is written once per batch, at its own place; the first write after a
        // launch waits until that batch's uploads have read theirs.
        if self.host_staging != HostStaging::InUse {
            self.staging_free()?;
            self.host_staging = HostStaging::InUse;
        }
        let input_ptr = self.input.device_ptr(&self.stream).0;
        let host_in = self
            .host_in
            .as_mut_slice()
            .map_err(Error::driver("staging"))?;
        let range = slot * frame.len()..(slot + 1) * frame.len();
        let host = host_in.get_mut(range.clone()).ok_or(Error::FrameTooLarge)?;
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
        .map_err(Error::driver("upload"))
    }

    /// `Ok` where `slot` lies within the largest batch.
    fn check_slot(&self, slot: usize) -> Result<()> {
        match slot < self.max_batch() {
            true => Ok(()),
            false => Err(Error::SlotOutOfRange {
                slot,
                max: self.max_batch(),
            }),
        }
    }

    /// The model input that staging `frames` makes; for tests.
    pub fn preprocess_frames(&mut self, frames: &[RawFrame]) -> Result<Vec<f32>> {
        for (slot, (pre, planes)) in frames.iter().enumerate() {
            self.stage_frame(slot, std::slice::from_ref(pre), planes)?;
        }
        self.flush_preprocess()?;
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
        .map_err(Error::driver("download"))?;
        self.stream.synchronize().map_err(Error::driver("sync"))?;
        Ok(out)
    }
}

/// How many destination columns one block of `preprocess_rows` filters: as many as read at
/// most `PRE_SPAN` (preprocess.cu) source pixels, which the block converts once and keeps.
fn columns_per_block(pre: &Pre) -> i32 {
    const PRE_SPAN: f32 = abi::PRE_SPAN as f32;
    let scale = pre.crop[2].max(1) as f32 / pre.dst[2].max(1) as f32;
    let support = scale.max(1.0);
    // Columns c0..c0 + n read about (n − 1)·scale + 2·support + 1 pixels.
    let n = ((PRE_SPAN - 2.0 - 2.0 * support) / scale).floor() as i32 + 1;
    n.clamp(1, pre.dst[2].max(1))
}

#[cfg(test)]
mod tests {
    use super::{Pre, columns_per_block};

    /// The source pixels a block of `preprocess_rows` reads, with the kernel's `taps`, fit
    /// the pixels it keeps (`PRE_SPAN`), so each is converted once; rows up to 8K wide.
    #[test]
    fn a_preprocessing_block_reads_what_it_keeps() {
        // preprocess.cu's `taps`, in the same f32 arithmetic: (first, count).
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
