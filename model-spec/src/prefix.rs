//! Prefix caching of sliding-window state: the three SWA policies of DESIGN §6 (what a
//! store keeps besides the compressed pages) and the choice of how to resume a
//! sequence from what a lookup found. Pure logic, shared by the router (placement
//! cost), the prefill worker (what to snapshot, how to restore) and the kvstore (what
//! it accepts).
//!
//! Terms: a prefix of `n` blocks is `n · block` tokens. A *snapshot at boundary k* is
//! the state a sequence carries across the end of block `k - 1` (window rings and CSA
//! compressor slots, `KvLayout::snapshot_bytes`), stored under that block's hash.

use std::fmt;
use std::str::FromStr;

/// What the store keeps of the sliding-window state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SwaPolicy {
    /// A snapshot at every block boundary: a hit restores the window directly.
    Full,
    /// A snapshot every `tokens` tokens (a multiple of the block): a hit restores the
    /// nearest snapshot at or before it and recomputes the gap.
    Periodic { tokens: usize },
    /// No window state: a hit rebuilds each layer's window from the cached compressed
    /// entries by recomputing the last `window · (layers - l)` tokens at layer `l`.
    Zero,
}

impl SwaPolicy {
    /// Whether the state at boundary `k` (after `k` blocks) is stored.
    pub fn snapshots_at(self, k: usize, block: usize) -> bool {
        match self {
            SwaPolicy::Full => k > 0,
            SwaPolicy::Periodic { tokens } => k > 0 && (k * block).is_multiple_of(tokens),
            SwaPolicy::Zero => false,
        }
    }

    /// The `policy` label value of metrics (bounded: three values).
    pub fn label(self) -> &'static str {
        match self {
            SwaPolicy::Full => "full",
            SwaPolicy::Periodic { .. } => "periodic",
            SwaPolicy::Zero => "zero",
        }
    }

    /// Check the policy against the block size it will be used with.
    pub fn validate(self, block: usize) -> Result<(), String> {
        match self {
            SwaPolicy::Periodic { tokens } if tokens == 0 || !tokens.is_multiple_of(block) => {
                Err(format!("periodic:{tokens}: the period must be a positive multiple of the {block}-token block"))
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Display for SwaPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SwaPolicy::Full => write!(f, "full"),
            SwaPolicy::Periodic { tokens } => write!(f, "periodic:{tokens}"),
            SwaPolicy::Zero => write!(f, "zero"),
        }
    }
}

impl FromStr for SwaPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "full" => Ok(SwaPolicy::Full),
            "zero" => Ok(SwaPolicy::Zero),
            _ => {
                let p = s.strip_prefix("periodic:").ok_or_else(|| {
                    format!("unknown SWA policy `{s}`: use full, periodic:P (P a multiple of 128) or zero")
                })?;
                let tokens = p.parse().map_err(|_| format!("periodic:{p}: the period must be a number of tokens"))?;
                Ok(SwaPolicy::Periodic { tokens })
            }
        }
    }
}

/// How to resume a sequence from a prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restore {
    /// Nothing usable: prefill from the start.
    Cold,
    /// Pages of the first `blocks` blocks plus the snapshot at that boundary; the
    /// prompt continues from `blocks · block` (tokens between there and the longest
    /// cached prefix are recomputed by ordinary prefill).
    Snapshot { blocks: usize },
    /// Pages of the first `blocks` blocks; the window is rebuilt from them.
    Rebuild { blocks: usize },
}

/// What a lookup found for a prompt, and the model's shape the choice depends on.
#[derive(Clone, Debug)]
pub struct RestoreInput<'a> {
    /// Leading blocks whose pages are cached.
    pub cached_blocks: usize,
    /// Boundaries (in blocks, ≤ `cached_blocks`) with a stored snapshot.
    pub snapshots: &'a [usize],
    pub block: usize,
    pub window: usize,
    pub layers: usize,
}

/// The chosen restore and what it costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestorePlan {
    pub restore: Restore,
    /// Prompt tokens whose full forward pass is skipped (`usage.cached_tokens`).
    pub cached_tokens: usize,
    /// Tokens computed again to rebuild state the cache did not hold: the gap after a
    /// snapshot, or the tokens whose first-layer input a window rebuild recomputes.
    pub recompute_tokens: usize,
    /// Work in token-layers that restoring costs before ordinary prefill resumes
    /// (what placement and the choice compare).
    pub recompute_cost: usize,
}

impl RestorePlan {
    /// Token-layers the rebuild of a `tokens`-token prefix recomputes: layer `l` needs
    /// its inputs for the last `window · (layers - l)` tokens (its own window, plus
    /// what the later layers' windows attend to).
    pub fn rebuild_cost(tokens: usize, window: usize, layers: usize) -> usize {
        (0..layers).map(|l| tokens.min(window * (layers - l))).sum()
    }

    /// Choose the cheapest exact way to resume from what is cached. A snapshot at
    /// boundary `m` costs recomputing `n - m` blocks through every layer; a rebuild at
    /// `n` costs [`Self::rebuild_cost`]; prefilling the prompt from scratch is the
    /// baseline both must beat.
    pub fn choose(input: &RestoreInput<'_>) -> RestorePlan {
        let RestoreInput { cached_blocks: n, snapshots, block, window, layers } = *input;
        let cold = RestorePlan { restore: Restore::Cold, cached_tokens: 0, recompute_tokens: 0, recompute_cost: 0 };
        if n == 0 {
            return cold;
        }
        let mut best: Option<RestorePlan> = None;
        let mut consider = |p: RestorePlan| {
            if best.is_none_or(|b| p.recompute_cost < b.recompute_cost) {
                best = Some(p);
            }
        };
        if let Some(&m) = snapshots.iter().filter(|&&m| m > 0 && m <= n).max() {
            let gap = (n - m) * block;
            consider(RestorePlan {
                restore: Restore::Snapshot { blocks: m },
                cached_tokens: m * block,
                recompute_tokens: gap,
                recompute_cost: gap * layers,
            });
        }
        let tokens = n * block;
        consider(RestorePlan {
            restore: Restore::Rebuild { blocks: n },
            cached_tokens: tokens,
            recompute_tokens: tokens.min(window * layers),
            recompute_cost: Self::rebuild_cost(tokens, window, layers),
        });
        match best {
            // Recomputing as much as the prefix itself saves nothing over a cold prefill.
            Some(p) if p.recompute_cost < tokens * layers => p,
            _ => cold,
        }
    }
}

/// Blocks of a prompt that can be restored: every complete block except that the last
/// prompt token is always computed (its logits start decoding).
pub fn restorable_blocks(prompt_tokens: usize, block: usize) -> usize {
    prompt_tokens.saturating_sub(1) / block
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(n: usize, snapshots: &[usize], layers: usize) -> RestoreInput<'_> {
        RestoreInput { cached_blocks: n, snapshots, block: 128, window: 128, layers }
    }

    #[test]
    fn policies_parse_print_and_validate() {
        for s in ["full", "zero", "periodic:1024"] {
            assert_eq!(s.parse::<SwaPolicy>().unwrap().to_string(), s);
        }
        assert!("periodic:x".parse::<SwaPolicy>().unwrap_err().contains("number of tokens"));
        assert!("some".parse::<SwaPolicy>().unwrap_err().contains("full, periodic:P"));
        assert!(SwaPolicy::Periodic { tokens: 100 }.validate(128).unwrap_err().contains("multiple of the 128"));
        assert!(SwaPolicy::Periodic { tokens: 0 }.validate(128).is_err());
        assert!(SwaPolicy::Periodic { tokens: 256 }.validate(128).is_ok());
    }

    #[test]
    fn snapshot_boundaries_follow_the_policy() {
        let at = |p: SwaPolicy| (0..10).filter(|&k| p.snapshots_at(k, 128)).collect::<Vec<_>>();
        assert_eq!(at(SwaPolicy::Full), (1..10).collect::<Vec<_>>());
        assert_eq!(at(SwaPolicy::Periodic { tokens: 512 }), vec![4, 8]);
        assert_eq!(at(SwaPolicy::Zero), Vec::<usize>::new());
    }

    #[test]
    fn rebuild_cost_is_bounded_by_window_times_layers_per_layer() {
        // 8 layers, a 32-block prefix: layer l recomputes 128·(8-l) tokens.
        assert_eq!(RestorePlan::rebuild_cost(4096, 128, 8), 128 * (8 + 7 + 6 + 5 + 4 + 3 + 2 + 1));
        // A prefix shorter than the window stack: every layer recomputes all of it,
        // up to its own bound.
        assert_eq!(RestorePlan::rebuild_cost(256, 128, 4), 256 + 256 + 256 + 128);
    }

    #[test]
    fn choice_takes_the_cheapest_exact_restore() {
        // Full: a snapshot at the hit point costs nothing.
        let p = RestorePlan::choose(&input(32, &(1..=32).collect::<Vec<_>>(), 8));
        assert_eq!(p.restore, Restore::Snapshot { blocks: 32 });
        assert_eq!((p.cached_tokens, p.recompute_tokens, p.recompute_cost), (4096, 0, 0));
        // Periodic:1024 and a hit at 30 blocks: the snapshot at 24 leaves 6 blocks to
        // recompute (6·128·8 = 6144) — cheaper than a rebuild (4608)? No: rebuild wins.
        let p = RestorePlan::choose(&input(30, &[8, 16, 24], 8));
        assert_eq!(p.restore, Restore::Rebuild { blocks: 30 });
        assert_eq!(p.recompute_tokens, 1024);
        // ...but a snapshot two blocks back beats a rebuild.
        let p = RestorePlan::choose(&input(26, &[8, 16, 24], 8));
        assert_eq!(p.restore, Restore::Snapshot { blocks: 24 });
        assert_eq!((p.cached_tokens, p.recompute_tokens), (24 * 128, 256));
        // Zero: always a rebuild when it beats a cold prefill.
        let p = RestorePlan::choose(&input(32, &[], 8));
        assert_eq!(p.restore, Restore::Rebuild { blocks: 32 });
        assert_eq!(p.cached_tokens, 4096);
        // A one-block prefix under a deep model: rebuilding it is the whole prefill.
        assert_eq!(RestorePlan::choose(&input(1, &[], 8)).restore, Restore::Cold);
        assert_eq!(RestorePlan::choose(&input(0, &[], 8)).restore, Restore::Cold);
        // Snapshots past the cached pages are unusable.
        assert_eq!(RestorePlan::choose(&input(1, &[2], 8)).restore, Restore::Cold);
        assert_eq!(RestorePlan::choose(&input(1, &[1], 8)).restore, Restore::Snapshot { blocks: 1 });
    }

    #[test]
    fn the_last_prompt_token_is_always_computed() {
        assert_eq!(restorable_blocks(128, 128), 0);
        assert_eq!(restorable_blocks(129, 128), 1);
        assert_eq!(restorable_blocks(256, 128), 1);
        assert_eq!(restorable_blocks(257, 128), 2);
        assert_eq!(restorable_blocks(0, 128), 0);
    }
}
