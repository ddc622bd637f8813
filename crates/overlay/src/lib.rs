// SPDX-License-Identifier: MPL-2.0
#![warn(missing_docs)]
#![allow(unused_doc_comments)]

//! `trtclassifyoverlay`: draws what `trtclassify` found on the video. A plugin of its own,
//! since it links Pango and Cairo, which the classifier does not need.

use gst::glib;

/// The `trtclassifyoverlay` element.
pub mod trtclassifyoverlay;

fn plugin_init(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    trtclassify_meta::register();
    trtclassifyoverlay::register(plugin)
}

// As in the classifier's plugin: `plugin_define!` expands in a private module that allows
// `missing_docs`, and the entry point for static registration is re-exported.
#[allow(missing_docs)]
mod plugin {
    use super::plugin_init;

    gst::plugin_define!(
        trtclassifyoverlay,
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
/// Registers the element with GStreamer without loading a shared library: for tests and
/// applications that link the crate.
pub use plugin::plugin_register_static;
