// SPDX-License-Identifier: MPL-2.0
//! Int8 and FP8 plans: which products and convolutions read their operands rounded to
//! 8 bits, and with what scales.
//!
//! Calibration runs the unquantized plan on sample frames (`Calibrator`, fed by any runner
//! that can read a step's input before the step runs: `sim`, the CPU runner, the GPU
//! runtime) and keeps, for each step that may be quantized, the range of its input and the
//! error its product would make in each format. The `CalibrationTable` holds them by ONNX
//! node, so that one table serves the plans of every batch size and is saved beside the
//! engine. `quantize` then marks a plan's steps (`plan::Quant`): per-tensor input scales
//! from the table, per-channel weight scales from the weights, and the steps whose error
//! passes `LAYER_ERROR_BOUND` kept in the plan's type. `Agreement` compares the quantized
//! engine's scores with the unquantized one's, for the build's accuracy guard.

mod agreement;
mod calibration;
mod heldout;
mod table;

pub use crate::plan::QuantFormat;
pub use agreement::Agreement;
pub use calibration::{Calibrator, Stepper};
pub use heldout::HeldOut;
pub use table::{CalibrationTable, HEADER as TABLE_HEADER, NodeRange, TableError};

use crate::plan::{ConvStep, GemmStep, Loc, Plan, Quant, Span, Step, Weights};

/// The largest relative error (root-mean-square error over root-mean-square value) a step's
/// product may make on the calibration frames with its operands rounded, for the step to be
/// quantized; a step past it stays in the plan's type. Rounding to int8 or FP8 alone makes
/// 1-3 % in a well-behaved layer; 10 % marks a layer whose range is set by a few outliers.
pub const LAYER_ERROR_BOUND: f32 = 0.10;

/// Why a step that might have been quantized was not.
#[derive(Debug, Clone, PartialEq)]
pub enum Kept {
    /// The table has no range for its node (a table made for another model, or a node that
    /// never ran in calibration).
    NotCalibrated,
    /// Its product's error on the calibration frames, which is above `LAYER_ERROR_BOUND`.
    Error(f32),
    /// Named by the caller.
    Asked,
}

impl std::fmt::Display for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kept::NotCalibrated => write!(f, "not in the calibration table"),
            Kept::Error(e) => write!(
                f,
                "{:.1} % error on the calibration frames (the bound is {:.0} %)",
                e * 100.0,
                LAYER_ERROR_BOUND * 100.0
            ),
            Kept::Asked => write!(f, "asked to stay"),
        }
    }
}

/// What `quantize` did to a plan.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Quantized {
    /// The nodes whose steps are quantized, in plan order.
    pub nodes: Vec<String>,
    /// The nodes that might have been and stay in the plan's type, with why.
    pub kept: Vec<(String, Kept)>,
}

/// The input a step reads, where the step is one that may be quantized: a product or a
/// dense convolution with constant weights, computed in the plan's type, whose sizes suit
/// 8-bit tensor cores (the summed dimension a multiple of 16, the output channels of 8).
/// The others (the first convolution of 3 colour channels, depthwise convolutions, which
/// are limited by memory, not arithmetic, products of two activations, a classifier of
/// 1,000 classes) stay in the plan's type, as do steps that write the model's f32 output
/// and runs of several products at once (attention's), which the GPU runs in its type.
pub fn input_of(step: &Step) -> Option<Span> {
    let tensor_cores =
        |summed: usize, out: usize| summed.is_multiple_of(16) && out.is_multiple_of(8);
    let fits = match step {
        Step::Gemm(g) => {
            matches!(g.w, Loc::Weight { .. }) && g.batch == 1 && tensor_cores(g.k, g.n)
        }
        Step::Conv(c) => {
            matches!(c.weight, Loc::Weight { .. }) && c.group == 1 && tensor_cores(c.c, c.k)
        }
        _ => false,
    };
    let writes_output = matches!(step.written().loc, Loc::Output(_));
    // A product's and a convolution's first span is their input (`StepKind::spans`).
    (fits && !writes_output && !step.is_wide()).then(|| step.spans()[0])
}

/// Marks the steps of `plan` that `input_of` takes and whose node has a range in `table`
/// as quantized to `format`, except those of the nodes in `keep` and those whose error in
/// the table passes `LAYER_ERROR_BOUND`. The weights' scales are added to `weights`.
pub fn quantize(
    plan: &mut Plan,
    weights: &mut Weights,
    table: &CalibrationTable,
    format: QuantFormat,
    keep: &[String],
) -> Quantized {
    let mut done = Quantized::default();
    for (step, origin) in plan.steps.iter_mut().zip(&plan.origins) {
        if input_of(step).is_none() {
            continue;
        }
        let range = match table.get(origin) {
            _ if keep.contains(origin) => Err(Kept::Asked),
            None => Err(Kept::NotCalibrated),
            Some(r) if r.error(format) > LAYER_ERROR_BOUND => Err(Kept::Error(r.error(format))),
            Some(r) => Ok(r),
        };
        let range = match range {
            Ok(range) => range,
            Err(why) => {
                if !done.kept.iter().any(|(n, _)| n == origin) {
                    done.kept.push((origin.clone(), why));
                }
                continue;
            }
        };
        let quant = Some(Quant {
            format,
            x_scale: format.scale(range.range(format)),
            w_scales: weight_scales(weights, &channels(step), format),
            algo: None,
            kernel: None,
        });
        match step {
            Step::Gemm(g) => g.quant = quant,
            Step::Conv(c) => c.quant = quant,
            _ => unreachable!("input_of takes products and convolutions"),
        }
        if !done.nodes.contains(origin) {
            done.nodes.push(origin.clone());
        }
    }
    done
}

/// Where each output channel's weights are: the constant, and for each channel the offsets
/// of its weights in it.
struct Channels {
    weight: Loc,
    offsets: Vec<Vec<usize>>,
}

/// A product's columns, per product: `w` is `[batch, k, n]`, or `[batch, n, k]` transposed.
fn gemm_columns(g: &GemmStep) -> Channels {
    let (row, col) = match g.w_transposed {
        true => (1, g.k),
        false => (g.n, 1),
    };
    let offsets = (0..g.batch)
        .flat_map(|p| (0..g.n).map(move |j| (p, j)))
        .map(|(p, j)| {
            (0..g.k)
                .map(|i| p * g.k * g.n + i * row + j * col)
                .collect()
        })
        .collect();
    Channels {
        weight: g.w,
        offsets,
    }
}

/// A convolution's filters: its weight is KRSC.
fn conv_filters(c: &ConvStep) -> Channels {
    let per_filter = c.kernel[0] * c.kernel[1] * (c.c / c.group);
    Channels {
        weight: c.weight,
        offsets: (0..c.k)
            .map(|k| (k * per_filter..(k + 1) * per_filter).collect())
            .collect(),
    }
}

/// Each channel's weights, as `weights` holds them.
fn channel_weights(weights: &Weights, channels: &Channels) -> Vec<Vec<f32>> {
    let Loc::Weight { index, offset } = channels.weight else {
        unreachable!("input_of takes constant weights only")
    };
    let data = &weights.data[index];
    (channels.offsets.iter())
        .map(|offsets| offsets.iter().map(|&i| data[offset + i]).collect())
        .collect()
}

/// The scale that maps a channel's largest magnitude onto `format`'s largest value.
fn channel_scale(channel: &[f32], format: QuantFormat) -> f32 {
    format.scale(channel.iter().map(|v| v.abs()).fold(0.0, f32::max))
}

/// Adds the per-channel scales of `channels` in `format` as an f32 constant, and returns
/// where it is.
fn weight_scales(weights: &mut Weights, channels: &Channels, format: QuantFormat) -> Loc {
    let scales: Vec<f32> = (channel_weights(weights, channels).iter())
        .map(|channel| channel_scale(channel, format))
        .collect();
    let Loc::Weight { index, offset } = channels.weight else {
        unreachable!("input_of takes constant weights only")
    };
    let name = format!("{}@{offset} {format} scales", weights.names[index]);
    // Scales stay f32 on the device, beside weights of the plan's type.
    let index = weights.add(&name, &std::sync::Arc::new(scales), true);
    Loc::Weight { index, offset: 0 }
}

/// Each channel's weights as `format` rounds them.
fn rounded_weights(exact: &[Vec<f32>], format: QuantFormat) -> Vec<Vec<f32>> {
    (exact.iter())
        .map(|channel| {
            let scale = channel_scale(channel, format);
            channel.iter().map(|&v| format.fake(v, scale)).collect()
        })
        .collect()
}

/// The channels of a step `input_of` takes.
fn channels(step: &Step) -> Channels {
    match step {
        Step::Gemm(g) => gemm_columns(g),
        Step::Conv(c) => conv_filters(c),
        _ => unreachable!("input_of takes products and convolutions"),
    }
}

#[cfg(test)]
mod tests;
