//! The on-disk record: a fixed header (with its own checksum) followed by the payload
//! (with a checksum in the header). A record whose header or payload fails its checksum
//! is never served; at start-up a torn tail is cut off at the first such record.
//!
//! Header (little endian, 136 bytes):
//! ```text
//! magic "SLKVREC2" | kind u8 | pad [3] | depth u32 | key [32] | parent [32]
//! pools: csa_main u64, csa_indexer u64, hca u64, swa u64
//! payload_len u64 | payload_sum u64 | header_xxh3 u64 (of the 128 bytes before it)
//! ```
//! `payload_sum` is the [KV checksum](transfer::checksum::kv_checksum), the one writers
//! and readers of KV bytes compare on the wire too (GPU workers compute it in device
//! memory), so a record's checksum travels unchanged from the writer's commit to a
//! reader's restore. Format 1 (`SLKVREC1`, xxh3 payload checksums) is not read: a store
//! directory of that format starts empty (its segments are cut at their first record,
//! with a warning) and refills, since it only ever holds a cache.
//! A tombstone (kind 3) deletes one earlier record: its key and, in `depth`, the
//! killed record's kind; its 16-byte payload is the killed record's segment id and
//! offset.

use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

pub const HEADER_LEN: usize = 136;
const MAGIC: &[u8; 8] = b"SLKVREC2";
/// The magic of format 1, recognised only to say why its records are not read.
const MAGIC_V1: &[u8; 8] = b"SLKVREC1";

/// A block key: chained prefix hash salted with the model fingerprint.
pub type Key = [u8; 32];

/// A record's bytes in memory: read from disk, or still in the staging area a writer
/// put them in (accepted puts are queued for disk from there, without a copy).
pub type Payload = std::sync::Arc<dyn RecordBytes>;

/// What a [`Payload`] can be: bytes shared across threads.
pub trait RecordBytes: AsRef<[u8]> + Send + Sync + std::fmt::Debug {}

impl<T: AsRef<[u8]> + Send + Sync + std::fmt::Debug> RecordBytes for T {}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// One block's compressed KV, all layers.
    Page,
    /// The sliding-window state at the end of the block.
    Snapshot,
    /// Deletes an earlier record.
    Tombstone,
}

impl Kind {
    pub fn code(self) -> u8 {
        match self {
            Kind::Page => 1,
            Kind::Snapshot => 2,
            Kind::Tombstone => 3,
        }
    }

    pub fn from_code(c: u8) -> Option<Kind> {
        match c {
            1 => Some(Kind::Page),
            2 => Some(Kind::Snapshot),
            3 => Some(Kind::Tombstone),
            _ => None,
        }
    }
}

/// Bytes of a record per KV pool, as the writer declared them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pools {
    pub csa_main: u64,
    pub csa_indexer: u64,
    pub hca: u64,
    pub swa: u64,
}

impl Pools {
    /// `(pool label, bytes)` in the order of `cluster::telemetry::metrics::KV_POOLS`.
    pub fn labelled(&self) -> [(&'static str, u64); 4] {
        [("csa_main", self.csa_main), ("csa_indexer", self.csa_indexer), ("hca", self.hca), ("swa", self.swa)]
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub depth: u32,
    pub key: Key,
    pub parent: Option<Key>,
    pub pools: Pools,
    pub payload_len: u64,
    pub payload_checksum: u64,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("not a record header")]
    Magic,
    #[error("a record of format 1 (an older sluice's store): not read; the cache refills")]
    OldFormat,
    #[error("record header checksum mismatch")]
    HeaderChecksum,
    #[error("unknown record kind {0}")]
    Kind(u8),
    #[error("record payload checksum mismatch")]
    PayloadChecksum,
    #[error("record payload length {0} is more than any file holds")]
    Length(u64),
}

/// The longest payload a record may declare: one whose record still ends at a file
/// offset (`i64`), so offsets computed from it cannot overflow.
pub const MAX_PAYLOAD_LEN: u64 = i64::MAX as u64 - HEADER_LEN as u64;

/// A payload's checksum: the KV checksum, as writers send it.
pub fn checksum(bytes: &[u8]) -> u64 {
    transfer::checksum::kv_checksum(bytes)
}

/// The header's own checksum (never leaves the store).
pub fn header_checksum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

impl Header {
    pub fn total_len(&self) -> u64 {
        HEADER_LEN as u64 + self.payload_len
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..8].copy_from_slice(MAGIC);
        h[8] = self.kind.code();
        h[12..16].copy_from_slice(&self.depth.to_le_bytes());
        h[16..48].copy_from_slice(&self.key);
        h[48..80].copy_from_slice(&self.parent.unwrap_or([0; 32]));
        let p = &self.pools;
        for (i, v) in [p.csa_main, p.csa_indexer, p.hca, p.swa].into_iter().enumerate() {
            h[80 + 8 * i..88 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        h[112..120].copy_from_slice(&self.payload_len.to_le_bytes());
        h[120..128].copy_from_slice(&self.payload_checksum.to_le_bytes());
        let sum = header_checksum(&h[..128]);
        h[128..136].copy_from_slice(&sum.to_le_bytes());
        h
    }

    pub fn decode(h: &[u8]) -> Result<Header, RecordError> {
        if h.len() >= 8 && &h[..8] == MAGIC_V1 {
            return Err(RecordError::OldFormat);
        }
        if h.len() < HEADER_LEN || &h[..8] != MAGIC {
            return Err(RecordError::Magic);
        }
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));
        if u64_at(128) != header_checksum(&h[..128]) {
            return Err(RecordError::HeaderChecksum);
        }
        let kind = Kind::from_code(h[8]).ok_or(RecordError::Kind(h[8]))?;
        let payload_len = u64_at(112);
        if payload_len > MAX_PAYLOAD_LEN {
            return Err(RecordError::Length(payload_len));
        }
        let parent: Key = h[48..80].try_into().expect("32 bytes");
        Ok(Header {
            kind,
            depth: u32::from_le_bytes(h[12..16].try_into().expect("4 bytes")),
            key: h[16..48].try_into().expect("32 bytes"),
            parent: (parent != [0; 32]).then_some(parent),
            pools: Pools { csa_main: u64_at(80), csa_indexer: u64_at(88), hca: u64_at(96), swa: u64_at(104) },
            payload_len,
            payload_checksum: u64_at(120),
        })
    }

    /// Check a payload read back against this header.
    pub fn verify(&self, payload: &[u8]) -> Result<(), RecordError> {
        if payload.len() as u64 != self.payload_len || checksum(payload) != self.payload_checksum {
            return Err(RecordError::PayloadChecksum);
        }
        Ok(())
    }
}

/// The payload of a tombstone: where the record it deletes was.
pub fn tombstone_payload(segment: u64, offset: u64) -> Vec<u8> {
    let mut v = segment.to_le_bytes().to_vec();
    v.extend_from_slice(&offset.to_le_bytes());
    v
}

pub fn parse_tombstone(payload: &[u8]) -> Option<(u64, u64)> {
    if payload.len() != 16 {
        return None;
    }
    Some((u64::from_le_bytes(payload[..8].try_into().ok()?), u64::from_le_bytes(payload[8..].try_into().ok()?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(payload: &[u8]) -> Header {
        Header {
            kind: Kind::Page,
            depth: 7,
            key: [3; 32],
            parent: Some([9; 32]),
            pools: Pools { csa_main: 10, csa_indexer: 20, hca: 30, swa: 0 },
            payload_len: payload.len() as u64,
            payload_checksum: checksum(payload),
        }
    }

    #[test]
    fn headers_round_trip_and_catch_damage() {
        let payload = b"some page bytes".to_vec();
        let h = header(&payload);
        let bytes = h.encode();
        assert_eq!(Header::decode(&bytes), Ok(h));
        assert_eq!(h.verify(&payload), Ok(()));
        let mut torn = payload.clone();
        torn[3] ^= 1;
        assert_eq!(h.verify(&torn), Err(RecordError::PayloadChecksum));
        assert_eq!(h.verify(&payload[..4]), Err(RecordError::PayloadChecksum));
        for at in [0, 8, 20, 100, 130] {
            let mut bad = bytes;
            bad[at] ^= 0x40;
            assert!(Header::decode(&bad).is_err(), "a flip at byte {at} must be caught");
        }
        assert_eq!(Header::decode(&[0u8; 10]), Err(RecordError::Magic));
        let mut v1 = bytes;
        v1[..8].copy_from_slice(MAGIC_V1);
        assert_eq!(Header::decode(&v1), Err(RecordError::OldFormat));
        let root = Header { parent: None, ..h };
        assert_eq!(Header::decode(&root.encode()).unwrap().parent, None);
        // A length no file holds (fuzz/regressions/kvstore_record/payload-len-overflow).
        let huge = Header { payload_len: u64::MAX - 3, ..h };
        assert_eq!(Header::decode(&huge.encode()), Err(RecordError::Length(u64::MAX - 3)));
    }

    #[test]
    fn tombstones_name_a_location() {
        assert_eq!(parse_tombstone(&tombstone_payload(5, 1 << 40)), Some((5, 1 << 40)));
        assert_eq!(parse_tombstone(b"short"), None);
    }
}
