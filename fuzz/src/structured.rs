//! kvstore segment files built from fuzzer bytes with the real record encoder, so that
//! headers carry valid checksums and the parsers behind them are reached: records with
//! lying lengths, pools and parents, tombstones naming real or made-up locations, then
//! byte damage (flips, a cut tail) optionally resealed with fresh header checksums.

use arbitrary::{Arbitrary, Unstructured};
use kvstore::record::{HEADER_LEN, Header, Key, Kind, Pools, checksum, tombstone_payload};

/// One record as the fuzzer describes it.
#[derive(Arbitrary, Debug)]
pub struct RecordSpec {
    /// 1 page, 2 snapshot, 3 tombstone; anything else is an unknown kind.
    kind: u8,
    depth: u32,
    key: u8,
    parent: Option<u8>,
    pools: [u64; 4],
    payload: Vec<u8>,
    /// A `payload_len` that is not the payload's length.
    lie_len: Option<u64>,
    /// A payload checksum that is wrong.
    bad_sum: bool,
    /// Tombstones: which earlier record (by index, wrapping) they delete.
    kills: u16,
}

#[derive(Arbitrary, Debug)]
pub enum Damage {
    Flip {
        at: u32,
        bit: u8,
    },
    Cut {
        at: u32,
    },
    /// Set a header's `payload_len` (record index wrapping) and reseal its checksum.
    Relength {
        record: u16,
        len: u64,
    },
    /// Overwrite 8 bytes anywhere and reseal every header.
    Poke {
        at: u32,
        value: u64,
    },
}

#[derive(Arbitrary, Debug)]
pub struct SegmentSpec {
    pub id: u8,
    /// An id near `u64::MAX` instead of a small one.
    pub huge_id: bool,
    pub records: Vec<RecordSpec>,
    pub damage: Vec<Damage>,
}

impl SegmentSpec {
    pub fn segment_id(&self) -> u64 {
        if self.huge_id { u64::MAX - self.id as u64 } else { self.id as u64 + 1 }
    }
}

/// Key `k` of a small key space (so records collide, chain and shadow each other).
pub fn key(k: u8) -> Key {
    let mut key = [0xa5; 32];
    key[0] = k;
    key
}

/// Records written so far, for tombstones to point at: `(segment, offset, kind code)`.
pub type Written = Vec<(u64, u64, u8)>;

/// The bytes of one segment file; appends what it wrote to `written`.
pub fn encode_segment(spec: &SegmentSpec, written: &mut Written) -> Vec<u8> {
    let id = spec.segment_id();
    let mut out = Vec::new();
    let mut starts = Vec::new();
    for r in &spec.records {
        let mut depth = r.depth;
        let payload = if r.kind == Kind::Tombstone.code() && !written.is_empty() {
            let (seg, off, code) = written[r.kills as usize % written.len()];
            depth = code as u32;
            tombstone_payload(seg, off)
        } else {
            r.payload.clone()
        };
        let header = header(r, depth, &payload);
        starts.push(out.len());
        written.push((id, out.len() as u64, r.kind));
        out.extend_from_slice(&header);
        out.extend_from_slice(&payload);
    }
    for d in &spec.damage {
        damage(&mut out, &starts, d);
    }
    out
}

fn header(r: &RecordSpec, depth: u32, payload: &[u8]) -> [u8; HEADER_LEN] {
    let [csa_main, csa_indexer, hca, swa] = r.pools;
    let mut sum = checksum(payload);
    if r.bad_sum {
        sum ^= 1;
    }
    let h = Header {
        kind: Kind::from_code(r.kind).unwrap_or(Kind::Page),
        depth,
        key: key(r.key),
        parent: r.parent.map(key),
        pools: Pools { csa_main, csa_indexer, hca, swa },
        payload_len: r.lie_len.unwrap_or(payload.len() as u64),
        payload_checksum: sum,
    };
    let mut bytes = h.encode();
    if Kind::from_code(r.kind).is_none() {
        bytes[8] = r.kind;
        reseal(&mut bytes);
    }
    bytes
}

fn reseal(h: &mut [u8]) {
    let sum = kvstore::record::header_checksum(&h[..128]);
    h[128..HEADER_LEN].copy_from_slice(&sum.to_le_bytes());
}

fn damage(out: &mut Vec<u8>, starts: &[usize], d: &Damage) {
    let len = out.len();
    match *d {
        Damage::Flip { at, bit } if len > 0 => out[at as usize % len] ^= 1 << (bit % 8),
        Damage::Cut { at } => out.truncate(at as usize % (len + 1)),
        Damage::Relength { record, len: new } if !starts.is_empty() => {
            let s = starts[record as usize % starts.len()];
            if s + HEADER_LEN <= len {
                out[s + 112..s + 120].copy_from_slice(&new.to_le_bytes());
                reseal(&mut out[s..s + HEADER_LEN]);
            }
        }
        Damage::Poke { at, value } if len >= 8 => {
            let at = at as usize % (len - 7);
            out[at..at + 8].copy_from_slice(&value.to_le_bytes());
            for &s in starts.iter().filter(|&&s| s + HEADER_LEN <= len) {
                reseal(&mut out[s..s + HEADER_LEN]);
            }
        }
        _ => {}
    }
}

/// Segments described by `data` (at most `max` of them).
pub fn segments(data: &[u8], max: usize) -> arbitrary::Result<Vec<SegmentSpec>> {
    let mut u = Unstructured::new(data);
    let mut out: Vec<SegmentSpec> = Vec::new();
    while out.len() < max && !u.is_empty() {
        out.push(SegmentSpec::arbitrary(&mut u)?);
    }
    Ok(out)
}
