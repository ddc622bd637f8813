// SPDX-License-Identifier: MPL-2.0
//! `results-location`: one JSON object per frame, one per line, so that results leave a
//! `gst-launch-1.0` pipeline without code.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::Path;

use serde::Serialize;

use crate::outputs::meta::{ClassEntry, Classification};

fn entries(classes: &[ClassEntry]) -> Vec<Entry<'_>> {
    classes
        .iter()
        .map(|c| Entry {
            class_id: c.class_id,
            label: &c.label,
            confidence: c.confidence,
        })
        .collect()
}

#[derive(Serialize)]
struct Line<'a> {
    frame: u64,
    pts_ns: Option<u64>,
    fresh: bool,
    model: &'a str,
    topk: Vec<Entry<'a>>,
    /// With `roi=regions` or `both`, each classified region; left out when there is none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    regions: Vec<RegionLine<'a>>,
}

#[derive(Serialize)]
struct RegionLine<'a> {
    id: i32,
    roi_type: &'a str,
    x: u32,
    y: u32,
    width: u32,
    height: u32,
    topk: Vec<Entry<'a>>,
}

#[derive(Serialize)]
struct Entry<'a> {
    class_id: u32,
    label: &'a str,
    confidence: f32,
}

/// Where the JSON lines of `results-location` go.
pub enum ResultsWriter {
    /// Standard output (`-`).
    Stdout,
    /// A file, appended to.
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

    /// The JSON line of one frame's result (without its newline), with the buffer's
    /// timestamp.
    pub fn format(result: &Classification, pts: Option<gst::ClockTime>) -> String {
        let line = Line {
            frame: result.frame,
            pts_ns: pts.map(gst::ClockTime::nseconds),
            fresh: result.fresh,
            model: &result.model,
            topk: entries(&result.classes),
            regions: result
                .regions
                .iter()
                .map(|r| RegionLine {
                    id: r.id,
                    roi_type: &r.roi_type,
                    x: r.rect.0,
                    y: r.rect.1,
                    width: r.rect.2,
                    height: r.rect.3,
                    topk: entries(&r.classes),
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
    use crate::outputs::meta::RegionResult;

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
            regions: Vec::new(),
        };
        let line = ResultsWriter::format(&result, None);
        assert_eq!(
            line,
            r#"{"frame":3,"pts_ns":null,"fresh":false,"model":"m.onnx","topk":[{"class_id":2,"label":"red \"x\"","confidence":0.5}]}"#
        );
        let line = ResultsWriter::format(&result, Some(gst::ClockTime::from_mseconds(40)));
        assert!(line.contains(r#""pts_ns":40000000"#), "{line}");
    }

    #[test]
    fn regions_have_their_own_topk() {
        let result = Classification {
            model: "m.onnx".into(),
            frame: 0,
            fresh: true,
            classes: Vec::new(),
            regions: vec![RegionResult {
                id: 7,
                roi_type: "car".into(),
                rect: (1, 2, 30, 40),
                classes: vec![ClassEntry {
                    class_id: 1,
                    label: "van".into(),
                    confidence: 0.75,
                }],
            }],
        };
        assert_eq!(
            ResultsWriter::format(&result, None),
            r#"{"frame":0,"pts_ns":null,"fresh":true,"model":"m.onnx","topk":[],"regions":[{"id":7,"roi_type":"car","x":1,"y":2,"width":30,"height":40,"topk":[{"class_id":1,"label":"van","confidence":0.75}]}]}"#
        );
    }
}
