// SPDX-License-Identifier: MPL-2.0
//! A convolution's weights rearranged once, when the plan is loaded, for the kernel that
//! runs it: apart from the kernels, which only read the result.

use std::sync::Arc;

use super::is_depthwise;
use crate::kernels::panels::Panels;
use crate::kernels::winograd;
use crate::kernels::{Aligned, Packed};
use trtclassify_compiler::plan::{Loc, Step};

pub fn pack(step: &Step, weights: &[Arc<Vec<f32>>]) -> Packed {
    let Step::Conv(c) = step else {
        return Packed::None;
    };
    // Only the GPU's plans take an activation into a convolution's input
    // (`compile_for_cpu` never does), and no kernel here applies one.
    assert!(
        c.act_in.is_none(),
        "a CPU plan with an activation in a convolution's input"
    );
    let Loc::Weight { index, offset } = c.weight else {
        // A weight computed by the plan is read as it is, at run time.
        return Packed::None;
    };
    let krsc = &weights[index][offset..];
    let taps = c.kernel[0] * c.kernel[1];
    if is_depthwise(c) {
        let mut packed = vec![0.0; taps * c.k];
        for k in 0..c.k {
            for t in 0..taps {
                packed[t * c.k + k] = krsc[k * taps + t];
            }
        }
        return Packed::Depthwise(Arc::new(Aligned::from_slice(&packed)));
    }
    let (cg, kg) = (c.c / c.group, c.k / c.group);
    let rows = taps * cg;
    if winograd::fits(c) {
        return Packed::Winograd(winograd::pack(c, krsc));
    }
    if c.group == 1 {
        return Packed::Panels(
            Panels::pack(rows, c.k, 1.0, |i, j| krsc[j * rows + i]),
            None,
        );
    }
    let groups = (0..c.group)
        .map(|g| Panels::pack(rows, kg, 1.0, |i, j| krsc[(g * kg + j) * rows + i]))
        .collect();
    Packed::Groups(groups)
}
