//! The decode worker's KV memory: where prefill workers write a prompt's KV.
//!
//! - CPU engine: the engine's own KV memory is UCX-registered host memory.
//! - GPU engine, GPU-direct (`--gpu-direct auto` with a CUDA-enabled libucx, or `on`):
//!   each GPU's part of the page pool and state slots is registered as device memory,
//!   so prefill workers put straight into it (cuda_ipc on one host, GPUDirect RDMA
//!   across hosts); only the prompt's last logits land in host memory (they are sampled
//!   there). A target names the regions of the GPU that holds the reservation, with page
//!   ids and slot relative to them.
//! - GPU engine otherwise: a registered host mirror the engine copies in from after
//!   each commit.

use engine::EngineOptions;
use engine::device::AnyEngine;
use engine::mirror::HostMirror;
use model_spec::ModelConfig;
use transfer::{Receiver, RegionSpec, RegisteredDevice, RegisteredKv, WireGeometry};

use crate::{DecodeConfig, WorkerError};

/// The regions of one device's part of the KV memory (the only part for host memory).
#[derive(Clone)]
pub struct DeviceTargets {
    pub pages: RegionSpec,
    pub rings: RegionSpec,
    pub comp: RegionSpec,
    /// Global id of the part's first page and slot: targets name ids relative to them.
    pub first_page: u32,
    pub first_slot: u32,
}

/// What a reservation's target is made of, apart from its page ids and slot.
#[derive(Clone)]
pub struct TargetTemplate {
    pub geometry: WireGeometry,
    pub ucx_address: Vec<u8>,
    /// One entry per device when device memory is registered, else one for the host
    /// memory holding every page.
    pub parts: Vec<DeviceTargets>,
    pub logits: RegionSpec,
}

impl TargetTemplate {
    /// The regions a reservation on device `rank` is written through.
    pub fn part(&self, rank: usize) -> &DeviceTargets {
        if self.parts.len() == 1 { &self.parts[0] } else { &self.parts[rank] }
    }

    /// The logits window of a reservation on `part`. One host region holds every slot's
    /// logits, but a target's slot is relative to its device's part (so that it also
    /// addresses that device's state slots): the window starts at the part's first slot.
    /// (Without this, sequences on a decode worker's second GPU had their logits written
    /// into the first GPU's slots and their commits refused, found on four H200s.)
    pub fn logits_for(&self, part: &DeviceTargets) -> RegionSpec {
        logits_window(&self.logits, self.geometry.logits_bytes, part.first_slot)
    }
}

/// The engine, its target template, and the device registrations that must live as
/// long as peers may write (dropped after the engine thread is joined).
pub struct DecodeMemory {
    pub engine: AnyEngine,
    pub template: TargetTemplate,
    pub registrations: Vec<RegisteredDevice>,
}

/// The engine on `--device` (or `--devices`), with its KV where peers can write it.
pub fn build(cfg: &DecodeConfig, receiver: &Receiver) -> Result<DecodeMemory, WorkerError> {
    let model_cfg = ModelConfig::from_file(&cfg.model.join("config.json"))?;
    let layout = model_cfg.kv_layout(cfg.kv_dtype);
    plan_memory(cfg, &model_cfg)?;
    let opts = EngineOptions {
        kv_dtype: cfg.kv_dtype,
        max_pages: cfg.max_pages,
        max_sequences: cfg.max_sequences,
        max_chunk_tokens: 2048,
    };
    let devices = cfg.devices();
    let on_gpus = devices.iter().all(|d| d.is_cuda());
    let direct = cfg.gpu_direct.decide(on_gpus, receiver.supports_cuda()).map_err(WorkerError::Config)?;
    if on_gpus && !direct {
        tracing::info!(
            gpu_direct = %cfg.gpu_direct,
            ucx_cuda = receiver.supports_cuda(),
            "prefill workers write KV into a registered host mirror, copied to the GPU after each commit (staged: \
             --gpu-direct off, or a libucx without CUDA transports)"
        );
    }
    let (engine, parts, logits, registrations) = if direct {
        let (logits_kv, logits) =
            transfer::registered::allocate_logits(receiver, cfg.max_sequences, model_cfg.vocab_size)?;
        let mut engine = AnyEngine::load_for_transport(&cfg.model, &devices, opts, None)
            .map_err(|e| WorkerError::Config(e.to_string()))?;
        let kv = engine::with_engine!(&engine, e => e.device_kv())
            .ok_or_else(|| WorkerError::Config("the GPU engine holds no KV in device memory".into()))?;
        let mut parts = Vec::new();
        let mut registrations = Vec::new();
        for part in kv {
            let (first_page, first_slot) = (part.first_page as u32, part.first_slot as u32);
            let ordinal = part.pages.ordinal();
            let [pages, rings, comp] = [part.pages, part.rings, part.comp].map(|m| receiver.register_device(m));
            let (pages, rings, comp) = (pages?, rings?, comp?);
            tracing::info!(
                device = part.rank,
                cuda = ordinal,
                pages_bytes = pages.spec.len,
                "KV memory of this GPU registered with UCX: prefill workers write into it directly"
            );
            parts.push(DeviceTargets {
                pages: pages.spec.clone(),
                rings: rings.spec.clone(),
                comp: comp.spec.clone(),
                first_page,
                first_slot,
            });
            registrations.extend([pages, rings, comp]);
        }
        engine::with_engine!(&mut engine, e => e.set_direct(Some(logits_kv)))?;
        (engine, parts, logits, registrations)
    } else {
        let kv =
            RegisteredKv::allocate(receiver, &layout, cfg.max_pages, cfg.max_sequences, Some(model_cfg.vocab_size))?;
        let logits = kv.logits.clone().expect("asked for a logits region");
        let part = DeviceTargets {
            pages: kv.pages.clone(),
            rings: kv.rings.clone(),
            comp: kv.comp.clone(),
            first_page: 0,
            first_slot: 0,
        };
        let host = HostMirror { state: kv.state, slot_logits: kv.slot_logits };
        let engine = AnyEngine::load_for_transport(&cfg.model, &devices, opts, Some(host))
            .map_err(|e| WorkerError::Config(e.to_string()))?;
        (engine, vec![part], logits, Vec::new())
    };
    let fingerprint = engine::with_engine!(&engine, e => e.fingerprint.clone());
    let geometry = WireGeometry::new(&layout, &fingerprint, model_cfg.vocab_size);
    let template = TargetTemplate { geometry, ucx_address: receiver.address().to_vec(), parts, logits };
    Ok(DecodeMemory { engine, template, registrations })
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

/// `logits` from slot `first_slot` on (`per_slot` bytes a slot).
fn logits_window(logits: &RegionSpec, per_slot: usize, first_slot: u32) -> RegionSpec {
    let skip = (first_slot as u64 * per_slot as u64).min(logits.len);
    RegionSpec { base: logits.base + skip, len: logits.len - skip, rkey: logits.rkey.clone() }
}

#[cfg(test)]
mod logits_window_tests {
    use super::*;

    #[test]
    fn a_parts_relative_slot_addresses_its_global_slots_logits() {
        // 8 slots of 40 bytes; the second GPU's part starts at global slot 4.
        let all = RegionSpec { base: 0x1000, len: 8 * 40, rkey: vec![7] };
        let second = logits_window(&all, 40, 4);
        assert_eq!((second.base, second.len, second.rkey.clone()), (0x1000 + 160, 160, vec![7]));
        // Relative slot 1 on the second part is global slot 5, where the engine reads it.
        assert_eq!(second.base + 40, all.base + 5 * 40);
        // The first (or only) part is the whole region.
        let first = logits_window(&all, 40, 0);
        assert_eq!((first.base, first.len), (all.base, all.len));
    }
}
