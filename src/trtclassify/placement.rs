// SPDX-License-Identifier: MPL-2.0
//! Which GPU an element's engine runs on when `gpu-id` is -1 (automatic, the default).
//!
//! The frames decide where they can: frames decoded on a GPU are classified on that GPU, so
//! that they never cross between GPUs and a decoder keeps the device it was made for (an
//! NVDEC decoder of GPU 1, `nvh264device1dec`, refuses a context of GPU 0). The element learns
//! the frames' GPU from the decoder upstream before the frames flow (its `cuda-device-id`
//! property, or the CUDA context it answers a query with), or failing that from the first
//! frame in CUDA memory (a decoder that `decodebin` plugs in later): the engine then moves to
//! that GPU as in a live update. Frames in system memory go to the GPU with the fewest
//! streams of the process, so that cameras spread over the GPUs, elements on one GPU sharing
//! its engines.

use std::collections::BTreeMap;

/// `gpu-id`: the GPU the frames are on, else the least loaded.
pub(crate) const AUTOMATIC: i32 = -1;

/// The GPU for an element with `gpu-id` set to `gpu_id`, whose frames are on GPU `frames_on`
/// (`None`: in system memory, or not known), on a machine with `gpus` GPUs whose engines
/// serve `streams` streams (by GPU).
pub(crate) fn choose(
    gpu_id: i32,
    frames_on: Option<u32>,
    gpus: usize,
    streams: &BTreeMap<u32, usize>,
) -> u32 {
    if let Ok(gpu) = u32::try_from(gpu_id) {
        return gpu;
    }
    let gpus = u32::try_from(gpus).unwrap_or(u32::MAX).max(1);
    if let Some(gpu) = frames_on.filter(|&g| g < gpus) {
        return gpu;
    }
    (0..gpus)
        .min_by_key(|gpu| (streams.get(gpu).copied().unwrap_or(0), *gpu))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_set_by_hand_is_kept() {
        let busy = BTreeMap::from([(2, 40)]);
        assert_eq!(choose(2, Some(0), 4, &busy), 2);
        // Even one this machine does not have: the engine says so when it is built.
        assert_eq!(choose(7, None, 1, &busy), 7);
    }

    #[test]
    fn frames_on_a_gpu_are_classified_there() {
        let streams = BTreeMap::from([(0, 0), (1, 30)]);
        assert_eq!(choose(AUTOMATIC, Some(1), 2, &streams), 1);
        // A device the driver does not count is no placement.
        assert_eq!(choose(AUTOMATIC, Some(5), 2, &streams), 0);
    }

    #[test]
    fn frames_in_system_memory_spread_over_the_gpus_fewest_streams_first() {
        let mut streams = BTreeMap::new();
        let placed: Vec<u32> = (0..7)
            .map(|_| {
                let gpu = choose(AUTOMATIC, None, 3, &streams);
                *streams.entry(gpu).or_default() += 1;
                gpu
            })
            .collect();
        assert_eq!(placed, [0, 1, 2, 0, 1, 2, 0]);
        // A GPU loaded by elements placed by hand gets the next ones last.
        let streams = BTreeMap::from([(0, 5), (1, 2)]);
        assert_eq!(choose(AUTOMATIC, None, 2, &streams), 1);
    }

    #[test]
    fn without_a_gpu_everything_is_gpu_0() {
        assert_eq!(choose(AUTOMATIC, None, 0, &BTreeMap::new()), 0);
        assert_eq!(choose(AUTOMATIC, Some(3), 0, &BTreeMap::new()), 0);
    }
}
