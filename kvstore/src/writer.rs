//! The thread that owns appending: it writes queued records to the active segment
//! (write-behind), keeps the segment files under the capacity (compaction, then
//! eviction), rotates segments, and fsyncs once idle.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use crate::index::{Loc, Rec};
use crate::record::{Header, Key, Kind, Payload, Pools, parse_tombstone};
use crate::segment::{self, Segment, read_record};
use crate::store::{Shared, Store};

/// How long the writer waits for more work before it fsyncs what it wrote.
const SYNC_AFTER_IDLE: Duration = Duration::from_millis(200);

/// The thread that owns appending.
pub(crate) struct Writer {
    store: Arc<Store>,
    active: Segment,
}

impl Writer {
    pub(crate) fn new(store: Arc<Store>, active: Segment) -> Self {
        Writer { store, active }
    }

    pub(crate) fn run(mut self) {
        // Written but not yet fsynced; synced once the writer has been idle for
        // SYNC_AFTER_IDLE (and at every segment rotation and at shutdown), so a stream of
        // puts is not cut into many small synchronous flushes.
        let mut dirty = false;
        loop {
            let next = {
                let mut s = self.store.lock();
                loop {
                    if let Some(q) = s.queue.front() {
                        break Some((q.key, q.kind, q.parent, q.depth, q.pools, q.data.clone(), q.checksum));
                    }
                    if s.stop {
                        break None;
                    }
                    if dirty {
                        let (g, timeout) = self.store.work.wait_timeout(s, SYNC_AFTER_IDLE).expect("not poisoned");
                        s = g;
                        if timeout.timed_out() && s.queue.is_empty() {
                            break None;
                        }
                    } else {
                        s = self.store.work.wait(s).expect("not poisoned");
                    }
                }
            };
            let Some((key, kind, parent, depth, pools, data, sum)) = next else {
                if dirty {
                    if let Err(e) = self.active.sync() {
                        tracing::warn!(error = %e, "kvstore: fsync failed");
                    }
                    dirty = false;
                    continue;
                }
                break;
            };
            self.write_one(key, kind, parent, depth, pools, &data, sum);
            dirty = true;
        }
        let _ = self.active.sync();
    }

    fn still_wanted(&self, key: &Key, kind: Kind, data: &Payload) -> bool {
        if kind == Kind::Tombstone {
            return true;
        }
        let s = self.store.lock();
        matches!(s.index.get(key, kind).map(|r| &r.loc), Some(Loc::Queued(d)) if Arc::ptr_eq(d, data))
    }

    /// Append one queued record (unless it was deleted or evicted meanwhile), making
    /// room first.
    #[allow(clippy::too_many_arguments)]
    fn write_one(
        &mut self,
        key: Key,
        kind: Kind,
        parent: Option<Key>,
        depth: u32,
        pools: Pools,
        data: &Payload,
        sum: u64,
    ) {
        let bytes: &[u8] = (**data).as_ref();
        let header = Header { kind, depth, key, parent, pools, payload_len: bytes.len() as u64, payload_checksum: sum };
        let mut outcome: Result<Option<(u64, u64)>, &'static str> = Ok(None);
        if self.still_wanted(&key, kind, data) {
            outcome = self.make_room(header.total_len()).and_then(|()| {
                self.append(&header, bytes).map(Some).map_err(|e| {
                    tracing::warn!(error = %e, "kvstore: a record could not be written; serving continues");
                    "write_error"
                })
            });
        }
        let store = self.store.clone();
        let mut s = store.lock();
        let q = s.queue.pop_front().expect("the writer is the only consumer");
        s.queued_bytes -= (*q.data).as_ref().len() as u64;
        let ours = |s: &Shared| matches!(s.index.get(&key, kind).map(|r| &r.loc), Some(Loc::Queued(d)) if Arc::ptr_eq(d, data));
        match outcome {
            Ok(Some((seg, offset))) if kind != Kind::Tombstone => {
                if ours(&s) {
                    let rec = s.index.get_mut(&key, kind).expect("ours");
                    rec.loc = Loc::Disk { seg, offset };
                    let rec = rec.clone();
                    s.account(&rec);
                    self.store.metrics.written(&pools.labelled());
                }
            }
            Ok(_) => {}
            Err(reason) => {
                if reason == "write_error" {
                    self.store.metrics.write_errors.inc();
                } else {
                    self.store.metrics.dropped(reason);
                }
                if ours(&s) {
                    s.drop_record(&key, kind);
                    if kind == Kind::Page {
                        s.drop_record(&key, Kind::Snapshot);
                    }
                }
            }
        }
        self.store.publish(&s);
        if s.queue.is_empty() {
            self.store.drained.notify_all();
        }
    }

    /// Append to the active segment (starting a new one when this record would not
    /// fit); returns (segment, offset).
    fn append(&mut self, header: &Header, payload: &[u8]) -> io::Result<(u64, u64)> {
        if self.active.size > 0 && self.active.size + header.total_len() > self.store.cfg.segment_bytes {
            self.rotate()?;
        }
        let before = self.active.size;
        let result = self.active.append(header, payload);
        let mut s = self.store.lock();
        s.seg_size.insert(self.active.id, self.active.size);
        if let Err(e) = result {
            debug_assert_eq!(self.active.size, before);
            return Err(e);
        }
        drop(s);
        result.map(|offset| (self.active.id, offset))
    }

    fn rotate(&mut self) -> io::Result<()> {
        self.active.sync()?;
        let next = Segment::create(&self.store.cfg.dir, self.active.id + 1)?;
        let mut s = self.store.lock();
        s.files.insert(next.id, next.file.clone());
        s.seg_size.insert(next.id, 0);
        s.seg_live.entry(next.id).or_default();
        drop(s);
        self.active = next;
        Ok(())
    }

    /// Reclaim space until `need` more bytes fit under the capacity less one segment
    /// of headroom: compact the segment with the most dead bytes, or, when there is
    /// none, evict.
    fn make_room(&mut self, need: u64) -> Result<(), &'static str> {
        let cfg = &self.store.cfg;
        let limit = cfg.capacity - cfg.segment_bytes;
        loop {
            let (disk, candidate, active_dead) = {
                let s = self.store.lock();
                let dead = |id: &u64| s.seg_size[id].saturating_sub(*s.seg_live.get(id).unwrap_or(&0));
                let candidate = s
                    .seg_size
                    .keys()
                    .filter(|id| **id != self.active.id && dead(id) > 0)
                    .max_by_key(|id| (dead(id), std::cmp::Reverse(**id)))
                    .copied();
                (s.disk_bytes(), candidate, dead(&self.active.id))
            };
            if disk + need <= limit {
                return Ok(());
            }
            if let Some(seg) = candidate {
                if let Err(e) = self.compact(seg) {
                    tracing::warn!(segment = seg, error = %e, "kvstore: compaction failed");
                    return Err("write_error");
                }
                continue;
            }
            if active_dead > 0 {
                self.rotate().map_err(|_| "write_error")?;
                continue;
            }
            let mut s = self.store.lock();
            let Some((key, kind)) = s.index.victim() else {
                return Err("no_room");
            };
            let mut evicted = vec![(key, kind)];
            if kind == Kind::Page && s.index.has(&key, Kind::Snapshot) {
                evicted.push((key, Kind::Snapshot));
            }
            for (k, kind) in evicted {
                if let Some(rec) = s.drop_record(&k, kind) {
                    self.store.metrics.evicted(&rec.pools.labelled());
                    self.store.evictions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            self.store.publish(&s);
        }
    }

    /// Copy a segment's live records (and the tombstones still needed) to the active
    /// segment, then delete it.
    fn compact(&mut self, seg: u64) -> io::Result<()> {
        let file = {
            let s = self.store.lock();
            match s.files.get(&seg) {
                Some(f) => f.clone(),
                None => return Ok(()),
            }
        };
        let size = self.store.lock().seg_size[&seg];
        let view = Segment { id: seg, file: file.clone(), size };
        let (found, _) = view.scan(false)?;
        for f in found {
            let h = f.header;
            if h.kind == Kind::Tombstone {
                let needed = f
                    .tombstone
                    .as_deref()
                    .and_then(parse_tombstone)
                    .is_some_and(|(kseg, _)| kseg != seg && self.store.lock().files.contains_key(&kseg));
                if needed {
                    let payload = f.tombstone.expect("parsed above");
                    self.append(&h, &payload)?;
                }
                continue;
            }
            let live = self.store.lock().index.get(&h.key, h.kind).and_then(Rec::disk) == Some((seg, f.offset));
            if !live {
                continue;
            }
            let (_, payload) = match read_record(&file, f.offset) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(segment = seg, offset = f.offset, error = %e, "kvstore: dropping a damaged record");
                    self.store.metrics.corrupt.inc();
                    let mut s = self.store.lock();
                    s.drop_record(&h.key, h.kind);
                    continue;
                }
            };
            let (nseg, noff) = self.append(&h, &payload)?;
            let mut s = self.store.lock();
            if s.index.get(&h.key, h.kind).and_then(Rec::disk) == Some((seg, f.offset)) {
                let rec = s.index.get_mut(&h.key, h.kind).expect("live");
                rec.loc = Loc::Disk { seg: nseg, offset: noff };
                let rec = rec.clone();
                *s.seg_live.entry(nseg).or_default() += rec.total();
            }
        }
        // The copies must be durable before the originals go.
        self.active.sync()?;
        {
            let mut s = self.store.lock();
            s.files.remove(&seg);
            s.seg_size.remove(&seg);
            s.seg_live.remove(&seg);
            self.store.publish(&s);
        }
        std::fs::remove_file(segment::path(&self.store.cfg.dir, seg))?;
        tracing::debug!(segment = seg, "kvstore: segment compacted");
        Ok(())
    }
}
