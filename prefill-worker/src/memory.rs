//! The prefill worker's KV memory: UCX regions handed to the engine as its page pool
//! and state cache, so a kvstore can write cached pages and window snapshots straight
//! into a prompt's pages and slot (and the UCX sender sends from registered memory).

use engine::device::{AnyEngine, Device};
use engine::mirror::HostMirror;
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

/// The engine on `--device`: on the CPU its KV memory is the registered regions; on a
/// GPU the regions are a host mirror it stages through (out before a send or a put, in
/// after a restore).
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
    let engine = match cfg.device {
        Device::Cpu => {
            let provided = ProvidedKv { state: kv.state, slot_logits: None };
            AnyEngine::Cpu(Engine::load_with_state(&cfg.model, CpuBackend::new(), opts, Some(provided))?)
        }
        device => {
            let mut engine =
                AnyEngine::load(&cfg.model, device, opts).map_err(|e| WorkerError::Config(e.to_string()))?;
            engine::with_engine!(&mut engine, e => e.set_mirror(HostMirror { state: kv.state, slot_logits: None }))?;
            let pinned = engine::with_engine!(&engine, e => e.mirror_pinned());
            tracing::info!(
                %device,
                pinned,
                "KV lives in GPU memory; transfers go through a registered host mirror (UCX does not register CUDA \
                 memory here), pinned for the device copies unless pinned=false"
            );
            engine
        }
    };
    Ok((engine, regions))
}

/// Log the memory plan for this worker's settings and refuse, saying what to change,
/// when its model, workspace and KV pool do not fit the device.
fn plan_memory(cfg: &PrefillConfig, model_cfg: &ModelConfig) -> Result<(), WorkerError> {
    use engine::memory_plan::{Devices, MemoryPlan, Residence, StepShape};
    let residence = if cfg.device.is_cuda() { Residence::Gpu } else { Residence::Cpu };
    let bytes = match cfg.gpu_memory {
        Some(b) => b,
        None => engine::device::memory_bytes(cfg.device).map_err(|e| WorkerError::Config(e.to_string()))?,
    };
    let shape = StepShape {
        rows: cfg.token_budget,
        context: (cfg.max_pages * 128).min(model_cfg.max_position),
        sequences: cfg.max_sequences,
    };
    let on = Devices { residence, count: 1, bytes };
    let plan = MemoryPlan::for_dir(&cfg.model, model_cfg, on, cfg.kv_dtype, shape)
        .map_err(|e| WorkerError::Config(e.to_string()))?;
    tracing::info!(device = %cfg.device, max_pages = cfg.max_pages, "{}", plan.summary());
    plan.check_pages(cfg.max_pages, &cfg.device.to_string()).map_err(|e| WorkerError::Config(e.to_string()))
}
