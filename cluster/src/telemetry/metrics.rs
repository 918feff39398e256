//! The Prometheus side of telemetry: one registry per process, the metric names (the
//! contract with the Grafana dashboards and alert rules in deploy/), the shared latency
//! buckets, and `sluice_build_info`.
//!
//! Names follow Prometheus conventions (DESIGN §9): prefix `sluice_`, unit suffix,
//! `_total` on counters, bounded label values. docs/metrics.md lists every one.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// Buckets (seconds) of every latency histogram: from a millisecond (a decode step on
/// a GPU) to ten minutes (the default request timeout).
pub const LATENCY_BUCKETS: [f64; 18] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0];

/// Every metric name, in one place.
pub mod names {
    // Every process.
    pub const BUILD_INFO: &str = "sluice_build_info";

    // Router.
    pub const REQUEST_TTFT: &str = "sluice_request_ttft_seconds";
    pub const REQUEST_INTER_TOKEN: &str = "sluice_request_inter_token_latency_seconds";
    pub const REQUEST_E2E: &str = "sluice_request_e2e_seconds";
    pub const REQUEST_QUEUE: &str = "sluice_request_queue_seconds";
    pub const REQUESTS: &str = "sluice_requests_total";
    pub const PROMPT_TOKENS: &str = "sluice_prompt_tokens_total";
    pub const CACHED_TOKENS: &str = "sluice_cached_tokens_total";
    pub const GENERATED_TOKENS: &str = "sluice_generated_tokens_total";
    pub const REQUESTS_RUNNING: &str = "sluice_requests_running";
    pub const ROUTER_WORKERS: &str = "sluice_router_workers";
    pub const ROUTER_MIGRATIONS: &str = "sluice_router_migrations_total";

    // Prefill worker.
    pub const PREFILL_TOKENS: &str = "sluice_prefill_tokens_total";
    pub const PREFILL_WAITING: &str = "sluice_prefill_requests_waiting";
    pub const PREFILL_RUNNING: &str = "sluice_prefill_requests_running";
    pub const PREFIX_CACHE_QUERY: &str = "sluice_prefix_cache_query_tokens_total";
    pub const PREFIX_CACHE_HIT: &str = "sluice_prefix_cache_hit_tokens_total";
    pub const KV_TRANSFER_BYTES: &str = "sluice_kv_transfer_bytes_total";
    pub const KV_TRANSFER_SECONDS: &str = "sluice_kv_transfer_seconds";

    // Decode worker.
    pub const DECODE_TOKENS: &str = "sluice_decode_tokens_total";
    pub const DECODE_STEP: &str = "sluice_decode_step_seconds";
    pub const DECODE_RUNNING: &str = "sluice_decode_requests_running";
    pub const DECODE_WAITING: &str = "sluice_decode_requests_waiting";
    pub const KV_COMMITS_REFUSED: &str = "sluice_kv_commits_refused_total";
    pub const DECODE_CUDA_GRAPHS_ON: &str = "sluice_decode_cuda_graphs_on";
    pub const DECODE_GRAPH_CAPTURES_REFUSED: &str = "sluice_decode_cuda_graph_captures_refused_total";

    // Prefix cache, as prefill workers use it.
    pub const PREFIX_CACHE_RECOMPUTE: &str = "sluice_prefix_cache_recompute_tokens_total";
    pub const PREFIX_CACHE_RESTORE: &str = "sluice_prefix_cache_restore_seconds";
    pub const PREFIX_CACHE_ERRORS: &str = "sluice_prefix_cache_errors_total";
    pub const PREFIX_CACHE_PUT_BYTES: &str = "sluice_prefix_cache_put_bytes_total";

    // kvstore.
    pub const KVSTORE_LOOKUPS: &str = "sluice_kvstore_lookups_total";
    pub const KVSTORE_QUERY_TOKENS: &str = "sluice_kvstore_query_tokens_total";
    pub const KVSTORE_HIT_TOKENS: &str = "sluice_kvstore_hit_tokens_total";
    pub const KVSTORE_MISS_TOKENS: &str = "sluice_kvstore_miss_tokens_total";
    pub const KVSTORE_READ_BYTES: &str = "sluice_kvstore_read_bytes_total";
    pub const KVSTORE_WRITTEN_BYTES: &str = "sluice_kvstore_written_bytes_total";
    pub const KVSTORE_ENTRIES: &str = "sluice_kvstore_entries";
    pub const KVSTORE_STORED_BYTES: &str = "sluice_kvstore_stored_bytes";
    pub const KVSTORE_EVICTIONS: &str = "sluice_kvstore_evictions_total";
    pub const KVSTORE_DISK_BYTES: &str = "sluice_kvstore_disk_bytes";
    pub const KVSTORE_CAPACITY_BYTES: &str = "sluice_kvstore_capacity_bytes";
    pub const KVSTORE_QUEUE_RECORDS: &str = "sluice_kvstore_put_queue_records";
    pub const KVSTORE_QUEUE_BYTES: &str = "sluice_kvstore_put_queue_bytes";
    pub const KVSTORE_DROPPED: &str = "sluice_kvstore_put_dropped_total";
    pub const KVSTORE_WRITE_ERRORS: &str = "sluice_kvstore_write_errors_total";
    pub const KVSTORE_CORRUPT: &str = "sluice_kvstore_corrupt_records_total";
    pub const KVSTORE_GET_SECONDS: &str = "sluice_kvstore_get_seconds";

    // KV memory (prefill and decode workers).
    pub const KV_PAGES_USED: &str = "sluice_kv_pages_used";
    pub const KV_PAGES_TOTAL: &str = "sluice_kv_pages_total";
    pub const KV_STATE_SLOTS_USED: &str = "sluice_kv_state_slots_used";
    pub const KV_STATE_SLOTS_TOTAL: &str = "sluice_kv_state_slots_total";
    pub const KV_MEMORY_PATH: &str = "sluice_kv_memory_path";
}

/// The KV pools of a DeepSeek-V4 cache, as the `pool` label spells them.
pub const KV_POOLS: [&str; 4] = ["csa_main", "csa_indexer", "hca", "swa"];

/// Why a kvstore dropped an offered record, as the `reason` label spells it (`lease`: the
/// put's lease ended before its commit).
pub const DROP_REASONS: [&str; 6] = ["queue_full", "staging_full", "no_room", "checksum", "too_large", "lease"];

/// Why a decode worker refused a KV commit, as the `reason` label spells it: `checksum`
/// (the bytes that landed differ from those sent), `lease` (no live reservation by that
/// id: its lease ended, it was used or given back, or it never existed).
pub const COMMIT_REFUSALS: [&str; 2] = ["checksum", "lease"];

/// How peers reach a worker's KV memory, as the `path` label of `sluice_kv_memory_path`
/// spells it (1 for the worker's path, 0 for the others): `device` (GPU KV registered
/// with a CUDA-enabled UCX and reached in place: GPU-direct), `device_send` (a prefill
/// worker that sends to decode workers from GPU memory but stages kvstore traffic
/// through a host mirror), `registered` (the engine's KV is the UCX-registered host
/// memory itself: CPU engines), `mirror` (GPU KV staged through a registered host mirror
/// pinned for the device), `mirror_pageable` (the same, but the driver refused to pin
/// it: copies at pageable speed).
pub const KV_MEMORY_PATHS: [&str; 5] = ["device", "device_send", "registered", "mirror", "mirror_pageable"];

/// How a request migration attempt ended, as the `outcome` label spells it: `resumed`
/// (another pair re-prefilled and decoding went on) or `failed`.
pub const MIGRATION_OUTCOMES: [&str; 2] = ["resumed", "failed"];

/// SWA policies, as the `policy` label spells them.
pub const SWA_POLICIES: [&str; 3] = ["full", "periodic", "zero"];

/// A registry for one process, holding `sluice_build_info{version, service} 1`.
pub fn registry(service: &str) -> Registry {
    let registry = Registry::new();
    let info = gauge_vec(&registry, names::BUILD_INFO, "Build of this process (always 1).", &["version", "service"]);
    info.with_label_values(&[env!("CARGO_PKG_VERSION"), service]).set(1);
    registry
}

/// The lowercase gRPC code name, as the `status` label spells it.
pub fn status_label(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "ok",
        Cancelled => "cancelled",
        Unknown => "unknown",
        InvalidArgument => "invalid_argument",
        DeadlineExceeded => "deadline_exceeded",
        NotFound => "not_found",
        AlreadyExists => "already_exists",
        PermissionDenied => "permission_denied",
        ResourceExhausted => "resource_exhausted",
        FailedPrecondition => "failed_precondition",
        Aborted => "aborted",
        OutOfRange => "out_of_range",
        Unimplemented => "unimplemented",
        Internal => "internal",
        Unavailable => "unavailable",
        DataLoss => "data_loss",
        Unauthenticated => "unauthenticated",
    }
}

/// Every gRPC code, so outcome counters can start at 0 for each (a rate over a series
/// that appears only with its first error is wrong for a scrape interval).
pub const ALL_CODES: [tonic::Code; 17] = {
    use tonic::Code::*;
    [
        Ok,
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    ]
};

/// The text exposition of everything in `registry`.
pub fn encode(registry: &Registry) -> String {
    prometheus::TextEncoder::new().encode_to_string(&registry.gather()).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot encode metrics");
        String::new()
    })
}

// Registration helpers. Names and label sets are fixed at compile time, so a failure
// to register is a programming error (a duplicate name) and panics at startup.

fn register<T: prometheus::core::Collector + Clone + 'static>(registry: &Registry, m: T) -> T {
    registry.register(Box::new(m.clone())).expect("metric names are unique per registry");
    m
}

pub fn histogram(registry: &Registry, name: &str, help: &str) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec());
    register(registry, Histogram::with_opts(opts).expect("valid histogram"))
}

pub fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    register(registry, IntCounter::new(name, help).expect("valid counter"))
}

pub fn counter_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register(registry, IntCounterVec::new(Opts::new(name, help), labels).expect("valid counter"))
}

pub fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    register(registry, IntGauge::new(name, help).expect("valid gauge"))
}

pub fn gauge_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    register(registry, IntGaugeVec::new(Opts::new(name, help), labels).expect("valid gauge"))
}
