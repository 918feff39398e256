//! Where a step's time goes, per op (`SLUICE_CUDA_PROFILE`):
//! - `1`: every op synchronises before and after and its wall time is added up per op
//!   name (it removes the overlap of host launches with device work and adds a round
//!   trip per op, so small ops look larger and totals exceed unprofiled steps);
//! - `events`: CUDA events recorded around every op, nothing synchronised; the device
//!   time between each op's pair is added up when the profile is taken (the device's
//!   own time per op, launch gaps inside an op included);
//! - `host`: the host's time inside every op (recording or launching it; nothing
//!   synchronised, decode steps still recorded for CUDA graphs): where the thread that
//!   issues a step spends it, which is what bounds a step whose wall time exceeds its
//!   time on the device. Ops nest (`moe` holds `moe: experts`), so the profile also
//!   carries [`HOST_OUTERMOST`]: the time in outermost ops alone. The rest of a step's
//!   wall time is the engine's own code.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Mutex;

use cudarc::driver::CudaEvent;

use super::runtime::{Gpu, fail};

/// The entry of a host profile that holds the time in outermost ops (each op's time
/// counted once, however deeply ops nest).
pub const HOST_OUTERMOST: &str = "(outermost ops)";

thread_local! {
    /// How many host-profiled ops the calling thread is inside.
    static HOST_DEPTH: Cell<u32> = const { Cell::new(0) };
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Sync,
    Events,
    Host,
}

pub(crate) struct OpProfile {
    mode: Mode,
    totals: Mutex<BTreeMap<&'static str, (f64, u64)>>,
    pending: Mutex<Vec<(&'static str, CudaEvent, CudaEvent)>>,
}

impl OpProfile {
    /// The profile `SLUICE_CUDA_PROFILE` asks for, if any.
    pub fn from_env() -> Option<Self> {
        let mode = match std::env::var("SLUICE_CUDA_PROFILE").ok()?.as_str() {
            "1" => Mode::Sync,
            "events" => Mode::Events,
            "host" => Mode::Host,
            _ => return None,
        };
        Some(OpProfile { mode, totals: Mutex::default(), pending: Mutex::default() })
    }

    /// Whether this profile times the host (`host`): decode steps are then still
    /// recorded for graphs, since the other modes time ops issued one by one.
    pub fn times_host(&self) -> bool {
        self.mode == Mode::Host
    }

    pub fn measure<R>(&self, gpu: &Gpu, name: &'static str, f: impl FnOnce() -> R) -> R {
        Self::measure_all(&[(self, gpu)], name, f)
    }

    /// [`OpProfile::measure`] for work issued to several GPUs at once (an NCCL group):
    /// each GPU that profiles gets the time of `f` on its own stream (in `Sync` mode the
    /// wall time between synchronising all of them before and after).
    pub fn measure_all<R>(gpus: &[(&OpProfile, &Gpu)], name: &'static str, f: impl FnOnce() -> R) -> R {
        let Some((first, _)) = gpus.first() else { return f() };
        let record = |gpu: &Gpu| {
            let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            gpu.stream.record_event(flags).unwrap_or_else(|e| fail("event record", e))
        };
        match first.mode {
            Mode::Sync => {
                gpus.iter().for_each(|(_, g)| g.sync());
                let t = std::time::Instant::now();
                let r = f();
                gpus.iter().for_each(|(_, g)| g.sync());
                let seconds = t.elapsed().as_secs_f64();
                gpus.iter().for_each(|(p, _)| p.add(name, seconds));
                r
            }
            Mode::Host => {
                // One thread issues the group for every GPU: its time is counted once.
                let depth = HOST_DEPTH.replace(HOST_DEPTH.get() + 1);
                let t = std::time::Instant::now();
                let r = f();
                let seconds = t.elapsed().as_secs_f64();
                HOST_DEPTH.set(depth);
                first.add(name, seconds);
                if depth == 0 {
                    first.add(HOST_OUTERMOST, seconds);
                }
                r
            }
            Mode::Events => {
                let starts: Vec<CudaEvent> = gpus.iter().map(|(_, g)| record(g)).collect();
                let r = f();
                for ((p, g), start) in gpus.iter().zip(starts) {
                    let end = record(g);
                    p.pending.lock().expect("profile poisoned").push((name, start, end));
                }
                r
            }
        }
    }

    fn add(&self, name: &'static str, seconds: f64) {
        let mut t = self.totals.lock().expect("profile poisoned");
        let e = t.entry(name).or_default();
        e.0 += seconds;
        e.1 += 1;
    }

    /// `(name, seconds, calls)` since the last call, largest first.
    pub fn take(&self, gpu: &Gpu) -> Vec<(&'static str, f64, u64)> {
        let pending = std::mem::take(&mut *self.pending.lock().expect("profile poisoned"));
        if !pending.is_empty() {
            gpu.sync();
        }
        for (name, start, end) in pending {
            let ms = start.elapsed_ms(&end).unwrap_or_else(|e| fail("event timing", e));
            self.add(name, ms as f64 / 1e3);
        }
        let mut v: Vec<_> = std::mem::take(&mut *self.totals.lock().expect("profile poisoned"))
            .into_iter()
            .map(|(k, (t, n))| (k, t, n))
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }
}
