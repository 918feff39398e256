//! The cluster as a client sees it: results equal the in-process engine's, bad input is
//! refused with a message, many concurrent requests all come back right, and pages
//! return to the pool after requests finish or are cancelled.

use std::time::{Duration, Instant};

use engine::generate::{GenerateRequest, Generation, generate};
use engine::sampling::SamplingParams;
use engine::{CpuBackend, Engine, EngineOptions, EntryDtype};
use sluice_e2e::{KvSpec, Spec, TestCluster, ids_request, prompt};
use sluice_proto::v1 as pb;
use tonic::{Code, Status};

const VOCAB: u32 = 320;

fn local_engine(c: &TestCluster) -> Engine<CpuBackend> {
    let opts = EngineOptions { kv_dtype: EntryDtype::Bf16, max_pages: 64, max_sequences: 4, max_chunk_tokens: 2048 };
    Engine::load(&c.model, CpuBackend::new(), opts).expect("load model in-process")
}

fn local(engine: &mut Engine<CpuBackend>, prompt: &[u32], max_tokens: usize, sampling: SamplingParams) -> Generation {
    let req = GenerateRequest { prompt: prompt.to_vec(), max_tokens, sampling, stop_tokens: vec![] };
    tokio::task::block_in_place(|| generate(engine, &req, |_| {})).expect("in-process generation")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_output_equals_in_process_engine() {
    let c = TestCluster::start(Spec::new(1, 1)).await;
    let mut engine = local_engine(&c);
    for (len, salt) in [(5usize, 1u32), (130, 2), (300, 3)] {
        let p = prompt(len, salt, VOCAB);
        // Greedy.
        let want = local(&mut engine, &p, 20, SamplingParams { top_logprobs: 0, ..Default::default() });
        let got = c.generate(ids_request(p.clone(), 20)).await.expect("greedy through the cluster");
        assert_eq!(got.ids(), want.tokens.iter().map(|s| s.token).collect::<Vec<_>>(), "greedy tokens, prompt {len}");
        assert_eq!(
            got.logprobs(),
            want.tokens.iter().map(|s| s.logprob).collect::<Vec<_>>(),
            "greedy logprobs, prompt {len}"
        );
        assert_eq!(got.fin.usage.as_ref().unwrap().prompt_tokens, len as u32);
        assert_eq!(got.fin.finish_reason, pb::FinishReason::Length as i32);

        // Seeded sampling.
        let sampling =
            SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 50, seed: 7 + salt as u64, top_logprobs: 0 };
        let want = local(&mut engine, &p, 16, sampling.clone());
        let mut req = ids_request(p.clone(), 16);
        req.sampling = Some(pb::SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            top_k: 50,
            seed: Some(7 + salt as u64),
            logprobs: true,
            top_logprobs: 0,
        });
        let got = c.generate(req).await.expect("sampling through the cluster");
        assert_eq!(got.ids(), want.tokens.iter().map(|s| s.token).collect::<Vec<_>>(), "sampled tokens, prompt {len}");
        assert_eq!(
            got.logprobs(),
            want.tokens.iter().map(|s| s.logprob).collect::<Vec<_>>(),
            "sampled logprobs, prompt {len}"
        );
    }
    c.assert_pages_return(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_a_message_and_the_cluster_stays_healthy() {
    let c = TestCluster::start(Spec::new(1, 1)).await;
    let mut client = c.client().await;
    let text = |t: &str| Some(pb::generate_request::Prompt::Text(t.into()));
    let cases: Vec<(pb::GenerateRequest, &str)> = vec![
        (ids_request(vec![1, VOCAB], 4), "outside the vocabulary"),
        (ids_request(vec![], 4), "the prompt is empty"),
        (pb::GenerateRequest { prompt: text(""), max_tokens: 4, ..Default::default() }, "the prompt is empty"),
        (ids_request(prompt(4090, 1, VOCAB), 100), "past the context limit of 4096"),
        (ids_request(vec![1, 2], 0), "max_tokens must be at least 1"),
        (ids_request(vec![1, 2], 5000), "above this server's limit"),
        (pb::GenerateRequest { model: "gpt-4".into(), ..ids_request(vec![1], 4) }, "unknown model `gpt-4`"),
        (pb::GenerateRequest { prompt: None, max_tokens: 4, ..Default::default() }, "no prompt"),
    ];
    for (req, want) in cases {
        let err = match client.generate(req).await {
            Err(s) => s,
            Ok(resp) => resp.into_inner().message().await.expect_err("the stream must fail"),
        };
        assert_eq!(err.code(), Code::InvalidArgument, "{want}: {err:?}");
        assert!(err.message().contains(want), "`{}` lacks `{want}`", err.message());
    }
    let http_cases = [
        (r#"{"prompt": [1, 320], "max_tokens": 4}"#, "outside the vocabulary"),
        (r#"{"prompt": "", "max_tokens": 4}"#, "the prompt is empty"),
        (r#"{"prompt": [1], "max_tokens": 0}"#, "max_tokens must be at least 1"),
        (r#"{"prompt": [1], "max_tokens": 4, "model": "nope"}"#, "unknown model"),
        (r#"{"prompt": [1], "max_tokens": "many"}"#, "malformed request body"),
        (r#"{"prompt": [1], "n": 2}"#, "n must be 1"),
        ("not json", "malformed request body"),
    ];
    for (body, want) in http_cases {
        let (status, text) = c.http_post("/v1/completions", body).await.expect("http");
        assert_eq!(status, 400, "{body}: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("error body is JSON");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(want), "{body}: `{msg}` lacks `{want}`");
    }
    // Still serving.
    assert_eq!(c.http_get("/health").await.unwrap().0, 200);
    let ok = c.generate(ids_request(vec![5, 6, 7], 3)).await.expect("a good request after bad ones");
    assert_eq!(ok.tokens.len(), 3);
    c.assert_pages_return(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_api_streams_and_answers_like_grpc() {
    let c = TestCluster::start(Spec::new(1, 1)).await;
    let p = prompt(40, 9, VOCAB);
    let grpc = c.generate(ids_request(p.clone(), 6)).await.unwrap();
    let body = serde_json::json!({"prompt": p, "max_tokens": 6, "temperature": 0, "logprobs": 1}).to_string();
    let (status, text) = c.http_post("/v1/completions", &body).await.unwrap();
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids: Vec<u32> = v["choices"][0]["logprobs"]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, grpc.ids());
    assert_eq!(v["usage"]["completion_tokens"], 6);
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    let body = serde_json::json!({"prompt": "Hello there", "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}}).to_string();
    let (status, text) = c.http_post("/v1/completions", &body).await.unwrap();
    assert_eq!(status, 200);
    let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<serde_json::Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks.len(), 6, "5 token chunks and a final one: {text}");
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 5);

    let (status, text) = c.http_get("/v1/models").await.unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("\"id\":\"tiny\""), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_cluster_logs_no_error_line() {
    // As `sluice up` runs it: KV over shared memory, a kvstore, two decode workers.
    let spec = Spec { ucx_tls: Some("shm".into()), kvstore: Some(KvSpec::policy("periodic:1024")), ..Spec::new(1, 2) };
    let c = TestCluster::start(spec).await;
    // Cold prompts at once (placed on both decode workers), then a repeated one whose
    // blocks come back from the kvstore.
    let cold = |i: u32| c.generate(ids_request(prompt(150 + i as usize, 30 + i, VOCAB), 8));
    let (a, b, d, e) = tokio::join!(cold(0), cold(1), cold(2), cold(3));
    for r in [a, b, d, e] {
        r.expect("a cold request");
    }
    let shared = prompt(300, 21, VOCAB);
    c.generate(ids_request(shared.clone(), 8)).await.expect("the prefix's first request");
    // One block from each cold prompt, two from the shared one.
    c.wait_kvstore(6, 0).await;
    let hit = c.generate(ids_request(shared, 8)).await.expect("the prefix's second request");
    assert_eq!(hit.fin.usage.as_ref().map(|u| u.cached_tokens), Some(256), "the kvstore served the prefix");
    let (status, _) = c.http_post("/v1/completions", r#"{"prompt": "Hello there", "max_tokens": 4}"#).await.unwrap();
    assert_eq!(status, 200);
    c.assert_pages_return(Duration::from_secs(5)).await;
    let errors = c.error_lines();
    assert!(errors.is_empty(), "a healthy cluster logged errors: {errors:#?}");
}

/// A prompt whose greedy continuation has no near-tie (top-2 logprob gap > 1e-3 at every
/// step), so batching (which changes summation order) cannot flip a token.
fn tie_free(engine: &mut Engine<CpuBackend>, len: usize, max_tokens: usize, salt: u32) -> (Vec<u32>, Generation) {
    for attempt in 0..50 {
        let p = prompt(len, salt * 97 + attempt, VOCAB);
        let g = local(engine, &p, max_tokens, SamplingParams { top_logprobs: 2, ..Default::default() });
        if g.tokens.iter().all(|t| t.top.len() == 2 && t.top[0].1 - t.top[1].1 > 1e-3) {
            return (p, g);
        }
    }
    panic!("no tie-free prompt of length {len}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_requests_all_correct_and_pages_return() {
    let c = TestCluster::start(Spec::new(1, 1)).await;
    let mut engine = local_engine(&c);
    let cases: Vec<(Vec<u32>, Generation)> = (0..64u32)
        .map(|i| {
            tie_free(&mut engine, [1, 3, 17, 127, 128, 129, 200, 260][i as usize % 8], 1 + (i as usize * 7) % 24, i)
        })
        .collect();
    let started = Instant::now();
    let handles: Vec<_> = cases
        .iter()
        .map(|(p, g)| {
            let req = ids_request(p.clone(), g.tokens.len() as u32);
            let grpc = c.grpc.clone();
            tokio::spawn(async move {
                let mut client = sluice_proto::v1::generation_client::GenerationClient::connect(grpc).await.unwrap();
                let mut s = client.generate(req).await?.into_inner();
                let mut out = Vec::new();
                while let Some(ev) = s.message().await? {
                    if let Some(pb::generate_event::Event::Token(t)) = ev.event {
                        out.push((t.token_id, t.logprob));
                    }
                }
                Ok::<_, tonic::Status>(out)
            })
        })
        .collect();
    for (i, (h, (_, want))) in handles.into_iter().zip(&cases).enumerate() {
        let got =
            tokio::time::timeout(Duration::from_secs(120), h).await.expect("bounded").unwrap().expect("request ok");
        let ids: Vec<u32> = got.iter().map(|x| x.0).collect();
        assert_eq!(ids, want.tokens.iter().map(|s| s.token).collect::<Vec<_>>(), "request {i}");
        for ((_, lp), w) in got.iter().zip(&want.tokens) {
            assert!((lp - w.logprob).abs() < 1e-3, "request {i}: logprob {lp} vs {}", w.logprob);
        }
    }
    eprintln!("64 concurrent requests in {:.2}s", started.elapsed().as_secs_f64());
    c.assert_pages_return(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_cancellation_frees_pages_everywhere_within_a_second() {
    let spec = Spec {
        debug_hooks: true,
        decode_args: vec!["--debug-step-delay-ms".into(), "30".into()],
        prefill_args: vec![vec!["--debug-transfer-delay-ms".into(), "600".into()]],
        ..Spec::new(1, 1)
    };
    let c = TestCluster::start(spec).await;
    let p = prompt(150, 4, VOCAB);

    // Cancelled while decoding.
    let mut client = c.client().await;
    let mut stream = client.generate(ids_request(p.clone(), 500)).await.unwrap().into_inner();
    for _ in 0..3 {
        stream.message().await.unwrap().expect("a token");
    }
    let busy = c.decode_load("decode-0").await;
    assert!(busy.free_pages < busy.total_pages && busy.running == 1, "{busy:?}");
    drop(stream);
    drop(client);
    let t = Instant::now();
    c.assert_pages_return(Duration::from_secs(1)).await;
    eprintln!("pages back {:.0} ms after cancelling a decode", t.elapsed().as_secs_f64() * 1e3);

    // Cancelled while prefilling (before any KV was written).
    let mut client = c.client().await;
    let call = tokio::spawn(async move {
        let mut stream = client.generate(ids_request(p, 8)).await?.into_inner();
        while stream.message().await?.is_some() {}
        Ok::<(), Status>(())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let reserved = c.decode_load("decode-0").await;
    assert!(reserved.free_pages < reserved.total_pages, "a reservation is held during prefill: {reserved:?}");
    call.abort();
    let t = Instant::now();
    c.assert_pages_return(Duration::from_secs(1)).await;
    eprintln!("pages back {:.0} ms after cancelling a prefill", t.elapsed().as_secs_f64() * 1e3);
    let load = c.prefill_client("prefill-0").await.load(pb::LoadRequest {}).await.unwrap().into_inner();
    assert_eq!(load.queued_requests, 0, "the prefill worker dropped the cancelled prompt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_concurrency_limit_are_shed_at_once() {
    let spec = Spec {
        debug_hooks: true,
        decode_args: vec!["--debug-step-delay-ms".into(), "50".into()],
        router_args: vec!["--max-concurrency".into(), "2".into()],
        ..Spec::new(1, 1)
    };
    let c = TestCluster::start(spec).await;
    let mut held = Vec::new();
    for salt in 0..2 {
        let mut client = c.client().await;
        let mut stream = client.generate(ids_request(prompt(20, salt, VOCAB), 200)).await.unwrap().into_inner();
        stream.message().await.unwrap().expect("a token");
        held.push(stream);
    }
    let t = Instant::now();
    let shed = c.generate(ids_request(prompt(20, 7, VOCAB), 4)).await.expect_err("over the limit");
    assert_eq!(shed.code(), Code::ResourceExhausted, "{shed:?}");
    assert!(shed.message().contains("limit of 2"), "{}", shed.message());
    eprintln!("shed in {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    let (status, body) = c.http_post("/v1/completions", r#"{"prompt": [5, 6, 7], "max_tokens": 2}"#).await.unwrap();
    assert_eq!(status, 429, "{body}");

    // Capacity comes back as soon as the held streams go away.
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match c.generate(ids_request(prompt(20, 8, VOCAB), 4)).await {
            Ok(g) => break assert_eq!(g.tokens.len(), 4),
            Err(e) if e.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("capacity did not come back: {e:?}"),
        }
    }
    c.assert_pages_return(Duration::from_secs(2)).await;
}
