//! KV storage's device memory, allocated with `cuMemAlloc` rather than from the
//! stream-ordered pool the rest of the backend uses (`cuMemAllocAsync`).
//!
//! Why: KV pools are what other processes and other GPUs reach. Memory from the
//! default stream-ordered pool cannot be exported with `cuIpcGetMemHandle`, so UCX's
//! `cuda_ipc` transport cannot map it in a peer process and falls back to staging the
//! bytes through host memory (measured on two H200s: 0.7 GB/s for the KV sender against
//! 97 GB/s for `ucx_perftest` on `cudaMalloc` buffers); and the context-wide peer access
//! that `cuCtxEnablePeerAccess` grants does not cover pool memory either (peer copies of
//! pool pages ran at 13.6 GB/s). KV pools are allocated once per worker, so the
//! synchronous allocation costs nothing that matters.

use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, result};

/// A byte buffer from `cuMemAlloc`, zeroed, freed with `cuMemFree` once the stream is done.
pub struct KvBuffer {
    slice: ManuallyDrop<CudaSlice<u8>>,
    stream: Arc<CudaStream>,
}

impl KvBuffer {
    pub(crate) fn zeroed(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self, result::DriverError> {
        let bytes = bytes.max(1);
        stream.context().bind_to_thread()?;
        // Synchronous allocation and memset: not beside a capture on this GPU.
        let _sync = super::capture_lock::may_sync(stream.context().ordinal());
        // SAFETY: the context is current; the pointer is owned by the slice built from
        // it below and freed exactly once, in Drop, with cuMemFree (it came from cuMemAlloc).
        let slice = unsafe {
            let ptr = result::malloc_sync(bytes)?;
            if let Err(e) = result::memset_d8_sync(ptr, 0, bytes) {
                let _ = result::free_sync(ptr);
                return Err(e);
            }
            stream.upgrade_device_ptr::<u8>(ptr, bytes)
        };
        Ok(KvBuffer { slice: ManuallyDrop::new(slice), stream: stream.clone() })
    }
}

impl Deref for KvBuffer {
    type Target = CudaSlice<u8>;

    fn deref(&self) -> &CudaSlice<u8> {
        &self.slice
    }
}

impl Drop for KvBuffer {
    fn drop(&mut self) {
        // SAFETY: taken once, here; `leak` waits for the slice's recorded uses, and the
        // stream is synchronised before the free so no queued work still reads it.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let ptr = slice.leak();
        let _ = self.stream.context().bind_to_thread();
        let _ = self.stream.synchronize();
        let _sync = super::capture_lock::may_sync(self.stream.context().ordinal());
        // SAFETY: allocated by cuMemAlloc in `zeroed`, freed only here.
        if let Err(e) = unsafe { result::free_sync(ptr) } {
            tracing::warn!(error = %e, "freeing KV device memory failed");
        }
    }
}
