// SPDX-License-Identifier: MPL-2.0
//! The model digests of engine keys, remembered. An engine file is found by a key holding the
//! SHA-256 of the model and its external weights (`engine_file::model_digest`), which reads
//! every byte: 0.35 s for ViT-B/16's 331 MB on the GPU host, seconds for a model of several
//! gigabytes, on every start. So the digest is kept in the engine cache folder beside what
//! identifies the files' contents (`cache::identity`: device, inode, size, modification and
//! change times, as make, git and ccache tell a changed file), and used again while those stay
//! the same. A model written in place changes its change time (which no program can set
//! back), and one renamed over it has another inode: either is hashed again.
//!
//! A remembered digest is trusted as an engine file is: only one in a file of this user's
//! that no one else could have written. Anything amiss (no cache folder, a file that cannot
//! be read or written) costs the hashing, never the start.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::cache::{self, Place};
use crate::engine_file::{self, Error};

/// The digest of the model `path` and its `external` weight files, from the cache folder
/// where it was remembered for those very files, else computed (and remembered there).
pub fn model_digest(path: &Path, external: &[PathBuf]) -> Result<String, Error> {
    model_digest_in(&cache::dir(), path, external)
}

/// `model_digest` with the digests kept in `dir`.
fn model_digest_in(dir: &Path, path: &Path, external: &[PathBuf]) -> Result<String, Error> {
    let Some((memo, stamp)) = memo_and_stamp(dir, path, external) else {
        return engine_file::model_digest(path, external);
    };
    if let Some(digest) = remembered(&memo, &stamp) {
        return Ok(digest);
    }
    let digest = engine_file::model_digest(path, external)?;
    // A file written while it was read has another stamp now: its digest is not remembered.
    if memo_and_stamp(dir, path, external).is_some_and(|(_, after)| after == stamp) {
        remember(dir, &memo, &stamp, &digest);
    }
    Ok(digest)
}

/// Where the digest of these files is remembered (named after their paths), and what
/// identifies their contents now; `None` where a file cannot be looked at (the hashing then
/// says why).
fn memo_and_stamp(dir: &Path, path: &Path, external: &[PathBuf]) -> Option<(PathBuf, String)> {
    let files: Vec<PathBuf> = std::iter::once(path)
        .chain(external.iter().map(PathBuf::as_path))
        .map(fs::canonicalize)
        .collect::<Result<_, _>>()
        .ok()?;
    let names: Vec<&str> = files.iter().map(|f| f.to_str()).collect::<Option<_>>()?;
    // The files are their canonical paths: the identity of each is its own, not a link's.
    let stamp = files
        .iter()
        .map(|f| cache::identity(f).map(|id| format!("{id:?}")))
        .collect::<Option<Vec<String>>>()?
        .join(" ");
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    let hash = engine_file::sha256_hex(names.join("\n"));
    let memo = dir.join(format!("{stem}-{}.digest", &hash[..16]));
    Some((memo, format!("{}\n{stamp}", names.join("\n"))))
}

/// The digest in `memo` if it was remembered for files stamped `stamp` and the file is
/// trusted; its time is touched, as an engine file's is when used.
fn remembered(memo: &Path, stamp: &str) -> Option<String> {
    let mut file = cache::open_engine(memo).ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || engine_file::trusted(&meta).is_err() || meta.len() > 64 * 1024 {
        return None;
    }
    let mut text = String::new();
    file.read_to_string(&mut text).ok()?;
    let (remembered_stamp, digest) = text.trim_end().rsplit_once('\n')?;
    let is_digest = digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit());
    if remembered_stamp != stamp || !is_digest {
        return None;
    }
    let _ = file.set_modified(std::time::SystemTime::now());
    Some(digest.to_owned())
}

/// Keeps `digest` for files stamped `stamp` in `memo`; a failure only costs the next start
/// the hashing.
fn remember(dir: &Path, memo: &Path, stamp: &str, digest: &str) {
    let written = cache::make_folder(dir, Place::Cache).and_then(|()| {
        cache::replace(memo, 0o600, |out: &mut dyn Write| {
            writeln!(out, "{stamp}\n{digest}")
        })
    });
    if let Err(e) = written {
        log::debug!(target: trtclassify_compiler::LOG_TARGET, "cannot remember the model digest in {}: {e}", memo.display());
    }
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// The one memo file in `dir`.
    fn memo_of(dir: &Path) -> PathBuf {
        let memos: Vec<PathBuf> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "digest"))
            .collect();
        assert_eq!(memos.len(), 1, "{memos:?}");
        memos[0].clone()
    }

    /// Puts `fake` in place of the remembered digest: what a remembered digest returns shows
    /// whether the files were hashed again.
    fn forge(memo: &Path, fake: &str) {
        let text = fs::read_to_string(memo).unwrap();
        let (stamp, _) = text.trim_end().rsplit_once('\n').unwrap();
        fs::write(memo, format!("{stamp}\n{fake}\n")).unwrap();
        fs::set_permissions(memo, fs::Permissions::from_mode(0o600)).unwrap();
    }

    #[test]
    fn a_digest_is_remembered_until_a_file_changes() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let (model, weights) = (dir.path().join("m.onnx"), dir.path().join("m.weights"));
        fs::write(&model, b"model one").unwrap();
        fs::write(&weights, b"weights one").unwrap();
        let files = [weights.clone()];
        let real = engine_file::model_digest(&model, &files).unwrap();
        assert_eq!(model_digest_in(&cache, &model, &files).unwrap(), real);
        let memo = memo_of(&cache);
        assert_eq!(
            fs::metadata(&memo).unwrap().permissions().mode() & 0o777,
            0o600
        );

        let fake = "f".repeat(64);
        forge(&memo, &fake);
        assert_eq!(
            model_digest_in(&cache, &model, &files).unwrap(),
            fake,
            "unchanged files are not hashed again"
        );

        // The external weights rewritten in place, at the same size.
        fs::write(&weights, b"weights two").unwrap();
        let changed = engine_file::model_digest(&model, &files).unwrap();
        assert_ne!(changed, real);
        assert_eq!(model_digest_in(&cache, &model, &files).unwrap(), changed);

        // The model replaced by a file renamed over it.
        forge(&memo, &fake);
        let new = dir.path().join("new.onnx");
        fs::write(&new, b"model two").unwrap();
        fs::rename(&new, &model).unwrap();
        assert_eq!(
            model_digest_in(&cache, &model, &files).unwrap(),
            engine_file::model_digest(&model, &files).unwrap()
        );
    }

    #[test]
    fn a_memo_others_could_write_is_not_believed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let model = dir.path().join("m.onnx");
        fs::write(&model, b"model").unwrap();
        let real = model_digest_in(&cache, &model, &[]).unwrap();
        let memo = memo_of(&cache);
        forge(&memo, &"0".repeat(64));
        fs::set_permissions(&memo, fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(model_digest_in(&cache, &model, &[]).unwrap(), real);
        // Hashed again, and remembered in a file of its own mode again.
        assert_eq!(
            fs::metadata(&memo).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn a_missing_model_is_the_hashing_error() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let err = model_digest_in(&cache, &dir.path().join("gone.onnx"), &[]).unwrap_err();
        assert!(err.to_string().contains("gone.onnx"), "{err}");
        assert!(
            !cache.exists(),
            "nothing remembered for a model that is not there"
        );
    }
}
