//! Where each target's inputs live: `corpus/<target>/` holds small seeds (valid
//! encodings made by the real encoders, see `tests/seeds.rs`) and what libFuzzer kept;
//! `regressions/<target>/` holds minimised inputs that once failed. Both are replayed by
//! `cargo test`; libFuzzer starts from both.

use std::path::{Path, PathBuf};

/// The crate's directory (corpus paths are relative to it).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn corpus_dir(target: &str) -> PathBuf {
    root().join("corpus").join(target)
}

pub fn regressions_dir(target: &str) -> PathBuf {
    root().join("regressions").join(target)
}

/// Files of a directory in name order (none when it does not exist).
pub fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    out.sort();
    out
}

/// Every input of a target: seeds first, then regressions, as `(path, bytes)`.
pub fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let mut paths = files(&corpus_dir(target));
    paths.extend(files(&regressions_dir(target)));
    paths
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()));
            (p, bytes)
        })
        .collect()
}
