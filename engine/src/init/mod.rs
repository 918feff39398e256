//! `sluice model init`: a deterministic random checkpoint in the official DeepSeek
//! layout (config.json + model.safetensors + tokenizer.json) for a preset shape. The same seed gives the
//! same bytes on every machine: each tensor draws from its own ChaCha stream keyed by
//! the seed and the tensor's name, so generation order and thread count do not matter.
//! The released shapes (`flash`, `pro`) are written sharded and streamed (`sharded`).

mod manifest;
mod presets;
mod sharded;
mod tokenizer;

use std::path::Path;

use kernels::quant;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use thiserror::Error;

pub use manifest::{Class, Fill, TensorSpec, manifest};
pub use presets::Preset;
pub use sharded::total_bytes;
pub use tokenizer::{BOS, CHAT_TOKENS, EOS, tokenizer_json};

use crate::checkpoint::{CheckpointError, OwnedTensor, write_safetensors};
use crate::config::{ConfigError, ModelConfig, parse_hf};

/// How `model init` stores weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    Bf16,
    /// As DeepSeek ships V4: FP8 attention/shared-expert projections with ue8m0
    /// 128x128 block scales, FP4 routed experts with ue8m0 per-32 scales, BF16 rest.
    Fp8,
}

impl WeightDtype {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" => Some(WeightDtype::F32),
            "bf16" => Some(WeightDtype::Bf16),
            "fp8" => Some(WeightDtype::Fp8),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct InitOptions {
    pub preset: Preset,
    pub seed: u64,
    pub dtype: WeightDtype,
    /// Full-size presets only: keep the first this many layers (all widths unchanged).
    pub layers: Option<usize>,
}

impl InitOptions {
    pub fn new(preset: Preset, seed: u64, dtype: WeightDtype) -> Self {
        InitOptions { preset, seed, dtype, layers: None }
    }
}

#[derive(Debug, Error)]
pub enum InitError {
    #[error("cannot write {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{path} already holds a checkpoint; choose an empty directory")]
    NotEmpty { path: String },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("{0}")]
    Options(String),
}

pub(super) fn rng_for(seed: u64, name: &str) -> ChaCha8Rng {
    let digest = Sha256::digest([seed.to_le_bytes().as_slice(), name.as_bytes()].concat());
    ChaCha8Rng::from_seed(digest.into())
}

fn normal(rng: &mut ChaCha8Rng) -> f32 {
    // Box-Muller; u1 in (0, 1] keeps the log finite.
    let u1 = 1.0 - rng.random::<f64>();
    let u2 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

pub(super) fn values(spec: &TensorSpec, seed: u64) -> Vec<f32> {
    let mut rng = rng_for(seed, &spec.name);
    let n: usize = spec.shape.iter().product();
    match spec.fill {
        Fill::Linear { gain } => {
            let bound = gain * (3.0 / *spec.shape.last().unwrap() as f32).sqrt();
            (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * bound).collect()
        }
        Fill::Norm => (0..n).map(|_| 1.0 + 0.1 * normal(&mut rng)).collect(),
        Fill::Normal { std } => (0..n).map(|_| std * normal(&mut rng)).collect(),
        Fill::Scale => (0..n).map(|_| 0.5 + rng.random::<f32>()).collect(),
        Fill::Tid2eid { experts } => {
            let (rows, k) = (spec.shape[0], spec.shape[1]);
            let mut out = Vec::with_capacity(n);
            for _ in 0..rows {
                let mut pool: Vec<u32> = (0..experts as u32).collect();
                for j in 0..k {
                    let pick = rng.random_range(j..experts);
                    pool.swap(j, pick);
                    out.push(pool[j] as f32);
                }
            }
            out
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| quant::f32_to_bf16(x).to_le_bytes()).collect()
}

/// The stored tensors (one, or a weight and its scale) of one spec.
fn encode(spec: &TensorSpec, seed: u64, dtype: WeightDtype) -> Vec<(String, OwnedTensor)> {
    let v = values(spec, seed);
    let one = |dtype, data| vec![(spec.name.clone(), OwnedTensor { dtype, shape: spec.shape.clone(), data })];
    let scale_name = spec.name.strip_suffix(".weight").map(|b| format!("{b}.scale")).unwrap_or_default();
    match (spec.class, dtype) {
        (Class::Int, _) => one(Dtype::I32, v.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect()),
        (Class::F32, _) | (_, WeightDtype::F32) => one(Dtype::F32, f32_bytes(&v)),
        (_, WeightDtype::Bf16) | (Class::Dense, WeightDtype::Fp8) => one(Dtype::BF16, bf16_bytes(&v)),
        (Class::Fp8, WeightDtype::Fp8) => {
            let (rows, cols) = (spec.shape[0], spec.shape[1]);
            let (q, s) = quant::quantize_fp8_blocks(&v, rows, cols, (128, 128));
            let grid = vec![rows.div_ceil(128), cols.div_ceil(128)];
            vec![
                (spec.name.clone(), OwnedTensor { dtype: Dtype::F8_E4M3, shape: spec.shape.clone(), data: q }),
                (scale_name, OwnedTensor { dtype: Dtype::F8_E8M0, shape: grid, data: s }),
            ]
        }
        (Class::Fp4, WeightDtype::Fp8) => {
            let (rows, cols) = (spec.shape[0], spec.shape[1]);
            let (q, s) = quant::quantize_fp4_groups(&v, rows, cols, 32);
            vec![
                (spec.name.clone(), OwnedTensor { dtype: Dtype::I8, shape: vec![rows, cols / 2], data: q }),
                (scale_name, OwnedTensor { dtype: Dtype::F8_E8M0, shape: vec![rows, cols.div_ceil(32)], data: s }),
            ]
        }
    }
}

pub(super) fn io(path: &Path, e: impl std::fmt::Display) -> InitError {
    InitError::Io { path: path.display().to_string(), reason: e.to_string() }
}

/// Write the checkpoint and return its parsed config. `progress` receives the bytes of
/// tensor data written so far (full-size presets write for a while; small ones report
/// once at the end).
pub fn write_checkpoint_with(
    dir: &Path,
    opts: &InitOptions,
    progress: &std::sync::atomic::AtomicU64,
) -> Result<ModelConfig, InitError> {
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    if ["config.json", "model.safetensors", "model.safetensors.index.json"].iter().any(|f| dir.join(f).exists()) {
        return Err(InitError::NotEmpty { path: dir.display().to_string() });
    }
    if opts.layers.is_some() && !opts.preset.is_full_size() {
        return Err(InitError::Options(format!(
            "--layers applies to the released shapes (flash, pro); {} has a fixed shape",
            opts.preset.name()
        )));
    }
    if opts.preset.is_full_size() && opts.dtype != WeightDtype::Fp8 {
        return Err(InitError::Options(format!(
            "the {} preset is written in the shipped formats (fp8: FP8 projections, FP4 experts); drop --dtype",
            opts.preset.name()
        )));
    }
    let mut conf = if opts.preset.is_full_size() {
        opts.preset.full_config(opts.layers).map_err(InitError::Options)?
    } else {
        opts.preset.config_json()
    };
    let m = conf.as_object_mut().expect("object");
    match opts.dtype {
        WeightDtype::F32 => drop(m.insert("torch_dtype".into(), json!("float32"))),
        WeightDtype::Bf16 => drop(m.insert("torch_dtype".into(), json!("bfloat16"))),
        WeightDtype::Fp8 => {
            m.insert("torch_dtype".into(), json!("bfloat16"));
            m.insert("expert_dtype".into(), json!("fp4"));
            m.insert(
                "quantization_config".into(),
                json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}),
            );
        }
    }
    let cfg = parse_hf(&conf)?;
    if opts.preset.is_full_size() {
        sharded::write_shards(dir, &cfg, opts.seed, progress)?;
    } else {
        let tensors: Vec<(String, OwnedTensor)> =
            manifest(&cfg).par_iter().flat_map_iter(|spec| encode(spec, opts.seed, opts.dtype)).collect();
        write_safetensors(&dir.join("model.safetensors"), &tensors)?;
        let bytes: usize = tensors.iter().map(|(_, t)| t.data.len()).sum();
        progress.fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }
    let tok = tokenizer_json(cfg.vocab_size).map_err(|e| io(&dir.join("tokenizer.json"), e))?;
    std::fs::write(dir.join("tokenizer.json"), tok).map_err(|e| io(&dir.join("tokenizer.json"), e))?;
    let text = serde_json::to_string_pretty(&keys_sorted(&conf)).expect("json") + "\n";
    std::fs::write(dir.join("config.json"), text).map_err(|e| io(&dir.join("config.json"), e))?;
    Ok(cfg)
}

/// Bytes of tensor data a full-size preset writes (for progress bars); `None` for the
/// small presets, which are written at once.
pub fn planned_bytes(opts: &InitOptions) -> Option<u64> {
    if !opts.preset.is_full_size() {
        return None;
    }
    let conf = opts.preset.full_config(opts.layers).ok()?;
    Some(total_bytes(&parse_hf(&conf).ok()?))
}

/// [`write_checkpoint_with`] without progress reporting.
pub fn write_checkpoint(dir: &Path, opts: &InitOptions) -> Result<ModelConfig, InitError> {
    write_checkpoint_with(dir, opts, &std::sync::atomic::AtomicU64::new(0))
}

/// `v` with every object's keys in sorted order. serde_json keeps insertion order when any
/// crate in the build turns on its `preserve_order` feature (llguidance does), so files
/// written from a `Value` would otherwise depend on what else is linked in.
pub(crate) fn keys_sorted(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            Value::Object(keys.into_iter().map(|k| (k.clone(), keys_sorted(&m[k]))).collect())
        }
        Value::Array(a) => Value::Array(a.iter().map(keys_sorted).collect()),
        other => other.clone(),
    }
}
