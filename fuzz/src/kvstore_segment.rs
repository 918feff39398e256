//! One kvstore segment file scanned as start-up recovery scans it (`segment.rs`).
//!
//! Asserts: a scan never panics, on raw bytes or on records built with the real encoder
//! (valid header checksums over lying lengths, unknown kinds, damage); the records it
//! returns are back to back from offset 0, each header decodes at its offset, and the
//! scan ends where the last one ends, within the file; the payload-checking scan returns
//! a prefix of the header-only scan, every payload it returns checks, and tombstones
//! carry their payload; cutting the file where the scan ended (what recovery does) and
//! scanning again finds the same records and no torn tail: recovery is idempotent.

use std::os::unix::fs::FileExt;

use kvstore::record::{HEADER_LEN, Header, Kind};
use kvstore::segment::{Found, Segment, path, read_record};

use crate::structured::{SegmentSpec, encode_segment};

pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let bytes = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let mut u = arbitrary::Unstructured::new(rest);
        let Ok(spec) = <SegmentSpec as arbitrary::Arbitrary>::arbitrary(&mut u) else { return };
        encode_segment(&spec, &mut Vec::new())
    };
    check(&bytes);
}

fn check(bytes: &[u8]) {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(path(dir.path(), 1), bytes).expect("write segment");
    let mut seg = Segment::open(dir.path(), 1).expect("open segment");
    assert_eq!(seg.size, bytes.len() as u64);
    let (quick, quick_end) = seg.scan(false).expect("scan");
    let (full, full_end) = seg.scan(true).expect("scan");
    laid_back_to_back(&quick, quick_end, bytes);
    laid_back_to_back(&full, full_end, bytes);
    assert!(full.len() <= quick.len() && full_end <= quick_end, "checking payloads only shortens the scan");
    for (f, q) in full.iter().zip(&quick) {
        assert_eq!((f.offset, f.header), (q.offset, q.header));
    }
    for f in &full {
        let (h, payload) = read_record(&seg.file, f.offset).expect("a record the full scan kept reads back");
        assert_eq!(h, f.header);
        if h.kind == Kind::Tombstone {
            assert_eq!(f.tombstone.as_deref(), Some(&payload[..]));
        }
    }
    seg.truncate(full_end).expect("cut the tail");
    let reopened = Segment::open(dir.path(), 1).expect("reopen");
    let (again, end) = reopened.scan(true).expect("rescan");
    assert_eq!(end, reopened.size, "no torn tail left after recovery cut it");
    assert_eq!(again.len(), full.len());
    for (a, f) in again.iter().zip(&full) {
        assert_eq!((a.offset, a.header), (f.offset, f.header));
    }
    let mut h = [0u8; HEADER_LEN];
    if let Some(last) = again.last() {
        reopened.file.read_exact_at(&mut h, last.offset).expect("read the last header");
        assert_eq!(Header::decode(&h), Ok(last.header));
    }
}

fn laid_back_to_back(found: &[Found], end: u64, bytes: &[u8]) {
    let mut at = 0u64;
    for f in found {
        assert_eq!(f.offset, at, "records are back to back");
        let start = f.offset as usize;
        assert_eq!(Header::decode(&bytes[start..]), Ok(f.header));
        at = at.checked_add(HEADER_LEN as u64).and_then(|a| a.checked_add(f.header.payload_len)).expect("no overflow");
        assert!(at <= bytes.len() as u64, "a record the scan kept lies inside the file");
        assert_eq!(
            f.tombstone.is_some(),
            f.header.kind == Kind::Tombstone,
            "tombstones, and only they, carry a payload"
        );
    }
    assert_eq!(end, at, "the scan ends where its last record ends");
}
