// SPDX-License-Identifier: MPL-2.0
//! `results-location`: one JSON object per frame, one per line, so that results leave a
//! `gst-launch-1.0` pipeline without code.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::Path;

use serde::Serialize;

use crate::meta::Classification;

#[derive(Serialize)]
struct Line<'a> {
    frame: u64,
    pts_ns: Option<u64>,
    fresh: bool,
    model: &'a str,
    topk: Vec<Entry<'a>>,
}

#[derive(Serialize)]
struct Entry<'a> {
    class_id: u32,
    label: &'a str,
    confidence: f32,
}

pub enum ResultsWriter {
    Stdout,
    File(BufWriter<File>),
}

impl ResultsWriter {
    /// `-` is standard output; anything else a file that lines are appended to.
    pub fn open(location: &str) -> io::Result<Self> {
        if location == "-" {
            return Ok(ResultsWriter::Stdout);
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(Path::new(location))?;
        Ok(ResultsWriter::File(BufWriter::new(file)))
    }

    pub fn format(result: &Classification, pts: Option<gst::ClockTime>) -> String {
        let line = Line {
            frame: result.frame,
            pts_ns: pts.map(gst::ClockTime::nseconds),
            fresh: result.fresh,
            model: &result.model,
            topk: result
                .classes
                .iter()
                .map(|c| Entry {
                    class_id: c.class_id,
                    label: &c.label,
                    confidence: c.confidence,
                })
                .collect(),
        };
        serde_json::to_string(&line).expect("a result always serialises")
    }

    /// Writes the lines of one batch and flushes, so a reader that tails the file sees whole
    /// lines as soon as the frames leave the element.
    pub fn write_lines(&mut self, lines: &[String]) -> io::Result<()> {
        match self {
            ResultsWriter::Stdout => {
                let mut out = io::stdout().lock();
                for line in lines {
                    writeln!(out, "{line}")?;
                }
                out.flush()
            }
            ResultsWriter::File(file) => {
                for line in lines {
                    writeln!(file, "{line}")?;
                }
                file.flush()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::ClassEntry;

    #[test]
    fn line_has_the_documented_keys() {
        let result = Classification {
            model: "m.onnx".into(),
            frame: 3,
            fresh: false,
            classes: vec![ClassEntry {
                class_id: 2,
                label: "red \"x\"".into(),
                confidence: 0.5,
            }],
        };
        let line = ResultsWriter::format(&result, None);
        assert_eq!(
            line,
            r#"{"frame":3,"pts_ns":null,"fresh":false,"model":"m.onnx","topk":[{"class_id":2,"label":"red \"x\"","confidence":0.5}]}"#
        );
        let line = ResultsWriter::format(&result, Some(gst::ClockTime::from_mseconds(40)));
        assert!(line.contains(r#""pts_ns":40000000"#), "{line}");
    }
}
