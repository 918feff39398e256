//! Offering prompts' blocks to the kvstore off the engine thread. A put is several
//! round trips to the store (BeginPut, the UCX writes into its staging, CommitPut), and
//! done on the engine thread it held up every prompt queued behind it: on a GPU cluster
//! a prefix hit that arrived while the previous prompt's blocks were being offered waited
//! tens of milliseconds before its restore could start. The engine thread now copies the
//! blocks out (one device-to-host copy, or a host copy) and hands them to this thread,
//! which has a UCX sender of its own; the pages go back to the pool at once.
//!
//! Bounded: offers wait in a queue of at most `limit` bytes; past it an offer is dropped
//! and counted (`sluice_prefill_prefix_cache_errors_total{op="put"}`), as a store that
//! is down is: the cache only costs hits, never memory or requests.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use cluster::telemetry::PrefillMetrics;
use cluster::telemetry::propagation::set_parent_context;
use sluice_proto::v1 as pb;
use transfer::{Sender, Source};

use crate::prefix_cache::{PrefixCache, PutRecord};

/// One record's description, bytes and KV checksum, owned.
pub struct OwnedRecord {
    pub record: pb::PutRecord,
    pub bytes: Vec<u8>,
    pub checksum: u64,
}

/// The records of one prompt.
pub struct PutJob {
    pub request_id: String,
    pub trace: cluster::telemetry::TraceContext,
    pub records: Vec<OwnedRecord>,
}

impl PutJob {
    fn bytes(&self) -> usize {
        self.records.iter().map(|r| r.bytes.len()).sum()
    }
}

pub struct PutQueue {
    tx: Option<mpsc::Sender<PutJob>>,
    pending: Arc<AtomicUsize>,
    limit: usize,
    metrics: PrefillMetrics,
    thread: Option<JoinHandle<()>>,
}

impl PutQueue {
    /// Start the put thread (its UCX sender is made there, on the thread that uses it).
    pub fn start(
        cache: Arc<PrefixCache>,
        rt: tokio::runtime::Handle,
        metrics: PrefillMetrics,
        limit: usize,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<PutJob>();
        let pending = Arc::new(AtomicUsize::new(0));
        let thread = std::thread::Builder::new().name("kvstore-put".into()).spawn({
            let (pending, metrics) = (pending.clone(), metrics.clone());
            move || {
                let mut sender = match Sender::new() {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::warn!(error = %e, "no UCX sender for kvstore puts; prompts' blocks are not offered");
                        None
                    }
                };
                for job in rx {
                    let bytes = job.bytes();
                    match sender.as_mut() {
                        Some(s) => put(&cache, &rt, s, &metrics, &job),
                        None => metrics.cache_error("put"),
                    }
                    pending.fetch_sub(bytes, Ordering::Relaxed);
                }
            }
        })?;
        Ok(PutQueue { tx: Some(tx), pending, limit, metrics, thread: Some(thread) })
    }

    /// Queue a prompt's records, or drop them (counted) when the queue is full.
    pub fn offer(&self, job: PutJob) {
        let bytes = job.bytes();
        let before = self.pending.fetch_add(bytes, Ordering::Relaxed);
        if before + bytes > self.limit {
            self.pending.fetch_sub(bytes, Ordering::Relaxed);
            self.metrics.cache_error("put");
            tracing::warn!(
                request_id = %job.request_id,
                queued_bytes = before,
                limit = self.limit,
                "kvstore puts are falling behind; this prompt's blocks are not offered"
            );
            return;
        }
        if let Some(tx) = &self.tx
            && tx.send(job).is_err()
        {
            self.pending.fetch_sub(bytes, Ordering::Relaxed);
        }
    }
}

fn put(cache: &PrefixCache, rt: &tokio::runtime::Handle, sender: &mut Sender, m: &PrefillMetrics, job: &PutJob) {
    let span = tracing::info_span!("prefix_cache.put", request_id = %job.request_id);
    set_parent_context(&span, job.trace.clone());
    let _in = span.enter();
    let records: Vec<PutRecord<'_>> = job
        .records
        .iter()
        .map(|r| PutRecord { record: r.record.clone(), source: Source::Host(&r.bytes), checksum: r.checksum })
        .collect();
    match cache.put(rt, sender, &records) {
        Ok(written) => m.put_bytes.inc_by(written),
        Err(e) => {
            m.cache_error("put");
            tracing::warn!(request_id = %job.request_id, error = %e, "offering the prompt's blocks to the kvstore failed");
        }
    }
}

impl Drop for PutQueue {
    /// Offers already queued are finished (each bounded by `--kvstore-timeout-ms`).
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
