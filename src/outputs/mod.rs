// SPDX-License-Identifier: MPL-2.0
//! What the element makes of a model's scores, and where it puts them: post-processing
//! (softmax, top-k, threshold), class labels, the classification metadata on every buffer and
//! the JSON lines of `results-location`.
//!
//! None of this knows the element: `crate::trtclassify` calls it for every frame it sends on.
//! The modules are also public API for applications that embed the plugin; `lib.rs`
//! re-exports them at their former paths (`gsttrtclassify::meta`, ...).

pub mod labels;
/// The classification metadata (its own crate, shared with `trtclassifyoverlay`).
pub use trtclassify_meta as meta;
pub mod postprocess;
pub mod results;
