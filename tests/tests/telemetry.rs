//! Telemetry of a real cluster: every process serves Prometheus metrics whose values
//! add up to what the requests did, and — with OTLP export on — one request is one
//! trace, with spans from the router, the prefill worker and the decode worker linked
//! parent to child across the gRPC hops. An OTLP/gRPC receiver inside the test collects
//! what the processes export.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use sluice_e2e::{Spec, TestCluster, ids_request, prompt};
use tonic::{Code, Request, Response, Status};

const VOCAB: u32 = 320;

/// Longest any telemetry may take to show up.
const WITHIN: Duration = Duration::from_secs(20);

/// The text exposition as `series → value`, series written as exposed: `name{labels}`.
fn parse(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

fn get(m: &HashMap<String, f64>, series: &str) -> f64 {
    *m.get(series).unwrap_or_else(|| {
        let mut known: Vec<&String> = m.keys().collect();
        known.sort();
        panic!("{series} is not exposed; exposed: {known:?}")
    })
}

/// Scrape `service` until `ready` holds (bounded), returning the last scrape.
async fn scrape_until(
    c: &TestCluster,
    service: &str,
    ready: impl Fn(&HashMap<String, f64>) -> bool,
) -> HashMap<String, f64> {
    let deadline = Instant::now() + WITHIN;
    loop {
        let m = parse(&c.scrape(service).await);
        if ready(&m) || Instant::now() >= deadline {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_process_serves_metrics_that_add_up() {
    let c = TestCluster::start(Spec::new(1, 1)).await;
    let requests = [(5usize, 4u32), (130, 6), (40, 3)];
    let (mut generated, mut prompted) = (0usize, 0usize);
    for (i, &(len, max_tokens)) in requests.iter().enumerate() {
        let g = c.generate(ids_request(prompt(len, i as u32, VOCAB), max_tokens)).await.expect("a good request");
        assert_eq!(g.tokens.len(), max_tokens as usize);
        generated += g.tokens.len();
        prompted += len;
    }
    let err = c.generate(ids_request(vec![1, VOCAB], 4)).await.expect_err("token outside the vocabulary");
    assert_eq!(err.code(), Code::InvalidArgument);
    let (status, _) = c.http_post("/v1/completions", r#"{"prompt": [1], "max_tokens": 0}"#).await.unwrap();
    assert_eq!(status, 400);
    c.assert_pages_return(Duration::from_secs(5)).await;
    let n = requests.len() as f64;

    // Router.
    let m = scrape_until(&c, "router", |m| {
        m.get(r#"sluice_requests_total{status="ok"}"#) == Some(&n) && m.get("sluice_requests_running") == Some(&0.0)
    })
    .await;
    assert_eq!(get(&m, r#"sluice_requests_total{status="ok"}"#), n);
    assert_eq!(get(&m, r#"sluice_requests_total{status="invalid_argument"}"#), 2.0, "one gRPC, one HTTP");
    assert_eq!(get(&m, r#"sluice_requests_total{status="unavailable"}"#), 0.0);
    assert_eq!(get(&m, "sluice_generated_tokens_total"), generated as f64);
    assert_eq!(get(&m, "sluice_prompt_tokens_total"), prompted as f64);
    assert_eq!(get(&m, "sluice_cached_tokens_total"), 0.0);
    assert_eq!(get(&m, "sluice_requests_running"), 0.0);
    for h in ["sluice_request_ttft_seconds", "sluice_request_e2e_seconds", "sluice_request_queue_seconds"] {
        assert_eq!(get(&m, &format!("{h}_count")), n, "{h}");
        assert_eq!(get(&m, &format!(r#"{h}_bucket{{le="+Inf"}}"#)), n, "{h}");
        assert!(get(&m, &format!("{h}_sum")) > 0.0, "{h}");
    }
    assert!(
        get(&m, "sluice_request_ttft_seconds_sum") <= get(&m, "sluice_request_e2e_seconds_sum"),
        "the first token comes before the last event"
    );
    assert_eq!(get(&m, "sluice_request_inter_token_latency_seconds_count"), (generated - requests.len()) as f64);
    assert_eq!(get(&m, r#"sluice_router_workers{role="prefill"}"#), 1.0);
    assert_eq!(get(&m, r#"sluice_router_workers{role="decode"}"#), 1.0);
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(get(&m, &format!(r#"sluice_build_info{{service="router",version="{version}"}}"#)), 1.0);

    // Prefill worker.
    let m = scrape_until(&c, "prefill-0", |m| m.get("sluice_prefill_requests_running") == Some(&0.0)).await;
    assert_eq!(get(&m, "sluice_prefill_tokens_total"), prompted as f64);
    for pool in ["csa_main", "csa_indexer", "hca", "swa"] {
        let query = format!(r#"sluice_prefix_cache_query_tokens_total{{pool="{pool}"}}"#);
        assert_eq!(get(&m, &query), prompted as f64, "{pool}");
        assert_eq!(get(&m, &format!(r#"sluice_prefix_cache_hit_tokens_total{{pool="{pool}"}}"#)), 0.0, "{pool}");
    }
    assert!(get(&m, "sluice_kv_transfer_bytes_total") > 0.0);
    assert_eq!(get(&m, "sluice_kv_transfer_seconds_count"), n);
    assert_eq!(get(&m, "sluice_prefill_requests_waiting"), 0.0);
    assert_eq!(get(&m, "sluice_kv_pages_used"), 0.0);
    assert!(get(&m, "sluice_kv_pages_total") > 0.0);
    // A CPU engine's KV is the registered memory itself: no mirror.
    assert_eq!(get(&m, r#"sluice_kv_memory_path{path="registered"}"#), 1.0);
    assert_eq!(get(&m, r#"sluice_kv_memory_path{path="mirror"}"#), 0.0);
    assert_eq!(get(&m, &format!(r#"sluice_build_info{{service="prefill-worker",version="{version}"}}"#)), 1.0);

    // Decode worker.
    let m = scrape_until(&c, "decode-0", |m| m.get("sluice_kv_pages_used") == Some(&0.0)).await;
    assert_eq!(get(&m, "sluice_decode_tokens_total"), generated as f64);
    // The first token of each request is sampled from the prefill's logits, without a step.
    assert_eq!(get(&m, "sluice_decode_step_seconds_count"), (generated - requests.len()) as f64);
    assert_eq!(get(&m, "sluice_decode_requests_running"), 0.0);
    assert_eq!(get(&m, "sluice_decode_requests_waiting"), 0.0);
    assert_eq!(get(&m, "sluice_kv_pages_used"), 0.0);
    assert!(get(&m, "sluice_kv_pages_total") > 0.0);
    assert_eq!(get(&m, "sluice_kv_state_slots_used"), 0.0);
    assert!(get(&m, "sluice_kv_state_slots_total") > 0.0);
    assert_eq!(get(&m, r#"sluice_kv_memory_path{path="registered"}"#), 1.0);
    assert_eq!(get(&m, r#"sluice_kv_memory_path{path="mirror_pageable"}"#), 0.0);
    assert_eq!(get(&m, &format!(r#"sluice_build_info{{service="decode-worker",version="{version}"}}"#)), 1.0);

    // A worker serves nothing but /metrics there.
    let url = c.metrics_url("decode-0");
    let addr = url.trim_start_matches("http://").trim_end_matches("/metrics");
    assert_eq!(sluice_e2e::http(addr, "GET", "/health", None).await.unwrap().0, 404);
}

/// One exported span, as much of it as the checks need.
#[derive(Clone, Debug)]
struct Span {
    service: String,
    name: String,
    trace: Vec<u8>,
    id: Vec<u8>,
    parent: Vec<u8>,
    attributes: Vec<KeyValue>,
}

impl Span {
    fn attribute(&self, key: &str) -> Option<String> {
        self.attributes.iter().find(|kv| kv.key == key).and_then(|kv| string(kv.value.as_ref()))
    }
}

fn string(v: Option<&AnyValue>) -> Option<String> {
    match v?.value.as_ref()? {
        any_value::Value::StringValue(s) => Some(s.clone()),
        any_value::Value::IntValue(i) => Some(i.to_string()),
        _ => None,
    }
}

/// An OTLP/gRPC trace receiver that keeps every span it is sent.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Span>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
                .and_then(|kv| string(kv.value.as_ref()))
                .unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                spans.push(Span {
                    service: service.clone(),
                    name: span.name,
                    trace: span.trace_id,
                    id: span.span_id,
                    parent: span.parent_span_id,
                    attributes: span.attributes,
                });
            }
        }
        Ok(Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl Receiver {
    /// Listen on a free loopback port; returns the endpoint URL.
    async fn start(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(self.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
        tokio::spawn(server);
        format!("http://{addr}")
    }

    fn traces(&self) -> HashMap<Vec<u8>, Vec<Span>> {
        let mut traces: HashMap<Vec<u8>, Vec<Span>> = HashMap::new();
        for s in self.spans.lock().unwrap().iter() {
            traces.entry(s.trace.clone()).or_default().push(s.clone());
        }
        traces
    }
}

/// (service, span name) of every span a request's trace holds.
const EXPECTED: [(&str, &str); 11] = [
    ("router", "request"),
    ("router", "queue"),
    ("router", "prefill"),
    ("router", "decode"),
    ("decode-worker", "decode.reserve"),
    ("prefill-worker", "prefill.queue"),
    ("prefill-worker", "prefill.compute"),
    ("prefill-worker", "kv_transfer"),
    ("prefill-worker", "commit"),
    ("decode-worker", "decode.commit"),
    ("decode-worker", "decode"),
];

fn complete(trace: &[Span]) -> bool {
    EXPECTED.iter().all(|&(svc, name)| trace.iter().any(|s| s.service == svc && s.name == name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_all_three_services() {
    let receiver = Receiver::default();
    let endpoint = receiver.start().await;
    let spec = Spec {
        extra_env: vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "200".into()),
        ],
        ..Spec::new(1, 1)
    };
    let c = TestCluster::start(spec).await;
    const N: usize = 3;
    let mut ids = Vec::new();
    for i in 0..N {
        let mut req = ids_request(prompt(20 + 50 * i, i as u32, VOCAB), 3);
        req.request_id = format!("trace-test-{i}");
        ids.push(req.request_id.clone());
        c.generate(req).await.expect("a good request");
    }

    let deadline = Instant::now() + WITHIN;
    loop {
        let traces = receiver.traces();
        if traces.values().filter(|t| complete(t)).count() >= N {
            break;
        }
        assert!(Instant::now() < deadline, "traces incomplete after {WITHIN:?}: {traces:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Anything exported late (a stray trace) would show up within a few batch delays.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let traces = receiver.traces();
    assert_eq!(traces.len(), N, "one trace per request, nothing else: {traces:#?}");

    let mut seen_ids = HashSet::new();
    for spans in traces.values() {
        assert!(complete(spans), "incomplete trace: {spans:#?}");
        let services: HashSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
        assert_eq!(services, HashSet::from(["router", "prefill-worker", "decode-worker"]));
        let by_id: HashMap<&[u8], &Span> = spans.iter().map(|s| (s.id.as_slice(), s)).collect();
        let one = |svc: &str, name: &str| {
            let found: Vec<&Span> = spans.iter().filter(|s| s.service == svc && s.name == name).collect();
            assert_eq!(found.len(), 1, "one {svc}/{name} span per trace: {spans:#?}");
            found[0]
        };
        let parent_of = |s: &Span| -> &Span {
            by_id
                .get(s.parent.as_slice())
                .unwrap_or_else(|| panic!("{}/{}: parent not in the trace", s.service, s.name))
        };

        let root = one("router", "request");
        assert!(root.parent.is_empty(), "the router's request span is the root");
        assert_eq!(spans.iter().filter(|s| s.parent.is_empty()).count(), 1, "a single root");
        seen_ids.insert(root.attribute("request_id").expect("request_id on the root span"));
        for s in spans.iter().filter(|s| !s.parent.is_empty()) {
            parent_of(s);
        }

        let (queue, prefill, decode) = (one("router", "queue"), one("router", "prefill"), one("router", "decode"));
        for s in [queue, prefill, decode] {
            assert_eq!(parent_of(s).id, root.id, "{} under request", s.name);
        }
        assert_eq!(parent_of(one("decode-worker", "decode.reserve")).id, queue.id, "reserve under queue");
        for name in ["prefill.queue", "prefill.compute", "kv_transfer", "commit"] {
            assert_eq!(parent_of(one("prefill-worker", name)).id, prefill.id, "{name} under the router's prefill");
        }
        let commit = one("prefill-worker", "commit");
        assert_eq!(parent_of(one("decode-worker", "decode.commit")).id, commit.id, "commit crosses to decode");
        assert_eq!(parent_of(one("decode-worker", "decode")).id, decode.id, "decode stream under the router's");
    }
    assert_eq!(seen_ids, ids.into_iter().collect::<HashSet<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_kvstore_the_trace_reaches_into_the_store() {
    let receiver = Receiver::default();
    let endpoint = receiver.start().await;
    let spec = Spec {
        extra_env: vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "200".into()),
        ],
        kvstore: Some(sluice_e2e::KvSpec::policy("full")),
        ..Spec::new(1, 1)
    };
    let c = TestCluster::start(spec).await;
    // The same 400-token prompt twice: the first is computed and put, the second restored.
    let p = prompt(400, 7, VOCAB);
    for i in 0..2 {
        let mut req = ids_request(p.clone(), 3);
        req.request_id = format!("kv-trace-{i}");
        let g = c.generate(req).await.expect("a good request");
        if i == 0 {
            c.wait_kvstore(3, 3).await;
        } else {
            assert!(g.fin.usage.unwrap().cached_tokens > 0, "the second request hits");
        }
    }
    let kv_op = |s: &Span| (s.service == "kvstore").then(|| s.attribute("op")).flatten();
    let deadline = Instant::now() + WITHIN;
    let (first, second) = loop {
        let traces = receiver.traces();
        let with_ops = |ops: &[&str]| {
            traces.values().find(|t| ops.iter().all(|op| t.iter().any(|s| kv_op(s).as_deref() == Some(*op)))).cloned()
        };
        if let (Some(a), Some(b)) = (with_ops(&["lookup", "begin_put", "commit_put"]), with_ops(&["lookup", "get"]))
            && complete(&a)
            && complete(&b)
        {
            break (a, b);
        }
        assert!(Instant::now() < deadline, "no traces reaching the kvstore after {WITHIN:?}: {traces:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for spans in [&first, &second] {
        let services: HashSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
        assert_eq!(services, HashSet::from(["router", "prefill-worker", "decode-worker", "kvstore"]));
        let by_id: HashMap<&[u8], &Span> = spans.iter().map(|s| (s.id.as_slice(), s)).collect();
        for s in spans.iter().filter(|s| s.service == "kvstore") {
            let parent =
                by_id.get(s.parent.as_slice()).unwrap_or_else(|| panic!("kvstore span without its parent: {s:?}"));
            let expected = match kv_op(s).as_deref() {
                Some("lookup") => ["prefix_cache.lookup", "prefix_lookup"].as_slice(),
                Some("get") => &["prefix_cache.fetch"],
                Some("begin_put" | "commit_put") => &["prefix_cache.put"],
                other => panic!("unexpected kvstore op {other:?}"),
            };
            assert!(expected.contains(&parent.name.as_str()), "kvstore {:?} under {}", kv_op(s), parent.name);
        }
    }
}
