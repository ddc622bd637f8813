// SPDX-License-Identifier: MPL-2.0
//! Activations over slices, written as plain loops without calls or branches that the
//! compiler can turn into SIMD instructions: libm's `expf` is a call per value, which made
//! sigmoid and SiLU (EfficientNet) cost more than the convolutions around them. `FMA`: the
//! caller is compiled for a CPU that multiplies and adds in one instruction (`kernels::wide!`
//! picks it), which the polynomial of `exp` is made of: SiLU over 1.2 M values 1.03 → 0.59 ms
//! on the development VM's AMD EPYC.

use trtclassify_compiler::ir::Act;

/// e^x within 2 ulp for x in [-87, 88] (Cephes' `expf`: x = n·ln2 + r, a degree-6
/// polynomial in r, then 2^n put in the exponent bits); below that range it gives about
/// 1e-38 instead of a subnormal or 0, above it 2^127·e^r instead of infinity, which no
/// activation here can tell apart.
#[inline(always)]
pub fn exp<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and taking away 1.5·2^23 rounds to the nearest integer without a call.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = fma::<FMA>(x, LOG2E, ROUND);
    let n = t - ROUND;
    let r = fma::<FMA>(-n, LN2_LO, fma::<FMA>(-n, LN2_HI, x));
    let p = 1.987_569_1e-4;
    let p = fma::<FMA>(p, r, 1.398_2e-3);
    let p = fma::<FMA>(p, r, 8.333_452e-3);
    let p = fma::<FMA>(p, r, 4.166_579_6e-2);
    let p = fma::<FMA>(p, r, 0.166_666_65);
    let p = fma::<FMA>(p, r, 0.5);
    let e = fma::<FMA>(p, r * r, r + 1.0);
    // t's low mantissa bits hold n (t = 1.5·2^23 + n): 2^n from integer operations alone,
    // since a float-to-int conversion (`as`, saturating) does not vectorise.
    let n_bits = t.to_bits().wrapping_sub(0x4B40_0000);
    e * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// `a·b + c`, in one instruction where `FMA` (elsewhere `mul_add` is a slow library call).
#[inline(always)]
pub fn fma<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

#[inline(always)]
fn sigmoid<const FMA: bool>(x: f32) -> f32 {
    1.0 / (1.0 + exp::<FMA>(-x))
}

/// erf(x) as the reference computes it (Abramowitz and Stegun 7.1.26, error below 1.5e-7),
/// without calls or branches: the reference's libm `expf` per value made GELU's epilogue cost
/// four times its product (ViT-Ti: 2.3 ms of a 0.5 ms product, on one core).
#[inline(always)]
fn erf<const FMA: bool>(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / fma::<FMA>(0.327_591_1, a, 1.0);
    let p = fma::<FMA>(1.061_405_4, t, -1.453_152_1);
    let p = fma::<FMA>(p, t, 1.421_413_8);
    let p = fma::<FMA>(p, t, -0.284_496_74);
    let p = fma::<FMA>(p, t, 0.254_829_6);
    let y = 1.0 - p * t * exp::<FMA>(-a * a);
    y.copysign(x)
}

/// Applies `act` to every value of `v`, one loop per activation so that each vectorises.
#[inline(always)]
pub fn activate<const FMA: bool>(act: Act, v: &mut [f32]) {
    match act {
        Act::None => {}
        Act::Relu => v.iter_mut().for_each(|x| *x = x.max(0.0)),
        Act::Clip(lo, hi) => v.iter_mut().for_each(|x| *x = x.max(lo).min(hi)),
        Act::LeakyRelu(a) => v
            .iter_mut()
            .for_each(|x| *x = if *x < 0.0 { a * *x } else { *x }),
        Act::HardSigmoid(a, b) => v.iter_mut().for_each(|x| *x = (a * *x + b).clamp(0.0, 1.0)),
        Act::HardSwish => v
            .iter_mut()
            .for_each(|x| *x *= (*x * (1.0 / 6.0) + 0.5).clamp(0.0, 1.0)),
        Act::Sigmoid => v.iter_mut().for_each(|x| *x = sigmoid::<FMA>(*x)),
        // x / (1 + e^-x): one operation fewer than x · sigmoid(x).
        Act::Silu => v.iter_mut().for_each(|x| *x /= 1.0 + exp::<FMA>(-*x)),
        // tanh(x) = 2·sigmoid(2x) − 1; its absolute error near 0 is 1e-7.
        Act::Tanh => v
            .iter_mut()
            .for_each(|x| *x = 2.0 * sigmoid::<FMA>(2.0 * *x) - 1.0),
        Act::Exp => v.iter_mut().for_each(|x| *x = exp::<FMA>(*x)),
        Act::Erf => v.iter_mut().for_each(|x| *x = erf::<FMA>(*x)),
        Act::Gelu => v.iter_mut().for_each(|x| {
            *x *= 0.5 * (1.0 + erf::<FMA>(*x * std::f32::consts::FRAC_1_SQRT_2));
        }),
        other => v.iter_mut().for_each(|x| *x = other.apply(*x)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut x = -87.0f32;
        while x < 88.0 {
            for (ours, fma) in [(exp::<false>(x), false), (exp::<true>(x), true)] {
                let libm = x.exp();
                let ulp = (libm.to_bits() as i64 - ours.to_bits() as i64).abs();
                assert!(ulp <= 2, "exp({x}) = {ours} (FMA {fma}), libm {libm}");
            }
            x += 0.001_7;
        }
        assert!(exp::<false>(-200.0) < 1e-37 && exp::<false>(200.0) > 1e38);
        assert!(exp::<true>(-200.0) < 1e-37 && exp::<true>(200.0) > 1e38);
    }

    #[test]
    fn activations_on_slices_agree_with_the_reference() {
        let acts = [
            Act::Relu,
            Act::Clip(0.0, 6.0),
            Act::LeakyRelu(0.1),
            Act::HardSigmoid(0.2, 0.5),
            Act::HardSwish,
            Act::Sigmoid,
            Act::Silu,
            Act::Tanh,
            Act::Exp,
            Act::Erf,
            Act::Gelu,
        ];
        let xs: Vec<f32> = (-400..400).map(|i| i as f32 * 0.025).collect();
        for (act, fma) in acts.into_iter().flat_map(|a| [(a, false), (a, true)]) {
            let mut v = xs.clone();
            if fma {
                activate::<true>(act, &mut v);
            } else {
                activate::<false>(act, &mut v);
            }
            for (&x, &y) in xs.iter().zip(&v) {
                let want = act.apply(x);
                assert!(
                    (y - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "{act:?}({x}) = {y} (FMA {fma}), want {want}"
                );
            }
        }
    }
}
