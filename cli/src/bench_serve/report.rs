//! The table a sweep prints (one row per request rate) and its `--json` document.

use serde_json::{Value, json};

use super::stats::{Record, Summary};
use super::workload::Rate;

/// One rate of a sweep: what was measured.
pub struct RateRun {
    pub rate: Rate,
    pub seed: u64,
    pub summary: Summary,
    pub records: Vec<Record>,
}

/// A Markdown table, one row per rate (docs/serving-bench.md explains the columns).
pub fn table(runs: &[RateRun]) -> String {
    let mut out = String::from(
        "| rate (req/s) | ok / failed | req/s | out tok/s | out tok/s/GPU | TTFT mean / p50 / p99 (ms) | ITL mean / p50 / p99 (ms) | TPOT mean (ms) | E2E p50 / p99 (ms) | prefix hit rate |\n\
         |---|---|---:|---:|---:|---|---|---:|---|---:|\n",
    );
    for r in runs {
        let s = &r.summary;
        out += &format!(
            "| {} | {} / {} | {:.2} | {:.1} | {:.1} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} / {:.1} | {:.1} | {:.0} / {:.0} | {:.1}% |\n",
            r.rate,
            s.completed,
            s.failed,
            s.request_throughput,
            s.output_throughput,
            s.output_throughput_per_gpu,
            s.ttft.mean,
            s.ttft.p50,
            s.ttft.p99,
            s.itl.mean,
            s.itl.p50,
            s.itl.p99,
            s.tpot.mean,
            s.e2e.p50,
            s.e2e.p99,
            s.hit_rate * 100.0
        );
    }
    out
}

/// Where the time to first token went, per rate (the servers' own timings, means over
/// completed requests): the prefill worker's queue, the prefix restore, the prefill
/// compute and the KV transfer.
pub fn ttft_breakdown(runs: &[RateRun]) -> String {
    let mut out = String::from(
        "| rate (req/s) | TTFT mean (ms) | queue | prefix restore | prefill | KV transfer |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for r in runs {
        let s = &r.summary;
        out += &format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |\n",
            r.rate, s.ttft.mean, s.server_queue_ms, s.server_restore_ms, s.server_prefill_ms, s.server_kv_transfer_ms
        );
    }
    out
}

/// What went wrong, per rate that had failures or short completions (empty if none).
pub fn problems(runs: &[RateRun]) -> String {
    let mut out = String::new();
    for r in runs.iter().filter(|r| r.summary.failed > 0 || r.summary.short > 0) {
        let codes: Vec<String> = r.summary.failures.iter().map(|(c, n)| format!("{c} ×{n}")).collect();
        out += &format!("rate {}: {} failed ({})", r.rate, r.summary.failed, codes.join(", "));
        if let Some(first) = r.records.iter().find_map(|x| match &x.outcome {
            super::stats::Outcome::Failed { code, message } => Some(format!("{code}: {message}")),
            _ => None,
        }) {
            out += &format!("; first: {first}");
        }
        if r.summary.short > 0 {
            out += &format!("; {} finished before max_tokens", r.summary.short);
        }
        out.push('\n');
    }
    out
}

/// The whole sweep: `config` (what was asked) and per rate the summary and every request.
pub fn document(config: Value, runs: &[RateRun]) -> Value {
    let runs: Vec<Value> = runs
        .iter()
        .map(|r| {
            json!({
                "request_rate": r.rate.json(),
                "request_rate_label": r.rate.to_string(),
                "seed": r.seed,
                "summary": r.summary.json(),
                "requests": r.records.iter().map(Record::json).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({"benchmark": "sluice bench serve", "config": config, "runs": runs})
}
