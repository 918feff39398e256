//! The workers the router can use: one gRPC channel per member of the cluster, kept in
//! step with membership (static peers or etcd), and their load, polled in the
//! background and adjusted by what this router sends between polls.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use cluster::discovery::{Member, Membership, Role};
use cluster::telemetry::propagation::{PropagateContext, Traced};
use cluster::tls::Dialer;
use sluice_proto::v1 as pb;
use sluice_proto::v1::decode_client::DecodeClient;
use sluice_proto::v1::prefill_client::PrefillClient;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::placement::{DecodeView, PrefillView, rank_decode, rank_prefill};

/// How long a load query may take before the worker counts as unhealthy.
const LOAD_TIMEOUT: Duration = Duration::from_millis(1000);

#[derive(Default)]
struct Load {
    /// `None` until the first answer: a new worker is tried optimistically.
    healthy: Option<bool>,
    prefill: pb::PrefillLoad,
    decode: pb::DecodeLoad,
    /// Prompt tokens this router sent since the last report.
    sent_tokens: u64,
    /// Reservations this router made since the last report (pages).
    reserved_pages: u64,
}

pub struct Worker {
    pub id: String,
    pub role: Role,
    pub addr: String,
    channel: Channel,
    load: Mutex<Load>,
}

impl Worker {
    fn new(m: &Member, dialer: &Dialer) -> Result<Self, String> {
        let endpoint = dialer
            .endpoint(&m.grpc_addr)
            .map_err(|e| format!("worker {} address: {e}", m.id))?
            .connect_timeout(Duration::from_secs(3))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(3));
        let channel = dialer.lazy(&endpoint);
        Ok(Worker {
            id: m.id.clone(),
            role: m.role,
            addr: m.grpc_addr.clone(),
            channel,
            load: Mutex::new(Load::default()),
        })
    }

    /// A client whose calls carry the current span's trace context.
    pub fn prefill(&self) -> PrefillClient<Traced<Channel>> {
        PrefillClient::with_interceptor(self.channel.clone(), PropagateContext)
    }

    /// A client whose calls carry the current span's trace context.
    pub fn decode(&self) -> DecodeClient<Traced<Channel>> {
        DecodeClient::with_interceptor(self.channel.clone(), PropagateContext)
    }

    fn load(&self) -> std::sync::MutexGuard<'_, Load> {
        self.load.lock().expect("load lock")
    }

    /// This worker just failed a request: route around it until it answers a poll.
    pub fn mark_failed(&self) {
        self.load().healthy = Some(false);
    }

    pub fn is_healthy(&self) -> bool {
        self.load().healthy != Some(false)
    }

    pub fn add_sent_tokens(&self, n: u64) {
        self.load().sent_tokens += n;
    }

    pub fn add_reserved_pages(&self, n: u64) {
        self.load().reserved_pages += n;
    }

    fn prefill_view(&self) -> PrefillView {
        let l = self.load();
        PrefillView { healthy: l.healthy != Some(false), queued_tokens: l.prefill.queued_tokens + l.sent_tokens }
    }

    fn decode_view(&self) -> DecodeView {
        let l = self.load();
        DecodeView {
            healthy: l.healthy != Some(false),
            free_pages: if l.healthy.is_none() {
                u64::MAX
            } else {
                (l.decode.free_pages as u64).saturating_sub(l.reserved_pages)
            },
            free_slots: if l.healthy.is_none() { u64::MAX } else { l.decode.free_slots as u64 },
            running: l.decode.running as u64 + l.decode.waiting as u64,
        }
    }

    async fn poll(&self) {
        let answer = match self.role {
            Role::Prefill => {
                let mut c = self.prefill();
                tokio::time::timeout(LOAD_TIMEOUT, c.load(pb::LoadRequest {})).await.ok().and_then(|r| r.ok()).map(
                    |r| {
                        let mut l = self.load();
                        l.prefill = r.into_inner();
                        l.sent_tokens = 0;
                    },
                )
            }
            Role::Decode => {
                let mut c = self.decode();
                tokio::time::timeout(LOAD_TIMEOUT, c.load(pb::LoadRequest {})).await.ok().and_then(|r| r.ok()).map(
                    |r| {
                        let mut l = self.load();
                        l.decode = r.into_inner();
                        l.reserved_pages = 0;
                    },
                )
            }
            Role::Router | Role::Kvstore => Some(()),
        };
        let mut l = self.load();
        let was = l.healthy;
        l.healthy = Some(answer.is_some());
        if was != l.healthy {
            if answer.is_some() {
                tracing::info!(worker = %self.id, addr = %self.addr, "worker is reachable");
            } else {
                tracing::warn!(worker = %self.id, addr = %self.addr, "worker does not answer; routing around it");
            }
        }
    }
}

#[derive(Default)]
pub struct WorkerSet {
    workers: RwLock<HashMap<String, Arc<Worker>>>,
    /// How workers are dialed (TLS with the router's certificate, when on).
    dialer: Dialer,
}

impl WorkerSet {
    pub fn new(dialer: Dialer) -> Self {
        WorkerSet { workers: RwLock::default(), dialer }
    }

    /// Make the set match `members` (prefill and decode workers only).
    pub fn sync(&self, members: &[Member]) {
        let mut w = self.workers.write().expect("workers lock");
        w.retain(|id, _| members.iter().any(|m| &m.id == id));
        for m in members.iter().filter(|m| matches!(m.role, Role::Prefill | Role::Decode)) {
            if !w.contains_key(&m.id) {
                match Worker::new(m, &self.dialer) {
                    Ok(worker) => {
                        tracing::info!(worker = %m.id, role = m.role.as_str(), addr = %m.grpc_addr, "worker joined");
                        w.insert(m.id.clone(), Arc::new(worker));
                    }
                    Err(e) => tracing::warn!("{e}"),
                }
            }
        }
    }

    fn of_role(&self, role: Role) -> Vec<Arc<Worker>> {
        let mut v: Vec<Arc<Worker>> =
            self.workers.read().expect("workers lock").values().filter(|w| w.role == role).cloned().collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Healthy prefill workers not in `exclude`, best first.
    pub fn prefill_ranked(&self, exclude: &[String]) -> Vec<Arc<Worker>> {
        let ws: Vec<Arc<Worker>> =
            self.of_role(Role::Prefill).into_iter().filter(|w| !exclude.contains(&w.id)).collect();
        let views: Vec<PrefillView> = ws.iter().map(|w| w.prefill_view()).collect();
        rank_prefill(&views).into_iter().map(|i| ws[i].clone()).collect()
    }

    /// Healthy decode workers not in `exclude`, best first for a request of `need_pages`.
    pub fn decode_ranked(&self, need_pages: u64, exclude: &[String]) -> Vec<Arc<Worker>> {
        let ws: Vec<Arc<Worker>> =
            self.of_role(Role::Decode).into_iter().filter(|w| !exclude.contains(&w.id)).collect();
        let views: Vec<DecodeView> = ws.iter().map(|w| w.decode_view()).collect();
        rank_decode(&views, need_pages).into_iter().map(|i| ws[i].clone()).collect()
    }

    /// `(healthy prefill workers, healthy decode workers)`.
    /// The model fingerprint a healthy prefill worker reported (salts prefix keys).
    pub fn fingerprint(&self) -> Option<String> {
        self.of_role(Role::Prefill).iter().find_map(|w| {
            let l = w.load();
            (l.healthy == Some(true) && !l.prefill.fingerprint.is_empty()).then(|| l.prefill.fingerprint.clone())
        })
    }

    pub fn healthy_counts(&self) -> (usize, usize) {
        let n = |role| self.of_role(role).iter().filter(|w| w.is_healthy()).count();
        (n(Role::Prefill), n(Role::Decode))
    }

    async fn poll_all(&self) {
        let all: Vec<Arc<Worker>> = self.workers.read().expect("workers lock").values().cloned().collect();
        futures::future::join_all(all.iter().map(|w| w.poll())).await;
    }
}

/// Keep `set` in step with `membership` and poll loads every `interval`, until `shutdown`.
pub fn spawn_maintenance(
    set: Arc<WorkerSet>,
    mut membership: Membership,
    interval: Duration,
    shutdown: CancellationToken,
) {
    set.sync(&membership.current());
    let s = set.clone();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                r = membership.changed() => {
                    if r.is_err() {
                        break;
                    }
                    s.sync(&membership.current());
                }
            }
        }
    });
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => set.poll_all().await,
            }
        }
    });
}
