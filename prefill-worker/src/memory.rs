//! The prefill worker's KV memory: UCX regions handed to the engine as its page pool
//! and state cache, so a kvstore can write cached pages and window snapshots straight
//! into a prompt's pages and slot (and the UCX sender sends from registered memory).

use engine::{CpuBackend, Engine, EngineOptions, ProvidedKv};
use model_spec::ModelConfig;
use transfer::{Receiver, RegionSpec, RegisteredKv};

use crate::{PrefillConfig, WorkerError};

/// Where peers write into this worker's KV memory.
#[derive(Clone, Debug)]
pub struct KvRegions {
    pub ucx_address: Vec<u8>,
    pub pages: RegionSpec,
    pub rings: RegionSpec,
    pub comp: RegionSpec,
}

pub fn build(cfg: &PrefillConfig, receiver: &Receiver) -> Result<(Engine<CpuBackend>, KvRegions), WorkerError> {
    let model_cfg = ModelConfig::from_file(&cfg.model.join("config.json"))?;
    let layout = model_cfg.kv_layout(cfg.kv_dtype);
    let kv = RegisteredKv::allocate(receiver, &layout, cfg.max_pages, cfg.max_sequences, None)?;
    let regions =
        KvRegions { ucx_address: receiver.address().to_vec(), pages: kv.pages, rings: kv.rings, comp: kv.comp };
    let provided = ProvidedKv { state: kv.state, slot_logits: None };
    let opts = EngineOptions {
        kv_dtype: cfg.kv_dtype,
        max_pages: cfg.max_pages,
        max_sequences: cfg.max_sequences,
        max_chunk_tokens: cfg.token_budget,
    };
    let engine = Engine::load_with_state(&cfg.model, CpuBackend::new(), opts, Some(provided))?;
    Ok((engine, regions))
}
