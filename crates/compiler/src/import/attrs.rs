// SPDX-License-Identifier: MPL-2.0
//! A node's attributes, and the axes and 2-D parameters they give.

use tract_onnx::pb;

/// A node's attributes, looked up by name; an absent one is `None` (its default applies).
pub(crate) struct Attrs<'a>(pub(crate) &'a [pb::AttributeProto]);

impl Attrs<'_> {
    fn get(&self, name: &str) -> Option<&pb::AttributeProto> {
        self.0.iter().find(|a| a.name == name)
    }
    pub(crate) fn i(&self, name: &str) -> Option<i64> {
        self.get(name).map(|a| a.i)
    }
    pub(crate) fn f(&self, name: &str) -> Option<f32> {
        self.get(name).map(|a| a.f)
    }
    pub(crate) fn s(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(|a| std::str::from_utf8(&a.s).ok())
    }
    pub(crate) fn ints(&self, name: &str) -> Option<&[i64]> {
        self.get(name).map(|a| a.ints.as_slice())
    }
    pub(crate) fn floats(&self, name: &str) -> Option<&[f32]> {
        self.get(name).map(|a| a.floats.as_slice())
    }
    pub(crate) fn tensor(&self, name: &str) -> Option<&pb::TensorProto> {
        self.get(name).and_then(|a| a.t.as_ref())
    }

    /// A 2-D attribute such as strides; `default` when absent (0 means it is required).
    pub(crate) fn pair(&self, name: &str, default: usize) -> Result<[usize; 2], String> {
        match self.ints(name) {
            Some([a, b]) if *a > 0 && *b > 0 => Ok([*a as usize, *b as usize]),
            None if default > 0 => Ok([default; 2]),
            other => Err(format!("{name} {other:?} is not two positive values")),
        }
    }

    /// Pads as top, left, bottom, right, from `pads` or `auto_pad`.
    pub(crate) fn pads(
        &self,
        input: &[usize],
        kernel: &[usize; 2],
        strides: &[usize; 2],
        dilations: &[usize; 2],
    ) -> Result<[usize; 4], String> {
        match self.s("auto_pad").unwrap_or("NOTSET") {
            "NOTSET" | "" => match self.ints("pads") {
                None => Ok([0; 4]),
                Some(p) if p.len() == 4 && p.iter().all(|&v| v >= 0) => {
                    Ok([p[0] as usize, p[1] as usize, p[2] as usize, p[3] as usize])
                }
                Some(p) => Err(format!("pads {p:?} are not four values ≥ 0")),
            },
            "VALID" => Ok([0; 4]),
            mode @ ("SAME_UPPER" | "SAME_LOWER") => {
                let mut pads = [0; 4];
                for a in 0..2 {
                    let out = input[a].div_ceil(strides[a]);
                    let span = (kernel[a] - 1) * dilations[a] + 1;
                    let total = ((out - 1) * strides[a] + span).saturating_sub(input[a]);
                    let (small, big) = (total / 2, total - total / 2);
                    (pads[a], pads[a + 2]) = if mode == "SAME_UPPER" {
                        (small, big)
                    } else {
                        (big, small)
                    };
                }
                Ok(pads)
            }
            other => Err(format!("auto_pad {other} is not supported")),
        }
    }
}

/// `axis` of a tensor of `rank` dimensions, counted from the end when negative.
pub(crate) fn axis_of(axis: i64, rank: i64) -> Result<usize, String> {
    let a = if axis < 0 { axis + rank } else { axis };
    match (0..rank).contains(&a) {
        true => Ok(a as usize),
        false => Err(format!(
            "axis {axis} is out of range for a tensor of rank {rank}"
        )),
    }
}

/// `axis` counted from the end when negative, clamped into `0..rank`.
pub(crate) fn norm_axis(axis: i64, rank: i64) -> usize {
    (if axis < 0 { axis + rank } else { axis }).clamp(0, (rank - 1).max(0)) as usize
}
