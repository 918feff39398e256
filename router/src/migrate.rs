//! Request migration, the pure part: when a decode worker is lost mid-stream, the
//! request continues on another (prefill, decode) pair. The new pair prefills the
//! client's prompt followed by every token already streamed, and the new decode worker
//! resumes after them (`DecodeRequest.resumed_tokens`: event indices, the seeded RNG's
//! position and the grammar continue), so the client sees one uninterrupted stream: no
//! token twice, none missing. Text state (detokenizer, held-back stop strings) never
//! leaves the router, so it carries over untouched (`relay`).
//!
//! Which failures are a lost decode worker, what the next leg asks for, and how many
//! migrations a request may use are decided here; `orchestrate` runs the attempts.

use std::time::Duration;

use tonic::Code;

use crate::validate::Validated;

/// `sluice_router_migrations_total{outcome}`: the re-prefill committed on another pair
/// and decoding continued there, or the attempt failed (no pair could take it, the
/// re-prefill failed, or it ran past `--migration-timeout-s`).
pub const RESUMED: &str = "resumed";
pub const FAILED: &str = "failed";

/// How far migration goes for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MigrationLimits {
    /// Migration attempts per request (0: a lost decode worker fails the stream).
    pub attempts: u32,
    /// Longest one attempt may take, from the loss to the re-prefill's commit.
    pub attempt_timeout: Duration,
}

/// Whether a decode stream that ended with `code` lost its decode worker (it died, was
/// cut off, or failed internally), so the request may continue elsewhere. Answers about
/// the request itself (invalid input, a refused grammar's replay, a full worker before
/// anything was sent) are not losses: another worker would answer the same.
pub fn lost_decode(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::Unknown
            | Code::Internal
            | Code::Cancelled
            | Code::Aborted
            | Code::DataLoss
            | Code::DeadlineExceeded
            | Code::NotFound
    )
}

/// What one (prefill, decode) pair is asked to do for a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leg {
    /// Tokens to prefill: the client's prompt, then (after a migration) what was streamed.
    pub tokens: Vec<u32>,
    /// Tokens the decode worker may still produce.
    pub max_tokens: u32,
    /// Tokens already streamed to the client, which the decode worker resumes after.
    pub resumed: Vec<u32>,
}

impl Leg {
    /// The request as it arrived.
    pub fn first(req: &Validated) -> Leg {
        Leg { tokens: req.prompt.clone(), max_tokens: req.max_tokens, resumed: Vec::new() }
    }

    /// The rest of the request after `emitted` tokens were streamed; `None` when nothing
    /// is left to produce (the stream would already have finished).
    pub fn after(req: &Validated, emitted: &[u32]) -> Option<Leg> {
        let max_tokens = req.max_tokens.checked_sub(emitted.len() as u32).filter(|&n| n > 0)?;
        let tokens = req.prompt.iter().chain(emitted).copied().collect();
        Some(Leg { tokens, max_tokens, resumed: emitted.to_vec() })
    }
}

/// The migrations one request may still use.
#[derive(Debug)]
pub struct Budget {
    left: u32,
    used: u32,
}

impl Budget {
    pub fn new(limits: &MigrationLimits) -> Self {
        Budget { left: limits.attempts, used: 0 }
    }

    /// Take one attempt; `None` when none is left, else its number (1-based).
    pub fn take(&mut self) -> Option<u32> {
        self.left = self.left.checked_sub(1)?;
        self.used += 1;
        Some(self.used)
    }

    pub fn used(&self) -> u32 {
        self.used
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::Sampling;

    fn request(prompt: Vec<u32>, max_tokens: u32) -> Validated {
        Validated {
            request_id: "r".into(),
            prompt,
            max_tokens,
            sampling: Sampling { temperature: 0.0, top_p: 1.0, top_k: 0, seed: None, logprobs: false, top_logprobs: 0 },
            stop_ids: vec![],
            stop_strings: vec![],
            constraint: None,
        }
    }

    #[test]
    fn a_resumed_leg_prefills_prompt_and_streamed_tokens_for_what_is_left() {
        let req = request(vec![5, 6, 7], 10);
        assert_eq!(Leg::first(&req), Leg { tokens: vec![5, 6, 7], max_tokens: 10, resumed: vec![] });
        let leg = Leg::after(&req, &[40, 41, 42, 43]).expect("six tokens left");
        assert_eq!(leg.tokens, vec![5, 6, 7, 40, 41, 42, 43]);
        assert_eq!(leg.max_tokens, 6);
        assert_eq!(leg.resumed, vec![40, 41, 42, 43]);
        // Prompt + budget is what the first leg reserved, so a worker that took the
        // request takes the migrated one.
        assert_eq!(leg.tokens.len() as u32 + leg.max_tokens, 3 + 10);
        assert_eq!(Leg::after(&req, &[]), Some(Leg::first(&req)), "lost before the first token: a plain retry");
        assert_eq!(Leg::after(&req, &[1; 10]), None, "nothing left to produce");
    }

    #[test]
    fn the_budget_runs_out_after_the_limit() {
        let limits = |attempts| MigrationLimits { attempts, attempt_timeout: Duration::from_secs(1) };
        let mut b = Budget::new(&limits(2));
        assert_eq!((b.take(), b.take(), b.take()), (Some(1), Some(2), None));
        assert_eq!(b.used(), 2);
        let mut off = Budget::new(&limits(0));
        assert_eq!(off.take(), None, "--migration-limit 0 turns migration off");
        assert_eq!(off.used(), 0);
    }

    #[test]
    fn outcomes_are_the_metric_label_values() {
        use cluster::telemetry::metrics::MIGRATION_OUTCOMES;
        assert_eq!(MIGRATION_OUTCOMES, [RESUMED, FAILED]);
    }

    #[test]
    fn only_a_lost_worker_is_migrated() {
        for code in [Code::Unavailable, Code::Unknown, Code::Internal, Code::Cancelled, Code::DataLoss] {
            assert!(lost_decode(code), "{code:?}");
        }
        for code in [Code::InvalidArgument, Code::FailedPrecondition, Code::ResourceExhausted, Code::PermissionDenied] {
            assert!(!lost_decode(code), "{code:?}");
        }
    }
}
