//! The storage engine on a real directory: write-behind and restart, torn tails after a
//! crash, deletes that survive restarts, capacity and the eviction order, and readers
//! racing eviction.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cluster::telemetry::KvstoreMetrics;
use kvstore::record::{Key, Kind, Pools, checksum};
use kvstore::store::{Accept, Offer, ReadError, Store, StoreConfig};

const FLUSH: Duration = Duration::from_secs(30);

fn cfg(dir: &Path, capacity: u64, segment: u64) -> StoreConfig {
    StoreConfig { dir: dir.to_path_buf(), capacity, segment_bytes: segment, queue_bytes: 64 << 20 }
}

fn open(c: StoreConfig) -> Arc<Store> {
    let registry = cluster::telemetry::metrics::registry("kvstore-test");
    Store::open(c, KvstoreMetrics::new(&registry)).unwrap()
}

/// Key of block `depth` of prompt family `chain` (families share nothing).
fn key(chain: u8, depth: u32) -> Key {
    let mut k = [0u8; 32];
    k[0] = chain;
    k[1..5].copy_from_slice(&depth.to_le_bytes());
    k[31] = 0xa5;
    k
}

/// Deterministic record contents, different per (key, kind).
fn payload(key: &Key, kind: Kind, len: usize) -> Vec<u8> {
    let salt = key.iter().fold(kind.code() as u32, |a, &b| a.wrapping_mul(31).wrapping_add(b as u32));
    (0..len as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(salt) >> 13) as u8).collect()
}

fn offer(chain: u8, depth: u32, kind: Kind, len: usize) -> Offer {
    let pools = match kind {
        Kind::Page => Pools { csa_main: len as u64 / 2, csa_indexer: len as u64 / 4, hca: len as u64 / 4, swa: 0 },
        _ => Pools { swa: len as u64, ..Pools::default() },
    };
    Offer {
        key: key(chain, depth),
        kind,
        parent: (depth > 0).then(|| key(chain, depth - 1)),
        depth,
        len: len as u64,
        pools,
    }
}

/// Snapshots of `len` bytes at the depths where the function says so.
type Snapshots = Option<(usize, fn(u32) -> bool)>;

/// Offer and commit a chain of `blocks` pages (plus snapshots where `snap(depth)`).
fn put_chain(s: &Store, chain: u8, blocks: u32, page: usize, snap: Snapshots) {
    let mut offers = Vec::new();
    for d in 0..blocks {
        offers.push(offer(chain, d, Kind::Page, page));
        if let Some((len, at)) = snap
            && at(d)
        {
            offers.push(offer(chain, d, Kind::Snapshot, len));
        }
    }
    let answers = s.offer(&offers);
    for (o, a) in offers.iter().zip(answers) {
        if a == Accept::Yes {
            let bytes = payload(&o.key, o.kind, o.len as usize);
            let sum = checksum(&bytes);
            s.commit(o, Arc::new(bytes), sum).unwrap();
        }
    }
}

fn disk_usage(dir: &Path) -> u64 {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum()
}

fn check_read(s: &Store, chain: u8, depth: u32, kind: Kind, len: usize) -> Result<(), ReadError> {
    let k = key(chain, depth);
    let r = s.read(&[(k, kind)])?;
    assert_eq!(
        (*r[0].data).as_ref(),
        payload(&k, kind, len).as_slice(),
        "record {chain}/{depth} {kind:?} came back different"
    );
    Ok(())
}

#[test]
fn puts_are_readable_at_once_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(cfg(dir.path(), 64 << 20, 4 << 20));
    put_chain(&s, 1, 5, 50_000, Some((200_000, |d| d % 2 == 1)));
    // Readable before the writer caught up, and after.
    check_read(&s, 1, 4, Kind::Page, 50_000).unwrap();
    assert!(s.flush(FLUSH));
    assert_eq!(s.stats().queued_records, 0);
    assert_eq!(s.lookup(&(0..7).map(|d| key(1, d)).collect::<Vec<_>>(), 128), (5, vec![2, 4]));
    // Offers of what is stored, of orphans and of oversized records are declined.
    let again =
        s.offer(&[offer(1, 0, Kind::Page, 50_000), offer(9, 3, Kind::Page, 10), offer(1, 5, Kind::Page, 5 << 20)]);
    assert_eq!(again, vec![Accept::Have, Accept::Orphan, Accept::TooLarge]);
    let first = s.offer(&[offer(2, 0, Kind::Page, 10)]);
    assert_eq!(first, vec![Accept::Yes]);
    assert_eq!(s.offer(&[offer(2, 0, Kind::Page, 10)]), vec![Accept::InFlight], "a concurrent put of the same block");
    s.withdraw(&[(key(2, 0), Kind::Page)]);
    s.shutdown();

    let s = open(cfg(dir.path(), 64 << 20, 4 << 20));
    let st = s.stats();
    assert_eq!((st.pages, st.snapshots), (5, 2));
    assert_eq!(st.stored.swa, 400_000);
    for d in 0..5 {
        check_read(&s, 1, d, Kind::Page, 50_000).unwrap();
    }
    check_read(&s, 1, 3, Kind::Snapshot, 200_000).unwrap();
    assert_eq!(s.read(&[(key(1, 2), Kind::Snapshot)]).unwrap_err(), ReadError::Missing(0));
    s.shutdown();
}

#[test]
fn a_torn_tail_is_cut_and_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(cfg(dir.path(), 64 << 20, 8 << 20));
    put_chain(&s, 1, 4, 30_000, None);
    assert!(s.flush(FLUSH));
    s.shutdown();
    // A crash in the middle of the next record: half a header and payload at the end.
    let segs = kvstore::segment::list(dir.path()).unwrap();
    let with_data = segs.iter().copied().find(|&id| disk_usage_of(dir.path(), id) > 0).unwrap();
    let path = kvstore::segment::path(dir.path(), with_data);
    let mut bytes = std::fs::read(&path).unwrap();
    let good = bytes.len();
    let mut torn = bytes[..200].to_vec(); // the start of a real record: a valid-looking header prefix
    torn.extend(vec![7u8; 5000]);
    bytes.extend(torn);
    std::fs::write(&path, &bytes).unwrap();
    // And flip a byte inside the last good record's payload.
    let mut damaged = std::fs::read(&path).unwrap();
    damaged[good - 10] ^= 0xff;
    std::fs::write(&path, &damaged).unwrap();

    let s = open(cfg(dir.path(), 64 << 20, 8 << 20));
    assert_eq!(
        std::fs::metadata(&path).unwrap().len() as usize,
        good - (30_000 + 136),
        "cut before the damaged record"
    );
    assert_eq!(s.stats().pages, 3);
    for d in 0..3 {
        check_read(&s, 1, d, Kind::Page, 30_000).unwrap();
    }
    assert_eq!(s.read(&[(key(1, 3), Kind::Page)]).unwrap_err(), ReadError::Missing(0));
    s.shutdown();
}

fn disk_usage_of(dir: &Path, id: u64) -> u64 {
    std::fs::metadata(kvstore::segment::path(dir, id)).map(|m| m.len()).unwrap_or(0)
}

#[test]
fn damage_found_on_read_drops_the_record_and_is_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(cfg(dir.path(), 64 << 20, 1 << 20));
    // Enough to fill several segments, so the damaged one is not scanned at start.
    put_chain(&s, 1, 60, 60_000, None);
    assert!(s.flush(FLUSH));
    s.shutdown();
    let first = kvstore::segment::list(dir.path()).unwrap()[0];
    let path = kvstore::segment::path(dir.path(), first);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[136 + 100] ^= 1; // the first record's payload
    std::fs::write(&path, &bytes).unwrap();
    let s = open(cfg(dir.path(), 64 << 20, 1 << 20));
    assert_eq!(s.read(&[(key(1, 0), Kind::Page)]).unwrap_err(), ReadError::Corrupt(0));
    assert_eq!(
        s.read(&[(key(1, 0), Kind::Page)]).unwrap_err(),
        ReadError::Missing(0),
        "dropped after the failed check"
    );
    check_read(&s, 1, 1, Kind::Page, 60_000).unwrap();
    s.shutdown();
}

#[test]
fn deletes_take_the_subtree_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(cfg(dir.path(), 64 << 20, 4 << 20));
    put_chain(&s, 1, 6, 10_000, Some((20_000, |_| true)));
    put_chain(&s, 2, 3, 10_000, None);
    assert!(s.flush(FLUSH));
    assert_eq!(s.delete(&[key(1, 3)], false), 6, "blocks 3, 4, 5 with their snapshots");
    assert!(s.flush(FLUSH));
    s.shutdown();
    let s = open(cfg(dir.path(), 64 << 20, 4 << 20));
    let keys: Vec<Key> = (0..6).map(|d| key(1, d)).collect();
    assert_eq!(s.lookup(&keys, 128), (3, vec![1, 2, 3]));
    assert_eq!(s.stats().pages, 6);
    assert_eq!(s.delete(&[], true), 9);
    assert!(s.flush(FLUSH));
    s.shutdown();
    let s = open(cfg(dir.path(), 64 << 20, 4 << 20));
    assert_eq!(s.stats().pages, 0);
    s.shutdown();
}

#[test]
fn capacity_is_never_exceeded_and_eviction_follows_the_rules() {
    let dir = tempfile::tempdir().unwrap();
    let (capacity, segment) = (6u64 << 20, 1u64 << 20);
    let s = open(cfg(dir.path(), capacity, segment));
    let (page, snap) = (40_000usize, 150_000usize);
    // One shared trunk (chain 0), then many prompts: their pages chain from their own
    // first block; every fourth block has a snapshot.
    put_chain(&s, 0, 4, page, Some((snap, |d| d == 3)));
    assert!(s.flush(FLUSH));
    let mut max_seen = 0;
    for chain in 1..=40u8 {
        put_chain(&s, chain, 6, page, Some((snap, |d| d % 4 == 3)));
        assert!(s.flush(FLUSH));
        let used = disk_usage(dir.path());
        max_seen = max_seen.max(used);
        assert!(used <= capacity, "{used} bytes on disk over a capacity of {capacity}");
        assert_eq!(s.stats().disk_bytes, used, "accounting matches the directory");
    }
    let st = s.stats();
    assert!(st.evictions > 0, "the working set is several times the capacity");
    assert!(max_seen > capacity / 2, "the store used its room ({max_seen})");
    // Snapshots go first: with the pressure this high, none are left; pages form whole
    // prefixes (a leaf goes before the block it chains from).
    assert_eq!(st.snapshots, 0);
    for chain in 1..=40u8 {
        let keys: Vec<Key> = (0..6).map(|d| key(chain, d)).collect();
        let (n, _) = s.lookup(&keys, 128);
        for d in 0..6u32 {
            let present = s.read(&[(key(chain, d), Kind::Page)]).is_ok();
            assert_eq!(present, d < n as u32, "chain {chain}: block {d} present={present} but the prefix is {n}");
        }
    }
    // The most recent prompts are the ones kept.
    let recent: usize = (35..=40u8).map(|c| s.lookup(&(0..6).map(|d| key(c, d)).collect::<Vec<_>>(), 128).0).sum();
    let old: usize = (1..=6u8).map(|c| s.lookup(&(0..6).map(|d| key(c, d)).collect::<Vec<_>>(), 128).0).sum();
    assert!(recent > old, "LRU: recent prompts keep more ({recent}) than old ones ({old})");
    s.shutdown();
    let s = open(cfg(dir.path(), capacity, segment));
    assert!(disk_usage(dir.path()) <= capacity);
    s.shutdown();
}

#[test]
fn readers_racing_eviction_get_whole_records_or_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(cfg(dir.path(), 4 << 20, 512 << 10));
    let page = 30_000usize;
    put_chain(&s, 1, 8, page, None);
    assert!(s.flush(FLUSH));
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut ok, mut missing) = (0, 0);
                while !stop.load(Ordering::Relaxed) {
                    for d in 0..8 {
                        match check_read(&s, 1, d, Kind::Page, page) {
                            Ok(()) => ok += 1,
                            Err(ReadError::Missing(_)) => missing += 1,
                            Err(e) => panic!("a reader saw {e}"),
                        }
                    }
                }
                (ok, missing)
            })
        })
        .collect();
    for chain in 2..40u8 {
        put_chain(&s, chain, 4, page, None);
    }
    assert!(s.flush(FLUSH));
    stop.store(true, Ordering::Relaxed);
    let (mut ok, mut missing) = (0, 0);
    for r in readers {
        let (o, m) = r.join().unwrap();
        ok += o;
        missing += m;
    }
    assert!(ok > 0, "readers read");
    assert!(missing > 0 || s.stats().evictions > 0, "eviction ran while they read");
    assert!(disk_usage(dir.path()) <= 4 << 20);
    s.shutdown();
}

#[test]
fn pool_gauges_follow_puts_evictions_and_deletes() {
    let dir = tempfile::tempdir().unwrap();
    let registry = cluster::telemetry::metrics::registry("kvstore-test");
    let s = Store::open(cfg(dir.path(), 3 << 20, 512 << 10), KvstoreMetrics::new(&registry)).unwrap();
    let gauge = |name: &str, pool: &str| -> u64 {
        let text = cluster::telemetry::metrics::encode(&registry);
        let series = format!("{name}{{pool=\"{pool}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&series)).unwrap().trim().parse().unwrap()
    };
    let check = |s: &Store| {
        let st = s.stats();
        assert_eq!(gauge("sluice_kvstore_stored_bytes", "swa"), st.stored.swa);
        assert_eq!(gauge("sluice_kvstore_stored_bytes", "csa_main"), st.stored.csa_main);
        assert_eq!(gauge("sluice_kvstore_entries", "swa"), st.snapshots);
        assert_eq!(gauge("sluice_kvstore_entries", "hca"), st.pages);
    };
    for chain in 1..=12u8 {
        put_chain(&s, chain, 4, 40_000, Some((100_000, |d| d % 2 == 1)));
        assert!(s.flush(FLUSH));
        check(&s);
    }
    assert!(s.stats().evictions > 0);
    s.delete(&[key(12, 1)], false);
    check(&s);
    s.shutdown();
}
