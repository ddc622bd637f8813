// SPDX-License-Identifier: MPL-2.0
//! The calibration table: each quantizable node's input range and the error its product
//! makes in each format, as calibration measured them. It is a text file, one node a line,
//! kept beside the engine so that a rebuild does not calibrate again, and written by
//! `trtclassify-engine calibrate` ahead of time.
//!
//! Its lines, fields separated by tabs (shown here as `→`):
//!
//! ```text
//! trtclassify-calibration 1
//! frames 64
//! # node→amax→int8-range→int8-error→fp8-error
//! conv3→3.25→2.875→0.0121→0.0232
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use crate::plan::QuantFormat;

/// The first line of a table, with the version of its format.
/// The first line of a table file.
pub const HEADER: &str = "trtclassify-calibration 1";

/// One node's line: the range of its input and its product's errors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NodeRange {
    /// The largest magnitude its input held.
    pub amax: f32,
    /// The range int8 clips its input to (`Calibrator::table` says how it is chosen); at
    /// most `amax`.
    pub int8: f32,
    /// Its product's relative error in int8 on the calibration frames.
    pub int8_error: f32,
    /// Its product's relative error in FP8 (whose range is `amax`).
    pub fp8_error: f32,
}

impl NodeRange {
    /// The input range `format` maps onto its largest value: int8 clips at its range, FP8
    /// takes the largest value seen.
    pub fn range(&self, format: QuantFormat) -> f32 {
        match format {
            QuantFormat::Int8 => self.int8,
            QuantFormat::Fp8 => self.amax,
        }
    }

    /// The product's relative error in `format`.
    pub fn error(&self, format: QuantFormat) -> f32 {
        match format {
            QuantFormat::Int8 => self.int8_error,
            QuantFormat::Fp8 => self.fp8_error,
        }
    }
}

/// The ranges of one model's quantizable nodes, by ONNX node name (`plan::Plan::origins`):
/// the same for the plans of every batch size.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CalibrationTable {
    /// Frames calibration ran.
    pub frames: usize,
    /// Each node's range.
    pub nodes: BTreeMap<String, NodeRange>,
}

/// Why a calibration table cannot be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TableError {
    /// The file could not be read or written.
    #[error("{path}: {problem}")]
    Io {
        /// The file.
        path: String,
        /// The system's message.
        problem: String,
    },
    /// A binary file (held-out frames) that is not what its format says.
    #[error("{path}: {problem}")]
    Corrupt {
        /// The file.
        path: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A line that is not what the format says.
    #[error("{path}: line {line}: {problem}")]
    Format {
        /// The file, or "the table" for text that came from elsewhere.
        path: String,
        /// The line, counted from 1.
        line: usize,
        /// What is wrong with it.
        problem: String,
    },
}

impl CalibrationTable {
    /// The range of node `name`.
    pub fn get(&self, name: &str) -> Option<&NodeRange> {
        self.nodes.get(name)
    }

    /// The table as its file holds it. A node name with a tab or a line break in it (which
    /// ONNX allows) is written with spaces instead, and its node then finds no line.
    pub fn to_text(&self) -> String {
        let mut text = format!(
            "{HEADER}\nframes {}\n# node\tamax\tint8-range\tint8-error\tfp8-error\n",
            self.frames
        );
        for (name, r) in &self.nodes {
            let name = name.replace(['\t', '\n', '\r'], " ");
            text += &format!(
                "{name}\t{}\t{}\t{}\t{}\n",
                r.amax, r.int8, r.int8_error, r.fp8_error
            );
        }
        text
    }

    /// Reads a table from its text; `path` names it in errors.
    pub fn parse(text: &str, path: &str) -> Result<Self, TableError> {
        let fail = |line: usize, problem: String| TableError::Format {
            path: path.to_owned(),
            line,
            problem,
        };
        let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
        match lines.next() {
            Some((_, HEADER)) => {}
            Some((_, l)) if l.starts_with("trtclassify-calibration ") => {
                return Err(fail(
                    1,
                    format!("`{l}`: a version this build does not read"),
                ));
            }
            _ => return Err(fail(1, format!("not a calibration table (no `{HEADER}`)"))),
        }
        let frames = match lines.next() {
            Some((_, l)) if l.starts_with("frames ") => l["frames ".len()..]
                .parse()
                .map_err(|_| fail(2, format!("`{l}`: not a count of frames")))?,
            _ => return Err(fail(2, "no `frames N` line".into())),
        };
        let mut nodes = BTreeMap::new();
        for (n, line) in lines.filter(|(_, l)| !l.starts_with('#') && !l.is_empty()) {
            let fields: Vec<&str> = line.split('\t').collect();
            let [name, values @ ..] = fields.as_slice() else {
                unreachable!("split gives one field at least")
            };
            let values: Vec<f32> = match values.len() {
                4 => values
                    .iter()
                    .map(|v| v.parse::<f32>().ok().filter(|v| v.is_finite() && *v >= 0.0))
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        fail(
                            n,
                            format!("node `{name}`: values that are not finite numbers ≥ 0"),
                        )
                    })?,
                _ => return Err(fail(n, format!("{} fields, not 5", fields.len()))),
            };
            let range = NodeRange {
                amax: values[0],
                int8: values[1],
                int8_error: values[2],
                fp8_error: values[3],
            };
            if range.int8 > range.amax {
                return Err(fail(
                    n,
                    format!("node `{name}`: an int8 range past its largest value"),
                ));
            }
            if nodes.insert((*name).to_owned(), range).is_some() {
                return Err(fail(n, format!("node `{name}` a second time")));
            }
        }
        Ok(CalibrationTable { frames, nodes })
    }

    /// Reads the table in `path`.
    pub fn load(path: &Path) -> Result<Self, TableError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| TableError::Io {
            path: shown.clone(),
            problem: e.to_string(),
        })?;
        Self::parse(&text, &shown)
    }

    /// Writes the table to `path`.
    pub fn save(&self, path: &Path) -> Result<(), TableError> {
        std::fs::write(path, self.to_text()).map_err(|e| TableError::Io {
            path: path.display().to_string(),
            problem: e.to_string(),
        })
    }
}
