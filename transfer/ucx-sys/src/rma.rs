//! One-sided puts and gets.
//!
//! The safe calls ([`Worker::put_all`], [`Worker::put_blocking`],
//! [`Worker::get_blocking`]) borrow their buffers for the whole call and return only
//! once UCX is done with them. The `unsafe` [`Endpoint::put`]/[`Endpoint::get`] return a
//! [`Pending`] and leave the buffer's lifetime to the caller.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use crate::coalesce::{Put, coalesce};
use crate::endpoint::Endpoint;
use crate::memory::{LocalRange, MemoryType, Source};
use crate::raw;
use crate::request::Pending;
use crate::rkey::RemoteKey;
use crate::status::UcxError;
use crate::worker::Worker;

/// Request parameters that name the local buffer's memory type (host buffers leave it
/// unset, as before: UCX detects it).
fn param_for(memory: MemoryType, memh: Option<raw::ucp_mem_h>) -> raw::ucp_request_param_t {
    let mut p = raw::ucp_request_param_t::empty();
    if memory != MemoryType::Host {
        p.op_attr_mask |= raw::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        p.memory_type = memory.raw();
    }
    if let Some(memh) = memh {
        p.op_attr_mask |= raw::UCP_OP_ATTR_FIELD_MEMH;
        p.memh = memh;
    }
    p
}

impl Endpoint {
    /// Starts writing the local range `local` (host or GPU memory) to `remote_addr` in
    /// the peer region of `rkey`, as [`Endpoint::put`].
    ///
    /// # Safety
    /// `local` must be live memory of its type, unmodified until the returned
    /// [`Pending`] has been waited for or dropped.
    pub unsafe fn put_range(&self, local: LocalRange, remote_addr: u64, rkey: &RemoteKey) -> Result<Pending, UcxError> {
        // SAFETY: the caller's guarantees, passed on.
        unsafe { self.put_range_with(local, None, remote_addr, rkey) }
    }

    /// [`Endpoint::put_range`] with the local memory's handle, when it is registered with
    /// this endpoint's context.
    ///
    /// # Safety
    /// As [`Endpoint::put_range`]; `memh` must be live and cover `local`.
    pub(crate) unsafe fn put_range_with(
        &self,
        local: LocalRange,
        memh: Option<raw::ucp_mem_h>,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Pending, UcxError> {
        let ep = self.inner.live()?;
        let handle = rkey.handle_for(self, remote_addr, local.len)?;
        let param = param_for(local.memory, memh);
        // SAFETY: ep and the rkey are live and belong together (checked above); the remote
        // range lies inside the region; the caller keeps `local` valid until the request
        // finishes.
        let ptr = unsafe { raw::ucp_put_nbx(ep, local.addr as *const c_void, local.len, remote_addr, handle, &param) };
        Pending::issued_rma(ptr, &rkey.inner, "ucp_put_nbx")
    }

    /// Starts reading `local.len` bytes at `remote_addr` of the peer region of `rkey`
    /// into the local range (host or GPU memory), as [`Endpoint::get`].
    ///
    /// # Safety
    /// `local` must be live memory of its type, neither read nor written until the
    /// returned [`Pending`] has been waited for or dropped.
    pub unsafe fn get_range(&self, local: LocalRange, remote_addr: u64, rkey: &RemoteKey) -> Result<Pending, UcxError> {
        let ep = self.inner.live()?;
        let handle = rkey.handle_for(self, remote_addr, local.len)?;
        let param = param_for(local.memory, None);
        // SAFETY: as for put_range.
        let ptr = unsafe { raw::ucp_get_nbx(ep, local.addr as *mut c_void, local.len, remote_addr, handle, &param) };
        Pending::issued_rma(ptr, &rkey.inner, "ucp_get_nbx")
    }

    /// Starts writing `local` to `remote_addr` in the peer region of `rkey`.
    ///
    /// Completion of the returned request means `local` may be reused; the bytes are
    /// guaranteed to be at the peer only after a flush ([`Endpoint::flush`]).
    ///
    /// # Safety
    /// `local` must stay valid and unmodified until the returned [`Pending`] has been
    /// waited for or dropped. Leaking the `Pending` (e.g. `mem::forget`) leaves UCX free
    /// to read `local` at any later time.
    pub unsafe fn put(&self, local: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<Pending, UcxError> {
        let ep = self.inner.live()?;
        let handle = rkey.handle_for(self, remote_addr, local.len())?;
        let param = raw::ucp_request_param_t::empty();
        // SAFETY: ep and the rkey are live and belong together (checked above); the remote
        // range lies inside the region; the caller keeps `local` valid until the request
        // finishes.
        let ptr =
            unsafe { raw::ucp_put_nbx(ep, local.as_ptr().cast::<c_void>(), local.len(), remote_addr, handle, &param) };
        Pending::issued_rma(ptr, &rkey.inner, "ucp_put_nbx")
    }

    /// Starts reading `local.len()` bytes at `remote_addr` in the peer region of `rkey`
    /// into `local`. The data is in `local` once the returned request completes.
    ///
    /// # Safety
    /// `local` must stay valid, and must be neither read nor written, until the returned
    /// [`Pending`] has been waited for or dropped. Leaking the `Pending` leaves UCX free
    /// to write `local` at any later time.
    pub unsafe fn get(&self, local: &mut [u8], remote_addr: u64, rkey: &RemoteKey) -> Result<Pending, UcxError> {
        let ep = self.inner.live()?;
        let handle = rkey.handle_for(self, remote_addr, local.len())?;
        let param = raw::ucp_request_param_t::empty();
        // SAFETY: as for put; the caller keeps `local` valid and untouched until the
        // request finishes.
        let ptr = unsafe {
            raw::ucp_get_nbx(ep, local.as_mut_ptr().cast::<c_void>(), local.len(), remote_addr, handle, &param)
        };
        Pending::issued_rma(ptr, &rkey.inner, "ucp_get_nbx")
    }
}

impl Worker {
    /// Writes every `(local, remote_addr)` pair into the region of `rkey`, then flushes
    /// `ep`: when this returns `Ok`, all bytes are at the peer. All puts are issued before
    /// waiting, so they overlap on the wire; ordering between them is not guaranteed, only
    /// that all precede the flush.
    ///
    /// Every range is checked against the region before anything is sent. On timeout
    /// the endpoint is closed, by force with [`ErrorMode::Peer`](crate::ErrorMode::Peer)
    /// (outstanding puts are cancelled, so the buffers are free again); connect again to
    /// retry.
    pub fn put_all(
        &self,
        ep: &Endpoint,
        puts: &[(&[u8], u64)],
        rkey: &RemoteKey,
        timeout: Duration,
    ) -> Result<(), UcxError> {
        let ranges: Vec<(LocalRange, u64)> = puts.iter().map(|(b, at)| (LocalRange::host(b), *at)).collect();
        // SAFETY: `puts` borrows every host buffer for the whole call, and put_ranges
        // returns only once UCX is done with them.
        unsafe { self.put_ranges(ep, &ranges, rkey, timeout) }
    }

    /// [`Worker::put_all`] for local bytes in host memory or held device memory (GPU
    /// memory needs a CUDA-enabled libucx: [`Context::supports`](crate::Context::supports))
    /// into several regions of one peer, a batch per remote key, all issued before one
    /// flush: one round trip for a sequence's pages, rings, compressor slots and logits
    /// instead of one per region. GPU-memory puts that continue one another on both ends
    /// (and lie in one allocation) go out as one (module `coalesce`); returns how many
    /// puts were issued.
    pub fn put_batches(
        &self,
        ep: &Endpoint,
        batches: &[(&RemoteKey, &[(Source<'_>, u64)])],
        timeout: Duration,
    ) -> Result<usize, UcxError> {
        let mut ranges = Vec::new();
        for (rkey, puts) in batches {
            let each = puts
                .iter()
                .map(|(s, at)| {
                    s.range().map(|(local, memh)| Put { local, memh, remote: *at, allocation: s.allocation() })
                })
                .collect::<Result<Vec<_>, _>>()?;
            ranges.extend(coalesce(&each).into_iter().map(|p| (p.local, p.memh, p.remote, *rkey)));
        }
        // SAFETY: host sources are borrowed for the whole call; device sources are held by
        // their handles or registrations (live device memory while borrowed), checked to lie
        // inside them above; a merged range spans device sources that continue one another
        // in one allocation, so it is live memory too; put_all_ranges returns only once UCX
        // is done with every range.
        unsafe { self.put_all_ranges(ep, &ranges, timeout) }?;
        Ok(ranges.len())
    }

    /// [`Worker::put_all`] for local ranges of any memory type (GPU memory with a
    /// CUDA-enabled libucx).
    ///
    /// # Safety
    /// Every range must be live memory of its type, unmodified for the whole call.
    pub unsafe fn put_ranges(
        &self,
        ep: &Endpoint,
        puts: &[(LocalRange, u64)],
        rkey: &RemoteKey,
        timeout: Duration,
    ) -> Result<(), UcxError> {
        let puts: Vec<_> = puts.iter().map(|(l, at)| (*l, None, *at, rkey)).collect();
        // SAFETY: the caller's guarantees, passed on.
        unsafe { self.put_all_ranges(ep, &puts, timeout) }
    }

    /// Issues every put (each range with its memory handle where it has one, into the
    /// region of its remote key), then flushes `ep` once.
    ///
    /// # Safety
    /// As [`Worker::put_ranges`]; every handle must be live and cover its range.
    #[allow(clippy::type_complexity)]
    unsafe fn put_all_ranges(
        &self,
        ep: &Endpoint,
        puts: &[(LocalRange, Option<raw::ucp_mem_h>, u64, &RemoteKey)],
        timeout: Duration,
    ) -> Result<(), UcxError> {
        self.owns(&ep.inner.worker)?;
        for (local, _, remote_addr, rkey) in puts {
            rkey.handle_for(ep, *remote_addr, local.len)?;
        }
        let deadline = Instant::now() + timeout;
        let mut issued = Vec::with_capacity(puts.len());
        let mut result = Ok(());
        for (local, memh, remote_addr, rkey) in puts.iter().filter(|(local, ..)| local.len > 0) {
            // SAFETY: the caller keeps every range valid for the whole call, and every
            // Pending is finished (waited for, or given up after closing the endpoint)
            // before we return: below, or by its Drop if we return early.
            match unsafe { ep.put_range_with(*local, *memh, *remote_addr, rkey) } {
                Ok(pending) => issued.push(pending),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_ok() {
            result = ep.flush_pending("ucp_ep_flush_nbx (after puts)").and_then(|f| f.wait_until(deadline));
        }
        if result.as_ref().is_err_and(UcxError::is_timeout) {
            // Cancels the puts still in flight, so the loop below ends at once.
            ep.inner.force_close();
        }
        // After a successful flush every put has completed.
        for pending in issued {
            let status = pending.wait_until(deadline);
            result = result.and(status);
        }
        result
    }

    /// Reads every `(local, remote_addr)` range from the region of `rkey` (host or GPU
    /// memory locally); returns once all of them have landed. On timeout the endpoint is
    /// closed, as for [`Worker::put_all`].
    ///
    /// # Safety
    /// Every range must be live memory of its type, neither read nor written for the
    /// whole call.
    pub unsafe fn get_ranges(
        &self,
        ep: &Endpoint,
        gets: &[(LocalRange, u64)],
        rkey: &RemoteKey,
        timeout: Duration,
    ) -> Result<(), UcxError> {
        self.owns(&ep.inner.worker)?;
        for (local, remote_addr) in gets {
            rkey.handle_for(ep, *remote_addr, local.len)?;
        }
        let deadline = Instant::now() + timeout;
        let mut issued = Vec::with_capacity(gets.len());
        let mut result = Ok(());
        for (local, remote_addr) in gets.iter().filter(|(local, _)| local.len > 0) {
            // SAFETY: as in put_ranges; each Pending is finished before we return.
            match unsafe { ep.get_range(*local, *remote_addr, rkey) } {
                Ok(pending) => issued.push(pending),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        for pending in issued {
            let status = pending.wait_until(deadline);
            if status.as_ref().is_err_and(UcxError::is_timeout) {
                ep.inner.force_close();
            }
            result = result.and(status);
        }
        result
    }

    /// [`Worker::put_all`] for a single buffer: returns once the bytes are at the peer.
    pub fn put_blocking(
        &self,
        ep: &Endpoint,
        local: &[u8],
        remote_addr: u64,
        rkey: &RemoteKey,
        timeout: Duration,
    ) -> Result<(), UcxError> {
        self.put_all(ep, &[(local, remote_addr)], rkey, timeout)
    }

    /// Reads `local.len()` bytes at `remote_addr` in the region of `rkey` into `local`.
    /// On timeout the endpoint is closed, as for [`Worker::put_all`].
    pub fn get_blocking(
        &self,
        ep: &Endpoint,
        local: &mut [u8],
        remote_addr: u64,
        rkey: &RemoteKey,
        timeout: Duration,
    ) -> Result<(), UcxError> {
        self.owns(&ep.inner.worker)?;
        let deadline = Instant::now() + timeout;
        // SAFETY: `local` is borrowed mutably for the whole call and the Pending is
        // finished (or given up after closing the endpoint) before we return.
        let pending = unsafe { ep.get(local, remote_addr, rkey) }?;
        pending.wait_until(deadline)
    }
}
