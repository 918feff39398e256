//! Device memory of one decode step at addresses that repeat from step to step, so a
//! step's launches can be compared with an earlier step's and replayed as a CUDA graph
//! (`step_graph`).
//!
//! While a step records, [`super::runtime::Gpu::alloc`] and [`super::runtime::Gpu::upload`]
//! take their memory from one preallocated region instead of the stream-ordered pool:
//! temporaries from the bottom (a buffer freed during the step is handed to the next
//! request of the same rounded size, last freed first), the step's host-to-device copies
//! from the top (never reused within the step, because those copies run as soon as they
//! are issued while the step's kernels wait to be issued together; a fresh address is
//! one no earlier kernel of the step touches). The same ops in the same order therefore
//! get the same addresses. A request that does not fit marks the step as overflowed
//! (it then runs without a graph, from pool memory: what was recorded is issued at that
//! point and the rest of the step runs eagerly, `step_graph::arena_slice`) and the next
//! step starts with a region large enough.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;

/// Temporaries are rounded up to this many bytes (and so aligned to it).
const ALIGN: usize = 256;

/// A device buffer: owned (freed to the pool when dropped) or a piece of the step arena
/// (given back to the arena's free list when dropped).
pub(crate) struct DevBuf<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    lease: Option<Lease>,
}

/// Where an arena buffer lies, to give it back.
pub(crate) struct Lease {
    arena: Arc<ArenaState>,
    generation: u64,
    offset: usize,
    bytes: usize,
    upload: bool,
}

impl<T> DevBuf<T> {
    pub(crate) fn owned(slice: CudaSlice<T>) -> Self {
        DevBuf { slice: ManuallyDrop::new(slice), lease: None }
    }

    pub(crate) fn leased(slice: CudaSlice<T>, lease: Lease) -> Self {
        DevBuf { slice: ManuallyDrop::new(slice), lease: Some(lease) }
    }
}

impl<T> Deref for DevBuf<T> {
    type Target = CudaSlice<T>;

    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> DerefMut for DevBuf<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> Drop for DevBuf<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and not used afterwards.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        match self.lease.take() {
            // The arena owns the memory: forget the slice (no free) and return the piece.
            Some(lease) => {
                let _ = slice.leak();
                lease.arena.give_back(&lease);
            }
            None => drop(slice),
        }
    }
}

/// The arena's bookkeeping, shared with the buffers it hands out.
pub(crate) struct ArenaState {
    inner: Mutex<Pieces>,
}

#[derive(Default)]
struct Pieces {
    /// Bumped at every step's start: pieces of an earlier step are not given back.
    generation: u64,
    active: bool,
    size: usize,
    /// Next free byte of the temporaries (from the bottom).
    low: usize,
    /// Lowest byte of the copies (from the top).
    high: usize,
    /// Freed temporaries by rounded size, last freed last.
    free: HashMap<usize, Vec<usize>>,
    /// Bytes requested this step that did not fit.
    overflow: usize,
    /// The step's highest use of the region (temporaries + copies).
    peak: usize,
    /// A recorded branch is open (`Gpu::fork`): temporaries freed now wait in `held`
    /// until it joins, since the other stream of the branch may still be using them.
    hold: bool,
    held: Vec<(usize, usize)>,
}

impl ArenaState {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(ArenaState { inner: Mutex::new(Pieces::default()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pieces> {
        self.inner.lock().expect("arena poisoned")
    }

    /// Start a step over a region of `size` bytes: everything is free again.
    pub(crate) fn begin(&self, size: usize) {
        let mut p = self.lock();
        p.generation += 1;
        p.active = true;
        p.size = size;
        p.low = 0;
        p.high = size;
        p.free.clear();
        p.overflow = 0;
        p.peak = 0;
        p.hold = false;
        p.held.clear();
    }

    /// Hold freed temporaries back from reuse (`true`, a branch opens) or hand the held
    /// ones back (`false`, it joins).
    pub(crate) fn hold(&self, on: bool) {
        let mut p = self.lock();
        p.hold = on;
        if !on {
            for (bytes, offset) in std::mem::take(&mut p.held) {
                p.free.entry(bytes).or_default().push(offset);
            }
        }
    }

    /// Stop handing out pieces; returns (peak bytes used, bytes that did not fit).
    pub(crate) fn end(&self) -> (usize, usize) {
        let mut p = self.lock();
        p.active = false;
        (p.peak, p.overflow)
    }

    pub(crate) fn active(&self) -> bool {
        self.lock().active
    }

    /// Whether a request made now came from the pool instead (the step overflowed).
    pub(crate) fn overflowed(&self) -> bool {
        self.lock().overflow > 0
    }

    /// Offset of a piece of `bytes` for a temporary (`upload` false) or a copy's target,
    /// or None when no step is recording or it does not fit.
    pub(crate) fn take(self: &Arc<Self>, bytes: usize, upload: bool) -> Option<Lease> {
        let mut p = self.lock();
        if !p.active {
            return None;
        }
        let rounded = if upload { bytes.max(ALIGN).next_power_of_two() } else { bytes.max(1).next_multiple_of(ALIGN) };
        let offset = if upload {
            // Powers of two: a list that grows a little (a page table) keeps its address.
            match p.high.checked_sub(rounded).filter(|&at| at >= p.low) {
                Some(at) => {
                    p.high = at;
                    Some(at)
                }
                None => None,
            }
        } else if let Some(at) = p.free.get_mut(&rounded).and_then(Vec::pop) {
            Some(at)
        } else if p.low + rounded <= p.high {
            p.low += rounded;
            Some(p.low - rounded)
        } else {
            None
        };
        let used = p.low + (p.size - p.high);
        p.peak = p.peak.max(used);
        match offset {
            Some(offset) => {
                Some(Lease { arena: self.clone(), generation: p.generation, offset, bytes: rounded, upload })
            }
            None => {
                p.overflow += rounded;
                None
            }
        }
    }

    fn give_back(&self, lease: &Lease) {
        let mut p = self.lock();
        if lease.upload || lease.generation != p.generation || !p.active {
            return;
        }
        if p.hold {
            p.held.push((lease.bytes, lease.offset));
            return;
        }
        p.free.entry(lease.bytes).or_default().push(lease.offset);
    }
}

impl Lease {
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same requests in the same order get the same offsets in every step, a freed
    /// temporary is reused by the next request of its size, and copies never overlap
    /// the temporaries.
    #[test]
    fn steps_with_the_same_requests_get_the_same_offsets() {
        let arena = ArenaState::new();
        let run = |arena: &Arc<ArenaState>| {
            arena.begin(1 << 20);
            let a = arena.take(1000, false).unwrap();
            let b = arena.take(5000, false).unwrap();
            let up = arena.take(300, true).unwrap();
            let offsets = (a.offset(), b.offset(), up.offset());
            arena.give_back(&a);
            let c = arena.take(1024, false).unwrap();
            assert_eq!(c.offset(), a.offset(), "a freed piece of the same rounded size is reused");
            let d = arena.take(1000, false).unwrap();
            assert_ne!(d.offset(), c.offset(), "a piece in use is not handed out twice");
            assert!(up.offset() >= d.offset() + 1024, "copies lie above the temporaries");
            let (peak, overflow) = arena.end();
            assert_eq!(overflow, 0);
            (offsets, d.offset(), peak)
        };
        let first = run(&arena);
        let second = run(&arena);
        assert_eq!(first, second);
        assert_eq!(first.0.2, (1 << 20) - 512, "a copy's piece is a power of two from the top");
    }

    /// A request that does not fit is counted, not placed; pieces of an earlier step are
    /// not given back into the next one.
    #[test]
    fn overflow_is_reported_and_old_pieces_are_not_reused() {
        let arena = ArenaState::new();
        arena.begin(4096);
        let old = arena.take(2048, false).unwrap();
        assert!(arena.take(4096, false).is_none());
        assert!(arena.overflowed());
        assert_eq!(arena.end(), (2048, 4096));
        arena.begin(4096);
        arena.give_back(&old);
        let fresh = arena.take(2048, false).unwrap();
        let next = arena.take(2048, false).unwrap();
        assert_eq!((fresh.offset(), next.offset()), (0, 2048), "the old step's piece was not put on the free list");
        assert!(arena.take(1, false).is_none(), "full");
        arena.end();
        assert!(arena.take(1, false).is_none(), "no step recording");
    }

    /// While a branch is open, a freed temporary is not handed out again (the branch's
    /// other stream may still read it); at the join it is.
    #[test]
    fn pieces_freed_inside_a_branch_wait_for_its_join() {
        let arena = ArenaState::new();
        arena.begin(1 << 20);
        let a = arena.take(1024, false).unwrap();
        arena.hold(true);
        arena.give_back(&a);
        let b = arena.take(1024, false).unwrap();
        assert_ne!(b.offset(), a.offset(), "reused inside the branch");
        arena.hold(false);
        let c = arena.take(1024, false).unwrap();
        assert_eq!(c.offset(), a.offset(), "handed out again after the join");
        arena.end();
    }
}
