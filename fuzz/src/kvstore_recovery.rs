//! A kvstore directory of segment files (built with the real record encoder, then
//! damaged) opened by `Store::open`, which rebuilds the index (`store.rs` `recover`,
//! `index.rs`).
//!
//! Asserts: opening never panics; reopening what the first open left (it cut torn tails)
//! recovers the same records, bytes per pool and disk bytes; deleting any key terminates
//! and removes exactly the records it reports, and the deletion survives a restart;
//! every record the index offers reads back with its checksum or is reported `Corrupt`
//! (never served wrong, never a panic); lookups find at most the keys asked for.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cluster::telemetry::KvstoreMetrics;
use kvstore::record::{Kind, checksum};
use kvstore::segment::path;
use kvstore::store::{ReadError, Stats, Store, StoreConfig, StoreError};

use crate::structured::{Written, encode_segment, key, segments};

const MAX_SEGMENTS: usize = 4;

pub fn run(data: &[u8]) {
    let Some((&deletes, rest)) = data.split_first() else { return };
    let Ok(specs) = segments(rest, MAX_SEGMENTS) else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let mut written: Written = Vec::new();
    let mut ids = Vec::new();
    for spec in &specs {
        let id = spec.segment_id();
        if ids.contains(&id) {
            continue;
        }
        ids.push(id);
        std::fs::write(path(dir.path(), id), encode_segment(spec, &mut written)).expect("write segment");
    }
    let Ok(store) = open(dir.path()) else { return };
    let first = store.stats();
    store.shutdown();
    drop(store);

    let Some(store) = reopen(dir.path(), "a store that opened once opens again") else { return };
    assert_same(&first, &store.stats(), "reopening what recovery left");

    // Delete a few keys (and what chains from them): it terminates, and counts right.
    let before = store.stats();
    let mut gone = 0;
    for k in 0..4u8 {
        if deletes & (1 << k) != 0 {
            gone += store.delete(&[key(k.wrapping_mul(37))], false) as u64;
        }
    }
    if deletes & 0x80 != 0 {
        gone += store.delete(&[], true) as u64;
    }
    // Tombstones are written behind; what survives a restart is what is on disk.
    assert!(store.flush(Duration::from_secs(30)), "the writer drains its queue");
    let after = store.stats();
    assert_eq!(before.pages + before.snapshots - gone, after.pages + after.snapshots, "delete reports what it removed");
    store.shutdown();
    drop(store);

    let Some(store) = reopen(dir.path(), "reopen after deletes") else { return };
    assert_same(&after, &store.stats(), "deletes survive a restart");
    reads(&store);
    store.shutdown();
}

fn open(dir: &Path) -> Result<Arc<Store>, StoreError> {
    let cfg =
        StoreConfig { dir: dir.to_path_buf(), capacity: 256 << 20, segment_bytes: 64 << 10, queue_bytes: 1 << 20 };
    let registry = cluster::telemetry::metrics::registry("fuzz");
    Store::open(cfg, KvstoreMetrics::new(&registry))
}

/// Open a store that opened before. Each open starts a new segment, so one whose newest
/// segment id is within a few of `u64::MAX` runs out of ids: that, and only that, is
/// refused (naming the file to move).
fn reopen(dir: &Path, what: &str) -> Option<Arc<Store>> {
    match open(dir) {
        Ok(store) => Some(store),
        Err(e) if e.to_string().contains("largest possible segment id") => None,
        Err(e) => panic!("{what}: {e}"),
    }
}

fn assert_same(a: &Stats, b: &Stats, what: &str) {
    assert_eq!(
        (a.pages, a.snapshots, a.stored, a.disk_bytes),
        (b.pages, b.snapshots, b.stored, b.disk_bytes),
        "{what}"
    );
}

fn reads(store: &Store) {
    for k in 0..=255u8 {
        assert!(store.lookup(&[key(k)], 128).0 <= 1);
        for kind in [Kind::Page, Kind::Snapshot] {
            match store.read(&[(key(k), kind)]) {
                Ok(got) => {
                    assert_eq!(got.len(), 1);
                    let data: &[u8] = (*got[0].data).as_ref();
                    assert_eq!(checksum(data), got[0].checksum, "a served record matches its checksum");
                }
                Err(ReadError::Missing(0) | ReadError::Corrupt(0)) => {}
                Err(e) => panic!("one record asked for, error names another: {e}"),
            }
        }
    }
}
