// SPDX-License-Identifier: MPL-2.0
//! What calibration keeps of each quantizable step's input while the unquantized plan runs
//! on sample frames: a histogram of magnitudes (for the ranges), and a few rows of the
//! product's input (for the error each format would make).

use std::collections::BTreeMap;
use std::ops::Range;

use super::table::{CalibrationTable, NodeRange};
use super::{channel_weights, channels, input_of, rounded_weights};
use crate::plan::{Plan, QuantFormat, Span, Step, Weights};

/// Bins of the magnitude histogram: TensorRT's entropy calibrator uses as many.
const BINS: usize = 2048;

/// int8's positive levels, which the entropy search folds the histogram into.
const LEVELS: usize = 128;

/// Input rows kept per node for the error estimate, and taken from each run.
const SAMPLES: usize = 128;
const ROWS_PER_RUN: usize = 16;

/// Output channels the error estimate looks at, at most (spread over all of them).
const CHANNELS: usize = 256;

/// A runner that runs a plan's steps one at a time and reads its buffers between them.
pub trait Stepper {
    /// Why a step or a read failed.
    type Error;

    /// Runs step `step` of the plan.
    fn run_step(&mut self, step: usize) -> Result<(), Self::Error>;

    /// The values of `span`, as f32, once the steps run so far have written them.
    fn read(&mut self, span: Span) -> Result<Vec<f32>, Self::Error>;
}

/// Gathers the inputs of a plan's quantizable steps over calibration runs, then makes the
/// table of their ranges and errors.
#[derive(Default)]
pub struct Calibrator {
    nodes: BTreeMap<String, Observed>,
    frames: usize,
}

/// What one node's step read, over all runs.
struct Observed {
    /// The step (of the plan that ran), for its geometry and weights.
    step: Step,
    histogram: Histogram,
    /// Input rows as read: the values that one output row's channels (the range) sum over.
    samples: Vec<(Range<usize>, Vec<f32>)>,
    rows_seen: usize,
}

impl Calibrator {
    /// A calibrator that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Frames run so far.
    pub fn frames(&self) -> usize {
        self.frames
    }

    /// Runs `plan` once through `runner` (whose input buffer holds `plan.batch` calibration
    /// frames), reading each quantizable step's input before that step runs.
    pub fn run<S: Stepper>(&mut self, plan: &Plan, runner: &mut S) -> Result<(), S::Error> {
        for (i, (step, origin)) in plan.steps.iter().zip(&plan.origins).enumerate() {
            if let Some(span) = input_of(step) {
                let values = runner.read(span)?;
                self.observe(step, origin, &values);
            }
            runner.run_step(i)?;
        }
        self.frames += plan.batch;
        Ok(())
    }

    /// Records `x`, the input that `step` (of node `origin`) read in one run.
    pub fn observe(&mut self, step: &Step, origin: &str, x: &[f32]) {
        let node = (self.nodes.entry(origin.to_owned())).or_insert_with(|| Observed {
            step: step.clone(),
            histogram: Histogram::default(),
            samples: Vec::new(),
            rows_seen: 0,
        });
        node.histogram.add(x);
        let rows = input_rows(step);
        let every = (rows / ROWS_PER_RUN).max(1);
        for row in (0..rows).step_by(every).take(ROWS_PER_RUN) {
            let sample = input_row(step, x, row);
            // The first `SAMPLES` rows, then each later row in turn in place of an older one,
            // so that later frames count too.
            match node.samples.len() < SAMPLES {
                true => node.samples.push(sample),
                false => node.samples[node.rows_seen % SAMPLES] = sample,
            }
            node.rows_seen += 1;
        }
    }

    /// Each node's ranges, and the error its product makes in each format on the rows kept;
    /// `weights` are those of the plan that ran.
    ///
    /// FP8 takes the largest value seen: its steps grow with the value, so that large
    /// values cost little precision elsewhere. int8's even steps make clipping worth it: of
    /// the largest value, the 99.999th, 99.99th and 99.9th percentiles and the entropy
    /// range (TensorRT's), the range whose product error on the kept rows is smallest. No
    /// one of them suits every layer: entropy clips hard where a few large values matter,
    /// the largest value wastes the steps on a long tail.
    pub fn table(&self, weights: &Weights) -> CalibrationTable {
        let nodes = (self.nodes.iter())
            .map(|(name, seen)| {
                let h = &seen.histogram;
                let exact = channel_weights(weights, &channels(&seen.step));
                let (int8_weights, fp8_weights) = (
                    rounded_weights(&exact, QuantFormat::Int8),
                    rounded_weights(&exact, QuantFormat::Fp8),
                );
                let error = |format, range| {
                    let rounded = match format {
                        QuantFormat::Int8 => &int8_weights,
                        QuantFormat::Fp8 => &fp8_weights,
                    };
                    product_error(&seen.samples, &exact, rounded, format, range)
                };
                let candidates = [
                    h.top_value,
                    h.percentile(0.99999),
                    h.percentile(0.9999),
                    h.percentile(0.999),
                    h.entropy_range(),
                ];
                let (int8, int8_error) = (candidates.iter())
                    .map(|&r| r.min(h.top_value))
                    .map(|r| (r, error(QuantFormat::Int8, r)))
                    .min_by(|a, b| a.1.total_cmp(&b.1))
                    .expect("candidates");
                let range = NodeRange {
                    amax: h.top_value,
                    int8,
                    int8_error,
                    fp8_error: error(QuantFormat::Fp8, h.top_value),
                };
                (name.clone(), range)
            })
            .collect();
        CalibrationTable {
            frames: self.frames,
            nodes,
        }
    }
}

/// Rows of a step's product: a product's rows (of every product that reads its own input),
/// a convolution's output pixels.
fn input_rows(step: &Step) -> usize {
    match step {
        Step::Gemm(g) if g.x_batch > 0 => g.batch * g.rows,
        Step::Gemm(g) => g.rows,
        Step::Conv(c) => c.n * c.oh * c.ow,
        _ => 0,
    }
}

/// Input row `row` of a step's product, from `x` (the step's input span): the output
/// channels it meets (a row of an input that several products share meets all of theirs),
/// and the values those sum over, in the order of the weights (a convolution's KRSC patch,
/// zero where it reaches into the padding).
fn input_row(step: &Step, x: &[f32], row: usize) -> (Range<usize>, Vec<f32>) {
    match step {
        Step::Gemm(g) => {
            let (start, columns) = match g.x_batch {
                0 => (row * g.k, 0..g.batch * g.n),
                _ => {
                    let (product, r) = (row / g.rows, row % g.rows);
                    (
                        product * g.x_batch + r * g.k,
                        product * g.n..(product + 1) * g.n,
                    )
                }
            };
            (columns, x[start..start + g.k].to_vec())
        }
        Step::Conv(c) => {
            let (n, pixel) = (row / (c.oh * c.ow), row % (c.oh * c.ow));
            let (oy, ox) = (pixel / c.ow, pixel % c.ow);
            let mut patch = Vec::with_capacity(c.kernel[0] * c.kernel[1] * c.c);
            for r in 0..c.kernel[0] {
                let y = (oy * c.strides[0] + r * c.dilations[0]) as isize - c.pads[0] as isize;
                for s in 0..c.kernel[1] {
                    let xx = (ox * c.strides[1] + s * c.dilations[1]) as isize - c.pads[1] as isize;
                    let inside = (0..c.h as isize).contains(&y) && (0..c.w as isize).contains(&xx);
                    match inside {
                        true => {
                            let at = ((n * c.h + y as usize) * c.w + xx as usize) * c.c;
                            patch.extend_from_slice(&x[at..at + c.c]);
                        }
                        false => patch.extend(std::iter::repeat_n(0.0, c.c)),
                    }
                }
            }
            (0..c.k, patch)
        }
        _ => unreachable!("input_of takes products and convolutions"),
    }
}

/// The relative error (root-mean-square difference over root-mean-square value) of the
/// product on the kept rows with the input rounded in `format` for `range` and the weights
/// as `rounded`, against the exact product (`exact`: each channel's weights); over at most
/// `CHANNELS` channels. Past f32's range (a NaN or an infinity among the values) it is
/// `f32::MAX`, which the table can hold and which keeps the step unquantized.
fn product_error(
    samples: &[(Range<usize>, Vec<f32>)],
    exact: &[Vec<f32>],
    rounded: &[Vec<f32>],
    format: QuantFormat,
    range: f32,
) -> f32 {
    let x_scale = format.scale(range);
    let dot = |x: &[f32], w: &[f32]| -> f64 {
        (x.iter().zip(w))
            .map(|(&x, &w)| f64::from(x) * f64::from(w))
            .sum()
    };
    let (mut error, mut value) = (0.0f64, 0.0f64);
    for (columns, row) in samples {
        let row_q: Vec<f32> = row.iter().map(|&v| format.fake(v, x_scale)).collect();
        let every = (columns.len() / CHANNELS).max(1);
        for j in columns.clone().step_by(every) {
            let want = dot(row, &exact[j]);
            error += (dot(&row_q, &rounded[j]) - want).powi(2);
            value += want.powi(2);
        }
    }
    let relative = match value > 0.0 {
        true => (error / value).sqrt() as f32,
        false => 0.0,
    };
    match relative.is_finite() {
        true => relative,
        false => f32::MAX,
    }
}

/// Counts of magnitudes in `BINS` equal bins over `[0, end)`; the range doubles
/// (neighbouring bins merged) when a larger value comes.
#[derive(Default)]
struct Histogram {
    counts: Vec<u64>,
    /// The end of the last bin; 0 before the first value that is not 0.
    end: f32,
    /// The largest magnitude seen.
    top_value: f32,
}

impl Histogram {
    fn add(&mut self, values: &[f32]) {
        if self.counts.is_empty() {
            self.counts = vec![0; BINS];
        }
        let largest = (values.iter())
            .filter(|v| v.is_finite())
            .map(|v| v.abs())
            .fold(0.0f32, f32::max);
        self.top_value = self.top_value.max(largest);
        if self.end == 0.0 {
            self.end = largest;
        }
        while largest > self.end {
            self.counts = (self.counts.chunks(2))
                .map(|pair| pair.iter().sum())
                .chain(std::iter::repeat_n(0, BINS / 2))
                .collect();
            self.end *= 2.0;
        }
        for v in values.iter().filter(|v| v.is_finite()) {
            let bin = match self.end > 0.0 {
                true => ((v.abs() / self.end) * BINS as f32) as usize,
                false => 0,
            };
            self.counts[bin.min(BINS - 1)] += 1;
        }
    }

    /// The end of the first bin by which `share` of the values are counted.
    fn percentile(&self, share: f64) -> f32 {
        let total: u64 = self.counts.iter().sum();
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen as f64 >= share * total as f64 {
                return self.end * (i + 1) as f32 / BINS as f32;
            }
        }
        self.end
    }

    /// The range that int8 loses least information in: the clipping point whose histogram,
    /// folded into int8's 128 levels, is nearest the full one by Kullback-Leibler divergence
    /// (TensorRT's entropy calibration).
    fn entropy_range(&self) -> f32 {
        if self.end == 0.0 {
            return 0.0;
        }
        let counts: Vec<f64> = self.counts.iter().map(|&c| c as f64).collect();
        // What lies past each bin, which clipping there folds into the last bin kept.
        let mut after = vec![0.0; BINS + 1];
        for i in (0..BINS).rev() {
            after[i] = after[i + 1] + counts[i];
        }
        let mut best = (f64::INFINITY, BINS);
        for clip in LEVELS..=BINS {
            let mut p = counts[..clip].to_vec();
            p[clip - 1] += after[clip];
            let q = folded(&counts[..clip], &p);
            if let Some(divergence) = kl_divergence(&p, &q)
                && divergence < best.0
            {
                best = (divergence, clip);
            }
        }
        self.end * best.1 as f32 / BINS as f32
    }
}

/// `sliced` folded into `LEVELS` levels and spread back over the bins that `p` has values
/// in, as int8 would see the clipped histogram.
fn folded(sliced: &[f64], p: &[f64]) -> Vec<f64> {
    let per_level = sliced.len() / LEVELS;
    let mut q = vec![0.0; sliced.len()];
    for level in 0..LEVELS {
        let start = level * per_level;
        let end = match level == LEVELS - 1 {
            true => sliced.len(),
            false => start + per_level,
        };
        let total: f64 = sliced[start..end].iter().sum();
        let used = p[start..end].iter().filter(|&&v| v != 0.0).count();
        if used > 0 {
            for i in start..end {
                if p[i] != 0.0 {
                    q[i] = total / used as f64;
                }
            }
        }
    }
    q
}

/// KL(p ‖ q) of two histograms, each normalised and smoothed so that no bin is empty;
/// `None` where either is all zeros.
fn kl_divergence(p: &[f64], q: &[f64]) -> Option<f64> {
    let p = smoothed(p)?;
    let q = smoothed(q)?;
    Some(
        (p.iter().zip(&q))
            .filter(|(p, _)| **p > 0.0)
            .map(|(p, q)| p * (p / q).ln())
            .sum(),
    )
}

/// `h` normalised, with a little mass moved onto its empty bins.
fn smoothed(h: &[f64]) -> Option<Vec<f64>> {
    const EPS: f64 = 1e-4;
    let total: f64 = h.iter().sum();
    let empty = h.iter().filter(|&&v| v == 0.0).count();
    let full = h.len() - empty;
    if total <= 0.0 || full == 0 {
        return None;
    }
    let taken = EPS * empty as f64 / full as f64;
    Some(
        h.iter()
            .map(|&v| match v == 0.0 {
                true => EPS,
                false => (v / total - taken).max(EPS * 0.1),
            })
            .collect(),
    )
}
