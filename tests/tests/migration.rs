//! Request migration: a decode worker killed (`kill -9`) mid-stream, and the stream
//! continues on the other one with exactly what an undisturbed run gives — for seeded
//! sampling (the RNG resumes at the same position) and for grammar-constrained chat (the
//! grammar is replayed over the tokens already streamed). The greedy case, the metric
//! and `--migration-limit 0` are in `failures.rs`.

use std::time::Duration;

use sluice_e2e::{Spec, TestCluster, prompt};
use sluice_proto::v1 as pb;

const VOCAB: u32 = 320;

/// Two decode workers slowed enough that a stream can be interrupted part way.
fn spec() -> Spec {
    Spec { debug_hooks: true, decode_args: vec!["--debug-step-delay-ms".into(), "30".into()], ..Spec::new(1, 2) }
}

/// Kill whichever decode worker serves the one running request.
async fn kill_the_busy_decode_worker(c: &mut TestCluster) -> String {
    let busy = c.busy_decode_worker().await;
    c.kill_worker(&busy).await;
    busy
}

async fn resumed_migrations(c: &TestCluster) -> String {
    let metrics = c.scrape("router").await;
    metrics.lines().find(|l| l.starts_with(r#"sluice_router_migrations_total{outcome="resumed"}"#)).unwrap_or("").into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_continues_from_the_same_rng_position() {
    let mut c = TestCluster::start(spec()).await;
    let request = || pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt(90, 5, VOCAB) })),
        max_tokens: 40,
        sampling: Some(pb::SamplingParams {
            temperature: 1.1,
            top_p: 0.95,
            top_k: 60,
            seed: Some(20_240_611),
            logprobs: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let undisturbed = c.generate(request()).await.expect("an undisturbed run");
    // Sampling, not greedy: a second seed gives other tokens, so equality below means
    // the RNG really resumed where it was.
    let mut other_seed = request();
    other_seed.sampling.as_mut().expect("sampling").seed = Some(7);
    assert_ne!(c.generate(other_seed).await.expect("another seed").ids(), undisturbed.ids());

    let mut stream = c.client().await.generate(request()).await.expect("accepted").into_inner();
    let mut ids = Vec::new();
    while ids.len() < 6 {
        if let Some(pb::generate_event::Event::Token(t)) =
            stream.message().await.expect("healthy").expect("event").event
        {
            ids.push(t.token_id);
        }
    }
    let killed = kill_the_busy_decode_worker(&mut c).await;
    let fin = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match stream.message().await.expect("the stream survives the kill").expect("a final event").event {
                Some(pb::generate_event::Event::Token(t)) => ids.push(t.token_id),
                Some(pb::generate_event::Event::Final(f)) => return f,
                None => {}
            }
        }
    })
    .await
    .expect("bounded");
    assert_eq!(ids, undisturbed.ids(), "{killed} was killed after 6 tokens");
    assert_eq!(fin.usage.map(|u| u.completion_tokens), Some(40));
    assert!(resumed_migrations(&c).await.ends_with(" 1"), "{}", resumed_migrations(&c).await);
    c.assert_pages_return(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_chat_replays_its_grammar_on_the_new_worker() {
    let mut c = TestCluster::start(spec()).await;
    let schema = r#"{"type":"object","properties":{"name":{"type":"string"},"tags":{"type":"array","items":{"type":"string"}}},"required":["name","tags"]}"#;
    let request = || pb::ChatRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "Describe a person as JSON.".into(),
            ..Default::default()
        }],
        max_tokens: 60,
        sampling: Some(pb::SamplingParams { temperature: 0.8, seed: Some(99), ..Default::default() }),
        response_format: Some(pb::ResponseFormat { r#type: "json_schema".into(), json_schema: schema.into() }),
        ..Default::default()
    };
    // Content and the final event of one chat stream, read to its end; `kill_after`
    // content events, the busy decode worker is killed.
    async fn chat(c: &mut TestCluster, req: pb::ChatRequest, kill_after: Option<usize>) -> (String, pb::ChatFinal) {
        let mut stream = c.client().await.chat(req).await.expect("accepted").into_inner();
        let (mut content, mut deltas) = (String::new(), 0);
        let read = async {
            loop {
                match stream.message().await.expect("the stream survives").expect("a final event").event {
                    Some(pb::chat_event::Event::ContentDelta(d)) => {
                        content.push_str(&d);
                        deltas += 1;
                        if Some(deltas) == kill_after {
                            kill_the_busy_decode_worker(c).await;
                        }
                    }
                    Some(pb::chat_event::Event::Final(f)) => return f,
                    _ => {}
                }
            }
        };
        let fin = tokio::time::timeout(Duration::from_secs(60), read).await.expect("bounded");
        (content, fin)
    }
    let (want, want_fin) = chat(&mut c, request(), None).await;
    assert!(want.starts_with('{'), "the grammar holds: {want:?}");
    let (got, fin) = chat(&mut c, request(), Some(4)).await;
    assert_eq!(got, want, "the migrated stream is the undisturbed one");
    assert_eq!(fin.finish_reason, want_fin.finish_reason);
    assert_eq!(fin.usage, want_fin.usage);
    assert!(resumed_migrations(&c).await.ends_with(" 1"), "{}", resumed_migrations(&c).await);
    c.assert_pages_return(Duration::from_secs(10)).await;
}
