//! The decode worker's KV memory: UCX regions (so prefill workers can write pages
//! straight into them) — the engine's own memory on the CPU, a host mirror the engine
//! copies in from after each commit when it runs on a GPU.

use engine::EngineOptions;
use engine::device::AnyEngine;
use engine::mirror::HostMirror;
use model_spec::ModelConfig;
use transfer::{Receiver, RegionSpec, RegisteredKv, WireGeometry};

use crate::{DecodeConfig, WorkerError};

/// What a reservation's target is made of, apart from its page ids and slot.
#[derive(Clone)]
pub struct TargetTemplate {
    pub geometry: WireGeometry,
    pub ucx_address: Vec<u8>,
    pub pages: RegionSpec,
    pub rings: RegionSpec,
    pub comp: RegionSpec,
    pub logits: RegionSpec,
}

/// The engine on `--device` (or `--devices`), with its KV where peers can write it.
pub fn build(cfg: &DecodeConfig, receiver: &Receiver) -> Result<(AnyEngine, TargetTemplate), WorkerError> {
    let model_cfg = ModelConfig::from_file(&cfg.model.join("config.json"))?;
    let layout = model_cfg.kv_layout(cfg.kv_dtype);
    plan_memory(cfg, &model_cfg)?;
    let kv = RegisteredKv::allocate(receiver, &layout, cfg.max_pages, cfg.max_sequences, Some(model_cfg.vocab_size))?;
    let logits = kv.logits.clone().expect("asked for a logits region");
    let (pages, rings, comp) = (kv.pages.clone(), kv.rings.clone(), kv.comp.clone());
    let opts = EngineOptions {
        kv_dtype: cfg.kv_dtype,
        max_pages: cfg.max_pages,
        max_sequences: cfg.max_sequences,
        max_chunk_tokens: 2048,
    };
    let host = HostMirror { state: kv.state, slot_logits: kv.slot_logits };
    let engine = AnyEngine::load_for_transport(&cfg.model, &cfg.devices(), opts, host)
        .map_err(|e| WorkerError::Config(e.to_string()))?;
    let fingerprint = engine::with_engine!(&engine, e => e.fingerprint.clone());
    let geometry = WireGeometry::new(&layout, &fingerprint, model_cfg.vocab_size);
    let template = TargetTemplate { geometry, ucx_address: receiver.address().to_vec(), pages, rings, comp, logits };
    Ok((engine, template))
}

/// Log the memory plan for this worker's settings and refuse, saying what to change,
/// when its model, workspace and KV pool do not fit the devices.
fn plan_memory(cfg: &DecodeConfig, model_cfg: &ModelConfig) -> Result<(), WorkerError> {
    engine::memory_plan::check_worker(
        &cfg.model,
        model_cfg,
        &cfg.devices(),
        cfg.gpu_memory,
        cfg.kv_dtype,
        cfg.max_batch,
        cfg.max_pages,
        cfg.max_sequences,
    )
    .map(drop)
    .map_err(WorkerError::Config)
}
