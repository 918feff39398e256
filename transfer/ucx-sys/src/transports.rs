//! Which endpoint error mode the configured transports can honour (UCX 1.13).
//!
//! Peer-failure handling (`UCP_ERR_HANDLING_MODE_PEER`) needs a transport with active
//! messages and a peer-failure handler: tcp or an RDMA transport. The shared-memory
//! transports (posix, sysv; cma, knem and xpmem move bytes only) have neither, so with
//! `UCX_TLS=shm` a `Peer` endpoint cannot be created, and `ucp_ep_create` says so with
//! an `ERROR` line on stderr (`no active messages transport to …: posix/memory - no peer
//! failure handler, …`) before returning `UCS_ERR_UNREACHABLE`. Choosing the mode from
//! the transports up front keeps a healthy shared-memory cluster's logs free of it.

use crate::ErrorMode;

/// `UCX_TLS` names (transports and aliases) that reach only the same host and cannot
/// detect a failed peer: shared memory, the memory-copy helpers, and `self`.
const HOST_ONLY: &[&str] = &[
    "shm",
    "sm",
    "mm",
    "posix",
    "sysv",
    "xpmem",
    "knem",
    "cma",
    "self",
    "cuda",
    "cuda_copy",
    "cuda_ipc",
    "gdr_copy",
    "rocm",
    "rocm_copy",
    "rocm_ipc",
    "rocm_gdr",
];

impl ErrorMode {
    /// The mode for endpoints when the transports are `tls` (`UCX_TLS` syntax; `None`
    /// when unset, which means all): [`ErrorMode::Peer`] unless every transport named
    /// is host-only, then [`ErrorMode::None`]. Exclusion lists (`^…`) and names this
    /// table does not know are taken to include a network transport.
    pub fn for_transports(tls: Option<&str>) -> ErrorMode {
        let Some(tls) = tls.map(str::trim).filter(|t| !t.is_empty()) else {
            return ErrorMode::Peer;
        };
        if tls.starts_with('^') {
            return ErrorMode::Peer;
        }
        // A name may carry a qualifier (`rc:aux`); the transport is before the colon.
        let host_only = tls
            .split(',')
            .map(|t| t.trim().split(':').next().unwrap_or_default())
            .filter(|t| !t.is_empty())
            .all(|t| HOST_ONLY.contains(&t.to_ascii_lowercase().as_str()));
        if host_only { ErrorMode::None } else { ErrorMode::Peer }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_alone_gets_no_peer_error_handling() {
        for tls in ["shm", "sm", "shm,self", "posix,sysv,cma", " SHM ", "sm,cuda_copy,cuda_ipc", "shm,"] {
            assert_eq!(ErrorMode::for_transports(Some(tls)), ErrorMode::None, "{tls}");
        }
    }

    #[test]
    fn a_network_transport_gets_peer_error_handling() {
        for tls in [None, Some(""), Some("all"), Some("tcp"), Some("shm,tcp"), Some("rc,sm,self"), Some("rc:aux,sm")] {
            assert_eq!(ErrorMode::for_transports(tls), ErrorMode::Peer, "{tls:?}");
        }
        // Everything but some transports, or a name not in the table: assume a network one.
        assert_eq!(ErrorMode::for_transports(Some("^ib")), ErrorMode::Peer);
        assert_eq!(ErrorMode::for_transports(Some("ugni_rdma,sm")), ErrorMode::Peer);
    }
}
