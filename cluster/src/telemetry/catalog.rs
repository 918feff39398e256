//! The metric set of each service. Each is registered once per process (into the
//! registry `/metrics` serves) and cloned into whatever records it: the handles are
//! atomics behind `Arc`s, so recording never takes a lock.
//!
//! Labelled series are created at registration with all their (bounded) label values,
//! so every series a dashboard or alert queries exists from the first scrape.

use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use super::metrics::{self, ALL_CODES, KV_POOLS, MIGRATION_OUTCOMES, SWA_POLICIES, names, status_label};

/// What the router records: latency as a client sees it, outcomes, token counts.
#[derive(Clone, Debug)]
pub struct RouterMetrics {
    /// Arrival → first token streamed.
    pub ttft: Histogram,
    /// Gap between consecutive streamed tokens.
    pub inter_token: Histogram,
    /// Arrival → final event.
    pub e2e: Histogram,
    /// Arrival → prefill started: router queue plus the prefill worker's queue.
    pub queue: Histogram,
    requests: IntCounterVec,
    pub prompt_tokens: IntCounter,
    pub cached_tokens: IntCounter,
    pub generated_tokens: IntCounter,
    /// Requests in flight at the router.
    pub running: IntGauge,
    workers: IntGaugeVec,
    migrations: IntCounterVec,
}

impl RouterMetrics {
    pub fn new(registry: &Registry) -> Self {
        let requests = metrics::counter_vec(
            registry,
            names::REQUESTS,
            "Requests by outcome (lowercase gRPC status code name).",
            &["status"],
        );
        for code in ALL_CODES {
            requests.with_label_values(&[status_label(code)]);
        }
        let workers = metrics::gauge_vec(
            registry,
            names::ROUTER_WORKERS,
            "Healthy workers the router can place requests on.",
            &["role"],
        );
        for role in ["prefill", "decode"] {
            workers.with_label_values(&[role]);
        }
        let migrations = metrics::counter_vec(
            registry,
            names::ROUTER_MIGRATIONS,
            "Attempts to continue a request on another prefill/decode pair after its decode worker was lost, by outcome.",
            &["outcome"],
        );
        for outcome in MIGRATION_OUTCOMES {
            migrations.with_label_values(&[outcome]);
        }
        RouterMetrics {
            ttft: metrics::histogram(registry, names::REQUEST_TTFT, "Time to first token as the router sees it."),
            inter_token: metrics::histogram(
                registry,
                names::REQUEST_INTER_TOKEN,
                "Gap between consecutive streamed tokens of a request.",
            ),
            e2e: metrics::histogram(registry, names::REQUEST_E2E, "Request arrival to its final event."),
            queue: metrics::histogram(
                registry,
                names::REQUEST_QUEUE,
                "Request arrival to prefill start (router queue plus prefill worker queue).",
            ),
            requests,
            prompt_tokens: metrics::counter(registry, names::PROMPT_TOKENS, "Prompt tokens of prefilled requests."),
            cached_tokens: metrics::counter(
                registry,
                names::CACHED_TOKENS,
                "Prompt tokens served from the prefix cache instead of computed.",
            ),
            generated_tokens: metrics::counter(registry, names::GENERATED_TOKENS, "Tokens streamed to clients."),
            running: metrics::gauge(registry, names::REQUESTS_RUNNING, "Requests in flight at the router."),
            workers,
            migrations,
        }
    }

    /// Count a request's outcome.
    pub fn outcome(&self, code: tonic::Code) {
        self.requests.with_label_values(&[status_label(code)]).inc();
    }

    /// Count a migration attempt; `outcome` is one of [`MIGRATION_OUTCOMES`].
    pub fn migration(&self, outcome: &str) {
        debug_assert!(MIGRATION_OUTCOMES.contains(&outcome), "{outcome}");
        self.migrations.with_label_values(&[outcome]).inc();
    }

    pub fn set_workers(&self, prefill: usize, decode: usize) {
        self.workers.with_label_values(&["prefill"]).set(prefill as i64);
        self.workers.with_label_values(&["decode"]).set(decode as i64);
    }
}

/// What a prefill worker records.
#[derive(Clone, Debug)]
pub struct PrefillMetrics {
    /// Prompt tokens computed.
    pub tokens: IntCounter,
    pub waiting: IntGauge,
    pub running: IntGauge,
    cache_query: IntCounterVec,
    cache_hit: IntCounterVec,
    pub transfer_bytes: IntCounter,
    pub transfer_seconds: Histogram,
    pub pages_used: IntGauge,
    pub pages_total: IntGauge,
    recompute: IntCounterVec,
    /// Time from a prompt's admission to its restored prefix being usable.
    pub restore_seconds: Histogram,
    cache_errors: IntCounterVec,
    /// Record bytes written into the kvstore.
    pub put_bytes: IntCounter,
    kv_path: IntGaugeVec,
}

impl PrefillMetrics {
    pub fn new(registry: &Registry) -> Self {
        let cache_query = metrics::counter_vec(
            registry,
            names::PREFIX_CACHE_QUERY,
            "Prompt tokens looked up in the prefix cache, per KV pool.",
            &["pool"],
        );
        let cache_hit = metrics::counter_vec(
            registry,
            names::PREFIX_CACHE_HIT,
            "Prompt tokens found in the prefix cache, per KV pool.",
            &["pool"],
        );
        for pool in KV_POOLS {
            cache_query.with_label_values(&[pool]);
            cache_hit.with_label_values(&[pool]);
        }
        let recompute = metrics::counter_vec(
            registry,
            names::PREFIX_CACHE_RECOMPUTE,
            "Tokens recomputed to rebuild window state a prefix hit did not restore, per SWA policy.",
            &["policy"],
        );
        for p in SWA_POLICIES {
            recompute.with_label_values(&[p]);
        }
        let cache_errors = metrics::counter_vec(
            registry,
            names::PREFIX_CACHE_ERRORS,
            "Prefix-cache calls that failed (the store unreachable, slow or missing a record); prefill went on cold.",
            &["op"],
        );
        for op in ["lookup", "get", "put"] {
            cache_errors.with_label_values(&[op]);
        }
        PrefillMetrics {
            tokens: metrics::counter(registry, names::PREFILL_TOKENS, "Prompt tokens computed."),
            waiting: metrics::gauge(registry, names::PREFILL_WAITING, "Prompts queued, not started."),
            running: metrics::gauge(registry, names::PREFILL_RUNNING, "Prompts being prefilled."),
            cache_query,
            cache_hit,
            transfer_bytes: metrics::counter(
                registry,
                names::KV_TRANSFER_BYTES,
                "KV bytes written into decode workers.",
            ),
            transfer_seconds: metrics::histogram(
                registry,
                names::KV_TRANSFER_SECONDS,
                "Time to write one prompt's KV into its decode worker.",
            ),
            pages_used: metrics::gauge(registry, names::KV_PAGES_USED, "KV pages in use."),
            pages_total: metrics::gauge(registry, names::KV_PAGES_TOTAL, "KV pages in the pool."),
            recompute,
            restore_seconds: metrics::histogram(
                registry,
                names::PREFIX_CACHE_RESTORE,
                "Time to restore a cached prefix (fetch, check, and any window rebuild).",
            ),
            cache_errors,
            put_bytes: metrics::counter(
                registry,
                names::PREFIX_CACHE_PUT_BYTES,
                "Record bytes written into the prefix cache.",
            ),
            kv_path: kv_path_gauge(registry),
        }
    }

    /// The path peers reach this worker's KV memory by (one of [`metrics::KV_MEMORY_PATHS`]).
    pub fn set_kv_path(&self, path: &str) {
        set_kv_path(&self.kv_path, path);
    }

    /// A prompt's prefix-cache lookup in one pool: `query` tokens asked for, `hit` found.
    pub fn prefix_lookup(&self, pool: &str, query: u64, hit: u64) {
        self.cache_query.with_label_values(&[pool]).inc_by(query);
        self.cache_hit.with_label_values(&[pool]).inc_by(hit);
    }

    /// Tokens recomputed under `policy` (its `SwaPolicy::label`).
    pub fn recomputed(&self, policy: &str, tokens: u64) {
        self.recompute.with_label_values(&[policy]).inc_by(tokens);
    }

    /// A failed prefix-cache call (`lookup`, `get` or `put`).
    pub fn cache_error(&self, op: &str) {
        self.cache_errors.with_label_values(&[op]).inc();
    }
}

/// What a decode worker records.
#[derive(Clone, Debug)]
pub struct DecodeMetrics {
    /// Tokens sampled and streamed.
    pub tokens: IntCounter,
    pub step_seconds: Histogram,
    pub running: IntGauge,
    pub waiting: IntGauge,
    pub pages_used: IntGauge,
    pub pages_total: IntGauge,
    pub slots_used: IntGauge,
    pub slots_total: IntGauge,
    /// 1 while a GPU engine's decode steps replay as CUDA graphs.
    pub cuda_graphs_on: IntGauge,
    /// Captures the driver refused (each turns graphs off for that GPU).
    pub graph_captures_refused: IntCounter,
    commits_refused: IntCounterVec,
    kv_path: IntGaugeVec,
}

impl DecodeMetrics {
    pub fn new(registry: &Registry) -> Self {
        let commits_refused = metrics::counter_vec(
            registry,
            names::KV_COMMITS_REFUSED,
            "KV commits refused, never decoded, by reason (checksum, lease).",
            &["reason"],
        );
        for r in metrics::COMMIT_REFUSALS {
            commits_refused.with_label_values(&[r]);
        }
        DecodeMetrics {
            commits_refused,
            kv_path: kv_path_gauge(registry),
            tokens: metrics::counter(registry, names::DECODE_TOKENS, "Tokens decoded."),
            step_seconds: metrics::histogram(registry, names::DECODE_STEP, "Time of one decode step of the batch."),
            running: metrics::gauge(registry, names::DECODE_RUNNING, "Requests in the running batch."),
            waiting: metrics::gauge(
                registry,
                names::DECODE_WAITING,
                "Committed requests waiting for room in the batch.",
            ),
            pages_used: metrics::gauge(
                registry,
                names::KV_PAGES_USED,
                "KV pages in use (reserved, being written, or decoding).",
            ),
            pages_total: metrics::gauge(registry, names::KV_PAGES_TOTAL, "KV pages in the pool."),
            slots_used: metrics::gauge(registry, names::KV_STATE_SLOTS_USED, "State-cache slots in use."),
            slots_total: metrics::gauge(registry, names::KV_STATE_SLOTS_TOTAL, "State-cache slots."),
            cuda_graphs_on: metrics::gauge(
                registry,
                names::DECODE_CUDA_GRAPHS_ON,
                "1 while decode steps replay as CUDA graphs (GPU engines; 0 on CPUs, when switched off, or after a \
                 refused capture).",
            ),
            graph_captures_refused: metrics::counter(
                registry,
                names::DECODE_GRAPH_CAPTURES_REFUSED,
                "CUDA-graph captures the driver refused; each turns graphs off for that GPU.",
            ),
        }
    }

    /// A GPU engine's graph state (`on`, and its captures refused so far, which only grow).
    pub fn set_graphs(&self, on: bool, refused: u64) {
        self.cuda_graphs_on.set(i64::from(on));
        let seen = self.graph_captures_refused.get();
        if refused > seen {
            self.graph_captures_refused.inc_by(refused - seen);
        }
    }

    /// A refused commit; `reason` is one of [`metrics::COMMIT_REFUSALS`].
    pub fn commit_refused(&self, reason: &str) {
        debug_assert!(metrics::COMMIT_REFUSALS.contains(&reason), "{reason}");
        self.commits_refused.with_label_values(&[reason]).inc();
    }

    /// The path peers reach this worker's KV memory by (one of [`metrics::KV_MEMORY_PATHS`]).
    pub fn set_kv_path(&self, path: &str) {
        set_kv_path(&self.kv_path, path);
    }
}

fn kv_path_gauge(registry: &Registry) -> IntGaugeVec {
    let g = metrics::gauge_vec(
        registry,
        names::KV_MEMORY_PATH,
        "1 for how peers reach this worker's KV memory (GPU memory in place, registered host memory, or a host \
         mirror of GPU memory).",
        &["path"],
    );
    for p in metrics::KV_MEMORY_PATHS {
        g.with_label_values(&[p]);
    }
    g
}

fn set_kv_path(g: &IntGaugeVec, path: &str) {
    debug_assert!(metrics::KV_MEMORY_PATHS.contains(&path), "{path}");
    for p in metrics::KV_MEMORY_PATHS {
        g.with_label_values(&[p]).set(i64::from(p == path));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::metrics::{encode, registry};

    /// Every name a dashboard queries is in the exposition from the first scrape.
    #[test]
    fn every_metric_is_exposed_from_the_start() {
        let r = registry("router");
        let m = RouterMetrics::new(&r);
        m.outcome(tonic::Code::InvalidArgument);
        m.set_workers(2, 3);
        m.migration("resumed");
        let text = encode(&r);
        for name in [
            names::REQUEST_TTFT,
            names::REQUEST_INTER_TOKEN,
            names::REQUEST_E2E,
            names::REQUEST_QUEUE,
            names::REQUESTS,
            names::PROMPT_TOKENS,
            names::CACHED_TOKENS,
            names::GENERATED_TOKENS,
            names::REQUESTS_RUNNING,
            names::ROUTER_WORKERS,
            names::ROUTER_MIGRATIONS,
        ] {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing:\n{text}");
        }
        assert!(text.contains(r#"sluice_requests_total{status="invalid_argument"} 1"#), "{text}");
        assert!(text.contains(r#"sluice_requests_total{status="data_loss"} 0"#), "{text}");
        assert!(text.contains(r#"sluice_router_workers{role="decode"} 3"#), "{text}");
        assert!(text.contains(r#"sluice_router_migrations_total{outcome="resumed"} 1"#), "{text}");
        assert!(text.contains(r#"sluice_router_migrations_total{outcome="failed"} 0"#), "{text}");
        assert!(text.contains(r#"sluice_request_ttft_seconds_bucket{le="600"} 0"#), "{text}");
        assert!(
            text.contains(&format!(
                r#"sluice_build_info{{service="router",version="{}"}} 1"#,
                env!("CARGO_PKG_VERSION")
            ))
        );

        let r = registry("prefill-worker");
        let m = PrefillMetrics::new(&r);
        m.prefix_lookup("hca", 7, 0);
        m.set_kv_path("mirror");
        let text = encode(&r);
        for name in [
            names::PREFILL_TOKENS,
            names::PREFILL_WAITING,
            names::PREFILL_RUNNING,
            names::PREFIX_CACHE_QUERY,
            names::PREFIX_CACHE_HIT,
            names::KV_TRANSFER_BYTES,
            names::KV_TRANSFER_SECONDS,
            names::KV_PAGES_USED,
            names::KV_PAGES_TOTAL,
        ] {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing:\n{text}");
        }
        for pool in KV_POOLS {
            assert!(text.contains(&format!(r#"sluice_prefix_cache_hit_tokens_total{{pool="{pool}"}} 0"#)), "{text}");
        }
        assert!(text.contains(r#"sluice_prefix_cache_query_tokens_total{pool="hca"} 7"#), "{text}");
        assert!(text.contains(r#"sluice_kv_memory_path{path="mirror"} 1"#), "{text}");
        assert!(text.contains(r#"sluice_kv_memory_path{path="registered"} 0"#), "{text}");
        assert!(text.contains(r#"sluice_kv_memory_path{path="mirror_pageable"} 0"#), "{text}");

        let r = registry("decode-worker");
        let m = DecodeMetrics::new(&r);
        m.commit_refused("lease");
        m.set_graphs(true, 0);
        m.set_graphs(false, 2);
        m.set_graphs(false, 2);
        let text = encode(&r);
        assert!(text.contains("sluice_decode_cuda_graphs_on 0"), "{text}");
        assert!(
            text.contains("sluice_decode_cuda_graph_captures_refused_total 2"),
            "the count follows, not adds: {text}"
        );
        assert!(text.contains(r#"sluice_kv_commits_refused_total{reason="lease"} 1"#), "{text}");
        assert!(text.contains(r#"sluice_kv_commits_refused_total{reason="checksum"} 0"#), "{text}");
        for name in [
            names::DECODE_TOKENS,
            names::DECODE_STEP,
            names::DECODE_RUNNING,
            names::DECODE_WAITING,
            names::KV_PAGES_USED,
            names::KV_PAGES_TOTAL,
            names::KV_STATE_SLOTS_USED,
            names::KV_STATE_SLOTS_TOTAL,
            names::KV_COMMITS_REFUSED,
            names::DECODE_CUDA_GRAPHS_ON,
            names::DECODE_GRAPH_CAPTURES_REFUSED,
        ] {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing:\n{text}");
        }
    }

    #[test]
    fn latency_histograms_use_the_shared_buckets() {
        let r = registry("decode-worker");
        let m = DecodeMetrics::new(&r);
        m.step_seconds.observe(0.003);
        let text = encode(&r);
        let les: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("sluice_decode_step_seconds_bucket"))
            .filter_map(|l| l.split("le=\"").nth(1)?.split('"').next())
            .collect();
        let want: Vec<String> =
            LATENCY_BUCKETS_TEXT.iter().map(|s| s.to_string()).chain(["+Inf".to_string()]).collect();
        assert_eq!(les, want);
        assert!(text.contains(r#"sluice_decode_step_seconds_bucket{le="0.0025"} 0"#));
        assert!(text.contains(r#"sluice_decode_step_seconds_bucket{le="0.005"} 1"#));
    }

    const LATENCY_BUCKETS_TEXT: [&str; 18] = [
        "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "5", "10", "30", "60",
        "120", "300", "600",
    ];
}
