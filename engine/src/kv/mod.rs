//! Per-sequence KV state on a backend: the page pool (compressed entries per 128-token
//! block), the state cache (window rings and compressor slots per running sequence),
//! the sequences that own them, and their byte export/import.

mod cache;
mod export;
mod pool;

pub use cache::{KvCache, PoolStats, Sequence};
pub use export::{ExportHeader, ImportError, SEQUENCE_FORMAT_VERSION};
pub use pool::{PagePool, PoolError, SlotPool};
