use std::fmt;
use std::time::Duration;

use etcd_client::{Client, PutOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::backoff::Backoff;
use super::etcd::bounded;
use super::{DiscoveryError, EtcdConfig, Member};

/// Keeps one member registered in etcd under a lease until shut down or dropped.
///
/// A background task keeps the lease alive every TTL/3. When the lease is lost (etcd unreachable,
/// keep-alive unanswered for a whole TTL, or etcd reporting the lease gone) it logs a warning and
/// keeps retrying with backoff until it can grant a new lease and put the member again; it never
/// gives up and never brings the process down.
///
/// Dropping the handle stops the keep-alive and revokes the lease in the background (best effort);
/// [`Registration::shutdown`] does the same and waits for the revoke.
pub struct Registration {
    key: String,
    member_tx: watch::Sender<Member>,
    lease_rx: watch::Receiver<Option<i64>>,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
    dial_timeout: Duration,
}

impl Registration {
    /// Registers `member` under `<prefix><member.id>`. The first registration must succeed within
    /// the dial timeout; a process that cannot register at start is misconfigured, not unlucky.
    pub async fn start(cfg: EtcdConfig, member: Member) -> Result<Registration, DiscoveryError> {
        cfg.validate()?;
        if member.id.is_empty() || member.id.contains('/') {
            return Err(DiscoveryError::Config(format!(
                "member id {:?} must be a non-empty single key component",
                member.id
            )));
        }
        let key = format!("{}{}", cfg.normalized_prefix(), member.id);
        let session = Session::establish(&cfg, &key, &member).await?;
        tracing::info!(member = %member.id, lease = %hex(session.lease), ttl = ?session.ttl, "registered in etcd");

        let (member_tx, member_rx) = watch::channel(member);
        let (lease_tx, lease_rx) = watch::channel(Some(session.lease));
        let stop = CancellationToken::new();
        let dial_timeout = cfg.dial_timeout;
        let keeper = Keeper { cfg, key: key.clone(), member_rx, lease_tx, stop: stop.clone() };
        let task = tokio::spawn(keeper.run(session));
        Ok(Registration { key, member_tx, lease_rx, stop, task: Some(task), dial_timeout })
    }

    /// The etcd key this member lives under.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The member as currently registered (or about to be, after [`Registration::update`]).
    pub fn member(&self) -> Member {
        self.member_tx.borrow().clone()
    }

    /// The lease the member is registered under right now, or `None` while it is re-registering.
    /// Changes on every re-registration; useful for health reporting and diagnostics.
    pub fn lease_id(&self) -> Option<i64> {
        *self.lease_rx.borrow()
    }

    /// Publishes a new description (e.g. capacity changed), re-put under the current lease. The id
    /// is fixed for the life of a registration: a different `member.id` is ignored with a warning,
    /// as renaming would leave the old key behind until its lease expired.
    pub fn update(&self, mut member: Member) {
        self.member_tx.send_modify(|current| {
            if member.id != current.id {
                tracing::warn!(registered = %current.id, given = %member.id, "member id cannot change; keeping it");
                member.id.clone_from(&current.id);
            }
            *current = member;
        });
    }

    /// Stops the keep-alive and revokes the lease, so the member disappears from watchers at once
    /// instead of after the TTL. Waits at most about the dial timeout.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            // The task's revoke is bounded by the dial timeout; the margin covers scheduling.
            if tokio::time::timeout(self.dial_timeout + Duration::from_secs(1), task).await.is_err() {
                tracing::warn!(key = %self.key, "lease revoke did not finish in time; the lease will expire");
            }
        }
    }

    /// Test hook simulating a crash: stops keeping the lease alive without revoking it, so the
    /// member disappears only when etcd expires the lease (within the TTL), exactly as it would if
    /// the process had been killed.
    #[cfg(feature = "testing")]
    pub async fn abandon(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            // Aborting takes effect at the task's next await, which drops its etcd connection.
            let _ = task.await;
        }
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration").field("key", &self.key).field("lease", &self.lease_id()).finish()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One lease, with the member put under it.
struct Session {
    client: Client,
    lease: i64,
    /// As granted by etcd, which may raise a TTL below its minimum.
    ttl: Duration,
}

impl Session {
    async fn establish(cfg: &EtcdConfig, key: &str, member: &Member) -> Result<Session, DiscoveryError> {
        let value = serde_json::to_vec(member)?;
        let work = async {
            let mut client = cfg.connect().await?;
            let grant = client
                .lease_grant(cfg.ttl_secs(), None)
                .await
                .map_err(|source| DiscoveryError::Etcd { what: "lease grant", source })?;
            client
                .put(key, value, Some(PutOptions::new().with_lease(grant.id())))
                .await
                .map_err(|source| DiscoveryError::Etcd { what: "member put", source })?;
            let ttl = Duration::from_secs(u64::try_from(grant.ttl()).unwrap_or(1).max(1));
            Ok(Session { client, lease: grant.id(), ttl })
        };
        tokio::time::timeout(cfg.dial_timeout, work)
            .await
            .map_err(|_| DiscoveryError::Timeout { what: "registration", after: cfg.dial_timeout })?
    }
}

/// Why a keep-alive loop ended.
enum Ended {
    Stopped,
    Lost(String),
}

/// The background task behind a [`Registration`].
struct Keeper {
    cfg: EtcdConfig,
    key: String,
    member_rx: watch::Receiver<Member>,
    lease_tx: watch::Sender<Option<i64>>,
    stop: CancellationToken,
}

impl Keeper {
    async fn run(mut self, first: Session) {
        let mut backoff = Backoff::standard();
        let mut session = first;
        loop {
            self.lease_tx.send_replace(Some(session.lease));
            let began = Instant::now();
            let reason = match self.keep_alive(&mut session).await {
                Ended::Stopped => return self.revoke(Some(session.client), session.lease).await,
                Ended::Lost(reason) => reason,
            };
            self.lease_tx.send_replace(None);
            tracing::warn!(
                member = %self.member_id(), lease = %hex(session.lease), %reason,
                "etcd registration lost; re-registering under a new lease"
            );
            // A session that lived a while means etcd was healthy: retry quickly. One that died
            // young keeps the backoff growing, so a flapping etcd is not hammered.
            if began.elapsed() >= session.ttl {
                backoff.reset();
            }
            let old_lease = session.lease;
            session = loop {
                let delay = backoff.next_delay();
                tokio::select! {
                    () = self.stop.cancelled() => return self.revoke(None, old_lease).await,
                    () = tokio::time::sleep(delay) => {}
                }
                let member = self.member_rx.borrow_and_update().clone();
                let attempt = tokio::select! {
                    () = self.stop.cancelled() => return self.revoke(None, old_lease).await,
                    attempt = Session::establish(&self.cfg, &self.key, &member) => attempt,
                };
                match attempt {
                    Ok(new) => break new,
                    Err(error) => tracing::debug!(member = %member.id, %error, "re-registration failed; retrying"),
                }
            };
            tracing::info!(member = %self.member_id(), lease = %hex(session.lease), "re-registered in etcd");
        }
    }

    /// Keeps `session`'s lease alive until stopped or the lease is presumed lost.
    async fn keep_alive(&mut self, session: &mut Session) -> Ended {
        let ttl = session.ttl;
        let period = ttl / 3;
        let opened =
            bounded("lease keep-alive", self.cfg.dial_timeout.min(ttl), session.client.lease_keep_alive(session.lease))
                .await;
        let (mut keeper, mut acks) = match opened {
            Ok(stream) => stream,
            Err(error) => return Ended::Lost(error.to_string()),
        };
        // Opening the stream already refreshed the lease once.
        let mut last_ack = Instant::now();
        let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut unsaved = false;
        loop {
            tokio::select! {
                () = self.stop.cancelled() => return Ended::Stopped,
                _ = ticks.tick() => {
                    // A stream can stall without failing (a partitioned server); after a whole TTL
                    // without an answer etcd has expired the lease whatever the stream says.
                    if last_ack.elapsed() >= ttl {
                        return Ended::Lost(format!("no keep-alive answer for {ttl:?}"));
                    }
                    if let Err(error) = keeper.keep_alive().await {
                        return Ended::Lost(format!("keep-alive request failed: {error}"));
                    }
                    if unsaved {
                        unsaved = !self.put(session, period).await;
                    }
                }
                ack = acks.message() => match ack {
                    Ok(Some(ack)) if ack.ttl() > 0 => last_ack = Instant::now(),
                    Ok(Some(_)) => return Ended::Lost("etcd reports the lease expired".into()),
                    Ok(None) => return Ended::Lost("etcd closed the keep-alive stream".into()),
                    Err(error) => return Ended::Lost(format!("keep-alive stream failed: {error}")),
                },
                changed = self.member_rx.changed() => {
                    if changed.is_err() {
                        // The handle is gone; its drop also cancelled `stop`.
                        return Ended::Stopped;
                    }
                    unsaved = !self.put(session, period).await;
                }
            }
        }
    }

    /// Re-puts the current member under the session's lease; false if it has to be retried.
    async fn put(&mut self, session: &mut Session, limit: Duration) -> bool {
        let member = self.member_rx.borrow_and_update().clone();
        let value = match serde_json::to_vec(&member) {
            Ok(value) => value,
            Err(error) => {
                tracing::error!(member = %member.id, %error, "member update cannot be encoded; keeping the old one");
                return true;
            }
        };
        let options = Some(PutOptions::new().with_lease(session.lease));
        // Bounded by the keep-alive period so a slow put cannot starve the keep-alive.
        let limit = limit.min(self.cfg.dial_timeout);
        match bounded("member put", limit, session.client.put(self.key.as_str(), value, options)).await {
            Ok(_) => true,
            Err(error) => {
                tracing::warn!(member = %member.id, %error, "member update not stored yet; retrying");
                false
            }
        }
    }

    /// Revokes `lease` so the member disappears at once; best effort and bounded, since the lease
    /// expires on its own anyway.
    async fn revoke(&self, client: Option<Client>, lease: i64) {
        self.lease_tx.send_replace(None);
        let work = async {
            let mut client = match client {
                Some(client) => client,
                None => self.cfg.connect().await?,
            };
            client.lease_revoke(lease).await.map_err(|source| DiscoveryError::Etcd { what: "lease revoke", source })
        };
        match tokio::time::timeout(self.cfg.dial_timeout, work).await {
            Ok(Ok(_)) => tracing::info!(member = %self.member_id(), lease = %hex(lease), "deregistered from etcd"),
            Ok(Err(error)) => {
                tracing::warn!(member = %self.member_id(), %error, "lease revoke failed; the lease will expire")
            }
            Err(_) => tracing::warn!(member = %self.member_id(), "lease revoke timed out; the lease will expire"),
        }
    }

    fn member_id(&self) -> String {
        self.member_rx.borrow().id.clone()
    }
}

/// etcd tooling (`etcdctl lease list`) shows lease ids in hex.
fn hex(lease: i64) -> String {
    format!("{lease:x}")
}
