//! The decode worker's KV memory: UCX regions (so prefill workers can write pages
//! straight into them) handed to the engine as its page pool and state cache.

use engine::{CpuBackend, Engine, EngineOptions, ProvidedKv};
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

pub fn build(cfg: &DecodeConfig, receiver: &Receiver) -> Result<(Engine<CpuBackend>, TargetTemplate), WorkerError> {
    let model_cfg = ModelConfig::from_file(&cfg.model.join("config.json"))?;
    let layout = model_cfg.kv_layout(cfg.kv_dtype);
    let kv = RegisteredKv::allocate(receiver, &layout, cfg.max_pages, cfg.max_sequences, Some(model_cfg.vocab_size))?;
    let logits = kv.logits.clone().expect("asked for a logits region");
    let provided = ProvidedKv { state: kv.state, slot_logits: kv.slot_logits };
    let opts = EngineOptions {
        kv_dtype: cfg.kv_dtype,
        max_pages: cfg.max_pages,
        max_sequences: cfg.max_sequences,
        max_chunk_tokens: 2048,
    };
    let engine = Engine::load_with_state(&cfg.model, CpuBackend::new(), opts, Some(provided))?;
    let geometry = WireGeometry::new(&engine.model.layout, &engine.fingerprint, engine.config().vocab_size);
    let template = TargetTemplate {
        geometry,
        ucx_address: receiver.address().to_vec(),
        pages: kv.pages,
        rings: kv.rings,
        comp: kv.comp,
        logits,
    };
    Ok((engine, template))
}
