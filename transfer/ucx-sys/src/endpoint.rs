//! Endpoints: a connection from a worker to a peer worker.

use std::cell::Cell;
use std::ffi::c_void;
use std::ptr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use crate::envelope;
use crate::raw;
use crate::request::Pending;
use crate::status::{UcxError, check};
use crate::worker::{Worker, WorkerInner};

/// How long dropping an endpoint waits for its graceful close.
const DROP_CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// How an endpoint deals with its peer failing (`ucp_err_handling_mode_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorMode {
    /// `UCP_ERR_HANDLING_MODE_PEER`: a failed peer becomes errors on the endpoint
    /// ([`Endpoint::has_failed`]) instead of a hang, and a timed-out put or get can be
    /// cancelled by force-closing the endpoint. In UCX 1.13 only network transports (tcp,
    /// RDMA) support it; the shared-memory ones (posix, sysv, cma) do not, so with
    /// `UCX_TLS=shm` such a connect fails with `UCS_ERR_UNREACHABLE`.
    Peer,
    /// `UCP_ERR_HANDLING_MODE_NONE`: no failure detection, which lets UCX 1.13 use shared
    /// memory. Peer failure is undefined behaviour in UCX's terms, and an unfinished
    /// put/get cannot be cancelled: giving one up waits for it a further 10 s and then
    /// aborts the process rather than release a buffer UCX may still use. Over shared
    /// memory, puts and gets are synchronous copies, so that does not arise there.
    None,
}

pub(crate) struct EndpointInner {
    pub(crate) worker: Rc<WorkerInner>,
    mode: ErrorMode,
    /// Null once closed.
    handle: Cell<raw::ucp_ep_h>,
    /// Written by [`on_peer_error`]; boxed so its address can be handed to UCX.
    failure: Box<Cell<raw::ucs_status_t>>,
    /// Puts/gets issued but not yet finished (see [`Pending`]).
    pub(crate) in_flight: Cell<usize>,
}

/// `ucp_err_handler_cb_t`: records the failure; later operations report it.
unsafe extern "C" fn on_peer_error(arg: *mut c_void, _ep: raw::ucp_ep_h, status: raw::ucs_status_t) {
    let failure = arg.cast::<Cell<raw::ucs_status_t>>();
    // SAFETY: arg is the EndpointInner's boxed cell. UCX calls this only from
    // ucp_worker_progress on the worker's thread, and never after ucp_ep_close_nbx, which
    // runs before the box is freed.
    unsafe { (*failure).set(status) };
}

impl EndpointInner {
    /// The handle, if the endpoint is open and has not failed.
    pub(crate) fn live(&self) -> Result<raw::ucp_ep_h, UcxError> {
        let ep = self.handle.get();
        if ep.is_null() {
            return Err(UcxError::new(raw::UCS_ERR_NOT_CONNECTED, "endpoint is closed")
                .with_hint("it was closed, or force-closed after a timed-out operation; connect again"));
        }
        let failure = self.failure.get();
        if failure != raw::UCS_OK {
            return Err(UcxError::new(failure, "endpoint failed earlier (peer error reported by UCX)"));
        }
        Ok(ep)
    }

    /// Closes without waiting for the peer. With [`ErrorMode::Peer`] outstanding
    /// operations complete with `UCS_ERR_CANCELED` during the next progress calls; with
    /// [`ErrorMode::None`] (where UCX forbids a forced close) they finish on their own.
    pub(crate) fn force_close(&self) {
        let _ = self.close(self.mode == ErrorMode::Peer, Duration::ZERO);
    }

    fn close(&self, force: bool, timeout: Duration) -> Result<(), UcxError> {
        let ep = self.handle.replace(ptr::null_mut());
        if ep.is_null() {
            return Ok(());
        }
        let mut param = raw::ucp_request_param_t::empty();
        param.op_attr_mask = raw::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = if force { raw::UCP_EP_CLOSE_FLAG_FORCE } else { 0 };
        // SAFETY: ep is open (the handle was non-null) and is closed exactly once, since
        // the handle was nulled above. Callers force only in ErrorMode::Peer, as UCX
        // requires.
        let ptr = unsafe { raw::ucp_ep_close_nbx(ep, &param) };
        let what = if force { "ucp_ep_close_nbx (force)" } else { "ucp_ep_close_nbx (flush)" };
        Pending::issued(ptr, &self.worker, None, what)?.wait_until(Instant::now() + timeout)
    }

    /// Graceful close, unless the endpoint failed or has puts/gets in flight: then a
    /// flush could not succeed (or would wait on buffers nobody tracks), so force if the
    /// mode allows it.
    fn close_gracefully(&self, timeout: Duration) -> Result<(), UcxError> {
        let force = self.failure.get() != raw::UCS_OK || self.in_flight.get() > 0;
        self.close(force && self.mode == ErrorMode::Peer, timeout)
    }
}

impl Drop for EndpointInner {
    fn drop(&mut self) {
        // Dropping cannot report errors; a close that times out is finished by UCX, at the
        // latest when the worker is destroyed.
        let _ = self.close_gracefully(DROP_CLOSE_TIMEOUT);
    }
}

/// A connection to a peer worker, created by [`Worker::connect`].
///
/// See [`ErrorMode`] for how it handles peer failure. `!Send`: use it on its worker's
/// thread only.
///
/// Dropping closes it gracefully (flushing outstanding operations, at most 5 s) once the
/// last [`RemoteKey`](crate::RemoteKey) unpacked on it is dropped too; use
/// [`Endpoint::close`] to choose the timeout and see the result.
pub struct Endpoint {
    pub(crate) inner: Rc<EndpointInner>,
}

impl Worker {
    /// Connects to the peer whose [`Worker::address`] is `remote_address`, with
    /// [`ErrorMode::Peer`].
    ///
    /// The address must be the exact bytes the peer's `Worker::address` returned; they are
    /// checked (see the envelope format in the crate docs) before UCX parses them.
    pub fn connect(&self, remote_address: &[u8]) -> Result<Endpoint, UcxError> {
        self.connect_with(remote_address, ErrorMode::Peer)
    }

    /// [`Worker::connect`] with a chosen [`ErrorMode`]; `ErrorMode::None` is what shared
    /// memory (`UCX_TLS=shm`) needs in UCX 1.13.
    pub fn connect_with(&self, remote_address: &[u8], mode: ErrorMode) -> Result<Endpoint, UcxError> {
        let address = envelope::open::<0>(envelope::ADDRESS_MAGIC, "worker address", remote_address)?;
        let failure = Box::new(Cell::new(raw::UCS_OK));
        // SAFETY: ucp_ep_params_t is plain data (integers, pointers, nullable function
        // pointers), for which all-zero bytes are valid; field_mask selects what is read.
        let mut params: raw::ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = raw::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | raw::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        params.address = address.payload_ptr().cast();
        params.err_mode = match mode {
            ErrorMode::Peer => raw::UCP_ERR_HANDLING_MODE_PEER,
            ErrorMode::None => raw::UCP_ERR_HANDLING_MODE_NONE,
        };
        if mode == ErrorMode::Peer {
            params.field_mask |= raw::UCP_EP_PARAM_FIELD_ERR_HANDLER;
            params.err_handler = raw::ucp_err_handler_t {
                cb: Some(on_peer_error),
                arg: ptr::from_ref::<Cell<raw::ucs_status_t>>(&failure).cast_mut().cast(),
            };
        }
        let mut ep = ptr::null_mut();
        // SAFETY: the worker is alive and owned by this thread; the address payload is a
        // complete, checksummed UCX address in aligned storage that outlives the call (UCX
        // copies what it keeps); the error-handler argument outlives the endpoint (see
        // on_peer_error).
        let status = unsafe { raw::ucp_ep_create(self.inner.handle, &params, &mut ep) };
        check(status, "ucp_ep_create (connect to peer worker)").map_err(|e| {
            if status == raw::UCS_ERR_UNREACHABLE && mode == ErrorMode::Peer {
                e.with_hint(
                    "no transport with peer-failure detection could reach the peer; in UCX 1.13 the shared-memory \
                     transports lack it, so for UCX_TLS=shm connect with ErrorMode::None, otherwise check that \
                     UCX_TLS on both sides shares tcp or an RDMA transport and UCX_NET_DEVICES is routable",
                )
            } else {
                e
            }
        })?;
        let inner =
            EndpointInner { worker: self.inner.clone(), mode, handle: Cell::new(ep), failure, in_flight: Cell::new(0) };
        Ok(Endpoint { inner: Rc::new(inner) })
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("handle", &self.inner.handle.get())
            .field("mode", &self.inner.mode)
            .field("failure", &self.inner.failure.get())
            .finish()
    }
}

impl Endpoint {
    /// Waits until every put issued on this endpoint has completed at the peer. On timeout
    /// the endpoint is closed (by force with [`ErrorMode::Peer`]), as after any timed-out
    /// endpoint operation: a peer that stopped responding is not waited for again on drop.
    pub fn flush(&self, timeout: Duration) -> Result<(), UcxError> {
        let result = self.flush_pending("ucp_ep_flush_nbx")?.wait_until(Instant::now() + timeout);
        if result.as_ref().is_err_and(UcxError::is_timeout) {
            self.inner.force_close();
        }
        result
    }

    pub(crate) fn flush_pending(&self, what: &'static str) -> Result<Pending, UcxError> {
        let ep = self.inner.live()?;
        let param = raw::ucp_request_param_t::empty();
        // SAFETY: ep is open; param is valid for the call.
        let ptr = unsafe { raw::ucp_ep_flush_nbx(ep, &param) };
        Pending::issued(ptr, &self.inner.worker, Some(&self.inner), what)
    }

    /// Closes the endpoint now: gracefully (flushing) within `timeout`, or, with
    /// [`ErrorMode::Peer`], by force if it failed or has unfinished puts/gets, which then
    /// complete with `UCS_ERR_CANCELED`. Remote keys unpacked on it stop working.
    pub fn close(self, timeout: Duration) -> Result<(), UcxError> {
        self.inner.close_gracefully(timeout)
    }

    pub fn error_mode(&self) -> ErrorMode {
        self.inner.mode
    }

    /// True once UCX reported the peer failed (detected during progress; only with
    /// [`ErrorMode::Peer`]).
    pub fn has_failed(&self) -> bool {
        self.inner.failure.get() != raw::UCS_OK
    }
}
