//! Worker deaths (`kill -9`) during a request: a request whose decode worker dies
//! mid-stream continues on another one (migration; with it turned off, the client hears
//! about the dead worker quickly instead of hanging), and a prefill worker that dies
//! before writing is replaced by another one without the client noticing; a prompt
//! whose lease runs out in a busy prefill worker's queue is retried there.

use std::time::{Duration, Instant};

use sluice_e2e::{Spec, TestCluster, ids_request, prompt};
use sluice_proto::v1 as pb;

const VOCAB: u32 = 320;

/// Read a stream to its final event (bounded): the tokens after those already read, and
/// the final event or the error that ended it.
async fn finish_stream(
    stream: &mut tonic::Streaming<pb::GenerateEvent>,
    within: Duration,
) -> (Vec<pb::TokenEvent>, Result<pb::FinalEvent, tonic::Status>) {
    let mut tokens = Vec::new();
    let outcome = tokio::time::timeout(within, async {
        loop {
            match stream.message().await {
                Ok(Some(ev)) => match ev.event {
                    Some(pb::generate_event::Event::Final(f)) => return Ok(f),
                    Some(pb::generate_event::Event::Token(t)) => tokens.push(t),
                    None => {}
                },
                Ok(None) => return Err(tonic::Status::unknown("stream ended without a final event")),
                Err(s) => return Err(s),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the stream did not end within {within:?}"));
    (tokens, outcome)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_worker_killed_mid_stream_is_migrated_and_the_stream_completes() {
    let spec =
        Spec { debug_hooks: true, decode_args: vec!["--debug-step-delay-ms".into(), "30".into()], ..Spec::new(1, 2) };
    let mut c = TestCluster::start(spec).await;
    let request = || ids_request(prompt(140, 1, VOCAB), 48);
    let undisturbed = c.generate(request()).await.expect("an undisturbed run");

    let mut stream = c.client().await.generate(request()).await.expect("accepted").into_inner();
    let mut tokens = Vec::new();
    for _ in 0..8 {
        match stream.message().await.expect("stream healthy").expect("an event").event {
            Some(pb::generate_event::Event::Token(t)) => tokens.push(t),
            other => panic!("{other:?}"),
        }
    }
    let serving = c.busy_decode_worker().await;
    c.kill_worker(&serving).await;
    let (rest, outcome) = finish_stream(&mut stream, Duration::from_secs(30)).await;
    let fin = outcome.expect("the request continues on the other decode worker");
    tokens.extend(rest);

    // One stream: every index once, in order, the same tokens, logprobs and usage as
    // the undisturbed run.
    assert_eq!(tokens.iter().map(|t| t.index).collect::<Vec<_>>(), (0..48).collect::<Vec<u32>>());
    assert_eq!(tokens.iter().map(|t| t.token_id).collect::<Vec<_>>(), undisturbed.ids());
    for (a, b) in tokens.iter().zip(&undisturbed.tokens) {
        assert!((a.logprob - b.logprob).abs() < 1e-3, "logprob of token {}: {} vs {}", a.index, a.logprob, b.logprob);
    }
    assert_eq!(fin.finish_reason, pb::FinishReason::Length as i32);
    let usage = fin.usage.expect("usage");
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (140, 48));

    let metrics = c.scrape("router").await;
    assert!(metrics.contains(r#"sluice_router_migrations_total{outcome="resumed"} 1"#), "{metrics}");
    assert!(metrics.contains(r#"sluice_router_migrations_total{outcome="failed"} 0"#), "{metrics}");
    let log = c.router.as_ref().expect("router").log_tail(200);
    assert!(log.contains("migrating the request") && log.contains(&serving), "{log}");
    c.assert_pages_return(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_migration_off_a_killed_decode_worker_fails_the_stream_within_five_seconds() {
    let spec = Spec {
        debug_hooks: true,
        decode_args: vec!["--debug-step-delay-ms".into(), "50".into()],
        router_args: vec!["--migration-limit".into(), "0".into()],
        ..Spec::new(1, 2)
    };
    let mut c = TestCluster::start(spec).await;
    let mut client = c.client().await;
    let mut stream = client.generate(ids_request(prompt(140, 1, VOCAB), 400)).await.expect("accepted").into_inner();
    for _ in 0..3 {
        let ev = stream.message().await.expect("stream healthy").expect("an event");
        assert!(matches!(ev.event, Some(pb::generate_event::Event::Token(_))), "{ev:?}");
    }

    let serving = c.busy_decode_worker().await;
    c.kill_worker(&serving).await;
    let killed = Instant::now();
    let (_, outcome) = finish_stream(&mut stream, Duration::from_secs(5)).await;
    let status = outcome.expect_err("a request whose decode worker died cannot finish without migration");
    eprintln!(
        "client error {:.0} ms after kill -9: {:?} {}",
        killed.elapsed().as_secs_f64() * 1e3,
        status.code(),
        status.message()
    );
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains(&serving) && status.message().contains("--migration-limit 0"),
        "the message names the worker and why the request was not moved: {status:?}"
    );
    let metrics = c.scrape("router").await;
    assert!(metrics.contains(r#"sluice_router_migrations_total{outcome="resumed"} 0"#), "{metrics}");

    // The router still serves on the decode worker that is left.
    let again = c.generate(ids_request(prompt(10, 2, VOCAB), 4)).await.expect("the other decode worker serves");
    assert_eq!(again.ids().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_worker_killed_before_transfer_is_retried_elsewhere() {
    // prefill-0 (ranked first on a fresh cluster) pauses 5 s between computing and
    // writing, so it can be killed holding a computed but unsent prompt. The decode
    // worker's short lease lets the reservation it was given come back.
    let spec = Spec {
        debug_hooks: true,
        prefill_args: vec![vec!["--debug-transfer-delay-ms".into(), "5000".into()], vec![]],
        decode_args: vec!["--lease-ms".into(), "3000".into()],
        ..Spec::new(2, 1)
    };
    let mut c = TestCluster::start(spec).await;
    let p = prompt(200, 3, VOCAB);
    let request = {
        let grpc = c.grpc.clone();
        let req = ids_request(p.clone(), 12);
        tokio::spawn(async move {
            let mut client = sluice_proto::v1::generation_client::GenerationClient::connect(grpc).await?;
            let mut stream = client.generate(req).await?.into_inner();
            let mut ids = Vec::new();
            while let Some(ev) = stream.message().await? {
                match ev.event {
                    Some(pb::generate_event::Event::Token(t)) => ids.push(t.token_id),
                    Some(pb::generate_event::Event::Final(f)) => {
                        return Ok::<_, Box<dyn std::error::Error + Send + Sync>>((ids, f));
                    }
                    None => {}
                }
            }
            Err("stream ended without a final event".into())
        })
    };

    // Wait until a reservation is held (prefill-0 has the prompt), then kill it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.decode_load("decode-0").await.free_pages == c.decode_load("decode-0").await.total_pages {
        assert!(Instant::now() < deadline, "the request never reserved pages");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.kill_worker("prefill-0").await;

    let (ids, fin) = tokio::time::timeout(Duration::from_secs(30), request)
        .await
        .expect("bounded")
        .expect("task")
        .expect("the request succeeds on the other prefill worker");
    assert_eq!(ids.len(), 12);
    let router_log = c.router.as_ref().expect("router").log_tail(200);
    assert!(router_log.contains("retrying elsewhere"), "the first attempt died on prefill-0:\n{router_log}");
    assert_eq!(fin.usage.as_ref().map(|u| u.completion_tokens), Some(12));

    // Same answer as an undisturbed run of the same request.
    let clean = c.generate(ids_request(p, 12)).await.expect("clean run");
    assert_eq!(ids, clean.ids(), "the retried request computed the same tokens");

    // The dead worker's reservation is quarantined until its lease ends, then freed.
    c.assert_pages_return(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_decode_worker_finish_its_requests_then_exit() {
    let spec =
        Spec { debug_hooks: true, decode_args: vec!["--debug-step-delay-ms".into(), "20".into()], ..Spec::new(1, 1) };
    let mut c = TestCluster::start(spec).await;
    let mut client = c.client().await;
    let mut stream = client.generate(ids_request(prompt(60, 4, VOCAB), 40)).await.expect("accepted").into_inner();
    stream.message().await.expect("stream healthy").expect("a first token");

    let pid = c.worker("decode-0").pid().expect("running");
    let status = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().expect("kill");
    assert!(status.success());

    let mut tokens = 1;
    let fin = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match stream.message().await.expect("the running request is not cut off").expect("a final event").event {
                Some(pb::generate_event::Event::Token(_)) => tokens += 1,
                Some(pb::generate_event::Event::Final(f)) => return f,
                None => {}
            }
        }
    })
    .await
    .expect("bounded");
    assert_eq!(tokens, 40);
    assert_eq!(fin.finish_reason, pb::FinishReason::Length as i32);

    let deadline = Instant::now() + Duration::from_secs(10);
    while c.worker("decode-0").exited().is_none() {
        assert!(Instant::now() < deadline, "the drained decode worker did not exit");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = c.worker("decode-0").log_tail(20);
    assert!(log.contains("SIGTERM"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_runs_out_in_a_busy_queue_is_retried_on_the_same_worker() {
    // One prefill worker that takes 1.5 s a prompt (a debug pause on its engine thread,
    // one 40-token prompt a step) and decode leases of 4 s: of three prompts sent at
    // once, the third waits 3 s in the queue and cannot finish within its lease. That is
    // load, not a fault: the router retries it with a fresh reservation on the same
    // (only) worker, and it succeeds.
    let spec = Spec {
        debug_hooks: true,
        prefill_args: vec![["--debug-transfer-delay-ms", "1500", "--token-budget", "40"].map(String::from).to_vec()],
        decode_args: vec!["--lease-ms".into(), "4000".into()],
        ..Spec::new(1, 1)
    };
    let c = TestCluster::start(spec).await;
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(40, 10 + i, VOCAB)).collect();
    let (a, b, third) = tokio::join!(
        c.generate(ids_request(prompts[0].clone(), 4)),
        c.generate(ids_request(prompts[1].clone(), 4)),
        c.generate(ids_request(prompts[2].clone(), 4)),
    );
    for (i, r) in [a, b, third].into_iter().enumerate() {
        let r = r.unwrap_or_else(|s| panic!("prompt {i} failed: {s}"));
        assert_eq!(r.ids().len(), 4, "prompt {i}");
    }
    let router_log = c.router.as_ref().expect("router").log_tail(300);
    assert!(
        router_log.contains("retrying with a fresh reservation, this worker included")
            && router_log.contains("DeadlineExceeded"),
        "a prompt's lease ran out in the queue and was retried:\n{router_log}"
    );
    c.assert_pages_return(Duration::from_secs(10)).await;
}
