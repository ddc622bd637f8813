// SPDX-License-Identifier: MPL-2.0
//! The operators, one module per family, each holding all there is to know of its operators:
//! the ONNX operators it takes (`OPS`, with `required_inputs`), their import into `ir::Op`s
//! with the output shape each gives, their evaluation in f32 for `reference`, and their
//! lowering to plan steps (`impl Lowering`). The phases only dispatch to them: `import`'s
//! `FAMILIES`, `reference::eval` and `lower::Lowering::node` (the last two as matches over
//! `Op` without a catch-all, so that a new op that misses one does not compile).
//!
//! `conv` (Conv, BatchNormalization, pooling), `elementwise` (activations, arithmetic,
//! casts), `matmul` (Gemm, MatMul, Einsum; the fused attention), `normalization` (softmax,
//! layer and instance norm, LRN, reductions), `shape` (reshapes, transposes, slices,
//! concatenation, padding), `resize` (Resize as products with interpolation matrices) and
//! `shape_arithmetic` (constants and the integer arithmetic on shapes, evaluated at import).

pub(crate) mod conv;
pub(crate) mod elementwise;
pub(crate) mod matmul;
pub(crate) mod normalization;
pub(crate) mod resize;
pub(crate) mod shape;
pub(crate) mod shape_arithmetic;
