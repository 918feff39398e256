//! The prefill worker's KV memory: UCX regions handed to the engine as its page pool
//! and state cache, so a kvstore can write cached pages and window snapshots straight
//! into a prompt's pages and slot (and the UCX sender sends from registered memory).

use engine::EngineOptions;
use engine::device::AnyEngine;
use engine::mirror::HostMirror;
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

/// The engine on `--device` (or `--devices`): on one CPU its KV memory is the
/// registered regions; on GPUs the regions are a host mirror it stages through (out
/// before a send or a put, in after a restore).
pub fn build(cfg: &PrefillConfig, receiver: &Receiver) -> Result<(AnyEngine, KvRegions), WorkerError> {
    let model_cfg = ModelConfig::from_file(&cfg.model.join("config.json"))?;
    let layout = model_cfg.kv_layout(cfg.kv_dtype);
    plan_memory(cfg, &model_cfg)?;
    let kv = RegisteredKv::allocate(receiver, &layout, cfg.max_pages, cfg.max_sequences, None)?;
    let regions = KvRegions {
        ucx_address: receiver.address().to_vec(),
        pages: kv.pages.clone(),
        rings: kv.rings.clone(),
        comp: kv.comp.clone(),
    };
    let opts = EngineOptions {
        kv_dtype: cfg.kv_dtype,
        max_pages: cfg.max_pages,
        max_sequences: cfg.max_sequences,
        max_chunk_tokens: cfg.token_budget,
    };
    let host = HostMirror { state: kv.state, slot_logits: None };
    let engine = AnyEngine::load_for_transport(&cfg.model, &cfg.devices(), opts, host)
        .map_err(|e| WorkerError::Config(e.to_string()))?;
    Ok((engine, regions))
}

/// Log the memory plan for this worker's settings and refuse, saying what to change,
/// when its model, workspace and KV pool do not fit the devices.
fn plan_memory(cfg: &PrefillConfig, model_cfg: &ModelConfig) -> Result<(), WorkerError> {
    engine::memory_plan::check_worker(
        &cfg.model,
        model_cfg,
        &cfg.devices(),
        cfg.gpu_memory,
        cfg.kv_dtype,
        cfg.token_budget,
        cfg.max_pages,
        cfg.max_sequences,
    )
    .map(drop)
    .map_err(WorkerError::Config)
}
