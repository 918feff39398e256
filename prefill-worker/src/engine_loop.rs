//! The prefill worker's engine thread: queued prompts are batched into steps of at most
//! `token_budget` tokens (long prompts are prefilled in chunks across steps, from the
//! state the previous chunk left); a prompt whose last chunk is done has its pages,
//! state slot and last-token logits written into its decode worker's reservation with
//! UCX, straight out of the engine's memory.
//!
//! The UCX sender lives on this thread (it is `!Send`) next to the memory it sends from.
//!
//! Telemetry: each job carries its caller's trace context; its `prefill.queue`,
//! `prefill.compute` and `kv_transfer` spans are children of it. Gauges are set at the
//! end of every pass of the loop, after every change of state.

mod put;
mod put_queue;
mod restore;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use cluster::telemetry::metrics::KV_POOLS;
use cluster::telemetry::propagation::set_parent_context;
use cluster::telemetry::{PrefillMetrics, TraceContext};
use engine::kv::Sequence;
use engine::{Engine, Logits, StepInput};
use kernels::Backend;
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;
use tonic::Status;
use tracing::Span;
use transfer::{Checksums, SendParts, Sender, Source, SourceParts, Target, WireGeometry};

pub use restore::RestoreTarget;

use crate::prefix_cache::{FetchError, Prefix, PrefixCache};

pub struct Job {
    pub request_id: String,
    pub reservation_id: String,
    pub tokens: Vec<u32>,
    pub target: Target,
    /// The reservation's lease end: no byte may be written after it.
    pub deadline: Instant,
    pub enqueued: Instant,
    pub reply: oneshot::Sender<Result<Done, Status>>,
    /// The caller's trace context: the parent of this job's spans.
    pub trace: TraceContext,
    /// `prefill.queue`, open from arrival until the job starts.
    pub queue_span: Span,
    /// What the prefix cache holds of this prompt and how to resume from it.
    pub prefix: Option<Prefix>,
    /// Where to send the pages and slot a planned restore must fill (dropped when the
    /// prompt starts cold).
    pub restore: Option<oneshot::Sender<RestoreTarget>>,
}

impl Job {
    /// Make `span` (of this job's work) a child of the caller's span.
    fn adopt(&self, span: Span) -> Span {
        set_parent_context(&span, self.trace.clone());
        span
    }
}

pub struct Done {
    pub checksums: Checksums,
    pub tokens: usize,
    pub cached_tokens: usize,
    pub recompute_tokens: usize,
    /// Waiting here before the prompt was admitted.
    pub queue: Duration,
    /// Restoring a cached prefix: the store's writes, their check, the copy in.
    pub restore: Duration,
    /// Computing (a window rebuild after a restore included).
    pub compute: Duration,
    pub transfer: Duration,
    pub bytes: u64,
}

pub enum Command {
    Prefill(Box<Job>),
    /// Replies once the job will not write any more (see [`CancelOutcome`]).
    Cancel {
        reservation_id: String,
        reply: oneshot::Sender<CancelOutcome>,
    },
    Load {
        reply: oneshot::Sender<pb::PrefillLoad>,
    },
    Dump {
        reservation_id: String,
        reply: oneshot::Sender<Option<pb::KvDump>>,
    },
    /// The store wrote (or failed to write) a restore's records.
    Restored {
        reservation_id: String,
        result: Result<Vec<u64>, FetchError>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    /// Stopped before writing anything, or not arrived yet and now refused if it does.
    Cancelled,
    /// Already wrote everything.
    Finished,
}

#[derive(Clone)]
pub struct LoopConfig {
    pub token_budget: usize,
    pub transfer_timeout: Duration,
    pub keep_dumps: bool,
    /// Test hook: a pause after a step computes, before finished prompts are written.
    pub transfer_delay: Duration,
    pub metrics: PrefillMetrics,
    /// The shared-prefix store, and the runtime its (blocking) puts run on.
    pub cache: Option<(Arc<PrefixCache>, tokio::runtime::Handle)>,
    /// Whether sends and kvstore traffic read and write device memory in place.
    pub paths: crate::memory::KvPaths,
    /// Most bytes of blocks waiting for the put thread (`--kvstore-put-queue-bytes`).
    pub put_queue_bytes: usize,
}

struct Active {
    job: Job,
    seq: Sequence,
    /// In the queue before admission, and restoring a cached prefix after it.
    queued: Duration,
    restore: Duration,
    compute: Duration,
    /// `prefill.compute`, open until the last chunk is computed.
    span: Span,
    /// Tokens restored from the prefix cache, and recomputed to rebuild state.
    cached: usize,
    recomputed: usize,
    /// Window snapshots taken at block boundaries for the store: (boundary, bytes).
    snapshots: Vec<(usize, Vec<u8>)>,
}

struct State<B: Backend> {
    engine: Engine<B>,
    sender: Sender,
    geometry: WireGeometry,
    queue: VecDeque<Job>,
    active: Vec<Active>,
    cfg: LoopConfig,
    /// What the last prefills sent, for the test hook (bounded).
    dumps: VecDeque<(String, pb::KvDump)>,
    /// Reservations whose KV was fully written recently (bounded), so a late cancel
    /// can say nothing more will be written.
    finished: VecDeque<String>,
    /// Reservations cancelled before their prompt arrived here (bounded). A prompt that
    /// arrives after its cancel (the router gave up while the call was in flight) is
    /// refused, so a `Cancelled` reply is a promise that nothing will be written.
    tombstones: VecDeque<String>,
    /// Prompts whose cached prefix the store is writing into their pages.
    restoring: Vec<restore::Restoring>,
    /// Sequences a store might still write into (a fetch given up on): released once
    /// the fetch's deadline has passed.
    quarantine: Vec<(Instant, Sequence)>,
    /// Offers of finished prompts' blocks to the kvstore, sent by their own thread.
    puts: Option<put_queue::PutQueue>,
}

const KEPT_FINISHED: usize = 4096;

/// Far more cancels than can race their own prompt; a prompt older than this many
/// cancels is refused by its lease deadline anyway.
const KEPT_TOMBSTONES: usize = 4096;

const KEPT_DUMPS: usize = 16;

/// Start the engine thread; returns its command sender and its handle (joined at
/// shutdown, after the last sender is gone, so the engine is dropped before exit).
pub fn spawn<B: Backend>(
    engine: Engine<B>,
    cfg: LoopConfig,
) -> std::io::Result<(std_mpsc::Sender<Command>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = std_mpsc::channel();
    let (ready_tx, ready_rx) = std_mpsc::channel();
    let handle = std::thread::Builder::new().name("prefill-engine".into()).spawn(move || {
        let sender = match Sender::new().and_then(|mut s| {
            // Sends from device memory carry its registration (UCX's zero-copy GPU path).
            if cfg.paths.direct_send {
                for part in engine.device_kv().unwrap_or_default() {
                    for mem in [part.pages, part.rings, part.comp] {
                        s.register_local(mem)?;
                    }
                }
            }
            Ok(s)
        }) {
            Ok(s) => {
                let _ = ready_tx.send(Ok(()));
                s
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e.to_string()));
                return;
            }
        };
        let geometry = WireGeometry::new(&engine.model.layout, &engine.fingerprint, engine.config().vocab_size);
        let puts = match (&cfg.cache, cfg.paths.kvstore_direct) {
            (Some((cache, rt)), false) => {
                match put_queue::PutQueue::start(cache.clone(), rt.clone(), cfg.metrics.clone(), cfg.put_queue_bytes) {
                    Ok(q) => Some(q),
                    Err(e) => {
                        tracing::warn!(error = %e, "no kvstore put thread; prompts' blocks are not offered");
                        None
                    }
                }
            }
            _ => None,
        };
        let mut s = State {
            engine,
            sender,
            geometry,
            queue: VecDeque::new(),
            active: Vec::new(),
            cfg,
            dumps: VecDeque::new(),
            finished: VecDeque::new(),
            tombstones: VecDeque::new(),
            restoring: Vec::new(),
            quarantine: Vec::new(),
            puts,
        };
        s.run(rx);
    })?;
    ready_rx
        .recv()
        .map_err(|_| std::io::Error::other("prefill engine thread exited"))?
        .map_err(|e| std::io::Error::other(format!("UCX sender: {e}")))?;
    Ok((tx, handle))
}

impl<B: Backend> State<B> {
    fn run(&mut self, rx: std_mpsc::Receiver<Command>) {
        let rx = &rx;
        self.publish();
        loop {
            let idle = self.queue.is_empty() && self.active.is_empty();
            let first = if !idle {
                rx.try_recv().ok()
            } else if let Some(wake) = self.next_wake() {
                match rx.recv_timeout(wake.saturating_duration_since(Instant::now())) {
                    Ok(c) => Some(c),
                    Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
                }
            } else {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => break, // every sender is gone
                }
            };
            for cmd in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
                self.handle(cmd);
            }
            self.expire_restores();
            self.admit();
            if !self.active.is_empty() {
                self.step(rx);
            }
            self.publish();
        }
        for a in self.active.drain(..) {
            let _ = a.job.reply.send(Err(Status::unavailable("prefill worker shutting down")));
            self.engine.release(a.seq);
        }
        for r in self.restoring.drain(..) {
            let _ = r.job.reply.send(Err(Status::unavailable("prefill worker shutting down")));
        }
    }

    /// Set the gauges from the state (called after every pass, before blocking).
    fn publish(&self) {
        let m = &self.cfg.metrics;
        let stats = self.engine.pool_stats();
        m.waiting.set(self.queue.len() as i64);
        m.running.set(self.active.len() as i64);
        m.pages_used.set(stats.pages_used as i64);
        m.pages_total.set(stats.pages_total as i64);
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Prefill(job) => {
                if let Some(i) = self.tombstones.iter().position(|id| *id == job.reservation_id) {
                    self.tombstones.remove(i);
                    let _ = job.reply.send(Err(Status::cancelled("prefill cancelled before it arrived")));
                } else {
                    self.queue.push_back(*job);
                }
            }
            Command::Cancel { reservation_id, reply } => {
                let outcome = if let Some(i) = self.queue.iter().position(|j| j.reservation_id == reservation_id) {
                    let job = self.queue.remove(i).expect("present");
                    let _ = job.reply.send(Err(Status::cancelled("prefill cancelled")));
                    CancelOutcome::Cancelled
                } else if let Some(i) = self.active.iter().position(|a| a.job.reservation_id == reservation_id) {
                    let a = self.active.remove(i);
                    let _ = a.job.reply.send(Err(Status::cancelled("prefill cancelled")));
                    self.engine.release(a.seq);
                    CancelOutcome::Cancelled
                } else if let Some(i) = self.restoring.iter().position(|r| r.job.reservation_id == reservation_id) {
                    // The store may still be writing into its pages: they wait out the fetch.
                    let r = self.restoring.remove(i);
                    let _ = r.job.reply.send(Err(Status::cancelled("prefill cancelled")));
                    self.quarantine.push((r.fetch_deadline, r.seq));
                    CancelOutcome::Cancelled
                } else if self.finished.contains(&reservation_id) {
                    CancelOutcome::Finished
                } else {
                    self.tombstones.push_back(reservation_id);
                    if self.tombstones.len() > KEPT_TOMBSTONES {
                        self.tombstones.pop_front();
                    }
                    CancelOutcome::Cancelled
                };
                let _ = reply.send(outcome);
            }
            Command::Load { reply } => {
                let cost = |j: &Job| j.tokens.len() - j.prefix.as_ref().map_or(0, |p| p.plan.cached_tokens);
                let queued: usize = self.queue.iter().map(cost).sum::<usize>()
                    + self.restoring.iter().map(|r| cost(&r.job)).sum::<usize>()
                    + self.active.iter().map(|a| a.job.tokens.len() - a.seq.len()).sum::<usize>();
                let _ = reply.send(pb::PrefillLoad {
                    queued_tokens: queued as u64,
                    queued_requests: (self.queue.len() + self.restoring.len() + self.active.len()) as u32,
                    fingerprint: self.engine.fingerprint.hex(),
                });
            }
            Command::Dump { reservation_id, reply } => {
                let _ = reply.send(self.dumps.iter().find(|(id, _)| *id == reservation_id).map(|(_, d)| d.clone()));
            }
            Command::Restored { reservation_id, result } => self.restored(&reservation_id, result),
        }
    }

    /// Start queued prompts while there are slots and pages for them: a prompt with a
    /// cached prefix first has the store fill its pages (see `restore`), the others go
    /// straight to the running set.
    fn admit(&mut self) {
        let block = self.engine.cache.layout.block;
        while let Some(job) = self.queue.front() {
            let stats = self.engine.pool_stats();
            let pages = job.tokens.len().div_ceil(block);
            let still_needed = |tokens: usize, have: usize| tokens.div_ceil(block) - have;
            let reserved: usize = self
                .active
                .iter()
                .map(|a| still_needed(a.job.tokens.len(), a.seq.pages().len()))
                .chain(self.restoring.iter().map(|r| still_needed(r.job.tokens.len(), r.seq.pages().len())))
                .sum();
            if stats.slots_used == stats.slots_total || stats.pages_total - stats.pages_used < pages + reserved {
                break;
            }
            let mut job = self.queue.pop_front().expect("front");
            drop(std::mem::replace(&mut job.queue_span, Span::none()));
            for pool in KV_POOLS {
                self.cfg.metrics.prefix_lookup(pool, job.tokens.len() as u64, 0);
            }
            match self.engine.open_sequence() {
                Ok(seq) => {
                    // Unless the store is filling its prefix, it starts cold now.
                    if let Some((job, seq)) = self.start_restore(job, seq) {
                        self.start(job, seq, 0, 0);
                    }
                }
                Err(e) => {
                    let _ = job.reply.send(Err(Status::resource_exhausted(e.to_string())));
                }
            }
        }
    }

    /// Put a prompt into the running set, `cached` of its tokens already in `seq`.
    fn start(&mut self, job: Job, seq: Sequence, cached: usize, recomputed: usize) {
        let queued = job.enqueued.elapsed();
        self.start_timed(job, seq, cached, recomputed, queued, Duration::ZERO, Duration::ZERO);
    }

    /// [`Self::start`] for a prompt admitted `queued` after it arrived, whose prefix
    /// took `restore` to restore and `rebuild` to recompute window state.
    #[allow(clippy::too_many_arguments)]
    fn start_timed(
        &mut self,
        job: Job,
        seq: Sequence,
        cached: usize,
        recomputed: usize,
        queued: Duration,
        restore: Duration,
        rebuild: Duration,
    ) {
        let span = tracing::info_span!(
            "prefill.compute",
            request_id = %job.request_id,
            tokens = job.tokens.len(),
            cached_tokens = cached
        );
        let span = job.adopt(span);
        self.active.push(Active {
            job,
            seq,
            queued,
            restore,
            compute: rebuild,
            span,
            cached,
            recomputed,
            snapshots: Vec::new(),
        });
    }

    fn step(&mut self, rx: &std_mpsc::Receiver<Command>) {
        let mut budget = self.cfg.token_budget;
        let mut chunks: Vec<(usize, usize, usize)> = Vec::new(); // (active index, from, to)
        for (i, a) in self.active.iter().enumerate() {
            if budget == 0 {
                break;
            }
            let from = a.seq.len();
            let mut to = (from + budget).min(a.job.tokens.len());
            // A chunk ends where the store wants a window snapshot.
            if let Some(k) = self.next_snapshot(&a.job, from) {
                to = to.min(k * self.engine.cache.layout.block);
            }
            budget -= to - from;
            chunks.push((i, from, to));
        }
        let t = Instant::now();
        let result = {
            let mut refs: Vec<Option<&mut Active>> = self.active.iter_mut().map(Some).collect();
            let mut inputs: Vec<StepInput<'_>> = Vec::with_capacity(chunks.len());
            for &(i, from, to) in &chunks {
                let a = refs[i].take().expect("each active once");
                let last = to == a.job.tokens.len();
                inputs.push(StepInput {
                    seq: &mut a.seq,
                    tokens: &a.job.tokens[from..to],
                    logits: if last { Logits::Last } else { Logits::None },
                });
            }
            self.engine.step(&mut inputs)
        };
        let elapsed = t.elapsed();
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "prefill step failed; failing its prompts");
                for &(i, _, _) in chunks.iter().rev() {
                    let a = self.active.remove(i);
                    let _ = a.job.reply.send(Err(Status::internal(format!("prefill failed: {e}"))));
                    self.engine.release(a.seq);
                }
                return;
            }
        };
        let mut finished = Vec::new();
        for &(i, _, to) in &chunks {
            self.take_snapshot(i, to);
        }
        for (&(i, from, to), l) in chunks.iter().zip(logits) {
            self.cfg.metrics.tokens.inc_by((to - from) as u64);
            self.active[i].compute += elapsed;
            if to == self.active[i].job.tokens.len() {
                finished.push((self.active[i].job.reservation_id.clone(), l));
            }
        }
        if !self.cfg.transfer_delay.is_zero() {
            std::thread::sleep(self.cfg.transfer_delay);
        }
        // A cancel that arrived while this step computed must win over the write.
        while let Ok(cmd) = rx.try_recv() {
            self.handle(cmd);
        }
        for (id, l) in finished {
            if let Some(i) = self.active.iter().position(|a| a.job.reservation_id == id) {
                let a = self.active.remove(i);
                self.finish(a, l);
            }
        }
    }

    /// Write a finished prompt's KV into its reservation, then free it here.
    fn finish(&mut self, mut a: Active, logits: Vec<f32>) {
        drop(std::mem::replace(&mut a.span, Span::none()));
        let span = a.job.adopt(tracing::info_span!(
            "kv_transfer",
            request_id = %a.job.request_id,
            pages = a.job.target.page_ids.len(),
            bytes = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            otel.status_message = tracing::field::Empty,
        ));
        let reply = span.in_scope(|| self.send(&a, &logits));
        match &reply {
            Ok(done) => {
                span.record("bytes", done.bytes);
                self.cfg.metrics.transfer_bytes.inc_by(done.bytes);
                self.cfg.metrics.transfer_seconds.observe(done.transfer.as_secs_f64());
            }
            Err(s) => {
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_message", s.message());
                tracing::warn!(parent: &span, request_id = %a.job.request_id, error = %s.message(), "KV transfer failed");
            }
        }
        drop(span);
        // Written or failed part way: either way nothing more will be written.
        self.finished.push_back(a.job.reservation_id.clone());
        if self.finished.len() > KEPT_FINISHED {
            self.finished.pop_front();
        }
        let _ = a.job.reply.send(reply);
        // Off the request's path: its KV is with the decode worker (or failed to get
        // there); the blocks the store lacks are copied out for it (or, when the store
        // reaches GPU memory, written from it) before the pages are reused.
        let offer = put::Offer { request_id: &a.job.request_id, tokens: &a.job.tokens, trace: &a.job.trace };
        self.put_blocks(offer, a.job.prefix.as_ref(), &a.seq, &a.snapshots);
        self.engine.release(a.seq);
    }

    /// Keep what a prefill sent, for the DumpKv test hook (bounded).
    fn keep_dump(&mut self, reservation_id: &str, pages: Vec<Vec<u8>>, rings: Vec<u8>, comp: Vec<u8>, logits: Vec<u8>) {
        self.dumps.push_back((reservation_id.to_string(), pb::KvDump { pages, rings, comp, logits }));
        if self.dumps.len() > KEPT_DUMPS {
            self.dumps.pop_front();
        }
    }

    fn send(&mut self, a: &Active, logits: &[f32]) -> Result<Done, Status> {
        let cached_tokens = a.cached;
        let recompute_tokens = a.recomputed;
        let now = Instant::now();
        if now >= a.job.deadline {
            return Err(Status::deadline_exceeded("the reservation's lease ended before its prefill finished"));
        }
        let n = a.job.tokens.len();
        let logit_bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        let timeout = self.cfg.transfer_timeout.min(a.job.deadline - now);
        let failed =
            |e: transfer::TransferError| Status::unavailable(format!("KV transfer to the decode worker failed: {e}"));
        let (checksums, stats) = if self.cfg.paths.direct_send {
            // Straight from device memory: the ops that wrote it must be done, and the
            // checksums are summed on the device holding the sequence.
            self.engine.model.backend.synchronize();
            let ranges = self
                .engine
                .sequence_device_ranges(&a.seq, n)
                .ok_or_else(|| Status::internal("GPU-direct send from an engine without device KV memory"))?;
            let mem = self.engine.device_kv().ok_or_else(|| Status::internal("no device KV memory"))?;
            let part = &mem[ranges.rank];
            fn dev(mem: &dyn kernels::backend::DeviceMemory, (offset, len): (usize, usize)) -> Source<'_> {
                Source::Device { mem, offset, len }
            }
            let parts = SourceParts {
                pages: ranges.pages.iter().map(|&r| dev(&*part.pages, r)).collect(),
                rings: dev(&*part.rings, ranges.rings),
                comp: dev(&*part.comp, ranges.comp),
                logits: Source::Host(&logit_bytes),
            };
            let sums = self.engine.own_checksums(&a.seq, n);
            let checksums = Checksums {
                pages: sums.pages,
                rings: sums.rings,
                comp: sums.comp,
                logits: transfer::checksum::kv_checksum(&logit_bytes),
            };
            let stats = self.sender.send_from(&a.job.target, &self.geometry, &parts, timeout).map_err(failed)?;
            if self.cfg.keep_dumps {
                let b = self.engine.read_sequence(&a.seq, n);
                self.keep_dump(&a.job.reservation_id, b.pages, b.rings, b.comp, logit_bytes);
            }
            (checksums, stats)
        } else {
            // Staged: a device engine's KV goes out through its host mirror.
            self.engine.stage_out(&a.seq, n);
            let bytes =
                self.engine.sequence_bytes(&a.seq, n).ok_or_else(|| Status::internal("KV memory is not readable"))?;
            let parts = SendParts { pages: bytes.pages, rings: bytes.rings, comp: bytes.comp, logits: &logit_bytes };
            let checksums = Checksums::of(&parts);
            let stats = self.sender.send(&a.job.target, &self.geometry, &parts, timeout).map_err(failed)?;
            if self.cfg.keep_dumps {
                let pages = parts.pages.iter().map(|p| p.to_vec()).collect();
                let (rings, comp) = (parts.rings.to_vec(), parts.comp.to_vec());
                self.keep_dump(&a.job.reservation_id, pages, rings, comp, logit_bytes.clone());
            }
            (checksums, stats)
        };
        tracing::debug!(request_id = %a.job.request_id, tokens = n, bytes = stats.bytes, ms = stats.elapsed.as_secs_f64() * 1e3, "KV sent");
        Ok(Done {
            checksums,
            tokens: n,
            cached_tokens,
            recompute_tokens,
            queue: a.queued,
            restore: a.restore,
            compute: a.compute,
            transfer: stats.elapsed,
            bytes: stats.bytes,
        })
    }
}
