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

use crate::engine::compiler::check;
use crate::engine::compiler::plan::{DType, Plan, weight_type};

/// Why an engine file cannot be used, read or written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file is there but cannot be read.
    #[error("cannot read it: {0}")]
    Unreadable(std::io::Error),
    /// Another user owns the file: its PTX would run as ours.
    #[error("owned by user {owner}, not by this process's user {me}: not trusted")]
    NotOwned {
        /// The file owner's uid.
        owner: u32,
        /// This process's effective uid.
        me: u32,
    },
    /// Another user could have written the file.
    #[error("writable by its group or by others (mode {mode:o}): not trusted")]
    Writable {
        /// The file's permission bits (`0o777` of its mode).
        mode: u32,
    },
    /// No engine file's magic.
    #[error("not a trtclassify engine file")]
    NotAnEngineFile,
    /// Shorter than the fixed fields and the checksum.
    #[error("truncated: {0} bytes")]
    Truncated(usize),
    /// A format this plugin does not read.
    #[error("engine format {0}; this plugin reads format {FORMAT_VERSION}")]
    Format(u32),
    /// The contents do not match their checksum.
    #[error("the checksum does not match: the file is truncated or corrupt")]
    Checksum,
    /// The header's length runs past the end of the file.
    #[error("the header runs past the end")]
    HeaderPastEnd,
    /// The header is not the JSON this plugin writes.
    #[error("the header does not parse: {0}")]
    Header(serde_json::Error),
    /// The key differs from this setup's: each difference, as `Key::differences` says it.
    #[error("built for another setup ({})", .0.join("; "))]
    OtherSetup(Vec<String>),
    /// The header's weight sizes do not add up to the file's length.
    #[error("the weights do not add up to the file's length")]
    WeightsLength,
    /// Plans for other batch sizes than the key's.
    #[error("plans for batch sizes {found:?}, not {key:?}")]
    BatchSizes {
        /// The batch sizes of the file's plans, in order.
        found: Vec<usize>,
        /// The batch sizes its key lists.
        key: Vec<usize>,
    },
    /// A number of classes out of range.
    #[error("{0} classes")]
    Classes(usize),
    /// A weight whose length is not a whole number of values of the plans' type.
    #[error("weight {0} is not a whole number of values")]
    PartialWeight(usize),
    /// A plan that fails the compiler's checks (`check::check_plan`), and why.
    #[error("{0}")]
    Plan(String),
    /// A file the model names cannot be read (for its digest).
    #[error("{}: {source}", path.display())]
    Read {
        /// The model or external weight file.
        path: PathBuf,
        /// What the read failed with.
        source: std::io::Error,
    },
    /// The header does not serialise.
    #[error("{0}")]
    Serialize(serde_json::Error),
    /// The engine's folder cannot be created.
    #[error("cannot create {}: {source}", dir.display())]
    CreateDir {
        /// The folder.
        dir: PathBuf,
        /// What the creation failed with.
        source: std::io::Error,
    },
    /// The engine cannot be written.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The engine file.
        path: PathBuf,
        /// What the write failed with.
        source: std::io::Error,
    },
}

const MAGIC: &[u8; 8] = b"TRTCENG\0";
/// Bumped whenever the plan or file layout changes meaning.
pub const FORMAT_VERSION: u32 = 9;
const CHECKSUM_LEN: usize = 32;

/// What an engine is valid for: the same model bytes, GPU, libraries and build settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Key {
    /// `FORMAT_VERSION` of the plugin that wrote it.
    pub format: u32,
    /// The version of the plugin that built it.
    pub plugin_version: String,
    /// SHA-256 of the kernel source the file's PTX was compiled from: the plan calls these
    /// kernels by name and argument layout, so other kernels mean a rebuild.
    pub kernels_sha256: String,
    /// SHA-256 of the ONNX file and of any external weight files it names.
    pub onnx_sha256: String,
    /// The GPU's name: algorithms are tuned for it.
    pub gpu: String,
    /// The GPU's compute capability (major, minor): the PTX is compiled for it.
    pub compute_capability: (i32, i32),
    /// The CUDA driver's version.
    pub cuda_driver: i32,
    /// cuDNN's version: its algorithms are tuned for it.
    pub cudnn: usize,
    /// cuBLASLt's version.
    pub cublaslt: usize,
    /// The type of the plans' activations and weights.
    pub precision: DType,
    /// The batch size of each plan, in order.
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
    pub(crate) fn file_name(&self, model: &Path) -> String {
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
    /// What it was built from and for.
    pub key: Key,
    /// Scores per frame.
    pub num_classes: usize,
    /// The kernels, compiled for the key's GPU and precision.
    pub ptx: String,
    /// One plan per batch size of the key, tuned.
    pub plans: Vec<Plan>,
    /// In the plans' type, ready to upload.
    pub weights: Vec<Vec<u8>>,
    /// Why an engine asked for in fp16 runs in fp32: the sample frames overflowed fp16 (the
    /// report of `runtime::Runtime::first_overflow`). `None`: it runs in the key's precision.
    pub fp32_because: Option<String>,
    /// The nodes of an fp16 engine computed in f32 because fp16 cannot hold their values
    /// (mixed precision); `None`: every step runs in the plans' type.
    pub kept_f32: Option<KeptF32>,
}

/// The part of an fp16 engine kept in f32.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeptF32 {
    /// What was found on the sample frames: each node whose values passed fp16's range.
    pub because: Vec<String>,
    /// The nodes computed in f32 (by `Plan::origins`): those and the nodes reading them.
    pub nodes: Vec<String>,
    /// The kernels compiled for f32, which their steps run.
    pub ptx: String,
    /// Whether each weight is stored in f32 (read by a node kept in f32), not fp16.
    pub weights: Vec<bool>,
}

impl EngineFile {
    /// The type the plans and weights are in.
    pub fn dtype(&self) -> DType {
        plans_dtype(&self.key, &self.fp32_because)
    }
}

fn plans_dtype(key: &Key, fp32_because: &Option<String>) -> DType {
    match fp32_because {
        Some(_) => DType::F32,
        None => key.precision,
    }
}

#[derive(Serialize, Deserialize)]
struct Header {
    key: Key,
    num_classes: usize,
    ptx: String,
    plans: Vec<Plan>,
    weight_sizes: Vec<usize>,
    fp32_because: Option<String>,
    kept_f32: Option<KeptF32>,
}

/// The per-user engine cache: `$XDG_CACHE_HOME/trtclassify` (usually `~/.cache/trtclassify`).
pub(crate) fn cache_dir() -> PathBuf {
    glib::user_cache_dir().join("trtclassify")
}

/// SHA-256 of the model file and of the external weight files it names, in hex.
pub(crate) fn model_digest(path: &Path, external: &[PathBuf]) -> Result<String, Error> {
    let mut hasher = Sha256::new();
    for file in std::iter::once(path).chain(external.iter().map(PathBuf::as_path)) {
        let bytes = std::fs::read(file).map_err(|source| Error::Read {
            path: file.to_owned(),
            source,
        })?;
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(&bytes);
    }
    Ok(hex(&hasher.finalize()))
}

/// SHA-256 of `text`, in hex.
pub(crate) fn sha256_hex(text: &str) -> String {
    hex(&Sha256::digest(text.as_bytes()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Loads the engine at `path` if its key is `key` and its plans fit frames of `frame_len`
/// values. `Ok(None)`: there is no file. `Err`: the file is there but unusable, and why.
///
/// An engine file holds GPU code (PTX) and the plan that drives it, so it is trusted like a
/// program: only a file owned by this user and writable by no one else is used (see
/// `trusted`); its checksum proves it intact, and every step of its plans is checked to stay
/// within the buffers it names (`check_plans`) so that a file written by a buggy build cannot
/// make a kernel touch memory outside them.
pub(crate) fn load(path: &Path, key: &Key, frame_len: usize) -> Result<Option<EngineFile>, Error> {
    let mut file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::Unreadable(e)),
    };
    trusted(&file)?;
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut file, &mut bytes).map_err(Error::Unreadable)?;
    from_bytes(&bytes, key, frame_len).map(Some)
}

/// Refuses a file that another user owns or could have written: its PTX would run as ours.
#[cfg(unix)]
fn trusted(file: &std::fs::File) -> Result<(), Error> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata().map_err(Error::Unreadable)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(Error::NotOwned {
            owner: meta.uid(),
            me,
        });
    }
    if meta.mode() & 0o022 != 0 {
        return Err(Error::Writable {
            mode: meta.mode() & 0o777,
        });
    }
    Ok(())
}

#[cfg(not(unix))]
fn trusted(_file: &std::fs::File) -> Result<(), Error> {
    Ok(())
}

/// An engine file's contents, checked as `load` checks them (all but the file's owner and
/// mode): for a key, and frames of `frame_len` values.
pub fn from_bytes(bytes: &[u8], key: &Key, frame_len: usize) -> Result<EngineFile, Error> {
    let fixed = MAGIC.len() + 4 + 8;
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err(Error::NotAnEngineFile);
    }
    if bytes.len() < fixed + CHECKSUM_LEN {
        return Err(Error::Truncated(bytes.len()));
    }
    let format = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if format != FORMAT_VERSION {
        return Err(Error::Format(format));
    }
    let (body, checksum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    if Sha256::digest(body).as_slice() != checksum {
        return Err(Error::Checksum);
    }
    let header_len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes")) as usize;
    let header = body
        .get(fixed..fixed.saturating_add(header_len))
        .ok_or(Error::HeaderPastEnd)?;
    let mut header: Header = serde_json::from_slice(header).map_err(Error::Header)?;
    let diffs = header.key.differences(key);
    if !diffs.is_empty() {
        return Err(Error::OtherSetup(diffs));
    }
    let mut rest = &body[fixed + header_len..];
    let total = header
        .weight_sizes
        .iter()
        .try_fold(0usize, |sum, &n| sum.checked_add(n));
    if total != Some(rest.len()) {
        return Err(Error::WeightsLength);
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
    check_plans(
        &mut header.plans,
        &weights,
        header.kept_f32.as_ref(),
        key,
        plans_dtype(key, &header.fp32_because),
        frame_len,
        header.num_classes,
    )?;
    Ok(EngineFile {
        key: header.key,
        num_classes: header.num_classes,
        ptx: header.ptx,
        plans: header.plans,
        weights,
        fp32_because: header.fp32_because,
        kept_f32: header.kept_f32,
    })
}

/// The plans are those of the key (batch sizes) in `dtype`, their input and output buffers
/// hold the batch's frames and scores, and every step's sizes fit what its kernel takes and
/// keep it inside the buffers it names.
fn check_plans(
    plans: &mut [Plan],
    weights: &[Vec<u8>],
    kept_f32: Option<&KeptF32>,
    key: &Key,
    dtype: DType,
    frame_len: usize,
    num_classes: usize,
) -> Result<(), Error> {
    let batches: Vec<usize> = plans.iter().map(|p| p.batch).collect();
    if batches != key.batch_sizes {
        return Err(Error::BatchSizes {
            found: batches,
            key: key.batch_sizes.clone(),
        });
    }
    if !(1..=1 << 24).contains(&num_classes) {
        return Err(Error::Classes(num_classes));
    }
    let wide = kept_f32.map_or(&[][..], |k| &k.weights);
    let type_of = |index: usize| weight_type(wide, index, dtype);
    if let Some(i) =
        (0..weights.len()).find(|&i| !weights[i].len().is_multiple_of(type_of(i).size()))
    {
        return Err(Error::PartialWeight(i));
    }
    if kept_f32.is_some_and(|k| k.weights.len() != weights.len()) {
        return Err(Error::Plan("a weight type for each weight".into()));
    }
    let weight = |index: usize| {
        let t = type_of(index);
        weights.get(index).map(|w| (w.len() / t.size(), t))
    };
    for plan in plans {
        if plan.wide_len > 0 && kept_f32.is_none() {
            return Err(Error::Plan(
                "values kept in f32 without their kernels".into(),
            ));
        }
        check::check_plan(plan, &weight, dtype, frame_len, num_classes)
            .map_err(|e| Error::Plan(e.to_string()))?;
    }
    Ok(())
}

/// Writes `engine` to `path`, through a temporary file in the same folder so that a reader
/// never sees half a file.
pub(crate) fn save(path: &Path, engine: &EngineFile) -> Result<(), Error> {
    let bytes = to_bytes(engine)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| Error::CreateDir {
            dir: dir.to_owned(),
            source,
        })?;
    }
    // Unique per writer: elements of one process may save the same engine at once.
    static WRITERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let writer = WRITERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{writer}", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(&bytes)?;
        f.sync_all()
    });
    if let Err(source) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::Write {
            path: path.to_owned(),
            source,
        });
    }
    Ok(())
}

/// The file `save` writes for `engine`: magic, format, header, weights, then the checksum.
pub fn to_bytes(engine: &EngineFile) -> Result<Vec<u8>, Error> {
    let header = Header {
        key: engine.key.clone(),
        num_classes: engine.num_classes,
        ptx: engine.ptx.clone(),
        plans: engine.plans.clone(),
        weight_sizes: engine.weights.iter().map(Vec::len).collect(),
        fp32_because: engine.fp32_because.clone(),
        kept_f32: engine.kept_f32.clone(),
    };
    let header = serde_json::to_vec(&header).map_err(Error::Serialize)?;
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
    body.extend_from_slice(&checksum);
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::compiler::ir::Act;
    use crate::engine::compiler::plan::{Cast, Loc, MAX_RANK, Step, Strided};

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
            batch_sizes: vec![1],
            input: (2, 2),
        }
    }

    /// Values of one frame of the fixture's model: 3 × 2 × 2.
    const FRAME: usize = 12;

    fn engine() -> EngineFile {
        let step = Step::Ew {
            op: None,
            act: Act::Relu,
            cast: Cast::None,
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
                wide_len: 0,
                input_len: 12,
                output_len: 4,
                steps: vec![step],
                origins: vec!["copy".into()],
            }],
            weights: vec![vec![1, 2], vec![3; 12]],
            fp32_because: None,
            kept_f32: None,
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
        let loaded = load(&path, &key(), FRAME).unwrap().unwrap();
        let want = engine();
        assert_eq!(loaded.plans, want.plans);
        assert_eq!(loaded.weights, want.weights);
        assert_eq!((loaded.num_classes, loaded.ptx), (4, want.ptx));
        assert!(
            load(&path.with_extension("other"), &key(), FRAME)
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
        here.input = (224, 224);
        let err = load(&path, &here, FRAME).err().unwrap().to_string();
        assert!(
            err.contains("gpu: the file has \"NVIDIA H200\", this setup \"NVIDIA L4\""),
            "{err}"
        );
        assert!(err.contains("batch_sizes"), "{err}");
        assert!(!err.contains("cudnn"), "{err}");
        // Another plugin build with other kernels: the PTX in the file is not theirs.
        let mut here = key();
        here.kernels_sha256 = "ef".repeat(32);
        let err = load(&path, &here, FRAME).err().unwrap().to_string();
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
            let err = load(&path, &key(), FRAME).err().unwrap().to_string();
            assert!(err.contains(want), "expected «{want}» in «{err}»");
        }
        // Every single bit flipped past the magic and version is caught by the checksum.
        for i in (12..good.len()).step_by(7) {
            let mut b = good.clone();
            b[i] ^= 1 << (i % 8);
            std::fs::write(&path, &b).unwrap();
            assert!(
                load(&path, &key(), FRAME).is_err(),
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
        let err = load(&path, &key(), FRAME).err().unwrap().to_string();
        assert!(err.contains("names weight 1"), "{err}");
    }

    /// A change that makes a sound file unsound.
    type Damage<T> = fn(&mut T);

    /// Saves `e` and loads it back.
    fn reload(e: &EngineFile) -> Result<Option<EngineFile>, Error> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.engine");
        save(&path, e).unwrap();
        load(&path, &key(), FRAME)
    }

    #[test]
    fn plans_reaching_outside_their_buffers_are_refused() {
        // The fixture's step reads weight 1 (6 values) from 2 on and writes arena 0..4.
        let cases: Vec<(Damage<Step>, &str)> = vec![
            (
                |s| {
                    let Step::Ew { a, .. } = s else {
                        unreachable!()
                    };
                    a.loc = Loc::Weight {
                        index: 1,
                        offset: 3,
                    };
                },
                "touches elements 3..7 of a weight of 6",
            ),
            (
                |s| {
                    let Step::Ew { out, .. } = s else {
                        unreachable!()
                    };
                    out.loc = Loc::Arena(1);
                },
                "touches elements 1..5 of a buffer of 4",
            ),
            (
                |s| {
                    let Step::Ew { dims, .. } = s else {
                        unreachable!()
                    };
                    dims[0] = 5;
                },
                "touches elements 0..5",
            ),
            (
                |s| {
                    let Step::Ew { out, .. } = s else {
                        unreachable!()
                    };
                    out.strides[0] = 2;
                },
                "touches elements 0..7 of a buffer of 4",
            ),
            (
                |s| {
                    let Step::Ew { a, .. } = s else {
                        unreachable!()
                    };
                    a.strides[0] = -1;
                },
                "touches elements -1..3",
            ),
            (
                |s| {
                    // An fp16 step writing the f32 scores without a cast.
                    let Step::Ew { out, .. } = s else {
                        unreachable!()
                    };
                    out.loc = Loc::Output(0);
                },
                "reads or writes a buffer in the wrong type",
            ),
            (
                |s| {
                    // A cast from f32 reading fp16 weights as f32: twice their bytes.
                    let Step::Ew { cast, .. } = s else {
                        unreachable!()
                    };
                    *cast = Cast::FromF32;
                },
                "reads or writes a buffer in the wrong type",
            ),
            (
                |s| {
                    // A binary operator without its second operand reads address 0.
                    let Step::Ew { op, .. } = s else {
                        unreachable!()
                    };
                    *op = Some(crate::engine::compiler::ir::BinOp::Add);
                },
                "sizes its kernel cannot take",
            ),
            (
                |s| {
                    let Step::Ew { dims, .. } = s else {
                        unreachable!()
                    };
                    *dims = vec![1; MAX_RANK + 1];
                },
                "sizes its kernel cannot take",
            ),
            (
                |s| {
                    let Step::Ew { a, .. } = s else {
                        unreachable!()
                    };
                    a.strides.push(0);
                },
                "sizes its kernel cannot take",
            ),
            (
                |s| {
                    let Step::Ew { out, .. } = s else {
                        unreachable!()
                    };
                    out.loc = Loc::Temp { id: 0, offset: 0 };
                },
                "an unplaced buffer",
            ),
            (
                |s| {
                    *s = Step::Zero {
                        loc: Loc::Arena(2),
                        len: 3,
                    }
                },
                "touches elements 2..5 of a buffer of 4",
            ),
        ];
        assert!(reload(&engine()).is_ok(), "the fixture itself is sound");
        for (damage, want) in cases {
            let mut e = engine();
            damage(&mut e.plans[0].steps[0]);
            let err = reload(&e)
                .err()
                .unwrap_or_else(|| panic!("accepted: {want}"))
                .to_string();
            assert!(err.contains(want), "expected «{want}» in «{err}»");
            assert!(err.contains("the plan for batch 1: step 0"), "{err}");
        }
    }

    #[test]
    fn weight_sizes_that_overflow_are_refused() {
        // A header whose sizes wrap around to the file's length (the checksum is the writer's
        // to compute, so it proves nothing here).
        let e = engine();
        let header = Header {
            key: key(),
            num_classes: e.num_classes,
            ptx: e.ptx.clone(),
            plans: e.plans.clone(),
            weight_sizes: vec![usize::MAX, 15],
            fp32_because: None,
            kept_f32: None,
        };
        let header = serde_json::to_vec(&header).unwrap();
        let mut body = Vec::new();
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        body.extend_from_slice(&(header.len() as u64).to_le_bytes());
        body.extend_from_slice(&header);
        body.extend_from_slice(&[0; 14]);
        let checksum = Sha256::digest(&body);
        body.extend_from_slice(&checksum);
        let err = from_bytes(&body, &key(), FRAME).err().unwrap().to_string();
        assert!(err.contains("do not add up"), "{err}");
    }

    #[test]
    fn plans_that_do_not_fit_the_frames_or_the_key_are_refused() {
        let cases: Vec<(Damage<EngineFile>, &str)> = vec![
            (|e| e.plans[0].input_len = 13, "input of 13"),
            (|e| e.plans[0].output_len = 5, "output of 5"),
            (|e| e.num_classes = 0, "0 classes"),
            (
                |e| e.plans[0].batch = 2,
                "plans for batch sizes [2], not [1]",
            ),
            (|e| e.plans.push(e.plans[0].clone()), "batch sizes [1, 1]"),
            (|e| e.weights[1].push(0), "weight 1 is not a whole number"),
        ];
        for (damage, want) in cases {
            let mut e = engine();
            damage(&mut e);
            let err = reload(&e)
                .err()
                .unwrap_or_else(|| panic!("accepted: {want}"))
                .to_string();
            assert!(err.contains(want), "expected «{want}» in «{err}»");
        }
    }

    #[test]
    fn files_others_could_have_written_are_not_trusted() {
        use std::os::unix::fs::PermissionsExt;
        let (_dir, path) = saved();
        for mode in [0o666, 0o620, 0o602] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = load(&path, &key(), FRAME).err().unwrap().to_string();
            assert!(err.contains("writable by its group or by others"), "{err}");
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(load(&path, &key(), FRAME).unwrap().is_some());
        // SAFETY: no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            // As root the test can hand the file to another user.
            std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
            let err = load(&path, &key(), FRAME).err().unwrap().to_string();
            assert!(err.contains("owned by user 65534"), "{err}");
        }
    }

    #[test]
    fn the_plans_of_real_models_pass_the_checks() {
        // What the compiler makes of the repository's models, saved and loaded back: the
        // checks refuse nothing the build writes, fp16 plans that overflowed and were built
        // in fp32 included; fp32 plans under an fp16 key without that reason are refused.
        for name in ["colors.onnx", "cnn.onnx", "ops.onnx"] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("models")
                .join(name);
            let model = crate::engine::OnnxModel::load(&path).unwrap();
            let spec = model.input_spec(None).unwrap();
            let batch_sizes = vec![1, 2, 4];
            let cases = [
                (DType::F16, DType::F16, None, true),
                (DType::F32, DType::F32, None, true),
                (DType::F16, DType::F32, Some("overflow".to_string()), true),
                (DType::F16, DType::F32, None, false),
            ];
            for (asked, dtype, fp32_because, loads) in cases {
                let (plans, weights) =
                    crate::engine::compiler::compile(&model, &batch_sizes, spec, dtype).unwrap();
                let k = Key {
                    precision: asked,
                    batch_sizes: batch_sizes.clone(),
                    input: (spec.height, spec.width),
                    ..key()
                };
                let e = EngineFile {
                    key: k.clone(),
                    num_classes: plans[0].output_len,
                    ptx: String::new(),
                    plans,
                    weights: weights
                        .data
                        .iter()
                        .map(|w| vec![0; w.len() * dtype.size()])
                        .collect(),
                    fp32_because,
                    kept_f32: None,
                };
                assert_eq!(e.dtype() == dtype, loads, "{name}: {asked:?} as {dtype:?}");
                let dir = tempfile::tempdir().unwrap();
                let file = dir.path().join("e.engine");
                save(&file, &e).unwrap();
                let loaded = load(&file, &k, spec.frame_len());
                let what = format!("{name} {asked:?} as {dtype:?}");
                match loads {
                    true => assert!(matches!(loaded, Ok(Some(_))), "{what}: {:?}", loaded.err()),
                    false => {
                        let err = loaded.err().expect("refused").to_string();
                        assert!(err.contains("another precision"), "{what}: {err}");
                    }
                }
            }
        }
    }

    #[test]
    fn mixed_precision_plans_load_with_their_f32_part() {
        // big_middle.onnx with its first convolution (and the product reading it) kept in
        // f32: the file loads with the weights of the kept nodes in f32 and the others in
        // fp16; without its f32 part, or with a kept weight stored in fp16, it is refused.
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/big_middle.onnx");
        let model = crate::engine::OnnxModel::load(&path).unwrap();
        let spec = model.input_spec(None).unwrap();
        let batch_sizes = vec![1, 2];
        let kept = ["conv_0".to_owned()];
        let (plans, weights) =
            crate::engine::compiler::compile_mixed(&model, &batch_sizes, spec, DType::F16, &kept)
                .unwrap();
        assert!(plans.iter().all(|p| p.wide_len > 0));
        assert!(weights.wide.contains(&true) && weights.wide.contains(&false));
        let k = Key {
            batch_sizes: batch_sizes.clone(),
            input: (spec.height, spec.width),
            ..key()
        };
        let bytes = |i: usize, t: DType| vec![0u8; weights.data[i].len() * t.size()];
        let file = |kept_f32: Option<KeptF32>, half_everywhere: bool| EngineFile {
            key: k.clone(),
            num_classes: plans[0].output_len,
            ptx: String::new(),
            plans: plans.clone(),
            weights: (0..weights.data.len())
                .map(|i| match half_everywhere {
                    true => bytes(i, DType::F16),
                    false => bytes(i, weights.dtype(i, DType::F16)),
                })
                .collect(),
            fp32_because: None,
            kept_f32,
        };
        let kept_f32 = KeptF32 {
            because: vec!["node `conv_0` reaches 6e5".into()],
            nodes: plans[0].wide_nodes(),
            ptx: String::new(),
            weights: weights.wide.clone(),
        };
        assert_eq!(kept_f32.nodes, ["conv_0", "conv_1"]);
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join("e.engine");
        let load_back = |e: &EngineFile| {
            save(&at, e).unwrap();
            load(&at, &k, spec.frame_len())
        };
        let loaded = load_back(&file(Some(kept_f32.clone()), false))
            .unwrap()
            .expect("loads");
        assert_eq!(loaded.kept_f32.as_ref(), Some(&kept_f32));
        assert_eq!(loaded.plans, plans);
        let err = load_back(&file(None, false))
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("without their kernels"), "{err}");
        let err = load_back(&file(Some(kept_f32), true))
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("touches elements"), "{err}");
    }

    #[test]
    fn unwritable_folder_is_an_error_not_a_panic() {
        let err = save(Path::new("/proc/trtclassify/x.engine"), &engine())
            .unwrap_err()
            .to_string();
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
