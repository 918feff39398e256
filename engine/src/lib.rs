//! DeepSeek-V4 model runtime.
//!
//! Module map:
//! - [`config`]: the model description, parsed from HF or reference config files.
//! - [`checkpoint`]: safetensors reading (sharded, official/HF names, BF16/FP8/FP4).
//! - [`model`]: weights on a `kernels` backend and the forward pass.
//! - [`kv`]: page pool, state-cache slots, sequences and their byte export/import.
//! - [`engine`]: model + KV memory; batched steps of prefill chunks and decode tokens.
//! - [`sampling`]: greedy / temperature / top-k / top-p sampling with logprobs.
//! - [`generate`]: in-process generation loop.
//! - [`init`]: deterministic random checkpoints (`sluice model init`) and presets.
//! - [`inspect`]: layer table and KV bytes per token per pool.
//! - [`fingerprint`], [`block_hash`]: identity of a model and of token prefixes.
#![forbid(unsafe_code)]

pub mod block_hash;
pub mod checkpoint;
pub mod config;
pub mod engine;
pub mod error;
pub mod fingerprint;
pub mod generate;
pub mod init;
pub mod inspect;
pub mod kv;
pub mod model;
pub mod sampling;

pub use engine::{Engine, EngineOptions, Logits, StepInput};
pub use error::EngineError;
pub use kernels::{CpuBackend, EntryDtype};
