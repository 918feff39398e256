//! The prefill worker's KV memory and how its peers reach it.
//!
//! - CPU engine: the engine's KV memory is UCX-registered host memory; the kvstore
//!   writes cached pages and window snapshots straight into a prompt's pages and slot,
//!   and sends read from it.
//! - GPU engine: sends to decode workers go straight from device memory when the
//!   loaded libucx has CUDA transports (`--gpu-direct`). kvstore traffic goes through a
//!   registered host mirror (restores land there and are copied in; offered blocks are
//!   copied out first), or, with `--kvstore-gpu-direct`, the store writes into each GPU's
//!   registered part of the pools directly. Without a kvstore and with direct sends
//!   there is no host mirror at all.

use engine::EngineOptions;
use engine::device::AnyEngine;
use engine::mirror::HostMirror;
use model_spec::ModelConfig;
use transfer::{Receiver, RegionSpec, RegisteredDevice, RegisteredKv};

use crate::{PrefillConfig, WorkerError};

/// The regions of one part of the KV memory peers write (one device's part, with page
/// ids and slots relative to it, or the host memory holding every page).
#[derive(Clone, Debug)]
pub struct KvRegionPart {
    pub pages: RegionSpec,
    pub rings: RegionSpec,
    pub comp: RegionSpec,
}

/// Where peers write into this worker's KV memory.
#[derive(Clone, Debug)]
pub struct KvRegions {
    pub ucx_address: Vec<u8>,
    /// One per device when device memory is registered, else one.
    pub parts: Vec<KvRegionPart>,
}

impl KvRegions {
    /// The regions of the part holding a sequence on device `rank`.
    pub fn part(&self, rank: usize) -> &KvRegionPart {
        if self.parts.len() == 1 { &self.parts[0] } else { &self.parts[rank] }
    }
}

/// How this worker's KV leaves and arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPaths {
    /// Sends to decode workers read device memory.
    pub direct_send: bool,
    /// The kvstore writes into and reads from device memory.
    pub kvstore_direct: bool,
}

pub struct PrefillMemory {
    pub engine: AnyEngine,
    pub regions: KvRegions,
    pub paths: KvPaths,
    /// Device registrations, kept until no peer can write any more.
    pub registrations: Vec<RegisteredDevice>,
}

/// The engine on `--device` (or `--devices`) and its KV memory (see the module docs).
pub fn build(cfg: &PrefillConfig, receiver: &Receiver) -> Result<PrefillMemory, WorkerError> {
    let model_cfg = ModelConfig::from_file(&cfg.model.join("config.json"))?;
    let layout = model_cfg.kv_layout(cfg.kv_dtype);
    plan_memory(cfg, &model_cfg)?;
    let opts = EngineOptions {
        kv_dtype: cfg.kv_dtype,
        max_pages: cfg.max_pages,
        max_sequences: cfg.max_sequences,
        max_chunk_tokens: cfg.token_budget,
    };
    let devices = cfg.devices();
    let on_gpus = devices.iter().all(|d| d.is_cuda());
    let direct_send = cfg.gpu_direct.decide(on_gpus, receiver.supports_cuda()).map_err(WorkerError::Config)?;
    let kvstore_direct = direct_send && cfg.kvstore_gpu_direct;
    let paths = KvPaths { direct_send, kvstore_direct };
    // A host mirror exists for whatever cannot reach device memory: sends when they are
    // staged, kvstore traffic unless the store reaches the GPU.
    let mirror = !on_gpus || !direct_send || (cfg.kvstore.is_some() && !kvstore_direct);
    let (engine, parts, registrations) = if mirror {
        let kv = RegisteredKv::allocate(receiver, &layout, cfg.max_pages, cfg.max_sequences, None)?;
        let part = KvRegionPart { pages: kv.pages.clone(), rings: kv.rings.clone(), comp: kv.comp.clone() };
        let host = HostMirror { state: kv.state, slot_logits: None };
        let engine = AnyEngine::load_for_transport(&cfg.model, &devices, opts, Some(host))
            .map_err(|e| WorkerError::Config(e.to_string()))?;
        (engine, vec![part], Vec::new())
    } else {
        let engine = AnyEngine::load_for_transport(&cfg.model, &devices, opts, None)
            .map_err(|e| WorkerError::Config(e.to_string()))?;
        let (mut parts, mut registrations) = (Vec::new(), Vec::new());
        if kvstore_direct {
            let kv = engine::with_engine!(&engine, e => e.device_kv())
                .ok_or_else(|| WorkerError::Config("the GPU engine holds no KV in device memory".into()))?;
            for part in kv {
                let [pages, rings, comp] = [part.pages, part.rings, part.comp].map(|m| receiver.register_device(m));
                let (pages, rings, comp) = (pages?, rings?, comp?);
                parts.push(KvRegionPart {
                    pages: pages.spec.clone(),
                    rings: rings.spec.clone(),
                    comp: comp.spec.clone(),
                });
                registrations.extend([pages, rings, comp]);
            }
        }
        (engine, parts, registrations)
    };
    let mut engine = engine;
    if kvstore_direct {
        engine::with_engine!(&mut engine, e => e.set_direct(None))?;
    }
    if on_gpus {
        tracing::info!(
            gpu_direct = %cfg.gpu_direct,
            ucx_cuda = receiver.supports_cuda(),
            sends = if direct_send { "from GPU memory" } else { "staged through the host mirror" },
            kvstore = match (cfg.kvstore.is_some(), kvstore_direct) {
                (false, _) => "none",
                (true, true) => "into and from GPU memory",
                (true, false) => "staged through the host mirror",
            },
            "KV paths of this prefill worker"
        );
    }
    let regions = KvRegions { ucx_address: receiver.address().to_vec(), parts };
    Ok(PrefillMemory { engine, regions, paths, registrations })
}

impl PrefillMemory {
    /// The `sluice_kv_memory_path` label for these paths.
    pub fn kv_path_label(&self) -> &'static str {
        match (self.paths.direct_send, self.paths.kvstore_direct) {
            (true, true) => "device",
            (true, false) if engine::with_engine!(&self.engine, e => e.mirror.is_some()) => "device_send",
            (true, false) => "device",
            (false, _) => engine::with_engine!(&self.engine, e => e.kv_memory_path()),
        }
    }
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
