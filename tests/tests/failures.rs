//! Worker deaths (`kill -9`) during a request: the client hears about a dead decode
//! worker quickly instead of hanging, and a prefill worker that dies before writing is
//! replaced by another one without the client noticing.

use std::time::{Duration, Instant};

use sluice_e2e::{Spec, TestCluster, ids_request, prompt};
use sluice_proto::v1 as pb;

const VOCAB: u32 = 320;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_worker_killed_mid_stream_fails_the_request_within_five_seconds() {
    let spec =
        Spec { debug_hooks: true, decode_args: vec!["--debug-step-delay-ms".into(), "50".into()], ..Spec::new(1, 1) };
    let mut c = TestCluster::start(spec).await;
    let mut client = c.client().await;
    let mut stream = client.generate(ids_request(prompt(140, 1, VOCAB), 400)).await.expect("accepted").into_inner();
    for _ in 0..3 {
        let ev = stream.message().await.expect("stream healthy").expect("an event");
        assert!(matches!(ev.event, Some(pb::generate_event::Event::Token(_))), "{ev:?}");
    }

    c.kill_worker("decode-0").await;
    let killed = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match stream.message().await {
                Ok(Some(ev)) => match ev.event {
                    Some(pb::generate_event::Event::Final(f)) => return Ok(f),
                    _ => continue, // tokens already in flight
                },
                Ok(None) => return Err(tonic::Status::unknown("stream ended without a final event")),
                Err(s) => return Err(s),
            }
        }
    })
    .await
    .expect("the client hears of the dead decode worker within 5 s");
    let status = outcome.expect_err("a request whose decode worker died cannot finish");
    eprintln!(
        "client error {:.0} ms after kill -9: {:?} {}",
        killed.elapsed().as_secs_f64() * 1e3,
        status.code(),
        status.message()
    );
    assert!(
        matches!(status.code(), tonic::Code::Unavailable | tonic::Code::Internal | tonic::Code::Unknown),
        "{status:?}"
    );
    assert!(!status.message().is_empty());

    // The router still answers, and says plainly that no decode worker is left.
    let again = c.generate(ids_request(prompt(10, 2, VOCAB), 4)).await.expect_err("no decode worker left");
    assert_eq!(again.code(), tonic::Code::Unavailable, "{again:?}");
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
