//! The `sluice.v1.Prefill` gRPC service: validates a prompt, queues it on the engine
//! thread, and once its KV is in the decode worker's memory commits it there.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cluster::telemetry::propagation::{self, PropagateContext, Traced};
use sluice_proto::v1 as pb;
use sluice_proto::v1::decode_client::DecodeClient;
use sluice_proto::v1::prefill_server::Prefill;
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tracing::Instrument;
use transfer::{Target, WireGeometry};

use crate::engine_loop::{CancelOutcome, Command, Job, RestoreTarget};
use crate::prefix_cache::{Prefix, PrefixCache};

/// Time left for the commit after the transfer, out of the lease.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(10);

pub struct PrefillService {
    pub engine: std_mpsc::Sender<Command>,
    pub geometry: WireGeometry,
    pub vocab: usize,
    pub max_position: usize,
    pub debug_hooks: bool,
    pub decode_clients: Mutex<HashMap<String, Channel>>,
    /// How decode workers are dialed (TLS with this worker's certificate, when on).
    pub dialer: cluster::tls::Dialer,
    pub cache: Option<Arc<PrefixCache>>,
    pub metrics: cluster::telemetry::PrefillMetrics,
}

/// Tells the engine to drop a job whose caller went away, unless it completed.
struct CancelOnDrop {
    engine: std_mpsc::Sender<Command>,
    reservation_id: Option<String>,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(reservation_id) = self.reservation_id.take() {
            let (reply, _) = oneshot::channel();
            let _ = self.engine.send(Command::Cancel { reservation_id, reply });
        }
    }
}

impl PrefillService {
    /// A client of the decode worker at `addr` whose calls carry the current trace context.
    fn decode_client(&self, addr: &str) -> Result<DecodeClient<Traced<Channel>>, Status> {
        let mut clients = self.decode_clients.lock().expect("not poisoned");
        if let Some(ch) = clients.get(addr) {
            return Ok(DecodeClient::with_interceptor(ch.clone(), PropagateContext));
        }
        let endpoint = self
            .dialer
            .endpoint(addr)
            .map_err(|e| Status::invalid_argument(format!("decode address: {e}")))?
            .connect_timeout(Duration::from_secs(5));
        let ch = self.dialer.lazy(&endpoint);
        clients.insert(addr.to_string(), ch.clone());
        Ok(DecodeClient::with_interceptor(ch, PropagateContext))
    }

    /// The prompt's cached prefix and how to resume from it (bounded; a store that
    /// does not answer in time means a cold prompt, counted).
    async fn lookup(&self, tokens: &[u32]) -> Option<Prefix> {
        let cache = self.cache.as_ref()?;
        match tokio::time::timeout(cache.timeout, cache.lookup(tokens)).await {
            Ok(Ok(p)) => Some(p),
            Ok(Err(e)) => {
                self.metrics.cache_error("lookup");
                tracing::debug!(error = %e, "prefix lookup failed; the prompt goes on cold");
                None
            }
            Err(_) => {
                self.metrics.cache_error("lookup");
                tracing::debug!("prefix lookup timed out; the prompt goes on cold");
                None
            }
        }
    }

    /// Wait for the engine's reply; meanwhile, when the engine asks for a prompt's
    /// cached prefix, have the store write it and report back.
    async fn serve_restore<T>(
        &self,
        reservation_id: &str,
        trace: cluster::telemetry::TraceContext,
        restore: Option<oneshot::Receiver<RestoreTarget>>,
        reply: oneshot::Receiver<T>,
    ) -> Result<T, oneshot::error::RecvError> {
        tokio::pin!(reply);
        if let (Some(rx), Some(cache)) = (restore, &self.cache) {
            tokio::select! {
                r = &mut reply => return r,
                target = rx => if let Ok(t) = target {
                    let span = tracing::info_span!("prefix_cache.fetch", blocks = t.keys.len(), snapshot = t.snapshot);
                    propagation::set_parent_context(&span, trace);
                    let result = cache.fetch(&t.keys, &t.page_ids, t.slot, t.snapshot, t.part).instrument(span).await;
                    let _ = self.engine.send(Command::Restored { reservation_id: reservation_id.to_string(), result });
                },
            }
        }
        reply.await
    }

    fn validate(&self, r: &pb::PrefillRequest) -> Result<Target, Status> {
        if r.tokens.is_empty() {
            return Err(Status::invalid_argument("the prompt is empty"));
        }
        if let Some(&t) = r.tokens.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(Status::invalid_argument(format!(
                "token id {t} is outside the vocabulary (size {})",
                self.vocab
            )));
        }
        if r.tokens.len() > self.max_position {
            return Err(Status::invalid_argument(format!(
                "prompt of {} tokens is past the context limit of {}",
                r.tokens.len(),
                self.max_position
            )));
        }
        let t = r.target.as_ref().ok_or_else(|| Status::invalid_argument("missing KV target"))?;
        let target = Target::from_proto(t).map_err(|e| Status::failed_precondition(e.to_string()))?;
        self.geometry.check_compatible(&target.geometry).map_err(|e| Status::failed_precondition(e.to_string()))?;
        if target.page_ids.len() < r.tokens.len().div_ceil(self.geometry.block) {
            return Err(Status::invalid_argument("the reservation has fewer pages than the prompt needs"));
        }
        Ok(target)
    }
}

#[tonic::async_trait]
impl Prefill for PrefillService {
    async fn prefill(&self, request: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillReply>, Status> {
        // The router's `prefill` span is the parent of everything done here.
        let trace = propagation::extract(request.metadata());
        let r = request.into_inner();
        let target = self.validate(&r)?;
        let queue_span = tracing::info_span!("prefill.queue", request_id = %r.request_id, tokens = r.tokens.len());
        propagation::set_parent_context(&queue_span, trace.clone());
        let lease = Duration::from_millis(r.lease_ms.max(1));
        let started = Instant::now();
        let lookup_span = tracing::info_span!("prefix_cache.lookup", request_id = %r.request_id);
        propagation::set_parent_context(&lookup_span, trace.clone());
        let prefix = self.lookup(&r.tokens).instrument(lookup_span).await;
        let restoring = prefix.as_ref().is_some_and(|p| p.plan.restore != model_spec::Restore::Cold);
        let (restore_tx, restore_rx) = oneshot::channel();
        let (tx, rx) = oneshot::channel();
        let job = Job {
            request_id: r.request_id.clone(),
            reservation_id: r.reservation_id.clone(),
            tokens: r.tokens,
            target,
            // Keep a margin for the commit after the last byte.
            deadline: started + lease.saturating_sub(Duration::from_millis(500)),
            enqueued: started,
            reply: tx,
            trace: trace.clone(),
            queue_span,
            prefix,
            restore: restoring.then_some(restore_tx),
        };
        self.engine.send(Command::Prefill(Box::new(job))).map_err(|_| Status::unavailable("prefill engine stopped"))?;
        let mut guard = CancelOnDrop { engine: self.engine.clone(), reservation_id: Some(r.reservation_id.clone()) };
        let waited = self.serve_restore(&r.reservation_id, trace.clone(), restoring.then_some(restore_rx), rx);
        let done = match tokio::time::timeout(lease, waited).await {
            Ok(Ok(result)) => result?,
            Ok(Err(_)) => return Err(Status::unavailable("prefill engine stopped")),
            Err(_) => return Err(Status::deadline_exceeded("prefill did not finish within the reservation's lease")),
        };
        guard.reservation_id = None; // the bytes are written; nothing to cancel any more
        let commit = pb::CommitRequest {
            reservation_id: r.reservation_id.clone(),
            tokens: done.tokens as u32,
            page_checksums: done.checksums.pages.clone(),
            rings_checksum: done.checksums.rings,
            comp_checksum: done.checksums.comp,
            logits_checksum: done.checksums.logits,
        };
        let mut client = self.decode_client(&r.decode_addr)?;
        let mut req = Request::new(commit);
        req.set_timeout(COMMIT_TIMEOUT);
        let span = tracing::info_span!("commit", request_id = %r.request_id);
        propagation::set_parent_context(&span, trace);
        client
            .commit(req)
            .instrument(span)
            .await
            .map_err(|s| Status::new(s.code(), format!("commit on the decode worker: {}", s.message())))?;
        Ok(Response::new(pb::PrefillReply {
            cached_tokens: done.cached_tokens as u32,
            recompute_tokens: done.recompute_tokens as u32,
            tokens: done.tokens as u32,
            queue_ms: done.queue.as_secs_f64() * 1e3,
            compute_ms: done.compute.as_secs_f64() * 1e3,
            transfer_ms: done.transfer.as_secs_f64() * 1e3,
            transfer_bytes: done.bytes,
            restore_ms: done.restore.as_secs_f64() * 1e3,
        }))
    }

    async fn cancel(&self, request: Request<pb::CancelRequest>) -> Result<Response<pb::CancelReply>, Status> {
        let (tx, rx) = oneshot::channel();
        let reservation_id = request.into_inner().reservation_id;
        self.engine
            .send(Command::Cancel { reservation_id, reply: tx })
            .map_err(|_| Status::unavailable("prefill engine stopped"))?;
        let outcome = rx.await.map_err(|_| Status::unavailable("prefill engine stopped"))?;
        Ok(Response::new(pb::CancelReply {
            cancelled: outcome == CancelOutcome::Cancelled,
            finished: outcome == CancelOutcome::Finished,
        }))
    }

    async fn load(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::PrefillLoad>, Status> {
        let (tx, rx) = oneshot::channel();
        self.engine.send(Command::Load { reply: tx }).map_err(|_| Status::unavailable("prefill engine stopped"))?;
        Ok(Response::new(rx.await.map_err(|_| Status::unavailable("prefill engine stopped"))?))
    }

    async fn dump_kv(&self, request: Request<pb::DumpKvRequest>) -> Result<Response<pb::KvDump>, Status> {
        if !self.debug_hooks {
            return Err(Status::permission_denied("DumpKv is a test hook; start the worker with --debug-hooks"));
        }
        let (tx, rx) = oneshot::channel();
        let reservation_id = request.into_inner().reservation_id;
        self.engine
            .send(Command::Dump { reservation_id: reservation_id.clone(), reply: tx })
            .map_err(|_| Status::unavailable("prefill engine stopped"))?;
        rx.await
            .map_err(|_| Status::unavailable("prefill engine stopped"))?
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no recent prefill for reservation {reservation_id}")))
    }
}
