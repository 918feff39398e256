//! The `sluice.v1.KvStore` gRPC service: thin adapters over the store (lookup,
//! offers, commits, reads, deletes, stats), the staging area puts land in, and the
//! bulk thread that writes gets into callers' memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cluster::telemetry::KvstoreMetrics;
use cluster::telemetry::propagation;
use model_spec::{BLOCK_TOKENS, SwaPolicy};
use sluice_proto::v1 as pb;
use sluice_proto::v1::kv_store_server::KvStore;
use tonic::{Request, Response, Status};
use tracing::Instrument;
use transfer::{Landing, RegionSpec};

use crate::bulk::{self, Bulk};
use crate::ranges::Ranges;
use crate::record::{Key, Kind, Pools, checksum};
use crate::store::{Accept, Offer, Store};

/// An accepted put waiting for its bytes.
struct PendingPut {
    offers: Vec<Offer>,
    offsets: Vec<u64>,
    deadline: Instant,
}

/// Bytes of a committed put, left where its writer put them: queued for disk from
/// there and served from there until the disk writer and every reader are done with
/// them; the staging range is given back when the last of them lets go.
struct Staged {
    landing: Arc<Landing>,
    ranges: Arc<Mutex<Ranges>>,
    offset: u64,
    len: u64,
}

impl AsRef<[u8]> for Staged {
    fn as_ref(&self) -> &[u8] {
        self.landing.bytes(self.offset as usize, self.len as usize)
    }
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Staged({} bytes at {})", self.len, self.offset)
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        self.ranges.lock().expect("not poisoned").release(self.offset, self.len);
    }
}

pub struct KvService {
    pub store: Arc<Store>,
    pub policy: SwaPolicy,
    pub metrics: KvstoreMetrics,
    pub landing: Arc<Landing>,
    pub ucx_address: Vec<u8>,
    pub bulk: Bulk,
    pub put_lease: Duration,
    pub get_timeout: Duration,
    /// Free ranges of the staging area, and puts waiting for their commit.
    ranges: Arc<Mutex<Ranges>>,
    puts: Mutex<HashMap<String, PendingPut>>,
    next_put: AtomicU64,
}

fn key(bytes: &[u8], what: &str) -> Result<Key, Status> {
    bytes.try_into().map_err(|_| Status::invalid_argument(format!("{what}: a key is 32 bytes, got {}", bytes.len())))
}

fn kind(k: i32) -> Result<Kind, Status> {
    match pb::RecordKind::try_from(k) {
        Ok(pb::RecordKind::Page) => Ok(Kind::Page),
        Ok(pb::RecordKind::Snapshot) => Ok(Kind::Snapshot),
        _ => Err(Status::invalid_argument(format!("record kind {k}: use RECORD_KIND_PAGE or RECORD_KIND_SNAPSHOT"))),
    }
}

fn pools(p: Option<&pb::PoolBytes>) -> Pools {
    p.map_or_else(Pools::default, |p| Pools {
        csa_main: p.csa_main,
        csa_indexer: p.csa_indexer,
        hca: p.hca,
        swa: p.swa,
    })
}

/// A span for one call, a child of the caller's trace (W3C context in the metadata).
fn span_for<T>(name: &'static str, request: &Request<T>) -> tracing::Span {
    let span = tracing::info_span!("kvstore", op = name, records = tracing::field::Empty);
    propagation::set_parent(&span, request.metadata());
    span
}

fn region(r: &pb::RemoteRegion) -> RegionSpec {
    RegionSpec { base: r.base, len: r.len, rkey: r.rkey.clone() }
}

impl KvService {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Arc<Store>,
        policy: SwaPolicy,
        metrics: KvstoreMetrics,
        landing: Landing,
        ucx_address: Vec<u8>,
        bulk: Bulk,
        put_lease: Duration,
        get_timeout: Duration,
    ) -> Self {
        let ranges = Arc::new(Mutex::new(Ranges::new(landing.len() as u64)));
        KvService {
            store,
            policy,
            metrics,
            landing: Arc::new(landing),
            ucx_address,
            bulk,
            put_lease,
            get_timeout,
            ranges,
            puts: Mutex::new(HashMap::new()),
            next_put: AtomicU64::new(1),
        }
    }

    fn ranges(&self) -> std::sync::MutexGuard<'_, Ranges> {
        self.ranges.lock().expect("not poisoned")
    }

    fn puts(&self) -> std::sync::MutexGuard<'_, HashMap<String, PendingPut>> {
        self.puts.lock().expect("not poisoned")
    }

    /// Give back the staging of puts whose writers did not commit in time.
    pub fn expire_puts(&self) -> usize {
        let now = Instant::now();
        let expired: Vec<PendingPut> = {
            let mut puts = self.puts();
            let ids: Vec<String> = puts.iter().filter(|(_, p)| p.deadline <= now).map(|(id, _)| id.clone()).collect();
            ids.iter().map(|id| puts.remove(id).expect("listed")).collect()
        };
        for p in &expired {
            self.lease_ended(p);
        }
        expired.len()
    }

    /// A put whose lease ended before its commit: its records are not stored (counted),
    /// and its staging is given back (a late write lands nowhere that is read).
    fn lease_ended(&self, p: &PendingPut) {
        for _ in &p.offers {
            self.metrics.dropped("lease");
        }
        self.release(p);
    }

    /// Give back a put's staging ranges and reservations.
    fn release(&self, p: &PendingPut) {
        let mut ranges = self.ranges();
        for (o, &at) in p.offers.iter().zip(&p.offsets) {
            ranges.release(at, o.len);
        }
        drop(ranges);
        let records: Vec<(Key, Kind)> = p.offers.iter().map(|o| (o.key, o.kind)).collect();
        self.store.withdraw(&records);
    }

    /// Validate a Get's pieces: each record's pieces in order, covering it exactly.
    fn pieces(req: &pb::GetRequest, lens: &[usize]) -> Result<Vec<bulk::Piece>, Status> {
        let mut cursor = vec![0usize; lens.len()];
        let mut out = Vec::with_capacity(req.pieces.len());
        for p in &req.pieces {
            let r = p.record as usize;
            let reg = req.regions.get(p.region as usize).ok_or_else(|| {
                Status::invalid_argument(format!("piece names region {} of {}", p.region, req.regions.len()))
            })?;
            let len = *lens.get(r).ok_or_else(|| Status::invalid_argument(format!("piece names record {r}")))?;
            let from = cursor[r];
            if from + p.len as usize > len {
                return Err(Status::invalid_argument(format!("pieces of record {r} cover more than its {len} bytes")));
            }
            if p.offset.checked_add(p.len).is_none_or(|end| end > reg.len) {
                return Err(Status::invalid_argument(format!(
                    "a piece of {} bytes at offset {} overruns its {}-byte region",
                    p.len, p.offset, reg.len
                )));
            }
            cursor[r] += p.len as usize;
            out.push(bulk::Piece { record: r, from, len: p.len as usize, region: p.region as usize, offset: p.offset });
        }
        if let Some(r) = (0..lens.len()).find(|&r| cursor[r] != lens[r]) {
            return Err(Status::failed_precondition(format!(
                "record {r} is {} bytes; the pieces cover {} (the caller's model geometry differs?)",
                lens[r], cursor[r]
            )));
        }
        Ok(out)
    }
}

/// The service as tonic holds it (shared with the lease sweeper).
pub struct Shared(pub Arc<KvService>);

impl std::ops::Deref for Shared {
    type Target = KvService;
    fn deref(&self) -> &KvService {
        &self.0
    }
}

#[tonic::async_trait]
impl KvStore for Shared {
    async fn info(&self, _: Request<pb::KvInfoRequest>) -> Result<Response<pb::KvInfo>, Status> {
        let cfg = self.store.config();
        Ok(Response::new(pb::KvInfo {
            swa_policy: self.policy.to_string(),
            capacity_bytes: cfg.capacity,
            max_record_bytes: cfg.max_record().min(self.landing.len() as u64),
        }))
    }

    async fn lookup(&self, request: Request<pb::LookupRequest>) -> Result<Response<pb::LookupReply>, Status> {
        let span = span_for("lookup", &request);
        async move {
            let keys = request.into_inner().keys.iter().map(|k| key(k, "lookup")).collect::<Result<Vec<_>, _>>()?;
            let (n, snapshots) = self.store.lookup(&keys, BLOCK_TOKENS as u64);
            Ok(Response::new(pb::LookupReply {
                cached_blocks: n as u32,
                snapshots: snapshots.into_iter().map(|s| s as u32).collect(),
            }))
        }
        .instrument(span)
        .await
    }

    async fn begin_put(&self, request: Request<pb::BeginPutRequest>) -> Result<Response<pb::BeginPutReply>, Status> {
        let span = span_for("begin_put", &request);
        async move {
            let req = request.into_inner();
            let offers = req
                .records
                .iter()
                .map(|r| {
                    Ok(Offer {
                        key: key(&r.key, "put")?,
                        kind: kind(r.kind)?,
                        parent: if r.parent.is_empty() { None } else { Some(key(&r.parent, "put parent")?) },
                        depth: r.depth,
                        len: r.len,
                        pools: pools(r.pools.as_ref()),
                    })
                })
                .collect::<Result<Vec<_>, Status>>()?;
            tracing::Span::current().record("records", offers.len());
            let answers = self.store.offer(&offers);
            for a in &answers {
                if *a == Accept::TooLarge {
                    self.metrics.dropped("too_large");
                }
            }
            let accepted: Vec<Offer> =
                offers.iter().zip(&answers).filter(|(_, a)| **a == Accept::Yes).map(|(o, _)| o.clone()).collect();
            let mut reply = pb::BeginPutReply {
                accepted: answers.iter().map(|a| *a == Accept::Yes).collect(),
                ucx_address: self.ucx_address.clone(),
                staging: Some(pb::RemoteRegion {
                    base: self.landing.spec.base,
                    len: self.landing.spec.len,
                    rkey: self.landing.spec.rkey.clone(),
                }),
                lease_ms: self.put_lease.as_millis() as u64,
                ..Default::default()
            };
            if accepted.is_empty() {
                reply.accepted.iter_mut().for_each(|a| *a = false);
                return Ok(Response::new(reply));
            }
            let mut ranges = self.ranges();
            let mut offsets = Vec::with_capacity(accepted.len());
            for o in &accepted {
                match ranges.alloc(o.len) {
                    Some(at) => offsets.push(at),
                    None => break,
                }
            }
            if offsets.len() < accepted.len() {
                for (o, &at) in accepted.iter().zip(&offsets) {
                    ranges.release(at, o.len);
                }
                drop(ranges);
                self.store.withdraw(&accepted.iter().map(|o| (o.key, o.kind)).collect::<Vec<_>>());
                for _ in &accepted {
                    self.metrics.dropped("staging_full");
                }
                reply.accepted.iter_mut().for_each(|a| *a = false);
                return Ok(Response::new(reply));
            }
            let id = format!("put-{}", self.next_put.fetch_add(1, Ordering::Relaxed));
            reply.offsets = offsets.clone();
            reply.put_id = id.clone();
            drop(ranges);
            self.puts().insert(id, PendingPut { offers: accepted, offsets, deadline: Instant::now() + self.put_lease });
            Ok(Response::new(reply))
        }
        .instrument(span)
        .await
    }

    async fn commit_put(&self, request: Request<pb::CommitPutRequest>) -> Result<Response<pb::CommitPutReply>, Status> {
        let span = span_for("commit_put", &request);
        async move {
            let req = request.into_inner();
            let pending = self.puts().remove(&req.put_id).ok_or_else(|| {
                Status::not_found(format!("no put {} (its lease ended, or it was committed)", req.put_id))
            })?;
            // A commit after the lease is refused even before the sweeper reclaims it.
            if pending.deadline <= Instant::now() {
                self.lease_ended(&pending);
                return Err(Status::not_found(format!(
                    "put {} committed after its {} ms lease; nothing stored",
                    req.put_id,
                    self.put_lease.as_millis()
                )));
            }
            if req.checksums.len() != pending.offers.len() {
                self.release(&pending);
                return Err(Status::invalid_argument(format!(
                    "{} checksums for {} accepted records",
                    req.checksums.len(),
                    pending.offers.len()
                )));
            }
            let (mut stored, mut rejected) = (0, 0);
            for ((o, &at), &sum) in pending.offers.iter().zip(&pending.offsets).zip(&req.checksums) {
                // From here the range belongs to the record: it is given back when the
                // record is on disk and unread, or at once if it is not stored.
                let staged =
                    Staged { landing: self.landing.clone(), ranges: self.ranges.clone(), offset: at, len: o.len };
                let result = if checksum(staged.as_ref()) != sum {
                    self.metrics.dropped("checksum");
                    self.store.withdraw(&[(o.key, o.kind)]);
                    Err("checksum")
                } else {
                    self.store.commit(o, Arc::new(staged), sum)
                };
                match result {
                    Ok(()) => stored += 1,
                    Err(_) => rejected += 1,
                }
            }
            Ok(Response::new(pb::CommitPutReply { stored, rejected }))
        }
        .instrument(span)
        .await
    }

    async fn abort_put(&self, request: Request<pb::AbortPutRequest>) -> Result<Response<pb::AbortPutReply>, Status> {
        let id = request.into_inner().put_id;
        let pending = self.puts().remove(&id);
        if let Some(p) = pending {
            self.release(&p);
        }
        Ok(Response::new(pb::AbortPutReply {}))
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> Result<Response<pb::GetReply>, Status> {
        let span = span_for("get", &request);
        async move {
            let started = Instant::now();
            let req = request.into_inner();
            if req.keys.len() != req.kinds.len() {
                return Err(Status::invalid_argument(format!("{} keys but {} kinds", req.keys.len(), req.kinds.len())));
            }
            let wanted = req
                .keys
                .iter()
                .zip(&req.kinds)
                .map(|(k, &t)| Ok((key(k, "get")?, kind(t)?)))
                .collect::<Result<Vec<_>, Status>>()?;
            tracing::Span::current().record("records", wanted.len());
            let pinned = self.store.pin(&wanted).map_err(|e| Status::not_found(e.to_string()))?;
            let (lens, checksums) = (pinned.lens(), pinned.checksums());
            let pieces = match KvService::pieces(&req, &lens) {
                Ok(p) => p,
                Err(e) => {
                    self.store.unpin(pinned);
                    return Err(e);
                }
            };
            // Read on a blocking thread, record by record, while the bulk thread writes the
            // ones already read.
            let (tx, records) = std::sync::mpsc::channel();
            let store = self.store.clone();
            let reader = tokio::task::spawn_blocking(move || {
                let mut result = Ok(());
                for i in 0..lens.len() {
                    match store.load(&pinned, i) {
                        Ok(r) => {
                            if tx.send((i, r.data)).is_err() {
                                break; // the writer failed; it reports why
                            }
                        }
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    }
                }
                store.unpin(pinned);
                result
            });
            let job = bulk::Job {
                address: req.ucx_address.clone(),
                regions: req.regions.iter().map(region).collect(),
                records,
                pieces,
                timeout: if req.deadline_ms == 0 {
                    self.get_timeout
                } else {
                    // What is left of the caller's wait; nothing may land after it.
                    Duration::from_millis(req.deadline_ms).saturating_sub(started.elapsed()).min(self.get_timeout)
                },
            };
            let written = self.bulk.write(job).await;
            let read = reader.await.map_err(|e| Status::internal(format!("read task: {e}")))?;
            read.map_err(|e| Status::data_loss(e.to_string()))?;
            let stats =
                written.map_err(|e| Status::unavailable(format!("writing into the caller's memory failed: {e}")))?;
            self.metrics.get_seconds.observe(started.elapsed().as_secs_f64());
            Ok(Response::new(pb::GetReply { checksums, bytes: stats.bytes }))
        }
        .instrument(span)
        .await
    }

    async fn delete(&self, request: Request<pb::DeleteRequest>) -> Result<Response<pb::DeleteReply>, Status> {
        let req = request.into_inner();
        let keys = req.keys.iter().map(|k| key(k, "delete")).collect::<Result<Vec<_>, _>>()?;
        let deleted = self.store.delete(&keys, req.all);
        Ok(Response::new(pb::DeleteReply { deleted: deleted as u32 }))
    }

    async fn stats(&self, _: Request<pb::KvStatsRequest>) -> Result<Response<pb::KvStats>, Status> {
        let s = self.store.stats();
        let counters = &self.metrics;
        let dropped: u64 = cluster::telemetry::metrics::DROP_REASONS.iter().map(|r| counters.dropped_count(r)).sum();
        Ok(Response::new(pb::KvStats {
            swa_policy: self.policy.to_string(),
            capacity_bytes: self.store.config().capacity,
            disk_bytes: s.disk_bytes,
            pages: s.pages,
            snapshots: s.snapshots,
            stored: Some(pb::PoolBytes {
                csa_main: s.stored.csa_main,
                csa_indexer: s.stored.csa_indexer,
                hca: s.stored.hca,
                swa: s.stored.swa,
            }),
            queued_records: s.queued_records,
            queued_bytes: s.queued_bytes,
            evictions: s.evictions,
            dropped_puts: dropped,
            write_errors: counters.write_errors.get(),
            corrupt_records: counters.corrupt.get(),
            segments: s.segments,
        }))
    }
}
