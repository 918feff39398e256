//! One request from admission to its last token:
//!
//! 1. reserve pages on a decode worker (most room, smallest batch first);
//! 2. prefill on a prefill worker (shortest queue first), which writes the KV into
//!    the reservation and commits it; a failed prefill is retried on another worker
//!    with a fresh reservation (bounded), the old one given back safely;
//! 3. stream the decode worker's tokens to the client, as text deltas (stop strings
//!    held back and cut) with logprobs, then a final event with usage and timings
//!    (`relay`);
//! 4. when the decode worker is lost mid-stream, migrate: re-prefill the prompt plus the
//!    tokens already streamed on another pair and continue the stream from there
//!    (`migrate`; bounded attempts, each bounded in time).
//!
//! A client that goes away, or a request past its deadline, drops the task: the
//! cleanup guard cancels the prefill and gives the reservation back, and a dropped
//! decode stream makes the decode worker free the request's pages.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster::telemetry::metrics::status_label;
use cluster::telemetry::prometheus::IntGauge;
use cluster::telemetry::{RouterMetrics, propagation};
use sluice_proto::v1 as pb;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::migrate::{self, Budget, Leg, MigrationLimits};
use crate::model::ModelInfo;
use crate::relay::{Latency, Relay};
use crate::validate::Validated;
use crate::workers::{Worker, WorkerSet};

pub struct RouterCtx {
    pub model: ModelInfo,
    pub workers: Arc<WorkerSet>,
    pub admission: Arc<Semaphore>,
    pub max_concurrency: usize,
    pub request_timeout: Duration,
    pub prefill_retries: u32,
    /// How far a request whose decode worker is lost may be migrated.
    pub migration: MigrationLimits,
    /// Tokens per KV page (to size reservations).
    pub block_tokens: u64,
    pub metrics: RouterMetrics,
    /// The kvstore, for placement costs (None without --kvstore).
    pub prefix: Option<crate::prefix::PrefixLookup>,
}

/// A request as it arrived: when, and the root span of its trace (a child of the
/// caller's trace context when it sent one).
pub struct Arrival {
    span: Span,
    at: Instant,
}

/// Note a request's arrival; everything the router does for it happens in its span.
pub fn arrive(request_id: &str, metadata: &MetadataMap) -> Arrival {
    let span = tracing::info_span!(
        "request",
        request_id = %request_id,
        prompt_tokens = Empty,
        status = Empty,
        otel.status_code = Empty,
        otel.status_message = Empty,
    );
    propagation::set_parent(&span, metadata);
    Arrival { span, at: Instant::now() }
}

/// Record a request refused before it started (invalid input, router full); returns
/// the status to send.
pub fn refuse(ctx: &RouterCtx, arrival: &Arrival, status: Status) -> Status {
    ctx.metrics.outcome(status.code());
    record_status(&arrival.span, status.code(), status.message());
    status
}

/// A span's outcome, in OpenTelemetry's terms too (error status with its message).
fn record_status(span: &Span, code: Code, message: &str) {
    span.record("status", status_label(code));
    if code != Code::Ok {
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_message", message);
    }
}

/// Counts a request in `sluice_requests_running` while it lives.
struct InFlight(IntGauge);

impl InFlight {
    fn new(gauge: &IntGauge) -> Self {
        gauge.inc();
        InFlight(gauge.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenOut {
    pub index: u32,
    pub token_id: u32,
    pub text: String,
    pub logprob: f32,
    pub top: Vec<(u32, f32, String)>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    pub queue_ms: f64,
    pub restore_ms: f64,
    pub prefill_ms: f64,
    pub kv_transfer_ms: f64,
    pub ttft_ms: f64,
    pub total_ms: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token(TokenOut),
    Final { finish: pb::FinishReason, prompt_tokens: u32, cached_tokens: u32, completion_tokens: u32, timings: Timings },
}

pub type Events = mpsc::Receiver<Result<Event, Status>>;

/// Admit a request and start it; fails fast with RESOURCE_EXHAUSTED when the router is
/// at its concurrency limit.
pub fn start(ctx: Arc<RouterCtx>, req: Validated, arrival: Arrival) -> Result<Events, Status> {
    arrival.span.record("prompt_tokens", req.prompt.len());
    let Ok(permit) = ctx.admission.clone().try_acquire_owned() else {
        let s = Status::resource_exhausted(format!(
            "the router is serving its limit of {} concurrent requests; retry shortly",
            ctx.max_concurrency
        ));
        return Err(refuse(&ctx, &arrival, s));
    };
    let (tx, rx) = mpsc::channel(64);
    let span = arrival.span.clone();
    tokio::spawn(drive(ctx, req, tx, permit, arrival.at).instrument(span));
    Ok(rx)
}

async fn drive(
    ctx: Arc<RouterCtx>,
    req: Validated,
    tx: mpsc::Sender<Result<Event, Status>>,
    _permit: OwnedSemaphorePermit,
    arrived: Instant,
) {
    let _in_flight = InFlight::new(&ctx.metrics.running);
    let id = req.request_id.clone();
    let timeout = ctx.request_timeout;
    let result = tokio::select! {
        r = tokio::time::timeout(timeout, run(&ctx, req, &tx, arrived)) => match r {
            Ok(r) => r,
            Err(_) => Err(Status::deadline_exceeded(format!("request did not finish within {}s", timeout.as_secs()))),
        },
        _ = tx.closed() => Err(Status::cancelled("client went away")),
    };
    let (code, message) = match &result {
        Ok(()) => (Code::Ok, ""),
        Err(s) => (s.code(), s.message()),
    };
    ctx.metrics.outcome(code);
    record_status(&Span::current(), code, message);
    let ms = arrived.elapsed().as_secs_f64() * 1e3;
    match result {
        Ok(()) => tracing::info!(request_id = %id, ms, "request finished"),
        Err(_) if tx.is_closed() => tracing::info!(request_id = %id, ms, "client went away; cancelled"),
        Err(status) => {
            tracing::info!(request_id = %id, ms, code = ?status.code(), message = status.message(), "request failed");
            let _ = tx.send(Err(status)).await;
        }
    }
}

/// Errors after which another prefill worker may succeed.
fn retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::DataLoss | Code::Internal | Code::Cancelled
    )
}

/// Gives a reservation back unless disarmed: cancels its prefill first, so the pages
/// are freed at once when the prefill worker confirms it will not write any more.
struct Cleanup {
    decode: Arc<Worker>,
    reservation_id: String,
    prefill: Option<Arc<Worker>>,
    armed: bool,
}

impl Cleanup {
    async fn give_back(decode: Arc<Worker>, reservation_id: String, prefill: Option<Arc<Worker>>) {
        let writer_done = match &prefill {
            None => true,
            Some(p) => {
                let mut client = p.prefill();
                let cancel = client.cancel(pb::CancelRequest { reservation_id: reservation_id.clone() });
                // No answer (the worker is unreachable): it cannot be ruled out that
                // it still writes, so the decode worker quarantines the pages until
                // the lease ends.
                matches!(tokio::time::timeout(Duration::from_secs(2), cancel).await,
                         Ok(Ok(r)) if r.get_ref().cancelled || r.get_ref().finished)
            }
        };
        let mut client = decode.decode();
        let release = client.release(pb::ReleaseRequest { reservation_id: reservation_id.clone(), writer_done });
        if let Err(e) = tokio::time::timeout(Duration::from_secs(2), release)
            .await
            .map_err(|_| Status::deadline_exceeded("timeout"))
            .and_then(|r| r)
        {
            tracing::warn!(reservation = %reservation_id, error = %e, "could not release a reservation; its lease will reclaim it");
        }
    }

    async fn now(mut self) {
        self.armed = false;
        Self::give_back(self.decode.clone(), std::mem::take(&mut self.reservation_id), self.prefill.take()).await;
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if self.armed {
            let (d, id, p) = (self.decode.clone(), std::mem::take(&mut self.reservation_id), self.prefill.take());
            tokio::spawn(Self::give_back(d, id, p).instrument(Span::current()));
        }
    }
}

/// A leg's prefill, committed into a reservation on `decode`.
struct Placed {
    decode: Arc<Worker>,
    reservation_id: String,
    /// Gives the reservation back if the decode stream never opens.
    guard: Cleanup,
    reply: pb::PrefillReply,
}

async fn reserve(
    ctx: &RouterCtx,
    req: &Validated,
    leg: &Leg,
    exclude: &[String],
) -> Result<(Arc<Worker>, pb::Reservation), Status> {
    let need = (leg.tokens.len() as u64 + leg.max_tokens as u64).div_ceil(ctx.block_tokens);
    let candidates = ctx.workers.decode_ranked(need, exclude);
    if candidates.is_empty() {
        return Err(Status::unavailable("no decode worker is available"));
    }
    let mut last = None;
    for d in candidates {
        let r = pb::ReserveRequest {
            request_id: req.request_id.clone(),
            prompt_tokens: leg.tokens.len() as u32,
            max_tokens: leg.max_tokens,
            fingerprint: String::new(),
        };
        match d.decode().reserve(r).await {
            Ok(res) => {
                d.add_reserved_pages(need);
                return Ok((d, res.into_inner()));
            }
            Err(s) if s.code() == Code::InvalidArgument => return Err(s),
            Err(s) => {
                if s.code() != Code::ResourceExhausted {
                    d.mark_failed();
                }
                last = Some(s);
            }
        }
    }
    let s = last.expect("at least one candidate");
    Err(match s.code() {
        Code::ResourceExhausted => Status::resource_exhausted(format!("every decode worker is full: {}", s.message())),
        _ => Status::unavailable(format!("no decode worker could take the request: {}", s.message())),
    })
}

/// Reserve on a decode worker (not one of `exclude`) and prefill `leg` into it, trying
/// other prefill workers (with a fresh reservation each) when one fails. `first`: the
/// client's own prompt, which the queue and prompt-token metrics count.
async fn place(
    ctx: &RouterCtx,
    req: &Validated,
    leg: &Leg,
    exclude: &[String],
    first: Option<Instant>,
) -> Result<Placed, Status> {
    // What the prefill will cost its worker, counting the cached prefix.
    let plan = match (&ctx.prefix, ctx.workers.fingerprint()) {
        (Some(p), Some(fp)) => p.plan(&fp, &leg.tokens).instrument(tracing::info_span!("prefix_lookup")).await,
        _ => None,
    };
    let cost = crate::prefix::prefill_cost(leg.tokens.len(), plan.as_ref());
    let (mut d, mut res) = reserve(ctx, req, leg, exclude).instrument(tracing::info_span!("queue")).await?;
    let mut guard =
        Cleanup { decode: d.clone(), reservation_id: res.reservation_id.clone(), prefill: None, armed: true };
    let mut failed: Vec<String> = Vec::new();
    let mut last_error: Option<String> = None;
    let mut attempts = 0;
    loop {
        let p = ctx.workers.prefill_ranked(&failed).into_iter().next().ok_or_else(|| match &last_error {
            Some(e) => {
                Status::unavailable(format!("no other prefill worker to retry on; the last attempt failed: {e}"))
            }
            None => Status::unavailable("no prefill worker is available"),
        })?;
        guard.prefill = Some(p.clone());
        p.add_sent_tokens(cost);
        let span = tracing::info_span!(
            "prefill",
            worker = %p.id,
            attempt = attempts,
            status = Empty,
            otel.status_code = Empty,
            otel.status_message = Empty,
        );
        let sent = Instant::now();
        let r = p
            .prefill()
            .prefill(pb::PrefillRequest {
                request_id: req.request_id.clone(),
                reservation_id: res.reservation_id.clone(),
                tokens: leg.tokens.clone(),
                target: res.target.clone(),
                decode_addr: d.addr.clone(),
                lease_ms: res.lease_ms,
            })
            .instrument(span.clone())
            .await;
        match &r {
            Ok(_) => record_status(&span, Code::Ok, ""),
            Err(s) => record_status(&span, s.code(), s.message()),
        }
        match r {
            Ok(reply) => {
                let reply = reply.into_inner();
                if let Some(arrived) = first {
                    // Router queue (placement, reservation, earlier attempts) plus the
                    // prefill worker's own queue.
                    let queued = (sent - arrived).as_secs_f64() + reply.queue_ms / 1e3;
                    ctx.metrics.queue.observe(queued);
                    ctx.metrics.prompt_tokens.inc_by(leg.tokens.len() as u64);
                    ctx.metrics.cached_tokens.inc_by(reply.cached_tokens as u64);
                }
                // Committed: from here the decode worker owns the pages and frees them
                // when the decode stream ends or is dropped.
                guard.prefill = None;
                return Ok(Placed { decode: d, reservation_id: res.reservation_id, guard, reply });
            }
            Err(s) if retryable(&s) && attempts < ctx.prefill_retries => {
                attempts += 1;
                if s.code() == Code::Unavailable {
                    p.mark_failed();
                }
                // A lease that ran out in a busy worker's queue is load, not a fault: the
                // worker stays a candidate (measured on 4 H200s: 64 prompts at once queued
                // past the 30 s lease of their decode pages, and excluding the only
                // prefill worker failed every one of them).
                if s.code() == Code::DeadlineExceeded {
                    tracing::warn!(request_id = %req.request_id, worker = %p.id, code = ?s.code(), message = s.message(), "prefill failed; retrying with a fresh reservation, this worker included");
                } else {
                    tracing::warn!(request_id = %req.request_id, worker = %p.id, code = ?s.code(), message = s.message(), "prefill failed; retrying elsewhere");
                    failed.push(p.id.clone());
                }
                last_error = Some(s.message().to_string());
                guard.now().await;
                (d, res) = reserve(ctx, req, leg, exclude).instrument(tracing::info_span!("queue")).await?;
                guard = Cleanup {
                    decode: d.clone(),
                    reservation_id: res.reservation_id.clone(),
                    prefill: None,
                    armed: true,
                };
            }
            Err(s) => return Err(Status::new(s.code(), format!("prefill failed: {}", s.message()))),
        }
    }
}

/// How a decode leg ended without finishing the request.
enum LegEnd {
    /// The request cannot go on (client gone, bad input, a broken stream).
    Failed(Status),
    /// The decode worker was lost; the request may continue elsewhere.
    Lost { worker: Arc<Worker>, status: Status },
}

async fn run(
    ctx: &RouterCtx,
    req: Validated,
    tx: &mpsc::Sender<Result<Event, Status>>,
    arrived: Instant,
) -> Result<(), Status> {
    let mut leg = Leg::first(&req);
    let mut placed = place(ctx, &req, &leg, &[], Some(arrived)).await?;
    let mut relay = Relay::new(&req, placed.reply, arrived);
    let mut budget = Budget::new(&ctx.migration);
    // Decode workers this request lost; a migration goes elsewhere.
    let mut lost: Vec<String> = Vec::new();
    loop {
        let span = tracing::info_span!(
            "decode",
            worker = %placed.decode.id,
            resumed_tokens = leg.resumed.len(),
            completion_tokens = Empty,
        );
        let (worker, status) = match decode_leg(ctx, &req, placed, &leg, &mut relay, tx).instrument(span).await {
            Ok(()) => return Ok(()),
            Err(LegEnd::Failed(s)) => return Err(s),
            Err(LegEnd::Lost { worker, status }) => (worker, status),
        };
        worker.mark_failed();
        lost.push(worker.id.clone());
        (placed, leg) = migrate(ctx, &req, relay.emitted(), &lost, &mut budget, &worker, status).await?;
    }
}

/// Continue a request whose decode worker `from` was lost (`why`) on another pair,
/// within the budget; each attempt is bounded by `--migration-timeout-s`. Fails with
/// UNAVAILABLE, saying why, when no attempt is left.
async fn migrate(
    ctx: &RouterCtx,
    req: &Validated,
    emitted: &[u32],
    lost: &[String],
    budget: &mut Budget,
    from: &Worker,
    why: Status,
) -> Result<(Placed, Leg), Status> {
    let Some(leg) = Leg::after(req, emitted) else {
        return Err(Status::internal("the decode worker failed after the request's last token"));
    };
    let mut last_failure: Option<String> = None;
    loop {
        let Some(attempt) = budget.take() else {
            let tried = match (budget.used(), last_failure) {
                (0, _) => "migration is off (--migration-limit 0)".to_string(),
                (n, None) => format!("its {n} migrations (--migration-limit) are used up"),
                (n, Some(e)) => format!("its {n} migrations (--migration-limit) are used up; the last attempt: {e}"),
            };
            return Err(Status::unavailable(format!(
                "decode worker {} was lost after {} tokens ({}); {tried}",
                from.id,
                emitted.len(),
                why.message()
            )));
        };
        tracing::warn!(
            request_id = %req.request_id,
            worker = %from.id,
            code = ?why.code(),
            message = why.message(),
            streamed = emitted.len(),
            attempt,
            "decode worker lost mid-stream; migrating the request"
        );
        let span = tracing::info_span!(
            "migrate",
            from = %from.id,
            attempt,
            resumed_tokens = emitted.len(),
            outcome = Empty,
            otel.status_code = Empty,
            otel.status_message = Empty,
        );
        let timeout = ctx.migration.attempt_timeout;
        let tried = tokio::time::timeout(timeout, place(ctx, req, &leg, lost, None)).instrument(span.clone()).await;
        let result = tried.unwrap_or_else(|_| {
            Err(Status::deadline_exceeded(format!(
                "re-prefill did not commit within --migration-timeout-s {}",
                timeout.as_secs()
            )))
        });
        match result {
            Ok(placed) => {
                ctx.metrics.migration(migrate::RESUMED);
                span.record("outcome", migrate::RESUMED);
                tracing::info!(request_id = %req.request_id, to = %placed.decode.id, attempt, "request migrated");
                return Ok((placed, leg));
            }
            Err(s) => {
                ctx.metrics.migration(migrate::FAILED);
                span.record("outcome", migrate::FAILED);
                record_status(&span, s.code(), s.message());
                tracing::warn!(request_id = %req.request_id, attempt, code = ?s.code(), message = s.message(), "migration attempt failed");
                last_failure = Some(s.message().to_string());
                // Membership and loads are polled: give them a moment before the next try.
                tokio::time::sleep(MIGRATION_RETRY_PAUSE).await;
            }
        }
    }
}

/// Pause between failed migration attempts.
const MIGRATION_RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Decode `leg` on the worker its prefill committed to and relay its tokens, until the
/// request finishes or the leg ends.
async fn decode_leg(
    ctx: &RouterCtx,
    req: &Validated,
    mut placed: Placed,
    leg: &Leg,
    relay: &mut Relay,
    tx: &mpsc::Sender<Result<Event, Status>>,
) -> Result<(), LegEnd> {
    let sampling = pb::SamplingParams {
        temperature: req.sampling.temperature,
        top_p: req.sampling.top_p,
        top_k: req.sampling.top_k,
        seed: req.sampling.seed,
        logprobs: req.sampling.logprobs,
        top_logprobs: req.sampling.top_logprobs,
    };
    let worker = placed.decode.clone();
    let lost = |status: Status| match status.code() {
        code if migrate::lost_decode(code) => LegEnd::Lost { worker: worker.clone(), status },
        Code::InvalidArgument => LegEnd::Failed(status),
        _ => LegEnd::Failed(Status::unavailable(status.message())),
    };
    let mut client = worker.decode();
    let decode = client.decode(pb::DecodeRequest {
        reservation_id: placed.reservation_id.clone(),
        request_id: req.request_id.clone(),
        max_tokens: leg.max_tokens,
        sampling: Some(sampling),
        stop_token_ids: req.stop_ids.clone(),
        constraint: req.constraint.clone().map(|lark| pb::Constraint { lark }),
        resumed_tokens: leg.resumed.clone(),
    });
    let mut stream = match decode.await {
        Ok(s) => s.into_inner(),
        Err(s) => return Err(lost(Status::new(s.code(), format!("decode worker failed: {}", s.message())))),
    };
    placed.guard.armed = false;
    let codec = ctx.model.codec.as_ref();
    loop {
        let ev = match stream.message().await {
            Ok(Some(ev)) => ev,
            Ok(None) => return Err(lost(Status::unavailable("the decode worker ended the stream early"))),
            Err(s) => {
                return Err(lost(Status::new(s.code(), format!("decode worker failed mid-stream: {}", s.message()))));
            }
        };
        let r = relay.accept(codec, &ev, Instant::now()).map_err(LegEnd::Failed)?;
        match r.latency {
            Latency::First(d) => ctx.metrics.ttft.observe(d.as_secs_f64()),
            Latency::Gap(d) => ctx.metrics.inter_token.observe(d.as_secs_f64()),
        }
        tx.send(Ok(Event::Token(r.token))).await.map_err(|_| LegEnd::Failed(Status::cancelled("client went away")))?;
        ctx.metrics.generated_tokens.inc();
        if let Some(finish) = r.finish {
            let fin = relay.final_event(finish);
            ctx.metrics.e2e.observe(relay.since_arrival().as_secs_f64());
            Span::current().record("completion_tokens", relay.emitted().len());
            let _ = tx.send(Ok(fin)).await;
            return Ok(());
        }
    }
}
