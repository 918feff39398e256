//! Writing full-size random checkpoints (`model init --preset flash|pro`) the way
//! DeepSeek ships them: official tensor names, FP8 e4m3 projections with ue8m0 128×128
//! block scales, FP4 e2m1 routed experts with ue8m0 per-32 scales, BF16 dense matrices,
//! F32 small tensors, one shard per layer plus one for the embedding, head and final
//! norms, and `model.safetensors.index.json`.
//!
//! Streamed and parallel: each shard's safetensors header is computed from the shapes
//! up front, then its tensors are generated and written piece by piece through a
//! bounded buffer, shards on all cores; nothing near a whole tensor of the large ones
//! is ever in memory. Quantised codes are drawn directly in their format (quantising
//! f32 values would take hours at this size): every piece of a tensor comes from its own
//! ChaCha stream keyed by the seed, the tensor's name and the piece's index, so the
//! bytes do not depend on thread count or order.
//!
//! Value distributions (what the random model computes with): FP8 codes are an
//! Irwin–Hall sum of four uniform bytes (near-normal, ±3.5σ, σ = 32 code units) with
//! the block's scale putting σ at the tensor's target standard deviation; FP4 nibbles
//! are uniform over the 16 codes (σ ≈ 2.93 code units) with per-32 scales likewise (±1
//! in the exponent, at random); BF16 matrices are the same Irwin–Hall values; the
//! target standard deviation is `manifest`'s (`gain / sqrt(fan_in)` for projections).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use kernels::quant;
use rand::{Rng, RngCore};
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::json;

use super::manifest::{Class, Fill, TensorSpec, manifest};
use super::{InitError, io, rng_for, values};
use crate::config::ModelConfig;

/// Bytes generated per RNG stream (and written per buffer flush).
const PIECE: usize = 4 << 20;

/// Irwin–Hall sum of four uniform bytes, centred: range ±510, standard deviation ≈ 147.8.
const IH_SIGMA: f32 = 147.8;
/// Target spread of FP8 codes in code units (the block scale maps it to the weight's).
const FP8_SIGMA: f32 = 32.0;
/// Standard deviation of a uniform E2M1 code, in code units.
const FP4_SIGMA: f32 = 2.926;

/// One stored tensor of a shard: name, dtype, shape, how to make its bytes.
struct Stored {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: usize,
    make: Make,
}

#[derive(Clone)]
enum Make {
    /// FP8 codes: Irwin–Hall values through `table` (sum + 510 → code).
    Fp8Codes,
    /// Scale bytes around `base` (±1 at random).
    Scales { base: u8 },
    /// Uniform random bytes (packed FP4 nibbles).
    Random,
    /// BF16 Irwin–Hall values times `std / IH_SIGMA`.
    Bf16 { std: f32 },
    /// Small tensors: the same values `model init` draws for small presets.
    Small(TensorSpec),
}

/// Standard deviation `manifest` aims a matrix at.
fn target_std(spec: &TensorSpec) -> f32 {
    match spec.fill {
        Fill::Linear { gain } => gain / (*spec.shape.last().expect("2-D") as f32).sqrt(),
        _ => 1.0,
    }
}

/// The ue8m0 byte of the power of two nearest `x`.
fn ue8m0_near(x: f32) -> u8 {
    (x.log2().round() as i32 + 127).clamp(1, 254) as u8
}

/// The stored tensors of one spec in the shipped formats.
fn stored(spec: &TensorSpec) -> Vec<Stored> {
    let n: usize = spec.shape.iter().product();
    let scale_name = || spec.name.strip_suffix(".weight").map(|b| format!("{b}.scale")).unwrap_or_default();
    let one =
        |dtype, bytes, make| vec![Stored { name: spec.name.clone(), dtype, shape: spec.shape.clone(), bytes, make }];
    match spec.class {
        Class::Fp8 => {
            let (r, c) = (spec.shape[0], spec.shape[1]);
            let grid = vec![r.div_ceil(128), c.div_ceil(128)];
            let base = ue8m0_near(target_std(spec) / FP8_SIGMA);
            vec![
                Stored {
                    name: spec.name.clone(),
                    dtype: Dtype::F8_E4M3,
                    shape: spec.shape.clone(),
                    bytes: n,
                    make: Make::Fp8Codes,
                },
                Stored {
                    name: scale_name(),
                    dtype: Dtype::F8_E8M0,
                    bytes: grid[0] * grid[1],
                    shape: grid,
                    make: Make::Scales { base },
                },
            ]
        }
        Class::Fp4 => {
            let (r, c) = (spec.shape[0], spec.shape[1]);
            let base = ue8m0_near(target_std(spec) / FP4_SIGMA);
            vec![
                Stored {
                    name: spec.name.clone(),
                    dtype: Dtype::I8,
                    shape: vec![r, c / 2],
                    bytes: n / 2,
                    make: Make::Random,
                },
                Stored {
                    name: scale_name(),
                    dtype: Dtype::F8_E8M0,
                    shape: vec![r, c.div_ceil(32)],
                    bytes: r * c.div_ceil(32),
                    make: Make::Scales { base },
                },
            ]
        }
        Class::Dense => one(Dtype::BF16, 2 * n, Make::Bf16 { std: target_std(spec) }),
        Class::F32 => one(Dtype::F32, 4 * n, Make::Small(spec.clone())),
        Class::Int => one(Dtype::I32, 4 * n, Make::Small(spec.clone())),
    }
}

/// `sum of four bytes` (0..=1020) → FP8 code of (sum − 510)·σ/147.8.
fn fp8_table() -> Vec<u8> {
    (0..=1020).map(|s| quant::f32_to_fp8_e4m3((s as f32 - 510.0) * FP8_SIGMA / IH_SIGMA)).collect()
}

/// Write the bytes of `t` into `out` (a writer), piece by piece.
fn write_tensor(out: &mut impl Write, t: &Stored, seed: u64, table: &[u8], done: &AtomicU64) -> std::io::Result<()> {
    if let Make::Small(spec) = &t.make {
        let v = values(spec, seed);
        let bytes: Vec<u8> = match t.dtype {
            Dtype::I32 => v.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
            _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        out.write_all(&bytes)?;
        done.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        return Ok(());
    }
    let mut buf = vec![0u8; PIECE];
    for (i, at) in (0..t.bytes).step_by(PIECE).enumerate() {
        let len = PIECE.min(t.bytes - at);
        let piece = &mut buf[..len];
        let mut rng = rng_for(seed, &format!("{}#{i}", t.name));
        match &t.make {
            Make::Random => rng.fill_bytes(piece),
            Make::Fp8Codes => {
                for b in piece.iter_mut() {
                    let r = rng.next_u32();
                    let s = (r & 0xff) + ((r >> 8) & 0xff) + ((r >> 16) & 0xff) + (r >> 24);
                    *b = table[s as usize];
                }
            }
            Make::Scales { base } => {
                for b in piece.iter_mut() {
                    *b = (*base as i32 + rng.random_range(-1..=1)).clamp(1, 254) as u8;
                }
            }
            Make::Bf16 { std } => {
                for pair in piece.chunks_exact_mut(2) {
                    let r = rng.next_u32();
                    let s = (r & 0xff) + ((r >> 8) & 0xff) + ((r >> 16) & 0xff) + (r >> 24);
                    let v = (s as f32 - 510.0) * std / IH_SIGMA;
                    pair.copy_from_slice(&quant::f32_to_bf16(v).to_le_bytes());
                }
            }
            Make::Small(_) => unreachable!("written above"),
        }
        out.write_all(piece)?;
        done.fetch_add(len as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// The safetensors header of `tensors` (in order), padded to 8 bytes as the format
/// requires.
fn header(tensors: &[Stored]) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut at = 0usize;
    for t in tensors {
        let dtype = serde_json::to_value(t.dtype).expect("dtype serialises");
        map.insert(t.name.clone(), json!({"dtype": dtype, "shape": t.shape, "data_offsets": [at, at + t.bytes]}));
        at += t.bytes;
    }
    let mut text = serde_json::to_vec(&serde_json::Value::Object(map)).expect("json");
    while !(text.len() + 8).is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out
}

/// One shard: its file name and tensors in write order.
struct Shard {
    file: String,
    tensors: Vec<Stored>,
}

/// The shards of a config: the embedding, head and final norms first, then one a layer.
fn shards(cfg: &ModelConfig) -> Vec<Shard> {
    let mut by_shard: BTreeMap<usize, Vec<Stored>> = BTreeMap::new();
    for spec in manifest(cfg) {
        let shard = spec
            .name
            .strip_prefix("layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|l| l.parse::<usize>().ok())
            .map(|l| l + 1)
            .unwrap_or(0);
        by_shard.entry(shard).or_default().extend(stored(&spec));
    }
    let total = by_shard.len();
    by_shard
        .into_values()
        .enumerate()
        .map(|(i, tensors)| Shard { file: format!("model-{:05}-of-{total:05}.safetensors", i + 1), tensors })
        .collect()
}

/// Bytes the checkpoint of `cfg` takes (all shards' data).
pub fn total_bytes(cfg: &ModelConfig) -> u64 {
    shards(cfg).iter().flat_map(|s| &s.tensors).map(|t| t.bytes as u64).sum()
}

fn write_shard(dir: &Path, shard: &Shard, seed: u64, table: &[u8], done: &AtomicU64) -> Result<(), InitError> {
    let path = dir.join(&shard.file);
    let partial: PathBuf = dir.join(format!("{}.partial", shard.file));
    let file = File::create(&partial).map_err(|e| io(&partial, e))?;
    let mut w = BufWriter::with_capacity(PIECE, file);
    w.write_all(&header(&shard.tensors)).map_err(|e| io(&partial, e))?;
    for t in &shard.tensors {
        write_tensor(&mut w, t, seed, table, done).map_err(|e| io(&partial, e))?;
    }
    w.into_inner().map_err(|e| io(&partial, e.error()))?.sync_all().map_err(|e| io(&partial, e))?;
    std::fs::rename(&partial, &path).map_err(|e| io(&path, e))
}

/// Write every shard of `cfg` and the index into `dir` (which exists and is empty of
/// checkpoints), reporting bytes written to `done` as they go.
pub fn write_shards(dir: &Path, cfg: &ModelConfig, seed: u64, done: &AtomicU64) -> Result<u64, InitError> {
    let shards = shards(cfg);
    let table = fp8_table();
    shards.par_iter().try_for_each(|s| write_shard(dir, s, seed, &table, done))?;
    let total: u64 = shards.iter().flat_map(|s| &s.tensors).map(|t| t.bytes as u64).sum();
    let weight_map: serde_json::Map<String, serde_json::Value> =
        shards.iter().flat_map(|s| s.tensors.iter().map(move |t| (t.name.clone(), json!(s.file)))).collect();
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let path = dir.join("model.safetensors.index.json");
    std::fs::write(&path, serde_json::to_string_pretty(&super::keys_sorted(&index)).expect("json") + "\n")
        .map_err(|e| io(&path, e))?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::init::Preset;

    /// The tiny preset's config in the shipped formats, written by the sharded writer
    /// (the full-size presets' path) into `dir`.
    fn tiny_sharded(dir: &Path, seed: u64) -> ModelConfig {
        let mut conf = Preset::Tiny.config_json();
        conf.as_object_mut().unwrap().insert(
            "quantization_config".into(),
            json!({"fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}),
        );
        let cfg = crate::config::parse_hf(&conf).unwrap();
        write_shards(dir, &cfg, seed, &AtomicU64::new(0)).unwrap();
        std::fs::write(dir.join("config.json"), conf.to_string()).unwrap();
        cfg
    }

    fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
            .collect()
    }

    #[test]
    fn shards_load_through_the_checkpoint_reader_and_run() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny_sharded(dir.path(), 3);
        // One shard for the top-level tensors and one per layer, all in the index.
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("model.safetensors.index.json")).unwrap()).unwrap();
        let map = index["weight_map"].as_object().unwrap();
        let shard_files: std::collections::BTreeSet<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
        assert_eq!(shard_files.len(), cfg.num_layers + 1);
        let data: u64 = shard_files
            .iter()
            .map(|f| {
                let bytes = std::fs::read(dir.path().join(f)).unwrap();
                let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
                bytes.len() as u64 - 8 - n
            })
            .sum();
        assert_eq!(index["metadata"]["total_size"].as_u64().unwrap(), data, "total_size is the shards' data");
        assert_eq!(total_bytes(&cfg), data);
        // Every tensor the loader needs is there with the expected dtype, shape and
        // scale grid; the model loads and computes finite logits.
        let ck = Checkpoint::open(dir.path()).unwrap();
        let e = crate::Engine::load(dir.path(), kernels::CpuBackend::new(), crate::EngineOptions::default()).unwrap();
        assert_eq!(ck.naming(), crate::checkpoint::Naming::Official);
        let mut e = e;
        let mut seq = e.open_sequence().unwrap();
        let logits = e.prefill(&mut seq, &[1, 2, 3, 4, 5], crate::Logits::Last).unwrap();
        assert!(!logits.is_empty() && logits.iter().all(|v| v.is_finite()), "logits of the random model are finite");
        // Experts are FP4 with per-32 scales, projections FP8 with block scales.
        let ex = ck.weight("layers.1.ffn.experts.0.w1.weight", cfg.moe_intermediate_size, cfg.hidden_size).unwrap();
        assert_eq!(ex.format(), "fp4");
        let wq = ck.weight("layers.1.attn.wq_a.weight", cfg.q_lora_rank, cfg.hidden_size).unwrap();
        assert_eq!(wq.format(), "fp8");
    }

    #[test]
    fn bytes_depend_on_the_seed_only() {
        let (a, b, c) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        tiny_sharded(a.path(), 5);
        // One thread against the default pool: same bytes.
        rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(|| tiny_sharded(b.path(), 5));
        tiny_sharded(c.path(), 6);
        assert_eq!(files(a.path()), files(b.path()));
        assert_ne!(files(a.path()), files(c.path()));
    }

    #[test]
    fn fp8_table_is_centred_and_within_range() {
        let t = fp8_table();
        assert_eq!(t[510], 0, "zero sum is code 0");
        let lo = quant::fp8_e4m3_to_f32(t[0]);
        let hi = quant::fp8_e4m3_to_f32(t[1020]);
        assert_eq!(lo, -hi);
        assert!(hi > 100.0 && hi < 448.0, "±3.45σ of 32 = {hi}");
    }

    #[test]
    fn irwin_hall_of_four_bytes_has_the_assumed_spread() {
        // Var of one uniform byte is (256² − 1)/12; four of them sum the variances.
        let sigma = (4.0 * (256.0f64 * 256.0 - 1.0) / 12.0).sqrt();
        assert!((sigma as f32 - IH_SIGMA).abs() < 0.1, "{sigma}");
    }
}
