//! The KV handshake a prefill worker decodes from a decode worker's reservation
//! (`KvTarget`: wire version, geometry, registered regions, page ids, slot;
//! `transfer/src/wire.rs`, `target.rs`) and the checksums of a commit.
//!
//! Asserts: decoding never panics; a refused target is refused with a typed
//! `WireError` (`Version` exactly when the version differs); an accepted target encodes
//! and decodes back to itself, its proto form matches the input field for field (the
//! fingerprint and dtype names aside, which have aliases), its geometry agrees with
//! itself, and every byte the sender would write for it (each page at its id, the
//! state parts at the slot) lies inside the region the peer registered, with no
//! address arithmetic overflowing. For commits: checksums agree with themselves and a
//! different page count is always named as a mismatch.

use prost::Message;
use sluice_proto::v1 as pb;
use transfer::{Checksums, RegionSpec, Target, WIRE_VERSION, WireError};

pub fn run(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else { return };
    if which & 1 == 0 {
        if let Ok(msg) = pb::KvTarget::decode(rest) {
            target(&msg);
        }
    } else if let Ok(msg) = pb::CommitRequest::decode(rest) {
        commit(&msg);
    }
}

fn target(msg: &pb::KvTarget) {
    match Target::from_proto(msg) {
        Ok(t) => {
            assert_eq!(msg.wire_version, WIRE_VERSION);
            let again = t.to_proto();
            assert_eq!(Target::from_proto(&again).as_ref(), Ok(&t), "decode(encode(t)) == t");
            let (mut canon, mut got) = (msg.clone(), again.clone());
            for g in [canon.geometry.as_mut(), got.geometry.as_mut()].into_iter().flatten() {
                g.fingerprint.clear();
                g.entry_dtype.clear();
            }
            assert_eq!(canon, got, "an accepted target re-encodes field for field");
            t.geometry.check_compatible(&t.geometry).expect("a geometry agrees with itself");
            let g = &t.geometry;
            for &id in &t.page_ids {
                inside(&t.pages, id as u64, g.page_bytes as u64, "a page");
            }
            inside(&t.rings, t.slot as u64, g.ring_bytes as u64, "window rings");
            inside(&t.comp, t.slot as u64, g.comp_bytes as u64, "compressor slots");
            inside(&t.logits, t.slot as u64, g.logits_bytes as u64, "logits");
        }
        Err(WireError::Version { theirs }) => assert!(theirs == msg.wire_version && theirs != WIRE_VERSION),
        Err(e @ (WireError::Malformed(_) | WireError::Mismatch { .. })) => {
            assert_eq!(msg.wire_version, WIRE_VERSION);
            assert!(!e.to_string().is_empty());
        }
    }
}

/// Item `index` of `size` bytes lies inside `region`, computed without overflow.
fn inside(region: &RegionSpec, index: u64, size: u64, what: &str) {
    let end = index.checked_mul(size).and_then(|start| start.checked_add(size));
    let fits = end.is_some_and(|end| end <= region.len) && region.base.checked_add(region.len).is_some();
    assert!(
        fits,
        "{what} (#{index}, {size} bytes) lies outside its region (base {}, {} bytes)",
        region.base, region.len
    );
}

fn commit(msg: &pb::CommitRequest) {
    let sent = Checksums {
        pages: msg.page_checksums.clone(),
        rings: msg.rings_checksum,
        comp: msg.comp_checksum,
        logits: msg.logits_checksum,
    };
    assert_eq!(sent.first_mismatch(&sent), None);
    let mut fewer = sent.clone();
    fewer.pages.pop();
    if !sent.pages.is_empty() {
        assert!(sent.first_mismatch(&fewer).is_some_and(|m| m.contains("pages")));
    }
}
