//! The decode worker's engine thread. It owns the engine (whose KV memory prefill
//! workers write into), the reservation table and the running batch, and serves
//! commands from the gRPC side between decode steps.
//!
//! Continuous batching: each step decodes one token for every running request;
//! requests join (after their commit) and leave (finished, cancelled, client gone)
//! between steps. When the batch is full, committed requests wait in arrival order.
//!
//! A migrated request (the router re-prefilled its prompt plus the tokens an earlier
//! decode worker emitted) resumes as if uninterrupted: its event indices, seeded RNG
//! position and grammar state continue after the `resumed_tokens`.
//!
//! Telemetry: each request's `decode` span lives as long as it does here; gauges are
//! set at the end of every pass of the loop, after every change of state.

use std::collections::VecDeque;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use cluster::telemetry::DecodeMetrics;
use engine::kv::Sequence;
use engine::sampling::{Sampled, Sampler, SamplingParams};
use engine::{Engine, EngineError, Readout};
use kernels::Backend;
use rayon::prelude::*;
use sluice_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;
use tracing::Span;
use transfer::Checksums;

use crate::constraint::{Constraint, Grammars, Mask};
use crate::reservations::{Table, TableError};

pub type EventTx = mpsc::UnboundedSender<Result<pb::DecodeEvent, Status>>;

pub enum Command {
    Reserve {
        request_id: String,
        prompt_tokens: usize,
        max_tokens: usize,
        reply: oneshot::Sender<Result<Reserved, Status>>,
    },
    Commit {
        req: pb::CommitRequest,
        reply: oneshot::Sender<Result<(), Status>>,
    },
    Release {
        id: String,
        writer_done: bool,
        reply: oneshot::Sender<Result<(), Status>>,
    },
    Decode {
        req: pb::DecodeRequest,
        events: EventTx,
        /// The request's `decode` span, closed when it leaves.
        span: Span,
    },
    Load {
        reply: oneshot::Sender<pb::DecodeLoad>,
    },
    Dump {
        id: String,
        reply: oneshot::Sender<Result<pb::KvDump, Status>>,
    },
}

pub struct Reserved {
    pub id: String,
    pub page_ids: Vec<u32>,
    pub slot: u32,
    /// Which of the worker's devices holds the pages and slot.
    pub device: u32,
}

#[derive(Clone, Debug)]
pub struct LoopConfig {
    pub max_batch: usize,
    pub lease: Duration,
    /// Test hook: a pause before every decode step.
    pub step_delay: Duration,
    pub metrics: DecodeMetrics,
    /// The model's token table for grammars (`None`: no tokenizer, no constrained decoding).
    pub grammars: Option<std::sync::Arc<Grammars>>,
}

struct Running {
    request_id: String,
    seq: Sequence,
    sampler: Sampler,
    /// Token to feed next (the last one sampled).
    next: u32,
    /// Tokens emitted by an earlier decode worker before this request migrated here;
    /// event indices continue after them.
    resumed: usize,
    generated: usize,
    max_tokens: usize,
    stops: Vec<u32>,
    events: EventTx,
    span: Span,
    /// The request's grammar, advanced past every emitted token.
    constraint: Option<Constraint>,
}

/// Each running request's grammar mask for the token sampled after a step (`None`
/// without a grammar).
type Masks = Vec<MaskOf>;
/// One request's mask ([`Masks`]).
type MaskOf = Option<Result<Mask, crate::constraint::ConstraintError>>;

/// Send a failure to a request's client and mark its span failed.
fn fail(events: &EventTx, span: &Span, status: Status) {
    span.record("otel.status_code", "ERROR");
    span.record("otel.status_message", status.message());
    let _ = events.send(Err(status));
}

struct State<B: Backend> {
    engine: Engine<B>,
    table: Table<Sequence>,
    running: Vec<Running>,
    waiting: VecDeque<Running>,
    cfg: LoopConfig,
}

/// Start the engine thread; it runs until every sender of the returned channel is gone,
/// then frees everything it holds.
/// Start the engine thread; returns its command sender and its handle (joined at
/// shutdown, after the last sender is gone, so the engine is dropped before exit).
pub fn spawn<B: Backend>(
    engine: Engine<B>,
    cfg: LoopConfig,
) -> std::io::Result<(std_mpsc::Sender<Command>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = std_mpsc::channel();
    let handle = std::thread::Builder::new().name("decode-engine".into()).spawn(move || {
        let mut s = State { table: Table::new(cfg.lease), engine, running: Vec::new(), waiting: VecDeque::new(), cfg };
        s.run(rx);
    })?;
    Ok((tx, handle))
}

fn table_status(e: TableError) -> Status {
    match e {
        TableError::Unknown(_) | TableError::LeaseEnded(_) => Status::not_found(e.to_string()),
        TableError::WrongState { .. } => Status::failed_precondition(e.to_string()),
    }
}

fn engine_status(e: EngineError) -> Status {
    match e {
        EngineError::Pool(p) => Status::resource_exhausted(format!("decode worker is full: {p}")),
        e if e.is_invalid_input() => Status::invalid_argument(e.to_string()),
        e => Status::internal(e.to_string()),
    }
}

impl<B: Backend> State<B> {
    fn run(&mut self, rx: std_mpsc::Receiver<Command>) {
        self.publish();
        loop {
            let busy = !self.running.is_empty();
            // Idle: sleep until a command arrives or the next lease ends.
            let wait = if busy {
                Duration::ZERO
            } else {
                self.table
                    .next_deadline()
                    .map_or(Duration::from_millis(500), |d| d.saturating_duration_since(Instant::now()))
            };
            match rx.recv_timeout(wait) {
                Ok(cmd) => self.handle(cmd),
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            self.expire();
            self.admit();
            if !self.running.is_empty() {
                self.step(&rx);
            }
            self.publish();
        }
        for r in self.running.drain(..).chain(self.waiting.drain(..)) {
            fail(&r.events, &r.span, Status::unavailable("decode worker shutting down"));
            self.engine.release(r.seq);
        }
        for (_, e) in self.table.expire(Instant::now() + Duration::from_secs(365 * 86400)) {
            self.engine.release(e.seq);
        }
    }

    /// Set the gauges from the state (called after every pass, before waiting).
    fn publish(&self) {
        let m = &self.cfg.metrics;
        let stats = self.engine.pool_stats();
        m.running.set(self.running.len() as i64);
        m.waiting.set(self.waiting.len() as i64);
        m.pages_used.set(stats.pages_used as i64);
        m.pages_total.set(stats.pages_total as i64);
        m.slots_used.set(stats.slots_used as i64);
        m.slots_total.set(stats.slots_total as i64);
        if let Some(h) = self.engine.graph_health() {
            m.set_graphs(h.on, h.refused);
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Reserve { request_id, prompt_tokens, max_tokens, reply } => {
                let _ = reply.send(self.reserve(&request_id, prompt_tokens, max_tokens));
            }
            Command::Commit { req, reply } => {
                let _ = reply.send(self.commit(req));
            }
            Command::Release { id, writer_done, reply } => {
                let r = self.table.release(&id, writer_done).map_err(table_status).map(|seq| {
                    if let Some(seq) = seq {
                        self.engine.release(seq);
                    }
                });
                let _ = reply.send(r);
            }
            Command::Decode { req, events, span } => self.start_decode(req, events, span),
            Command::Load { reply } => {
                let s = self.engine.pool_stats();
                let _ = reply.send(pb::DecodeLoad {
                    free_pages: (s.pages_total - s.pages_used) as u32,
                    total_pages: s.pages_total as u32,
                    free_slots: (s.slots_total - s.slots_used) as u32,
                    running: self.running.len() as u32,
                    waiting: self.waiting.len() as u32,
                });
            }
            Command::Dump { id, reply } => {
                let _ = reply.send(self.dump(&id));
            }
        }
    }

    fn reserve(&mut self, request_id: &str, prompt_tokens: usize, max_tokens: usize) -> Result<Reserved, Status> {
        // The state holds prompt + max_tokens - 1 tokens at most; reserve it all now so a
        // running request never runs out of pages mid-stream.
        let seq = self.engine.reserve(prompt_tokens + max_tokens).map_err(engine_status)?;
        let (page_ids, slot) = (seq.pages().to_vec(), seq.slot() as u32);
        let device = self.engine.cache.rank_of(&seq) as u32;
        let id = self.table.insert(seq, request_id, prompt_tokens, max_tokens, Instant::now());
        tracing::debug!(reservation = %id, pages = page_ids.len(), slot, device, "reserved");
        Ok(Reserved { id, page_ids, slot, device })
    }

    /// Checksums of what landed: in the host mirror or registered host memory, or, when
    /// peers write device memory in place, summed on the device holding the sequence.
    fn landed(&self, seq: &Sequence, tokens: usize) -> Option<Checksums> {
        let logits = transfer::checksum::kv_checksum(self.engine.slot_logits_bytes(seq)?);
        let s = self.engine.transport_checksums(seq, tokens);
        Some(Checksums { pages: s.pages, rings: s.rings, comp: s.comp, logits })
    }

    fn commit(&mut self, req: pb::CommitRequest) -> Result<(), Status> {
        let tokens = req.tokens as usize;
        // Only a reservation still waiting for its writer, within its lease, takes a commit.
        let e = match self.table.writable(&req.reservation_id, Instant::now()) {
            Ok(e) => e,
            Err(err) => {
                self.cfg.metrics.commit_refused("lease");
                return Err(table_status(err));
            }
        };
        if tokens != e.prompt_tokens {
            return Err(Status::invalid_argument(format!(
                "commit of {tokens} tokens for a reservation of {} prompt tokens",
                e.prompt_tokens
            )));
        }
        let landed = self.landed(&e.seq, tokens).ok_or_else(|| Status::internal("KV memory is not readable"))?;
        let sent = Checksums {
            pages: req.page_checksums.clone(),
            rings: req.rings_checksum,
            comp: req.comp_checksum,
            logits: req.logits_checksum,
        };
        if let Some(part) = sent.first_mismatch(&landed) {
            self.cfg.metrics.commit_refused("checksum");
            // The writer says it is done, so the pages can go back at once.
            if let Ok(Some(seq)) = self.table.release(&req.reservation_id, true) {
                self.engine.release(seq);
            }
            return Err(Status::data_loss(format!(
                "KV bytes that landed differ from those sent ({part}); not decoding them"
            )));
        }
        let e = self.table.commit(&req.reservation_id, tokens, Instant::now()).map_err(table_status)?;
        // A device engine's KV landed in its host mirror: bring it in before decoding.
        self.engine.stage_in(&e.seq, tokens.div_ceil(self.engine.cache.layout.block), true);
        self.engine.mark_filled(&mut e.seq, tokens).map_err(engine_status)?;
        Ok(())
    }

    fn start_decode(&mut self, req: pb::DecodeRequest, events: EventTx, span: Span) {
        let (entry, tokens) = match self.table.take_committed(&req.reservation_id) {
            Ok(x) => x,
            Err(e) => {
                fail(&events, &span, table_status(e));
                return;
            }
        };
        let resumed = req.resumed_tokens.len();
        if resumed >= tokens {
            let msg = format!("{resumed} resumed tokens cannot be the tail of a {tokens}-token committed prompt");
            fail(&events, &span, Status::invalid_argument(msg));
            self.engine.release(entry.seq);
            return;
        }
        let max_tokens = (req.max_tokens as usize).min(entry.max_tokens);
        let sampling = req.sampling.unwrap_or_default();
        let params = SamplingParams {
            temperature: sampling.temperature,
            top_p: if sampling.top_p == 0.0 { 1.0 } else { sampling.top_p },
            top_k: sampling.top_k as usize,
            seed: sampling.seed.unwrap_or(0),
            top_logprobs: sampling.top_logprobs as usize,
        };
        if let Err(e) = params.validate() {
            fail(&events, &span, Status::invalid_argument(e.to_string()));
            self.engine.release(entry.seq);
            return;
        }
        let constraint = match (req.constraint.as_ref(), &self.cfg.grammars) {
            (None, _) => None,
            (Some(_), None) => {
                let msg = "this model has no tokenizer.json, so it cannot decode under a grammar";
                fail(&events, &span, Status::invalid_argument(msg));
                self.engine.release(entry.seq);
                return;
            }
            (Some(c), Some(g)) => match g.matcher(&c.lark).and_then(|m| m.replayed(&req.resumed_tokens)) {
                Ok(m) => Some(m),
                Err(e) => {
                    fail(&events, &span, Status::invalid_argument(e.to_string()));
                    self.engine.release(entry.seq);
                    return;
                }
            },
        };
        let mut r = Running {
            constraint,
            request_id: req.request_id,
            seq: entry.seq,
            sampler: Sampler::resumed(params, resumed),
            next: 0,
            resumed,
            generated: 0,
            max_tokens,
            stops: req.stop_token_ids,
            events,
            span,
        };
        // The first token comes from the logits the prefill worker left in the slot.
        let Some(logits) = self.engine.slot_logits(&r.seq) else {
            fail(&r.events, &r.span, Status::internal("no logits region"));
            self.engine.release(r.seq);
            return;
        };
        // No step to overlap with yet: the first mask is computed here.
        let mask = r.constraint.as_mut().map(Constraint::mask);
        let Some(s) = sample(&mut r, &logits, mask) else {
            self.engine.release(r.seq);
            return;
        };
        self.cfg.metrics.tokens.inc();
        if emit(&mut r, s) {
            self.engine.release(r.seq);
        } else {
            self.waiting.push_back(r);
        }
    }

    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_batch {
            match self.waiting.pop_front() {
                Some(r) => self.running.push(r),
                None => break,
            }
        }
    }

    /// One decode step of the running batch. Without grammars the step is launched, the
    /// commands that arrived meanwhile (reservations, commits, new requests, releases) and
    /// lease expiry are served while the device computes, and then its tokens are
    /// collected: the read of the picked tokens is the step's one wait on the device.
    /// Requests under a grammar have their masks computed on a helper thread instead,
    /// beside a step that returns when its logits are on the host.
    fn step(&mut self, rx: &std_mpsc::Receiver<Command>) {
        if !self.cfg.step_delay.is_zero() {
            std::thread::sleep(self.cfg.step_delay);
        }
        let tokens: Vec<u32> = self.running.iter().map(|r| r.next).collect();
        // Greedy requests without a grammar or top logprobs take the step's greedy
        // read-out (picked on the device by a GPU engine); the rest read their logits.
        let with_logits: Vec<bool> =
            self.running.iter().map(|r| r.sampler.needs_logits() || r.constraint.is_some()).collect();
        let started = Instant::now();
        let (result, masks) = if self.running.iter().any(|r| r.constraint.is_some()) {
            self.step_with_masks(&tokens, &with_logits)
        } else {
            let launched = {
                let mut seqs: Vec<&mut Sequence> = self.running.iter_mut().map(|r| &mut r.seq).collect();
                self.engine.decode_launch(&mut seqs, &tokens, &with_logits)
            };
            match launched {
                Ok(launched) => {
                    while let Ok(cmd) = rx.try_recv() {
                        self.handle(cmd);
                    }
                    self.expire();
                    (Ok(self.engine.decode_collect(launched)), Vec::new())
                }
                Err(e) => (Err(e), Vec::new()),
            }
        };
        self.cfg.metrics.step_seconds.observe(started.elapsed().as_secs_f64());
        self.finish_step(result, masks);
    }

    /// A step whose grammar masks (for the tokens sampled after it) are computed on a
    /// helper thread while the engine runs it.
    fn step_with_masks(&mut self, tokens: &[u32], with_logits: &[bool]) -> (Result<Vec<Readout>, EngineError>, Masks) {
        let (mut seqs, mut constraints): (Vec<&mut Sequence>, Vec<Option<&mut Constraint>>) =
            self.running.iter_mut().map(|r| (&mut r.seq, r.constraint.as_mut())).unzip();
        let engine = &mut self.engine;
        std::thread::scope(|scope| {
            let masker =
                scope.spawn(move || constraints.iter_mut().map(|c| c.as_mut().map(|c| c.mask())).collect::<Vec<_>>());
            let result = engine.decode_readout(&mut seqs, tokens, with_logits);
            (result, masker.join().expect("the mask thread does not panic"))
        })
    }

    /// Sample (or take the greedy pick of) every running request's token from the step's
    /// read-out, emit it, and let finished requests leave.
    fn finish_step(&mut self, result: Result<Vec<Readout>, EngineError>, mut masks: Masks) {
        masks.resize_with(self.running.len(), || None);
        let readouts = match result {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "decode step failed; failing the batch");
                for r in self.running.drain(..) {
                    fail(&r.events, &r.span, Status::internal(format!("decode step failed: {e}")));
                    self.engine.release(r.seq);
                }
                return;
            }
        };
        let mut keep = Vec::with_capacity(self.running.len());
        self.cfg.metrics.tokens.inc_by(self.running.len() as u64);
        let mut batch: Vec<_> = self.running.drain(..).zip(readouts).zip(masks).map(|((r, o), m)| (r, o, m)).collect();
        // A drawn token costs two passes over the vocabulary on the host (~2 ms at V4's
        // 129K, engine/examples/sampler_speed.rs): requests that draw are sampled on all
        // cores, so a batch of them costs their sum divided by the cores, not their sum.
        let pick = |(r, out, mask): &mut (Running, Readout, MaskOf)| match &out.logits {
            Some(l) => sample(r, l, mask.take()),
            None => Some(r.sampler.greedy(out.token, out.logprob)),
        };
        let drawn = batch.iter().filter(|(_, out, _)| out.logits.is_some()).count();
        let picks: Vec<Option<Sampled>> =
            if drawn > 1 { batch.par_iter_mut().map(pick).collect() } else { batch.iter_mut().map(pick).collect() };
        for ((mut r, _, _), sampled) in batch.into_iter().zip(picks) {
            let Some(s) = sampled else {
                self.engine.release(r.seq);
                continue;
            };
            if emit(&mut r, s) {
                self.engine.release(r.seq);
            } else {
                keep.push(r);
            }
        }
        self.running = keep;
    }

    fn expire(&mut self) {
        for (id, e) in self.table.expire(Instant::now()) {
            tracing::warn!(reservation = %id, request_id = %e.request_id, state = ?e.state, "reservation lease ended; pages reclaimed");
            self.engine.release(e.seq);
        }
    }

    fn dump(&self, id: &str) -> Result<pb::KvDump, Status> {
        let e = self.table.get(id).map_err(table_status)?;
        let tokens = match e.state {
            crate::reservations::State::Committed { tokens } => tokens,
            other => return Err(Status::failed_precondition(format!("reservation {id} is {other:?}"))),
        };
        let logits = self.engine.slot_logits_bytes(&e.seq).unwrap_or_default().to_vec();
        Ok(match self.engine.sequence_bytes(&e.seq, tokens) {
            Some(b) => pb::KvDump {
                pages: b.pages.iter().map(|p| p.to_vec()).collect(),
                rings: b.rings.to_vec(),
                comp: b.comp.to_vec(),
                logits,
            },
            // Device memory reached in place: read it back.
            None => {
                let b = self.engine.read_sequence(&e.seq, tokens);
                pb::KvDump { pages: b.pages, rings: b.rings, comp: b.comp, logits }
            }
        })
    }
}

/// Sample a request's next token (under its grammar's mask, when it has one) and advance
/// its grammar past it; `None` when the grammar failed (the request is failed).
fn sample(
    r: &mut Running,
    logits: &[f32],
    mask: Option<Result<Mask, crate::constraint::ConstraintError>>,
) -> Option<Sampled> {
    let s = match mask {
        None => r.sampler.sample(logits),
        Some(Ok(mask)) => r.sampler.sample_allowed(logits, |t| mask.allows(t)),
        Some(Err(e)) => {
            fail(&r.events, &r.span, Status::internal(format!("grammar failed: {e}")));
            return None;
        }
    };
    if let Some(c) = r.constraint.as_mut()
        && !r.stops.contains(&s.token)
        && let Err(e) = c.commit(s.token)
    {
        fail(&r.events, &r.span, Status::internal(format!("grammar failed: {e}")));
        return None;
    }
    Some(s)
}

/// Send one sampled token; returns whether the request is finished (done, or the
/// client went away).
fn emit(r: &mut Running, s: Sampled) -> bool {
    r.generated += 1;
    let finish = if r.stops.contains(&s.token) {
        pb::FinishReason::Stop
    } else if r.generated >= r.max_tokens {
        pb::FinishReason::Length
    } else {
        pb::FinishReason::Unspecified
    };
    let event = pb::DecodeEvent {
        index: (r.resumed + r.generated - 1) as u32,
        token_id: s.token,
        logprob: s.logprob,
        top_logprobs: s
            .top
            .iter()
            .map(|&(t, lp)| pb::TopLogprob { token_id: t, logprob: lp, text: String::new() })
            .collect(),
        finish: finish as i32,
    };
    if r.events.send(Ok(event)).is_err() {
        tracing::info!(parent: &r.span, request_id = %r.request_id, "client went away; freeing its pages");
        r.span.record("completion_tokens", r.generated);
        r.span.record("finish", "cancelled");
        return true;
    }
    r.next = s.token;
    if finish != pb::FinishReason::Unspecified {
        r.span.record("completion_tokens", r.generated);
        r.span.record("finish", finish.as_str_name());
        return true;
    }
    false
}
