// SPDX-License-Identifier: MPL-2.0
//! The CPU kernels against `compiler::sim`, the plain step-by-step run of a plan that the lowering
//! tests trust: random convolutions (depthwise with channel counts off the vector width,
//! grouped, strided, dilated, padded, with residuals and every fused activation), matrix
//! products on packed and on computed weights, pooling, and element-wise steps with broadcast and transposed operands, on one and on two threads.

use std::sync::Arc;

use super::plan_runner::PlanRunner;
use trtclassify_compiler::ir::{Act, BinOp};
use trtclassify_compiler::plan::{
    Cast, ConvStep, DType, EwStep, GateStep, GemmStep, Loc, Plan, PoolStep, Step, Strided, Weights,
    ZeroStep,
};
use trtclassify_compiler::sim;

/// A small deterministic generator: a failing case is its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: usize) -> usize {
        self.next() as usize % n
    }

    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }
}

const ACTS: [Act; 8] = [
    Act::None,
    Act::Relu,
    Act::Clip(0.0, 6.0),
    Act::Silu,
    Act::Sigmoid,
    Act::HardSwish,
    Act::LeakyRelu(0.1),
    Act::Gelu,
];

/// The plan of one step, `input` values in, `output` values out, and its weights.
fn one_step(step: Step, input: usize, output: usize, weights: Vec<Vec<f32>>) -> (Plan, Weights) {
    let plan = Plan {
        batch: 1,
        dtype: DType::F32,
        arena_len: 0,
        wide_len: 0,
        input_len: input,
        output_len: output,
        steps: vec![step],
        origins: vec!["step".into()],
    };
    let mut w = Weights::default();
    for (i, data) in weights.into_iter().enumerate() {
        w.add(&format!("w{i}"), &Arc::new(data), false);
    }
    (plan, w)
}

/// `len` consecutive values from `loc` on.
fn all(loc: Loc) -> Strided {
    Strided {
        loc,
        strides: vec![1],
    }
}

/// A step copying `len` values from `from` to `to`.
fn copy(from: Loc, to: Loc, len: usize) -> Step {
    Step::Ew(EwStep {
        op: None,
        act: Act::None,
        cast: Cast::None,
        dims: vec![len],
        out: all(to),
        a: all(from),
        b: None,
    })
}

/// `plan`, whose product reads its residual from the input at `z` and writes the output, in
/// the form the arena gives it where the residual is read for the last time
/// (`arena::over_residuals`): the residual copied into the arena, the product (and every
/// step after it) writing there over it, the result copied out.
fn over_residual(mut plan: Plan, z: usize) -> Plan {
    let len = plan.output_len;
    for step in &mut plan.steps {
        let residual = match step {
            Step::Conv(c) => &mut c.residual,
            Step::Gemm(GemmStep { residual, .. }) => residual,
            _ => &mut None,
        };
        if *residual == Some(Loc::Input(z)) {
            *residual = Some(Loc::Arena(0));
        }
        for loc in step.locs_mut() {
            if let Loc::Output(o) = *loc {
                *loc = Loc::Arena(o);
            }
        }
    }
    plan.steps
        .insert(0, copy(Loc::Input(z), Loc::Arena(0), len));
    plan.steps.push(copy(Loc::Arena(0), Loc::Output(0), len));
    plan.origins.insert(0, "residual".into());
    plan.origins.push("output".into());
    plan.arena_len = len;
    plan
}

/// Runs the plan with the CPU kernels on one and two threads, with AVX-512 where the CPU has
/// it and without, and with `sim`, and compares.
fn agree(plan: Plan, weights: &Weights, input: &[f32], what: &str) {
    let want = sim::run(&plan, weights, input);
    for avx512 in [true, false] {
        for threads in [1, 2] {
            let mut runner =
                PlanRunner::from_plan(plan.clone(), weights.data.clone(), input.len(), threads)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
            runner.allow_avx512(avx512);
            let got = runner.run(input, 1);
            assert_eq!(got.len(), want.len(), "{what}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g == w || (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                    "{what}, {threads} thread(s), AVX-512 {avx512}: value {i} is {g}, want {w}"
                );
            }
        }
    }
}

/// The kinds of random convolution.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    /// Any: depthwise, grouped or not, few channels.
    Small,
    /// Ungrouped, of 32 to 300 input channels, whose taps the product reads where they lie
    /// (in several blocks of k at 300 with 5×5 and 7×7).
    Wide,
    /// 3×3 of stride 1 with channels and pixels enough for Winograd's F(2×2, 3×3), odd
    /// sizes and padding up to 2 included.
    Winograd,
    /// Grouped, of 1 to 24 channels a group (unfolded below 8, read where they lie from 8),
    /// on images of enough pixels for several blocks of them (`conv_groups`).
    Grouped,
    /// Depthwise, of 1 to 40 channels, on images wide enough for several tiles of pixels
    /// along a row, the tiles at the row's ends reaching into the padding.
    Depthwise,
    /// One group of 1 to 4 input channels (a first layer on RGB or grey frames) and 1 to
    /// 40 output channels, on images wide enough for several tiles of pixels along a row.
    FewChannels,
}

/// A random convolution of the kind `shape`.
fn random_conv(rng: &mut Rng, shape: Shape) -> (Plan, Weights, Vec<f32>, String) {
    let depthwise = shape == Shape::Depthwise || (shape == Shape::Small && rng.below(2) == 0);
    let group = match shape {
        _ if depthwise => 1 + rng.below(40),
        Shape::Small => [1, 1, 2, 3, 4, 8][rng.below(6)],
        Shape::Grouped => 2 + rng.below(4),
        _ => 1,
    };
    let (c, k) = match shape {
        _ if depthwise => (group, group),
        // Up to 20 channels a group: RegNets' groups are 8 to 24 channels wide.
        Shape::Small => (group * (1 + rng.below(20)), group * (1 + rng.below(20))),
        Shape::Grouped => (
            group * [3, 8, 12, 16, 24][rng.below(5)],
            group * (1 + rng.below(24)),
        ),
        Shape::Wide => ([32, 40, 64, 300][rng.below(4)], 1 + rng.below(40)),
        Shape::Depthwise => unreachable!("depthwise above"),
        // Output channels of one register a pixel or two, and either side of their ends
        // (the second panel 8 wide up to 24), as often as any others.
        Shape::FewChannels => (
            1 + rng.below(4),
            match rng.below(2) {
                0 => [8, 9, 16, 17, 24, 25, 32, 33][rng.below(8)],
                _ => 1 + rng.below(40),
            },
        ),
        Shape::Winograd => (
            [32, 40, 64, 96][rng.below(4)],
            [32, 40, 48, 64][rng.below(4)],
        ),
    };
    let (kernel, strides, dilations, sizes) = match shape {
        Shape::Winograd => ([3, 3], [1, 1], [1, 1], 10..19),
        // Mostly the kernels that the AVX-512 rows take in tiles (3 or 5 columns,
        // undilated along the row), at times one they do not.
        Shape::Depthwise => (
            [[3, 3], [5, 5], [3, 5], [5, 3], [7, 7]][rng.below(5)],
            [1 + rng.below(2), 1 + rng.below(2)],
            [1 + rng.below(2), 1 + usize::from(rng.below(4) == 0)],
            8..41,
        ),
        _ => (
            [[1, 1], [3, 3], [5, 5], [1, 3], [7, 7]][rng.below(5)],
            [1 + rng.below(2), 1 + rng.below(2)],
            [1 + rng.below(2), 1 + rng.below(2)],
            match shape {
                Shape::Grouped => 32..65,
                Shape::FewChannels => 8..41,
                _ => 3..12,
            },
        ),
    };
    // Depthwise tiles also meet pixels whose taps along a row all fall in the padding.
    let most_pad = if shape == Shape::Depthwise { 4 } else { 3 };
    let pads = [rng.below(most_pad), rng.below(most_pad)];
    let mut size = || sizes.start + rng.below(sizes.len());
    let (h, w) = (size(), size());
    let n = 1 + rng.below(2);
    let Some(step) = trtclassify_compiler::testing::conv_step(
        [n, c, h, w, k],
        [kernel, strides, pads, dilations],
        Loc::Input(0),
        Loc::Output(0),
    ) else {
        return random_conv(rng, shape);
    };
    let residual = rng.below(2) == 0;
    let act = ACTS[rng.below(ACTS.len())];
    let x_len = n * h * w * c;
    let y_len = n * step.oh * step.ow * k;
    let step = ConvStep {
        group,
        act,
        residual: residual.then_some(Loc::Input(x_len)),
        ..step
    };
    let what = Step::Conv(step.clone()).describe();
    let weight = rng.values(k * kernel[0] * kernel[1] * (c / group));
    let bias = rng.values(k);
    let input = rng.values(x_len + if residual { y_len } else { 0 });
    let (plan, weights) = one_step(Step::Conv(step), input.len(), y_len, vec![weight, bias]);
    (plan, weights, input, what)
}

/// A random convolution's plan, its output written over its residual for odd seeds.
fn random_conv_plan(seed: u64, shape: Shape) -> (Plan, Weights, Vec<f32>, String) {
    let (plan, weights, input, what) = random_conv(&mut Rng(seed), shape);
    let Step::Conv(c) = &plan.steps[0] else {
        unreachable!("one convolution");
    };
    match c.residual {
        Some(Loc::Input(z)) if seed % 2 == 1 => {
            let what = format!("seed {seed}: {what}, in place");
            (over_residual(plan, z), weights, input, what)
        }
        _ => (plan, weights, input, format!("seed {seed}: {what}")),
    }
}

#[test]
fn convolutions_agree_with_the_plain_run() {
    for seed in 0..300 {
        let (plan, weights, input, what) = random_conv_plan(seed, Shape::Small);
        agree(plan, &weights, &input, &what);
    }
}

#[test]
fn depthwise_convolutions_of_wide_images_agree_with_the_plain_run() {
    for seed in 0..80 {
        let (plan, weights, input, what) = random_conv_plan(seed, Shape::Depthwise);
        agree(plan, &weights, &input, &what);
    }
}

#[test]
fn convolutions_of_few_input_channels_agree_with_the_plain_run() {
    let mut outputs = std::collections::BTreeSet::new();
    for seed in 0..80 {
        let (plan, weights, input, what) = random_conv_plan(seed, Shape::FewChannels);
        outputs.extend(plan.steps.iter().filter_map(|step| match step {
            Step::Conv(c) => Some(c.k),
            _ => None,
        }));
        agree(plan, &weights, &input, &what);
    }
    // One register a pixel and two, a second panel of 8 and of 16, and more than two.
    for k in [16, 17, 24, 32, 33] {
        assert!(
            outputs.contains(&k),
            "no convolution of {k} output channels"
        );
    }
}

#[test]
fn convolutions_of_many_channels_agree_with_the_plain_run() {
    for seed in 0..60 {
        let (plan, weights, input, what) = random_conv_plan(seed, Shape::Wide);
        agree(plan, &weights, &input, &what);
    }
}

#[test]
fn grouped_convolutions_of_many_pixels_agree_with_the_plain_run() {
    // Blocks of pixels per group: `conv_groups` takes about 64 Ki values of patches a block.
    let mut several_blocks = 0;
    for seed in 0..24 {
        let (plan, weights, input, what) = random_conv_plan(seed, Shape::Grouped);
        let c = (plan.steps.iter())
            .find_map(|s| match s {
                Step::Conv(c) => Some(c),
                _ => None,
            })
            .expect("a convolution");
        if c.oh * c.ow > crate::kernels::group_block(c) {
            several_blocks += 1;
        }
        agree(plan, &weights, &input, &what);
    }
    assert!(
        several_blocks >= 4,
        "{several_blocks} of 24 in several blocks"
    );
}

#[test]
fn winograd_convolutions_agree_with_the_plain_run() {
    for seed in 0..40 {
        let (plan, weights, input, what) = random_conv_plan(seed, Shape::Winograd);
        let runner = PlanRunner::from_plan(plan.clone(), weights.data.clone(), input.len(), 1)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(runner.winograd_convolutions(), 1, "{what}");
        agree(plan, &weights, &input, &what);
    }
}

#[test]
fn pooling_agrees_with_the_plain_run() {
    for seed in 0..100 {
        let mut rng = Rng(seed);
        let (n, h, w, c) = (
            1 + rng.below(2),
            2 + rng.below(9),
            2 + rng.below(9),
            1 + rng.below(40),
        );
        let kernel = [1 + rng.below(3), 1 + rng.below(3)];
        let strides = [1 + rng.below(2), 1 + rng.below(2)];
        // Pads below the kernel, as ONNX asks: every window holds a pixel.
        let pads = [
            rng.below(kernel[0]),
            rng.below(kernel[1]),
            rng.below(kernel[0]),
            rng.below(kernel[1]),
        ];
        let (Some(oh), Some(ow)) = (
            (h + pads[0] + pads[2]).checked_sub(kernel[0]),
            (w + pads[1] + pads[3]).checked_sub(kernel[1]),
        ) else {
            continue;
        };
        let (oh, ow) = (oh / strides[0] + 1, ow / strides[1] + 1);
        let step = Step::Pool(PoolStep {
            n,
            h,
            w,
            c,
            oh,
            ow,
            kernel,
            strides,
            pads,
            max: rng.below(2) == 0,
            count_include_pad: rng.below(2) == 0,
            x: Loc::Input(0),
            y: Loc::Output(0),
        });
        let what = format!("seed {seed}: {}", step.describe());
        let input = rng.values(n * h * w * c);
        let (plan, weights) = one_step(step, input.len(), n * oh * ow * c, vec![]);
        agree(plan, &weights, &input, &what);
    }
}

/// The squeeze-and-excitation gate, which only the GPU's plans have, runs where a plan has
/// one: each image's gate read from its row and written to its own, with biases or without.
#[test]
fn gates_agree_with_the_plain_run() {
    for (seed, biases) in [(0, true), (1, false)] {
        let mut rng = Rng(seed);
        let (n, c, r) = (3, 40, 6);
        let weight = |index| Loc::Weight { index, offset: 0 };
        let step = Step::Gate(GateStep {
            n,
            c,
            r,
            x: Loc::Input(0),
            w1: weight(0),
            b1: biases.then(|| weight(1)),
            act1: Act::Silu,
            w2: weight(2),
            b2: biases.then(|| weight(3)),
            act2: Act::Sigmoid,
            y: Loc::Output(0),
        });
        let what = format!("seed {seed}: {}", step.describe());
        let input = rng.values(n * c);
        let weights = vec![
            rng.values(c * r),
            rng.values(r),
            rng.values(r * c),
            rng.values(c),
        ];
        let (plan, weights) = one_step(step, input.len(), n * c, weights);
        agree(plan, &weights, &input, &what);
    }
}

#[test]
fn elementwise_steps_agree_with_the_plain_run() {
    let ops = [
        None,
        Some(BinOp::Add),
        Some(BinOp::Sub),
        Some(BinOp::Mul),
        Some(BinOp::Div),
        Some(BinOp::Max),
        Some(BinOp::Min),
    ];
    for seed in 0..200 {
        let mut rng = Rng(seed);
        let mut rank = 1 + rng.below(4);
        let mut dims: Vec<usize> = (0..rank).map(|_| 1 + rng.below(6)).collect();
        // Large enough for the threads to share the rows out.
        if seed % 8 == 0 {
            dims = vec![1100 + rng.below(100), 31];
            rank = 2;
        }
        let total: usize = dims.iter().product();
        let contiguous = |dims: &[usize]| {
            let mut strides = vec![0i64; dims.len()];
            let mut s = 1;
            for d in (0..dims.len()).rev() {
                strides[d] = s;
                s *= dims[d] as i64;
            }
            strides
        };
        // `a` contiguous, or transposed (its strides reversed over reversed sizes).
        let a_strides = match rng.below(2) {
            0 => contiguous(&dims),
            _ => {
                let reversed: Vec<usize> = dims.iter().rev().copied().collect();
                contiguous(&reversed).into_iter().rev().collect()
            }
        };
        // `b` contiguous, broadcast along some dimensions, or a single value.
        let b_strides: Vec<i64> = match rng.below(3) {
            0 => contiguous(&dims),
            1 => contiguous(&dims)
                .into_iter()
                .map(|s| if rng.below(2) == 0 { 0 } else { s })
                .collect(),
            _ => vec![0; rank],
        };
        let op = ops[rng.below(ops.len())];
        let act = ACTS[rng.below(ACTS.len())];
        let step = Step::Ew(EwStep {
            op,
            act,
            cast: Cast::None,
            dims: dims.clone(),
            out: Strided {
                loc: Loc::Output(0),
                strides: contiguous(&dims),
            },
            a: Strided {
                loc: Loc::Input(0),
                strides: a_strides,
            },
            b: op.map(|_| Strided {
                loc: Loc::Input(total),
                strides: b_strides,
            }),
        });
        let what = format!("seed {seed}: {}", step.describe());
        let mut input = rng.values(2 * total);
        // No division by values near zero.
        input[total..]
            .iter_mut()
            .for_each(|v| *v = v.signum() * (v.abs() + 0.5));
        let (plan, weights) = one_step(step, input.len(), total, vec![]);
        agree(plan, &weights, &input, &what);
    }
}

/// The model's input from NCHW to NHWC (`elementwise`'s copy of planes to pixels): frames of
/// 2, 3 and 4 planes, with several threads and without, agree with the plain run.
#[test]
fn frames_of_planes_become_pixels() {
    for (seed, (frames, pixels, planes)) in [
        (2, 1500, 3),
        (1, 5000, 3),
        (2, 12000, 3),
        (1, 700, 4),
        (3, 5, 2),
    ]
    .into_iter()
    .enumerate()
    {
        let mut dims = vec![pixels, planes];
        let mut out = vec![planes as i64, 1];
        let mut a = vec![1, pixels as i64];
        if frames > 1 {
            let frame = (pixels * planes) as i64;
            dims.insert(0, frames);
            out.insert(0, frame);
            a.insert(0, frame);
        }
        let step = Step::Ew(EwStep {
            op: None,
            act: Act::None,
            cast: Cast::None,
            dims,
            out: Strided {
                loc: Loc::Output(0),
                strides: out,
            },
            a: Strided {
                loc: Loc::Input(0),
                strides: a,
            },
            b: None,
        });
        let what = format!("{frames} frames of {planes} planes of {pixels}");
        let total = frames * pixels * planes;
        let input = Rng(seed as u64).values(total);
        let (plan, weights) = one_step(step, total, total, vec![]);
        agree(plan, &weights, &input, &what);
    }
}

/// Convolutions whose weights the plan computes (read from the input here) are packed when
/// they run, and agree as those with constant weights do.
#[test]
fn convolutions_of_computed_weights_agree_with_the_plain_run() {
    for seed in 0..60 {
        let shape = [Shape::Wide, Shape::Small, Shape::Winograd, Shape::Small][seed as usize % 4];
        let (mut plan, weights, mut input, what) = random_conv(&mut Rng(seed), shape);
        let Step::Conv(c) = &mut plan.steps[0] else {
            unreachable!("one convolution");
        };
        c.weight = Loc::Input(input.len());
        input.extend(weights.data[0].iter());
        plan.input_len = input.len();
        agree(
            plan,
            &weights,
            &input,
            &format!("seed {seed}, computed weights: {what}"),
        );
    }
}

/// Matrix products: constant weights (packed in panels) or computed ones (read in place,
/// transposed or not), sizes across the blocks of the panel kernel (rows past 120, k past
/// 256, columns past 128 and off the panel width), bias, residual, scaling, and an
/// activation step after the product that the product takes over.
#[test]
fn products_agree_with_the_plain_run() {
    for seed in 0..64 {
        let mut rng = Rng(seed);
        let size = |rng: &mut Rng, big: usize| match rng.below(3) {
            0 => 1 + rng.below(8),
            1 => 1 + rng.below(40),
            _ => big + rng.below(big),
        };
        let (rows, k, n) = match seed {
            // k in two blocks (over `panels::KC`), tiles of 12 rows, panels of 16 and 8.
            60.. => (
                24 + rng.below(30),
                2049 + rng.below(400),
                [8, 16, 24, 40][seed as usize % 4],
            ),
            _ => (
                size(&mut rng, 130),
                size(&mut rng, 270),
                size(&mut rng, 140),
            ),
        };
        let constant = rng.below(3) > 0;
        let batch = if constant { 1 } else { 1 + rng.below(2) };
        let (bias, residual, transposed) =
            (rng.below(2) == 0, rng.below(2) == 0, rng.below(2) == 0);
        let alpha = [1.0, 0.125][rng.below(2)];
        let act = ACTS[rng.below(ACTS.len())];
        // Several products may all read one x, and write outputs with room between them.
        let x_batch = [rows * k, 0][rng.below(2)];
        let y_batch = rows * n + 8 * rng.below(3);
        let x_len = (batch - 1) * x_batch + rows * k;
        let (w_len, y_len) = (batch * k * n, (batch - 1) * y_batch + rows * n);
        let mut weights = vec![rng.values(batch * n)];
        let w = if constant {
            weights.push(rng.values(w_len));
            Loc::Weight {
                index: 1,
                offset: 0,
            }
        } else {
            Loc::Input(x_len)
        };
        let z = x_len + if constant { 0 } else { w_len };
        let gemm = Step::Gemm(GemmStep {
            batch,
            alpha,
            rows,
            n,
            k,
            x: Loc::Input(0),
            x_batch,
            w,
            w_transposed: transposed,
            bias: bias.then_some(Loc::Weight {
                index: 0,
                offset: 0,
            }),
            residual: residual.then_some(Loc::Input(z)),
            act: if act == Act::Relu { act } else { Act::None },
            y: Loc::Output(0),
            y_batch,
            quant: None,
            algo: None,
        });
        let in_place = residual && seed % 2 == 1;
        let what = format!(
            "seed {seed}: {} then {act:?}{}",
            gemm.describe(),
            if in_place { ", in place" } else { "" }
        );
        let whole = Strided {
            loc: Loc::Output(0),
            strides: vec![1],
        };
        let activation = Step::Ew(EwStep {
            op: None,
            act,
            cast: Cast::None,
            dims: vec![y_len],
            out: whole.clone(),
            a: whole,
            b: None,
        });
        let input = rng.values(z + if residual { y_len } else { 0 });
        let (mut plan, weights) = one_step(gemm, input.len(), y_len, weights);
        plan.steps.push(activation);
        plan.origins.push("activation".into());
        // What lies between the products' outputs is theirs to leave alone: zeroed first,
        // both runs then hold the same there.
        for p in (0..batch - 1).filter(|_| y_batch > rows * n) {
            let gap = Step::Zero(ZeroStep {
                loc: Loc::Output(p * y_batch + rows * n),
                len: y_batch - rows * n,
            });
            plan.steps.insert(0, gap);
            plan.origins.insert(0, "gap".into());
        }
        if in_place {
            plan = over_residual(plan, z);
        }
        agree(plan, &weights, &input, &what);
    }
}

/// A per-channel scale before a 1×1 convolution (squeeze-and-excitation's) is folded into
/// the convolution's weights for the frame where nothing else reads the scaled values and
/// the convolution's output does not overwrite the unscaled ones, and left as it is
/// otherwise: the outputs are the plain run's either way.
/// A 1×1 convolution as the lowering gives it: `rows` NHWC pixels of `c` channels at `x`
/// times the `c × n` weights (weight 0, bias weight 1), into `y`, no activation.
fn pointwise(rows: usize, c: usize, n: usize, x: Loc, y: Loc, residual: Option<Loc>) -> Step {
    Step::Gemm(GemmStep {
        batch: 1,
        alpha: 1.0,
        rows,
        n,
        k: c,
        x,
        x_batch: 0,
        w: Loc::Weight {
            index: 0,
            offset: 0,
        },
        w_transposed: false,
        bias: Some(Loc::Weight {
            index: 1,
            offset: 0,
        }),
        residual,
        act: Act::None,
        y,
        y_batch: 0,
        quant: None,
        algo: None,
    })
}

#[test]
fn scales_before_a_pointwise_convolution_fold_into_it() {
    for seed in 0..12 {
        let mut rng = Rng(seed);
        let (h, w, c) = (5 + rng.below(4), 6, 1 + rng.below(20));
        // The scaled values read again after the product, or by the product as its
        // residual; the product's output placed over the unscaled input, whose last reader
        // was the scaling (as the arena may place it).
        let (read_again, over_input) = (seed % 4 == 3, seed % 4 == 1);
        let residual_scaled = seed % 4 == 2 && seed > 4;
        let pixels = h * w;
        let k = if residual_scaled {
            c
        } else {
            1 + rng.below(29)
        };
        let (scaled, unscaled) = (Loc::Arena(0), Loc::Arena(pixels * c));
        let y = if over_input {
            unscaled
        } else {
            Loc::Arena(2 * pixels * c)
        };
        let x = Strided {
            loc: unscaled,
            strides: vec![c as i64, 1],
        };
        let s = Strided {
            loc: Loc::Input(pixels * c),
            strides: vec![0, 1],
        };
        let (a, b) = if seed % 2 == 0 { (x, s) } else { (s, x) };
        let scale = Step::Ew(EwStep {
            op: Some(BinOp::Mul),
            act: Act::None,
            cast: Cast::None,
            dims: vec![pixels, c],
            out: Strided {
                loc: scaled,
                strides: vec![c as i64, 1],
            },
            a,
            b: Some(b),
        });
        // The 1×1 convolution, as the lowering gives it: NHWC pixels times the weights,
        // and its activation a step of its own, which the product takes over.
        let conv = pointwise(pixels, c, k, scaled, y, residual_scaled.then_some(scaled));
        let silu = Step::Ew(EwStep {
            op: None,
            act: Act::Silu,
            cast: Cast::None,
            dims: vec![pixels * k],
            out: all(y),
            a: all(y),
            b: None,
        });
        let input = rng.values(pixels * c + c);
        let weights = vec![rng.values(k * c), rng.values(k)];
        let out_len = pixels * k + if read_again { pixels * c } else { 0 };
        let (mut plan, weights) = one_step(
            copy(Loc::Input(0), unscaled, pixels * c),
            input.len(),
            out_len,
            weights,
        );
        plan.arena_len = 2 * pixels * c + pixels * k;
        plan.steps
            .extend([scale, conv, silu, copy(y, Loc::Output(0), pixels * k)]);
        if read_again {
            plan.steps
                .push(copy(scaled, Loc::Output(pixels * k), pixels * c));
        }
        plan.origins = vec!["step".into(); plan.steps.len()];
        let runner = PlanRunner::from_plan(plan.clone(), weights.data.clone(), input.len(), 1)
            .expect("plan");
        let what = format!(
            "seed {seed}: {h}x{w}x{c} -> {k}, read again: {read_again}, over the input: \
             {over_input}, the residual: {residual_scaled}"
        );
        let folded = !read_again && !over_input && !residual_scaled;
        assert_eq!(runner.scaled_inputs(), usize::from(folded), "{what}");
        agree(plan, &weights, &input, &what);
    }
}

#[test]
fn products_write_into_their_concatenation_where_nothing_else_reads_their_output() {
    for seed in 0..24 {
        let mut rng = Rng(seed);
        // The second branch's convolution by Winograd's transform for some seeds.
        let winograd = seed / 4 % 2 == 1;
        let (h, w, c) = match winograd {
            true => (8 + rng.below(4), 8 + rng.below(4), 16 * (1 + rng.below(2))),
            false => (3 + rng.below(6), 4 + rng.below(6), 1 + rng.below(24)),
        };
        let (k1, k2) = match winograd {
            true => (1 + rng.below(40), 32),
            false => (1 + rng.below(40), 2 * (1 + rng.below(20))),
        };
        let (pixels, wide) = (h * w, k1 + k2);
        // The first branch's output read again after its copy; the concatenation placed over
        // the second branch's input, whose last reader is that branch (as the arena may
        // place it); the second branch adding a residual.
        let (read_again, over_input, residual) = (seed % 4 == 1, seed % 4 == 2, seed % 4 == 3);
        let group = if winograd { 1 } else { 1 + rng.below(2) };
        let (t1, t2, x) = (0, pixels * k1, pixels * wide);
        let concat = if over_input { x } else { x + pixels * 2 * c };
        // Branch 1: a 1×1 convolution as the lowering gives it, NHWC pixels times the
        // weights, its activation a step of its own (which the product takes over).
        let product = pointwise(pixels, c, k1, Loc::Input(0), Loc::Arena(t1), None);
        // A clamp, which the tile applies in registers, or an activation it applies in a
        // pass over the rows it wrote.
        let act = if seed % 3 == 0 { Act::Silu } else { Act::Relu };
        let relu = Step::Ew(EwStep {
            op: None,
            act,
            cast: Cast::None,
            dims: vec![pixels * k1],
            out: all(Loc::Arena(t1)),
            a: all(Loc::Arena(t1)),
            b: None,
        });
        // Branch 2: a padded 3×3 convolution (grouped for some seeds) of the input's copy.
        let conv = trtclassify_compiler::testing::conv_step(
            [1, 2 * c, h, w, k2],
            [[3, 3], [1, 1], [1, 1], [1, 1]],
            Loc::Arena(x),
            Loc::Arena(t2),
        )
        .expect("a padded 3×3 convolution keeps the size");
        let conv = Step::Conv(ConvStep {
            group,
            act: Act::Relu,
            weight: Loc::Weight {
                index: 2,
                offset: 0,
            },
            bias: Loc::Weight {
                index: 3,
                offset: 0,
            },
            residual: residual.then_some(Loc::Input(0)),
            ..conv
        });
        let into_concat = |from: usize, len: usize, at: usize| {
            Step::Ew(EwStep {
                op: None,
                act: Act::None,
                cast: Cast::None,
                dims: vec![pixels, len],
                out: Strided {
                    loc: Loc::Arena(concat + at),
                    strides: vec![wide as i64, 1],
                },
                a: Strided {
                    loc: Loc::Arena(from),
                    strides: vec![len as i64, 1],
                },
                b: None,
            })
        };
        // The residual, where there is one, is the input's first `pixels × k2` values.
        let input = rng.values(pixels * c.max(k2) * 2);
        let weights = vec![
            rng.values(c * k1),
            rng.values(k1),
            rng.values(k2 * 9 * 2 * c / group),
            rng.values(k2),
        ];
        let out_len = pixels * wide + if read_again { pixels * k1 } else { 0 };
        let (mut plan, weights) = one_step(
            copy(Loc::Input(0), Loc::Arena(x), pixels * 2 * c),
            input.len(),
            out_len,
            weights,
        );
        plan.arena_len = (concat + pixels * wide).max(x + pixels * 2 * c);
        plan.steps.extend([
            product,
            relu,
            conv,
            into_concat(t1, k1, 0),
            into_concat(t2, k2, k1),
            copy(Loc::Arena(concat), Loc::Output(0), pixels * wide),
        ]);
        if read_again {
            plan.steps.push(copy(
                Loc::Arena(t1),
                Loc::Output(pixels * wide),
                pixels * k1,
            ));
        }
        plan.origins = vec!["step".into(); plan.steps.len()];
        let runner = PlanRunner::from_plan(plan.clone(), weights.data.clone(), input.len(), 1)
            .expect("plan");
        let what = format!(
            "seed {seed}: {h}x{w}x{c} -> {k1} + {k2} (group {group}), read again: \
             {read_again}, over the input: {over_input}, a residual: {residual}"
        );
        assert_eq!(
            runner.winograd_convolutions(),
            usize::from(winograd),
            "{what}"
        );
        let in_place = match seed % 4 {
            0 => 2,
            1 | 3 => 1,
            _ => 0,
        };
        assert_eq!(runner.concat_inputs_in_place(), in_place, "{what}");
        agree(plan, &weights, &input, &what);
    }
}

/// The small CNN committed in `models/`.
fn committed_cnn() -> trtclassify_compiler::OnnxModel {
    trtclassify_compiler::OnnxModel::load(&trtclassify_compiler::testing::models().join("cnn.onnx"))
        .expect("model loads")
}

#[test]
fn frames_spread_over_threads_give_the_same_scores() {
    // The committed CNN, five frames: one thread, two threads over frames, and a fixed batch
    // of one frame on two threads (its layers spread) all give the same scores.
    let model = committed_cnn();
    let spec = model.input_spec(None).expect("input");
    let mut rng = Rng(7);
    let input = rng.values(5 * spec.frame_len());
    let one = PlanRunner::new(&model, spec, 1, 1, 1)
        .expect("plan")
        .run(&input, 5);
    let two = PlanRunner::new(&model, spec, 1, 1, 2)
        .expect("plan")
        .run(&input, 5);
    assert_eq!(one.len(), 5 * 10);
    assert_eq!(one, two);
    let single = PlanRunner::new(&model, spec, 1, 1, 2)
        .expect("plan")
        .run(&input[..spec.frame_len()], 1);
    assert_eq!(single, one[..10]);
}

#[test]
fn a_frame_that_finds_the_team_taken_runs_on_the_pool_with_the_same_scores() {
    // Another run holds the team (as another element's would): a frame on two threads runs
    // its steps over the shared pool instead, and a batch its shares of frames, to the same
    // scores as on one thread, and as the same runner's with the team.
    use std::sync::mpsc::channel;
    let model = committed_cnn();
    let spec = model.input_spec(None).expect("input");
    let input = Rng(11).values(4 * spec.frame_len());
    let one = PlanRunner::new(&model, spec, 1, 1, 1)
        .expect("plan")
        .run(&input[..spec.frame_len()], 1);
    let two = PlanRunner::new(&model, spec, 1, 4, 2).expect("plan");
    // Two frames a thread through the same batched tail, with the team (or the pool, where
    // another test's run holds it: the frames' scores do not depend on which).
    let with_team = two.run(&input, 4);
    let (held, taken) = channel();
    let (release, done) = channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            // Other tests' runs may hold the team for a moment: until it is ours.
            let mut hold = || {
                held.send(()).expect("the test waits");
                done.recv().expect("the test releases the team");
            };
            while let Err(back) = super::kernels::Team::run(2, hold) {
                hold = back;
                std::thread::yield_now();
            }
        });
        // Dropped on a panic below, which lets the holder go before the scope joins it.
        let release = release;
        taken.recv().expect("the team held");
        let frame = two.run(&input[..spec.frame_len()], 1);
        let batch = two.run(&input, 4);
        release.send(()).expect("the holder waits");
        assert_eq!(frame.len(), 10);
        assert_eq!(frame, one);
        assert_eq!(batch.len(), 40);
        assert_eq!(batch, with_team);
    });
}

#[test]
fn frames_through_a_batched_tail_score_as_one_by_one() {
    // The committed CNN and the model of every operator PyTorch exports, four frames: the
    // batch plan's tail cut at each step where one can be (residual blocks, squeeze and
    // excitation, concatenations, pooling on either side) scores as the one-frame plan does
    // frame by frame, on one thread and on two (two frames each, the tail then for two).
    let root = trtclassify_compiler::testing::models();
    let mut cuts = 0;
    for name in ["cnn.onnx", "ops.onnx"] {
        let model = trtclassify_compiler::OnnxModel::load(&root.join(name)).expect("model loads");
        let spec = model.input_spec(None).expect("input");
        let frame_len = spec.frame_len();
        let input = Rng(5).values(4 * frame_len);
        for (threads, batch) in [(1, 4), (2, 2)] {
            let (plans, weights) =
                trtclassify_compiler::compile_for_cpu(&model, &[1, batch], spec).expect("compiles");
            let one = PlanRunner::from_plan(plans[0].clone(), weights.data.clone(), frame_len, 1)
                .expect("plan");
            let want = one.run(&input, 4);
            for at in 0..plans[0].steps.len() {
                let runner = PlanRunner::from_plans(
                    plans[0].clone(),
                    Some(plans[1].clone()),
                    weights.data.clone(),
                    frame_len,
                    threads,
                    Some(at),
                )
                .expect("plans");
                let Some((steps, frames)) = runner.batched_tail() else {
                    continue;
                };
                assert_eq!(
                    (steps, frames),
                    (plans[0].steps.len() - at, batch),
                    "{name}: the tail from step {at}"
                );
                cuts += 1;
                let got = runner.run(&input, 4);
                assert_eq!(got.len(), want.len());
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                        "{name}, {threads} thread(s), tail from step {at} ({}): \
                         score {i} is {g}, one by one {w}",
                        plans[0].steps[at].describe()
                    );
                }
            }
        }
    }
    assert!(cuts > 40, "only {cuts} cuts");
}

#[test]
fn frames_given_channels_last_are_read_where_they_lie() {
    // The committed CNN and the model of every operator PyTorch exports (both NCHW), five
    // frames: the plan for frames given channels-last has no first copy, reads the input
    // buffer itself, and scores as the plan for the model's layout does on the same frames
    // laid out planar, bit for bit, frame by frame and through a batched tail on two threads.
    use trtclassify_compiler::spec::Layout;
    let root = trtclassify_compiler::testing::models();
    for name in ["cnn.onnx", "ops.onnx"] {
        let model = trtclassify_compiler::OnnxModel::load(&root.join(name)).expect("model loads");
        let planar = model.input_spec(None).expect("input");
        assert_eq!(planar.layout, Layout::Nchw, "{name}");
        let last = trtclassify_compiler::spec::InputSpec {
            layout: Layout::Nhwc,
            ..planar
        };
        let (c, plane) = (planar.channels, planar.height * planar.width);
        let frames = Rng(3).values(5 * planar.frame_len());
        let mut pixels = vec![0.0; frames.len()];
        for (src, dst) in frames
            .chunks_exact(c * plane)
            .zip(pixels.chunks_exact_mut(c * plane))
        {
            for p in 0..plane {
                for ch in 0..c {
                    dst[p * c + ch] = src[ch * plane + p];
                }
            }
        }
        let (want_plans, _) =
            trtclassify_compiler::compile_for_cpu(&model, &[1], planar).expect("compiles");
        let (plans, _) =
            trtclassify_compiler::compile_for_cpu(&model, &[1], last).expect("compiles");
        assert_eq!(
            plans[0].steps.len() + 1,
            want_plans[0].steps.len(),
            "{name}: the input's copy left out"
        );
        assert!(
            plans[0].steps[0]
                .locs()
                .iter()
                .any(|l| matches!(l, Loc::Input(_))),
            "{name}: the first step reads the frames"
        );
        for (threads, frames_at_once) in [(1, 1), (2, 5)] {
            let want = PlanRunner::new(&model, planar, 1, frames_at_once, threads)
                .expect("plan")
                .run(&frames, 5);
            let runner = PlanRunner::new(&model, last, 1, frames_at_once, threads).expect("plan");
            assert_eq!(
                runner.batched_tail().is_some(),
                frames_at_once > threads,
                "{name}"
            );
            let got = runner.run(&pixels, 5);
            assert_eq!(got.len(), 5 * runner.num_classes(), "{name}");
            assert_eq!(got, want, "{name}, {threads} thread(s)");
        }
    }
}

/// Calibration on the CPU's kernels finds what `sim` found for the committed digits table
/// (`trtclassify-compiler`'s `calibration_makes_the_committed_digits_table`): the same
/// ranges and errors, up to the order of the sums.
#[test]
fn cpu_calibration_makes_the_committed_digits_table() {
    use trtclassify_compiler::quant::CalibrationTable;
    use trtclassify_compiler::testing::{digits_calibration, models};
    let model = trtclassify_compiler::OnnxModel::load(&models().join("digits/digits.onnx"))
        .expect("digits.onnx");
    let spec = model.input_spec(None).expect("an image input");
    let mut runner = super::CalibrationRunner::new(&model, spec).expect("compiles");
    let frames = digits_calibration();
    for i in 0..frames.frames.len() {
        runner.run(&frames.model_input(i));
    }
    assert_eq!(runner.frames(), 128);
    let got = runner.table();
    let want = CalibrationTable::load(&models().join("digits/digits_calibration.txt"))
        .expect("the committed table");
    assert_eq!(got.nodes.len(), want.nodes.len());
    for (name, w) in &want.nodes {
        let g = got.get(name).unwrap_or_else(|| panic!("{name} calibrated"));
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-3 * b.abs().max(1e-3);
        assert!(
            close(g.amax, w.amax)
                && close(g.int8, w.int8)
                && close(g.int8_error, w.int8_error)
                && close(g.fp8_error, w.fp8_error),
            "{name}: {g:?}, committed {w:?}"
        );
    }
}
