//! Merging puts that continue one another into one put.
//!
//! A KV transfer is a put per 128-token page, and a sequence's pages usually sit side by
//! side on both ends (the page pools hand out ascending runs). Each put costs UCX a
//! request and, between GPUs, a copy and an event of its own, which at ~0.5 MB a page
//! is a fifth of the time the bytes take over NVLink (docs/perf.md). Puts whose local
//! bytes and remote addresses both continue the previous put's, from the same
//! allocation and with the same memory handle, go out as one.
//!
//! Only GPU memory is merged. Host puts over shared memory are memory copies either
//! way, and one large put measured 5–10% slower than the same bytes page by page
//! (`sluice bench transfer --pages 512 --tls shm` with and without `--scatter`, 2
//! cores: 8.6 against 9.1–9.8 GB/s), so host pages keep a put each.

use crate::memory::{LocalRange, MemoryType};
use crate::raw;

/// One put before merging: its local range, the memory handle that goes with it, the
/// remote address, and which allocation the local range lies in (device ranges only
/// merge within one allocation: cuda_ipc maps allocations one by one).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Put {
    pub local: LocalRange,
    pub memh: Option<raw::ucp_mem_h>,
    pub remote: u64,
    pub allocation: u64,
}

/// `puts` with every put that continues the one before it merged into it, in order.
/// Empty puts are dropped.
pub(crate) fn coalesce(puts: &[Put]) -> Vec<Put> {
    let mut out: Vec<Put> = Vec::with_capacity(puts.len());
    for p in puts.iter().filter(|p| p.local.len > 0) {
        if let Some(last) = out.last_mut()
            && continues(last, p)
        {
            last.local.len += p.local.len;
            continue;
        }
        out.push(*p);
    }
    out
}

fn continues(last: &Put, next: &Put) -> bool {
    let len = last.local.len as u64;
    last.local.memory == MemoryType::Cuda
        && next.local.memory == MemoryType::Cuda
        && last.allocation == next.allocation
        && last.memh == next.memh
        && last.local.addr.checked_add(len) == Some(next.local.addr)
        && last.remote.checked_add(len) == Some(next.remote)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(addr: u64, len: usize, remote: u64, memory: MemoryType, allocation: u64) -> Put {
        Put { local: LocalRange { addr, len, memory }, memh: None, remote, allocation }
    }

    fn spans(puts: &[Put]) -> Vec<(u64, usize, u64)> {
        puts.iter().map(|p| (p.local.addr, p.local.len, p.remote)).collect()
    }

    #[test]
    fn runs_that_continue_on_both_ends_become_one_put() {
        let cuda = MemoryType::Cuda;
        // Pages 0, 1, 2 to remote pages 7, 8, 9; then page 3 to remote page 4 (a new
        // run); then page 5 (a gap on the local end) to remote page 5.
        let puts = [
            put(1000, 100, 7000, cuda, 1000),
            put(1100, 100, 7100, cuda, 1000),
            put(1200, 100, 7200, cuda, 1000),
            put(1300, 100, 4000, cuda, 1000),
            put(1500, 100, 4100, cuda, 1000),
        ];
        assert_eq!(spans(&coalesce(&puts)), vec![(1000, 300, 7000), (1300, 100, 4000), (1500, 100, 4100)]);
    }

    #[test]
    fn puts_from_different_allocations_memory_types_or_handles_stay_apart() {
        let (cuda, host) = (MemoryType::Cuda, MemoryType::Host);
        let apart = [put(1000, 100, 0, cuda, 1000), put(1100, 100, 100, cuda, 1100)];
        assert_eq!(coalesce(&apart).len(), 2, "two allocations that happen to touch");
        let kinds = [put(1000, 100, 0, cuda, 0), put(1100, 100, 100, host, 0)];
        assert_eq!(coalesce(&kinds).len(), 2, "device then host memory");
        let mut handles = [put(1000, 100, 0, cuda, 1000), put(1100, 100, 100, cuda, 1000)];
        handles[1].memh = Some(std::ptr::NonNull::dangling().as_ptr());
        assert_eq!(coalesce(&handles).len(), 2, "one registered, one not");
    }

    #[test]
    fn host_puts_keep_a_put_each() {
        let host = MemoryType::Host;
        let puts = [put(1000, 100, 0, host, 0), put(1100, 100, 100, host, 0)];
        assert_eq!(coalesce(&puts).len(), 2);
    }

    #[test]
    fn out_of_order_and_empty_puts_are_not_merged_backwards() {
        let cuda = MemoryType::Cuda;
        let puts = [put(200, 100, 200, cuda, 0), put(100, 100, 100, cuda, 0), put(300, 0, 300, cuda, 0)];
        assert_eq!(spans(&coalesce(&puts)), vec![(200, 100, 200), (100, 100, 100)]);
        let total: usize = coalesce(&puts).iter().map(|p| p.local.len).sum();
        assert_eq!(total, 200, "no byte lost or repeated");
    }
}
