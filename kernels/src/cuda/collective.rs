//! Moving rows between the GPUs of a sharded backend ([`crate::sharded::Collective`]).
//!
//! - [`Nccl`]: NCCL point-to-point sends and receives in one group per exchange, one
//!   communicator per GPU made by `ncclCommInitAll` (one process drives every GPU, so
//!   every call of a group is issued from this thread). NCCL is loaded at run time like
//!   the rest of CUDA; its own transport choice (NVLink, PCIe, shared memory) applies.
//! - [`PeerCopies`]: `cuMemcpyPeerAsync` (or a device-local copy), ordered by events
//!   between the two GPUs' streams. Works for any ranks, including several on one GPU
//!   (NCCL refuses a GPU twice), which is how the parity tests run the layout on one
//!   device.
//!
//! Both keep the trait's order of sums: each GPU adds the contributions in rank order
//! with the `add_into` kernel, so results do not depend on the transport.
//!
//! [`Nccl::all_to_all`] is the other way to run expert parallelism's exchange: each rank
//! sends each peer only the rows routed to the experts that peer holds (dispatch), and
//! the same counts transposed bring the experts' outputs back (combine). The sharded MoE
//! does not use it; `sluice bench collectives` times it against the all-gather and
//! reduce-scatter (docs/engine.md, "Dispatch"), with [`time_ms`] as its clock.

use cudarc::driver::sys;

use super::CudaBackend;
use super::memory::CudaBuf;
use super::runtime::{CudaError, fail};
use crate::backend::Backend;
use crate::sharded::Collective;

/// The collective for `ranks`: NCCL when every rank is a different GPU and NCCL loads
/// (unless `SLUICE_COLLECTIVE=copy`), peer copies otherwise. Says which in the log.
pub fn for_devices(ranks: &[CudaBackend]) -> Box<dyn Collective<CudaBackend>> {
    let mut ordinals: Vec<usize> = ranks.iter().map(|b| b.ordinal()).collect();
    ordinals.sort_unstable();
    let distinct = ordinals.windows(2).all(|w| w[0] != w[1]);
    let wanted = std::env::var("SLUICE_COLLECTIVE").unwrap_or_default();
    if distinct && wanted != "copy" {
        match Nccl::new(ranks) {
            Ok(n) => return Box::new(n),
            Err(e) => tracing::warn!("NCCL unavailable ({e}); GPUs exchange rows by peer copies"),
        }
    }
    PeerCopies::enable_peer_access(ranks);
    Box::new(PeerCopies)
}

/// Copy `len` f32 values from `src` (on `from`) at `src_at` into `dst` (on `to`) at
/// `dst_at`, ordered after the work issued so far on both streams and before the work
/// issued after it on both.
fn copy(from: &CudaBackend, src: &CudaBuf, src_at: usize, to: &CudaBackend, dst: &CudaBuf, dst_at: usize, len: usize) {
    if len == 0 {
        return;
    }
    assert!(src_at + len <= src.len && dst_at + len <= dst.len, "copy out of range");
    let (s, d) = (from.gpu(), to.gpu());
    // Events and peer copies are not recorded: both ranks issue what they recorded first.
    s.cut_segment();
    d.cut_segment();
    let (sp, dp) = (s.ptr(&src.mem) + 4 * src_at as u64, d.ptr(&dst.mem) + 4 * dst_at as u64);
    let bytes = 4 * len;
    let no_timing = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
    let same_stream = std::ptr::eq(from, to);
    if !same_stream {
        // The destination's allocation and earlier writes first.
        let ready = d.stream.record_event(no_timing).unwrap_or_else(|e| fail("event record", e));
        s.stream.wait(&ready).unwrap_or_else(|e| fail("stream wait", e));
    }
    s.ctx.bind_to_thread().unwrap_or_else(|e| fail("bind context", e));
    // SAFETY: both ranges lie inside live allocations (checked above); the copy is
    // ordered on the source's stream, which frees the source only after it, and the
    // destination's stream waits for it below before anything reads or frees `dst`.
    let r = unsafe {
        if from.ordinal() == to.ordinal() {
            sys::cuMemcpyDtoDAsync_v2(dp, sp, bytes, s.stream.cu_stream())
        } else {
            sys::cuMemcpyPeerAsync(dp, d.ctx.cu_ctx(), sp, s.ctx.cu_ctx(), bytes, s.stream.cu_stream())
        }
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        fail("peer copy", format!("{r:?}"));
    }
    if !same_stream {
        let done = s.stream.record_event(no_timing).unwrap_or_else(|e| fail("event record", e));
        d.stream.wait(&done).unwrap_or_else(|e| fail("stream wait", e));
    }
}

/// Prefix sums of `counts`.
fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &n| {
            let o = *at;
            *at += n;
            Some(o)
        })
        .collect()
}

/// Device `d`'s block of the sum: contributions of ranks 0, 1, … in order.
fn sum_block(ranks: &[CudaBackend], d: usize, blocks: Vec<CudaBuf>) -> CudaBuf {
    let b = &ranks[d];
    let mut it = blocks.into_iter();
    let mut acc = it.next().expect("at least one rank");
    for block in it {
        b.add_into(&mut acc, &block);
    }
    acc
}

/// Device copies between the GPUs' streams (see the module docs).
#[derive(Debug)]
pub struct PeerCopies;

impl PeerCopies {
    /// Let every pair of distinct GPUs read each other's memory directly (NVLink or
    /// PCIe peer access), where the hardware allows; copies work without it, staged.
    fn enable_peer_access(ranks: &[CudaBackend]) {
        // Mapping another GPU's memory changes the contexts: not beside a capture.
        let _sync: Vec<_> = ranks.iter().map(|b| super::capture_lock::may_sync(b.ordinal())).collect();
        for a in ranks {
            for b in ranks {
                if a.ordinal() == b.ordinal() {
                    continue;
                }
                a.gpu().ctx.bind_to_thread().unwrap_or_else(|e| fail("bind context", e));
                // SAFETY: plain driver call on live contexts; "already enabled" is fine.
                let r = unsafe { sys::cuCtxEnablePeerAccess(b.gpu().ctx.cu_ctx(), 0) };
                if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                    tracing::warn!(from = a.ordinal(), to = b.ordinal(), "no peer access ({r:?}); copies are staged");
                }
            }
        }
    }
}

impl Collective<CudaBackend> for PeerCopies {
    fn name(&self) -> &'static str {
        "peer copies"
    }

    fn all_gather(&self, ranks: &[CudaBackend], parts: &[&CudaBuf], counts: &[usize]) -> Vec<CudaBuf> {
        let at = offsets(counts);
        let total: usize = counts.iter().sum();
        ranks
            .iter()
            .map(|d| {
                let out = d.output(total);
                for (s, (src, part)) in ranks.iter().zip(parts).enumerate() {
                    copy(src, part, 0, d, &out, at[s], counts[s]);
                }
                out
            })
            .collect()
    }

    fn reduce_scatter(&self, ranks: &[CudaBackend], partials: &[CudaBuf], counts: &[usize]) -> Vec<CudaBuf> {
        let at = offsets(counts);
        (0..ranks.len())
            .map(|d| {
                let blocks = ranks
                    .iter()
                    .zip(partials)
                    .map(|(src, p)| {
                        let block = ranks[d].output(counts[d]);
                        copy(src, p, at[d], &ranks[d], &block, 0, counts[d]);
                        block
                    })
                    .collect();
                sum_block(ranks, d, blocks)
            })
            .collect()
    }
}

/// NCCL communicators, one per GPU, on the GPUs' own streams (see the module docs).
pub struct Nccl {
    comms: Vec<cudarc::nccl::Comm>,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nccl({} ranks)", self.comms.len())
    }
}

// SAFETY: the communicators are only used from the thread that calls the collective
// (one call at a time: the sharded backend issues ops in order from one thread), which
// is how `ncclCommInitAll` communicators may be driven.
unsafe impl Send for Nccl {}
// SAFETY: as above; `&self` methods issue NCCL calls, never concurrently.
unsafe impl Sync for Nccl {}

impl Nccl {
    pub fn new(ranks: &[CudaBackend]) -> Result<Self, CudaError> {
        // SAFETY: dlopen probe only.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(CudaError::NoLibrary("libnccl"));
        }
        // NCCL's set-up allocates device and pinned memory: not beside a capture.
        let _sync: Vec<_> = ranks.iter().map(|b| super::capture_lock::may_sync(b.ordinal())).collect();
        let streams = ranks.iter().map(|b| b.gpu().stream.clone()).collect();
        let comms = cudarc::nccl::Comm::from_devices(streams).map_err(|e| CudaError::Driver(format!("NCCL: {e:?}")))?;
        Ok(Nccl { comms })
    }

    /// Issue `f` for every rank inside one NCCL group, after what each rank has recorded
    /// of a step (NCCL calls are not recorded; the recording goes on after them).
    fn group(&self, ranks: &[CudaBackend], f: impl FnOnce()) {
        ranks.iter().for_each(|b| b.gpu().cut_segment());
        cudarc::nccl::result::group_start().unwrap_or_else(|e| fail("ncclGroupStart", e));
        f();
        cudarc::nccl::result::group_end().unwrap_or_else(|e| fail("ncclGroupEnd", e));
    }

    /// Send `len` values of `src` at `src_at` from rank `from` to rank `to`, where they
    /// land in `dst` at `dst_at` (a local copy when `from == to`). Inside a group.
    #[allow(clippy::too_many_arguments)]
    fn send_recv(
        &self,
        ranks: &[CudaBackend],
        from: usize,
        src: &CudaBuf,
        src_at: usize,
        to: usize,
        dst: &mut CudaBuf,
        dst_at: usize,
        len: usize,
    ) {
        if len == 0 {
            return;
        }
        if from == to {
            copy(&ranks[from], src, src_at, &ranks[to], dst, dst_at, len);
            return;
        }
        // Both on the ranks' own streams: the sender frees `src` after the send, the
        // receiver reads or frees `dst` after the receive.
        let s = src.mem.slice(src_at..src_at + len);
        self.comms[from].send(&s, to as i32).unwrap_or_else(|e| fail("ncclSend", e));
        let mut d = dst.mem.slice_mut(dst_at..dst_at + len);
        self.comms[to].recv(&mut d, from as i32).unwrap_or_else(|e| fail("ncclRecv", e));
    }
}

impl Collective<CudaBackend> for Nccl {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn all_gather(&self, ranks: &[CudaBackend], parts: &[&CudaBuf], counts: &[usize]) -> Vec<CudaBuf> {
        let at = offsets(counts);
        let total: usize = counts.iter().sum();
        let mut outs: Vec<CudaBuf> = ranks.iter().map(|b| b.output(total)).collect();
        CudaBackend::prof_all(ranks, "nccl: all-gather", || {
            self.group(ranks, || {
                for (d, out) in outs.iter_mut().enumerate() {
                    for (s, part) in parts.iter().enumerate() {
                        self.send_recv(ranks, s, part, 0, d, out, at[s], counts[s]);
                    }
                }
            })
        });
        outs
    }

    fn reduce_scatter(&self, ranks: &[CudaBackend], partials: &[CudaBuf], counts: &[usize]) -> Vec<CudaBuf> {
        let at = offsets(counts);
        let mut blocks: Vec<Vec<CudaBuf>> =
            (0..ranks.len()).map(|d| ranks.iter().map(|_| ranks[d].output(counts[d])).collect()).collect();
        CudaBackend::prof_all(ranks, "nccl: reduce-scatter", || {
            self.group(ranks, || {
                for (d, mine) in blocks.iter_mut().enumerate() {
                    for (s, (p, block)) in partials.iter().zip(mine.iter_mut()).enumerate() {
                        self.send_recv(ranks, s, p, at[d], d, block, 0, counts[d]);
                    }
                }
            })
        });
        blocks.into_iter().enumerate().map(|(d, b)| sum_block(ranks, d, b)).collect()
    }
}

/// Where each block of an all-to-all lies: `(send_at, recv_at)`, `send_at[r][s]` the
/// offset in rank `r`'s send buffer of its block for `s` (blocks by destination),
/// `recv_at[s][r]` the offset in rank `s`'s receive buffer of the block from `r` (blocks
/// by source). `counts[r][s]` is what `r` sends `s`.
pub fn all_to_all_offsets(counts: &[Vec<usize>]) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
    let n = counts.len();
    assert!(counts.iter().all(|c| c.len() == n), "all_to_all: counts must be ranks × ranks");
    let send_at = counts.iter().map(|c| offsets(c)).collect();
    let recv_at = (0..n).map(|s| offsets(&counts.iter().map(|c| c[s]).collect::<Vec<_>>())).collect();
    (send_at, recv_at)
}

impl Nccl {
    /// All-to-all of variable counts: rank `r` sends `counts[r][s]` values of `sends[r]`
    /// (its blocks laid out by destination, see [`all_to_all_offsets`]) to every rank `s`,
    /// which gets them in a buffer of its own laid out by source. One NCCL group of
    /// point-to-point calls; a rank's block for itself is a device copy (a dispatch that
    /// keeps its local rows in place gives it 0). The buffers read stay valid because
    /// every transfer is ordered on both ranks' streams before the work issued next.
    pub fn all_to_all(&self, ranks: &[CudaBackend], sends: &[&CudaBuf], counts: &[Vec<usize>]) -> Vec<CudaBuf> {
        let mut recvs: Vec<CudaBuf> =
            (0..ranks.len()).map(|s| ranks[s].output(counts.iter().map(|c| c[s]).sum())).collect();
        self.all_to_all_into(ranks, sends, counts, &mut recvs);
        recvs
    }

    /// [`Nccl::all_to_all`] into buffers the caller keeps (reused across layers, or with
    /// room past the blocks, which is left as it was).
    pub fn all_to_all_into(
        &self,
        ranks: &[CudaBackend],
        sends: &[&CudaBuf],
        counts: &[Vec<usize>],
        recvs: &mut [CudaBuf],
    ) {
        let n = ranks.len();
        assert!(sends.len() == n && recvs.len() == n && counts.len() == n, "all_to_all: one buffer per rank");
        let (send_at, recv_at) = all_to_all_offsets(counts);
        for r in 0..n {
            let out: usize = counts[r].iter().sum();
            let into: usize = counts.iter().map(|c| c[r]).sum();
            assert!(sends[r].len >= out, "all_to_all: rank {r} sends {out} values from a buffer of {}", sends[r].len);
            assert!(recvs[r].len >= into, "all_to_all: rank {r} gets {into} values into a buffer of {}", recvs[r].len);
        }
        self.group(ranks, || {
            for (s, recv) in recvs.iter_mut().enumerate() {
                for r in 0..n {
                    self.send_recv(ranks, r, sends[r], send_at[r][s], s, recv, recv_at[s][r], counts[r][s]);
                }
            }
        });
    }
}

/// Device time of what `f` issues on the ranks' streams, in milliseconds: events on
/// every stream around it (after waiting for earlier work), the longest span of any
/// rank, since an exchange is done when its last transfer is. Host issue time inside
/// `f` counts, as it does for the engine.
pub fn time_ms(ranks: &[CudaBackend], f: impl FnOnce()) -> f32 {
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let record = |b: &CudaBackend| b.gpu().stream.record_event(timing).unwrap_or_else(|e| fail("event record", e));
    ranks.iter().for_each(|b| b.gpu().sync());
    let starts: Vec<_> = ranks.iter().map(record).collect();
    f();
    let ends: Vec<_> = ranks.iter().map(record).collect();
    starts
        .iter()
        .zip(&ends)
        .map(|(s, e)| {
            e.synchronize().unwrap_or_else(|err| fail("event synchronize", err));
            s.elapsed_ms(e).unwrap_or_else(|err| fail("event timing", err))
        })
        .fold(0f32, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_to_all_blocks_go_by_destination_out_and_by_source_in() {
        // Rank 0 sends 1 to itself, 2 to rank 1, 0 to rank 2; rank 1: 3, 4, 5; rank 2: 6, 0, 7.
        let counts = vec![vec![1, 2, 0], vec![3, 4, 5], vec![6, 0, 7]];
        let (send_at, recv_at) = all_to_all_offsets(&counts);
        assert_eq!(send_at, vec![vec![0, 1, 3], vec![0, 3, 7], vec![0, 6, 6]]);
        // Rank 1 receives 2 from rank 0, then 4 from itself, then 0 from rank 2.
        assert_eq!(recv_at, vec![vec![0, 1, 4], vec![0, 2, 6], vec![0, 0, 5]]);
    }
}
