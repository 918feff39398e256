//! What one run of a serving benchmark measured, per request and in summary, with the
//! definitions of vLLM's `benchmark_serving.py` (and SGLang's `bench_serving`, which
//! uses the same ones):
//! - TTFT: request sent → first token event;
//! - ITL: every gap between consecutive token events, pooled over all requests;
//! - TPOT per request: (E2E − TTFT) / (output tokens − 1), requests with > 1 token;
//! - E2E: request sent → final event;
//! - throughputs: totals over the run's duration (first send → last completion);
//! - percentiles: linear interpolation between closest ranks (numpy's default);
//! - prefix-cache hit rate: Σ cached prompt tokens / Σ prompt tokens (router's usage).
//!
//! Pure: tested here.

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// How one request ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Done(Done),
    /// gRPC status code name (or `CLIENT_TIMEOUT`, `CONNECT`, `PROTOCOL`) and message.
    Failed {
        code: String,
        message: String,
    },
}

/// A request that received its final event.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Done {
    pub ttft_s: f64,
    /// Gaps between consecutive token events.
    pub itl_s: Vec<f64>,
    pub e2e_s: f64,
    /// Token events received.
    pub output_tokens: u32,
    /// The final event's usage.
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub completion_tokens: u32,
    /// Whether it ran to max_tokens (finish reason `length`).
    pub finished_by_length: bool,
    /// The router's timings (ms): queue, prefill, KV transfer, TTFT, total, prefix restore.
    pub server_ms: [f64; 6],
}

/// One request of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub index: usize,
    pub prompt_len: usize,
    pub asked_tokens: u32,
    /// Send time from the start of the run (after any wait for a concurrency slot).
    pub sent_s: f64,
    pub outcome: Outcome,
}

/// Mean and percentiles of a sample, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Dist {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Dist {
    /// From values in seconds; all zero when empty.
    pub fn of_seconds(v: &[f64]) -> Dist {
        if v.is_empty() {
            return Dist::default();
        }
        let mut s: Vec<f64> = v.iter().map(|x| x * 1e3).collect();
        s.sort_by(f64::total_cmp);
        Dist {
            mean: s.iter().sum::<f64>() / s.len() as f64,
            p50: percentile(&s, 50.0),
            p90: percentile(&s, 90.0),
            p99: percentile(&s, 99.0),
            max: s[s.len() - 1],
        }
    }

    pub fn json(&self) -> Value {
        json!({"mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99, "max": self.max})
    }
}

/// numpy's default percentile of sorted values: linear between the closest ranks.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let pos = p / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    pub completed: usize,
    pub failed: usize,
    pub failures: BTreeMap<String, usize>,
    /// Completed with fewer tokens than asked (a stop the benchmark did not ask for).
    pub short: usize,
    pub duration_s: f64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    pub request_throughput: f64,
    pub input_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub output_throughput_per_gpu: f64,
    /// Σ E2E / duration: requests in flight on average (SGLang's "concurrency").
    pub concurrency: f64,
    pub hit_rate: f64,
    pub ttft: Dist,
    pub itl: Dist,
    pub tpot: Dist,
    pub e2e: Dist,
    /// Means of the router's own timings (ms): queue, prefix restore, prefill, KV transfer.
    pub server_queue_ms: f64,
    pub server_restore_ms: f64,
    pub server_prefill_ms: f64,
    pub server_kv_transfer_ms: f64,
}

pub fn summarize(records: &[Record], duration_s: f64, gpus: usize) -> Summary {
    let done: Vec<(&Record, &Done)> = records
        .iter()
        .filter_map(|r| match &r.outcome {
            Outcome::Done(d) => Some((r, d)),
            Outcome::Failed { .. } => None,
        })
        .collect();
    let mut failures = BTreeMap::new();
    for r in records {
        if let Outcome::Failed { code, .. } = &r.outcome {
            *failures.entry(code.clone()).or_insert(0) += 1;
        }
    }
    let dur = duration_s.max(1e-9);
    let input_tokens: u64 = done.iter().map(|(_, d)| d.prompt_tokens as u64).sum();
    let output_tokens: u64 = done.iter().map(|(_, d)| d.output_tokens as u64).sum();
    let cached_tokens: u64 = done.iter().map(|(_, d)| d.cached_tokens as u64).sum();
    let ttfts: Vec<f64> = done.iter().map(|(_, d)| d.ttft_s).collect();
    let itls: Vec<f64> = done.iter().flat_map(|(_, d)| d.itl_s.iter().copied()).collect();
    let tpots: Vec<f64> = done
        .iter()
        .filter(|(_, d)| d.output_tokens > 1)
        .map(|(_, d)| (d.e2e_s - d.ttft_s) / (d.output_tokens - 1) as f64)
        .collect();
    let e2es: Vec<f64> = done.iter().map(|(_, d)| d.e2e_s).collect();
    let mean_server = |i: usize| {
        if done.is_empty() { 0.0 } else { done.iter().map(|(_, d)| d.server_ms[i]).sum::<f64>() / done.len() as f64 }
    };
    let output_throughput = output_tokens as f64 / dur;
    Summary {
        completed: done.len(),
        failed: records.len() - done.len(),
        failures,
        short: done.iter().filter(|(r, d)| d.output_tokens < r.asked_tokens).count(),
        duration_s,
        input_tokens,
        output_tokens,
        cached_tokens,
        request_throughput: done.len() as f64 / dur,
        input_throughput: input_tokens as f64 / dur,
        output_throughput,
        total_token_throughput: (input_tokens + output_tokens) as f64 / dur,
        output_throughput_per_gpu: output_throughput / gpus.max(1) as f64,
        concurrency: e2es.iter().sum::<f64>() / dur,
        hit_rate: if input_tokens == 0 { 0.0 } else { cached_tokens as f64 / input_tokens as f64 },
        ttft: Dist::of_seconds(&ttfts),
        itl: Dist::of_seconds(&itls),
        tpot: Dist::of_seconds(&tpots),
        e2e: Dist::of_seconds(&e2es),
        server_queue_ms: mean_server(0),
        server_restore_ms: mean_server(5),
        server_prefill_ms: mean_server(1),
        server_kv_transfer_ms: mean_server(2),
    }
}

impl Summary {
    pub fn json(&self) -> Value {
        json!({
            "completed": self.completed,
            "failed": self.failed,
            "failures": self.failures,
            "short": self.short,
            "duration_s": self.duration_s,
            "total_input_tokens": self.input_tokens,
            "total_output_tokens": self.output_tokens,
            "total_cached_tokens": self.cached_tokens,
            "request_throughput": self.request_throughput,
            "input_throughput": self.input_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "output_throughput_per_gpu": self.output_throughput_per_gpu,
            "concurrency": self.concurrency,
            "prefix_cache_hit_rate": self.hit_rate,
            "ttft_ms": self.ttft.json(),
            "itl_ms": self.itl.json(),
            "tpot_ms": self.tpot.json(),
            "e2e_ms": self.e2e.json(),
            "server_mean_ms": {"queue": self.server_queue_ms, "prefix_restore": self.server_restore_ms,
                               "prefill": self.server_prefill_ms, "kv_transfer": self.server_kv_transfer_ms},
        })
    }
}

impl Record {
    /// Everything measured about the request (the `--json` file's `requests`).
    pub fn json(&self) -> Value {
        let base = json!({"index": self.index, "prompt_len": self.prompt_len, "asked_tokens": self.asked_tokens,
                          "sent_s": self.sent_s});
        let mut v = base;
        match &self.outcome {
            Outcome::Done(d) => {
                let ms = |s: f64| s * 1e3;
                v["ok"] = json!(true);
                v["ttft_ms"] = json!(ms(d.ttft_s));
                v["e2e_ms"] = json!(ms(d.e2e_s));
                v["itl_ms"] = json!(d.itl_s.iter().map(|s| ms(*s)).collect::<Vec<_>>());
                v["output_tokens"] = json!(d.output_tokens);
                v["finish_reason"] = json!(if d.finished_by_length { "length" } else { "stop" });
                v["usage"] = json!({"prompt_tokens": d.prompt_tokens, "cached_tokens": d.cached_tokens,
                                    "completion_tokens": d.completion_tokens});
                let [queue, prefill, kv, ttft, total, restore] = d.server_ms;
                v["server_timings_ms"] = json!({"queue": queue, "prefix_restore": restore, "prefill": prefill,
                                                "kv_transfer": kv, "time_to_first_token": ttft, "total": total});
            }
            Outcome::Failed { code, message } => {
                v["ok"] = json!(false);
                v["error"] = json!({"code": code, "message": message});
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(ttft: f64, itl: &[f64], prompt: u32, cached: u32) -> Outcome {
        Outcome::Done(Done {
            ttft_s: ttft,
            itl_s: itl.to_vec(),
            e2e_s: ttft + itl.iter().sum::<f64>(),
            output_tokens: itl.len() as u32 + 1,
            prompt_tokens: prompt,
            cached_tokens: cached,
            completion_tokens: itl.len() as u32 + 1,
            finished_by_length: true,
            server_ms: [1.0, 2.0, 3.0, 4.0, 5.0, 0.5],
        })
    }

    fn rec(index: usize, asked: u32, outcome: Outcome) -> Record {
        Record { index, prompt_len: 100, asked_tokens: asked, sent_s: 0.0, outcome }
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&[5.0], 99.0), 5.0);
        let d = Dist::of_seconds(&[0.004, 0.001, 0.002, 0.003]);
        assert_eq!((d.mean, d.p50, d.max), (2.5, 2.5, 4.0));
    }

    #[test]
    fn summary_follows_the_serving_benchmarks_definitions() {
        let records = vec![
            rec(0, 3, done(0.1, &[0.02, 0.04], 100, 0)),
            rec(1, 3, done(0.3, &[0.02, 0.02], 300, 256)),
            rec(2, 5, done(0.2, &[], 100, 0)),
            rec(3, 3, Outcome::Failed { code: "Unavailable".into(), message: "x".into() }),
            rec(4, 3, Outcome::Failed { code: "CLIENT_TIMEOUT".into(), message: "y".into() }),
        ];
        let s = summarize(&records, 2.0, 4);
        assert_eq!((s.completed, s.failed, s.short), (3, 2, 1));
        assert_eq!(s.failures.get("Unavailable"), Some(&1));
        assert_eq!((s.input_tokens, s.output_tokens, s.cached_tokens), (500, 7, 256));
        assert_eq!(s.request_throughput, 1.5);
        assert_eq!(s.output_throughput, 3.5);
        assert_eq!(s.output_throughput_per_gpu, 3.5 / 4.0);
        assert_eq!(s.hit_rate, 256.0 / 500.0);
        // ITL pools every gap; TPOT skips the one-token request: (0.06/2, 0.04/2).
        assert!((s.itl.mean - 25.0).abs() < 1e-9 && s.itl.max == 40.0);
        assert!((s.tpot.mean - 25.0).abs() < 1e-9);
        assert!((s.ttft.p50 - 200.0).abs() < 1e-9);
        assert!((s.concurrency - (0.16 + 0.34 + 0.2) / 2.0).abs() < 1e-9);
        let j = s.json();
        for k in ["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "prefix_cache_hit_rate", "output_throughput_per_gpu"] {
            assert!(j.get(k).is_some(), "{k}");
        }
        assert_eq!(records[3].json()["error"]["code"], "Unavailable");
        assert_eq!(records[0].json()["itl_ms"].as_array().unwrap().len(), 2);
        assert_eq!(summarize(&[], 1.0, 1), Summary { duration_s: 1.0, ..Default::default() });
    }
}
