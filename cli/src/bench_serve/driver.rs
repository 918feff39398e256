//! Sending a run's requests to the router on their schedule and timing each one's
//! stream of token events. Thin: what is sent is `workload`'s, what the numbers mean is
//! `stats`'.
//!
//! A request's clock starts when it is sent: after its arrival time and, with
//! `--max-concurrency`, after a slot is free (as vLLM's semaphore does), so TTFT is the
//! server's and not the client's queue. Every request is bounded by the per-request
//! timeout; one that runs past it is dropped (the router sees the stream cancelled and
//! frees its pages) and counted as `CLIENT_TIMEOUT`, never waited for.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use indicatif::ProgressBar;
use sluice_proto::v1 as pb;
use sluice_proto::v1::generation_client::GenerationClient;
use tokio::sync::Semaphore;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;

use super::stats::{Done, Outcome, Record};
use super::workload::Request;
use crate::client::Access;

/// HTTP/2 streams a connection carries before another one is opened: servers commonly
/// cap concurrent streams per connection (hyper's default is 200), and a client past
/// the cap would queue requests itself and count that wait as TTFT.
const STREAMS_PER_CONNECTION: usize = 100;

/// How every request samples: greedy (the default) or drawn, each drawing request with
/// its own seed (`seed` + the request's index), so a run is reproducible.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub seed: u64,
}

impl Sampling {
    fn params(&self, index: usize) -> pb::SamplingParams {
        pb::SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: (self.temperature > 0.0).then(|| self.seed.wrapping_add(index as u64)),
            ..Default::default()
        }
    }
}

/// The router, over a pool of connections, and what every request carries.
pub struct Target {
    channels: Vec<Channel>,
    api_key: Option<MetadataValue<Ascii>>,
    timeout: Duration,
    sampling: Sampling,
}

impl Target {
    /// Connect now (an unreachable router fails here, not as N failed requests), enough
    /// connections for `in_flight` concurrent streams.
    pub async fn connect(
        router: &str,
        access: &Access,
        in_flight: usize,
        timeout: Duration,
        sampling: Sampling,
    ) -> Result<Target> {
        let endpoint =
            access.dialer.endpoint(router).map_err(anyhow::Error::msg)?.connect_timeout(Duration::from_secs(5));
        let mut channels = Vec::new();
        for _ in 0..in_flight.div_ceil(STREAMS_PER_CONNECTION).clamp(1, 64) {
            let ch = access
                .dialer
                .connect(&endpoint)
                .await
                .with_context(|| format!("cannot connect to the router at {}", access.dialer.url(router)))?;
            channels.push(ch);
        }
        let api_key = match &access.api_key {
            Some(k) => Some(format!("Bearer {k}").parse().context("--api-key: not a valid header value")?),
            None => None,
        };
        Ok(Target { channels, api_key, timeout, sampling })
    }

    /// Send one request and time its events.
    pub async fn send(&self, index: usize, request_id: String, req: &Request) -> Outcome {
        let body = pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: req.prompt.clone() })),
            max_tokens: req.output_len,
            // Greedy unless --temperature says otherwise, no logprobs, and no stop
            // tokens: the request runs to max_tokens (the serving benchmarks'
            // `ignore_eos`); the router adds no EOS stop to token-id requests.
            sampling: Some(self.sampling.params(index)),
            stop: None,
            request_id,
            ..Default::default()
        };
        let mut client = GenerationClient::new(self.channels[index % self.channels.len()].clone());
        let mut request = tonic::Request::new(body);
        if let Some(key) = &self.api_key {
            request.metadata_mut().insert("authorization", key.clone());
        }
        let sent = Instant::now();
        let stream = async {
            let mut events = client.generate(request).await?.into_inner();
            let mut done = Done::default();
            let mut last: Option<Instant> = None;
            while let Some(ev) = events.message().await? {
                let now = Instant::now();
                match ev.event {
                    Some(pb::generate_event::Event::Token(_)) => {
                        match last {
                            None => done.ttft_s = (now - sent).as_secs_f64(),
                            Some(prev) => done.itl_s.push((now - prev).as_secs_f64()),
                        }
                        last = Some(now);
                        done.output_tokens += 1;
                    }
                    Some(pb::generate_event::Event::Final(f)) => {
                        done.e2e_s = (now - sent).as_secs_f64();
                        let (u, t) = (f.usage.unwrap_or_default(), f.timings.unwrap_or_default());
                        done.prompt_tokens = u.prompt_tokens;
                        done.cached_tokens = u.cached_tokens;
                        done.completion_tokens = u.completion_tokens;
                        done.finished_by_length = f.finish_reason == pb::FinishReason::Length as i32;
                        done.server_ms = [
                            t.queue_ms,
                            t.prefill_ms,
                            t.kv_transfer_ms,
                            t.time_to_first_token_ms,
                            t.total_ms,
                            t.prefix_restore_ms,
                        ];
                        return Ok(Some(done));
                    }
                    None => {}
                }
            }
            Ok::<_, tonic::Status>(None)
        };
        match tokio::time::timeout(self.timeout, stream).await {
            Err(_) => Outcome::Failed {
                code: "CLIENT_TIMEOUT".into(),
                message: format!("no final event within {:.0} s (--timeout-s)", self.timeout.as_secs_f64()),
            },
            Ok(Err(status)) => {
                Outcome::Failed { code: format!("{:?}", status.code()), message: status.message().into() }
            }
            Ok(Ok(None)) => {
                Outcome::Failed { code: "PROTOCOL".into(), message: "the stream ended without a final event".into() }
            }
            Ok(Ok(Some(done))) if done.output_tokens == 0 => {
                Outcome::Failed { code: "PROTOCOL".into(), message: "a final event but no token".into() }
            }
            Ok(Ok(Some(done))) => Outcome::Done(done),
        }
    }
}

/// Send `requests` at `arrivals` (seconds from the start), at most `max_concurrency` in
/// flight; returns every request's record (in request order) and the run's duration
/// (first send → last completion).
pub async fn run(
    target: Arc<Target>,
    tag: &str,
    requests: Vec<Request>,
    arrivals: &[f64],
    max_concurrency: Option<usize>,
    bar: &ProgressBar,
) -> Result<(Vec<Record>, f64)> {
    let slots = max_concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (index, (req, &at)) in requests.into_iter().zip(arrivals).enumerate() {
        tokio::time::sleep_until(start + Duration::from_secs_f64(at)).await;
        let (target, slots, bar, id) = (target.clone(), slots.clone(), bar.clone(), format!("bench-{tag}-{index}"));
        tasks.spawn(async move {
            let _slot = match &slots {
                Some(s) => Some(s.clone().acquire_owned().await.expect("the semaphore is never closed")),
                None => None,
            };
            let sent_s = start.elapsed().as_secs_f64();
            let outcome = target.send(index, id, &req).await;
            bar.inc(1);
            Record { index, prompt_len: req.prompt.len(), asked_tokens: req.output_len, sent_s, outcome }
        });
    }
    let mut records = Vec::new();
    while let Some(r) = tasks.join_next().await {
        records.push(r.context("a request task panicked")?);
    }
    let duration = start.elapsed().as_secs_f64();
    records.sort_by_key(|r| r.index);
    Ok((records, duration))
}
