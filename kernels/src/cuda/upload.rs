//! Streaming host bytes (a memory-mapped checkpoint) into device memory through a
//! bounded pool of pinned staging buffers. Any number of loader threads call
//! [`Staging::copy`] at once: each takes a free buffer, fills it from its source (the
//! memcpy that pages the file in, or a format conversion), queues an asynchronous copy
//! to the device and hands the buffer back with an event; the next taker waits on that
//! event before refilling it. Host memory stays at the pool's size whatever the model's,
//! the host-side filling runs on as many threads as load, and the copies run at pinned
//! DMA speed behind them.

use std::sync::{Arc, Condvar, Mutex};

use cudarc::driver::{CudaEvent, CudaStream, PinnedHostSlice};

use super::runtime::{Gpu, fail};

/// Bytes per staging buffer.
pub(crate) const SLOT_BYTES: usize = 16 << 20;
/// Buffers in the pool (`SLOTS × SLOT_BYTES` of pinned host memory at most).
const SLOTS: usize = 24;
/// Sources smaller than this go through a plain (pageable) copy.
pub(crate) const STAGE_MIN_BYTES: usize = 1 << 20;

struct Slot {
    buf: PinnedHostSlice<u8>,
    /// Recorded after the last copy out of this buffer was queued.
    pending: Option<CudaEvent>,
}

/// The pool; empty until the first staged copy, released by [`Staging::release`].
#[derive(Default)]
pub(crate) struct Staging {
    slots: Mutex<Pool>,
    freed: Condvar,
}

#[derive(Default)]
struct Pool {
    free: Vec<Slot>,
    /// Buffers allocated so far (free or in use).
    made: usize,
}

impl Staging {
    /// Copy `len` bytes to device address `dst`, in pieces of at most [`SLOT_BYTES`]:
    /// `fill(offset, piece)` writes source bytes `offset..offset + piece.len()` into a
    /// pinned buffer, then the piece is queued to the device on `stream`. Returns once
    /// every piece is queued (the copies complete in stream order).
    pub fn copy(&self, gpu: &Gpu, dst: u64, len: usize, mut fill: impl FnMut(usize, &mut [u8])) {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(SLOT_BYTES);
            let mut slot = self.take(gpu);
            // SAFETY: the buffer is ours until `give` (no copy out of it is pending: `take`
            // waited for its event), it holds SLOT_BYTES >= n bytes, and nothing else
            // references its memory.
            let piece = unsafe { std::slice::from_raw_parts_mut(slot.buf.as_mut_ptr_unsynced(), n) };
            fill(at, piece);
            queue_copy(&gpu.stream, dst + at as u64, piece);
            slot.pending = Some(gpu.stream.record_event(None).unwrap_or_else(|e| fail("event record", e)));
            self.give(slot);
            at += n;
        }
    }

    /// A free buffer: one whose last copy has completed, else a new one (up to
    /// [`SLOTS`]), else the next free one once its copy completes. So a copy queued behind
    /// the device's work (`copy_now`) does not wait for that work to finish.
    fn take(&self, gpu: &Gpu) -> Slot {
        let mut pool = self.slots.lock().expect("staging pool poisoned");
        loop {
            let done = pool.free.iter().position(|s| s.pending.as_ref().is_none_or(CudaEvent::is_complete));
            if let Some(i) = done {
                return pool.free.swap_remove(i);
            }
            if pool.made >= SLOTS
                && let Some(slot) = pool.free.pop()
            {
                drop(pool);
                if let Some(ev) = &slot.pending {
                    ev.synchronize().unwrap_or_else(|e| fail("staging event wait", e));
                }
                return slot;
            }
            if pool.made < SLOTS {
                pool.made += 1;
                drop(pool);
                // Allocating pinned memory may synchronize the context.
                let _sync = super::capture_lock::may_sync(gpu.ordinal);
                // SAFETY: the buffer's bytes are written by `fill` before any copy reads them.
                let buf = unsafe { gpu.ctx.alloc_pinned_with_flags::<u8>(SLOT_BYTES, 0) }
                    .unwrap_or_else(|e| fail("pinned staging allocation", e));
                return Slot { buf, pending: None };
            }
            pool = self.freed.wait(pool).expect("staging pool poisoned");
        }
    }

    fn give(&self, slot: Slot) {
        self.slots.lock().expect("staging pool poisoned").free.push(slot);
        self.freed.notify_one();
    }

    /// Queue `bytes` to device address `dst` on the GPU's stream and return at once (the
    /// bytes go through a pinned buffer: a copy from pageable memory of more than a few
    /// pages waits for the stream to reach it).
    pub fn copy_now(&self, gpu: &Gpu, dst: u64, bytes: &[u8]) {
        self.copy(gpu, dst, bytes.len(), |at, piece| piece.copy_from_slice(&bytes[at..at + piece.len()]));
    }

    /// Wait for every queued copy and free the pinned buffers.
    pub fn release(&self, stream: &Arc<CudaStream>) {
        stream.synchronize().unwrap_or_else(|e| fail("stream synchronize", e));
        let mut pool = self.slots.lock().expect("staging pool poisoned");
        // Freeing pinned memory may synchronize the context.
        let _sync = super::capture_lock::may_sync(stream.context().ordinal());
        pool.free.clear();
        pool.made = 0;
    }
}

trait UnsyncedPtr {
    /// The buffer's address without waiting on cudarc's own event (which this module
    /// does not use: event tracking is off, see `runtime`).
    fn as_mut_ptr_unsynced(&mut self) -> *mut u8;
}

impl UnsyncedPtr for PinnedHostSlice<u8> {
    fn as_mut_ptr_unsynced(&mut self) -> *mut u8 {
        // With event tracking off cudarc never records this slice's event, so waiting on
        // it returns at once; our own `pending` event orders reuse.
        self.as_mut_ptr().unwrap_or_else(|e| fail("pinned buffer access", e))
    }
}

/// Queue `src` to device address `dst` on `stream`. From pinned memory the copy is
/// asynchronous (the caller keeps `src` unchanged until an event after it completes);
/// from pageable memory the driver has taken the bytes when this returns.
pub(crate) fn queue_copy(stream: &Arc<CudaStream>, dst: u64, src: &[u8]) {
    use cudarc::driver::sys;
    stream.context().bind_to_thread().unwrap_or_else(|e| fail("binding the context", e));
    // SAFETY: `src` is pageable (consumed before return) or pinned memory that stays
    // untouched until the event recorded after this copy completes (`Staging::take`
    // waits for it); `dst..dst + len` lies in a live device allocation (the callers
    // allocate it before copying).
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const std::ffi::c_void, src.len(), stream.cu_stream()) }
        .result()
        .unwrap_or_else(|e| fail("staged host-to-device copy", e));
}

impl super::CudaBackend {
    /// `words` in device memory of this step (as [`Gpu::upload`] places them), copied
    /// through the staging buffers ([`Staging::copy_now`]): the host goes on at once,
    /// where a pageable copy of this size would wait for the work queued before it.
    pub(crate) fn upload_staged(&self, words: &[i32]) -> super::runtime::DevBuf<i32> {
        let g = &self.gpu;
        let len = words.len().max(1);
        let dst = g.arena_slice::<i32>(len, true).unwrap_or_else(|| super::runtime::DevBuf::owned(g.alloc_owned(len)));
        if !words.is_empty() {
            self.staging.copy_now(g, g.ptr(&dst), bytemuck::cast_slice(words));
        }
        dst
    }
}
