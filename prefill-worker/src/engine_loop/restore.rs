//! Prompts resumed from the prefix cache, on the engine thread: a prompt whose lookup
//! found a usable prefix gets that prefix's pages reserved; the service has the store
//! write them (and the window snapshot, when restoring from one) into this worker's
//! registered memory, then reports back; the engine checks what landed against the
//! store's checksums, rebuilds the window when there was no snapshot, and starts the
//! prompt from the end of the prefix. Any failure sends the prompt on cold.
//!
//! Memory the store may still write into (a fetch given up on) is quarantined until
//! the fetch's deadline — the store writes nothing after it — before it is reused.
//!
//! Also here: where chunks end so that window snapshots can be taken for the store.

use std::time::{Duration, Instant};

use engine::kv::Sequence;
use engine::prefix::PrefixState;
use model_spec::Restore;
use model_spec::block_hash::BlockHash;
use tonic::Status;
use transfer::checksum::kv_checksum;

use super::{Job, State};
use crate::prefix_cache::FetchError;

/// What the store must fill for a restore.
#[derive(Clone, Debug)]
pub struct RestoreTarget {
    /// Keys of the prefix blocks, in order.
    pub keys: Vec<BlockHash>,
    /// Where their pages go (ids relative to the part of the KV memory they are in).
    pub page_ids: Vec<u32>,
    pub slot: usize,
    /// Also the window snapshot at the end of the prefix.
    pub snapshot: bool,
    /// The part of this worker's registered KV memory written (a GPU's, when the store
    /// writes device memory in place; else the one host region).
    pub part: usize,
}

pub struct Restoring {
    pub job: Job,
    pub seq: Sequence,
    blocks: usize,
    snapshot: bool,
    started: Instant,
    /// After this the store writes nothing more into the sequence's memory.
    pub fetch_deadline: Instant,
}

/// Slack on top of a fetch's timeout before its memory is trusted to be left alone.
const FETCH_MARGIN: Duration = Duration::from_secs(1);

impl<B: kernels::Backend> State<B> {
    /// Ask for a prompt's prefix to be filled, when its lookup found one; otherwise
    /// hand the prompt back to start cold.
    pub(super) fn start_restore(&mut self, mut job: Job, mut seq: Sequence) -> Option<(Job, Sequence)> {
        let Some((cache, _)) = &self.cfg.cache else { return Some((job, seq)) };
        let timeout = cache.timeout;
        let (blocks, snapshot) = match job.prefix.as_ref().map(|p| p.plan.restore) {
            Some(Restore::Snapshot { blocks }) if blocks > 0 => (blocks, true),
            Some(Restore::Rebuild { blocks }) if blocks > 0 => (blocks, false),
            _ => return Some((job, seq)),
        };
        let Some(tx) = job.restore.take() else { return Some((job, seq)) };
        let page_ids = match self.engine.reserve_prefix(&mut seq, blocks) {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(request_id = %job.request_id, error = %e, "no room to restore the cached prefix; computing it");
                return Some((job, seq));
            }
        };
        let keys = job.prefix.as_ref().expect("checked").keys[..blocks].to_vec();
        // The store writes device memory per GPU: ids relative to the sequence's GPU.
        let target = match self.cfg.paths.kvstore_direct {
            true => match self.engine.sequence_device_ranges(&seq, blocks * self.engine.cache.layout.block) {
                Some(r) => RestoreTarget { keys, page_ids: r.local_pages, slot: r.local_slot, snapshot, part: r.rank },
                None => RestoreTarget { keys, page_ids, slot: seq.slot(), snapshot, part: 0 },
            },
            false => RestoreTarget { keys, page_ids, slot: seq.slot(), snapshot, part: 0 },
        };
        if tx.send(target).is_err() {
            // The caller is gone: nothing was asked of the store, nothing to wait for.
            self.engine.release(seq);
            return None;
        }
        let now = Instant::now();
        self.restoring.push(Restoring {
            job,
            seq,
            blocks,
            snapshot,
            started: now,
            fetch_deadline: now + timeout + FETCH_MARGIN,
        });
        None
    }

    /// The store is done with a restore (or failed): check, rebuild, start.
    pub(super) fn restored(&mut self, reservation_id: &str, result: Result<Vec<u64>, FetchError>) {
        let Some(i) = self.restoring.iter().position(|r| r.job.reservation_id == reservation_id) else {
            return; // cancelled or expired meanwhile; its memory is quarantined
        };
        let r = self.restoring.remove(i);
        let outcome = result.and_then(|sums| {
            self.check_landed(&r, &sums).map_err(|message| FetchError { message, may_have_written: false })
        });
        let Restoring { job, mut seq, blocks, snapshot, started, fetch_deadline } = r;
        let block = self.engine.cache.layout.block;
        let prefix_tokens = blocks * block;
        let queued = started.saturating_duration_since(job.enqueued);
        // Restore: the store's writes and their check, then the copy in; rebuild: the
        // window recompute (compute, reported as such).
        let (mut restore, mut rebuild) = (Duration::ZERO, Duration::ZERO);
        let finished = outcome.and_then(|()| {
            // A device engine's prefix landed in its host mirror: bring it in.
            self.engine.stage_in(&seq, blocks, snapshot);
            restore = started.elapsed();
            let t = Instant::now();
            let state = if snapshot { PrefixState::Snapshot } else { PrefixState::Rebuild };
            let r = self
                .engine
                .finish_restore(&mut seq, &job.tokens[..prefix_tokens], state)
                .map_err(|e| FetchError { message: e.to_string(), may_have_written: false });
            rebuild = t.elapsed();
            r
        });
        let m = &self.cfg.metrics;
        match finished {
            Ok(_) => {
                let plan = job.prefix.as_ref().expect("a restore has a plan").plan;
                let policy = job.prefix.as_ref().expect("a restore has a plan").policy;
                for pool in ["csa_main", "csa_indexer", "hca"] {
                    m.prefix_lookup(pool, 0, prefix_tokens as u64);
                }
                m.prefix_lookup("swa", 0, if snapshot { prefix_tokens as u64 } else { 0 });
                m.recomputed(policy.label(), plan.recompute_tokens as u64);
                m.restore_seconds.observe(started.elapsed().as_secs_f64());
                tracing::debug!(request_id = %job.request_id, tokens = prefix_tokens, snapshot, "cached prefix restored");
                self.start_timed(job, seq, prefix_tokens, plan.recompute_tokens, queued, restore, rebuild);
            }
            Err(e) => {
                m.cache_error("get");
                tracing::warn!(request_id = %job.request_id, error = %e.message, "restoring the cached prefix failed; computing it");
                self.go_cold(job, seq, e.may_have_written.then_some(fetch_deadline));
            }
        }
    }

    /// Start a prompt from scratch after a failed restore; its old sequence is either
    /// emptied or, when the store might still write into it, quarantined.
    fn go_cold(&mut self, job: Job, mut seq: Sequence, quarantine_until: Option<Instant>) {
        match quarantine_until {
            None => {
                self.engine.cache.trim(&mut seq, 0);
                self.start(job, seq, 0, 0);
            }
            Some(until) => {
                self.quarantine.push((until, seq));
                match self.engine.open_sequence() {
                    Ok(fresh) => self.start(job, fresh, 0, 0),
                    Err(e) => {
                        let _ = job.reply.send(Err(Status::resource_exhausted(e.to_string())));
                    }
                }
            }
        }
    }

    /// Compare what landed in the sequence's pages and slot with the store's checksums.
    fn check_landed(&self, r: &Restoring, sums: &[u64]) -> Result<(), String> {
        let want = r.blocks + usize::from(r.snapshot);
        if sums.len() != want {
            return Err(format!("the store sent {} checksums for {want} records", sums.len()));
        }
        let block = self.engine.cache.layout.block;
        // Where the store wrote: the host mirror (or the CPU engine's own memory), or,
        // when it writes GPU memory in place, the device (summed there).
        let (pages, snapshot) = if self.cfg.paths.kvstore_direct {
            let pages = self.engine.own_checksums(&r.seq, r.blocks * block).pages;
            (pages, r.snapshot.then(|| self.engine.own_snapshot_checksum(&r.seq)))
        } else {
            let bytes = self.engine.sequence_bytes(&r.seq, r.blocks * block).ok_or("KV memory is not readable")?;
            let pages = bytes.pages.iter().map(|p| kv_checksum(p)).collect();
            (pages, r.snapshot.then(|| kv_checksum(&self.engine.host_snapshot(&r.seq).unwrap_or_default())))
        };
        if let Some(i) = pages.iter().zip(sums).position(|(a, b)| a != b) {
            return Err(format!("cached page {i} arrived damaged"));
        }
        if snapshot.is_some_and(|s| s != sums[r.blocks]) {
            return Err("the cached window snapshot arrived damaged".into());
        }
        Ok(())
    }

    /// Release quarantined memory whose fetch deadline passed, and give up on restores
    /// whose report never came.
    pub(super) fn expire_restores(&mut self) {
        let now = Instant::now();
        let (done, kept): (Vec<_>, Vec<_>) = self.quarantine.drain(..).partition(|(until, _)| *until <= now);
        self.quarantine = kept;
        for (_, seq) in done {
            self.engine.release(seq);
        }
        while let Some(i) = self.restoring.iter().position(|r| r.fetch_deadline <= now) {
            let r = self.restoring.remove(i);
            self.cfg.metrics.cache_error("get");
            tracing::warn!(request_id = %r.job.request_id, "the cached prefix did not arrive in time; computing it");
            self.go_cold(r.job, r.seq, Some(now));
        }
    }

    /// When the loop must wake up without a command.
    pub(super) fn next_wake(&self) -> Option<Instant> {
        self.restoring.iter().map(|r| r.fetch_deadline).chain(self.quarantine.iter().map(|(t, _)| *t)).min()
    }

    /// The next block boundary after `from` where the store wants a window snapshot
    /// of this prompt (a chunk must end there).
    pub(super) fn next_snapshot(&self, job: &Job, from: usize) -> Option<usize> {
        self.cfg.cache.as_ref()?;
        let policy = job.prefix.as_ref()?.policy;
        let block = self.engine.cache.layout.block;
        (from / block + 1..=job.tokens.len() / block).find(|&k| policy.snapshots_at(k, block))
    }

    /// After a step: keep the snapshot of a prompt that just reached a boundary the
    /// store wants.
    pub(super) fn take_snapshot(&mut self, i: usize, to: usize) {
        let block = self.engine.cache.layout.block;
        let a = &self.active[i];
        let wanted = self.cfg.cache.is_some()
            && to.is_multiple_of(block)
            && to / block <= a.job.tokens.len() / block
            && a.job.prefix.as_ref().is_some_and(|p| p.policy.snapshots_at(to / block, block));
        if wanted {
            let bytes = self.engine.snapshot(&a.seq);
            self.active[i].snapshots.push((to / block, bytes));
        }
    }
}
