// SPDX-License-Identifier: MPL-2.0
//! A product whose columns are only ever read in groups, one group per Slice (attention's
//! query, key and value, projected together and picked apart), becomes one product per group.
//! The projection `[rows, 3·E]` is otherwise written once and then copied out group by group,
//! each copy strided; a product per group writes each one compact where the attention reads it.
//!
//! The groups are found through the views between the product and the slices: a reshape that
//! splits the product's last axis into `[groups, columns…]`, then transposes, and reshapes that
//! only add and remove axes of 1. torchvision's ViT: `unflatten(-1, (3, E))`,
//! `unsqueeze(0).transpose(0, -2).squeeze(-2)` and `proj[i]`; Swin and timm's models:
//! `reshape(B, N, 3, heads, head_size).permute(2, 0, 3, 1, 4)` and `qkv[i]` or `unbind(0)`.
//! Each slice then holds its group's product seen through the same views (a reshape, and the
//! transpose of the axes the permutation moved), which cost no copy. Slices straight across
//! the columns, all as wide (MaxViT's `chunk(3, dim=-1)`), are groups too.

use super::ir::{Graph, Node, Op, Tensor};

/// Where an axis of a view of the product's output comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Axis {
    /// Axis `i` of the product's output, before its last.
    Lead(usize),
    /// The product's last axis, not yet split.
    Columns,
    /// Which group of columns.
    Group,
    /// An axis of the columns within a group, which the split may cut into several (the
    /// heads and the values of a head).
    InGroup(usize),
    /// An axis of 1 added on the way.
    Unit,
}

/// Splits every product that fits (see the module's comment).
pub(super) fn split_products(graph: &mut Graph) {
    let mut p = 0;
    while p < graph.nodes.len() {
        match plan_split(graph, p) {
            Some(split) => apply(graph, p, split),
            None => p += 1,
        }
    }
}

/// The rewrite of product `p`: the view nodes between it and the slices, and each slice's
/// index with its group.
struct Split {
    views: Vec<usize>,
    slices: Vec<(usize, usize)>,
    groups: usize,
    /// The shape of one group's product seen as the slices' axes before they are
    /// transposed: the product's leading axes past 1, then the group's columns as split.
    grouped: Vec<usize>,
    /// Where the slices have those axes: axis `i` of a slice is axis `perm[i]` of `grouped`.
    perm: Vec<usize>,
}

fn plan_split(graph: &Graph, p: usize) -> Option<Split> {
    let product = &graph.nodes[p];
    if !matches!(product.op, Op::Gemm { .. }) || product.inputs.len() > 3 {
        return None;
    }
    // Constant weights (and bias) to cut into groups.
    if !product.inputs[1..].iter().all(|w| graph.is_const(w)) {
        return None;
    }
    let shape = graph.shape(&product.output);
    let lead = shape.len() - 1;
    let mut axes: Vec<Axis> = (0..lead).map(Axis::Lead).chain([Axis::Columns]).collect();
    let mut views = Vec::new();
    let mut value = product.output.clone();
    let mut split = None;
    // Down the chain of views, each the only reader of the one before; `readers` ends
    // holding the readers of the last.
    let mut readers: Vec<usize>;
    loop {
        readers = (0..graph.nodes.len())
            .filter(|&i| graph.nodes[i].inputs.contains(&value))
            .collect();
        let &[r] = readers.as_slice() else { break };
        let node = &graph.nodes[r];
        let out_shape = graph.shape(&node.output);
        axes = match &node.op {
            Op::Transpose { perm } => perm.iter().map(|&a| axes[a]).collect(),
            Op::Reshape => {
                let (next, columns) = reshaped(graph.shape(&value), &axes, out_shape)?;
                if columns.is_some() {
                    split = columns;
                }
                next
            }
            _ => break,
        };
        views.push(r);
        value = node.output.clone();
    }
    // A reader's slice: its axis, start, width and step.
    let slice_of = |i: usize| match graph.nodes[i].op {
        Op::Slice {
            axis,
            start,
            end,
            step,
        } => Some((
            axis,
            start,
            end.checked_sub(start).filter(|&w| w > 0)?,
            step,
        )),
        _ => None,
    };
    // Each reader is a slice of one group: one element of the group axis where a reshape
    // cut the columns into groups; else a run of the columns themselves, all as wide (MaxViT's
    // `chunk(3, dim=-1)`), after which that axis holds one group's columns.
    let (axis, width, groups, columns) = match split {
        Some((groups, columns)) => {
            let axis = axes.iter().position(|&a| a == Axis::Group)?;
            (axis, 1, groups, columns)
        }
        None => {
            let axis = axes.iter().position(|&a| a == Axis::Columns)?;
            let (_, _, width, _) = slice_of(*readers.first()?)?;
            let n = shape[lead];
            if !n.is_multiple_of(width) || n / width < 2 {
                return None;
            }
            axes[axis] = Axis::InGroup(0);
            (axis, width, n / width, vec![width])
        }
    };
    let slices = readers
        .iter()
        .map(|&i| {
            let (a, start, w, step) = slice_of(i)?;
            // The step of a slice one element wide reads nothing else.
            let fits = a == axis && w == width && start.is_multiple_of(width);
            (fits && (w == 1 || step == 1)).then_some((i, start / width))
        })
        .collect::<Option<Vec<_>>>()?;
    // Apart from the group axis, a slice's axes are the product's leading axes and the
    // group's columns as split, in an order that a transpose of the group's product gives.
    let grouped_axes: Vec<Axis> = (0..lead)
        .filter(|&i| shape[i] != 1)
        .map(Axis::Lead)
        .chain((0..columns.len()).map(Axis::InGroup))
        .collect();
    let perm: Vec<usize> = axes
        .iter()
        .filter(|a| match a {
            Axis::Group | Axis::Unit => false,
            Axis::Lead(i) => shape[*i] != 1,
            _ => true,
        })
        .map(|a| grouped_axes.iter().position(|g| g == a))
        .collect::<Option<_>>()?;
    if perm.len() != grouped_axes.len() {
        return None;
    }
    let grouped = (0..lead)
        .map(|i| shape[i])
        .filter(|&d| d != 1)
        .chain(columns)
        .collect();
    if slices.is_empty() || value == graph.output {
        return None;
    }
    Some(Split {
        views,
        slices,
        groups,
        grouped,
        perm,
    })
}

/// How a reshape cuts the product's columns: into how many groups, and the sizes (past 1)
/// of the axes that a group's columns become.
type ColumnsCut = (usize, Vec<usize>);

/// The tags of a reshape's output axes and, where it is the reshape that splits the product's
/// columns, the number of groups and the sizes (past 1) that a group's columns are cut into;
/// `None` where it moves anything else.
fn reshaped(
    from: &[usize],
    axes: &[Axis],
    to: &[usize],
) -> Option<(Vec<Axis>, Option<ColumnsCut>)> {
    // The axes past 1, with their sizes and tags.
    let old: Vec<(usize, Axis)> = (0..from.len())
        .filter(|&a| from[a] != 1)
        .map(|a| (from[a], axes[a]))
        .collect();
    let new: Vec<usize> = to.iter().copied().filter(|&d| d != 1).collect();
    if old.iter().map(|&(d, _)| d).eq(new.iter().copied()) {
        // Only axes of 1 come or go.
        return Some((with_units(to, old.iter().map(|&(_, t)| t)), None));
    }
    // The split: the last axis, the product's columns, into [groups, columns per group…].
    let (&(columns, tag), rest) = old.split_last()?;
    if tag != Axis::Columns || new.len() < old.len() + 1 {
        return None;
    }
    let (kept, split) = new.split_at(rest.len());
    let (&groups, per_group) = split.split_first()?;
    let rest_kept = rest.iter().map(|&(d, _)| d).eq(kept.iter().copied());
    if groups < 2 || groups * per_group.iter().product::<usize>() != columns || !rest_kept {
        return None;
    }
    let tags = rest
        .iter()
        .map(|&(_, t)| t)
        .chain([Axis::Group])
        .chain((0..per_group.len()).map(Axis::InGroup));
    Some((with_units(to, tags), Some((groups, per_group.to_vec()))))
}

/// The tags of the axes of `shape` past 1 in order, `Unit` for the others.
fn with_units(shape: &[usize], tags: impl Iterator<Item = Axis>) -> Vec<Axis> {
    let mut tags = tags;
    shape
        .iter()
        .map(|&d| match d {
            1 => Axis::Unit,
            _ => tags.next().expect("one tag for each axis past 1"),
        })
        .collect()
}

/// Replaces product `p` and its views by one product per slice, each seen as its slice's
/// output through a reshape (and where the views moved its axes, a transpose and a reshape).
fn apply(graph: &mut Graph, p: usize, split: Split) {
    let product = graph.nodes[p].clone();
    let (k, n) = {
        let w = &graph.consts[&product.inputs[1]];
        (w.shape[0], w.shape[1])
    };
    let per_group = n / split.groups;
    let mut out_shape = graph.shape(&product.output).to_vec();
    *out_shape.last_mut().expect("a matrix") = per_group;
    let mut replaced = Vec::new();
    for &(s, group) in &split.slices {
        let slice = graph.nodes[s].clone();
        let columns = group * per_group..(group + 1) * per_group;
        let name = format!("{}.group{group}", product.name);
        let w = &graph.consts[&product.inputs[1]];
        let w_group: Vec<f32> = (0..k)
            .flat_map(|r| {
                w.data[r * n + columns.start..r * n + columns.end]
                    .iter()
                    .copied()
            })
            .collect();
        let mut inputs = vec![product.inputs[0].clone()];
        let weight = format!("{name}.weight");
        graph
            .consts
            .insert(weight.clone(), Tensor::new(vec![k, per_group], w_group));
        inputs.push(weight);
        if let Some(b) = product.inputs.get(2) {
            let bias = format!("{name}.bias");
            let data = graph.consts[b].data[columns].to_vec();
            graph
                .consts
                .insert(bias.clone(), Tensor::new(vec![per_group], data));
            inputs.push(bias);
        }
        let output = format!("{name}.output");
        graph.shapes.insert(output.clone(), out_shape.clone());
        let mut nodes = vec![Node {
            name: name.clone(),
            op: product.op.clone(),
            inputs,
            output: output.clone(),
        }];
        let mut value = output;
        if split.perm.iter().enumerate().any(|(i, &p)| i != p) {
            let mut view = |op: Op, shape: Vec<usize>, what: &str| {
                let output = format!("{name}.{what}");
                graph.shapes.insert(output.clone(), shape);
                nodes.push(Node {
                    name: output.clone(),
                    op,
                    inputs: vec![std::mem::replace(&mut value, output.clone())],
                    output,
                });
            };
            view(Op::Reshape, split.grouped.clone(), "split");
            let moved = split.perm.iter().map(|&a| split.grouped[a]).collect();
            view(
                Op::Transpose {
                    perm: split.perm.clone(),
                },
                moved,
                "moved",
            );
        }
        nodes.push(Node {
            name: slice.name.clone(),
            op: Op::Reshape,
            inputs: vec![value],
            output: slice.output.clone(),
        });
        replaced.push((s, nodes));
    }
    // Later nodes first, so that the earlier indices hold.
    let mut gone: Vec<usize> = split.views.iter().copied().chain([p]).collect();
    for &g in &gone {
        let output = graph.nodes[g].output.clone();
        graph.shapes.remove(&output);
    }
    replaced.sort_by_key(|&(s, _)| std::cmp::Reverse(s));
    for (s, nodes) in replaced {
        graph.nodes.splice(s..=s, nodes);
    }
    gone.sort_unstable();
    for &g in gone.iter().rev() {
        graph.nodes.remove(g);
    }
}
