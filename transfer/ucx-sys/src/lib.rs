//! FFI to the system libucx (UCP, UCX 1.13) for one-sided RMA between processes, in
//! three levels:
//!
//! - [`raw`]: level 1, hand-written `extern "C"` declarations and `#[repr(C)]` types
//!   for exactly the subset used, checked against the C headers by `tests/layout.rs`
//!   (through [`layout`], compiled from `csrc/layout.c`).
//! - [`status`]: level 2, `ucs_status_t` to `Result<_, UcxError>`.
//! - Level 3, RAII types, one concept per module:
//!   - `context`: [`Context`] (`Send + Sync`), features and configuration.
//!   - `worker`: [`Worker`], the progress engine (`!Send`: one thread).
//!   - `wakeup`: sleeping on a worker's event fd instead of spinning.
//!   - `endpoint`: [`Endpoint`], a connection to a peer worker.
//!   - `transports`: which [`ErrorMode`] the configured transports can honour.
//!   - `memory`: [`MemRegion`] (`Send + Sync`), host memory peers can access;
//!     [`DeviceRegion`], GPU memory registered with a CUDA-enabled libucx
//!     ([`Context::supports`]); [`LocalRange`], local memory of either kind by address;
//!     [`Source`], local bytes to put (host, or device memory held by a handle).
//!   - `rkey`: [`RemoteKey`], a peer's region as seen through one endpoint.
//!   - `rma`: puts and gets.
//!   - `coalesce`: puts that continue one another merged into one.
//!   - `request`: [`Pending`], an operation in flight.
//!   - `envelope`: framing for the address and rkey bytes peers exchange.
//!
//! # Thread affinity
//! A [`Worker`] is created in `UCS_THREAD_MODE_SINGLE`; it and everything created from it
//! ([`Endpoint`], [`RemoteKey`], [`Pending`]) is `!Send + !Sync`, so every call on them
//! happens on the thread that created the worker. [`Context`] and [`MemRegion`] are
//! `Send + Sync` (the context is created with `mt_workers_shared`).
//!
//! # Flow
//! The receiver allocates a [`MemRegion`], publishes [`Worker::address`] and
//! [`MemRegion::pack_rkey`] (which carries the region's base and length), and keeps
//! progressing its worker ([`Worker::wait_for_events`] between rounds). The sender
//! [`Worker::connect`]s ([`Worker::connect_with`] and [`ErrorMode::None`] for shared
//! memory, see [`ErrorMode`]; [`Worker::error_mode`] picks what the configured transports
//! can honour), [`Endpoint::unpack_rkey`]s and calls [`Worker::put_all`],
//! which returns once the bytes are at the receiver.
//!
//! The address and rkey bytes are sealed in a checksummed envelope (module `envelope`):
//! UCX parses them without a length, so corrupted or truncated bytes are rejected here
//! first. They are not authenticated; the control plane carrying them is trusted.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod raw;
pub mod status;

pub mod layout;

mod coalesce;
mod context;
mod endpoint;
mod envelope;
mod memory;
mod request;
mod rkey;
mod rma;
mod transports;
mod wakeup;
mod worker;

pub use context::{Context, Features, library_path, version};
pub use endpoint::{Endpoint, ErrorMode};
pub use memory::{DeviceRegion, LocalRange, MemRegion, MemoryType, Source};
pub use request::Pending;
pub use rkey::RemoteKey;
pub use status::{UcxError, check};
pub use worker::Worker;
