// SPDX-License-Identifier: MPL-2.0
#![allow(clippy::non_send_fields_in_send_ty, unused_doc_comments)]

//! `trtclassify`: a GStreamer element that classifies video frames with an ONNX image
//! classifier and attaches the top-k classes to every buffer as metadata.
//!
//! The crate is both the plugin (`cdylib`) and a library (`rlib`) whose [`meta`] module gives
//! applications a typed reader for the classification metadata.

use gst::glib;

#[cfg(feature = "analytics")]
pub mod analytics;
pub mod cudamem;
pub mod engine;
pub mod instance;
pub mod labels;
pub mod meta;
#[cfg(feature = "overlay")]
pub mod overlay;
pub mod postprocess;
pub mod preprocess;
pub mod regions;
pub mod results;
pub mod trtclassify;

fn plugin_init(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    meta::register();
    trtclassify::register(plugin)?;
    #[cfg(feature = "overlay")]
    overlay::register(plugin)?;
    Ok(())
}

gst::plugin_define!(
    trtclassify,
    env!("CARGO_PKG_DESCRIPTION"),
    plugin_init,
    concat!(env!("CARGO_PKG_VERSION"), "-", env!("COMMIT_ID")),
    "MPL",
    env!("CARGO_PKG_NAME"),
    env!("CARGO_PKG_NAME"),
    env!("CARGO_PKG_REPOSITORY"),
    env!("BUILD_REL_DATE")
);
