// SPDX-License-Identifier: MPL-2.0
//! How long frames stay in the element (buffer in to buffer out), as a histogram with 5%
//! wide buckets: constant memory however long a camera runs, percentiles within 5%.

use std::time::Duration;

/// Bucket `i` holds waits of up to `RATIO^(i+1)` microseconds.
const RATIO: f64 = 1.05;
/// Enough buckets for waits up to about 20 minutes.
const BUCKETS: usize = 440;

#[derive(Debug, Clone)]
pub struct LatencyHistogram {
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
    pub fn record(&mut self, frame: u64, wait: Duration) {
        let us = wait.as_secs_f64() * 1e6;
        let i = (us.max(1.0).ln() / RATIO.ln()) as usize;
        self.counts[i.min(BUCKETS - 1)] += 1;
        self.frames += 1;
        if wait > self.max {
            self.max = wait;
            self.slowest = frame;
        }
    }

    pub fn frames(&self) -> u64 {
        self.frames
    }

    pub fn max(&self) -> Duration {
        self.max
    }

    /// The number of the frame that waited `max`.
    pub fn slowest(&self) -> u64 {
        self.slowest
    }

    /// The wait that a fraction `q` of the frames did not exceed (the upper edge of its
    /// bucket, at most the largest wait seen); zero when nothing was recorded.
    pub fn quantile(&self, q: f64) -> Duration {
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
