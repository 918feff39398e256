//! Tensor operations for the DeepSeek-V4 forward pass.
//!
//! Module map:
//! - [`backend`]: the [`Backend`] trait the engine's forward pass is written against,
//!   and the weight/parameter bundles its fused ops take.
//! - [`cpu`]: the CPU backend (GEMMs through the `gemm` crate, rayon across cores).
//! - [`reference`]: slow, obviously-correct versions of every op, computed from whole
//!   token histories; every backend is tested against them by one shared test body.
//! - [`kv_layout`]: byte geometry of pages (compressed entries) and state-cache slots.
//! - [`plan`]: which rows of a batch belong to which sequence.
//! - [`rope`]: rotary frequency tables (plain and YaRN) and the pair rotation.
//! - [`quant`]: stored number formats (BF16, FP8 e4m3, FP4 e2m1, ue8m0 scales).
//! - [`mapped`]: read-only memory maps of weight files.

pub mod backend;
pub mod cpu;
pub mod kv_layout;
pub mod mapped;
pub mod plan;
pub mod quant;
pub mod reference;
pub mod rope;

pub use backend::{Backend, HostMatrix, KvState};
pub use cpu::CpuBackend;
pub use kv_layout::{AttnKind, Branch, KvLayout, LayerSpec};
pub use plan::{BatchPlan, SeqSlice};
pub use rope::RopeTable;

/// How KV entries (pages and window rings) are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EntryDtype {
    F32,
    Bf16,
}

impl EntryDtype {
    pub fn size(self) -> usize {
        match self {
            EntryDtype::F32 => 4,
            EntryDtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EntryDtype::F32 => "f32",
            EntryDtype::Bf16 => "bf16",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" | "float32" => Some(EntryDtype::F32),
            "bf16" | "bfloat16" => Some(EntryDtype::Bf16),
            _ => None,
        }
    }
}
