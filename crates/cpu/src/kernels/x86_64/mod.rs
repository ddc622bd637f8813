// SPDX-License-Identifier: MPL-2.0
//! The kernels' code for x86-64 alone: AVX-512 and AVX2 intrinsics, and assembly. Apart from
//! the code that every target compiles, which chooses it at run time (`panels`, `conv`,
//! `conv::depthwise`), so that code reads without the `cfg`s and what one instruction set has
//! lies in one place.

pub(super) mod depthwise;
pub(super) mod few_channels;
pub(super) mod panels;
mod rows_avx512;
