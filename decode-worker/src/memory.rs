//! The decode worker's KV memory: UCX regions (so prefill workers can write pages
//! straight into them) — the engine's own memory on the CPU, a host mirror the engine
//! copies in from after each commit when it runs on a GPU.

use engine::device::{AnyEngine, Device};
use engine::mirror::HostMirror;
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

/// The engine on `--device`, with its KV where peers can write it.
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
    let engine = match cfg.device {
        Device::Cpu => {
            let provided = ProvidedKv { state: kv.state, slot_logits: kv.slot_logits };
            AnyEngine::Cpu(Engine::load_with_state(&cfg.model, CpuBackend::new(), opts, Some(provided))?)
        }
        device => {
            let mut engine =
                AnyEngine::load(&cfg.model, device, opts).map_err(|e| WorkerError::Config(e.to_string()))?;
            let mirror = HostMirror { state: kv.state, slot_logits: kv.slot_logits };
            engine::with_engine!(&mut engine, e => e.set_mirror(mirror))?;
            let pinned = engine::with_engine!(&engine, e => e.mirror_pinned());
            tracing::info!(
                %device,
                pinned,
                "KV lives in GPU memory; prefill workers write into a registered host mirror, copied in at commit \
                 (UCX does not register CUDA memory here), pinned for the device copies unless pinned=false"
            );
            engine
        }
    };
    let fingerprint = engine::with_engine!(&engine, e => e.fingerprint.clone());
    let geometry = WireGeometry::new(&layout, &fingerprint, model_cfg.vocab_size);
    let template = TargetTemplate { geometry, ucx_address: receiver.address().to_vec(), pages, rings, comp, logits };
    Ok((engine, template))
}

/// Log the memory plan for this worker's settings and refuse, saying what to change,
/// when its model, workspace and KV pool do not fit the device.
fn plan_memory(cfg: &DecodeConfig, model_cfg: &ModelConfig) -> Result<(), WorkerError> {
    use engine::memory_plan::{Devices, MemoryPlan, Residence, StepShape};
    let residence = if cfg.device.is_cuda() { Residence::Gpu } else { Residence::Cpu };
    let bytes = match cfg.gpu_memory {
        Some(b) => b,
        None => engine::device::memory_bytes(cfg.device).map_err(|e| WorkerError::Config(e.to_string()))?,
    };
    let shape = StepShape {
        rows: cfg.max_batch,
        context: (cfg.max_pages * 128).min(model_cfg.max_position),
        sequences: cfg.max_sequences,
    };
    let on = Devices { residence, count: 1, bytes };
    let plan = MemoryPlan::for_dir(&cfg.model, model_cfg, on, cfg.kv_dtype, shape)
        .map_err(|e| WorkerError::Config(e.to_string()))?;
    tracing::info!(device = %cfg.device, max_pages = cfg.max_pages, "{}", plan.summary());
    plan.check_pages(cfg.max_pages, &cfg.device.to_string()).map_err(|e| WorkerError::Config(e.to_string()))
}
