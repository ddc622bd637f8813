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
//! The facts of the model's graph that a start needs before its engine file (its input, its
//! last operator: `ModelFacts`) are remembered with the digest, so that a start whose engine
//! file is there need not read the model at all (0.6 s for ViT-B/16 on the GPU host).
//!
//! A remembered digest is trusted as an engine file is: only one in a file of this user's
//! that no one else could have written. Anything amiss (no cache folder, a file that cannot
//! be read or written) costs the hashing, never the start.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use trtclassify_compiler::ModelFacts;

use crate::cache::{self, Place};
use crate::engine_file::{self, Error};

/// What is remembered of a model: the files it was read from (the model, then its external
/// weights) as the start named them and as they resolved (canonical paths), what identified
/// their contents, their digest, and the facts of its graph that a start needs before its
/// engine file (`ModelFacts`), as this version of the plugin finds them.
#[derive(Serialize, Deserialize)]
struct Memo {
    named: Vec<String>,
    files: Vec<String>,
    stamp: String,
    digest: String,
    facts: ModelFacts,
    version: String,
}

/// The digest of the model `path` and its `external` weight files, from the cache folder
/// where it was remembered for those very files, else computed (and remembered there, with
/// the model's `facts`).
pub fn model_digest(
    path: &Path,
    external: &[PathBuf],
    facts: &ModelFacts,
) -> Result<String, Error> {
    model_digest_in(&cache::dir(), path, external, facts)
}

/// The digest and facts remembered for the model `path`, where neither it nor the external
/// weight files it named have changed since (nor where their names lead): a start that
/// finds its engine file then need not read the model at all.
pub fn remembered_model(path: &Path) -> Option<(String, ModelFacts)> {
    remembered_model_in(&cache::dir(), path)
}

/// `model_digest` with the digests kept in `dir`.
fn model_digest_in(
    dir: &Path,
    path: &Path,
    external: &[PathBuf],
    facts: &ModelFacts,
) -> Result<String, Error> {
    let Some(files) = Files::of(path, external) else {
        return engine_file::model_digest(path, external);
    };
    let memo = memo_path(dir, path, &files);
    if let Some(mut known) = remembered(&memo).filter(|m| files.match_memo(m)) {
        if known.facts != *facts || known.version != VERSION {
            // The same bytes, read by another version of the plugin: the digest holds.
            (known.facts, known.version) = (facts.clone(), VERSION.into());
            remember(dir, &memo, &known);
        }
        return Ok(known.digest);
    }
    let digest = engine_file::model_digest(path, external)?;
    // A file written while it was read has another stamp now: its digest is not remembered.
    if Files::of(path, external).is_some_and(|after| after.stamp == files.stamp) {
        let known = Memo {
            named: files.named,
            files: files.canonical,
            stamp: files.stamp,
            digest: digest.clone(),
            facts: facts.clone(),
            version: VERSION.into(),
        };
        remember(dir, &memo, &known);
    }
    Ok(digest)
}

/// `remembered_model` with the digests kept in `dir`.
fn remembered_model_in(dir: &Path, path: &Path) -> Option<(String, ModelFacts)> {
    let model = Files::of(path, &[])?;
    let known = remembered(&memo_path(dir, path, &model))?;
    if known.version != VERSION || known.named.first() != model.named.first() {
        return None;
    }
    let external: Vec<PathBuf> = known.named[1..].iter().map(PathBuf::from).collect();
    let files = Files::of(path, &external)?;
    files
        .match_memo(&known)
        .then_some((known.digest, known.facts))
}

/// The plugin's version: facts remembered by another are found again from the model.
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A model's files now: as named (made absolute), as they resolve, and what identifies
/// their contents.
struct Files {
    named: Vec<String>,
    canonical: Vec<String>,
    stamp: String,
}

impl Files {
    /// The files of the model `path` and its `external` weights; `None` where one cannot be
    /// looked at (the hashing then says why).
    fn of(path: &Path, external: &[PathBuf]) -> Option<Files> {
        let paths: Vec<&Path> = std::iter::once(path)
            .chain(external.iter().map(PathBuf::as_path))
            .collect();
        let text = |p: PathBuf| p.into_os_string().into_string().ok();
        let named = (paths.iter())
            .map(|p| text(std::path::absolute(p).ok()?))
            .collect::<Option<Vec<String>>>()?;
        let canonical = (paths.iter())
            .map(|p| text(fs::canonicalize(p).ok()?))
            .collect::<Option<Vec<String>>>()?;
        // Each file's own identity, not a link's.
        let stamp = (canonical.iter())
            .map(|f| cache::identity(Path::new(f)).map(|id| format!("{id:?}")))
            .collect::<Option<Vec<String>>>()?
            .join(" ");
        Some(Files {
            named,
            canonical,
            stamp,
        })
    }

    /// Whether `memo` was remembered for these very files, unchanged.
    fn match_memo(&self, memo: &Memo) -> bool {
        memo.named == self.named && memo.files == self.canonical && memo.stamp == self.stamp
    }
}

/// Where what is known of the model `path` is remembered: named after the path as the start
/// names it (a model reached by two names may have other external files beside each).
fn memo_path(dir: &Path, path: &Path, files: &Files) -> PathBuf {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    let hash = engine_file::sha256_hex(&files.named[0]);
    dir.join(format!("{stem}-{}.digest", &hash[..16]))
}

/// What `memo` remembers, if the file is trusted and holds a digest; its time is touched,
/// as an engine file's is when used.
fn remembered(memo: &Path) -> Option<Memo> {
    let mut file = cache::open_engine(memo).ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || engine_file::trusted(&meta).is_err() || meta.len() > 64 * 1024 {
        return None;
    }
    let mut text = String::new();
    file.read_to_string(&mut text).ok()?;
    let known: Memo = serde_json::from_str(&text).ok()?;
    let is_digest = known.digest.len() == 64 && known.digest.bytes().all(|b| b.is_ascii_hexdigit());
    if !is_digest {
        return None;
    }
    let _ = file.set_modified(std::time::SystemTime::now());
    Some(known)
}

/// Keeps `known` in `memo`; a failure only costs the next start the hashing.
fn remember(dir: &Path, memo: &Path, known: &Memo) {
    let written = cache::make_folder(dir, Place::Cache).and_then(|()| {
        cache::replace(memo, 0o600, |out: &mut dyn Write| {
            serde_json::to_writer(&mut *out, known).map_err(std::io::Error::other)
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
    use trtclassify_compiler::onnx::{Dim, ImageInput};
    use trtclassify_compiler::spec::Layout;

    fn facts(output_op: &str) -> ModelFacts {
        ModelFacts {
            input: ImageInput {
                name: "x".into(),
                layout: Layout::Nchw,
                batch: Dim::Dynamic("n".into()),
                channels: 3,
                height: Dim::Fixed(224),
                width: Dim::Fixed(224),
            },
            output_op: Some(output_op.into()),
        }
    }

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
        let mut known: Memo = serde_json::from_slice(&fs::read(memo).unwrap()).unwrap();
        known.digest = fake.into();
        fs::write(memo, serde_json::to_vec(&known).unwrap()).unwrap();
        fs::set_permissions(memo, fs::Permissions::from_mode(0o600)).unwrap();
    }

    /// A folder holding a model, its external weights and a cache folder (not made yet).
    fn model_with_weights() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let (model, weights) = (dir.path().join("m.onnx"), dir.path().join("m.weights"));
        fs::write(&model, b"model one").unwrap();
        fs::write(&weights, b"weights one").unwrap();
        (dir, cache, model, weights)
    }

    #[test]
    fn a_digest_is_remembered_until_a_file_changes() {
        let (dir, cache, model, weights) = model_with_weights();
        let files = [weights.clone()];
        let real = engine_file::model_digest(&model, &files).unwrap();
        assert_eq!(
            model_digest_in(&cache, &model, &files, &facts("Gemm")).unwrap(),
            real
        );
        let memo = memo_of(&cache);
        assert_eq!(
            fs::metadata(&memo).unwrap().permissions().mode() & 0o777,
            0o600
        );

        let fake = "f".repeat(64);
        forge(&memo, &fake);
        assert_eq!(
            model_digest_in(&cache, &model, &files, &facts("Gemm")).unwrap(),
            fake,
            "unchanged files are not hashed again"
        );

        // The external weights rewritten in place, at the same size.
        fs::write(&weights, b"weights two").unwrap();
        let changed = engine_file::model_digest(&model, &files).unwrap();
        assert_ne!(changed, real);
        assert_eq!(
            model_digest_in(&cache, &model, &files, &facts("Gemm")).unwrap(),
            changed
        );

        // The model replaced by a file renamed over it.
        forge(&memo, &fake);
        let new = dir.path().join("new.onnx");
        fs::write(&new, b"model two").unwrap();
        fs::rename(&new, &model).unwrap();
        assert_eq!(
            model_digest_in(&cache, &model, &files, &facts("Gemm")).unwrap(),
            engine_file::model_digest(&model, &files).unwrap()
        );
    }

    #[test]
    fn a_model_is_known_without_reading_it_until_a_file_changes() {
        let (dir, cache, model, weights) = model_with_weights();
        let files = [weights.clone()];
        assert!(remembered_model_in(&cache, &model).is_none(), "never seen");
        let digest = model_digest_in(&cache, &model, &files, &facts("Softmax")).unwrap();
        let (known, known_facts) = remembered_model_in(&cache, &model).unwrap();
        assert_eq!(known, digest);
        assert_eq!(known_facts, facts("Softmax"));
        assert!(known_facts.outputs_probabilities());

        // Remembered by another version of the plugin: its facts are not believed, but
        // found again from the model, which is not hashed again (the digest stays).
        let mut known: Memo = serde_json::from_slice(&fs::read(memo_of(&cache)).unwrap()).unwrap();
        known.version = "0.0.1-old".into();
        known.digest = "e".repeat(64);
        fs::write(memo_of(&cache), serde_json::to_vec(&known).unwrap()).unwrap();
        assert!(remembered_model_in(&cache, &model).is_none());
        assert_eq!(
            model_digest_in(&cache, &model, &files, &facts("Gemm")).unwrap(),
            "e".repeat(64)
        );
        assert_eq!(
            remembered_model_in(&cache, &model).unwrap(),
            ("e".repeat(64), facts("Gemm"))
        );

        // The external weights rewritten in place: the model must be read again, to know
        // its digest.
        fs::write(&weights, b"weights two").unwrap();
        assert!(remembered_model_in(&cache, &model).is_none());
        model_digest_in(&cache, &model, &files, &facts("Gemm")).unwrap();
        assert!(remembered_model_in(&cache, &model).is_some());

        // The model replaced by a file renamed over it, or gone.
        let new = dir.path().join("new.onnx");
        fs::write(&new, b"model two").unwrap();
        fs::rename(&new, &model).unwrap();
        assert!(remembered_model_in(&cache, &model).is_none());
        fs::remove_file(&model).unwrap();
        assert!(remembered_model_in(&cache, &model).is_none());
    }

    #[test]
    fn external_weights_behind_links_and_names_are_followed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        fs::create_dir_all(&a).unwrap();
        fs::create_dir_all(&b).unwrap();
        fs::write(a.join("m.onnx"), b"model").unwrap();
        fs::write(a.join("one.data"), b"weights one").unwrap();
        fs::write(a.join("two.data"), b"weights two").unwrap();
        let link = a.join("m.data");
        std::os::unix::fs::symlink(a.join("one.data"), &link).unwrap();
        let model = a.join("m.onnx");
        let links = [link.clone()];
        let one = model_digest_in(&cache, &model, &links, &facts("Gemm")).unwrap();
        assert!(remembered_model_in(&cache, &model).is_some());
        // The link led elsewhere: the weights are others, though no file changed.
        fs::remove_file(&link).unwrap();
        std::os::unix::fs::symlink(a.join("two.data"), &link).unwrap();
        assert!(remembered_model_in(&cache, &model).is_none());
        let two = model_digest_in(&cache, &model, &links, &facts("Gemm")).unwrap();
        assert_ne!(one, two);

        // The same model file by another name, beside other weights: known apart.
        std::os::unix::fs::symlink(&model, b.join("m.onnx")).unwrap();
        assert!(remembered_model_in(&cache, &b.join("m.onnx")).is_none());
        fs::write(b.join("m.data"), b"weights three").unwrap();
        let three = model_digest_in(
            &cache,
            &b.join("m.onnx"),
            &[b.join("m.data")],
            &facts("Gemm"),
        )
        .unwrap();
        assert_ne!(three, two);
        assert_eq!(remembered_model_in(&cache, &model).unwrap().0, two);
        assert_eq!(
            remembered_model_in(&cache, &b.join("m.onnx")).unwrap().0,
            three
        );
    }

    #[test]
    fn a_memo_others_could_write_is_not_believed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let model = dir.path().join("m.onnx");
        fs::write(&model, b"model").unwrap();
        let real = model_digest_in(&cache, &model, &[], &facts("Gemm")).unwrap();
        let memo = memo_of(&cache);
        forge(&memo, &"0".repeat(64));
        fs::set_permissions(&memo, fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(
            model_digest_in(&cache, &model, &[], &facts("Gemm")).unwrap(),
            real
        );
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
        let err = model_digest_in(&cache, &dir.path().join("gone.onnx"), &[], &facts("Gemm"))
            .unwrap_err();
        assert!(err.to_string().contains("gone.onnx"), "{err}");
        assert!(
            !cache.exists(),
            "nothing remembered for a model that is not there"
        );
    }
}
