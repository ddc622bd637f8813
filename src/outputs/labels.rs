// SPDX-License-Identifier: MPL-2.0
//! Class labels: a text file with one label per line, line N naming class N.

use std::path::{Path, PathBuf};

/// A labels file that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{}: cannot read the labels file: {source}", path.display())]
pub struct LabelsError {
    /// The labels file.
    pub path: PathBuf,
    /// Why it could not be read (text that is not UTF-8 is `InvalidData`, naming the line).
    #[source]
    pub source: std::io::Error,
}

/// The labels of a model's classes, by class id; empty when there is no labels file.
#[derive(Debug, Clone, Default)]
pub struct Labels(Vec<String>);

impl Labels {
    /// Reads a labels file (UTF-8 text, see `parse`).
    pub fn load(path: &Path) -> Result<Self, LabelsError> {
        let error = |source| LabelsError {
            path: path.to_owned(),
            source,
        };
        let bytes = std::fs::read(path).map_err(error)?;
        let text = String::from_utf8(bytes).map_err(|e| {
            let bytes = e.as_bytes();
            let line = 1 + bytes[..e.utf8_error().valid_up_to()]
                .iter()
                .filter(|&&b| b == b'\n')
                .count();
            error(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("line {line} is not UTF-8 text"),
            ))
        })?;
        Ok(Self::parse(&text))
    }

    /// One label per line; surrounding white space (and Windows line ends) is trimmed, and
    /// trailing empty lines are dropped so that a final newline does not add a class.
    pub fn parse(text: &str) -> Self {
        let mut labels: Vec<String> = text.lines().map(|l| l.trim().to_owned()).collect();
        while labels.last().is_some_and(|l| l.is_empty()) {
            labels.pop();
        }
        Labels(labels)
    }

    /// How many lines the file had (trailing empty lines left out).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no labels: class numbers stand in for every one.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The label of `class_id`, or its number when the file has none for it.
    pub fn get(&self, class_id: usize) -> String {
        match self.0.get(class_id) {
            Some(label) if !label.is_empty() => label.clone(),
            _ => class_id.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_stand_in_for_missing_labels() {
        let labels = Labels::parse("cat\r\n\ndog\n\n");
        assert_eq!(labels.len(), 3);
        assert_eq!(labels.get(0), "cat");
        assert_eq!(labels.get(1), "1");
        assert_eq!(labels.get(2), "dog");
        assert_eq!(labels.get(7), "7");
    }

    #[test]
    fn text_that_is_not_utf8_names_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("labels.txt");
        std::fs::write(&path, b"cat\r\ndog\r\nb\xe9te\r\n").unwrap();
        let msg = Labels::load(&path).unwrap_err().to_string();
        assert!(
            msg.contains("labels.txt: cannot read the labels file"),
            "{msg}"
        );
        assert!(msg.contains("line 3 is not UTF-8 text"), "{msg}");
    }

    #[test]
    fn unreadable_file_names_the_path() {
        let err = Labels::load(Path::new("/nonexistent/labels.txt")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/labels.txt"), "{msg}");
        assert!(msg.contains("No such file"), "{msg}");
    }
}
