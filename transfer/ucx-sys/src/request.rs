//! Non-blocking requests (`ucs_status_ptr_t` results) and waiting for them.

use std::ffi::c_void;
use std::ptr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use crate::endpoint::EndpointInner;
use crate::raw;
use crate::rkey::RkeyInner;
use crate::status::{UcxError, check};
use crate::worker::WorkerInner;

/// How long dropping an unfinished [`Pending`] waits before giving it up.
const DROP_GRACE: Duration = Duration::from_secs(5);
/// How long a given-up put/get may take to finish after its endpoint was closed. With
/// `ErrorMode::Peer`, UCX completes it with `UCS_ERR_CANCELED` during the next progress
/// calls; if it does not finish, the caller's buffer may still be in use and the process
/// cannot safely continue.
const CANCEL_GRACE: Duration = Duration::from_secs(10);

/// An operation UCX may still be working on: a put or get issued with
/// [`Endpoint::put`](crate::Endpoint::put)/[`Endpoint::get`](crate::Endpoint::get), or
/// an internal flush. Finish it with [`Worker::wait`](crate::Worker::wait).
///
/// Dropping an unfinished `Pending` waits for it (up to 5 s) and then gives it up as a
/// timed-out `wait` does. `!Send`: it belongs to its worker's thread.
#[must_use = "an unfinished request keeps its buffer in use; pass it to Worker::wait"]
pub struct Pending {
    /// The UCX request; null once finished (or if the operation completed immediately).
    req: *mut c_void,
    worker: Rc<WorkerInner>,
    /// Keeps the endpoint open while the operation runs.
    ep: Option<Rc<EndpointInner>>,
    /// Set for puts/gets: keeps the remote key alive while the operation uses it, and
    /// marks an operation that reads or writes a caller's buffer.
    rkey: Option<Rc<RkeyInner>>,
    what: &'static str,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("what", &self.what).field("request", &self.req).finish()
    }
}

impl Pending {
    /// Wraps the result of an `_nbx` call that uses no caller buffer (a flush or close).
    pub(crate) fn issued(
        ptr: raw::ucs_status_ptr_t,
        worker: &Rc<WorkerInner>,
        ep: Option<&Rc<EndpointInner>>,
        what: &'static str,
    ) -> Result<Pending, UcxError> {
        Pending::classify(ptr, what)?;
        Ok(Pending { req: request_of(ptr), worker: worker.clone(), ep: ep.cloned(), rkey: None, what })
    }

    /// Wraps the result of `ucp_put_nbx`/`ucp_get_nbx` on `rkey`'s endpoint.
    pub(crate) fn issued_rma(
        ptr: raw::ucs_status_ptr_t,
        rkey: &Rc<RkeyInner>,
        what: &'static str,
    ) -> Result<Pending, UcxError> {
        Pending::classify(ptr, what)?;
        let ep = rkey.ep.clone();
        let req = request_of(ptr);
        if !req.is_null() {
            ep.in_flight.set(ep.in_flight.get() + 1);
        }
        Ok(Pending { req, worker: ep.worker.clone(), ep: Some(ep), rkey: Some(rkey.clone()), what })
    }

    fn classify(ptr: raw::ucs_status_ptr_t, what: &'static str) -> Result<(), UcxError> {
        if raw::UCS_PTR_IS_ERR(ptr) { check(raw::UCS_PTR_RAW_STATUS(ptr), what) } else { Ok(()) }
    }

    pub(crate) fn worker(&self) -> &Rc<WorkerInner> {
        &self.worker
    }

    /// True once UCX reports the operation finished (successfully or not).
    pub fn is_complete(&self) -> bool {
        // SAFETY: a non-null req is a live request that has not been freed (freeing
        // nulls it).
        self.req.is_null() || unsafe { raw::ucp_request_check_status(self.req) } != raw::UCS_INPROGRESS
    }

    /// Progresses the worker until the request finishes or `deadline` passes; on timeout
    /// gives the request up (see [`Pending::give_up`]).
    pub(crate) fn wait_until(mut self, deadline: Instant) -> Result<(), UcxError> {
        self.finish(deadline)
    }

    fn finish(&mut self, deadline: Instant) -> Result<(), UcxError> {
        if self.req.is_null() {
            return Ok(());
        }
        loop {
            // SAFETY: req is live (not yet freed); this is the worker's thread.
            let status = unsafe { raw::ucp_request_check_status(self.req) };
            if status != raw::UCS_INPROGRESS {
                self.release();
                return check(status, self.what);
            }
            if Instant::now() >= deadline {
                return Err(self.give_up());
            }
            // SAFETY: the worker is alive (we hold it) and owned by this thread.
            if unsafe { raw::ucp_worker_progress(self.worker.handle) } == 0 {
                std::hint::spin_loop();
            }
        }
    }

    /// Gives up an unfinished request. A put/get may still be reading or writing the
    /// caller's buffer, so its endpoint is closed (forced, with `ErrorMode::Peer`, which
    /// makes UCX complete every outstanding operation with `UCS_ERR_CANCELED`), and the
    /// request is freed only once it has finished.
    fn give_up(&mut self) -> UcxError {
        // SAFETY: req is live and belongs to this worker.
        unsafe { raw::ucp_request_cancel(self.worker.handle, self.req) };
        if self.rkey.is_some() {
            if let Some(ep) = &self.ep {
                ep.force_close();
            }
            let grace = Instant::now() + CANCEL_GRACE;
            // SAFETY: req stays live until release() below; the worker is ours.
            while unsafe { raw::ucp_request_check_status(self.req) } == raw::UCS_INPROGRESS {
                // SAFETY: as above.
                unsafe { raw::ucp_worker_progress(self.worker.handle) };
                if Instant::now() >= grace {
                    eprintln!(
                        "ucx-sys: {} still running {:?} after its endpoint was closed; aborting \
                         because its buffer may still be in use",
                        self.what, CANCEL_GRACE
                    );
                    std::process::abort();
                }
            }
        }
        self.release();
        UcxError::new(raw::UCS_ERR_TIMED_OUT, format!("{} did not complete in time", self.what))
    }

    /// Frees the request (UCX finishes an unfinished flush or close on its own).
    fn release(&mut self) {
        let req = std::mem::replace(&mut self.req, ptr::null_mut());
        // SAFETY: req is a live request, freed exactly once (self.req is now null).
        unsafe { raw::ucp_request_free(req) };
        if self.rkey.is_some()
            && let Some(ep) = &self.ep
        {
            ep.in_flight.set(ep.in_flight.get() - 1);
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // The error has nowhere to go; what matters is that the request is finished.
        let _ = self.finish(Instant::now() + DROP_GRACE);
    }
}

fn request_of(ptr: raw::ucs_status_ptr_t) -> *mut c_void {
    if raw::UCS_PTR_IS_PTR(ptr) { ptr } else { ptr::null_mut() }
}
