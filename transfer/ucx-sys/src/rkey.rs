//! Remote keys: permission to access a peer's memory region over one endpoint.

use std::ptr;
use std::rc::Rc;

use crate::endpoint::{Endpoint, EndpointInner};
use crate::envelope;
use crate::raw;
use crate::status::{UcxError, check};

pub(crate) struct RkeyInner {
    pub(crate) handle: raw::ucp_rkey_h,
    /// The endpoint the key was unpacked on; it stays open while the key lives.
    pub(crate) ep: Rc<EndpointInner>,
    /// The remote region, as packed by the peer's `MemRegion::pack_rkey`.
    base: u64,
    len: u64,
}

impl Drop for RkeyInner {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_ep_rkey_unpack and is destroyed once. Requests
        // using it hold this object, so none is outstanding. The endpoint is normally
        // still open (we hold it); if it was force-closed or explicitly closed earlier,
        // destroying the key afterwards is still sound in UCX 1.13, where
        // ucp_rkey_destroy touches only the key and the worker's memory pool
        // (src/ucp/core/ucp_rkey.c), and the worker outlives the endpoint we hold.
        unsafe { raw::ucp_rkey_destroy(self.handle) }
    }
}

/// A peer's memory region, usable for puts and gets on the endpoint it was unpacked on.
///
/// Knows the region's bounds, so [`Endpoint::put`]/[`Endpoint::get`] reject accesses
/// outside it instead of letting the transport write past the mapping. `!Send`.
pub struct RemoteKey {
    pub(crate) inner: Rc<RkeyInner>,
}

impl std::fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteKey({:#x}+{})", self.inner.base, self.inner.len)
    }
}

impl RemoteKey {
    /// The remote region's base address.
    pub fn base(&self) -> u64 {
        self.inner.base
    }

    /// The remote region's length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The key's handle, after checking it belongs to `ep` and that
    /// `remote_addr..remote_addr + len` lies inside the region.
    pub(crate) fn handle_for(&self, ep: &Endpoint, remote_addr: u64, len: usize) -> Result<raw::ucp_rkey_h, UcxError> {
        if !Rc::ptr_eq(&self.inner.ep, &ep.inner) {
            return Err(UcxError::new(
                raw::UCS_ERR_INVALID_PARAM,
                "remote key used on an endpoint it was not unpacked on",
            )
            .with_hint("unpack the peer's rkey on each endpoint that accesses it"));
        }
        let end = remote_addr.checked_add(len as u64);
        let region_end = self.inner.base + self.inner.len;
        if remote_addr < self.inner.base || end.is_none_or(|end| end > region_end) {
            return Err(UcxError::new(
                raw::UCS_ERR_OUT_OF_RANGE,
                format!(
                    "access of {len} bytes at {remote_addr:#x} is outside the remote region {:#x}..{region_end:#x}",
                    self.inner.base
                ),
            ));
        }
        Ok(self.inner.handle)
    }
}

impl Endpoint {
    /// Unpacks a peer's [`MemRegion::pack_rkey`](crate::MemRegion::pack_rkey) bytes for
    /// use on this endpoint.
    pub fn unpack_rkey(&self, packed: &[u8]) -> Result<RemoteKey, UcxError> {
        let opened = envelope::open::<2>(envelope::RKEY_MAGIC, "packed rkey", packed)?;
        let [base, len] = opened.fields;
        if base.checked_add(len).is_none() {
            return Err(UcxError::new(raw::UCS_ERR_INVALID_PARAM, "packed rkey describes a region past 2^64"));
        }
        let ep = self.inner.live()?;
        let mut handle = ptr::null_mut();
        // SAFETY: ep is open and owned by this thread; the payload is a complete,
        // checksummed UCX rkey in aligned storage that outlives the call; handle is an
        // out-pointer.
        let status = unsafe { raw::ucp_ep_rkey_unpack(ep, opened.payload_ptr().cast(), &mut handle) };
        check(status, "ucp_ep_rkey_unpack").map_err(|e| {
            if status == raw::UCS_ERR_UNREACHABLE {
                e.with_hint(
                    "this endpoint's transports cannot reach the region; with shm both processes must share /dev/shm",
                )
            } else {
                e
            }
        })?;
        Ok(RemoteKey { inner: Rc::new(RkeyInner { handle, ep: self.inner.clone(), base, len }) })
    }
}
