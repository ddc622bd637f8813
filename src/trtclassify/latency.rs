// SPDX-License-Identifier: MPL-2.0
//! How long frames stay in the element (buffer in to buffer out), as histograms with 5%
//! wide buckets: constant memory however long a camera runs, percentiles within 5%.
//!
//! Start-up is kept apart from the steady state: while dozens of decoders open and allocate,
//! and the shared engine runs its first batches, a stream's first frames can wait several
//! times longer than any later one; over a short run they would set its p99 on their own.

use std::time::{Duration, Instant};

/// Frames that come in within this long of a stream's first frame are its start-up.
pub(crate) const START_UP: Duration = Duration::from_secs(2);

/// The waits of all frames, and of those after the start-up.
#[derive(Debug, Clone, Default)]
pub(crate) struct Latencies {
    pub(crate) all: LatencyHistogram,
    pub(crate) steady: LatencyHistogram,
    first_arrival: Option<Instant>,
}

impl Latencies {
    /// Records that frame number `frame`, which came in at `arrived`, leaves now.
    pub(crate) fn record(&mut self, frame: u64, arrived: Instant) {
        self.record_at(frame, arrived, Instant::now());
    }

    fn record_at(&mut self, frame: u64, arrived: Instant, left: Instant) {
        let wait = left.saturating_duration_since(arrived);
        // Frames leave in the order they came, so the first recorded came in first.
        let first = *self.first_arrival.get_or_insert(arrived);
        self.all.record(frame, wait);
        if arrived.saturating_duration_since(first) >= START_UP {
            self.steady.record(frame, wait);
        }
    }
}

/// Bucket `i` holds waits of up to `RATIO^(i+1)` microseconds.
const RATIO: f64 = 1.05;
/// Enough buckets for waits up to about 20 minutes.
const BUCKETS: usize = 440;

/// Waits in buckets growing by `RATIO`, for quantiles without keeping every wait.
#[derive(Debug, Clone)]
pub(crate) struct LatencyHistogram {
    counts: Vec<u64>,
    frames: u64,
    max: Duration,
    /// The number of the frame that waited longest: tells start-up apart from steady state.
    slowest: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self {
            counts: vec![0; BUCKETS],
            frames: 0,
            max: Duration::ZERO,
            slowest: 0,
        }
    }
}

impl LatencyHistogram {
    /// Records that frame number `frame` waited `wait`.
    pub(crate) fn record(&mut self, frame: u64, wait: Duration) {
        let us = wait.as_secs_f64() * 1e6;
        let i = (us.max(1.0).ln() / RATIO.ln()) as usize;
        self.counts[i.min(BUCKETS - 1)] += 1;
        self.frames += 1;
        if wait > self.max {
            self.max = wait;
            self.slowest = frame;
        }
    }

    /// How many frames were recorded.
    pub(crate) fn frames(&self) -> u64 {
        self.frames
    }

    /// The longest wait.
    pub(crate) fn max(&self) -> Duration {
        self.max
    }

    /// The number of the frame that waited `max`.
    pub(crate) fn slowest(&self) -> u64 {
        self.slowest
    }

    /// The wait that a fraction `q` of the frames did not exceed (the upper edge of its
    /// bucket, at most the largest wait seen); zero when nothing was recorded.
    pub(crate) fn quantile(&self, q: f64) -> Duration {
        if self.frames == 0 {
            return Duration::ZERO;
        }
        let rank = ((q * self.frames as f64).ceil() as u64).clamp(1, self.frames);
        let mut seen = 0;
        for (i, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let edge = Duration::from_secs_f64(RATIO.powi(i as i32 + 1) * 1e-6);
                return edge.min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_of_the_first_two_seconds_are_start_up() {
        let mut l = Latencies::default();
        let t0 = Instant::now();
        // Frames 0..30 in the first second wait 80 ms; frames 30..90 from 2 s on wait 10 ms.
        for frame in 0..30 {
            let arrived = t0 + Duration::from_millis(frame * 33);
            l.record_at(frame, arrived, arrived + Duration::from_millis(80));
        }
        for frame in 30..90 {
            let arrived = t0 + Duration::from_millis(2000 + frame * 33);
            l.record_at(frame, arrived, arrived + Duration::from_millis(10));
        }
        assert_eq!(l.all.frames(), 90);
        assert_eq!(l.steady.frames(), 60);
        assert_eq!(l.all.max(), Duration::from_millis(80));
        assert_eq!(l.steady.max(), Duration::from_millis(10));
        assert_eq!(l.steady.slowest(), 30);
        assert_eq!(l.all.quantile(0.99), Duration::from_millis(80));
    }

    #[test]
    fn quantiles_are_within_five_percent() {
        let mut h = LatencyHistogram::default();
        assert_eq!(h.quantile(0.5), Duration::ZERO);
        // 1 ms to 100 ms in 1 ms steps.
        for ms in 1..=100 {
            h.record(100 - ms, Duration::from_millis(ms));
        }
        assert_eq!(h.frames(), 100);
        let near = |d: Duration, ms: f64| {
            let got = d.as_secs_f64() * 1e3;
            assert!(
                got >= ms * 0.999 && got <= ms * 1.05,
                "{got} ms, want {ms} ms"
            );
        };
        near(h.quantile(0.5), 50.0);
        near(h.quantile(0.99), 99.0);
        near(h.quantile(1.0), 100.0);
        assert_eq!(h.max(), Duration::from_millis(100));
        assert_eq!(h.slowest(), 0);
    }
}
