//! Tensor operations for the DeepSeek-V4 forward pass.
//!
//! Module map:
//! - [`activations`]: the precision GPU backends hand activations to their bf16
//!   tensor-core products in (bf16, the reference model's; or split hi + lo parts).
//! - [`backend`]: the [`Backend`] trait the engine's forward pass is written against,
//!   and the weight/parameter bundles its fused ops take.
//! - [`attention_io`]: the attention sub-block's raw query and output projection as
//!   backends take them (a GPU folds the query's prep and keeps the output in bf16).
//! - [`hc_params`]: the mHC sites' parameters and a step's streams while they are still
//!   copies of the embedding.
//! - [`readout`]: a step's greedy read-out on the host (the sampler's argmax and
//!   log-probability) and a downloaded buffer cut into parts.
//! - [`cpu`]: the CPU backend (GEMMs through the `gemm` crate, rayon across cores).
//! - `cuda` (feature `cuda`): the CUDA backend (NVRTC-compiled kernels, cuBLAS).
//! - [`sharded`]: one backend over several devices (data-parallel attention, expert-
//!   parallel MoE) made of single-device backends and a [`sharded::Collective`].
//! - [`reference`]: slow, obviously-correct versions of every op, computed from whole
//!   token histories; every backend is tested against them by one shared test body.
//! - `kv_layout`: byte geometry of pages and state-cache slots (from `model-spec`).
//! - [`plan`]: which rows of a batch belong to which sequence.
//! - [`rope`]: rotary frequency tables (plain and YaRN) and the pair rotation.
//! - [`quant`]: stored number formats (BF16, FP8 e4m3, FP4 e2m1, ue8m0 scales).
//! - [`stored`]: typed views of weights as checkpoints store them (what backends load).
//! - [`kv_entry`]: one KV entry as stored bytes in each entry dtype (the fp8 record
//!   codec every backend and test shares).
//! - [`kv_checksum`]: the checksum KV writers and readers compare (computable where the
//!   bytes are, GPU memory included).
//! - [`mapped`]: read-only memory maps of weight files.

pub mod activations;
pub mod attention_io;
pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod hc_params;
pub mod kv_checksum;
pub mod kv_entry;
pub mod mapped;
pub mod plan;
pub mod quant;
pub mod readout;
pub mod reference;
pub mod rope;
pub mod sharded;
pub mod stored;

pub use activations::Activations;
pub use backend::{Backend, GraphHealth, HostMatrix, KvState};
pub use cpu::CpuBackend;
/// KV geometry is shared with services that never compute (transfer, kvstore, router).
pub use model_spec::layout as kv_layout;
pub use model_spec::{AttnKind, Branch, EntryDtype, EntryFormat, KvLayout, LayerSpec};
pub use plan::{BatchPlan, SeqSlice};
pub use rope::RopeTable;
pub use stored::WeightView;
