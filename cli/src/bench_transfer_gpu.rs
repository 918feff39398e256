//! The GPU children of `sluice bench transfer --devices cuda:S,cuda:R`: pages live in
//! device memory on both sides, the receiver registers its pool, rings and compressor
//! slot with a CUDA-enabled UCX (as a GPU-direct decode worker does), and the sender
//! puts straight from its device memory (as a GPU-direct prefill worker does); UCX
//! moves them GPU to GPU (cuda_ipc between processes of one host). Checksums are summed
//! on each device (`kernels::kv_checksum` on the GPU), and the sender also reports the
//! reference checksums of the bytes it uploaded, computed on the host, so a row checks
//! both the transfer and the device checksum against the CPU.

#![cfg(feature = "cuda")]

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use engine::{CudaBackend, EntryDtype};
use kernels::backend::{Backend, DeviceMemory, SumRange};
use kernels::kv_checksum::{finish, kv_checksum};
use prost::Message;
use serde_json::json;
use sluice_proto::v1 as pb;
use transfer::{Checksums, Receiver, Sender, Source, SourceParts, Target, WireGeometry};

use crate::bench_transfer::{checksums_json, fill, hex, page_ids, unhex};
use crate::child_proc::{expect_line, read_lines};

/// A byte buffer in device memory (FP8 storage: one element per byte).
fn device_bytes(b: &CudaBackend, bytes: &[u8]) -> kernels::cuda::CudaKv {
    let mut kv = b.kv_alloc(bytes.len().max(1), EntryDtype::Fp8);
    b.kv_write(&mut kv, 0, bytes);
    b.kv_fence();
    kv
}

/// Checksums of consecutive `piece`-byte pieces of a device buffer, summed on its GPU.
fn device_sums(b: &CudaBackend, kv: &kernels::cuda::CudaKv, pieces: usize, piece: usize) -> Vec<u64> {
    let ranges: Vec<SumRange> = (0..pieces).map(|i| SumRange::whole(i * piece, piece)).collect();
    b.kv_sums(kv, &ranges).into_iter().map(|s| finish(s, piece)).collect()
}

/// Holds `pages` pages and one state slot in device memory of `ordinal`, registered for
/// peers; prints the target, waits for `done`, prints the checksums of what landed.
pub fn receiver(g: &WireGeometry, pages: usize, scatter: bool, ordinal: usize, bound: Duration) -> Result<()> {
    let rx = Receiver::start()?;
    ensure!(rx.supports_cuda(), "{}", rx.describe_library());
    let gpu = CudaBackend::new(ordinal).with_context(|| format!("opening cuda:{ordinal}"))?;
    let pool = gpu.kv_alloc(pages * g.page_bytes, EntryDtype::Fp8);
    let (rings, comp) = (gpu.kv_alloc(g.ring_bytes, EntryDtype::Fp8), gpu.kv_alloc(g.comp_bytes, EntryDtype::Fp8));
    gpu.synchronize();
    let register = |kv: &kernels::cuda::CudaKv| {
        let mem: Box<dyn DeviceMemory> = gpu.kv_device_memory(kv).remove(0);
        rx.register_device(mem)
    };
    let (pool_r, rings_r, comp_r) = (register(&pool)?, register(&rings)?, register(&comp)?);
    let logits = rx.allocate(g.logits_bytes)?;
    let target = Target {
        geometry: g.clone(),
        ucx_address: rx.address().to_vec(),
        pages: pool_r.spec.clone(),
        rings: rings_r.spec.clone(),
        comp: comp_r.spec.clone(),
        logits: logits.spec.clone(),
        page_ids: page_ids(pages, scatter)?,
        slot: 0,
    };
    println!("TARGET {}", hex(&target.to_proto().encode_to_vec()));
    std::io::stdout().flush()?;
    let stdin = read_lines(std::io::stdin());
    expect_line(&stdin, "bench orchestrator", "done", bound)?;
    // The logits region read as a decode worker reads it: adopted host storage.
    let cpu = engine::CpuBackend::new();
    let logits = cpu.kv_adopt(Box::new(logits.region), g.logits_bytes / 4, EntryDtype::F32).map_err(|e| anyhow!(e))?;
    let host_logits = cpu.kv_host_bytes(&logits).ok_or_else(|| anyhow!("logits are not host memory"))?;
    let in_pool = device_sums(&gpu, &pool, pages, g.page_bytes);
    let landed = Checksums {
        pages: target.page_ids.iter().map(|&id| in_pool[id as usize]).collect(),
        rings: device_sums(&gpu, &rings, 1, g.ring_bytes)[0],
        comp: device_sums(&gpu, &comp, 1, g.comp_bytes)[0],
        logits: kv_checksum(host_logits),
    };
    println!("LANDED {}", checksums_json(&landed));
    std::io::stdout().flush()?;
    drop((pool_r, rings_r, comp_r));
    Ok(())
}

/// Sends distinct pages from device memory of `ordinal` to the target `warmup + iters`
/// times; prints the timings of the last `iters`, the checksums summed on the GPU and
/// the host's reference checksums of the same bytes.
pub fn sender(g: &WireGeometry, ordinal: usize, iters: usize, warmup: usize, step: Duration) -> Result<()> {
    let stdin = read_lines(std::io::stdin());
    let bytes = unhex(&expect_line(&stdin, "bench orchestrator", "TARGET", step)?)?;
    let target = Target::from_proto(&pb::KvTarget::decode(bytes.as_slice()).context("decoding the target")?)?;
    let pages = target.page_ids.len();
    let gpu = CudaBackend::new(ordinal).with_context(|| format!("opening cuda:{ordinal}"))?;
    let host_pool = fill(pages * g.page_bytes, 1);
    let (host_rings, host_comp, logits) = (fill(g.ring_bytes, 2), fill(g.comp_bytes, 3), fill(g.logits_bytes, 4));
    let (pool, rings, comp) =
        (device_bytes(&gpu, &host_pool), device_bytes(&gpu, &host_rings), device_bytes(&gpu, &host_comp));
    let mem = |kv: &kernels::cuda::CudaKv| gpu.kv_device_memory(kv).remove(0);
    let (pool_m, rings_m, comp_m) = (mem(&pool), mem(&rings), mem(&comp));
    let parts = SourceParts {
        pages: (0..pages)
            .map(|i| Source::Device { mem: &*pool_m, offset: i * g.page_bytes, len: g.page_bytes })
            .collect(),
        rings: Source::Device { mem: &*rings_m, offset: 0, len: g.ring_bytes },
        comp: Source::Device { mem: &*comp_m, offset: 0, len: g.comp_bytes },
        logits: Source::Host(&logits),
    };
    let mut tx = Sender::new()?;
    ensure!(tx.reaches_device_memory(), "the loaded libucx has no CUDA transports");
    // As a GPU-direct prefill worker does: its KV memory registered with the sender.
    for kv in [&pool, &rings, &comp] {
        tx.register_local(mem(kv))?;
    }
    for _ in 0..warmup {
        tx.send_from(&target, g, &parts, step)?;
    }
    let mut seconds = Vec::with_capacity(iters);
    let mut puts = 0;
    for _ in 0..iters {
        let started = Instant::now();
        puts = tx.send_from(&target, g, &parts, step)?.puts;
        seconds.push(started.elapsed().as_secs_f64());
    }
    let on_gpu = Checksums {
        pages: device_sums(&gpu, &pool, pages, g.page_bytes),
        rings: device_sums(&gpu, &rings, 1, g.ring_bytes)[0],
        comp: device_sums(&gpu, &comp, 1, g.comp_bytes)[0],
        logits: kv_checksum(&logits),
    };
    let on_host = Checksums {
        pages: host_pool.chunks_exact(g.page_bytes).map(kv_checksum).collect(),
        rings: kv_checksum(&host_rings),
        comp: kv_checksum(&host_comp),
        logits: kv_checksum(&logits),
    };
    if let Some(part) = on_host.first_mismatch(&on_gpu) {
        return Err(anyhow!("the GPU's checksum of {part} differs from the host's of the same bytes"));
    }
    // Rings, compressor slots and logits are a put each.
    let page_puts = puts.saturating_sub(3);
    let result = json!({"bytes_per_iter": parts.bytes(), "seconds": seconds, "page_puts": page_puts, "checksums": checksums_json(&on_gpu)});
    println!("RESULT {result}");
    std::io::stdout().flush()?;
    Ok(())
}
