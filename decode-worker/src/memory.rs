//! The decode worker's KV memory: UCX regions (so prefill workers can write pages
//! straight into them) handed to the engine as its page pool and state cache.

use engine::kv::KvCache;
use engine::{CpuBackend, Engine, EngineOptions, ProvidedKv};
use kernels::{Backend, EntryDtype, KvState};
use model_spec::ModelConfig;
use transfer::{Receiver, RegionSpec, WireGeometry};

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
    let (pe, re, ce) = KvCache::<CpuBackend>::region_elems(&layout, cfg.max_pages, cfg.max_sequences);
    let le = cfg.max_sequences * model_cfg.vocab_size;
    let size = cfg.kv_dtype.size();
    let pages = receiver.allocate(pe * size)?;
    let rings = receiver.allocate(re * size)?;
    let comp = receiver.allocate(ce * 4)?;
    let logits = receiver.allocate(le * 4)?;
    let specs = (pages.spec.clone(), rings.spec.clone(), comp.spec.clone(), logits.spec.clone());
    let b = CpuBackend::new();
    let adopt = |r: transfer::RegisteredRegion, elems, dtype| {
        b.kv_adopt(Box::new(r.region), elems, dtype).map_err(WorkerError::Memory)
    };
    let provided = ProvidedKv {
        state: KvState {
            pages: adopt(pages, pe, cfg.kv_dtype)?,
            rings: adopt(rings, re, cfg.kv_dtype)?,
            comp: adopt(comp, ce, EntryDtype::F32)?,
        },
        slot_logits: Some(adopt(logits, le, EntryDtype::F32)?),
    };
    let opts = EngineOptions {
        kv_dtype: cfg.kv_dtype,
        max_pages: cfg.max_pages,
        max_sequences: cfg.max_sequences,
        max_chunk_tokens: 2048,
    };
    let engine = Engine::load_with_state(&cfg.model, b, opts, Some(provided))?;
    let geometry = WireGeometry::new(&engine.model.layout, &engine.fingerprint, engine.config().vocab_size);
    let template = TargetTemplate {
        geometry,
        ucx_address: receiver.address().to_vec(),
        pages: specs.0,
        rings: specs.1,
        comp: specs.2,
        logits: specs.3,
    };
    Ok((engine, template))
}
