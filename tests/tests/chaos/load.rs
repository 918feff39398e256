//! The steady load of the chaos suite: a few clients, each sending one streaming greedy
//! request after another through the router's gRPC API, and what became of each request.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_proto::v1 as pb;
use sluice_proto::v1::generation_client::GenerationClient;
use tonic::Code;
use tonic::transport::Endpoint;

/// Longest one request may take before the client gives up on it (counted as
/// `DeadlineExceeded`): a hung stream is a failure the table must show, not a hang.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A prompt and the tokens an undisturbed cluster answers it with.
pub struct Case {
    pub prompt: Vec<u32>,
    pub expected: Vec<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The whole stream arrived and equals the undisturbed run's tokens.
    Ok,
    /// The stream finished but its tokens differ: a duplicate, a gap or corrupt KV.
    WrongOutput,
    /// The client got an error (or no answer in time).
    Failed(Code),
}

#[derive(Clone, Debug)]
pub struct Outcome {
    pub sent: Instant,
    pub ended: Instant,
    pub ttft: Option<Duration>,
    pub verdict: Verdict,
}

/// Clients running until [`Load::stop`].
pub struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
}

impl Load {
    /// `clients` tasks sending the cases round robin (each client starts at its own
    /// case) to the router at `router` (a gRPC URL that stays the same across restarts).
    pub fn start(router: String, cases: Arc<Vec<Case>>, clients: usize, max_tokens: u32) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let next = Arc::new(AtomicUsize::new(0));
        let tasks = (0..clients)
            .map(|_| {
                let (stop, outcomes, next, cases, router) =
                    (stop.clone(), outcomes.clone(), next.clone(), cases.clone(), router.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let case = &cases[next.fetch_add(1, Ordering::Relaxed) % cases.len()];
                        let o = one(&router, case, max_tokens).await;
                        let failed = matches!(o.verdict, Verdict::Failed(_));
                        outcomes.lock().expect("outcomes").push(o);
                        if failed {
                            // A client backs off a little instead of spinning on a dead router.
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                })
            })
            .collect();
        Load { stop, tasks, outcomes }
    }

    /// Requests finished so far.
    pub fn finished(&self) -> usize {
        self.outcomes.lock().expect("outcomes").len()
    }

    /// Stops sending, lets the requests in flight finish (each is bounded) and returns
    /// every outcome.
    pub async fn stop(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("client task");
        }
        std::mem::take(&mut *self.outcomes.lock().expect("outcomes"))
    }
}

/// One request: a fresh connection (so a restarted router is found again), the stream
/// read to its final event, the tokens compared with the undisturbed run's.
pub async fn one(router: &str, case: &Case, max_tokens: u32) -> Outcome {
    let sent = Instant::now();
    let mut ttft = None;
    let run = async {
        let ch = Endpoint::from_shared(router.to_string())
            .map_err(|_| Code::InvalidArgument)?
            .connect_timeout(Duration::from_secs(1))
            .connect()
            .await
            .map_err(|_| Code::Unavailable)?;
        let req = pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: case.prompt.clone() })),
            max_tokens,
            ..Default::default()
        };
        let mut stream = GenerationClient::new(ch).generate(req).await.map_err(|s| s.code())?.into_inner();
        let mut ids = Vec::new();
        loop {
            match stream.message().await {
                Ok(Some(ev)) => match ev.event {
                    Some(pb::generate_event::Event::Token(t)) => {
                        ttft.get_or_insert_with(|| sent.elapsed());
                        ids.push(t.token_id);
                    }
                    Some(pb::generate_event::Event::Final(_)) => return Ok(ids),
                    None => {}
                },
                Ok(None) => return Err(Code::Unknown),
                Err(s) => return Err(s.code()),
            }
        }
    };
    let verdict = match tokio::time::timeout(REQUEST_TIMEOUT, run).await {
        Err(_) => Verdict::Failed(Code::DeadlineExceeded),
        Ok(Err(code)) => Verdict::Failed(code),
        Ok(Ok(ids)) if ids == case.expected => Verdict::Ok,
        Ok(Ok(_)) => Verdict::WrongOutput,
    };
    Outcome { sent, ended: Instant::now(), ttft, verdict }
}
