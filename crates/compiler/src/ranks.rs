// SPDX-License-Identifier: MPL-2.0
//! Tensor ranks through an ONNX graph, to check axis attributes before any backend sees them.
//!
//! tract indexes shapes with the axes a node declares and panics on one beyond the rank (the
//! fuzzer found `Flatten axis=5` on a 4-D tensor). Ranks are cheap to follow from the image
//! input: most operators keep the rank of their input, and those that change it say how in
//! their attributes or constant inputs. A value whose rank is not known from that is skipped.

use std::collections::HashMap;

use tract_onnx::pb;

/// Checks every axis attribute whose tensor's rank is known; the error names the node.
pub fn check_axes(graph: &pb::GraphProto, input: &str, input_rank: usize) -> Result<(), String> {
    let mut ranks: HashMap<&str, usize> = graph
        .initializer
        .iter()
        .map(|t| (t.name.as_str(), t.dims.len()))
        .collect();
    ranks.insert(input, input_rank);
    let constant_nodes = graph.node.iter().filter(|n| n.op_type == "Constant");
    let consts: HashMap<&str, &pb::TensorProto> = graph
        .initializer
        .iter()
        .map(|t| (t.name.as_str(), t))
        .chain(constant_nodes.filter_map(|n| {
            let value = n.attribute.iter().find(|a| a.name == "value")?.t.as_ref()?;
            Some((n.output.first()?.as_str(), value))
        }))
        .collect();
    for node in &graph.node {
        let rank = |i: usize| {
            node.input
                .get(i)
                .and_then(|name| ranks.get(name.as_str()).copied())
        };
        let int = |name: &str| node.attribute.iter().find(|a| a.name == name).map(|a| a.i);
        let ints = |name: &str| {
            node.attribute
                .iter()
                .find(|a| a.name == name)
                .map(|a| a.ints.clone())
                // From opset 13 on, axes come as a constant input.
                .or_else(|| {
                    node.input
                        .get(1)
                        .and_then(|n| consts.get(n.as_str()))
                        .map(|t| {
                            let raw = t.raw_data.chunks_exact(8);
                            let raw = raw.map(|b| i64::from_le_bytes(b.try_into().expect("8")));
                            t.int64_data.iter().copied().chain(raw).collect()
                        })
                })
        };
        let check = |axis: i64, rank: usize, inclusive: bool| {
            let r = rank as i64;
            let top = if inclusive { r } else { r - 1 };
            if axis < -r || axis > top {
                Err(format!(
                    "{} node `{}` has axis {axis}, but its input has {rank} axes",
                    node.op_type, node.name
                ))
            } else {
                Ok(())
            }
        };
        let out = match (node.op_type.as_str(), rank(0)) {
            (_, None) if !matches!(node.op_type.as_str(), "Constant" | "Shape") => None,
            ("Flatten", Some(r)) => {
                check(int("axis").unwrap_or(1), r, true)?;
                Some(2)
            }
            ("Softmax" | "LogSoftmax" | "Hardmax" | "Concat" | "Split", Some(r)) => {
                if let Some(axis) = int("axis") {
                    check(axis, r, false)?;
                }
                Some(r)
            }
            ("Gather", Some(r)) => {
                check(int("axis").unwrap_or(0), r, false)?;
                rank(1).map(|q| r - 1 + q)
            }
            ("Transpose", Some(r)) => {
                if let Some(perm) = ints("perm")
                    && (perm.len() != r || perm.iter().any(|&p| p < 0 || p >= r as i64))
                {
                    return Err(format!(
                        "Transpose node `{}` has perm {perm:?}, but its input has {r} axes",
                        node.name
                    ));
                }
                Some(r)
            }
            ("Squeeze" | "ReduceMean" | "ReduceSum" | "ReduceMax" | "ReduceMin", Some(r)) => {
                let axes = ints("axes");
                for &axis in axes.iter().flatten() {
                    check(axis, r, false)?;
                }
                let keep = node.op_type != "Squeeze" && int("keepdims").unwrap_or(1) != 0;
                match axes {
                    _ if keep => Some(r),
                    Some(axes) if !axes.is_empty() => Some(r.saturating_sub(axes.len())),
                    _ => None,
                }
            }
            ("Unsqueeze", Some(r)) => match ints("axes") {
                Some(axes) => {
                    for &axis in &axes {
                        check(axis, r + axes.len(), false)?;
                    }
                    Some(r + axes.len())
                }
                None => None,
            },
            ("Add" | "Sub" | "Mul" | "Div" | "Pow" | "Max" | "Min" | "Sum" | "Mean", _) => node
                .input
                .iter()
                .map(|i| ranks.get(i.as_str()).copied())
                .collect::<Option<Vec<_>>>()
                .and_then(|r| r.into_iter().max()),
            ("Gemm" | "Shape", _) => Some(if node.op_type == "Shape" { 1 } else { 2 }),
            ("Reshape", _) => node
                .input
                .get(1)
                .and_then(|n| consts.get(n.as_str()))
                .map(|t| t.int64_data.len().max(t.raw_data.len() / 8)),
            ("Constant", _) => node
                .attribute
                .iter()
                .find(|a| a.name == "value")
                .and_then(|a| a.t.as_ref())
                .map(|t| t.dims.len()),
            (op, Some(r)) if keeps_rank(op) => Some(r),
            _ => None,
        };
        if let (Some(r), Some(name)) = (out, node.output.first()) {
            ranks.insert(name, r);
        }
    }
    Ok(())
}

/// Operators whose output has the rank of their first input (broadcasting ones only when
/// the other operand is not of higher rank, which image classifiers do not do): the
/// functions of one value that `ops::elementwise` declares, and these.
fn keeps_rank(op: &str) -> bool {
    crate::ops::elementwise::UNARY.contains(&op)
        || matches!(
            op,
            "Conv"
                | "BatchNormalization"
                | "MaxPool"
                | "AveragePool"
                | "GlobalAveragePool"
                | "GlobalMaxPool"
                | "LRN"
                | "Dropout"
                | "Identity"
                | "Cast"
                | "Pad"
                | "InstanceNormalization"
                | "LayerNormalization"
        )
}
