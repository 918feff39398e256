//! DeepSeek-V4 model runtime.
//!
//! Module map:
//! - [`config`], [`block_hash`]: re-exported from `model-spec` (no compute needed).
//! - [`checkpoint`]: safetensors reading (sharded, official/HF names, BF16/FP8/FP4).
//! - [`model`]: weights on a `kernels` backend and the forward pass.
//! - [`kv`]: page pool, state-cache slots, sequences and their byte export/import.
//! - [`engine`]: model + KV memory; batched steps of prefill chunks and decode tokens.
//! - [`handoff`]: sequences filled or read by another process (disaggregated serving).
//! - [`staging`]: a sequence's KV bytes copied between engine (e.g. GPU) memory and host buffers.
//! - [`device`]: `--device cpu|cuda:N`, and [`AnyEngine`] for a device chosen at run time.
//! - [`mirror`]: host memory transports use for engines whose KV is on a device.
//! - [`device_kv`]: KV in device memory that transports reach in place (GPU-direct).
//! - [`prefix`]: sequences resumed from a prefix cache (pages + snapshot, or a window rebuild).
//! - [`sampling`]: greedy / temperature / top-k / top-p sampling with logprobs.
//! - [`generate`]: in-process generation loop.
//! - [`init`]: deterministic random checkpoints (`sluice model init`) and presets.
//! - [`inspect`]: layer table and KV bytes per token per pool.
//! - [`memory_plan`]: weights, workspace and the KV that fits on a device.
//! - [`fingerprint`]: computing a model's fingerprint from its checkpoint.
//! - [`warm_up`]: a GPU engine's one-time costs paid before the first request.
#![forbid(unsafe_code)]

pub mod checkpoint;
pub mod device;
pub mod device_kv;
pub mod engine;
pub mod error;
pub mod fingerprint;
pub mod generate;
pub mod handoff;
pub mod init;
pub mod inspect;
pub mod kv;
pub mod memory_plan;
pub mod mirror;
pub mod model;
pub mod prefix;
pub mod sampling;
pub mod staging;
pub mod warm_up;

pub use device::{AnyEngine, Device, DeviceError};
pub use engine::{Engine, EngineOptions, LaunchedDecode, Logits, ProvidedKv, StepInput};
pub use error::EngineError;
#[cfg(feature = "cuda")]
pub use kernels::cuda::CudaBackend;
pub use kernels::{Activations, CpuBackend, EntryDtype};
pub use model::Readout;
pub use model_spec::{Fingerprint, block_hash, config};

/// Set how many threads CPU compute uses (once per process, before any model runs).
pub fn set_compute_threads(n: usize) -> Result<(), String> {
    rayon::ThreadPoolBuilder::new().num_threads(n).build_global().map_err(|e| format!("cannot use {n} threads: {e}"))
}
