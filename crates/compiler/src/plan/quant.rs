// SPDX-License-Identifier: MPL-2.0
//! What a quantized product or convolution computes: its input and its weights rounded to
//! an 8-bit format with a scale each, summed in f32. The scales come from calibration
//! (`crate::quant`); the semantics here are those of `sim`, and of the kernels.

use serde::{Deserialize, Serialize};

use super::Loc;

/// An 8-bit number format of quantized steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum QuantFormat {
    /// Signed integers −127..=127 (symmetric: −128 is not used, as in TensorRT), rounded to
    /// nearest, ties to even.
    Int8,
    /// FP8 E4M3 ("e4m3fn": no infinities, largest 448), rounded to nearest even and
    /// saturated at ±448.
    Fp8,
}

impl QuantFormat {
    /// The largest magnitude the format holds: a scale maps a calibrated range onto it.
    pub fn max(self) -> f32 {
        match self {
            QuantFormat::Int8 => 127.0,
            QuantFormat::Fp8 => 448.0,
        }
    }

    /// `v` rounded to the nearest value the format holds, saturated at `max`.
    pub fn round(self, v: f32) -> f32 {
        match self {
            QuantFormat::Int8 => v.round_ties_even().clamp(-127.0, 127.0),
            QuantFormat::Fp8 => fp8_e4m3(v),
        }
    }

    /// `v` as the step reads it: divided by `scale`, rounded, multiplied back. A scale of 0
    /// (a tensor that was all zeros in calibration) reads 0.
    pub fn fake(self, v: f32, scale: f32) -> f32 {
        match scale > 0.0 {
            true => self.round(v / scale) * scale,
            false => 0.0,
        }
    }

    /// The scale that maps magnitudes up to `range` onto the format's largest value; 0 (the
    /// values read as 0, as where they were all zeros) where that is not a normal number, so
    /// that the GPU, which rounds by the scale's inverse (quant.cu's `quantize_int8`), rounds
    /// as `fake` divides.
    pub fn scale(self, range: f32) -> f32 {
        let scale = range / self.max();
        if scale.is_normal() { scale } else { 0.0 }
    }

    /// The byte that holds `v`, a value of the format (`round`'s result): a two's-complement
    /// int8, or FP8 E4M3's sign, 4 exponent and 3 mantissa bits, as the GPU reads them.
    pub fn encode(self, v: f32) -> u8 {
        match self {
            QuantFormat::Int8 => v as i8 as u8,
            QuantFormat::Fp8 => {
                let sign = if v.is_sign_negative() { 0x80 } else { 0 };
                let a = v.abs();
                let bits = match a < pow2(-6) {
                    // Subnormals: exponent field 0, the value in steps of 2⁻⁹.
                    true => (a * 512.0) as u8,
                    false => {
                        let exponent = ((a.to_bits() >> 23) as i32) - 127;
                        let mantissa = (a / pow2(exponent) - 1.0) * 8.0;
                        (((exponent + 7) as u8) << 3) | mantissa as u8
                    }
                };
                sign | bits
            }
        }
    }

    /// The value of the byte `b` (`encode`'s inverse).
    pub fn decode(self, b: u8) -> f32 {
        match self {
            QuantFormat::Int8 => b as i8 as f32,
            QuantFormat::Fp8 => {
                let (exponent, mantissa) = (((b >> 3) & 0xf) as i32, (b & 7) as f32);
                let a = match exponent {
                    0 => mantissa * pow2(-9),
                    e => (1.0 + mantissa / 8.0) * pow2(e - 7),
                };
                if b & 0x80 != 0 { -a } else { a }
            }
        }
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            QuantFormat::Int8 => "int8",
            QuantFormat::Fp8 => "fp8",
        })
    }
}

/// `v` rounded to FP8 E4M3: 3 mantissa bits, exponents −6..=8 (bias 7), subnormals down to
/// 2⁻⁹, saturated at ±448; NaN stays NaN.
fn fp8_e4m3(v: f32) -> f32 {
    if v.is_nan() {
        return v;
    }
    let a = v.abs();
    // The spacing of representable values around `a`: 2^(e-3) for a normal of exponent e,
    // 2^-9 among the subnormals (below 2^-6). Both divisions are exact.
    let exponent = match a < pow2(-6) {
        true => -6,
        // At most 127: saturated to 448 below.
        false => ((a.to_bits() >> 23) as i32) - 127,
    };
    let step = pow2(exponent - 3);
    let rounded = ((a / step).round_ties_even() * step).min(448.0);
    rounded.copysign(v)
}

/// 2^e for a normal f32 exponent (−126..=127), built from its bits: `powi` is a loop of
/// products, and the engine rounds every weight of an FP8 engine as it opens.
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// How a product or convolution reads its operands when it is quantized: `x` with one
/// scale for the whole tensor (from calibration), each output channel's weights with their
/// own (from the weights).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Quant {
    /// The format both operands are rounded to.
    pub format: QuantFormat,
    /// The input's scale: `x` reads as `format.fake(x, x_scale)`.
    pub x_scale: f32,
    /// One f32 scale per output channel (a product's `n` columns, per product where it runs
    /// several; a convolution's `k` filters), a constant that stays f32 on the device.
    pub w_scales: Loc,
    /// The algorithm the GPU runs its 8-bit product with, chosen by timing at build, as
    /// `GemmStep::algo` holds a product's. `None` until tuned, and on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algo: Option<[u64; 8]>,
    /// How the GPU runs it, where it is int8 and the GPU's own kernel fits it, as chosen by
    /// timing at build; `None` before, elsewhere, and on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<EightBitKernel>,
}

/// How the GPU runs an int8 step (`Quant::kernel`); each way is meant to give the same
/// output, to the bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EightBitKernel {
    /// Its input rounded into patches, cuBLASLt's 8-bit product, and a pass that scales the
    /// sums back.
    Library,
    /// The engine's own implicit-GEMM kernel, in blocks of this width, rounding its input as
    /// it reads it.
    Own(OwnWidth),
    /// The engine's own kernel reading its input in int8, rounded by a pass before it: where
    /// many blocks read the same input (many output channels, a 3×3 convolution's taps), once
    /// instead of in each of them.
    OwnRoundedFirst(OwnWidth),
    /// The engine's own kernel in warps of 64 × 64 outputs, in blocks of this shape, reading
    /// its input in int8 (rounded by a pass first, as `OwnRoundedFirst`): fewer loads from
    /// shared memory a product, for long sums.
    OwnWide(OwnTile),
}

impl EightBitKernel {
    /// The ways of the engine's own kernel, as a build times them.
    pub const OWN: [EightBitKernel; 6] = [
        EightBitKernel::Own(OwnWidth::Cols64),
        EightBitKernel::Own(OwnWidth::Cols128),
        EightBitKernel::OwnRoundedFirst(OwnWidth::Cols64),
        EightBitKernel::OwnRoundedFirst(OwnWidth::Cols128),
        EightBitKernel::OwnWide(OwnTile::Rows256Cols64),
        EightBitKernel::OwnWide(OwnTile::Rows128Cols128),
    ];

    /// Whether the engine's own kernel runs it.
    pub fn is_own(self) -> bool {
        self != EightBitKernel::Library
    }

    /// Whether the engine's own kernel runs it reading its input in int8, which a pass rounds
    /// first where the step before does not write it so.
    pub fn reads_int8(self) -> bool {
        matches!(
            self,
            EightBitKernel::OwnRoundedFirst(_) | EightBitKernel::OwnWide(_)
        )
    }

    /// The block of the engine's own kernel in warps of 64 × 64 that runs it, if one does.
    pub fn wide_tile(self) -> Option<OwnTile> {
        match self {
            EightBitKernel::OwnWide(t) => Some(t),
            _ => None,
        }
    }

    /// The output channels a block of the engine's own kernel computes, or 0.
    pub fn cols(self) -> usize {
        match self {
            EightBitKernel::Library => 0,
            EightBitKernel::Own(w) | EightBitKernel::OwnRoundedFirst(w) => w.cols(),
            EightBitKernel::OwnWide(t) => t.cols(),
        }
    }
}

/// The output channels a block of the GPU's own int8 kernel computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OwnWidth {
    /// 64 output channels.
    Cols64,
    /// 128 output channels.
    Cols128,
}

impl OwnWidth {
    /// The output channels.
    pub fn cols(self) -> usize {
        match self {
            OwnWidth::Cols64 => 64,
            OwnWidth::Cols128 => 128,
        }
    }
}

/// The outputs a block of the GPU's own int8 kernel in warps of 64 × 64 computes: rows
/// (output pixels) × output channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OwnTile {
    /// 256 rows × 64 channels, four warps down the rows.
    Rows256Cols64,
    /// 128 rows × 128 channels, two warps each way.
    Rows128Cols128,
}

impl OwnTile {
    /// Every shape.
    pub const ALL: [OwnTile; 2] = [OwnTile::Rows256Cols64, OwnTile::Rows128Cols128];

    /// The rows.
    pub fn rows(self) -> usize {
        match self {
            OwnTile::Rows256Cols64 => 256,
            OwnTile::Rows128Cols128 => 128,
        }
    }

    /// The output channels.
    pub fn cols(self) -> usize {
        match self {
            OwnTile::Rows256Cols64 => 64,
            OwnTile::Rows128Cols128 => 128,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_rounds_to_nearest_even_and_saturates() {
        let f = QuantFormat::Int8;
        assert_eq!(f.round(2.5), 2.0);
        assert_eq!(f.round(3.5), 4.0);
        assert_eq!(f.round(-2.5), -2.0);
        assert_eq!(f.round(200.0), 127.0);
        assert_eq!(f.round(-200.0), -127.0);
        assert_eq!(f.fake(0.26, 0.1), 0.3);
        assert_eq!(f.fake(5.0, 0.0), 0.0);
        assert_eq!(f.scale(254.0), 2.0);
        // Ranges whose scale would be subnormal, infinite or NaN read as 0.
        for range in [1e-37, f32::INFINITY, f32::NAN] {
            assert_eq!(f.scale(range), 0.0, "range {range}");
        }
    }

    #[test]
    fn fp8_holds_its_grid_and_rounds_between_it() {
        let f = QuantFormat::Fp8;
        // Every value of the grid maps to itself: 8 subnormals and 15 binades of 8 values.
        let mut grid: Vec<f32> = (0..8).map(|m| m as f32 * 2f32.powi(-9)).collect();
        for e in -6..=8 {
            grid.extend((0..8).map(|m| (1.0 + m as f32 / 8.0) * 2f32.powi(e)));
        }
        grid.retain(|&v| v <= 448.0);
        assert_eq!(grid.len(), 8 + 15 * 8 - 1);
        for &v in &grid {
            assert_eq!(f.round(v), v);
            assert_eq!(f.round(-v), -v);
        }
        // Halfway between 1.0 and 1.125 goes to the even mantissa (1.0); between 1.125 and
        // 1.25 to 1.25; the smallest subnormal's half goes to 0.
        assert_eq!(f.round(1.0625), 1.0);
        assert_eq!(f.round(1.1875), 1.25);
        assert_eq!(f.round(2f32.powi(-10)), 0.0);
        assert_eq!(f.round(1.5 * 2f32.powi(-9)), 2.0 * 2f32.powi(-9));
        assert_eq!(f.round(1000.0), 448.0);
        assert_eq!(f.round(-1e30), -448.0);
        assert!(f.round(f32::NAN).is_nan());
    }

    #[test]
    fn bytes_hold_every_value_of_both_formats() {
        // Every byte but FP8's NaNs (S.1111.111) and int8's −128 is a value that encodes
        // back to it; 448 is 0x7e, 2⁻⁹ is 0x01, −1 is 0xb8 in FP8 and 0xff in int8.
        for format in [QuantFormat::Int8, QuantFormat::Fp8] {
            for b in 0..=255u8 {
                let nan = format == QuantFormat::Fp8 && b & 0x7f == 0x7f;
                if nan || (format == QuantFormat::Int8 && b == 0x80) {
                    continue;
                }
                let v = format.decode(b);
                assert_eq!(format.round(v), v, "{format} {b:#04x}");
                assert_eq!(format.encode(v), b, "{format} {b:#04x} = {v}");
            }
        }
        let f = QuantFormat::Fp8;
        assert_eq!(
            (f.encode(448.0), f.encode(2f32.powi(-9)), f.encode(-1.0)),
            (0x7e, 1, 0xb8)
        );
        assert_eq!(QuantFormat::Int8.encode(-1.0), 0xff);
    }
}
