//! Page-indexed movement of KV state between processes over UCX.
//!
//! A decode worker ([`Receiver`]) allocates its KV memory as UCX regions, so that on one
//! host the shared-memory transports can map it into peers, and hands the regions to its
//! engine. For each request it reserves pages and a state slot and describes them as a
//! [`Target`]: its worker address, the regions' base addresses and remote keys, the page
//! ids and the slot. A prefill worker ([`Sender`]) writes each finished page into its
//! slot with a UCX put, then the window rings and compressor slots, then the last-token
//! logits, and flushes; only then does it commit over gRPC, with [`Checksums`] the
//! receiver verifies against the bytes that landed. Bytes move as they are: both sides
//! check beforehand that they share the same [`WireGeometry`] (docs/kv-wire-format.md).
//!
//! Module map:
//! - [`wire`]: the versioned geometry both sides must agree on, and its proto form.
//! - [`target`]: where one sequence's bytes go (regions, page ids, slot).
//! - [`receiver`]: UCX context, registered regions and the progress thread.
//! - [`sender`]: endpoints, their remote keys and batched puts (lives on one thread).
//! - [`registered`]: engine KV pools in UCX regions, and landing areas read back after puts.
//! - [`checksum`]: KV checksums of what was sent and what landed.
//! - [`gpu_direct`]: `--gpu-direct`, whether GPU workers move KV in device memory.

#![forbid(unsafe_code)]

pub mod checksum;
pub mod gpu_direct;
pub mod receiver;
pub mod registered;
pub mod sender;
pub mod target;
pub mod wire;

pub use checksum::Checksums;
pub use gpu_direct::GpuDirect;
pub use receiver::{Receiver, RegisteredDevice, RegisteredRegion};
pub use registered::{Landing, RegisteredKv};
pub use sender::{RemoteWrite, SendParts, SendStats, Sender, SourceParts};
pub use target::{RegionSpec, Target};
pub use ucx_sys::Source;
pub use wire::{WIRE_VERSION, WireError, WireGeometry, WireLayer};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum TransferError {
    #[error(transparent)]
    Ucx(#[from] ucx_sys::UcxError),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("transfer thread failed: {0}")]
    Thread(String),
    #[error("registered KV memory: {0}")]
    Memory(String),
}
