//! Stream captures kept apart from the calls that may synchronize a whole context.
//!
//! Every engine of a process on one GPU shares the device's primary context. While one
//! thread captures a decode segment into a graph (`step_graph.rs`), a call on another
//! thread that synchronizes the context — cuBLAS making or destroying a handle or loading
//! one of its kernels at a first use, pinned host memory allocated, registered or freed,
//! a synchronous device allocation or free, a module unloaded — invalidates that capture
//! (the driver then refuses it with `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`, and graphs go
//! off for that GPU), and where it met the capture's instantiation it crashed the driver
//! (libcuda 580.159.04: a core dump read `cublasDestroy` → `cuCtxSynchronize` on one
//! thread beside `cuGraphInstantiate` on another; docs/perf.md). So, per device, a capture
//! holds the write side of a lock ([`capturing`]) and those calls the read side
//! ([`may_sync`]): they still run beside each other, never beside a capture. Launches,
//! stream-ordered copies, allocations and frees need no lock; they are what captures are
//! made to run beside.
//!
//! A thread's guards are reentrant: a call that takes [`may_sync`] while its thread holds
//! either side for that device (a cuBLAS product issued inside a capture, a pinned buffer
//! allocated while the backend is being made) takes nothing more.
//!
//! `SLUICE_CUDA_CAPTURE_LOCK=0` (read once) takes no lock at all: only to reproduce the
//! crash (`engine/tests/cuda_graphs.rs`, `cuda_engines_on_many_threads_capture_at_once`).

use std::cell::Cell;
use std::sync::{OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Devices a process tells apart (ordinals are folded onto them; two devices sharing a
/// lock only wait for each other a little more).
const DEVICES: usize = 64;

static LOCKS: [RwLock<()>; DEVICES] = [const { RwLock::new(()) }; DEVICES];

thread_local! {
    /// The devices whose lock this thread holds (either side), a bit each.
    static HELD: Cell<u64> = const { Cell::new(0) };
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_CAPTURE_LOCK").map_or(true, |v| v != "0"))
}

/// A held side of one device's lock; released (and the thread's mark cleared) on drop.
pub(crate) struct Held {
    bit: u64,
    _read: Option<RwLockReadGuard<'static, ()>>,
    _write: Option<RwLockWriteGuard<'static, ()>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        HELD.with(|h| h.set(h.get() & !self.bit));
    }
}

fn take(ordinal: usize, write: bool) -> Option<Held> {
    if !enabled() {
        return None;
    }
    let slot = ordinal % DEVICES;
    let bit = 1u64 << slot;
    if HELD.with(|h| h.get() & bit != 0) {
        return None;
    }
    // A panic while holding a side leaves nothing half-done that the lock protects: the
    // lock only orders driver calls.
    let lock = &LOCKS[slot];
    let held = if write {
        Held { bit, _read: None, _write: Some(lock.write().unwrap_or_else(|e| e.into_inner())) }
    } else {
        Held { bit, _read: Some(lock.read().unwrap_or_else(|e| e.into_inner())), _write: None }
    };
    HELD.with(|h| h.set(h.get() | bit));
    Some(held)
}

/// Held while capturing on device `ordinal`: no call that may synchronize its context
/// runs on another thread, and no other capture either.
pub(crate) fn capturing(ordinal: usize) -> Option<Held> {
    take(ordinal, true)
}

/// Held around a call that may synchronize the context of device `ordinal` (see the
/// module docs): it waits for a capture in progress and holds the next one back.
pub(crate) fn may_sync(ordinal: usize) -> Option<Held> {
    take(ordinal, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread holding a device's lock takes nothing more for it (no deadlock on
    /// itself), other devices' locks are separate, and the mark goes with the guard.
    #[test]
    fn guards_are_reentrant_per_thread_and_device() {
        if !enabled() {
            return;
        }
        let outer = capturing(3).expect("the first guard takes the lock");
        assert!(may_sync(3).is_none(), "inside a capture a call takes nothing more");
        assert!(capturing(3).is_none());
        let other = may_sync(4).expect("another device has its own lock");
        drop(other);
        drop(outer);
        let again = may_sync(3).expect("released with its guard");
        // Another thread may read beside this one, but not capture.
        std::thread::scope(|s| {
            s.spawn(|| assert!(may_sync(3).is_some(), "readers run beside each other"));
        });
        assert!(LOCKS[3].try_write().is_err(), "a capture waits for the call");
        drop(again);
        assert!(LOCKS[3].try_write().is_ok(), "and takes the lock once it is done");
    }
}
