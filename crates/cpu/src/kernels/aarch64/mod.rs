// SPDX-License-Identifier: MPL-2.0
//! The kernels' code for aarch64 alone: NEON intrinsics. Apart from the code that every
//! target compiles, which calls it (`panels`), so that what one instruction set has lies in
//! one place.

pub(super) mod panels;
