//! What a benchmark reads back of the ops a backend issued since it last asked: bytes the
//! weights and KV entries cost, product FLOPs, launches, decode steps replayed from CUDA
//! graphs, the per-op profile; and the switch between graphs and eager steps that tests
//! flip in one process.

use super::CudaBackend;
use super::step_graph::GraphStats;

impl CudaBackend {
    /// Bytes of weights and of KV entries the ops issued since the last call must read
    /// at least (each once), and reset the counters.
    pub fn take_traffic(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering;
        let t = &self.gpu.traffic;
        let device = self.gpu.take_device_traffic();
        (t.weights.swap(0, Ordering::Relaxed) + device, t.kv.swap(0, Ordering::Relaxed))
    }

    /// Floating-point operations of the products issued since the last call (2 per
    /// multiply-add; the routed experts' counted from the pairs routed), and reset.
    pub fn take_flops(&self) -> u64 {
        self.gpu.traffic.flops.swap(0, std::sync::atomic::Ordering::Relaxed)
    }

    /// Decode steps recorded, replayed from a CUDA graph, captured and issued eagerly
    /// since the last call (`step_graph`).
    pub fn take_graph_stats(&self) -> GraphStats {
        self.gpu.steps.take_stats()
    }

    /// Record decode steps and replay them as CUDA graphs (`on`, the default unless
    /// `SLUICE_CUDA_GRAPHS=0`), or issue every op as it comes: tests compare the two in
    /// one process.
    pub fn set_graphs(&self, on: bool) {
        self.gpu.set_graphs(on);
    }

    /// Kernel launches and cuBLAS calls issued since the last call.
    pub fn take_launches(&self) -> u64 {
        self.gpu.launches.swap(0, std::sync::atomic::Ordering::Relaxed)
    }

    /// Per-op `(name, seconds, calls)` since the last call, when profiling is on
    /// (`SLUICE_CUDA_PROFILE=1`, `events` or `host`), largest first.
    pub fn take_profile(&self) -> Option<Vec<(&'static str, f64, u64)>> {
        Some(self.profile.as_ref()?.take(&self.gpu))
    }

    /// Whether the profile is of the host's time in ops (`SLUICE_CUDA_PROFILE=host`).
    pub fn profiles_host(&self) -> bool {
        self.profile.as_ref().is_some_and(|p| p.times_host())
    }
}
