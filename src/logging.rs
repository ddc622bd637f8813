// SPDX-License-Identifier: MPL-2.0
//! The engines' log lines in GStreamer's debug log.
//!
//! The engines log through the `log` crate, since they do not link GStreamer. The plugin
//! forwards the lines of their target to the `trtclassify-engine` debug category, so
//! `GST_DEBUG=trtclassify-engine:4` shows builds, engine files and fallbacks as before. Other
//! crates' lines (tract, the gRPC stack) are not forwarded: they would flood the category.

use std::sync::LazyLock;

use gst::glib;
use gst::prelude::*;

use crate::engine::LOG_TARGET;

/// The engines' debug category (`GST_DEBUG=trtclassify-engine:4`), shared by the engine
/// instances that serve several elements, so their lines name the model, not an element.
pub static ENGINE_CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new(
        LOG_TARGET,
        gst::DebugColorFlags::empty(),
        Some("trtclassify inference engines"),
    )
});

struct EngineLogger;

fn level(level: log::Level) -> gst::DebugLevel {
    match level {
        log::Level::Error => gst::DebugLevel::Error,
        log::Level::Warn => gst::DebugLevel::Warning,
        log::Level::Info => gst::DebugLevel::Info,
        log::Level::Debug => gst::DebugLevel::Debug,
        log::Level::Trace => gst::DebugLevel::Trace,
    }
}

impl log::Log for EngineLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.target() == LOG_TARGET && ENGINE_CAT.above_threshold(level(metadata.level()))
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let file = glib::GString::from(record.file().unwrap_or(""));
        ENGINE_CAT.log(
            None::<&glib::Object>,
            level(record.level()),
            file.as_gstr(),
            record.module_path().unwrap_or(""),
            record.line().unwrap_or(0),
            *record.args(),
        );
    }

    fn flush(&self) {}
}

/// Sends the engines' `log` lines to [`ENGINE_CAT`]. Where the application has installed a
/// `log` logger of its own, that one keeps them.
pub fn forward_engine_logs() {
    static LOGGER: EngineLogger = EngineLogger;
    LazyLock::force(&ENGINE_CAT);
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Trace);
    }
}
