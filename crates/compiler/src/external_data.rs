// SPDX-License-Identifier: MPL-2.0
//! Weights kept outside the ONNX file ("external data"), as exporters write every model over
//! protobuf's 2 GiB limit. Each reference is checked once, when the model is read, so that
//! every backend refuses the same files with the same words, before any reads gigabytes.
//!
//! The ONNX rule is followed strictly: a location is a relative path inside the model's
//! folder. An absolute path, `..` or a symbolic link leading out of the folder is refused (as
//! tract and onnxruntime refuse them), so a downloaded model cannot make the element read, and
//! upload to a GPU, a file it names elsewhere on the machine.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

use tract_onnx::pb;

/// ONNX `TensorProto.DataLocation.EXTERNAL`.
const EXTERNAL: i32 = 1;

/// Where the bytes of one tensor lie, checked against the file they are in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalData {
    /// The tensor's name in the graph.
    pub tensor: String,
    /// The data file: its relative `location` joined to the model's folder, checked to lie inside.
    pub path: PathBuf,
    /// Where the tensor's bytes start in the file, in bytes.
    pub offset: u64,
    /// The tensor's size in bytes, as its dims and data type require.
    pub length: u64,
}

impl ExternalData {
    /// The tensor's bytes, read from its file's range alone.
    pub fn read(&self) -> Result<Vec<u8>, String> {
        let fail = |e: std::io::Error| {
            format!(
                "tensor `{}`: cannot read bytes {}..{} of {}: {e}",
                self.tensor,
                self.offset,
                self.offset + self.length,
                self.path.display()
            )
        };
        let length = usize::try_from(self.length).map_err(|_| {
            format!(
                "tensor `{}` holds {} bytes, more than this machine can address",
                self.tensor, self.length
            )
        })?;
        let mut file = File::open(&self.path).map_err(fail)?;
        file.seek(SeekFrom::Start(self.offset)).map_err(fail)?;
        let mut bytes = Vec::new();
        bytes.try_reserve_exact(length).map_err(|_| {
            format!(
                "tensor `{}`: not enough memory for its {length} bytes",
                self.tensor
            )
        })?;
        file.take(self.length)
            .read_to_end(&mut bytes)
            .map_err(fail)?;
        if bytes.len() != length {
            // The file shrank since it was checked.
            return Err(fail(std::io::ErrorKind::UnexpectedEof.into()));
        }
        Ok(bytes)
    }
}

/// Every tensor of the graph (initializers and `Constant` nodes) whose data is external,
/// checked: the file is inside `dir` and holds the range, and the range holds the tensor.
pub fn check(graph: &pb::GraphProto, dir: &Path) -> Result<Vec<ExternalData>, String> {
    let constants = graph
        .node
        .iter()
        .flat_map(|n| &n.attribute)
        .filter_map(|a| a.t.as_ref());
    graph
        .initializer
        .iter()
        .chain(constants)
        .filter(|t| t.data_location == Some(EXTERNAL))
        .map(|t| locate(t, dir))
        .collect()
}

/// Where one tensor's data lies, checked; `dir` is the model's folder.
pub fn locate(t: &pb::TensorProto, dir: &Path) -> Result<ExternalData, String> {
    let name = &t.name;
    let entry = |key: &str| {
        t.external_data
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.value.as_str())
    };
    let number = |key: &str| -> Result<Option<u64>, String> {
        entry(key)
            .map(|v| {
                v.parse::<u64>().map_err(|_| {
                    format!("tensor `{name}`: its external `{key}` is `{v}`, not a byte count")
                })
            })
            .transpose()
    };
    let location = entry("location").ok_or_else(|| {
        format!("tensor `{name}` keeps its data outside the model but names no file (`location`)")
    })?;
    let path = inside(dir, location).map_err(|why| {
        format!(
            "tensor `{name}`: its data file `{location}` {why}; ONNX external data lies in the \
             model's folder, named by a relative path"
        )
    })?;
    let file = std::fs::metadata(&path)
        .map_err(|e| format!("tensor `{name}`: its data file {}: {e}", path.display()))?;
    if !file.is_file() {
        return Err(format!(
            "tensor `{name}`: its data file {} is not a regular file",
            path.display()
        ));
    }
    let offset = number("offset")?.unwrap_or(0);
    let needed = byte_size(t).ok_or_else(|| {
        format!(
            "tensor `{name}`: its dims {:?} and data type {} give no byte size",
            t.dims, t.data_type
        )
    })?;
    let length = number("length")?.unwrap_or(needed);
    if length != needed {
        return Err(format!(
            "tensor `{name}`: its dims {:?} need {needed} bytes, but its external `length` is \
             {length}",
            t.dims
        ));
    }
    if offset
        .checked_add(length)
        .is_none_or(|end| end > file.len())
    {
        return Err(format!(
            "tensor `{name}` needs bytes {offset}..{} of {}, which holds {} bytes; is the file \
             truncated?",
            offset as u128 + length as u128,
            path.display(),
            file.len()
        ));
    }
    Ok(ExternalData {
        tensor: name.clone(),
        path,
        offset,
        length,
    })
}

/// `location` under `dir`, if it stays there once links are followed.
fn inside(dir: &Path, location: &str) -> Result<PathBuf, &'static str> {
    let relative = Path::new(location);
    if relative.as_os_str().is_empty() {
        return Err("is empty");
    }
    if relative.is_absolute() {
        return Err("is an absolute path");
    }
    if relative
        .components()
        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err("leads out of the model's folder (`..`)");
    }
    let path = dir.join(relative);
    // A missing file is reported with its path by the caller.
    let (Ok(real_dir), Ok(real)) = (dir.canonicalize(), path.canonicalize()) else {
        return Ok(path);
    };
    if !real.starts_with(&real_dir) {
        return Err("is a link that leads out of the model's folder");
    }
    Ok(path)
}

/// Bytes of the tensor's values, by its dims and data type; `None` for types without a fixed
/// size (strings) and sizes past 64 bits.
fn byte_size(t: &pb::TensorProto) -> Option<u64> {
    let element: u64 = match t.data_type {
        2 | 3 | 9 => 1,        // uint8, int8, bool
        4 | 5 | 10 | 16 => 2,  // uint16, int16, float16, bfloat16
        1 | 6 | 12 => 4,       // float, int32, uint32
        7 | 11 | 13 | 14 => 8, // int64, double, uint64, complex64
        15 => 16,              // complex128
        _ => return None,
    };
    t.dims.iter().try_fold(element, |n, &d| {
        u64::try_from(d).ok().and_then(|d| n.checked_mul(d))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(dims: &[i64], entries: &[(&str, &str)]) -> pb::TensorProto {
        pb::TensorProto {
            name: "w".into(),
            dims: dims.to_vec(),
            data_type: 1,
            data_location: Some(EXTERNAL),
            external_data: entries
                .iter()
                .map(|(k, v)| pb::StringStringEntryProto {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            ..Default::default()
        }
    }

    /// A model folder holding `w.bin` of 64 bytes (the values 0..16 as f32), and a file
    /// beside the folder that a model must not reach.
    fn folder() -> (tempfile::TempDir, PathBuf) {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("model");
        std::fs::create_dir(&dir).unwrap();
        let values: Vec<u8> = (0..16).flat_map(|v| (v as f32).to_le_bytes()).collect();
        std::fs::write(dir.join("w.bin"), values).unwrap();
        std::fs::write(root.path().join("secret"), [7u8; 64]).unwrap();
        (root, dir)
    }

    fn error(dims: &[i64], entries: &[(&str, &str)], dir: &Path) -> String {
        match locate(&tensor(dims, entries), dir) {
            Ok(found) => panic!("{entries:?} was accepted: {found:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn ranges_inside_the_file_are_read_alone() {
        let (_root, dir) = folder();
        let data = locate(
            &tensor(&[2, 2], &[("location", "w.bin"), ("offset", "16")]),
            &dir,
        )
        .unwrap();
        assert_eq!((data.offset, data.length), (16, 16));
        let values: Vec<f32> = data
            .read()
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(values, [4.0, 5.0, 6.0, 7.0]);
        // `./` is inside the folder too.
        assert!(locate(&tensor(&[16], &[("location", "./w.bin")]), &dir).is_ok());
    }

    #[test]
    fn locations_outside_the_models_folder_are_refused() {
        let (root, dir) = folder();
        let secret = root.path().join("secret");
        assert!(error(&[16], &[("location", "../secret")], &dir).contains("`..`"));
        assert!(
            error(&[16], &[("location", secret.to_str().unwrap())], &dir)
                .contains("is an absolute path")
        );
        std::os::unix::fs::symlink(&secret, dir.join("link.bin")).unwrap();
        let e = error(&[16], &[("location", "link.bin")], &dir);
        assert!(
            e.contains("is a link that leads out of the model's folder"),
            "{e}"
        );
        assert!(error(&[16], &[("location", "")], &dir).contains("is empty"));
        assert!(error(&[16], &[], &dir).contains("names no file"));
    }

    #[test]
    fn ranges_the_file_does_not_hold_are_refused() {
        let (_root, dir) = folder();
        let e = error(&[16], &[("location", "w.bin"), ("offset", "4")], &dir);
        assert!(
            e.contains("needs bytes 4..68 of") && e.contains("which holds 64 bytes"),
            "{e}"
        );
        // An offset near 2^64 would wrap around when added to the length.
        let e = error(
            &[1],
            &[("location", "w.bin"), ("offset", &u64::MAX.to_string())],
            &dir,
        );
        assert!(
            e.contains("needs bytes 18446744073709551615..18446744073709551619"),
            "{e}"
        );
        let e = error(&[16], &[("location", "w.bin"), ("length", "60")], &dir);
        assert!(
            e.contains("need 64 bytes, but its external `length` is 60"),
            "{e}"
        );
        let e = error(&[16], &[("location", "w.bin"), ("offset", "-4")], &dir);
        assert!(
            e.contains("its external `offset` is `-4`, not a byte count"),
            "{e}"
        );
        let e = error(&[16], &[("location", "missing.bin")], &dir);
        assert!(
            e.contains("missing.bin") && e.contains("No such file"),
            "{e}"
        );
        let e = error(&[16], &[("location", ".")], &dir);
        assert!(e.contains("is not a regular file"), "{e}");
        // Dims whose byte count passes 64 bits.
        let e = error(&[1 << 40, 1 << 40], &[("location", "w.bin")], &dir);
        assert!(e.contains("give no byte size"), "{e}");
    }
}
