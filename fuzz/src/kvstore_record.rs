//! kvstore record headers (`record.rs`) and tombstone payloads.
//!
//! Asserts: decoding never panics; a refused header is refused with a typed
//! `RecordError` (a header whose checksum fails is always refused); an accepted header
//! re-encodes to the same bytes (the three pad bytes aside, which the checksum covers
//! but nothing reads) and decodes to itself again; `total_len` does not overflow for any
//! accepted header; tombstone payloads parse exactly when they are 16 bytes and
//! round-trip. The first input byte picks raw bytes or bytes resealed with a valid
//! header checksum (so the fields behind the checksum are reached).

use kvstore::record::{
    HEADER_LEN, Header, MAX_PAYLOAD_LEN, RecordError, checksum, header_checksum, parse_tombstone, tombstone_payload,
};

pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut bytes = rest.to_vec();
    if mode & 1 == 1 && bytes.len() >= HEADER_LEN {
        let sum = header_checksum(&bytes[..128]);
        bytes[128..HEADER_LEN].copy_from_slice(&sum.to_le_bytes());
    }
    header(&bytes);
    tombstone(rest);
}

fn header(bytes: &[u8]) {
    match Header::decode(bytes) {
        Ok(h) => {
            assert!(bytes.len() >= HEADER_LEN);
            let again = h.encode();
            assert_eq!(again[..9], bytes[..9], "magic and kind re-encode");
            assert_eq!(again[12..HEADER_LEN - 8], bytes[12..HEADER_LEN - 8], "fields re-encode");
            assert_eq!(Header::decode(&again), Ok(h));
            assert!(h.total_len() >= HEADER_LEN as u64, "a record's length on disk is computable");
            assert!(h.verify(&[]).is_ok() == (h.payload_len == 0 && h.payload_checksum == checksum(&[])));
        }
        Err(e) => {
            let checksum_ok = bytes.len() >= HEADER_LEN
                && u64::from_le_bytes(bytes[128..HEADER_LEN].try_into().expect("8 bytes"))
                    == header_checksum(&bytes[..128]);
            match e {
                RecordError::Magic => assert!(bytes.len() < HEADER_LEN || bytes[..8] != *b"SLKVREC2"),
                RecordError::OldFormat => assert_eq!(bytes[..8], *b"SLKVREC1"),
                RecordError::HeaderChecksum => assert!(!checksum_ok),
                RecordError::Kind(k) => assert!(checksum_ok && !(1..=3).contains(&k)),
                RecordError::Length(n) => assert!(checksum_ok && n > MAX_PAYLOAD_LEN),
                RecordError::PayloadChecksum => panic!("decode never checks a payload"),
            }
        }
    }
}

fn tombstone(payload: &[u8]) {
    match parse_tombstone(payload) {
        Some((seg, off)) => {
            assert_eq!(payload.len(), 16);
            assert_eq!(tombstone_payload(seg, off), payload);
        }
        None => assert_ne!(payload.len(), 16),
    }
}
