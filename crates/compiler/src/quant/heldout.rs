// SPDX-License-Identifier: MPL-2.0
//! Held-out frames: frames of a calibration that its ranges were not learnt from, kept with
//! the unquantized model's scores for them (f32, on the CPU), so that a build can measure
//! what quantizing cost (`Agreement`) before it keeps an int8 or FP8 engine. They live in a
//! binary file beside the table (`beside`), written by `trtclassify-engine calibrate`:
//!
//! ```text
//! "TRTCHELD", version 1, frames, values per frame, classes (u32 each, little-endian),
//! then each frame's model input in fp16, then each frame's scores in f32
//! ```
//!
//! The inputs are fp16: half the size, and as exact as the fp16 engine reads them.

use std::path::{Path, PathBuf};

use super::TableError;

const MAGIC: &[u8; 8] = b"TRTCHELD";
const VERSION: u32 = 1;
/// The magic and four u32 fields.
const HEADER_LEN: usize = 8 + 4 * 4;

/// Held-out frames and their unquantized scores.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeldOut {
    /// Values of one frame's model input.
    pub frame_len: usize,
    /// Scores per frame.
    pub classes: usize,
    /// Each frame's model input, one after the other (fp16 values, as f32).
    pub inputs: Vec<f32>,
    /// Each frame's scores, one after the other.
    pub scores: Vec<f32>,
}

impl HeldOut {
    /// No frames yet, of `frame_len` values and `classes` scores each.
    pub fn new(frame_len: usize, classes: usize) -> Self {
        HeldOut {
            frame_len,
            classes,
            ..Default::default()
        }
    }

    /// The file of the held-out frames of the table at `table`: its name with `.heldout`.
    pub fn beside(table: &Path) -> PathBuf {
        let mut name = table.as_os_str().to_owned();
        name.push(".heldout");
        PathBuf::from(name)
    }

    /// Frames held out.
    pub fn frames(&self) -> usize {
        self.scores.len().checked_div(self.classes).unwrap_or(0)
    }

    /// Adds a frame (its model input, rounded to fp16 as the file keeps it) and its scores.
    pub fn push(&mut self, input: &[f32], scores: &[f32]) {
        assert_eq!((input.len(), scores.len()), (self.frame_len, self.classes));
        let fp16 = |v: &f32| half::f16::from_f32(*v).to_f32();
        self.inputs.extend(input.iter().map(fp16));
        self.scores.extend_from_slice(scores);
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(HEADER_LEN + self.inputs.len() * 2 + self.scores.len() * 4);
        out.extend_from_slice(MAGIC);
        for v in [
            VERSION as usize,
            self.frames(),
            self.frame_len,
            self.classes,
        ] {
            out.extend_from_slice(&(v as u32).to_le_bytes());
        }
        (self.inputs.iter()).for_each(|v| out.extend(half::f16::from_f32(*v).to_le_bytes()));
        (self.scores.iter()).for_each(|v| out.extend(v.to_le_bytes()));
        out
    }

    /// Reads `bytes`, a held-out file as `path` names it in errors.
    pub fn parse(bytes: &[u8], path: &str) -> Result<Self, TableError> {
        let corrupt = |problem: String| TableError::Corrupt {
            path: path.to_owned(),
            problem,
        };
        if bytes.len() < HEADER_LEN || &bytes[..8] != MAGIC {
            return Err(corrupt("not a file of held-out frames".into()));
        }
        let field = |i: usize| {
            let at = 8 + 4 * i;
            u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize
        };
        let (version, frames, frame_len, classes) = (field(0), field(1), field(2), field(3));
        if version != VERSION as usize {
            return Err(corrupt(format!(
                "version {version}; this plugin reads version {VERSION}"
            )));
        }
        let expected = (frames.checked_mul(frame_len * 2 + classes * 4))
            .and_then(|body| body.checked_add(HEADER_LEN));
        if classes == 0 || frame_len == 0 || expected != Some(bytes.len()) {
            return Err(corrupt(format!(
                "{} bytes, where {frames} frames of {frame_len} values and {classes} scores \
                 take {}",
                bytes.len(),
                expected.map_or("more than memory holds".into(), |n| n.to_string())
            )));
        }
        let (inputs, scores) = bytes[HEADER_LEN..].split_at(frames * frame_len * 2);
        let inputs: Vec<f32> = (inputs.chunks_exact(2))
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        let scores: Vec<f32> = (scores.chunks_exact(4))
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        if let Some(i) = inputs.iter().position(|v| !v.is_finite()) {
            return Err(corrupt(format!(
                "frame {}'s input is not finite",
                i / frame_len
            )));
        }
        if let Some(i) = scores.iter().position(|v| !v.is_finite()) {
            return Err(corrupt(format!(
                "frame {}'s scores are not finite",
                i / classes
            )));
        }
        Ok(HeldOut {
            frame_len,
            classes,
            inputs,
            scores,
        })
    }

    /// Reads the file at `path`.
    pub fn load(path: &Path) -> Result<Self, TableError> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| TableError::Io {
            path: shown.clone(),
            problem: e.to_string(),
        })?;
        Self::parse(&bytes, &shown)
    }

    /// Writes the file at `path`.
    pub fn save(&self, path: &Path) -> Result<(), TableError> {
        std::fs::write(path, self.to_bytes()).map_err(|e| TableError::Io {
            path: path.display().to_string(),
            problem: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_out_frames_read_back_and_damage_is_named() {
        let mut h = HeldOut::new(3, 2);
        h.push(&[0.1, -2.5, 1000.0], &[0.25, 0.75]);
        h.push(&[1.0, 0.0, -1.0], &[0.5, 0.5]);
        let bytes = h.to_bytes();
        assert_eq!(bytes.len(), HEADER_LEN + 2 * (3 * 2 + 2 * 4));
        let back = HeldOut::parse(&bytes, "t.heldout").expect("its own file");
        assert_eq!(back, h);
        assert_eq!(back.frames(), 2);
        // fp16 rounding happened at `push`: 0.1 is kept as fp16 holds it.
        assert_eq!(back.inputs[0], half::f16::from_f32(0.1).to_f32());
        let error = |bytes: &[u8]| HeldOut::parse(bytes, "t.heldout").unwrap_err().to_string();
        assert!(error(b"TRTCHELD").contains("not a file of held-out frames"));
        assert!(error(&bytes[..bytes.len() - 1]).starts_with("t.heldout: "));
        assert!(error(&bytes[..bytes.len() - 1]).contains("2 frames of 3 values"));
        let mut newer = bytes.clone();
        newer[8] = 2;
        assert!(error(&newer).contains("version 2"));
        let mut nan = bytes.clone();
        let last = nan.len() - 4;
        nan[last..].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(error(&nan).contains("frame 1's scores are not finite"));
        let mut inf = bytes.clone();
        inf[HEADER_LEN + 6..HEADER_LEN + 8].copy_from_slice(&half::f16::INFINITY.to_le_bytes());
        assert!(error(&inf).contains("frame 1's input is not finite"));
        let mut huge = bytes;
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(error(&huge).contains("frames"));
        assert_eq!(
            HeldOut::beside(Path::new("/x/m.calibration.txt")),
            Path::new("/x/m.calibration.txt.heldout")
        );
    }
}
