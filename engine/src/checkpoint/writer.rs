//! Writing safetensors files (used by `model init` and by tests that build edited
//! checkpoints).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, View};

use super::CheckpointError;

/// A tensor's dtype, shape and bytes, owned.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Write `tensors` to `path` atomically (a `.partial` file renamed into place), so an
/// interrupted write never leaves a file that looks complete. Metadata is the single
/// `format: pt` entry: safetensors writes metadata in hash order, and the same
/// tensors must give the same bytes.
pub fn write_safetensors(path: &Path, tensors: &[(String, OwnedTensor)]) -> Result<(), CheckpointError> {
    let io = |p: &Path, e: &dyn std::fmt::Display| CheckpointError::Io {
        path: p.display().to_string(),
        reason: e.to_string(),
    };
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = Path::new(&partial);
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(meta), partial)
        .map_err(|e| io(partial, &e))?;
    std::fs::rename(partial, path).map_err(|e| io(path, &e))
}
