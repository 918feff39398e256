//! GPU-to-GPU copy bandwidth (`cuMemcpyPeerAsync`), the ceiling a KV transfer between
//! two GPUs is compared with (`sluice bench transfer --devices cuda:0,cuda:1`).

use cudarc::driver::sys;

use super::CudaBackend;
use super::runtime::fail;
use crate::EntryDtype;
use crate::backend::Backend;

/// GB/s (10⁹ B/s of bytes moved) of copying `bytes` from `from` to `to` in pieces of
/// `piece` bytes (a KV page each, as a transfer moves them), median of `reps` timed
/// rounds after one warm-up; timed with events on the source GPU's stream.
pub fn peer_copy_gbs(from: &CudaBackend, to: &CudaBackend, bytes: usize, piece: usize, reps: usize) -> f64 {
    // Peer access both ways (without it the driver stages peer copies through host
    // memory); an error for an already enabled pair is expected and ignored.
    for (a, b) in [(from, to), (to, from)] {
        if a.ordinal() != b.ordinal() {
            a.gpu().ctx.bind_to_thread().unwrap_or_else(|e| fail("bind context", e));
            // SAFETY: both contexts are live for the call; the flag must be 0.
            let _ = unsafe { sys::cuCtxEnablePeerAccess(b.gpu().ctx.cu_ctx(), 0) };
        }
    }
    let src = from.kv_alloc(bytes, EntryDtype::Fp8);
    let dst = to.kv_alloc(bytes, EntryDtype::Fp8);
    from.synchronize();
    to.synchronize();
    let (s, d) = (from.gpu(), to.gpu());
    let (sp, dp) = (s.ptr(&src.mem), d.ptr(&dst.mem));
    let piece = piece.clamp(1, bytes.max(1));
    let round = || {
        s.ctx.bind_to_thread().unwrap_or_else(|e| fail("bind context", e));
        for at in (0..bytes).step_by(piece) {
            let n = piece.min(bytes - at);
            // SAFETY: both ranges lie inside the live allocations made above; the copy
            // is ordered on the source's stream, which is synchronised before they go.
            let r = unsafe {
                if from.ordinal() == to.ordinal() {
                    sys::cuMemcpyDtoDAsync_v2(dp + at as u64, sp + at as u64, n, s.stream.cu_stream())
                } else {
                    sys::cuMemcpyPeerAsync(
                        dp + at as u64,
                        d.ctx.cu_ctx(),
                        sp + at as u64,
                        s.ctx.cu_ctx(),
                        n,
                        s.stream.cu_stream(),
                    )
                }
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                fail("peer copy", format!("{r:?}"));
            }
        }
    };
    round();
    let mut ms: Vec<f32> = (0..reps.max(1)).map(|_| from.time_ms(round).1).collect();
    ms.sort_by(f32::total_cmp);
    let median = ms[ms.len() / 2] as f64;
    from.synchronize();
    bytes as f64 / (median / 1e3) / 1e9
}
