//! Sleeping on a worker's event fd instead of spinning on `progress()`.
//!
//! The pattern (`UCP_FEATURE_WAKEUP` required):
//!
//! ```no_run
//! # fn serve(worker: &ucx_sys::Worker, stop: &std::sync::atomic::AtomicBool) -> Result<(), ucx_sys::UcxError> {
//! use std::sync::atomic::Ordering;
//! use std::time::Duration;
//! while !stop.load(Ordering::Relaxed) {
//!     while worker.progress() > 0 {}
//!     worker.wait_for_events(Duration::from_millis(100))?;
//! }
//! # Ok(()) }
//! ```
//!
//! To wait on other fds too, put [`Worker::efd`] into your own poll/epoll set and call
//! [`Worker::arm`] before each sleep.

use std::ffi::c_int;
use std::io;
use std::os::fd::{BorrowedFd, RawFd};
use std::time::Duration;

use crate::context::Features;
use crate::raw;
use crate::status::{UcxError, check};
use crate::worker::Worker;

impl Worker {
    /// The worker's event fd: readable when [`Worker::progress`] has work to do, after a
    /// successful [`Worker::arm`].
    pub fn efd(&self) -> Result<BorrowedFd<'_>, UcxError> {
        self.require_wakeup("ucp_worker_get_efd")?;
        let mut fd: RawFd = -1;
        // SAFETY: the worker is alive and owned by this thread; fd is an out-pointer.
        let status = unsafe { raw::ucp_worker_get_efd(self.inner.handle, &mut fd) };
        check(status, "ucp_worker_get_efd")?;
        // SAFETY: UCX owns the fd and keeps it open until ucp_worker_destroy, which cannot
        // happen while `self` is borrowed.
        Ok(unsafe { BorrowedFd::borrow_raw(fd) })
    }

    /// Arms the event fd. `Ok(true)`: armed, safe to sleep on the fd. `Ok(false)`: events
    /// are already pending (`UCS_ERR_BUSY`); progress again instead of sleeping. Call only
    /// after `progress()` returned 0.
    pub fn arm(&self) -> Result<bool, UcxError> {
        self.require_wakeup("ucp_worker_arm")?;
        // SAFETY: the worker is alive and owned by this thread.
        let status = unsafe { raw::ucp_worker_arm(self.inner.handle) };
        if status == raw::UCS_ERR_BUSY {
            return Ok(false);
        }
        check(status, "ucp_worker_arm").map(|()| true)
    }

    /// Arms the worker and sleeps until it has events or `timeout` passes. Returns
    /// `Ok(true)` if there may be work for [`Worker::progress`], `Ok(false)` on timeout.
    /// Call only after `progress()` returned 0.
    pub fn wait_for_events(&self, timeout: Duration) -> Result<bool, UcxError> {
        let fd = self.efd()?;
        if !self.arm()? {
            return Ok(true);
        }
        let mut pfd = raw::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(&fd), events: raw::POLLIN, revents: 0 };
        // Round up so a sub-millisecond timeout sleeps instead of spinning.
        let ms = c_int::try_from(timeout.as_nanos().div_ceil(1_000_000)).unwrap_or(c_int::MAX);
        // SAFETY: one valid pollfd for the duration of the call.
        let rc = unsafe { raw::poll(&mut pfd, 1, ms) };
        if rc >= 0 {
            return Ok(rc > 0);
        }
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::Interrupted {
            return Ok(true);
        }
        Err(UcxError::new(raw::UCS_ERR_IO_ERROR, format!("poll on the worker event fd: {err}")))
    }

    fn require_wakeup(&self, what: &str) -> Result<(), UcxError> {
        if self.inner.ctx.features.contains(Features::WAKEUP) {
            Ok(())
        } else {
            Err(UcxError::new(raw::UCS_ERR_INVALID_PARAM, what.to_string())
                .with_hint("create the Context with Features::WAKEUP to sleep on a worker"))
        }
    }
}
