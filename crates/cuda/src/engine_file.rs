// SPDX-License-Identifier: MPL-2.0
//! The engine file: a built engine (tuned plans, compiled kernels, converted weights) saved so
//! that the next start skips import, tuning and compilation.
//!
//! Layout: magic, format version (u32 LE), header length (u64 LE), the JSON header (key,
//! plans, kernels, weight sizes), the weights one after the other, and a SHA-256 of all that.
//! The key says what the engine was built from and for; a file whose key differs from the
//! one at hand, or whose checksum fails, is rebuilt rather than trusted.
//!
//! Files are read and written as streams: an engine's weights are gigabytes for large
//! models, and each is read straight into its own buffer (and hashed on the way), so that a
//! load holds the engine once, not also the file. Where files are kept, and how they are
//! written and shared, is `super::cache`'s.

use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::cache::{self, CHUNK, Place};
use super::checksum;
use trtclassify_compiler::check;
use trtclassify_compiler::plan::{DType, Plan, scale_weights, weight_type};

/// Why an engine file cannot be used, read or written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file is there but cannot be read.
    #[error("cannot read it: {0}")]
    Unreadable(std::io::Error),
    /// Another user owns the file: its kernels would run as ours.
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
    /// A symbolic link where the engine file goes: whoever could plant it chose what it
    /// leads to. The save replaces the link itself.
    #[error("a symbolic link, which is not followed: not trusted")]
    Symlink,
    /// A folder, a FIFO or a device where the engine file goes.
    #[error("not a regular file")]
    NotAFile,
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
    /// The header's kernel and weight sizes do not add up to the file's length.
    #[error("the kernels and weights do not add up to the file's length")]
    WeightsLength,
    /// A set of kernels that is not an ELF file whose tables lie within it: the driver reads
    /// them with no length to go by.
    #[error("its kernels are not a whole CUBIN: {0}")]
    Kernels(&'static str),
    /// Not one set of kernels, plus one for the nodes kept in f32 where there are some.
    #[error("{found} sets of kernels, not {want}")]
    KernelSets {
        /// The sets the header lists.
        found: usize,
        /// The sets its engine runs.
        want: usize,
    },
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
pub const FORMAT_VERSION: u32 = 19;
/// The magic and the format version: what tells a file's format.
pub const FORMAT_PREFIX: usize = MAGIC.len() + 4;
/// The magic, the format version and the header's length.
const FIXED: usize = FORMAT_PREFIX + 8;

/// What an engine is valid for: the same model bytes, GPU, libraries and build settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Key {
    /// `FORMAT_VERSION` of the plugin that wrote it.
    pub format: u32,
    /// The version of the plugin that built it.
    pub plugin_version: String,
    /// SHA-256 of the kernel source the file's kernels were compiled from: the plan calls these
    /// kernels by name and argument layout, so other kernels mean a rebuild.
    pub kernels_sha256: String,
    /// SHA-256 of the ONNX file and of any external weight files it names.
    pub onnx_sha256: String,
    /// The GPU's name: algorithms are tuned for it.
    pub gpu: String,
    /// The GPU's compute capability (major, minor): the kernels are compiled for it.
    pub compute_capability: (i32, i32),
    /// The CUDA driver's version.
    pub cuda_driver: i32,
    /// The version of NVRTC, whose machine code the kernels are.
    pub nvrtc: i32,
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
    /// For int8 and FP8 engines: the format and the calibration table's SHA-256 (another
    /// table means other scales). Absent from the keys of fp16 and fp32 engines, whose files
    /// and names are as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantized: Option<QuantKey>,
}

/// How an int8 or FP8 engine was quantized.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantKey {
    /// The 8-bit format.
    pub format: trtclassify_compiler::plan::QuantFormat,
    /// SHA-256 of the calibration table file.
    pub table_sha256: String,
    /// SHA-256 of the held-out frames beside it, where there are any.
    pub held_out_sha256: Option<String>,
    /// The least top-1 agreement the accuracy guard asked (`EngineOptions::min_agreement`).
    pub min_agreement: f64,
    /// Whether every quantized layer runs in 8 bits (`EngineOptions::strict_precision`),
    /// rather than each in the faster of 8 bits and fp16.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub strict: bool,
}

/// What the accuracy guard measured of an int8 or FP8 build on the held-out frames.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantCheck {
    /// The build's report: the layers quantized and kept, and the agreement measured.
    pub report: String,
    /// Whether the agreement fell short, so that the plans are unquantized fp16 ones.
    pub fell_back: bool,
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
    /// What it was built from and for.
    pub key: Key,
    /// Scores per frame.
    pub num_classes: usize,
    /// The kernels, compiled for the key's GPU and precision (`runtime::Compiled::cubin`).
    pub kernels: Vec<u8>,
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
    /// For an int8 or FP8 key: what its build quantized and measured.
    pub quant_check: Option<QuantCheck>,
}

/// The part of an fp16 engine kept in f32.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeptF32 {
    /// What was found on the sample frames: each node whose values passed fp16's range.
    pub because: Vec<String>,
    /// The nodes computed in f32 (by `Plan::origins`): those and the nodes reading them.
    pub nodes: Vec<String>,
    /// The kernels compiled for f32, which their steps run: stored after the header, beside
    /// the engine's own.
    #[serde(skip)]
    pub kernels: Vec<u8>,
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
    /// The kernels' length, then the f32 kernels' where some nodes are kept in f32: they
    /// follow the header, before the weights.
    kernel_sizes: Vec<usize>,
    plans: Vec<Plan>,
    weight_sizes: Vec<usize>,
    fp32_because: Option<String>,
    kept_f32: Option<KeptF32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    quant_check: Option<QuantCheck>,
}

/// SHA-256 of the model file and of the external weight files it names, in hex: of each
/// file, its length (u64 LE) then its bytes. Read a few MiB at a time, since external
/// weights may be gigabytes.
pub fn model_digest(path: &Path, external: &[PathBuf]) -> Result<String, Error> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 4 * CHUNK];
    for file in std::iter::once(path).chain(external.iter().map(PathBuf::as_path)) {
        let read = |source| Error::Read {
            path: file.to_owned(),
            source,
        };
        let mut input = std::fs::File::open(file).map_err(read)?;
        // The length goes first, so it is the file's, not what a read returns.
        let len = input.metadata().map_err(read)?.len();
        hasher.update(len.to_le_bytes());
        let mut left = len;
        while left > 0 {
            let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let n = match input.read(&mut buf[..want]) {
                Ok(0) => {
                    return Err(read(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the file shrank while it was read",
                    )));
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(read(e)),
            };
            hasher.update(&buf[..n]);
            left -= n as u64;
        }
    }
    Ok(hex(&hasher.finalize()))
}

/// SHA-256 of `text`, in hex.
pub fn sha256_hex(data: impl AsRef<[u8]>) -> String {
    hex(&Sha256::digest(data.as_ref()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Loads the engine at `path` if its key is `key` and its plans fit frames of `frame_len`
/// values. `Ok(None)`: there is no file. `Err`: the file is there but unusable, and why.
///
/// An engine file holds GPU code (machine code for its GPU) and the plan that drives it, so
/// it is trusted like a program: only a file owned by this user and writable by no one else
/// is used (see `trusted`); its checksum proves it intact, its kernels are checked to be a
/// whole ELF file (`check_cubin`), and every step of its plans is checked to stay within the
/// buffers it names (`check_plans`) so that a file written by a buggy build cannot make a
/// kernel touch memory outside them.
///
/// The file is opened without following a symbolic link (`Error::Symlink`), and a file that
/// loads gets its modification time updated: the cache's cleanup removes what goes unused.
pub fn load(path: &Path, key: &Key, frame_len: usize) -> Result<Option<EngineFile>, Error> {
    let file = match cache::open_engine(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(_) if cache::is_symlink(path) => return Err(Error::Symlink),
        Err(e) => return Err(Error::Unreadable(e)),
    };
    let meta = file.metadata().map_err(Error::Unreadable)?;
    trusted(&meta)?;
    if !meta.is_file() {
        return Err(Error::NotAFile);
    }
    let input = BufReader::with_capacity(CHUNK, &file);
    let engine = read_engine(input, meta.len(), key, frame_len)?;
    if let Err(e) = file.set_modified(SystemTime::now()) {
        log::debug!(target: trtclassify_compiler::LOG_TARGET, "{}: cannot mark it used: {e}", path.display());
    }
    Ok(Some(engine))
}

/// Refuses a file that another user owns or could have written: its kernels would run as ours.
#[cfg(unix)]
pub(crate) fn trusted(meta: &std::fs::Metadata) -> Result<(), Error> {
    use std::os::unix::fs::MetadataExt;
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
pub(crate) fn trusted(_meta: &std::fs::Metadata) -> Result<(), Error> {
    Ok(())
}

/// An engine file's contents, checked as `load` checks them (all but the file's owner and
/// mode): for a key, and frames of `frame_len` values.
pub fn from_bytes(bytes: &[u8], key: &Key, frame_len: usize) -> Result<EngineFile, Error> {
    read_engine(bytes, bytes.len() as u64, key, frame_len)
}

/// The checksum that a file whose content (all it holds before the checksum) is `content`
/// ends with: for tests and fuzzers that make files by hand.
pub fn checksum(content: &[u8]) -> [u8; 32] {
    checksum::of_parts(&[content])
}

/// The format version of a file whose first bytes are `prefix`; `None` for no engine file.
pub fn format_of(prefix: &[u8; FORMAT_PREFIX]) -> Option<u32> {
    let (magic, format) = prefix.split_at(MAGIC.len());
    let format = <[u8; 4]>::try_from(format).ok()?;
    (magic == MAGIC).then(|| u32::from_le_bytes(format))
}

/// Reads an engine file of `len` bytes from `input`, each weight into a buffer of its own,
/// then checks the checksum on them there (`checksum::of_parts`). Every size the file states
/// is checked against `len` before anything of that size is allocated, so a hostile header
/// cannot ask for more than the file holds.
///
/// The errors are those of a check of the whole file's checksum first: what the body says
/// is only believed (and reported) once the checksum proves it the writer's, so that a
/// damaged file reads as damaged, whatever its header says.
fn read_engine(
    mut input: impl Read,
    len: u64,
    key: &Key,
    frame_len: usize,
) -> Result<EngineFile, Error> {
    let mut fixed = [0u8; FIXED];
    let (magic, rest) = fixed.split_at_mut(MAGIC.len());
    if len < magic.len() as u64 {
        return Err(Error::NotAnEngineFile);
    }
    input.read_exact(magic).map_err(read_error)?;
    if magic != MAGIC {
        return Err(Error::NotAnEngineFile);
    }
    if len < (FIXED + checksum::LEN) as u64 {
        return Err(Error::Truncated(len as usize));
    }
    input.read_exact(rest).map_err(read_error)?;
    let (format, header_len) = rest.split_at(4);
    let format = u32::from_le_bytes(format.try_into().expect("4 bytes"));
    if format != FORMAT_VERSION {
        return Err(Error::Format(format));
    }
    let header_len = u64::from_le_bytes(header_len.try_into().expect("8 bytes"));
    let body_len = len - (FIXED + checksum::LEN) as u64;
    let mut body = (&mut input).take(body_len);
    let mut header = Vec::new();
    let read = match read_header(&mut body, body_len, header_len, key, &mut header) {
        Err(e @ (Error::Unreadable(_) | Error::Checksum)) => return Err(e),
        Err(e) => Err(e),
        Ok(parsed) => Ok(read_blobs(&mut body, parsed)?),
    };
    let sum = match &read {
        Ok(b) => {
            let parts = [&fixed[..], &header].into_iter();
            let blobs = b.kernels.iter().chain(&b.weights).map(Vec::as_slice);
            checksum::of_parts(&parts.chain(blobs).collect::<Vec<_>>())
        }
        // Whatever the body says is the checksum's to confirm: hash the rest first.
        Err(_) => sum_with_rest(&[&fixed, &header], &mut body)?,
    };
    if body.limit() != 0 {
        // The file ended before its length: it shrank while it was read.
        return Err(Error::Checksum);
    }
    let mut stored = [0u8; checksum::LEN];
    input.read_exact(&mut stored).map_err(read_error)?;
    if sum != stored {
        return Err(Error::Checksum);
    }
    let Body {
        mut header,
        kernels,
        weights,
    } = read?;
    for set in &kernels {
        check_cubin(set)?;
    }
    // One set for the engine, then one for the nodes kept in f32 (`read_header`).
    let mut kernels = kernels.into_iter();
    let main = kernels.next().unwrap_or_default();
    if let Some(k) = &mut header.kept_f32 {
        k.kernels = kernels.next().unwrap_or_default();
    }
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
        kernels: main,
        plans: header.plans,
        weights,
        fp32_because: header.fp32_because,
        kept_f32: header.kept_f32,
        quant_check: header.quant_check,
    })
}

/// The checksum of the content that begins with `read` and goes on with what is left of
/// `rest`, hashed as it is read.
fn sum_with_rest(read: &[&[u8]], rest: &mut impl Read) -> Result<[u8; checksum::LEN], Error> {
    let mut sum = checksum::Streaming::new();
    for part in read {
        sum.update(part);
    }
    let mut buf = vec![0u8; CHUNK];
    loop {
        match rest.read(&mut buf).map_err(read_error)? {
            0 => return Ok(sum.finalize()),
            n => sum.update(&buf[..n]),
        }
    }
}

/// Checks that `cubin` is a 64-bit little-endian ELF file whose program and section header
/// tables lie within it: the driver takes its tables' places from its header.
fn check_cubin(cubin: &[u8]) -> Result<(), Error> {
    const HEADER: usize = 64;
    if cubin.len() < HEADER || !cubin.starts_with(b"\x7fELF") {
        return Err(Error::Kernels("no ELF header"));
    }
    if cubin[4] != 2 || cubin[5] != 1 {
        return Err(Error::Kernels("not a 64-bit little-endian ELF file"));
    }
    let u64_at = |at: usize| u64::from_le_bytes(cubin[at..at + 8].try_into().expect("8 bytes"));
    let u16_at = |at: usize| u64::from(u16::from_le_bytes([cubin[at], cubin[at + 1]]));
    // (offset, entry size, count) of the program headers, then of the section headers.
    for (offset, size, count) in [(0x20, 0x36, 0x38), (0x28, 0x3a, 0x3c)] {
        let end = u16_at(size)
            .checked_mul(u16_at(count))
            .and_then(|len| len.checked_add(u64_at(offset)));
        if end.is_none_or(|end| end > cubin.len() as u64) {
            return Err(Error::Kernels("a table past its end"));
        }
    }
    Ok(())
}

/// An engine file's body: the header, then the kernels and weights it lists.
struct Body {
    header: Header,
    kernels: Vec<Vec<u8>>,
    weights: Vec<Vec<u8>>,
}

/// The header of an engine file's body of `body_len` bytes, read into `bytes`, for `key`,
/// with sizes that add up to the body's.
fn read_header(
    body: &mut impl Read,
    body_len: u64,
    header_len: u64,
    key: &Key,
    bytes: &mut Vec<u8>,
) -> Result<Header, Error> {
    if header_len > body_len {
        return Err(Error::HeaderPastEnd);
    }
    bytes.resize(header_len as usize, 0);
    body.read_exact(bytes).map_err(read_error)?;
    let header: Header = serde_json::from_slice(bytes).map_err(Error::Header)?;
    let diffs = header.key.differences(key);
    if !diffs.is_empty() {
        return Err(Error::OtherSetup(diffs));
    }
    let want = 1 + usize::from(header.kept_f32.is_some());
    if header.kernel_sizes.len() != want {
        return Err(Error::KernelSets {
            found: header.kernel_sizes.len(),
            want,
        });
    }
    let total = (header.kernel_sizes.iter())
        .chain(&header.weight_sizes)
        .try_fold(0u64, |sum, &n| sum.checked_add(n as u64));
    if total != Some(body_len - header_len) {
        return Err(Error::WeightsLength);
    }
    Ok(header)
}

/// The kernels and weights that `header` lists, each read into a buffer of its own.
fn read_blobs(body: &mut impl Read, header: Header) -> Result<Body, Error> {
    let mut read = |sizes: &[usize]| {
        let mut blobs = Vec::with_capacity(sizes.len());
        for &n in sizes {
            let mut blob = vec![0u8; n];
            body.read_exact(&mut blob).map_err(read_error)?;
            blobs.push(blob);
        }
        Ok::<_, Error>(blobs)
    };
    let kernels = read(&header.kernel_sizes)?;
    let weights = read(&header.weight_sizes)?;
    Ok(Body {
        header,
        kernels,
        weights,
    })
}

/// A read that fails: a file that ends early is damaged (it shrank while it was read).
fn read_error(e: io::Error) -> Error {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => Error::Checksum,
        _ => Error::Unreadable(e),
    }
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
    let scales = scale_weights(plans);
    let type_of = |index: usize| match scales.binary_search(&index) {
        Ok(_) => DType::F32,
        Err(_) => weight_type(wide, index, dtype),
    };
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

/// Writes `engine` to `path` in the mode of its `place` (see `cache::replace`: a reader never
/// sees half a file, and a link at `path` is replaced, not followed), as a stream: the
/// engine is not copied whole into memory once more.
pub fn save(path: &Path, engine: &EngineFile, place: Place) -> Result<(), Error> {
    let header = header_json(engine)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        cache::make_folder(dir, place).map_err(|source| Error::CreateDir {
            dir: dir.to_owned(),
            source,
        })?;
    }
    let fixed = fixed_fields(&header);
    let parts: Vec<&[u8]> = parts(engine, &fixed, &header).collect();
    let sum = checksum::of_parts(&parts);
    cache::replace(path, place.file_mode(), |out| {
        for part in &parts {
            out.write_all(part)?;
        }
        out.write_all(&sum)
    })
    .map_err(|source| Error::Write {
        path: path.to_owned(),
        source,
    })
}

/// The file `save` writes for `engine`: magic, format, header, weights, then the checksum.
pub fn to_bytes(engine: &EngineFile) -> Result<Vec<u8>, Error> {
    let header = header_json(engine)?;
    let fixed = fixed_fields(&header);
    let len = parts(engine, &fixed, &header)
        .map(<[u8]>::len)
        .sum::<usize>();
    let mut bytes = Vec::with_capacity(len + checksum::LEN);
    for part in parts(engine, &fixed, &header) {
        bytes.extend_from_slice(part);
    }
    let sum = checksum::of_parts(&[&bytes]);
    bytes.extend_from_slice(&sum);
    Ok(bytes)
}

fn header_json(engine: &EngineFile) -> Result<Vec<u8>, Error> {
    let header = Header {
        key: engine.key.clone(),
        num_classes: engine.num_classes,
        kernel_sizes: kernel_sets(engine).map(<[u8]>::len).collect(),
        plans: engine.plans.clone(),
        weight_sizes: engine.weights.iter().map(Vec::len).collect(),
        fp32_because: engine.fp32_because.clone(),
        kept_f32: engine.kept_f32.clone(),
        quant_check: engine.quant_check.clone(),
    };
    serde_json::to_vec(&header).map_err(Error::Serialize)
}

/// The magic, the format version and the header's length.
fn fixed_fields(header: &[u8]) -> [u8; FIXED] {
    let mut fixed = [0u8; FIXED];
    let (magic, rest) = fixed.split_at_mut(MAGIC.len());
    let (format, len) = rest.split_at_mut(4);
    magic.copy_from_slice(MAGIC);
    format.copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    len.copy_from_slice(&(header.len() as u64).to_le_bytes());
    fixed
}

/// What the checksum covers, in order: the fixed fields, the header, the kernels, the
/// weights.
fn parts<'a>(
    engine: &'a EngineFile,
    fixed: &'a [u8; FIXED],
    header: &'a [u8],
) -> impl Iterator<Item = &'a [u8]> {
    [&fixed[..], header]
        .into_iter()
        .chain(kernel_sets(engine))
        .chain(engine.weights.iter().map(Vec::as_slice))
}

/// The engine's kernels, then those of the nodes it keeps in f32.
fn kernel_sets(engine: &EngineFile) -> impl Iterator<Item = &[u8]> {
    std::iter::once(engine.kernels.as_slice())
        .chain(engine.kept_f32.as_ref().map(|k| &k.kernels[..]))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use trtclassify_compiler::ir::Act;
    use trtclassify_compiler::plan::{Cast, EwStep, Loc, MAX_RANK, Step, Strided, ZeroStep};

    pub(crate) fn key() -> Key {
        Key {
            format: FORMAT_VERSION,
            plugin_version: "1.0".into(),
            kernels_sha256: "cd".repeat(32),
            onnx_sha256: "ab".repeat(32),
            gpu: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            cuda_driver: 13000,
            nvrtc: 13000,
            cudnn: 91400,
            cublaslt: 130000,
            precision: DType::F16,
            batch_sizes: vec![1],
            input: (2, 2),
            quantized: None,
        }
    }

    /// Values of one frame of the fixture's model: 3 × 2 × 2.
    pub(crate) const FRAME: usize = 12;

    /// The smallest file `check_cubin` takes: an ELF header with no tables, then `tag`.
    pub(crate) fn cubin(tag: &[u8]) -> Vec<u8> {
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf.extend_from_slice(tag);
        elf
    }

    pub(crate) fn engine() -> EngineFile {
        let step = Step::Ew(EwStep {
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
        });
        EngineFile {
            key: key(),
            num_classes: 4,
            kernels: cubin(b"kernels"),
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
            quant_check: None,
        }
    }

    fn saved() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/model.engine");
        save(&path, &engine(), Place::Elsewhere).unwrap();
        (dir, path)
    }

    #[test]
    fn round_trip() {
        let (_dir, path) = saved();
        let loaded = load(&path, &key(), FRAME).unwrap().unwrap();
        let want = engine();
        assert_eq!(loaded.plans, want.plans);
        assert_eq!(loaded.weights, want.weights);
        assert_eq!((loaded.num_classes, loaded.kernels), (4, want.kernels));
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
        // Another plugin build with other kernels: the kernels in the file are not theirs.
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
        save(&path, &e, Place::Elsewhere).unwrap();
        let err = load(&path, &key(), FRAME).err().unwrap().to_string();
        assert!(err.contains("names weight 1"), "{err}");
    }

    /// A change that makes a sound file unsound.
    type Damage<T> = fn(&mut T);

    /// Saves `e` and loads it back.
    fn reload(e: &EngineFile) -> Result<Option<EngineFile>, Error> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.engine");
        save(&path, e, Place::Elsewhere).unwrap();
        load(&path, &key(), FRAME)
    }

    #[test]
    fn plans_reaching_outside_their_buffers_are_refused() {
        // The fixture's step reads weight 1 (6 values) from 2 on and writes arena 0..4.
        let cases: Vec<(Damage<Step>, &str)> = vec![
            (
                |s| {
                    let Step::Ew(EwStep { a, .. }) = s else {
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
                    let Step::Ew(EwStep { out, .. }) = s else {
                        unreachable!()
                    };
                    out.loc = Loc::Arena(1);
                },
                "touches elements 1..5 of a buffer of 4",
            ),
            (
                |s| {
                    let Step::Ew(EwStep { dims, .. }) = s else {
                        unreachable!()
                    };
                    dims[0] = 5;
                },
                "touches elements 0..5",
            ),
            (
                |s| {
                    let Step::Ew(EwStep { out, .. }) = s else {
                        unreachable!()
                    };
                    out.strides[0] = 2;
                },
                "touches elements 0..7 of a buffer of 4",
            ),
            (
                |s| {
                    let Step::Ew(EwStep { a, .. }) = s else {
                        unreachable!()
                    };
                    a.strides[0] = -1;
                },
                "touches elements -1..3",
            ),
            (
                |s| {
                    // An fp16 step writing the f32 scores without a cast.
                    let Step::Ew(EwStep { out, .. }) = s else {
                        unreachable!()
                    };
                    out.loc = Loc::Output(0);
                },
                "reads or writes a buffer in the wrong type",
            ),
            (
                |s| {
                    // A cast from f32 reading fp16 weights as f32: twice their bytes.
                    let Step::Ew(EwStep { cast, .. }) = s else {
                        unreachable!()
                    };
                    *cast = Cast::FromF32;
                },
                "reads or writes a buffer in the wrong type",
            ),
            (
                |s| {
                    // A binary operator without its second operand reads address 0.
                    let Step::Ew(EwStep { op, .. }) = s else {
                        unreachable!()
                    };
                    *op = Some(trtclassify_compiler::ir::BinOp::Add);
                },
                "sizes its kernel cannot take",
            ),
            (
                |s| {
                    let Step::Ew(EwStep { dims, .. }) = s else {
                        unreachable!()
                    };
                    *dims = vec![1; MAX_RANK + 1];
                },
                "sizes its kernel cannot take",
            ),
            (
                |s| {
                    let Step::Ew(EwStep { a, .. }) = s else {
                        unreachable!()
                    };
                    a.strides.push(0);
                },
                "sizes its kernel cannot take",
            ),
            (
                |s| {
                    let Step::Ew(EwStep { out, .. }) = s else {
                        unreachable!()
                    };
                    out.loc = Loc::Temp { id: 0, offset: 0 };
                },
                "an unplaced buffer",
            ),
            (
                |s| {
                    *s = Step::Zero(ZeroStep {
                        loc: Loc::Arena(2),
                        len: 3,
                    })
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
            kernel_sizes: vec![e.kernels.len()],
            plans: e.plans.clone(),
            weight_sizes: vec![usize::MAX, 15],
            fp32_because: None,
            kept_f32: None,
            quant_check: None,
        };
        let header = serde_json::to_vec(&header).unwrap();
        let mut body = Vec::new();
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        body.extend_from_slice(&(header.len() as u64).to_le_bytes());
        body.extend_from_slice(&header);
        body.extend_from_slice(&[0; 14]);
        let sum = checksum::of_parts(&[&body]);
        body.extend_from_slice(&sum);
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
            let path = trtclassify_compiler::testing::repo()
                .join("models")
                .join(name);
            let model = trtclassify_compiler::OnnxModel::load(&path).unwrap();
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
                    trtclassify_compiler::compile(&model, &batch_sizes, spec, dtype).unwrap();
                let k = Key {
                    precision: asked,
                    batch_sizes: batch_sizes.clone(),
                    input: (spec.height, spec.width),
                    ..key()
                };
                let e = EngineFile {
                    key: k.clone(),
                    num_classes: plans[0].output_len,
                    kernels: cubin(b""),
                    plans,
                    weights: weights
                        .data
                        .iter()
                        .map(|w| vec![0; w.len() * dtype.size()])
                        .collect(),
                    fp32_because,
                    kept_f32: None,
                    quant_check: None,
                };
                assert_eq!(e.dtype() == dtype, loads, "{name}: {asked:?} as {dtype:?}");
                let dir = tempfile::tempdir().unwrap();
                let file = dir.path().join("e.engine");
                save(&file, &e, Place::Elsewhere).unwrap();
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
        let path = trtclassify_compiler::testing::repo().join("models/big_middle.onnx");
        let model = trtclassify_compiler::OnnxModel::load(&path).unwrap();
        let spec = model.input_spec(None).unwrap();
        let batch_sizes = vec![1, 2];
        let kept = ["conv_0".to_owned()];
        let (plans, weights) =
            trtclassify_compiler::compile_mixed(&model, &batch_sizes, spec, DType::F16, &kept)
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
            kernels: cubin(b"fp16 kernels"),
            plans: plans.clone(),
            weights: (0..weights.data.len())
                .map(|i| match half_everywhere {
                    true => bytes(i, DType::F16),
                    false => bytes(i, weights.dtype(i, DType::F16)),
                })
                .collect(),
            fp32_because: None,
            kept_f32,
            quant_check: None,
        };
        let kept_f32 = KeptF32 {
            because: vec!["node `conv_0` reaches 6e5".into()],
            nodes: plans[0].wide_nodes(),
            kernels: cubin(b"f32 kernels"),
            weights: weights.wide.clone(),
        };
        assert_eq!(kept_f32.nodes, ["conv_0", "conv_1"]);
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join("e.engine");
        let load_back = |e: &EngineFile| {
            save(&at, e, Place::Elsewhere).unwrap();
            load(&at, &k, spec.frame_len())
        };
        let loaded = load_back(&file(Some(kept_f32.clone()), false))
            .unwrap()
            .expect("loads");
        // Each set of kernels comes back as its own.
        assert_eq!(loaded.kept_f32.as_ref(), Some(&kept_f32));
        assert_eq!(loaded.kernels, cubin(b"fp16 kernels"));
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
        let err = save(
            Path::new("/proc/trtclassify/x.engine"),
            &engine(),
            Place::Elsewhere,
        )
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

    #[test]
    fn model_digests_are_those_of_earlier_versions() {
        // Values of the plugin that read files whole: the caches it wrote still match.
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m.onnx");
        let weights = dir.path().join("m.weights");
        std::fs::write(&model, b"trtclassify digest fixture\n").unwrap();
        let bytes: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
        std::fs::write(&weights, bytes).unwrap();
        assert_eq!(
            model_digest(&model, &[]).unwrap(),
            "1fb90a6ed736287aee15871c3dd99ced1c6ea0d30f30d3088a97d095fd00bdc0"
        );
        assert_eq!(
            model_digest(&model, &[weights]).unwrap(),
            "521615efa6dae613299a8a1d61063815ea02fc1f5cb282a12d6574a5178c831b"
        );
        let err = model_digest(&model, &[dir.path().join("gone")]).unwrap_err();
        assert!(err.to_string().contains("gone: No such file"), "{err}");
    }

    /// A file of `header` with a checksum that matches: only the reader's own checks can
    /// refuse it.
    fn signed(header: &[u8], header_len: u64, tail: &[u8]) -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        body.extend_from_slice(&header_len.to_le_bytes());
        body.extend_from_slice(header);
        body.extend_from_slice(tail);
        let sum = checksum::of_parts(&[&body]);
        body.extend_from_slice(&sum);
        body
    }

    #[test]
    fn sizes_past_the_file_are_refused_before_anything_is_allocated() {
        let e = engine();
        let header = |weight_sizes| {
            serde_json::to_vec(&Header {
                key: key(),
                num_classes: e.num_classes,
                kernel_sizes: vec![e.kernels.len()],
                plans: e.plans.clone(),
                weight_sizes,
                fp32_because: None,
                kept_f32: None,
                quant_check: None,
            })
            .unwrap()
        };
        // A header of 2^64 - 6 bytes, and weights of a petabyte: refused, not allocated.
        let h = header(vec![2, 12]);
        let file = signed(&h, u64::MAX - 5, &[0; 14]);
        let err = from_bytes(&file, &key(), FRAME).err().unwrap().to_string();
        assert!(err.contains("the header runs past the end"), "{err}");
        let h = header(vec![1 << 50, 14]);
        let file = signed(&h, h.len() as u64, &[0; 14]);
        let err = from_bytes(&file, &key(), FRAME).err().unwrap().to_string();
        assert!(err.contains("do not add up"), "{err}");
        // The same files damaged are damaged first.
        let mut file = file;
        let last = file.len() - 1;
        file[last] ^= 1;
        let err = from_bytes(&file, &key(), FRAME).err().unwrap().to_string();
        assert!(err.contains("checksum does not match"), "{err}");
    }

    #[test]
    fn kernels_that_are_not_a_whole_cubin_are_refused() {
        let refused = |kernels: Vec<u8>| {
            let e = EngineFile {
                kernels,
                ..engine()
            };
            let err = from_bytes(&to_bytes(&e).unwrap(), &key(), FRAME).err();
            err.expect("refused").to_string()
        };
        let err = refused(Vec::new());
        assert!(err.contains("not a whole CUBIN: no ELF header"), "{err}");
        let err = refused(b".version 8.0\n.target sm_90".to_vec());
        assert!(err.contains("no ELF header"), "{err}");
        let mut elf32 = cubin(b"");
        elf32[4] = 1;
        assert!(refused(elf32).contains("64-bit little-endian"));
        // Section headers said to lie past the end: the driver would read beyond the blob.
        let mut past = cubin(b"");
        past[0x28..0x30].copy_from_slice(&40u64.to_le_bytes());
        past[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        past[0x3c..0x3e].copy_from_slice(&1u16.to_le_bytes());
        assert!(refused(past).contains("a table past its end"));
        // A header that lists no kernels, or a set too many.
        for kernel_sizes in [vec![], vec![64, 0]] {
            let e = engine();
            let header = serde_json::to_vec(&Header {
                key: key(),
                num_classes: e.num_classes,
                kernel_sizes,
                plans: e.plans.clone(),
                weight_sizes: e.weights.iter().map(Vec::len).collect(),
                fp32_because: None,
                kept_f32: None,
                quant_check: None,
            })
            .unwrap();
            let tail: Vec<u8> = [e.kernels.clone()]
                .into_iter()
                .chain(e.weights)
                .flatten()
                .collect();
            let file = signed(&header, header.len() as u64, &tail);
            let err = from_bytes(&file, &key(), FRAME).err().unwrap().to_string();
            assert!(err.contains("sets of kernels, not 1"), "{err}");
        }
    }

    #[test]
    fn a_load_marks_the_file_used() {
        let (_dir, path) = saved();
        let month_ago = SystemTime::now() - std::time::Duration::from_secs(40 * 86400);
        let file = std::fs::File::options().write(true).open(&path).unwrap();
        file.set_modified(month_ago).unwrap();
        drop(file);
        assert!(load(&path, &key(), FRAME).unwrap().is_some());
        let used = std::fs::metadata(&path).unwrap().modified().unwrap();
        assert!(used > SystemTime::now() - std::time::Duration::from_secs(60));
        // A file that does not load is not marked.
        let mut other = key();
        other.gpu = "NVIDIA L4".into();
        let file = std::fs::File::options().write(true).open(&path).unwrap();
        file.set_modified(month_ago).unwrap();
        drop(file);
        assert!(load(&path, &other, FRAME).is_err());
        let used = std::fs::metadata(&path).unwrap().modified().unwrap();
        assert_eq!(used, month_ago);
    }
}
