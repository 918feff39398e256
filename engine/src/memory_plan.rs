//! The memory plan: what a model takes on a device and how much KV fits in the rest.
//! `sluice model inspect --device cuda` prints it; workers log it at start and refuse to
//! start, saying what to change, when their KV pool does not fit.
//!
//! - **Weights** per pool, as the backend holds them: on a GPU FP4 experts stay packed
//!   (half a byte a weight + one scale byte per 32), FP8 stays FP8 (a byte + one f32
//!   scale per 128×128 block), BF16 2 bytes, F32 matrices 4 (conservatively: those
//!   whose values are all bf16 values take 2), F16 4 (widened), vectors f32, integer
//!   tables stay on the host; on the CPU every matrix is dequantised to bf16 (2 bytes)
//!   or kept f32. Counted from the checkpoint's headers (no tensor data is read), or,
//!   for a bare config, from the tensor list in the shipped formats. MTP tensors are not
//!   loaded and not counted. With `devices` GPUs the routed experts are split across
//!   them (expert parallelism) and everything else is replicated: the figures are per GPU.
//! - **Workspace**: the activations of one step of `rows` rows, from named terms
//!   ([`workspace_bytes`]), plus a fixed allowance for the CUDA context, cuBLAS,
//!   kernels and scratch.
//! - **KV**: bytes per 128-token page and per running sequence's state slot, from the
//!   KV layout of the entry dtype; what is left after a reserve of 5% of the device
//!   goes to pages.

use std::fmt::Write;

use kernels::EntryDtype;
use safetensors::Dtype;
use serde_json::{Value, json};
use thiserror::Error;

use crate::checkpoint::Checkpoint;
use crate::config::{BLOCK_TOKENS, ModelConfig};
use crate::init::{Class, manifest};

/// The H200's memory as `nvidia-smi` reports it (143,771 MiB): the default device size.
pub const H200_BYTES: u64 = 143_771 << 20;
/// CUDA context, cuBLAS workspace, loaded kernels, scratch and pool slack.
pub const FIXED_WORKSPACE: u64 = 1 << 30;
/// Kept free: allocator fragmentation and whatever else shares the device.
pub const RESERVE_FRACTION: f64 = 0.05;

/// Where the weights live, which decides how each stored format is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residence {
    Gpu,
    Cpu,
}

/// Weight bytes per pool, per device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightPools {
    /// Attention projections, compressors, attention norms and sinks.
    pub attention: u64,
    /// The lightning indexer (its projections and compressor).
    pub indexer: u64,
    /// Routed experts (this device's share).
    pub experts: u64,
    /// Shared expert, router, mHC mixing, norms.
    pub dense: u64,
    /// Token embedding and LM head.
    pub embeddings: u64,
}

impl WeightPools {
    pub fn total(&self) -> u64 {
        self.attention + self.indexer + self.experts + self.dense + self.embeddings
    }
}

/// The device(s) a plan is for.
#[derive(Clone, Copy, Debug)]
pub struct Devices {
    pub residence: Residence,
    /// GPUs one worker spans (routed experts split across them).
    pub count: usize,
    /// Bytes of one device.
    pub bytes: u64,
}

/// What one step of the worker processes.
#[derive(Clone, Copy, Debug)]
pub struct StepShape {
    /// Rows of one forward step (prefill token budget, decode batch).
    pub rows: usize,
    /// Longest context a row attends over.
    pub context: usize,
    /// Running sequences (state slots).
    pub sequences: usize,
}

#[derive(Clone, Debug)]
pub struct MemoryPlan {
    pub residence: Residence,
    pub devices: usize,
    /// Bytes of one device.
    pub device_bytes: u64,
    pub weights: WeightPools,
    /// Where the weight figures come from (checkpoint headers, or the config alone).
    pub weights_from: &'static str,
    pub workspace: u64,
    pub reserve: u64,
    pub kv_dtype: EntryDtype,
    pub page_bytes: u64,
    pub state_bytes: u64,
    pub shape: StepShape,
}

#[derive(Debug, Error)]
pub enum PlanError {
    #[error("{0}")]
    DoesNotFit(String),
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

/// Which pool a stored tensor belongs to (official or HF names).
fn pool_of<'a>(p: &'a mut WeightPools, name: &str) -> &'a mut u64 {
    if name.contains("shared_expert") {
        &mut p.dense
    } else if name.contains("experts") {
        &mut p.experts
    } else if name.contains("indexer") {
        &mut p.indexer
    } else if name.contains("embed") || name == "head.weight" || name == "lm_head.weight" {
        &mut p.embeddings
    } else if name.contains("attn.") || name.contains("self_attn.") {
        &mut p.attention
    } else {
        &mut p.dense
    }
}

/// Bytes a stored tensor takes on a device: `scaled` says whether a block-scale tensor
/// sits beside it (FP8 / packed FP4 weights).
fn resident_bytes(dtype: Dtype, shape: &[usize], scaled: bool, at: Residence) -> u64 {
    let n: u64 = shape.iter().map(|&d| d as u64).product();
    if shape.len() != 2 {
        // Vectors and small tables upload as f32; integer tables stay on the host.
        return match dtype {
            Dtype::F32 | Dtype::BF16 | Dtype::F16 => 4 * n,
            _ => 0,
        };
    }
    let (r, c) = (shape[0] as u64, shape[1] as u64);
    match (at, dtype) {
        (Residence::Gpu, Dtype::F8_E4M3) => r * c + 4 * r.div_ceil(128) * c.div_ceil(128),
        (Residence::Gpu, Dtype::I8 | Dtype::U8) if scaled => r * c + r * (2 * c).div_ceil(32),
        (Residence::Gpu, Dtype::F4) if scaled => r * c / 2 + r * c.div_ceil(32),
        (Residence::Gpu, Dtype::BF16) => 2 * n,
        (Residence::Gpu, Dtype::F32 | Dtype::F16) => 4 * n,
        // The CPU dequantises every stored format to bf16 (exact), keeps f32 as it is.
        (Residence::Cpu, Dtype::F8_E4M3 | Dtype::BF16 | Dtype::F16) => 2 * n,
        (Residence::Cpu, Dtype::I8 | Dtype::U8) if scaled => 4 * n,
        (Residence::Cpu, Dtype::F4) if scaled => 2 * n,
        (Residence::Cpu, Dtype::F32) => 4 * n,
        // Integer tables (tid2eid) stay on the host.
        _ => 0,
    }
}

fn is_scale(name: &str) -> bool {
    name.ends_with(".scale") || name.ends_with("_scale_inv") || name.ends_with(".weight_scale")
}

fn is_mtp(name: &str) -> bool {
    name.starts_with("mtp.") || name.starts_with("model.mtp.")
}

/// Weight pools from a checkpoint's headers (no tensor data is read).
pub fn pools_from_checkpoint(ck: &Checkpoint, at: Residence, devices: usize) -> WeightPools {
    let set = ck.files();
    let mut p = WeightPools::default();
    for t in set.tensors() {
        if is_scale(t.name) || is_mtp(t.name) {
            continue;
        }
        let base = t.name.strip_suffix(".weight").unwrap_or(t.name);
        let scaled = [format!("{base}.scale"), format!("{}_scale_inv", t.name)].iter().any(|s| set.contains(s));
        *pool_of(&mut p, t.name) += resident_bytes(t.dtype, t.shape, scaled, at);
    }
    p.experts = p.experts.div_ceil(devices.max(1) as u64);
    p
}

/// Weight pools of a config in the shipped formats (FP8 projections, FP4 experts, BF16
/// dense matrices, F32 small tensors): the estimate when there is no checkpoint.
pub fn pools_from_config(cfg: &ModelConfig, at: Residence, devices: usize) -> WeightPools {
    let mut p = WeightPools::default();
    for spec in manifest(cfg) {
        let (dtype, shape, scaled) = match spec.class {
            Class::Fp8 => (Dtype::F8_E4M3, spec.shape.clone(), true),
            Class::Fp4 => (Dtype::U8, vec![spec.shape[0], spec.shape[1] / 2], true),
            Class::Dense => (Dtype::BF16, spec.shape.clone(), false),
            Class::F32 => (Dtype::F32, spec.shape.clone(), false),
            Class::Int => (Dtype::I32, spec.shape.clone(), false),
        };
        *pool_of(&mut p, &spec.name) += resident_bytes(dtype, &shape, scaled, at);
    }
    p.experts = p.experts.div_ceil(devices.max(1) as u64);
    p
}

/// Activations of one step of `shape.rows` rows: the largest buffers the forward pass
/// holds at once, in f32 (named terms, per row):
/// - residual streams and the next layer's copy: 2 · hc · hidden;
/// - queries, the attention output and the products' split activations: 3 · heads · head_dim;
/// - the low-rank q and the grouped output projection: q_lora + o_groups · o_lora;
/// - the MoE's gathered rows, gate/up and down outputs: top_k · (2 · hidden + 2 · inter);
///
/// plus the indexer's scores (rows × context / 4 candidates) and the logits of the
/// sampled rows (sequences × vocab), and [`FIXED_WORKSPACE`]. A GPU worker also keeps the
/// arena its decode steps record into for CUDA graphs (up to [`GRAPH_ARENA_ROWS`] rows,
/// whose temporaries stay at fixed addresses instead of returning to the pool): twice
/// the same terms for that many rows.
pub fn workspace_bytes(cfg: &ModelConfig, shape: &StepShape) -> u64 {
    // A layer's projections of its input are made at once (`Backend::matmul_many`) and
    // live together: the new entry, both compressors' kv and gate (overlapping: twice
    // the dim), the indexer's weights and query.
    let projections = 5 * cfg.head_dim + 4 * cfg.index_head_dim + cfg.index_heads * (1 + cfg.index_head_dim);
    let per_row = 2 * cfg.hc_mult * cfg.hidden_size
        + 3 * cfg.num_heads * cfg.head_dim
        + cfg.q_lora_rank
        + projections
        + cfg.o_groups * cfg.o_lora_rank
        + cfg.experts_per_token * (2 * cfg.hidden_size + 2 * cfg.moe_intermediate_size);
    let step = |rows: usize, sequences: usize| {
        let rows = rows as u64;
        let scores = rows * (shape.context as u64).div_ceil(4);
        let logits = (sequences.min(rows as usize) as u64) * cfg.vocab_size as u64;
        4 * (rows * per_row as u64 + scores + logits)
    };
    let decode_rows = shape.sequences.min(GRAPH_ARENA_ROWS);
    step(shape.rows, shape.sequences) + 2 * step(decode_rows, decode_rows) + FIXED_WORKSPACE
}

/// Most rows of a decode step recorded for a CUDA graph (`GRAPH_MAX_ROWS` in
/// kernels/src/cuda/step_graph.rs).
pub const GRAPH_ARENA_ROWS: usize = 64;

impl MemoryPlan {
    pub fn new(
        cfg: &ModelConfig,
        (weights, weights_from): (WeightPools, &'static str),
        on: Devices,
        kv_dtype: EntryDtype,
        shape: StepShape,
    ) -> Self {
        let layout = cfg.kv_layout(kv_dtype);
        MemoryPlan {
            residence: on.residence,
            devices: on.count.max(1),
            device_bytes: on.bytes,
            weights,
            weights_from,
            workspace: workspace_bytes(cfg, &shape),
            reserve: (on.bytes as f64 * RESERVE_FRACTION) as u64,
            kv_dtype,
            page_bytes: layout.page_bytes() as u64,
            state_bytes: layout.state_bytes() as u64,
            shape,
        }
    }

    /// The plan for a model directory (checkpoint headers if there are weights, else
    /// its config in the shipped formats).
    pub fn for_dir(
        dir: &std::path::Path,
        cfg: &ModelConfig,
        on: Devices,
        kv_dtype: EntryDtype,
        shape: StepShape,
    ) -> Result<Self, PlanError> {
        let has_weights = dir.join("model.safetensors").exists() || dir.join("model.safetensors.index.json").exists();
        let weights = if has_weights {
            (pools_from_checkpoint(&Checkpoint::open(dir)?, on.residence, on.count), "checkpoint headers")
        } else {
            (pools_from_config(cfg, on.residence, on.count), "config, shipped formats")
        };
        Ok(Self::new(cfg, weights, on, kv_dtype, shape))
    }

    /// Bytes left for KV pages on one device (negative: not even the weights fit).
    pub fn page_room(&self) -> i64 {
        self.device_bytes as i64
            - self.reserve as i64
            - self.weights.total() as i64
            - self.workspace as i64
            - (self.shape.sequences as u64 * self.state_bytes) as i64
    }

    /// Pages (of 128 tokens) that fit on one device.
    pub fn pages_that_fit(&self) -> u64 {
        (self.page_room().max(0) as u64).checked_div(self.page_bytes).unwrap_or(0)
    }

    /// KV tokens that fit over all devices.
    pub fn kv_tokens_that_fit(&self) -> u64 {
        self.pages_that_fit() * BLOCK_TOKENS as u64 * self.devices as u64
    }

    /// Whether a pool of `pages` pages (per device) fits; the error says what to change.
    pub fn check_pages(&self, pages: usize, device: &str) -> Result<(), PlanError> {
        if self.residence == Residence::Cpu || (pages as u64) <= self.pages_that_fit() {
            return Ok(());
        }
        let need = self.weights.total() + self.workspace + self.reserve;
        let mut msg = format!(
            "the model does not fit {device}: weights {:.1} GB + workspace {:.1} GB + reserve {:.1} GB + {} state \
             slots {:.1} GB + {pages} KV pages of {} KB ({:.1} GB) exceed its {:.1} GB.",
            gb(self.weights.total()),
            gb(self.workspace),
            gb(self.reserve),
            self.shape.sequences,
            gb(self.shape.sequences as u64 * self.state_bytes),
            self.page_bytes / 1000,
            gb(pages as u64 * self.page_bytes),
            gb(self.device_bytes)
        );
        if self.page_room() > 0 {
            let _ = write!(msg, " Lower --max-pages to {} or fewer", self.pages_that_fit());
        } else {
            let _ = write!(msg, " Not even the weights and workspace fit ({:.1} GB)", gb(need));
        }
        if self.kv_dtype != EntryDtype::Fp8 {
            let _ = write!(msg, ", use --kv-dtype fp8");
        }
        let _ = write!(msg, ", spread the model over more GPUs, or serve a smaller model.");
        Err(PlanError::DoesNotFit(msg))
    }

    /// One log line.
    pub fn summary(&self) -> String {
        format!(
            "memory plan: weights {:.2} GB (experts {:.2}, attention {:.2}, indexer {:.2}, dense {:.2}, embeddings \
             {:.2}), workspace {:.2} GB for {} rows, {} state slots {:.2} GB, {} KV pages fit ({} tokens, {} B/page, {}) \
             of {:.1} GB",
            gb(self.weights.total()),
            gb(self.weights.experts),
            gb(self.weights.attention),
            gb(self.weights.indexer),
            gb(self.weights.dense),
            gb(self.weights.embeddings),
            gb(self.workspace),
            self.shape.rows,
            self.shape.sequences,
            gb(self.shape.sequences as u64 * self.state_bytes),
            self.pages_that_fit(),
            self.kv_tokens_that_fit(),
            self.page_bytes,
            self.kv_dtype.name(),
            gb(self.device_bytes)
        )
    }

    /// The plan as a table.
    pub fn text(&self) -> String {
        let mut t = String::new();
        let place = match self.residence {
            Residence::Gpu => format!("per GPU of {:.1} GB, {} GPU(s)", gb(self.device_bytes), self.devices),
            Residence::Cpu => format!("host memory of {:.1} GB", gb(self.device_bytes)),
        };
        let _ = writeln!(t, "Memory plan ({place}; weights from {}):", self.weights_from);
        let w = &self.weights;
        for (name, b) in [
            ("experts", w.experts),
            ("attention", w.attention),
            ("indexer", w.indexer),
            ("dense", w.dense),
            ("embeddings", w.embeddings),
        ] {
            let _ = writeln!(t, "  weights {name:<11} {:>9.2} GB", gb(b));
        }
        let _ = writeln!(t, "  weights total       {:>9.2} GB", gb(w.total()));
        let _ = writeln!(
            t,
            "  workspace           {:>9.2} GB  ({} rows a step, context {})",
            gb(self.workspace),
            self.shape.rows,
            self.shape.context
        );
        let _ = writeln!(t, "  reserve             {:>9.2} GB  ({:.0}%)", gb(self.reserve), RESERVE_FRACTION * 100.0);
        let _ = writeln!(
            t,
            "  state slots         {:>9.2} GB  ({} sequences x {} B)",
            gb(self.shape.sequences as u64 * self.state_bytes),
            self.shape.sequences,
            self.state_bytes
        );
        let _ = writeln!(
            t,
            "  KV pages            {:>9} fit  ({} B per 128-token page, {}) = {} tokens",
            self.pages_that_fit(),
            self.page_bytes,
            self.kv_dtype.name(),
            self.kv_tokens_that_fit()
        );
        t
    }

    pub fn json(&self) -> Value {
        let w = &self.weights;
        json!({
            "residence": match self.residence { Residence::Gpu => "gpu", Residence::Cpu => "cpu" },
            "devices": self.devices,
            "device_bytes": self.device_bytes,
            "weights_from": self.weights_from,
            "weights": {"experts": w.experts, "attention": w.attention, "indexer": w.indexer, "dense": w.dense,
                        "embeddings": w.embeddings, "total": w.total()},
            "workspace": self.workspace,
            "reserve": self.reserve,
            "state_bytes_per_sequence": self.state_bytes,
            "sequences": self.shape.sequences,
            "rows_per_step": self.shape.rows,
            "context": self.shape.context,
            "kv_dtype": self.kv_dtype.name(),
            "page_bytes": self.page_bytes,
            "pages_that_fit": self.pages_that_fit(),
            "kv_tokens_that_fit": self.kv_tokens_that_fit(),
        })
    }
}

/// Parse a size like `141GB`, `80GiB`, `143771MiB` or plain bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().map_err(|_| format!("`{s}` is not a size (e.g. 141GB, 80GiB)"))?;
    let mul = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024f64.powi(4),
        other => return Err(format!("unknown size unit `{other}` in `{s}` (use B, KB, MB, GB, KiB, MiB, GiB)")),
    };
    Ok((v * mul) as u64)
}

/// What a worker checks at start: its model on `devices` with `max_pages` pages and
/// `max_sequences` slots split evenly between them, `rows` rows a step; `gpu_memory`
/// overrides each device's size. Logs the plan and refuses, saying what to change, when
/// one device's share does not fit.
#[allow(clippy::too_many_arguments)]
pub fn check_worker(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    devices: &[crate::device::Device],
    gpu_memory: Option<u64>,
    kv_dtype: EntryDtype,
    rows: usize,
    max_pages: usize,
    max_sequences: usize,
) -> Result<MemoryPlan, String> {
    let n = devices.len().max(1);
    let residence = if devices.iter().all(|d| d.is_cuda()) { Residence::Gpu } else { Residence::Cpu };
    let bytes = match gpu_memory {
        Some(b) => b,
        None => {
            let mut least = u64::MAX;
            for &d in devices {
                least = least.min(crate::device::memory_bytes(d).map_err(|e| e.to_string())?);
            }
            least
        }
    };
    let shape =
        StepShape { rows, context: (max_pages / n * BLOCK_TOKENS).min(cfg.max_position), sequences: max_sequences / n };
    let on = Devices { residence, count: n, bytes };
    let plan = MemoryPlan::for_dir(dir, cfg, on, kv_dtype, shape).map_err(|e| e.to_string())?;
    let label = crate::device::devices_label(devices);
    tracing::info!(devices = %label, max_pages, "{}", plan.summary());
    plan.check_pages(max_pages / n, &label).map_err(|e| e.to_string())?;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_hf;
    use crate::init::Preset;

    fn flash() -> ModelConfig {
        parse_hf(&Preset::Flash.config_json()).unwrap()
    }

    fn gpus(count: usize) -> Devices {
        Devices { residence: Residence::Gpu, count, bytes: H200_BYTES }
    }

    fn decode_shape() -> StepShape {
        StepShape { rows: 64, context: 65536, sequences: 64 }
    }

    #[test]
    fn flash_weights_in_shipped_formats_are_about_155_gb_and_need_two_h200s() {
        let p = pools_from_config(&flash(), Residence::Gpu, 1);
        let total = gb(p.total());
        assert!((145.0..165.0).contains(&total), "V4-Flash weights {total:.1} GB");
        assert!(p.experts > 10 * (p.attention + p.indexer), "experts dominate: {p:?}");
        let one = MemoryPlan::new(&flash(), (p, "config"), gpus(1), EntryDtype::Fp8, decode_shape());
        assert_eq!(one.pages_that_fit(), 0, "one H200 cannot hold V4-Flash");
        let err = one.check_pages(1, "cuda:0").unwrap_err().to_string();
        assert!(err.contains("Not even the weights") && err.contains("more GPUs"), "{err}");
        let p2 = pools_from_config(&flash(), Residence::Gpu, 2);
        let two = MemoryPlan::new(&flash(), (p2, "config"), gpus(2), EntryDtype::Fp8, decode_shape());
        assert!(two.kv_tokens_that_fit() > 1_000_000, "two H200s leave room for KV: {}", two.summary());
    }

    #[test]
    fn the_refusal_names_the_page_count_that_fits() {
        let cfg = parse_hf(&Preset::Flash.full_config(Some(20)).unwrap()).unwrap();
        let p = pools_from_config(&cfg, Residence::Gpu, 1);
        let plan = MemoryPlan::new(&cfg, (p, "config"), gpus(1), EntryDtype::Bf16, decode_shape());
        let fit = plan.pages_that_fit() as usize;
        assert!(fit > 0, "{}", plan.summary());
        plan.check_pages(fit, "cuda:0").unwrap();
        let err = plan.check_pages(fit + 1, "cuda:0").unwrap_err().to_string();
        assert!(
            err.contains(&format!("Lower --max-pages to {fit} or fewer")) && err.contains("--kv-dtype fp8"),
            "{err}"
        );
        // fp8 entries are smaller: more pages fit.
        let p8 = MemoryPlan::new(&cfg, (p, "config"), gpus(1), EntryDtype::Fp8, decode_shape());
        assert!(p8.pages_that_fit() > plan.pages_that_fit());
    }

    #[test]
    fn checkpoint_headers_give_the_same_pools_as_the_config() {
        // The tiny preset written in the shipped formats: headers and the config agree.
        let dir = tempfile::tempdir().unwrap();
        let opts = crate::init::InitOptions::new(Preset::Tiny, 1, crate::init::WeightDtype::Fp8);
        let cfg = crate::init::write_checkpoint(dir.path(), &opts).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(pools_from_checkpoint(&ck, Residence::Gpu, 1), pools_from_config(&cfg, Residence::Gpu, 1));
        assert_eq!(pools_from_checkpoint(&ck, Residence::Cpu, 1), pools_from_config(&cfg, Residence::Cpu, 1));
    }

    #[test]
    fn sizes_parse_in_decimal_and_binary_units() {
        assert_eq!(parse_size("141GB").unwrap(), 141_000_000_000);
        assert_eq!(parse_size("80GiB").unwrap(), 80 << 30);
        assert_eq!(parse_size("143771MiB").unwrap(), H200_BYTES);
        assert!(parse_size("12 parsecs").is_err());
    }
}
