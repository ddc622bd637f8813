// SPDX-License-Identifier: MPL-2.0
//! The engine file: a built engine (tuned plans, compiled kernels, converted weights) saved so
//! that the next start skips import, tuning and compilation.
//!
//! Layout: magic, format version (u32 LE), header length (u64 LE), the JSON header (key,
//! plans, kernels, weight sizes), the weights one after the other, and a SHA-256 of all that.
//! The key says what the engine was built from and for; a file whose key differs from the
//! one at hand, or whose checksum fails, is rebuilt rather than trusted.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::plan::{DType, Loc, Plan};

const MAGIC: &[u8; 8] = b"TRTCENG\0";
/// Bumped whenever the plan or file layout changes meaning.
pub const FORMAT_VERSION: u32 = 2;
const CHECKSUM_LEN: usize = 32;

/// What an engine is valid for: the same model bytes, GPU, libraries and build settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Key {
    pub format: u32,
    pub plugin_version: String,
    /// SHA-256 of the kernel source the file's PTX was compiled from: the plan calls these
    /// kernels by name and argument layout, so other kernels mean a rebuild.
    pub kernels_sha256: String,
    /// SHA-256 of the ONNX file and of any external weight files it names.
    pub onnx_sha256: String,
    pub gpu: String,
    pub compute_capability: (i32, i32),
    pub cuda_driver: i32,
    pub cudnn: usize,
    pub cublaslt: usize,
    pub precision: DType,
    pub batch_sizes: Vec<usize>,
    /// Height and width of the model input.
    pub input: (usize, usize),
}

impl Key {
    /// The fields that differ, as "field: file has A, this setup B".
    fn differences(&self, here: &Key) -> Vec<String> {
        let (ours, theirs) = (serde_json::to_value(here), serde_json::to_value(self));
        let (Ok(serde_json::Value::Object(ours)), Ok(serde_json::Value::Object(theirs))) =
            (ours, theirs)
        else {
            return vec!["the key does not serialize".into()];
        };
        ours.iter()
            .filter(|(field, value)| theirs.get(*field) != Some(value))
            .map(|(field, value)| {
                let file = theirs
                    .get(field)
                    .map_or("nothing".into(), |v| v.to_string());
                format!("{field}: the file has {file}, this setup {value}")
            })
            .collect()
    }

    /// A short name for the engine in a cache folder: the model's name and a hash of the key.
    pub fn file_name(&self, model: &Path) -> String {
        let stem = model
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned());
        let key = serde_json::to_vec(self).unwrap_or_default();
        let hash = hex(&Sha256::digest(&key));
        format!("{stem}-{}.engine", &hash[..16])
    }
}

/// A built engine, as saved and loaded.
pub struct EngineFile {
    pub key: Key,
    pub num_classes: usize,
    pub ptx: String,
    pub plans: Vec<Plan>,
    /// In the plans' type, ready to upload.
    pub weights: Vec<Vec<u8>>,
}

#[derive(Serialize, Deserialize)]
struct Header {
    key: Key,
    num_classes: usize,
    ptx: String,
    plans: Vec<Plan>,
    weight_sizes: Vec<usize>,
}

/// The per-user engine cache: `$XDG_CACHE_HOME/trtclassify` (usually `~/.cache/trtclassify`).
pub fn cache_dir() -> PathBuf {
    glib::user_cache_dir().join("trtclassify")
}

/// SHA-256 of the model file and of the external weight files it names, in hex.
pub fn model_digest(path: &Path, external: &[PathBuf]) -> Result<String, String> {
    let mut hasher = Sha256::new();
    for file in std::iter::once(path).chain(external.iter().map(PathBuf::as_path)) {
        let bytes = std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(&bytes);
    }
    Ok(hex(&hasher.finalize()))
}

/// SHA-256 of `text`, in hex.
pub fn sha256_hex(text: &str) -> String {
    hex(&Sha256::digest(text.as_bytes()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Loads the engine at `path` if its key is `key`. `Ok(None)`: there is no file. `Err`: the
/// file is there but unusable, and why.
pub fn load(path: &Path, key: &Key) -> Result<Option<EngineFile>, String> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read it: {e}")),
    };
    parse(&bytes, key).map(Some)
}

fn parse(bytes: &[u8], key: &Key) -> Result<EngineFile, String> {
    let fixed = MAGIC.len() + 4 + 8;
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err("not a trtclassify engine file".into());
    }
    if bytes.len() < fixed + CHECKSUM_LEN {
        return Err(format!("truncated: {} bytes", bytes.len()));
    }
    let format = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if format != FORMAT_VERSION {
        return Err(format!(
            "engine format {format}; this plugin reads format {FORMAT_VERSION}"
        ));
    }
    let (body, checksum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    if Sha256::digest(body).as_slice() != checksum {
        return Err("the checksum does not match: the file is truncated or corrupt".into());
    }
    let header_len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes")) as usize;
    let header = body
        .get(fixed..fixed.saturating_add(header_len))
        .ok_or("the header runs past the end")?;
    let mut header: Header =
        serde_json::from_slice(header).map_err(|e| format!("the header does not parse: {e}"))?;
    let diffs = header.key.differences(key);
    if !diffs.is_empty() {
        return Err(format!("built for another setup ({})", diffs.join("; ")));
    }
    let mut rest = &body[fixed + header_len..];
    if header.weight_sizes.iter().sum::<usize>() != rest.len() {
        return Err("the weights do not add up to the file's length".into());
    }
    let weights = header
        .weight_sizes
        .iter()
        .map(|&n| {
            let (w, tail) = rest.split_at(n);
            rest = tail;
            w.to_vec()
        })
        .collect::<Vec<_>>();
    check_plans(&mut header.plans, &weights, key.precision)?;
    Ok(EngineFile {
        key: header.key,
        num_classes: header.num_classes,
        ptx: header.ptx,
        plans: header.plans,
        weights,
    })
}

/// Every weight a plan names exists and has room for its offset.
fn check_plans(plans: &mut [Plan], weights: &[Vec<u8>], dtype: DType) -> Result<(), String> {
    // `locs_mut` is the one list of a step's buffers; nothing is changed through it here.
    for plan in plans {
        if plan.dtype != dtype {
            return Err("a plan of another precision".into());
        }
        for step in &mut plan.steps {
            for loc in step.locs_mut() {
                if let Loc::Weight { index, offset } = *loc {
                    let len = weights.get(index).map(|w| w.len() / dtype.size());
                    if len.is_none_or(|len| offset >= len) {
                        return Err(format!(
                            "a step names weight {index} at {offset}, not in the file"
                        ));
                    }
                }
                if matches!(loc, Loc::Temp { .. }) {
                    return Err("a plan with unplaced buffers".into());
                }
            }
        }
    }
    Ok(())
}

/// Writes `engine` to `path`, through a temporary file in the same folder so that a reader
/// never sees half a file.
pub fn save(path: &Path, engine: &EngineFile) -> Result<(), String> {
    let header = Header {
        key: engine.key.clone(),
        num_classes: engine.num_classes,
        ptx: engine.ptx.clone(),
        plans: engine.plans.clone(),
        weight_sizes: engine.weights.iter().map(Vec::len).collect(),
    };
    let header = serde_json::to_vec(&header).map_err(|e| e.to_string())?;
    let mut body =
        Vec::with_capacity(20 + header.len() + engine.weights.iter().map(Vec::len).sum::<usize>());
    body.extend_from_slice(MAGIC);
    body.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    body.extend_from_slice(&(header.len() as u64).to_le_bytes());
    body.extend_from_slice(&header);
    for w in &engine.weights {
        body.extend_from_slice(w);
    }
    let checksum = Sha256::digest(&body);

    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    // Unique per writer: elements of one process may save the same engine at once.
    static WRITERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let writer = WRITERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{writer}", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(&body)?;
        f.write_all(&checksum)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("cannot write {}: {e}", path.display()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cuda::ir::Act;
    use crate::engine::cuda::plan::{Step, Strided};

    fn key() -> Key {
        Key {
            format: FORMAT_VERSION,
            plugin_version: "1.0".into(),
            kernels_sha256: "cd".repeat(32),
            onnx_sha256: "ab".repeat(32),
            gpu: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            cuda_driver: 13000,
            cudnn: 91400,
            cublaslt: 130000,
            precision: DType::F16,
            batch_sizes: vec![1, 2, 4],
            input: (224, 224),
        }
    }

    fn engine() -> EngineFile {
        let step = Step::Ew {
            op: None,
            act: Act::Relu,
            cast: super::super::plan::Cast::None,
            dims: vec![4],
            out: Strided {
                loc: Loc::Arena(0),
                strides: vec![1],
            },
            a: Strided {
                loc: Loc::Weight {
                    index: 1,
                    offset: 2,
                },
                strides: vec![1],
            },
            b: None,
        };
        EngineFile {
            key: key(),
            num_classes: 4,
            ptx: ".version 8.0".into(),
            plans: vec![Plan {
                batch: 1,
                dtype: DType::F16,
                arena_len: 4,
                input_len: 12,
                output_len: 4,
                steps: vec![step],
            }],
            weights: vec![vec![1, 2], vec![3; 12]],
        }
    }

    fn saved() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/model.engine");
        save(&path, &engine()).unwrap();
        (dir, path)
    }

    #[test]
    fn round_trip() {
        let (_dir, path) = saved();
        let loaded = load(&path, &key()).unwrap().unwrap();
        let want = engine();
        assert_eq!(loaded.plans, want.plans);
        assert_eq!(loaded.weights, want.weights);
        assert_eq!((loaded.num_classes, loaded.ptx), (4, want.ptx));
        assert!(
            load(&path.with_extension("other"), &key())
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn another_setup_names_what_differs() {
        let (_dir, path) = saved();
        let mut here = key();
        here.gpu = "NVIDIA L4".into();
        here.batch_sizes = vec![1, 2];
        let err = load(&path, &here).err().unwrap();
        assert!(
            err.contains("gpu: the file has \"NVIDIA H200\", this setup \"NVIDIA L4\""),
            "{err}"
        );
        assert!(err.contains("batch_sizes"), "{err}");
        assert!(!err.contains("cudnn"), "{err}");
        // Another plugin build with other kernels: the PTX in the file is not theirs.
        let mut here = key();
        here.kernels_sha256 = "ef".repeat(32);
        let err = load(&path, &here).err().unwrap();
        assert!(err.contains("kernels_sha256"), "{err}");
    }

    #[test]
    fn damaged_files_are_refused() {
        let (_dir, path) = saved();
        let good = std::fs::read(&path).unwrap();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..good.len() / 2].to_vec(), "checksum does not match"),
            (good[..10].to_vec(), "truncated"),
            (Vec::new(), "not a trtclassify engine file"),
            (
                b"\x7fELF\x02\x01\x01\0 a shared library".to_vec(),
                "not a trtclassify engine file",
            ),
            (
                {
                    let mut b = good.clone();
                    b[8] = 99;
                    b
                },
                "engine format 99",
            ),
        ];
        for (bytes, want) in cases {
            std::fs::write(&path, &bytes).unwrap();
            let err = load(&path, &key()).err().unwrap();
            assert!(err.contains(want), "expected «{want}» in «{err}»");
        }
        // Every single bit flipped past the magic and version is caught by the checksum.
        for i in (12..good.len()).step_by(7) {
            let mut b = good.clone();
            b[i] ^= 1 << (i % 8);
            std::fs::write(&path, &b).unwrap();
            assert!(
                load(&path, &key()).is_err(),
                "a flip at byte {i} went unnoticed"
            );
        }
    }

    #[test]
    fn plans_naming_missing_weights_are_refused() {
        let mut e = engine();
        e.weights.pop();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.engine");
        save(&path, &e).unwrap();
        let err = load(&path, &key()).err().unwrap();
        assert!(err.contains("names weight 1"), "{err}");
    }

    #[test]
    fn unwritable_folder_is_an_error_not_a_panic() {
        let err = save(Path::new("/proc/trtclassify/x.engine"), &engine()).unwrap_err();
        assert!(err.contains("/proc/trtclassify"), "{err}");
    }

    #[test]
    fn file_names_differ_by_key() {
        let mut other = key();
        other.precision = DType::F32;
        let model = Path::new("/models/resnet50.onnx");
        let (a, b) = (key().file_name(model), other.file_name(model));
        assert!(a.starts_with("resnet50-") && a.ends_with(".engine"), "{a}");
        assert_ne!(a, b);
    }
}
