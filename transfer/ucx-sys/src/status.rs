//! Level 2: turning `ucs_status_t` into `Result`.

use std::ffi::CStr;
use std::fmt;

use crate::raw::{self, ucs_status_t};

/// A failed UCX call: which operation, UCX's own status text, and a fix when the status
/// usually has an obvious one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxError {
    /// The `ucs_status_t` value (negative; e.g. -6 is `UCS_ERR_UNREACHABLE`).
    pub status: i32,
    /// What this crate was doing, e.g. "ucp_ep_create (connect to peer worker)".
    pub what: String,
    /// `ucs_status_string(status)`.
    pub message: String,
    /// A suggested fix, if one is known for this status.
    pub hint: Option<&'static str>,
}

impl UcxError {
    /// An error for `status`, with the default hint for that status.
    pub fn new(status: ucs_status_t, what: impl Into<String>) -> Self {
        UcxError {
            status: status.into(),
            what: what.into(),
            message: status_string(status),
            hint: default_hint(status),
        }
    }

    /// Replaces the hint with one specific to the failing call.
    pub fn with_hint(mut self, hint: &'static str) -> Self {
        self.hint = Some(hint);
        self
    }

    /// True if the operation ran out of time (ours or UCX's own endpoint timeout).
    pub fn is_timeout(&self) -> bool {
        self.status == i32::from(raw::UCS_ERR_TIMED_OUT) || self.status == i32::from(raw::UCS_ERR_ENDPOINT_TIMEOUT)
    }

    /// True if the peer is unreachable or the connection to it failed: reconnecting to a
    /// fresh address (not retrying on this endpoint) is the remedy.
    pub fn is_peer_failure(&self) -> bool {
        is_peer_failure_status(self.status)
    }
}

impl fmt::Display for UcxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} (UCS status {})", self.what, self.message, self.status)?;
        if let Some(hint) = self.hint {
            write!(f, "; {hint}")?;
        }
        Ok(())
    }
}

impl std::error::Error for UcxError {}

/// `Ok(())` for `UCS_OK`, otherwise an error naming `what`.
pub fn check(status: ucs_status_t, what: &str) -> Result<(), UcxError> {
    if status == raw::UCS_OK { Ok(()) } else { Err(UcxError::new(status, what)) }
}

/// `ucs_status_string` as an owned string.
pub fn status_string(status: ucs_status_t) -> String {
    // SAFETY: ucs_status_string accepts any value (unknown ones map to a generic text)
    // and returns a pointer to a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(raw::ucs_status_string(status)) };
    text.to_string_lossy().into_owned()
}

fn is_peer_failure_status(s: i32) -> bool {
    let in_range = |first: ucs_status_t, last: ucs_status_t| s <= i32::from(first) && s >= i32::from(last);
    s == i32::from(raw::UCS_ERR_UNREACHABLE)
        || s == i32::from(raw::UCS_ERR_NOT_CONNECTED)
        || s == i32::from(raw::UCS_ERR_CONNECTION_RESET)
        || in_range(raw::UCS_ERR_FIRST_LINK_FAILURE, raw::UCS_ERR_LAST_LINK_FAILURE)
        || in_range(raw::UCS_ERR_FIRST_ENDPOINT_FAILURE, raw::UCS_ERR_LAST_ENDPOINT_FAILURE)
}

fn default_hint(status: ucs_status_t) -> Option<&'static str> {
    Some(match status {
        raw::UCS_ERR_UNREACHABLE => {
            "no UCX transport could reach the peer; check that UCX_TLS on both sides names a transport they \
             share (shm on one host, tcp across hosts) and that UCX_NET_DEVICES includes a routable device"
        }
        raw::UCS_ERR_NO_DEVICE => "no usable transport device; compare UCX_TLS and UCX_NET_DEVICES with `ucx_info -d`",
        raw::UCS_ERR_SHMEM_SEGMENT => {
            "could not attach the peer's shared memory; both processes need the same /dev/shm and IPC namespace \
             (containers: --ipc=host or a shared /dev/shm)"
        }
        raw::UCS_ERR_NO_MEMORY => "out of memory; for large regions check free space in /dev/shm and `ulimit -l`",
        raw::UCS_ERR_TIMED_OUT => "the peer did not respond in time; check that it is alive and progressing its worker",
        raw::UCS_ERR_CANCELED => "the operation was cancelled because its endpoint was closed",
        raw::UCS_ERR_NOT_CONNECTED | raw::UCS_ERR_CONNECTION_RESET => {
            "the connection to the peer is gone; reconnect using the peer's current worker address"
        }
        s if is_peer_failure_status(s.into()) => {
            "the peer failed or the link broke; reconnect using the peer's current worker address"
        }
        _ => return None,
    })
}
