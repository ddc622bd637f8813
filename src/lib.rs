// SPDX-License-Identifier: MPL-2.0
#![warn(missing_docs)]
#![allow(clippy::non_send_fields_in_send_ty, unused_doc_comments)]

//! `trtclassify`: a GStreamer element that classifies video frames with an ONNX image
//! classifier and attaches the top-k classes to every buffer as metadata.
//!
//! The crate is both the plugin (`cdylib`) and a library (`rlib`) whose [`meta`] module gives
//! applications a typed reader for the classification metadata.
//!
//! Where each part lives (this crate's modules, the engine crates under `crates/`, the
//! metadata crate and the overlay plugin): `docs/architecture.md`, the project's one map.

use gst::glib;

#[cfg(feature = "analytics")]
pub mod analytics;
pub mod calibrate;
pub mod cudamem;
/// The inference engines (their own crate, free of GStreamer).
pub use trtclassify_engine as engine;
pub mod instance;
pub mod logging;
pub mod outputs;
pub use trtclassify_engine::preprocess;
pub mod regions;
pub mod stream_calibration;
/// The `trtclassify` element.
pub mod trtclassify;
pub mod video;

// The output modules lived at the crate's root before they moved to `outputs/` (issue 11).
// Applications embedding the plugin use them by those paths (`gsttrtclassify::meta::
// Classification`, ...): these re-exports keep the old paths working.
pub use outputs::{labels, meta, postprocess, results};

fn plugin_init(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    logging::forward_engine_logs();
    meta::register();
    trtclassify::register(plugin)?;
    Ok(())
}

// `plugin_define!` generates a public module, struct and entry points that take no docs, and a
// lint attribute on a macro invocation is ignored: so it expands in a private module that allows
// `missing_docs`, and the one entry point applications call is re-exported. The C entry points
// are `#[no_mangle]`, so the cdylib exports them from any module.
#[allow(missing_docs)]
mod plugin {
    use super::plugin_init;

    gst::plugin_define!(
        trtclassify,
        env!("CARGO_PKG_DESCRIPTION"),
        plugin_init,
        concat!(env!("CARGO_PKG_VERSION"), "-", env!("COMMIT_ID")),
        "MPL",
        env!("CARGO_PKG_NAME"),
        env!("CARGO_PKG_NAME"),
        // No public home yet: GStreamer's own words for a plugin without one.
        "Unknown package origin",
        env!("BUILD_REL_DATE")
    );
}
/// Registers the plugin's elements with GStreamer without loading a shared library: for tests
/// and applications that link the crate.
pub use plugin::plugin_register_static;
