//! The safetensors files of a checkpoint directory, memory-mapped: one
//! `model.safetensors`, or shards listed by `model.safetensors.index.json` (any other
//! `*.safetensors` files are used when there is neither).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use kernels::mapped::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::CheckpointError;

/// Where one tensor's bytes are.
#[derive(Clone, Debug)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A tensor's metadata and bytes, borrowed from the mapping.
#[derive(Clone, Copy, Debug)]
pub struct RawTensor<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

pub struct SafetensorsSet {
    maps: Vec<Mmap>,
    /// Header bytes of each file, kept for fingerprinting.
    headers: Vec<Vec<u8>>,
    tensors: HashMap<String, Entry>,
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io { path: path.display().to_string(), reason: e.to_string() }
}

impl SafetensorsSet {
    pub fn open_dir(dir: &Path) -> Result<Self, CheckpointError> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| io_err(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| io_err(&index, e))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| io_err(&index, "no `weight_map` object"))?;
            let mut names: Vec<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| io_err(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            found
        };
        if files.is_empty() {
            return Err(CheckpointError::NoWeights { dir: dir.display().to_string() });
        }
        Self::open_files(&files)
    }

    pub fn open_files(files: &[PathBuf]) -> Result<Self, CheckpointError> {
        let mut set = SafetensorsSet { maps: Vec::new(), headers: Vec::new(), tensors: HashMap::new() };
        for path in files {
            let file = File::open(path).map_err(|e| io_err(path, e))?;
            let map = kernels::mapped::map_readonly(&file).map_err(|e| io_err(path, e))?;
            let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| io_err(path, e))?;
            let data_start = 8 + header_len;
            let idx = set.maps.len();
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                if set.tensors.contains_key(&name) {
                    return Err(io_err(path, format!("tensor `{name}` appears in more than one file")));
                }
                set.tensors.insert(
                    name,
                    Entry {
                        file: idx,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: data_start + s,
                        end: data_start + e,
                    },
                );
            }
            set.headers.push(map[..data_start].to_vec());
            set.maps.push(map);
        }
        Ok(set)
    }

    pub fn get(&self, name: &str) -> Option<RawTensor<'_>> {
        self.tensors.get_key_value(name).map(|(n, e)| RawTensor {
            name: n,
            dtype: e.dtype,
            shape: &e.shape,
            bytes: &self.maps[e.file][e.start..e.end],
        })
    }

    /// Every tensor, in no particular order.
    pub fn tensors(&self) -> impl Iterator<Item = RawTensor<'_>> {
        self.tensors.keys().filter_map(|n| self.get(n))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// `(header bytes, file length, whole mapping)` of every file, for fingerprinting.
    pub fn files(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.headers.iter().map(Vec::as_slice).zip(self.maps.iter().map(|m| &m[..]))
    }
}
