//! Framing for the bytes peers exchange out of band: worker addresses and packed rkeys.
//!
//! UCX parses both without being told their length, so truncated or foreign bytes would
//! be read past their end. Every blob this crate hands out is therefore sealed as
//!
//! ```text
//! magic[4] | version u8 | reserved[3] | fields: u64 LE * n | payload_len u32 LE | payload | fnv1a64 u64 LE
//! ```
//!
//! and opened (magic, version, length and checksum verified) before UCX sees the
//! payload. This catches corruption, truncation and mixed-up blobs; it does not
//! authenticate: the control plane that carries these bytes is trusted.

use crate::raw;
use crate::status::UcxError;

pub(crate) const ADDRESS_MAGIC: [u8; 4] = *b"UCXA";
pub(crate) const RKEY_MAGIC: [u8; 4] = *b"UCXK";
const VERSION: u8 = 1;

/// Seals `payload` with `fields` (e.g. a region's base and length) in front of it.
pub(crate) fn seal(magic: [u8; 4], fields: &[u64], payload: &[u8]) -> Vec<u8> {
    let payload_len = u32::try_from(payload.len()).expect("UCX blobs are far smaller than 4 GiB");
    let mut out = Vec::with_capacity(8 + 8 * fields.len() + 4 + payload.len() + 8);
    out.extend_from_slice(&magic);
    out.extend_from_slice(&[VERSION, 0, 0, 0]);
    for field in fields {
        out.extend_from_slice(&field.to_le_bytes());
    }
    out.extend_from_slice(&payload_len.to_le_bytes());
    out.extend_from_slice(payload);
    let sum = fnv1a64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// An opened blob: its fields, and the payload copied into 8-byte-aligned storage
/// (UCX reads multi-byte integers straight out of it).
pub(crate) struct Opened<const N: usize> {
    pub(crate) fields: [u64; N],
    words: Vec<u64>,
}

impl<const N: usize> Opened<N> {
    pub(crate) fn payload_ptr(&self) -> *const u8 {
        self.words.as_ptr().cast()
    }
}

/// Verifies and opens a blob sealed with `magic` and `N` fields; `kind` names it in errors.
pub(crate) fn open<const N: usize>(magic: [u8; 4], kind: &str, bytes: &[u8]) -> Result<Opened<N>, UcxError> {
    let bad = |why: String| {
        UcxError::new(raw::UCS_ERR_INVALID_PARAM, format!("{kind} rejected: {why}"))
            .with_hint("pass the exact bytes the peer's ucx-sys produced (Worker::address / MemRegion::pack_rkey)")
    };
    let header = 8 + 8 * N + 4;
    if bytes.len() < header + 8 {
        return Err(bad(format!("{} bytes is shorter than any {kind}", bytes.len())));
    }
    if bytes[..4] != magic {
        return Err(bad("wrong magic (not this kind of blob)".into()));
    }
    if bytes[4] != VERSION {
        return Err(bad(format!("envelope version {} (expected {VERSION})", bytes[4])));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    if fnv1a64(body) != read_u64(sum) {
        return Err(bad("checksum mismatch (corrupted or truncated)".into()));
    }
    let mut fields = [0u64; N];
    for (i, field) in fields.iter_mut().enumerate() {
        *field = read_u64(&body[8 + 8 * i..]);
    }
    let len = u32::from_le_bytes(body[header - 4..header].try_into().expect("4 bytes")) as usize;
    let payload = &body[header..];
    if payload.len() != len {
        return Err(bad(format!("payload is {} bytes, header says {len}", payload.len())));
    }
    let mut words = vec![0u64; len.div_ceil(8)];
    for (word, chunk) in words.iter_mut().zip(payload.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *word = u64::from_ne_bytes(b);
    }
    Ok(Opened { fields, words })
}

fn read_u64(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"))
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let sealed = seal(RKEY_MAGIC, &[7, 9], b"hello world");
        let opened = open::<2>(RKEY_MAGIC, "rkey", &sealed).unwrap();
        assert_eq!(opened.fields, [7, 9]);
        // SAFETY: payload_ptr points at the 11 payload bytes (zero-padded to 16), owned by
        // `opened`.
        let payload = unsafe { std::slice::from_raw_parts(opened.payload_ptr(), 11) };
        assert_eq!(payload, b"hello world");
    }

    #[test]
    fn rejects_damage() {
        let sealed = seal(ADDRESS_MAGIC, &[], &[1, 2, 3, 4, 5]);
        assert!(open::<0>(RKEY_MAGIC, "rkey", &sealed).is_err(), "wrong kind");
        assert!(open::<0>(ADDRESS_MAGIC, "address", &sealed[..sealed.len() - 1]).is_err(), "truncated");
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x40;
            assert!(open::<0>(ADDRESS_MAGIC, "address", &bad).is_err(), "flipped byte {i}");
        }
        assert!(open::<0>(ADDRESS_MAGIC, "address", &[]).is_err());
    }
}
