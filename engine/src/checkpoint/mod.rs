//! Checkpoint reading: memory-mapped safetensors (single file or sharded), official or
//! HF tensor names. Weight matrices come out as typed views of their stored bytes
//! (nothing is copied or widened here); small tensors as f32 or integers. Shapes,
//! dtypes and scale grids are checked; errors name the tensor and, for shapes, the
//! expected and actual shape.

mod decode;
mod files;
mod names;
mod writer;

use std::path::Path;

use kernels::HostMatrix;
use kernels::stored::{Stored, WeightView};
use thiserror::Error;

use crate::config::ConfigError;
pub use files::{RawTensor, SafetensorsSet};
pub use names::{Naming, hf_name};
pub use writer::{OwnedTensor, write_safetensors};

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("cannot read {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("no safetensors files in {dir} (expected model.safetensors or model.safetensors.index.json)")]
    NoWeights { dir: String },
    #[error(
        "cannot tell the tensor naming of {dir}: neither `embed.weight` (official) nor `model.embed_tokens.weight` (HF) is present"
    )]
    UnknownNaming { dir: String },
    #[error("checkpoint is missing tensor `{tensor}`{hint}")]
    Missing { tensor: String, hint: String },
    #[error("tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    Shape { tensor: String, expected: Vec<usize>, actual: Vec<usize> },
    #[error("tensor `{tensor}` has dtype {dtype}, expected {expected}")]
    Dtype { tensor: String, dtype: String, expected: String },
    #[error("tensor `{tensor}`: {reason}")]
    Quant { tensor: String, reason: String },
    #[error("tensor `{tensor}` holds an invalid value: {reason}")]
    Value { tensor: String, reason: String },
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// MTP tensors under any naming (`mtp.0.…`, `model.mtp.…`).
fn is_mtp(name: &str) -> bool {
    name.starts_with("mtp.") || name.starts_with("model.mtp.")
}

/// Which expert projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertProj {
    /// Gate (`w1`, HF `gate_proj`): `[inter, hidden]`.
    W1,
    /// Down (`w2`, HF `down_proj`): `[hidden, inter]`.
    W2,
    /// Up (`w3`, HF `up_proj`): `[inter, hidden]`.
    W3,
}

pub struct Checkpoint {
    set: SafetensorsSet,
    naming: Naming,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let set = SafetensorsSet::open_dir(dir)?;
        let naming =
            Naming::detect(&set).ok_or_else(|| CheckpointError::UnknownNaming { dir: dir.display().to_string() })?;
        Ok(Checkpoint { set, naming })
    }

    pub fn naming(&self) -> Naming {
        self.naming
    }

    pub fn files(&self) -> &SafetensorsSet {
        &self.set
    }

    fn stored_name(&self, official: &str) -> String {
        self.naming.stored(official)
    }

    fn raw(&self, official: &str) -> Result<RawTensor<'_>, CheckpointError> {
        let stored = self.stored_name(official);
        self.set.get(&stored).ok_or_else(|| CheckpointError::Missing {
            tensor: official.to_string(),
            hint: if stored != official {
                format!(" (looked for `{stored}`, {} naming)", self.naming.name())
            } else {
                String::new()
            },
        })
    }

    /// Bytes of the tensor stored for an official name (0 when absent).
    pub fn stored_bytes(&self, official: &str) -> usize {
        self.raw(official).map(|t| t.bytes.len()).unwrap_or(0)
    }

    /// Bytes a load reads: every tensor but the MTP block's (`mtp.*`, unused).
    pub fn bytes_to_load(&self) -> u64 {
        self.set.tensors().filter(|t| !is_mtp(t.name)).map(|t| t.bytes.len() as u64).sum()
    }

    pub fn has(&self, official: &str) -> bool {
        self.set.contains(&self.stored_name(official))
    }

    fn scale_of(&self, stored: &str) -> Option<RawTensor<'_>> {
        names::scale_names(stored).iter().find_map(|n| self.set.get(n))
    }

    /// A `[rows, cols]` weight matrix as stored.
    pub fn weight(&self, official: &str, rows: usize, cols: usize) -> Result<WeightView<'_>, CheckpointError> {
        let t = self.raw(official)?;
        let scale = self.scale_of(t.name);
        decode::weight(&t, scale.as_ref(), rows, cols)
    }

    /// A `[rows, cols]` weight matrix dequantised to f32 (tools and tests).
    pub fn matrix(&self, official: &str, rows: usize, cols: usize) -> Result<HostMatrix, CheckpointError> {
        Ok(HostMatrix::new(rows, cols, self.weight(official, rows, cols)?.dequantize()))
    }

    /// A float tensor of the given shape, flattened.
    pub fn floats(&self, official: &str, shape: &[usize]) -> Result<Vec<f32>, CheckpointError> {
        decode::floats(&self.raw(official)?, shape)
    }

    /// An integer tensor of the given shape, flattened.
    pub fn ints(&self, official: &str, shape: &[usize]) -> Result<Vec<i64>, CheckpointError> {
        decode::ints(&self.raw(official)?, shape)
    }

    /// All routed experts of a layer as `[w1, w2, w3]` views, from per-expert tensors
    /// (official names, or HF `experts.E.gate_proj`) or HF's fused float
    /// `experts.gate_up_proj` / `experts.down_proj` (sliced per expert, not copied).
    pub fn experts(
        &self,
        layer: usize,
        n: usize,
        inter: usize,
        hidden: usize,
    ) -> Result<Vec<[WeightView<'_>; 3]>, CheckpointError> {
        let fused_gate_up = format!("model.layers.{layer}.mlp.experts.gate_up_proj");
        if self.naming == Naming::Hf && self.set.contains(&fused_gate_up) {
            let gu = self.set.get(&fused_gate_up).expect("checked");
            let down_name = format!("model.layers.{layer}.mlp.experts.down_proj");
            let down = self
                .set
                .get(&down_name)
                .ok_or_else(|| CheckpointError::Missing { tensor: down_name, hint: String::new() })?;
            let gu_bytes = decode::float_bytes(&gu, &[n, 2 * inter, hidden])?;
            let down_bytes = decode::float_bytes(&down, &[n, hidden, inter])?;
            let per = inter * hidden;
            fn view<'a>(t: &RawTensor<'a>, bytes: &'a [u8], rows: usize, cols: usize) -> WeightView<'a> {
                let data = match t.dtype {
                    safetensors::Dtype::F32 => Stored::F32(bytes),
                    safetensors::Dtype::BF16 => Stored::Bf16(bytes),
                    _ => Stored::F16(bytes),
                };
                WeightView { rows, cols, data }
            }
            let (gs, ds) = (gu_bytes.len() / (2 * n * per), down_bytes.len() / (n * per));
            return Ok((0..n)
                .map(|e| {
                    let base = e * 2 * per * gs;
                    let (gate, up) =
                        (&gu_bytes[base..base + per * gs], &gu_bytes[base + per * gs..base + 2 * per * gs]);
                    let dn = &down_bytes[e * per * ds..(e + 1) * per * ds];
                    [view(&gu, gate, inter, hidden), view(&down, dn, hidden, inter), view(&gu, up, inter, hidden)]
                })
                .collect());
        }
        (0..n)
            .map(|e| {
                Ok([
                    self.expert(layer, e, ExpertProj::W1, inter, hidden)?,
                    self.expert(layer, e, ExpertProj::W2, hidden, inter)?,
                    self.expert(layer, e, ExpertProj::W3, inter, hidden)?,
                ])
            })
            .collect()
    }

    fn expert(
        &self,
        layer: usize,
        e: usize,
        proj: ExpertProj,
        rows: usize,
        cols: usize,
    ) -> Result<WeightView<'_>, CheckpointError> {
        let (off, hf) = match proj {
            ExpertProj::W1 => ("w1", "gate_proj"),
            ExpertProj::W2 => ("w2", "down_proj"),
            ExpertProj::W3 => ("w3", "up_proj"),
        };
        let official = format!("layers.{layer}.ffn.experts.{e}.{off}.weight");
        let stored = match self.naming {
            Naming::Hf => format!("model.layers.{layer}.mlp.experts.{e}.{hf}.weight"),
            other => other.stored(&official),
        };
        let t = self.set.get(&stored).ok_or_else(|| CheckpointError::Missing {
            tensor: official.clone(),
            hint: if stored != official {
                format!(" (looked for `{stored}` and fused `mlp.experts.gate_up_proj`)")
            } else {
                String::new()
            },
        })?;
        let scale = self.scale_of(&stored);
        decode::weight(&t, scale.as_ref(), rows, cols)
    }
}
