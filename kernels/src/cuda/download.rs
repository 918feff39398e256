//! Large device-to-host reads (a decode step's logits: 66 MB at batch 128 of a 129K
//! vocabulary) through two pinned buffers, double-buffered: the DMA of one piece runs
//! while the host copies the previous one out, into as many destination parts as the
//! caller has (one a sequence, so no single step-sized host buffer: glibc maps one that
//! large afresh every step, and its page faults made the batch-128 read 44 ms). And
//! reads queued now and waited for later (`Gpu::read_later`, `Gpu::finish_read`): a
//! prefill's MoE routing, read while the device runs the shared expert.

use std::sync::Mutex;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice};

use super::runtime::{Gpu, fail};

/// Bytes per pinned piece.
const PIECE_BYTES: usize = 8 << 20;
/// Reads smaller than this go through one pageable copy (fast enough, no staging).
pub(crate) const STAGED_READ_MIN_BYTES: usize = 4 << 20;

/// Keep large host allocations in the heap, for the process's life. glibc maps
/// allocations above a threshold (adapting up to 32 MiB) afresh and trims free memory at
/// the heap's top beyond twice it, so a large batch's per-sequence logits were page-
/// faulted in again every step: the copy out of the pinned pieces took 5 to 16 ms at
/// batch 64 on the H200 machine, varying run to run. Fixed thresholds (64 MiB mapped,
/// 1 GiB trimmed) let the next step reuse the memory. Called when a GPU is opened.
pub(crate) fn keep_host_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: mallopt only sets allocator parameters; any value is valid.
        ONCE.call_once(|| unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        });
    }
}

/// The two pinned buffers, allocated at the first large read; and the pinned buffers of
/// queued reads ([`Download::queue`]), kept for the next.
#[derive(Default)]
pub(crate) struct Download {
    bufs: Mutex<Vec<PinnedHostSlice<u8>>>,
    spare: Mutex<Vec<PinnedHostSlice<u8>>>,
}

/// Smallest pinned buffer of a queued read: a prefill's routing (8K rows × top-6 i32) fits.
const QUEUED_MIN_BYTES: usize = 1 << 20;

/// A device-to-host copy queued on the stream into a pinned buffer of its own, waited for
/// by [`Download::finish`]: the host may issue more work between the two, which the device
/// then runs while the host waits for the copy and uses what it read.
pub(crate) struct QueuedRead {
    buf: PinnedHostSlice<u8>,
    done: CudaEvent,
    bytes: usize,
}

impl Download {
    /// Queue a copy of `bytes` bytes at device address `src` on `stream` (the range must
    /// lie in live device memory of the stream's context until [`Download::finish`]).
    pub fn queue(&self, stream: &CudaStream, src: u64, bytes: usize) -> QueuedRead {
        let reused = self.spare.lock().expect("queued read buffers poisoned").pop();
        let mut buf = match reused {
            Some(b) if b.len() >= bytes => b,
            small => {
                // Freeing and allocating pinned memory may synchronize the context.
                let _sync = super::capture_lock::may_sync(stream.context().ordinal());
                drop(small);
                // SAFETY: the buffer's bytes are written by the copy below before any read.
                unsafe { stream.context().alloc_pinned_with_flags::<u8>(bytes.max(QUEUED_MIN_BYTES), 0) }
                    .unwrap_or_else(|e| fail("pinned read buffer", e))
            }
        };
        let dst = buf.as_mut_ptr().unwrap_or_else(|e| fail("pinned buffer access", e));
        // SAFETY: the pinned buffer holds at least `bytes` bytes and is not read by the host
        // until the event recorded after this copy has completed (`finish`); the source
        // range lies in live device memory (the caller's contract).
        unsafe {
            let dst = std::slice::from_raw_parts_mut(dst, bytes);
            cudarc::driver::result::memcpy_dtoh_async(dst, src, stream.cu_stream())
        }
        .unwrap_or_else(|e| fail("device-to-host copy", e));
        let done = stream.record_event(None).unwrap_or_else(|e| fail("event record", e));
        QueuedRead { buf, done, bytes }
    }

    /// Wait for a queued read and copy its bytes into `out` (exactly as many).
    pub fn finish(&self, mut read: QueuedRead, out: &mut [u8]) {
        assert_eq!(out.len(), read.bytes, "a queued read of {} bytes into {}", read.bytes, out.len());
        read.done.synchronize().unwrap_or_else(|e| fail("queued read event wait", e));
        let from = read.buf.as_mut_ptr().unwrap_or_else(|e| fail("pinned buffer access", e));
        // SAFETY: the copy into the buffer's first `bytes` bytes completed (its event above).
        out.copy_from_slice(unsafe { std::slice::from_raw_parts(from, read.bytes) });
        self.spare.lock().expect("queued read buffers poisoned").push(read.buf);
    }

    /// Copy the bytes at device address `src` into `outs`, one after another (their
    /// lengths summed), on `stream`, and wait. The address range must lie in live device
    /// memory of the stream's context.
    pub fn read(&self, stream: &CudaStream, src: u64, outs: &mut [&mut [u8]]) {
        let mut bufs = self.bufs.lock().expect("download buffers poisoned");
        let _sync = (bufs.len() < 2).then(|| super::capture_lock::may_sync(stream.context().ordinal()));
        while bufs.len() < 2 {
            // SAFETY: the buffer's bytes are written by the copies below before any read.
            let b = unsafe { stream.context().alloc_pinned_with_flags::<u8>(PIECE_BYTES, 0) }
                .unwrap_or_else(|e| fail("pinned download buffer", e));
            bufs.push(b);
        }
        let ptrs: Vec<*mut u8> =
            bufs.iter_mut().map(|b| b.as_mut_ptr().unwrap_or_else(|e| fail("pinned buffer access", e))).collect();
        let len: usize = outs.iter().map(|o| o.len()).sum();
        let pieces = len.div_ceil(PIECE_BYTES);
        let piece = |i: usize| (i * PIECE_BYTES, (len - i * PIECE_BYTES).min(PIECE_BYTES));
        let queue = |i: usize| {
            let (at, n) = piece(i);
            // SAFETY: the pinned buffer holds PIECE_BYTES >= n bytes and is not read by the
            // host until the event recorded after this copy has completed; the source
            // range lies in live device memory (the caller's contract).
            unsafe {
                let dst = std::slice::from_raw_parts_mut(ptrs[i % 2], n);
                cudarc::driver::result::memcpy_dtoh_async(dst, src + at as u64, stream.cu_stream())
            }
            .unwrap_or_else(|e| fail("device-to-host copy", e));
            stream.record_event(None).unwrap_or_else(|e| fail("event record", e))
        };
        // Where the next byte goes: part `part`, offset `off` in it.
        let (mut part, mut off) = (0, 0);
        let mut pending = (pieces > 0).then(|| queue(0));
        for i in 0..pieces {
            // Piece i + 1 goes into the other buffer, whose piece i - 1 was copied out.
            let next = (i + 1 < pieces).then(|| queue(i + 1));
            let done = pending.take().expect("a queued piece");
            done.synchronize().unwrap_or_else(|e| fail("download event wait", e));
            let n = piece(i).1;
            // SAFETY: the copy into this buffer completed (its event above).
            let mut from = unsafe { std::slice::from_raw_parts(ptrs[i % 2], n) };
            while !from.is_empty() {
                let dst = &mut outs[part][off..];
                let k = dst.len().min(from.len());
                dst[..k].copy_from_slice(&from[..k]);
                from = &from[k..];
                off += k;
                if off == outs[part].len() {
                    part += 1;
                    off = 0;
                }
            }
            pending = next;
        }
    }
}

/// The bytes of plain device data, for a copy to write them.
pub(crate) fn bytes_mut<T: DeviceRepr>(values: &mut [T]) -> &mut [u8] {
    let bytes = std::mem::size_of_val(values);
    // SAFETY: DeviceRepr types are plain data, so their bytes may be written as u8; the
    // view covers exactly the slice's values.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr() as *mut u8, bytes) }
}

/// Reads queued on a GPU's stream and waited for later.
impl Gpu {
    /// Queue a read of the first `len` elements of `src` ([`Gpu::finish_read`] waits for
    /// it): kernels launched between the two run while the host waits and uses the data.
    pub(crate) fn read_later<T: DeviceRepr>(&self, src: &CudaSlice<T>, len: usize) -> QueuedRead {
        self.flush_recording();
        assert!(len <= src.len(), "read of {len} elements past the buffer's {}", src.len());
        self.ctx.bind_to_thread().unwrap_or_else(|e| fail("binding the context", e));
        self.download.queue(&self.stream, self.ptr(src), len * std::mem::size_of::<T>())
    }

    /// Wait for a read queued by [`Gpu::read_later`] and copy it into `out` (as many
    /// elements as were queued).
    pub(crate) fn finish_read<T: DeviceRepr>(&self, read: QueuedRead, out: &mut [T]) {
        self.download.finish(read, bytes_mut(out));
    }
}
