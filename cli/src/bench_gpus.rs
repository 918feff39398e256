//! What `sluice bench engine` measures on the GPUs an engine computes on: one GPU, or
//! several as one sharded backend (figures summed over them: copy bandwidth, bytes
//! moved, memory; kernel-only timings on the first).

#![cfg(feature = "cuda")]

use engine::CudaBackend;
use kernels::Backend;
use kernels::sharded::Sharded;

pub trait MeasuredGpus: Backend {
    /// The first GPU (kernel-only timings run there).
    fn first(&self) -> &CudaBackend;
    /// Every GPU.
    fn gpus(&self) -> Vec<&CudaBackend>;

    /// Device-to-device copy bandwidth of all the GPUs together (GB/s, bytes read +
    /// written): the roofline of a step that streams its bytes from all of them.
    fn copy_gbs(&self) -> f64 {
        self.gpus().iter().map(|g| g.copy_bandwidth_gbs(1 << 30, 10)).sum()
    }

    /// Bytes `(free, total)` over all the GPUs.
    fn memory(&self) -> (usize, usize) {
        self.gpus().iter().map(|g| g.memory_info()).fold((0, 0), |(f, t), (a, b)| (f + a, t + b))
    }

    /// Weight and KV bytes the ops issued since the last call must read, all GPUs.
    fn traffic(&self) -> (u64, u64) {
        self.gpus().iter().map(|g| g.take_traffic()).fold((0, 0), |(w, k), (a, b)| (w + a, k + b))
    }

    /// Floating-point operations of the products issued since the last call, all GPUs.
    fn flops(&self) -> u64 {
        self.gpus().iter().map(|g| g.take_flops()).sum()
    }

    /// Kernel launches and cuBLAS calls since the last call, on the first GPU (each GPU
    /// of a sharded engine issues the same sequence).
    fn launches(&self) -> u64 {
        let n = self.first().take_launches();
        self.gpus().iter().skip(1).for_each(|g| {
            g.take_launches();
        });
        n
    }

    /// Decode step segments replayed as CUDA graphs since the last call, on the first GPU
    /// (every GPU of a sharded engine records the same steps).
    fn graphs(&self) -> kernels::cuda::GraphStats {
        let s = self.first().take_graph_stats();
        self.gpus().iter().skip(1).for_each(|g| {
            let _ = g.take_graph_stats();
        });
        s
    }

    /// Hold every GPU's stream for `ns` (work issued next queues behind it).
    fn hold(&self, ns: u64) {
        self.gpus().iter().for_each(|g| g.hold_stream(ns));
    }

    /// Per-op profile since the last call (`SLUICE_CUDA_PROFILE`): the first GPU's device
    /// times, or with `host` the issuing thread's time in every GPU's ops added up (one
    /// thread issues them all), largest first.
    fn profile(&self) -> Option<Vec<(&'static str, f64, u64)>> {
        let first = self.first();
        let mut p = first.take_profile()?;
        for g in self.gpus().iter().skip(1) {
            let Some(other) = g.take_profile() else { continue };
            if first.profiles_host() {
                for (name, t, n) in other {
                    match p.iter_mut().find(|e| e.0 == name) {
                        Some(e) => (e.1, e.2) = (e.1 + t, e.2 + n),
                        None => p.push((name, t, n)),
                    }
                }
            }
        }
        p.sort_by(|a, b| b.1.total_cmp(&a.1));
        Some(p)
    }
}

impl MeasuredGpus for CudaBackend {
    fn first(&self) -> &CudaBackend {
        self
    }

    fn gpus(&self) -> Vec<&CudaBackend> {
        vec![self]
    }
}

impl MeasuredGpus for Sharded<CudaBackend> {
    fn first(&self) -> &CudaBackend {
        &self.devices()[0]
    }

    fn gpus(&self) -> Vec<&CudaBackend> {
        self.devices().iter().collect()
    }
}
