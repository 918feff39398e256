//! The storage engine on a directory: an index in memory, records in append-only
//! segment files, and a writer thread behind a bounded queue (write-behind: a commit
//! returns once a record is queued and readable; the disk catches up).
//!
//! Capacity: the segment files never total more than `capacity`. Appends keep one
//! segment of headroom free, so compaction (copying a segment's live records forward,
//! then deleting it) always fits; when there is no dead space to reclaim, the writer
//! evicts (see [`crate::index`] for the order) until there is.
//!
//! Locking: one mutex guards the index, the queue and the accounting, held only for
//! bookkeeping. File reads and writes happen outside it: readers pin what they read
//! and use shared file handles (a segment deleted by compaction stays readable
//! through a handle already taken); the writer thread is the only one appending.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cluster::telemetry::KvstoreMetrics;
use thiserror::Error;

use crate::index::{Index, Loc, Rec};
use crate::record::{HEADER_LEN, Key, Kind, Payload, Pools, checksum, parse_tombstone, tombstone_payload};
use crate::segment::{self, Segment, read_record};

#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub dir: PathBuf,
    /// Most bytes the segment files may take.
    pub capacity: u64,
    /// Size at which the writer starts a new segment (the unit of compaction).
    pub segment_bytes: u64,
    /// Most bytes accepted but not yet written; puts beyond it are dropped.
    pub queue_bytes: u64,
}

impl StoreConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.segment_bytes < 64 * 1024 {
            return Err(format!("--segment-bytes {} is below the 64 KiB minimum", self.segment_bytes));
        }
        if self.capacity < 2 * self.segment_bytes {
            return Err(format!(
                "--capacity {} must hold at least two segments of --segment-bytes {} (one is kept free for compaction)",
                self.capacity, self.segment_bytes
            ));
        }
        Ok(())
    }

    /// The largest record that fits a segment.
    pub fn max_record(&self) -> u64 {
        self.segment_bytes - HEADER_LEN as u64
    }
}

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("invalid store configuration: {0}")]
    Config(String),
    #[error("store directory {dir}: {source}")]
    Dir { dir: PathBuf, source: io::Error },
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// A record someone wants to store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offer {
    pub key: Key,
    pub kind: Kind,
    pub parent: Option<Key>,
    pub depth: u32,
    pub len: u64,
    pub pools: Pools,
}

/// The store's answer to an offer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accept {
    Yes,
    /// Stored already.
    Have,
    /// Someone else is putting it right now.
    InFlight,
    /// A page whose parent, or a snapshot whose page, is neither stored nor coming.
    Orphan,
    /// Larger than a segment.
    TooLarge,
}

/// A record's bytes as read.
#[derive(Clone, Debug)]
pub struct Read {
    pub data: Payload,
    pub checksum: u64,
    pub pools: Pools,
}

/// Records pinned for reading ([`Store::pin`]); give them back with [`Store::unpin`].
pub struct Pinned {
    wanted: Vec<(Key, Kind)>,
    plan: Vec<(Rec, Option<Arc<File>>)>,
}

impl Pinned {
    /// Payload bytes of each record.
    pub fn lens(&self) -> Vec<usize> {
        self.plan.iter().map(|(r, _)| r.len as usize).collect()
    }

    pub fn checksums(&self) -> Vec<u64> {
        self.plan.iter().map(|(r, _)| r.checksum).collect()
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ReadError {
    #[error("record {0} is not stored")]
    Missing(usize),
    #[error("record {0} failed its checksum and was dropped")]
    Corrupt(usize),
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub disk_bytes: u64,
    pub segments: u64,
    pub pages: u64,
    pub snapshots: u64,
    pub stored: Pools,
    pub queued_records: u64,
    pub queued_bytes: u64,
    /// Records evicted since start.
    pub evictions: u64,
}

pub(crate) struct Queued {
    pub(crate) key: Key,
    pub(crate) kind: Kind,
    pub(crate) parent: Option<Key>,
    pub(crate) depth: u32,
    pub(crate) pools: Pools,
    pub(crate) data: Payload,
    pub(crate) checksum: u64,
}

pub(crate) struct Shared {
    pub(crate) index: Index,
    pub(crate) queue: VecDeque<Queued>,
    pub(crate) queued_bytes: u64,
    pub(crate) inflight: HashSet<(Key, Kind)>,
    /// Readable segments.
    pub(crate) files: HashMap<u64, Arc<File>>,
    /// Bytes per segment file, and how many of them belong to live records.
    pub(crate) seg_size: HashMap<u64, u64>,
    pub(crate) seg_live: HashMap<u64, u64>,
    pub(crate) stop: bool,
    /// Records holding bytes of each pool, and those bytes (kept as the index changes,
    /// so the gauges cost nothing to refresh).
    pub(crate) pool_records: [u64; 4],
    pub(crate) pool_bytes: [u64; 4],
}

impl Shared {
    /// Count a record into (`add`) or out of the per-pool totals.
    fn tally(&mut self, rec: &Rec, add: bool) {
        for (i, (_, b)) in rec.pools.labelled().iter().enumerate() {
            if *b > 0 {
                if add {
                    self.pool_records[i] += 1;
                    self.pool_bytes[i] += b;
                } else {
                    self.pool_records[i] = self.pool_records[i].saturating_sub(1);
                    self.pool_bytes[i] = self.pool_bytes[i].saturating_sub(*b);
                }
            }
        }
    }

    pub(crate) fn disk_bytes(&self) -> u64 {
        self.seg_size.values().sum()
    }

    /// Forget a record's bytes on disk (they become dead space).
    pub(crate) fn unaccount(&mut self, rec: &Rec) {
        if let Some((seg, _)) = rec.disk()
            && let Some(l) = self.seg_live.get_mut(&seg)
        {
            *l = l.saturating_sub(rec.total());
        }
    }

    pub(crate) fn account(&mut self, rec: &Rec) {
        if let Some((seg, _)) = rec.disk() {
            *self.seg_live.entry(seg).or_default() += rec.total();
        }
    }

    /// Remove a record from the index and its bytes from the live count.
    pub(crate) fn drop_record(&mut self, key: &Key, kind: Kind) -> Option<Rec> {
        let rec = self.index.remove(key, kind)?;
        self.unaccount(&rec);
        self.tally(&rec, false);
        Some(rec)
    }

    /// Put a record into the index, replacing (and unaccounting) an older copy.
    fn index_record(&mut self, key: Key, kind: Kind, parent: Option<Key>, depth: u32, rec: Rec) {
        self.account(&rec);
        self.tally(&rec, true);
        if let Some(old) = self.index.insert(key, kind, parent, depth, rec) {
            self.unaccount(&old);
            self.tally(&old, false);
        }
    }
}

pub struct Store {
    pub(crate) cfg: StoreConfig,
    pub(crate) shared: Mutex<Shared>,
    /// Wakes the writer (work queued, or stop).
    pub(crate) work: Condvar,
    /// Wakes waiters in [`Store::flush`] when the queue empties.
    pub(crate) drained: Condvar,
    pub(crate) metrics: KvstoreMetrics,
    pub(crate) writer: Mutex<Option<JoinHandle<()>>>,
    pub(crate) evictions: std::sync::atomic::AtomicU64,
}

impl Store {
    /// Open (or create) the store in `cfg.dir`, recovering its index from the segment
    /// files, and start the writer.
    pub fn open(cfg: StoreConfig, metrics: KvstoreMetrics) -> Result<Arc<Store>, StoreError> {
        cfg.validate().map_err(StoreError::Config)?;
        let dir_err = |source| StoreError::Dir { dir: cfg.dir.clone(), source };
        std::fs::create_dir_all(&cfg.dir).map_err(dir_err)?;
        let (shared, next_id) = recover(&cfg)?;
        let active = Segment::create(&cfg.dir, next_id).map_err(dir_err)?;
        let store = Arc::new(Store {
            cfg,
            shared: Mutex::new(shared),
            work: Condvar::new(),
            drained: Condvar::new(),
            metrics,
            writer: Mutex::new(None),
            evictions: Default::default(),
        });
        {
            let mut s = store.lock();
            s.files.insert(active.id, active.file.clone());
            s.seg_size.insert(active.id, 0);
            store.publish(&s);
        }
        let handle = std::thread::Builder::new().name("kvstore-writer".into()).spawn({
            let store = store.clone();
            move || crate::writer::Writer::new(store, active).run()
        })?;
        *store.writer.lock().expect("not poisoned") = Some(handle);
        Ok(store)
    }

    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().expect("the store lock is never poisoned: no panics while held")
    }

    /// Refresh the gauges from the state.
    pub(crate) fn publish(&self, s: &Shared) {
        let labels = Pools::default().labelled();
        let rows: Vec<(&str, u64, u64)> = (0..4).map(|i| (labels[i].0, s.pool_records[i], s.pool_bytes[i])).collect();
        self.metrics.set_stored(&rows);
        self.metrics.disk_bytes.set(s.disk_bytes() as i64);
        self.metrics.capacity_bytes.set(self.cfg.capacity as i64);
        self.metrics.queue_records.set(s.queue.len() as i64);
        self.metrics.queue_bytes.set(s.queued_bytes as i64);
    }

    /// The longest run of leading `keys` with pages, and the boundaries with snapshots.
    pub fn lookup(&self, keys: &[Key], block_tokens: u64) -> (usize, Vec<usize>) {
        let found = self.lock().index.lookup(keys);
        let m = &self.metrics;
        m.lookups.inc();
        m.query_tokens.inc_by(keys.len() as u64 * block_tokens);
        m.hit_tokens.inc_by(found.0 as u64 * block_tokens);
        m.miss_tokens.inc_by((keys.len() - found.0) as u64 * block_tokens);
        found
    }

    /// Decide which offered records to take; those accepted are reserved until
    /// [`Self::commit`] or [`Self::withdraw`].
    pub fn offer(&self, offers: &[Offer]) -> Vec<Accept> {
        let max = self.cfg.max_record();
        let mut s = self.lock();
        let mut coming: HashSet<(Key, Kind)> = HashSet::new();
        let mut out = Vec::with_capacity(offers.len());
        for o in offers {
            let present = |s: &Shared, key: &Key, kind: Kind, coming: &HashSet<(Key, Kind)>| {
                s.index.has(key, kind) || s.inflight.contains(&(*key, kind)) || coming.contains(&(*key, kind))
            };
            let a = if o.len == 0 || o.len > max {
                Accept::TooLarge
            } else if s.index.has(&o.key, o.kind) {
                Accept::Have
            } else if s.inflight.contains(&(o.key, o.kind)) || coming.contains(&(o.key, o.kind)) {
                Accept::InFlight
            } else {
                let anchored = match o.kind {
                    Kind::Page => o.parent.is_none_or(|p| present(&s, &p, Kind::Page, &coming)),
                    _ => present(&s, &o.key, Kind::Page, &coming),
                };
                if anchored { Accept::Yes } else { Accept::Orphan }
            };
            if a == Accept::Yes {
                coming.insert((o.key, o.kind));
            }
            out.push(a);
        }
        s.inflight.extend(coming);
        out
    }

    /// Give up reservations from [`Self::offer`].
    pub fn withdraw(&self, records: &[(Key, Kind)]) {
        let mut s = self.lock();
        for r in records {
            s.inflight.remove(r);
        }
    }

    /// Store an accepted record whose bytes were checked against `sum`: it is readable
    /// at once and written behind (from `data`, wherever it lives). Fails (dropping it)
    /// when the write queue is full.
    pub fn commit(&self, offer: &Offer, data: Payload, sum: u64) -> Result<(), &'static str> {
        let len = (*data).as_ref().len() as u64;
        let mut s = self.lock();
        s.inflight.remove(&(offer.key, offer.kind));
        if s.queued_bytes + len > self.cfg.queue_bytes {
            self.metrics.dropped("queue_full");
            return Err("queue_full");
        }
        let rec = Rec { loc: Loc::Queued(data.clone()), len, checksum: sum, pools: offer.pools, pins: 0 };
        s.index_record(offer.key, offer.kind, offer.parent, offer.depth, rec);
        s.queued_bytes += len;
        s.queue.push_back(Queued {
            key: offer.key,
            kind: offer.kind,
            parent: offer.parent,
            depth: offer.depth,
            pools: offer.pools,
            data,
            checksum: sum,
        });
        self.publish(&s);
        self.work.notify_one();
        Ok(())
    }

    /// Read records; each is pinned (never evicted) while it is read. A record read
    /// from disk is checked against its checksum; one that fails is dropped from the
    /// index and reported, never returned.
    pub fn read(&self, wanted: &[(Key, Kind)]) -> Result<Vec<Read>, ReadError> {
        let pinned = self.pin(wanted)?;
        let out: Result<Vec<Read>, ReadError> = (0..wanted.len()).map(|i| self.load(&pinned, i)).collect();
        self.unpin(pinned);
        out
    }

    /// Pin records for reading (all or none: `Missing` names the first absent one).
    /// Their lengths are known at once; [`Self::load`] reads them one at a time, so a
    /// reader can send one while reading the next.
    pub fn pin(&self, wanted: &[(Key, Kind)]) -> Result<Pinned, ReadError> {
        let mut plan = Vec::with_capacity(wanted.len());
        let mut s = self.lock();
        for (i, (key, kind)) in wanted.iter().enumerate() {
            let Some(rec) = s.index.get(key, *kind).cloned() else {
                unpin(&mut s, &wanted[..i]);
                return Err(ReadError::Missing(i));
            };
            s.index.get_mut(key, *kind).expect("present").pins += 1;
            let file = rec.disk().and_then(|(seg, _)| s.files.get(&seg).cloned());
            plan.push((rec, file));
        }
        Ok(Pinned { wanted: wanted.to_vec(), plan })
    }

    /// Read pinned record `i`, checked. One that fails its check is dropped from the
    /// index (with its snapshot, for a page) and reported as `Corrupt`.
    pub fn load(&self, pinned: &Pinned, i: usize) -> Result<Read, ReadError> {
        let (rec, file) = &pinned.plan[i];
        let (key, kind) = pinned.wanted[i];
        let data = match (&rec.loc, file) {
            (Loc::Queued(d), _) => Ok(d.clone()),
            (Loc::Disk { offset, .. }, Some(f)) => read_record(f, *offset).and_then(|(h, payload)| {
                if h.key != key || h.kind != kind || h.payload_checksum != rec.checksum {
                    Err(io::Error::new(io::ErrorKind::InvalidData, "the record there is another one"))
                } else {
                    Ok(Arc::new(payload) as Payload)
                }
            }),
            (Loc::Disk { .. }, None) => Err(io::Error::new(io::ErrorKind::NotFound, "segment gone")),
        };
        match data {
            Ok(d) => {
                self.metrics.read(&rec.pools.labelled());
                Ok(Read { data: d, checksum: rec.checksum, pools: rec.pools })
            }
            Err(e) => {
                tracing::error!(error = %e, record = i, "a stored record failed its check; dropping it");
                self.metrics.corrupt.inc();
                let mut s = self.lock();
                s.drop_record(&key, kind);
                if kind == Kind::Page {
                    s.drop_record(&key, Kind::Snapshot);
                }
                self.publish(&s);
                Err(ReadError::Corrupt(i))
            }
        }
    }

    /// Let pinned records be evicted again.
    pub fn unpin(&self, pinned: Pinned) {
        unpin(&mut self.lock(), &pinned.wanted);
    }

    /// Delete `keys` and everything chained after them (or everything, with `all`).
    /// Deleted records stay deleted across restarts (tombstones are logged).
    pub fn delete(&self, keys: &[Key], all: bool) -> usize {
        let mut s = self.lock();
        let targets: Vec<Key> = if all {
            s.index.keys()
        } else {
            let mut t: Vec<Key> = keys.iter().flat_map(|k| s.index.subtree(k)).collect();
            t.sort_unstable();
            t.dedup();
            t
        };
        let mut deleted = 0;
        for key in targets {
            for kind in [Kind::Snapshot, Kind::Page] {
                let Some(rec) = s.drop_record(&key, kind) else { continue };
                deleted += 1;
                if let Some((seg, offset)) = rec.disk() {
                    let payload = tombstone_payload(seg, offset);
                    s.queued_bytes += payload.len() as u64;
                    s.queue.push_back(Queued {
                        key,
                        kind: Kind::Tombstone,
                        parent: None,
                        depth: kind.code() as u32,
                        pools: Pools::default(),
                        checksum: checksum(&payload),
                        data: Arc::new(payload),
                    });
                }
            }
        }
        self.publish(&s);
        self.work.notify_one();
        deleted
    }

    pub fn stats(&self) -> Stats {
        let s = self.lock();
        let (pages, snapshots, stored) = s.index.totals();
        Stats {
            disk_bytes: s.disk_bytes(),
            segments: s.seg_size.len() as u64,
            pages,
            snapshots,
            stored,
            queued_records: s.queue.len() as u64,
            queued_bytes: s.queued_bytes,
            evictions: self.evictions.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Wait until everything queued is on disk (bounded).
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        while !s.queue.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            s = self.drained.wait_timeout(s, left).expect("not poisoned").0;
        }
        true
    }

    /// Write out what is queued, then stop the writer.
    pub fn shutdown(&self) {
        self.lock().stop = true;
        self.work.notify_all();
        if let Some(h) = self.writer.lock().expect("not poisoned").take() {
            let _ = h.join();
        }
    }
}

fn unpin(s: &mut Shared, records: &[(Key, Kind)]) {
    for (key, kind) in records {
        if let Some(r) = s.index.get_mut(key, *kind) {
            r.pins = r.pins.saturating_sub(1);
        }
    }
}

/// Rebuild the index from the segment files: records in log order (a later copy of a
/// record wins; tombstones delete the copy they name), torn or damaged tails cut off,
/// and what no lookup can reach dropped. Returns the state and the next segment id.
fn recover(cfg: &StoreConfig) -> Result<(Shared, u64), StoreError> {
    let ids = segment::list(&cfg.dir).map_err(|source| StoreError::Dir { dir: cfg.dir.clone(), source })?;
    let mut s = Shared {
        index: Index::default(),
        queue: VecDeque::new(),
        queued_bytes: 0,
        inflight: HashSet::new(),
        files: HashMap::new(),
        seg_size: HashMap::new(),
        seg_live: HashMap::new(),
        stop: false,
        pool_records: [0; 4],
        pool_bytes: [0; 4],
    };
    let started = Instant::now();
    for (i, &id) in ids.iter().enumerate() {
        let mut seg = Segment::open(&cfg.dir, id)?;
        // A crash can only tear the segments being written last; older ones are
        // checked record by record when read.
        let last = i + 1 == ids.len() || i + 2 == ids.len();
        let (found, end) = seg.scan(last)?;
        if end < seg.size {
            tracing::warn!(segment = id, kept = end, cut = seg.size - end, "cutting a torn or damaged segment tail");
            seg.truncate(end)?;
        }
        for f in found {
            let h = f.header;
            match h.kind {
                Kind::Tombstone => {
                    let (Some(kind), Some((kseg, koff))) =
                        (Kind::from_code(h.depth as u8), f.tombstone.as_deref().and_then(parse_tombstone))
                    else {
                        continue;
                    };
                    if s.index.get(&h.key, kind).and_then(Rec::disk) == Some((kseg, koff)) {
                        s.drop_record(&h.key, kind);
                    }
                }
                kind => {
                    let rec = Rec {
                        loc: Loc::Disk { seg: id, offset: f.offset },
                        len: h.payload_len,
                        checksum: h.payload_checksum,
                        pools: h.pools,
                        pins: 0,
                    };
                    s.index_record(h.key, kind, h.parent, h.depth, rec);
                }
            }
        }
        s.seg_size.insert(id, seg.size);
        s.seg_live.entry(id).or_default();
        s.files.insert(id, seg.file.clone());
    }
    for (_, _, rec) in s.index.prune_unreachable() {
        s.unaccount(&rec);
        s.tally(&rec, false);
    }
    let (pages, snapshots, _) = s.index.totals();
    tracing::info!(
        dir = %cfg.dir.display(),
        segments = ids.len(),
        pages,
        snapshots,
        disk_bytes = s.disk_bytes(),
        ms = started.elapsed().as_millis() as u64,
        "kvstore index recovered"
    );
    // The next segment's id; a file already at the largest id leaves none to give.
    let next = ids.last().map_or(Some(1), |l| l.checked_add(1)).ok_or_else(|| StoreError::Dir {
        dir: cfg.dir.clone(),
        source: io::Error::other(format!(
            "{} has the largest possible segment id, so no newer segment can be named; move it out of the store directory",
            segment::path(&cfg.dir, u64::MAX).display()
        )),
    })?;
    Ok((s, next))
}
