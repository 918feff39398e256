//! The repository's files that deployment tests read: the workspace root, a file under
//! it by relative path, and the panels of a Grafana dashboard (nested rows included).

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The workspace root (the parent of this crate's directory).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// A file under the workspace root, as text; fails naming it.
pub fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every panel of a dashboard, rows' nested panels after their row.
pub fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().into_iter().flatten() {
        out.push(p);
        out.extend(panels(p));
    }
    out
}
