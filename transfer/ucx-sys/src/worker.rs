//! The UCP worker: the progress engine that endpoints, remote keys and requests hang off.

use std::ptr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::context::{Context, ContextInner};
use crate::envelope;
use crate::raw;
use crate::request::Pending;
use crate::status::{UcxError, check};

/// Owns the `ucp_worker_h`. Endpoints, remote keys and requests hold an `Rc` to it, so the
/// worker is destroyed only after all of them.
pub(crate) struct WorkerInner {
    pub(crate) handle: raw::ucp_worker_h,
    pub(crate) ctx: Arc<ContextInner>,
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_worker_create. Everything created on the worker
        // holds an Rc to this object, so nothing uses the handle any more; `ctx` is
        // released only after this (fields drop after Drop::drop).
        unsafe { raw::ucp_worker_destroy(self.handle) }
    }
}

/// A UCP worker, created in `UCS_THREAD_MODE_SINGLE`.
///
/// # Thread affinity
/// `Worker` is `!Send` and `!Sync`, as are the [`Endpoint`](crate::Endpoint)s,
/// [`RemoteKey`](crate::RemoteKey)s and [`Pending`] requests created from it: every call
/// on them happens on the thread that created the worker. That is what
/// `UCS_THREAD_MODE_SINGLE` requires, and it lets UCX skip locking on the data path. To
/// serve several threads, create one worker per thread from a shared [`Context`].
pub struct Worker {
    pub(crate) inner: Rc<WorkerInner>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("handle", &self.inner.handle).finish()
    }
}

impl Worker {
    pub fn new(ctx: &Context) -> Result<Worker, UcxError> {
        // SAFETY: ucp_worker_params_t is plain data (integers, pointers, a bit set), for
        // which all-zero bytes are valid; only thread_mode is selected by field_mask.
        let mut params: raw::ucp_worker_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = raw::UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        params.thread_mode = raw::UCS_THREAD_MODE_SINGLE;
        let mut handle = ptr::null_mut();
        // SAFETY: the context is alive (we hold it), params is valid for the call and
        // handle is an out-pointer.
        let status = unsafe { raw::ucp_worker_create(ctx.inner.handle, &params, &mut handle) };
        check(status, "ucp_worker_create")?;
        Ok(Worker { inner: Rc::new(WorkerInner { handle, ctx: ctx.inner.clone() }) })
    }

    /// The endpoint error mode its context's transports can honour: what
    /// [`Worker::connect_with`] should be given to connect without UCX logging an error
    /// (see [`ErrorMode::for_transports`](crate::ErrorMode::for_transports)).
    pub fn error_mode(&self) -> crate::ErrorMode {
        crate::ErrorMode::for_transports(self.inner.ctx.tls.as_deref())
    }

    /// This worker's address, sealed for transport to a peer, which passes it to
    /// [`Worker::connect`]. Publish it through the control plane.
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut addr = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the worker is alive; addr and len are out-pointers.
        let status = unsafe { raw::ucp_worker_get_address(self.inner.handle, &mut addr, &mut len) };
        check(status, "ucp_worker_get_address")?;
        // SAFETY: UCX returned `len` readable bytes at `addr`, valid until released below.
        let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) };
        let sealed = envelope::seal(envelope::ADDRESS_MAGIC, &[], bytes);
        // SAFETY: addr came from ucp_worker_get_address on this worker; released once.
        unsafe { raw::ucp_worker_release_address(self.inner.handle, addr) };
        Ok(sealed)
    }

    /// Runs one round of communication progress; returns the number of events handled.
    pub fn progress(&self) -> u32 {
        // SAFETY: the worker is alive and this thread owns it (Worker is !Send).
        unsafe { raw::ucp_worker_progress(self.inner.handle) }
    }

    /// Waits until every operation issued on this worker, on all endpoints, has completed
    /// at its target.
    pub fn flush(&self, timeout: Duration) -> Result<(), UcxError> {
        let param = raw::ucp_request_param_t::empty();
        // SAFETY: the worker is alive; param is valid for the call.
        let ptr = unsafe { raw::ucp_worker_flush_nbx(self.inner.handle, &param) };
        let pending = Pending::issued(ptr, &self.inner, None, "ucp_worker_flush_nbx")?;
        pending.wait_until(Instant::now() + timeout)
    }

    /// Waits (progressing this worker) for `pending` to complete.
    ///
    /// On timeout the request is given up and `UCS_ERR_TIMED_OUT` returned: a put or get
    /// has its endpoint closed, by force with [`ErrorMode::Peer`](crate::ErrorMode::Peer),
    /// which cancels it and releases its buffer (for `ErrorMode::None` see there).
    pub fn wait(&self, pending: Pending, timeout: Duration) -> Result<(), UcxError> {
        if !Rc::ptr_eq(pending.worker(), &self.inner) {
            let err = UcxError::new(raw::UCS_ERR_INVALID_PARAM, "Worker::wait on a request of another worker");
            drop(pending);
            return Err(err);
        }
        pending.wait_until(Instant::now() + timeout)
    }

    pub(crate) fn owns(&self, inner: &Rc<WorkerInner>) -> Result<(), UcxError> {
        if Rc::ptr_eq(inner, &self.inner) {
            Ok(())
        } else {
            Err(UcxError::new(raw::UCS_ERR_INVALID_PARAM, "endpoint belongs to another worker"))
        }
    }
}
