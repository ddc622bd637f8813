// SPDX-License-Identifier: MPL-2.0
//! Where engine files are kept, and how they are written, shared and cleaned.
//!
//! The default folder, `$XDG_CACHE_HOME/trtclassify`, is this user's alone (0700, files
//! 0600) and ours to clean; an `engine-location` is the user's choice of file, perhaps in a
//! folder shared with others, so it is written 0644 and nothing beside it is removed but our
//! own temporary files of that engine. Modes are set on the open file, so the umask neither
//! widens them (the trust check in `engine_file` refuses what others could write: under
//! Ubuntu's umask 002 the cache would never hit) nor narrows them.
//!
//! A file is replaced by renaming over it a temporary file created beside it under a random
//! name, exclusively and without following symbolic links, and engine files are opened
//! without following them either: a link planted in a shared folder can redirect neither a
//! write nor a read. Builders of one engine file (processes, or threads with engines of
//! their own) hold an advisory lock beside it while they build, so that one builds and the
//! others load what it saved.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::engine_file::{self, EngineFile, Key};

/// The variable that bounds the size of the default folder's engines, in gigabytes (10⁹
/// bytes).
pub const MAX_GB_VAR: &str = "TRTCLASSIFY_ENGINE_CACHE_MAX_GB";
/// Engines are gigabytes for large models; a few models in a few setups fit.
const DEFAULT_MAX_GB: f64 = 20.0;
/// A temporary file this old belongs to a writer that crashed: writing takes seconds.
const TEMP_AGE: Duration = Duration::from_secs(3600);
/// An engine of this plugin's format unused this long is of a model or setup gone by.
const UNUSED_AGE: Duration = Duration::from_secs(30 * 24 * 3600);
/// An engine of another format version can only be used by another version of the plugin,
/// which may still run beside this one for a while.
const OTHER_FORMAT_AGE: Duration = Duration::from_secs(24 * 3600);
/// What is written or read at a time.
pub const CHUNK: usize = 1 << 20;

pub(crate) use sys::identity;

/// Where an engine file is: the default folder, or an `engine-location`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// `dir()`: private, and cleaned after each save.
    Cache,
    /// A file the user named: its folder is theirs, maybe shared with others.
    Elsewhere,
}

impl Place {
    /// The mode of the files written there: private in our cache; elsewhere readable by all,
    /// since the user may have chosen the folder to share engines between accounts.
    pub fn file_mode(self) -> u32 {
        match self {
            Place::Cache => 0o600,
            Place::Elsewhere => 0o644,
        }
    }
}

/// The per-user engine cache: `$XDG_CACHE_HOME/trtclassify` (usually `~/.cache/trtclassify`),
/// found as GLib finds the user's cache folder, without linking it.
pub fn dir() -> PathBuf {
    let set = |name| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let base = set("XDG_CACHE_HOME")
        .or_else(|| set("HOME").map(|home| home.join(".cache")))
        // No home (a bare service account): a folder of this user's own in the temporary
        // folder, which the cache's ownership checks then guard like any other.
        .unwrap_or_else(|| {
            // SAFETY: getuid has no preconditions and cannot fail.
            let uid = unsafe { libc::getuid() };
            std::env::temp_dir().join(format!("{uid}.cache"))
        });
    base.join("trtclassify")
}

/// Creates the folder `dir` of an engine file where it is missing: the cache folder itself
/// 0700 (and made so where an older plugin created it with the umask's mode), a folder
/// elsewhere with the umask's mode, like any other.
pub fn make_folder(dir: &Path, place: Place) -> io::Result<()> {
    match place {
        Place::Elsewhere => fs::create_dir_all(dir),
        Place::Cache => {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                fs::create_dir_all(parent)?;
            }
            match sys::create_dir(dir, 0o700) {
                Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
                _ => {}
            }
            let meta = fs::metadata(dir)?;
            if !meta.is_dir() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "it exists and is not a folder",
                ));
            }
            if sys::owned(&meta) && sys::mode(&meta) != 0o700 {
                sys::set_mode(dir, 0o700)?;
            }
            Ok(())
        }
    }
}

/// Opens an engine file to read it, without following a symbolic link (`ELOOP`) and without
/// blocking on a FIFO planted in its place.
pub fn open_engine(path: &Path) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true);
    sys::no_follow(&mut options, true);
    options.open(path)
}

/// Whether `path` is a symbolic link (the reason `open_engine` failed with `ELOOP`).
pub fn is_symlink(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

/// Replaces `path` (a file, or a symbolic link, never its target) with what `write` writes,
/// in `mode`: through a temporary file beside it, so that a reader never sees half a file,
/// synced before the rename so that a crash leaves the old file or the new one. The
/// temporary file is removed on any failure.
pub fn replace(
    path: &Path,
    mode: u32,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> io::Result<()> {
    let dir = folder_of(path);
    let name = file_name(path)?;
    let (tmp, file) = create_temp(dir, name, mode)?;
    let written = (|| {
        // Not left to the umask, which may differ from one process to the next.
        sys::set_file_mode(&file, mode)?;
        let mut out = BufWriter::with_capacity(CHUNK, &file);
        write(&mut out)?;
        out.flush()?;
        drop(out);
        file.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    // The rename itself, durable; a failure here loses nothing but the next start's hit.
    if let Ok(dir) = File::open(dir) {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// Creates a new file beside `name` in `dir`, `.<name>.<random hex>.tmp`: never an existing
/// file, nor a link's target (`O_CREAT|O_EXCL|O_NOFOLLOW`), under a name others cannot
/// guess to plant something there first.
fn create_temp(dir: &Path, name: &str, mode: u32) -> io::Result<(PathBuf, File)> {
    let mut last = None;
    for _ in 0..16 {
        let tmp = dir.join(format!(".{name}.{}.tmp", random_hex()));
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        sys::create_mode(&mut options, mode);
        sys::no_follow(&mut options, false);
        match options.open(&tmp) {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no temporary file name is free")))
}

/// 64 random bits in hex: SipHash keyed by std's per-process random keys (from the system's
/// random source), over a counter and the time. Temporary files are named
/// `.<name>.<random_hex>.tmp` (with `.heldout` after it for a calibration's held-out frames),
/// which the cleanup removes once stale.
pub fn random_hex() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u32(std::process::id());
    if let Ok(now) = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) {
        hasher.write_u128(now.as_nanos());
    }
    format!("{:016x}", hasher.finish())
}

/// The engine name of a temporary file `create_temp` made, `.<name>.<16 hex>.tmp`.
fn temp_of(file: &str) -> Option<&str> {
    let inner = file.strip_prefix('.')?.strip_suffix(".tmp")?;
    let (name, random) = inner.rsplit_once('.')?;
    (random.len() == 16 && random.bytes().all(|b| b.is_ascii_hexdigit()) && !name.is_empty())
        .then_some(name)
}

/// Whether `file` is a temporary file of an older plugin: `<stem>.tmp<pid>-<n>`.
fn old_temp(file: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    file.rsplit_once('.')
        .and_then(|(_, ext)| ext.strip_prefix("tmp"))
        .and_then(|rest| rest.split_once('-'))
        .is_some_and(|(pid, n)| digits(pid) && digits(n))
}

/// `.<name>.lock`, beside the engine file `engine`.
fn lock_path(engine: &Path) -> io::Result<PathBuf> {
    Ok(folder_of(engine).join(format!(".{}.lock", file_name(engine)?)))
}

/// The engine a lock file `.<name>.lock` is for.
fn lock_of(file: &str) -> Option<&str> {
    file.strip_prefix('.')?
        .strip_suffix(".lock")
        .filter(|n| n.ends_with(".engine"))
}

fn folder_of(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

fn file_name(path: &Path) -> io::Result<&str> {
    path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "the engine file's name is not UTF-8 text, or there is none",
        )
    })
}

/// The builders' lock of one engine file, held until dropped (closing the file releases
/// it, also when the process dies).
struct BuildLock {
    file: File,
    path: PathBuf,
}

impl Drop for BuildLock {
    /// Removes the lock file while it is held, so that none is left behind (beside an
    /// engine in a user's folder, say): whoever waits on it finds it gone once they hold it,
    /// and takes a new one (see `lock`).
    fn drop(&mut self) {
        if sys::same_file(&self.file, &self.path) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Takes the builders' lock of `engine`, waiting (and saying so) while another process or
/// thread holds it.
fn lock(engine: &Path, place: Place, progress: &mut dyn FnMut(&str)) -> io::Result<BuildLock> {
    make_folder(folder_of(engine), place)?;
    let path = lock_path(engine)?;
    // Each round follows a release by another holder (which removes the file): a few per
    // process starting together.
    for _ in 0..64 {
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(true);
        sys::create_mode(&mut options, place.file_mode());
        sys::no_follow(&mut options, false);
        let file = options.open(&path)?;
        if sys::owned(&file.metadata()?) {
            sys::set_file_mode(&file, place.file_mode())?;
        }
        if !sys::try_lock(&file)? {
            progress(&format!(
                "waiting for another process building {}",
                engine.display()
            ));
            sys::lock(&file)?;
        }
        // Holders remove the lock file as they release it: one taken after that locks
        // nothing that others see, so take the one now there.
        if sys::same_file(&file, &path) {
            return Ok(BuildLock { file, path });
        }
    }
    Err(io::Error::other("its lock file keeps being replaced"))
}

/// The engine of `key` at `path`, loaded from the file there, or built by `build` (which
/// also returns what else it made, e.g. the runtime it tuned) and saved there.
///
/// Builders of one file take turns (see `lock`): a process that finds another building
/// waits for it and loads what it saved. A lock that cannot be taken (a read-only folder, a
/// link planted where the lock file goes) only costs that: the engine is built regardless.
/// After a save in the default folder, the folder is cleaned (`cleanup`).
pub fn load_or_build<T, E>(
    path: &Path,
    place: Place,
    key: &Key,
    frame_len: usize,
    progress: &mut dyn FnMut(&str),
    build: impl FnOnce(&mut dyn FnMut(&str)) -> Result<(EngineFile, T), E>,
) -> Result<(EngineFile, Option<T>), E> {
    let seen = sys::identity(path);
    if let Some(file) = look(path, key, frame_len, progress) {
        return Ok((file, None));
    }
    let lock = match lock(path, place, progress) {
        Ok(lock) => Some(lock),
        Err(e) => {
            let at = lock_path(path).unwrap_or_else(|_| path.to_owned());
            log::warn!(target: trtclassify_compiler::LOG_TARGET, "cannot lock {}: {e}; building without the lock (a process starting now may \
                 build this engine too)",
                at.display()
            );
            None
        }
    };
    // Another builder may have saved it while this one waited, or since it looked.
    if sys::identity(path) != seen
        && let Some(file) = look(path, key, frame_len, progress)
    {
        return Ok((file, None));
    }
    let (file, built) = build(progress)?;
    match engine_file::save(path, &file, place) {
        Ok(()) => progress(&format!("saved engine file {}", path.display())),
        Err(e) => {
            log::warn!(target: trtclassify_compiler::LOG_TARGET, "{e}; the engine runs without being saved, and is built again next time"
            )
        }
    }
    let now = SystemTime::now();
    match place {
        Place::Cache => {
            cleanup(folder_of(path), path, now, max_bytes());
        }
        Place::Elsewhere => {
            cleanup_temporary(path, now);
        }
    }
    drop(lock);
    Ok((file, Some(built)))
}

/// The engine file at `path` if it is there and usable; why it is not, as a warning.
fn look(
    path: &Path,
    key: &Key,
    frame_len: usize,
    progress: &mut dyn FnMut(&str),
) -> Option<EngineFile> {
    match engine_file::load(path, key, frame_len) {
        Ok(Some(file)) => {
            progress(&format!("loaded engine file {}", path.display()));
            Some(file)
        }
        Ok(None) => None,
        Err(reason) => {
            log::warn!(target: trtclassify_compiler::LOG_TARGET, "engine file {}: {reason}; building the engine again",
                path.display()
            );
            None
        }
    }
}

/// The bound on the default folder's engines, from `MAX_GB_VAR`.
fn max_bytes() -> u64 {
    max_bytes_from(std::env::var(MAX_GB_VAR).ok().as_deref())
}

/// The bound that `MAX_GB_VAR` set to `value` (or unset) gives.
fn max_bytes_from(value: Option<&str>) -> u64 {
    let gb = match value {
        None => DEFAULT_MAX_GB,
        Some(value) => match value.trim().parse::<f64>() {
            Ok(gb) if gb.is_finite() && gb >= 0.0 => gb,
            _ => {
                log::warn!(target: trtclassify_compiler::LOG_TARGET, "{MAX_GB_VAR}={value:?} is not a number of gigabytes; the engine cache \
                     keeps up to {DEFAULT_MAX_GB} GB"
                );
                DEFAULT_MAX_GB
            }
        },
    };
    (gb * 1e9) as u64
}

/// An engine file found in the cache folder.
struct Found {
    path: PathBuf,
    len: u64,
    used: SystemTime,
}

/// Cleans the cache folder `dir` (never a user's `engine-location` folder): temporary files
/// of writers that crashed, engines, model digests (`digests`) and the calibration tables
/// the element made (with their held-out frames, `kept_while_used`) unused for `UNUSED_AGE`,
/// engines of another format unused for `OTHER_FORMAT_AGE`, then the least recently used
/// engines while the rest exceed `max_bytes`. `keep` (the engine just saved) and engines whose builders' lock is held stay.
/// One listing of the folder, and the first bytes of old engines only; what goes is logged.
/// Returns what was removed.
fn cleanup(dir: &Path, keep: &Path, now: SystemTime, max_bytes: u64) -> Vec<PathBuf> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            log::debug!(target: trtclassify_compiler::LOG_TARGET, "cannot list {} to clean it: {e}", dir.display());
            return Vec::new();
        }
    };
    let keep = keep.file_name();
    let mut removed = Vec::new();
    let mut engines = Vec::new();
    let mut locks = Vec::new();
    for entry in entries.flatten() {
        let (path, name) = (entry.path(), entry.file_name());
        let Some(name) = name.to_str() else { continue };
        // Not following links: a link is no file of ours.
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.file_type().is_file() {
            continue;
        }
        let used = meta.modified().unwrap_or(now);
        let age = now.duration_since(used).unwrap_or_default();
        // A calibration's held-out frames, written beside its temporary table, go with it.
        let temp = temp_of(name.strip_suffix(".heldout").unwrap_or(name));
        if temp.is_some() || old_temp(name) {
            if age > TEMP_AGE && fs::remove_file(&path).is_ok() {
                log_removed(&path, &format!("a temporary file left {}", ago(age)));
                removed.push(path);
            }
        } else if lock_of(name).is_some() {
            locks.push((path, age));
        } else if let Some(what) = kept_while_used(name) {
            if age > UNUSED_AGE && fs::remove_file(&path).is_ok() {
                log_removed(&path, &format!("{what} unused for {}", ago(age)));
                removed.push(path);
            }
        } else if name.ends_with(".engine") && !name.starts_with('.') {
            let found = Found {
                path,
                len: meta.len(),
                used,
            };
            let why = if Some(entry.file_name().as_os_str()) == keep {
                None
            } else if age > UNUSED_AGE {
                Some(format!("unused for {}", ago(age)))
            } else if age > OTHER_FORMAT_AGE {
                other_format(&found.path).map(|f| format!("{f}, unused for {}", ago(age)))
            } else {
                None
            };
            match why {
                Some(why) if remove_engine(&found.path) => {
                    log_removed(&found.path, &why);
                    removed.push(found.path);
                }
                _ => engines.push(found),
            }
        }
    }
    let mut total: u64 = engines.iter().map(|e| e.len).sum();
    engines.sort_by_key(|e| e.used);
    for engine in engines {
        if total <= max_bytes {
            break;
        }
        if engine.path.file_name() == keep || !remove_engine(&engine.path) {
            continue;
        }
        total -= engine.len;
        log_removed(
            &engine.path,
            &format!(
                "the least recently used, the cache's engines exceeding {:.1} GB ({MAX_GB_VAR})",
                max_bytes as f64 / 1e9
            ),
        );
        removed.push(engine.path);
    }
    // Lock files whose engine is gone: those of builders that crashed.
    for (path, age) in locks {
        let engine = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(lock_of)
            .map(|n| dir.join(n));
        if age > TEMP_AGE
            && engine.is_some_and(|e| fs::symlink_metadata(e).is_err())
            && remove_lock(&path)
        {
            removed.push(path);
        }
    }
    removed
}

/// What the cache's file `name` is, where it is one that each use marks as used and
/// the cleanup removes once unused for `UNUSED_AGE`: a model digest remembered (`digests`), or
/// a calibration table the element made from frames, or its held-out frames
/// (`CalibrationTable`, `HeldOut::beside`).
fn kept_while_used(name: &str) -> Option<&'static str> {
    if name.starts_with('.') {
        None
    } else if name.ends_with(".digest") {
        Some("a model digest")
    } else if name.ends_with(".calibration.txt") || name.ends_with(".calibration.txt.heldout") {
        Some("a calibration")
    } else {
        None
    }
}

/// Marks a file of the cache as used now (its modification time), so that the cleanup keeps
/// it; a failure only makes it look older.
pub fn mark_used(path: &Path) {
    if let Ok(file) = fs::OpenOptions::new().append(true).open(path) {
        let _ = file.set_modified(SystemTime::now());
    }
}

/// Removes the temporary files of the engine file `engine` that crashed writers left in a
/// user's folder (older than `TEMP_AGE`): nothing else there is ours to remove.
fn cleanup_temporary(engine: &Path, now: SystemTime) -> Vec<PathBuf> {
    let (dir, Ok(name)) = (folder_of(engine), file_name(engine)) else {
        return Vec::new();
    };
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let file = entry.file_name();
        if file.to_str().and_then(temp_of) != Some(name) {
            continue;
        }
        let Ok(meta) = entry.metadata() else { continue };
        let age = meta
            .modified()
            .ok()
            .and_then(|m| now.duration_since(m).ok())
            .unwrap_or_default();
        if meta.file_type().is_file() && age > TEMP_AGE && fs::remove_file(entry.path()).is_ok() {
            log_removed(
                &entry.path(),
                &format!("a temporary file left {}", ago(age)),
            );
            removed.push(entry.path());
        }
    }
    removed
}

/// Why the engine at `path` is of no use to this plugin, from its fixed fields: another
/// format, or not an engine file at all. `None` where it is of this format or unreadable.
fn other_format(path: &Path) -> Option<String> {
    let mut prefix = [0u8; engine_file::FORMAT_PREFIX];
    open_engine(path).ok()?.read_exact(&mut prefix).ok()?;
    match engine_file::format_of(&prefix) {
        Some(engine_file::FORMAT_VERSION) => None,
        Some(format) => Some(format!("engine format {format}")),
        None => Some("not a trtclassify engine file".into()),
    }
}

/// Removes the engine file `path` unless a builder holds its lock, and a lock file a crashed
/// builder left (holding it, so that whoever waits for it takes a new one: see `lock`).
fn remove_engine(path: &Path) -> bool {
    let Ok(lock) = lock_path(path) else {
        return false;
    };
    let held = match open_lock(&lock) {
        // Held, or replaced since it was opened: by a builder, now.
        Ok(file) => match sys::try_lock(&file) {
            Ok(true) if sys::same_file(&file, &lock) => Some(file),
            _ => return false,
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(_) => return false,
    };
    if let Err(e) = fs::remove_file(path) {
        log::debug!(target: trtclassify_compiler::LOG_TARGET, "cannot remove {}: {e}", path.display());
        return false;
    }
    if held.is_some() {
        let _ = fs::remove_file(&lock);
    }
    true
}

/// Removes the lock file `path` unless it is held.
fn remove_lock(path: &Path) -> bool {
    let Ok(file) = open_lock(path) else {
        return false;
    };
    matches!(sys::try_lock(&file), Ok(true))
        && sys::same_file(&file, path)
        && fs::remove_file(path).is_ok()
}

/// Opens an existing lock file, to take it.
fn open_lock(path: &Path) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true);
    sys::no_follow(&mut options, false);
    options.open(path)
}

fn log_removed(path: &Path, why: &str) {
    log::info!(target: trtclassify_compiler::LOG_TARGET, "engine cache: removed {}: {why}", path.display());
}

/// An age in days or hours.
fn ago(age: Duration) -> String {
    let hours = age.as_secs() / 3600;
    match hours {
        0..48 => format!("{hours} h"),
        _ => format!("{} days", hours / 24),
    }
}

#[cfg(unix)]
mod sys {
    //! The POSIX side: modes, `O_NOFOLLOW`, `flock`, file identities.
    use std::fs::{File, Metadata, OpenOptions};
    use std::io;
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
    use std::os::unix::io::AsRawFd;
    use std::path::Path;

    pub(super) fn create_dir(dir: &Path, mode: u32) -> io::Result<()> {
        std::fs::DirBuilder::new().mode(mode).create(dir)?;
        // The umask narrowed the mode `mkdir` got; this sets it exactly.
        set_mode(dir, mode)
    }

    pub(super) fn set_mode(path: &Path, mode: u32) -> io::Result<()> {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
    }

    pub(super) fn set_file_mode(file: &File, mode: u32) -> io::Result<()> {
        file.set_permissions(std::fs::Permissions::from_mode(mode))
    }

    pub(super) fn mode(meta: &Metadata) -> u32 {
        meta.mode() & 0o7777
    }

    pub(super) fn owned(meta: &Metadata) -> bool {
        // SAFETY: geteuid has no preconditions and cannot fail.
        meta.uid() == unsafe { libc::geteuid() }
    }

    pub(super) fn create_mode(options: &mut OpenOptions, mode: u32) {
        options.mode(mode);
    }

    /// `O_NOFOLLOW`, and `O_NONBLOCK` where `nonblocking` (an open for reading that a FIFO
    /// would otherwise block).
    pub(super) fn no_follow(options: &mut OpenOptions, nonblocking: bool) {
        let extra = if nonblocking { libc::O_NONBLOCK } else { 0 };
        options.custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | extra);
    }

    /// Takes `file`'s exclusive lock if no one holds it: `Ok(false)` where someone does.
    pub(super) fn try_lock(file: &File) -> io::Result<bool> {
        match flock(file, libc::LOCK_EX | libc::LOCK_NB) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Takes `file`'s exclusive lock, waiting for it.
    pub(super) fn lock(file: &File) -> io::Result<()> {
        flock(file, libc::LOCK_EX)
    }

    fn flock(file: &File, operation: libc::c_int) -> io::Result<()> {
        loop {
            // SAFETY: the descriptor is open for as long as `file` lives.
            if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Whether `file` is (still) the file at `path`.
    pub(super) fn same_file(file: &File, path: &Path) -> bool {
        match (file.metadata(), std::fs::symlink_metadata(path)) {
            (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
            _ => false,
        }
    }

    /// What tells one version of the file at `path` from the next: a save renames a new
    /// file over it, a load updates its time, a write in place its change time (which no
    /// program can set back).
    pub(crate) fn identity(path: &Path) -> Option<impl Eq + std::fmt::Debug> {
        let m = std::fs::symlink_metadata(path).ok()?;
        Some((
            (m.dev(), m.ino(), m.len()),
            (m.mtime(), m.mtime_nsec()),
            (m.ctime(), m.ctime_nsec()),
        ))
    }
}

#[cfg(not(unix))]
mod sys {
    //! Elsewhere: no modes, no links to avoid, no lock (each builder builds).
    use std::fs::{File, Metadata, OpenOptions};
    use std::io;
    use std::path::Path;

    pub(super) fn create_dir(dir: &Path, _mode: u32) -> io::Result<()> {
        std::fs::create_dir(dir)
    }
    pub(super) fn set_mode(_path: &Path, _mode: u32) -> io::Result<()> {
        Ok(())
    }
    pub(super) fn set_file_mode(_file: &File, _mode: u32) -> io::Result<()> {
        Ok(())
    }
    pub(super) fn mode(_meta: &Metadata) -> u32 {
        0o700
    }
    pub(super) fn owned(_meta: &Metadata) -> bool {
        true
    }
    pub(super) fn create_mode(_options: &mut OpenOptions, _mode: u32) {}
    pub(super) fn no_follow(_options: &mut OpenOptions, _nonblocking: bool) {}
    pub(super) fn try_lock(_file: &File) -> io::Result<bool> {
        Err(io::ErrorKind::Unsupported.into())
    }
    pub(super) fn lock(_file: &File) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }
    pub(super) fn same_file(_file: &File, _path: &Path) -> bool {
        false
    }
    pub(crate) fn identity(path: &Path) -> Option<impl Eq + std::fmt::Debug> {
        let m = std::fs::symlink_metadata(path).ok()?;
        Some((m.len(), m.modified().ok()?))
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use crate::engine_file::tests::{FRAME, engine, key};
    use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
    use std::process::{Command, Output, Stdio};

    /// Tells `child` what to do in a child process of this test binary: the umask and the
    /// environment are the process's, and the harness runs tests in threads of one.
    const CHILD: &str = "TRTCLASSIFY_CACHE_TEST_CHILD";
    /// The child's folder.
    const CHILD_DIR: &str = "TRTCLASSIFY_CACHE_TEST_DIR";

    /// `child` in a new process of this test binary, to do `what` in `dir`.
    fn child_process(what: &str, dir: &Path) -> Command {
        let module = module_path!().split_once("::").map_or("", |(_, m)| m);
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args(["--exact", &format!("{module}::child"), "--ignored"])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD, what)
            .env(CHILD_DIR, dir)
            .env("XDG_CACHE_HOME", dir.join("xdg"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    }

    /// The values of the lines `@name value` the child printed, checking that it succeeded.
    fn said(output: &Output, name: &str) -> Vec<String> {
        let text = String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "the child failed:\n{text}");
        let at = format!("@{name} ");
        text.lines()
            .filter_map(|l| l.strip_prefix(&at))
            .map(str::to_owned)
            .collect()
    }

    /// Prints `@name value` for the parent, on a line of its own.
    fn say(name: &str, value: impl std::fmt::Display) {
        println!("\n@{name} {value}");
    }

    fn mode_of(path: &Path) -> String {
        format!("{:o}", fs::symlink_metadata(path).unwrap().mode() & 0o7777)
    }

    /// `load_or_build` of the test engine at `path`: whether it was built.
    fn obtain(path: &Path, place: Place, progress: &mut dyn FnMut(&str)) -> bool {
        obtain_with(path, place, progress, || ()).is_some()
    }

    /// `load_or_build` of the test engine at `path`, calling `during` in the build: what it
    /// returned, if it built.
    fn obtain_with<T>(
        path: &Path,
        place: Place,
        progress: &mut dyn FnMut(&str),
        during: impl FnOnce() -> T,
    ) -> Option<T> {
        let (file, built) = load_or_build(path, place, &key(), FRAME, progress, |_| {
            Ok::<_, String>((engine(), during()))
        })
        .unwrap();
        assert_eq!(file.weights, engine().weights);
        built
    }

    /// What the other tests run in a child process; nothing without `CHILD`.
    #[test]
    #[ignore = "run by the other tests in a child process"]
    fn child() {
        let Ok(what) = std::env::var(CHILD) else {
            return;
        };
        let dir = PathBuf::from(std::env::var_os(CHILD_DIR).unwrap());
        let (what, arg) = what.split_once(':').unwrap_or((&what, ""));
        match what {
            "umask" => {
                let mask = libc::mode_t::from_str_radix(arg, 8).unwrap();
                // SAFETY: umask cannot fail; this process runs this test alone.
                unsafe { libc::umask(mask) };
                // A crashed writer's temporary file, which the cleanup after the save removes.
                let cache = super::dir();
                fs::create_dir_all(&cache).unwrap();
                let stale = cache.join(".m-1.engine.0123456789abcdef.tmp");
                let file = File::create(&stale).unwrap();
                file.set_modified(SystemTime::now() - 2 * TEMP_AGE).unwrap();
                for (place, path) in [
                    (Place::Cache, cache.join("m-1.engine")),
                    (Place::Elsewhere, dir.join("location/e.engine")),
                ] {
                    let lock = lock_path(&path).unwrap();
                    let held = obtain_with(&path, place, &mut |_| {}, || mode_of(&lock));
                    say("built", held.is_some());
                    say("hit", !obtain(&path, place, &mut |_| {}));
                    say("file", mode_of(&path));
                    say("lock", held.unwrap_or_default());
                    say("lock-left", lock.exists());
                }
                say("folder", mode_of(&cache));
                say("stale", stale.exists());
            }
            "race" => {
                // All start once all are ready.
                let n: usize = arg.parse().unwrap();
                fs::write(dir.join(format!("ready-{}", std::process::id())), b"").unwrap();
                let ready = || {
                    fs::read_dir(&dir)
                        .unwrap()
                        .flatten()
                        .filter(|e| e.file_name().to_string_lossy().starts_with("ready-"))
                        .count()
                };
                let started = std::time::Instant::now();
                while ready() < n && started.elapsed() < Duration::from_secs(30) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let path = dir.join("e.engine");
                let (_, built) = load_or_build(
                    &path,
                    Place::Elsewhere,
                    &key(),
                    FRAME,
                    &mut |msg| say("progress", msg),
                    |_| {
                        // A build long enough for the other process to come and wait.
                        std::thread::sleep(Duration::from_millis(1500));
                        Ok::<_, String>((engine(), ()))
                    },
                )
                .unwrap();
                say("result", if built.is_some() { "built" } else { "loaded" });
            }
            "load" => {
                let before = peak_memory();
                let loaded = engine_file::load(&dir.join("big.engine"), &key(), FRAME);
                assert!(loaded.unwrap().is_some());
                say("grew", peak_memory() - before);
            }
            "digest" => {
                let before = peak_memory();
                engine_file::model_digest(&dir.join("big.engine"), &[]).unwrap();
                say("grew", peak_memory() - before);
            }
            _ => panic!("{CHILD}={what}: nothing to do"),
        }
    }

    /// This process's peak resident memory so far, in bytes.
    fn peak_memory() -> u64 {
        let status = fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kb * 1024
    }

    #[test]
    fn files_get_their_mode_and_hit_under_any_umask() {
        // 002 is Ubuntu's for login users: files 0664 by default, which the trust check
        // refuses, so the cache never hit.
        for mask in ["002", "022", "077"] {
            let dir = tempfile::tempdir().unwrap();
            let out = child_process(&format!("umask:{mask}"), dir.path())
                .output()
                .unwrap();
            let one = |name| said(&out, name).join(" ");
            // In the cache, then at an `engine-location`.
            assert_eq!(one("built"), "true true", "umask {mask}");
            assert_eq!(one("hit"), "true true", "umask {mask}");
            assert_eq!(one("file"), "600 644", "umask {mask}");
            assert_eq!(one("lock"), "600 644", "umask {mask}");
            assert_eq!(one("lock-left"), "false false", "umask {mask}");
            assert_eq!(one("folder"), "700", "umask {mask}");
            assert_eq!(one("stale"), "false", "umask {mask}");
        }
    }

    #[test]
    fn processes_starting_together_build_once() {
        let dir = tempfile::tempdir().unwrap();
        let children: Vec<_> = (0..4)
            .map(|_| child_process("race:4", dir.path()).spawn().unwrap())
            .collect();
        let outputs: Vec<_> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        let mut results: Vec<_> = outputs.iter().flat_map(|o| said(o, "result")).collect();
        results.sort();
        assert_eq!(results, ["built", "loaded", "loaded", "loaded"]);
        let progress: Vec<_> = outputs.iter().flat_map(|o| said(o, "progress")).collect();
        let waited = format!(
            "waiting for another process building {}",
            dir.path().join("e.engine").display()
        );
        assert!(progress.contains(&waited), "{progress:?}");
    }

    #[test]
    fn engines_of_one_process_starting_together_build_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.engine");
        let (building, built) = std::sync::mpsc::channel();
        let first = {
            let path = path.clone();
            std::thread::spawn(move || {
                load_or_build(&path, Place::Elsewhere, &key(), FRAME, &mut |_| {}, |_| {
                    building.send(()).unwrap();
                    std::thread::sleep(Duration::from_millis(300));
                    Ok::<_, String>((engine(), ()))
                })
                .unwrap()
                .1
                .is_some()
            })
        };
        built.recv().unwrap();
        let mut said = Vec::new();
        assert!(!obtain(&path, Place::Elsewhere, &mut |m| said.push(m.to_owned())));
        assert!(first.join().unwrap());
        let waited = format!("waiting for another process building {}", path.display());
        assert_eq!(said[0], waited);
        assert_eq!(said[1], format!("loaded engine file {}", path.display()));
    }

    #[test]
    fn links_at_the_engine_path_are_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        // The link leads to a sound engine: followed, it would be used (and could be changed
        // by whoever planted the link).
        let victim = dir.path().join("victim.engine");
        engine_file::save(&victim, &engine(), Place::Elsewhere).unwrap();
        let before = fs::read(&victim).unwrap();
        let path = dir.path().join("e.engine");
        symlink(&victim, &path).unwrap();
        let err = engine_file::load(&path, &key(), FRAME).err().unwrap();
        assert!(err.to_string().contains("a symbolic link"), "{err}");
        assert!(obtain(&path, Place::Elsewhere, &mut |_| {}), "built again");
        assert!(fs::symlink_metadata(&path).unwrap().is_file());
        assert_eq!(fs::read(&victim).unwrap(), before);
        assert!(!obtain(&path, Place::Elsewhere, &mut |_| {}), "then loaded");
        // A FIFO is no engine, and reading it does not wait for a writer.
        let fifo = dir.path().join("fifo.engine");
        let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let err = engine_file::load(&fifo, &key(), FRAME).err().unwrap();
        assert!(err.to_string().contains("not a regular file"), "{err}");
    }

    #[test]
    fn a_group_writable_file_of_an_older_plugin_is_rebuilt_with_our_mode() {
        // What a plugin that left the mode to a umask of 002 wrote.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.engine");
        fs::write(&path, engine_file::to_bytes(&engine()).unwrap()).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o664)).unwrap();
        let err = engine_file::load(&path, &key(), FRAME).err().unwrap();
        assert!(err.to_string().contains("(mode 664): not trusted"), "{err}");
        assert!(obtain(&path, Place::Elsewhere, &mut |_| {}));
        assert_eq!(mode_of(&path), "644");
        assert!(!obtain(&path, Place::Elsewhere, &mut |_| {}));
    }

    #[test]
    fn temporary_files_cannot_be_planted() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        let path = dir.path().join("e.engine");
        // Links at the names earlier versions wrote to (`e.tmp<pid>-<n>`).
        for n in 0..2000 {
            let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
            symlink(&victim, tmp).unwrap();
        }
        engine_file::save(&path, &engine(), Place::Elsewhere).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        assert!(engine_file::load(&path, &key(), FRAME).unwrap().is_some());
        // The temporary file: a random name beside the engine, our mode from the start.
        let mut seen = Vec::new();
        replace(&path, 0o600, |out| {
            for entry in fs::read_dir(dir.path()).unwrap().flatten() {
                let name = entry.file_name().into_string().unwrap();
                if temp_of(&name) == Some("e.engine") {
                    seen.push((name, mode_of(&entry.path())));
                }
            }
            out.write_all(b"new")
        })
        .unwrap();
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0].1, "600");
        assert_ne!(random_hex(), random_hex());
        // On failure it goes, and the file stays as it was.
        let failed = replace(&path, 0o600, |out| {
            out.write_all(b"half")?;
            Err(io::Error::other("full disk"))
        });
        assert!(failed.is_err());
        assert_eq!(fs::read(&path).unwrap(), b"new");
        let left = fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter(|e| temp_of(&e.file_name().to_string_lossy()).is_some())
            .count();
        assert_eq!(left, 0);
    }

    #[test]
    fn links_at_the_lock_path_are_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        fs::set_permissions(&victim, fs::Permissions::from_mode(0o640)).unwrap();
        let (a, b) = (dir.path().join("a.engine"), dir.path().join("b.engine"));
        symlink(&victim, lock_path(&a).unwrap()).unwrap();
        // A dangling link: opening it with O_CREAT would create what it names.
        let created = dir.path().join("created");
        symlink(&created, lock_path(&b).unwrap()).unwrap();
        for path in [&a, &b] {
            // Built without the lock, and saved.
            assert!(obtain(path, Place::Elsewhere, &mut |_| {}));
            assert!(!obtain(path, Place::Elsewhere, &mut |_| {}));
        }
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        assert_eq!(mode_of(&victim), "640");
        assert!(!created.exists());
    }

    #[test]
    fn a_lock_that_cannot_be_taken_does_not_stop_the_build() {
        // A folder where the lock file goes: the build goes on without it, and saves.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.engine");
        fs::create_dir(lock_path(&path).unwrap()).unwrap();
        assert!(obtain(&path, Place::Elsewhere, &mut |_| {}));
        assert!(!obtain(&path, Place::Elsewhere, &mut |_| {}));
        // The build's own failure is the caller's, lock or not.
        fs::remove_file(&path).unwrap();
        let built = load_or_build(&path, Place::Elsewhere, &key(), FRAME, &mut |_| {}, |_| {
            Err::<(EngineFile, ()), _>("the build's own error")
        });
        assert_eq!(built.err(), Some("the build's own error"));
    }

    /// A file named `name` in `dir` holding `bytes`, last used `age` before `now`.
    fn put(dir: &Path, name: &str, bytes: &[u8], age: Duration, now: SystemTime) -> PathBuf {
        let path = dir.join(name);
        fs::write(&path, bytes).unwrap();
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(now - age)
            .unwrap();
        path
    }

    const HOUR: Duration = Duration::from_secs(3600);
    const DAY: Duration = Duration::from_secs(24 * 3600);

    /// The names in `removed`, sorted.
    fn names(removed: &[PathBuf]) -> Vec<String> {
        let mut names: Vec<_> = removed
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn the_cleanup_removes_what_is_stale() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let now = SystemTime::now();
        let good = engine_file::to_bytes(&engine()).unwrap();
        let mut format8 = good.clone();
        format8[8] = 8;
        put(
            d,
            ".m-1.engine.0123456789abcdef.tmp",
            b"half",
            2 * HOUR,
            now,
        );
        put(
            d,
            ".m-1.engine.fedcba9876543210.tmp",
            b"writing",
            HOUR / 6,
            now,
        );
        put(d, "m-2.tmp1234-0", b"half", 2 * HOUR, now);
        put(d, "m-unused.engine", &good, 31 * DAY, now);
        put(d, ".m-unused.engine.lock", b"", 31 * DAY, now);
        put(d, "m-recent.engine", &good, 29 * DAY, now);
        put(d, "m-format8.engine", &format8, 2 * DAY, now);
        put(d, "m-format8-new.engine", &format8, 2 * HOUR, now);
        put(
            d,
            "m-elf.engine",
            b"\x7fELF\x02\x01\x01\0 a library",
            2 * DAY,
            now,
        );
        let locked = put(d, "m-locked.engine", &good, 40 * DAY, now);
        let keep = put(d, "m-kept.engine", &good, 40 * DAY, now);
        put(d, ".m-gone.engine.lock", b"", 2 * HOUR, now);
        put(d, ".m-gone-new.engine.lock", b"", HOUR / 6, now);
        put(d, "notes.txt", b"mine", 400 * DAY, now);
        put(d, "m-old-0123456789abcdef.digest", b"digest", 31 * DAY, now);
        put(d, "m-0123456789abcdef.digest", b"digest", 29 * DAY, now);
        put(d, "m-old-1.calibration.txt", b"table", 31 * DAY, now);
        put(
            d,
            "m-old-1.calibration.txt.heldout",
            b"frames",
            31 * DAY,
            now,
        );
        put(d, "m-1.calibration.txt", b"table", 29 * DAY, now);
        put(d, "m-1.calibration.txt.heldout", b"frames", 29 * DAY, now);
        put(
            d,
            ".m-2.calibration.txt.0123456789abcdef.tmp",
            b"half",
            2 * HOUR,
            now,
        );
        put(
            d,
            ".m-2.calibration.txt.0123456789abcdef.tmp.heldout",
            b"half",
            2 * HOUR,
            now,
        );
        fs::create_dir(d.join("folder.engine")).unwrap();
        symlink(d.join("notes.txt"), d.join("link.engine")).unwrap();
        // A builder of `m-locked` holds its lock.
        let lock = File::create(lock_path(&locked).unwrap()).unwrap();
        assert!(sys::try_lock(&lock).unwrap());
        let removed = cleanup(d, &keep, now, u64::MAX);
        assert_eq!(
            names(&removed),
            [
                ".m-1.engine.0123456789abcdef.tmp",
                ".m-2.calibration.txt.0123456789abcdef.tmp",
                ".m-2.calibration.txt.0123456789abcdef.tmp.heldout",
                ".m-gone.engine.lock",
                "m-2.tmp1234-0",
                "m-elf.engine",
                "m-format8.engine",
                "m-old-0123456789abcdef.digest",
                "m-old-1.calibration.txt",
                "m-old-1.calibration.txt.heldout",
                "m-unused.engine",
            ]
        );
        assert!(removed.iter().all(|p| !p.exists()));
        let mut left: Vec<_> = fs::read_dir(d)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                ".m-1.engine.fedcba9876543210.tmp",
                ".m-gone-new.engine.lock",
                ".m-locked.engine.lock",
                "folder.engine",
                "link.engine",
                "m-0123456789abcdef.digest",
                "m-1.calibration.txt",
                "m-1.calibration.txt.heldout",
                "m-format8-new.engine",
                "m-kept.engine",
                "m-locked.engine",
                "m-recent.engine",
                "notes.txt",
            ]
        );
        // Released, the lock no longer keeps its engine.
        drop(lock);
        let removed = cleanup(d, &keep, now, u64::MAX);
        assert_eq!(names(&removed), ["m-locked.engine"]);
    }

    #[test]
    fn the_cleanup_keeps_the_cache_under_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let now = SystemTime::now();
        let good = engine_file::to_bytes(&engine()).unwrap();
        let n = good.len() as u64;
        // From the least recently used: locked, just saved, then b, c, d.
        let locked = put(d, "e.engine", &good, 5 * HOUR, now);
        let keep = put(d, "a.engine", &good, 4 * HOUR, now);
        put(d, "b.engine", &good, 3 * HOUR, now);
        put(d, "c.engine", &good, 2 * HOUR, now);
        put(d, "d.engine", &good, HOUR, now);
        let lock = File::create(lock_path(&locked).unwrap()).unwrap();
        assert!(sys::try_lock(&lock).unwrap());
        assert!(cleanup(d, &keep, now, 5 * n).is_empty());
        let removed = cleanup(d, &keep, now, 3 * n);
        assert_eq!(names(&removed), ["b.engine", "c.engine"]);
        assert_eq!(
            max_bytes_from(Some(" 0.5 ")),
            500_000_000,
            "{MAX_GB_VAR} in GB"
        );
        assert_eq!(max_bytes_from(None), 20_000_000_000);
        assert_eq!(max_bytes_from(Some("lots")), 20_000_000_000);
        assert_eq!(max_bytes_from(Some("-1")), 20_000_000_000);
    }

    #[test]
    fn nothing_but_our_temporary_files_goes_from_a_users_folder() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let now = SystemTime::now();
        let good = engine_file::to_bytes(&engine()).unwrap();
        let old = put(d, "old.engine", &good, 400 * DAY, now);
        let theirs = put(d, ".old.engine.0123456789abcdef.tmp", b"", 2 * HOUR, now);
        let ours = put(d, ".e.engine.0123456789abcdef.tmp", b"", 2 * HOUR, now);
        let writing = put(d, ".e.engine.fedcba9876543210.tmp", b"", HOUR / 6, now);
        let path = d.join("e.engine");
        assert!(obtain(&path, Place::Elsewhere, &mut |_| {}));
        assert!(old.exists() && theirs.exists() && writing.exists());
        assert!(!ours.exists());
    }

    #[test]
    fn loads_and_digests_hold_the_file_once_at_most() {
        // A 128 MiB weight: the load holds it once (not also the file's bytes), the digest
        // holds a few MiB of it at a time. Measured in child processes, whose peak memory
        // is their own.
        let dir = tempfile::tempdir().unwrap();
        let mut big = engine();
        big.weights.push(vec![7; 128 << 20]);
        let path = dir.path().join("big.engine");
        engine_file::save(&path, &big, Place::Elsewhere).unwrap();
        drop(big);
        let len = fs::metadata(&path).unwrap().len();
        for (what, bound) in [("load", len + len / 4), ("digest", 32 << 20)] {
            let out = child_process(what, dir.path()).output().unwrap();
            let grew: u64 = said(&out, "grew")[0].parse().unwrap();
            assert!(
                grew < bound,
                "{what}: {} MiB for a file of {} MiB",
                grew >> 20,
                len >> 20
            );
        }
    }
}
