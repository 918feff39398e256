use etcd_client::{Client, EventType, GetOptions, GetResponse, WatchOptions};
use tokio::sync::watch;

use super::backoff::Backoff;
use super::etcd::bounded;
use super::table::MemberTable;
use super::{DiscoveryError, EtcdConfig, Member, Membership};

/// Watches all members under the configured prefix.
///
/// The initial listing must succeed within the dial timeout. Afterwards a background task follows
/// etcd's events; when the watch breaks it keeps publishing the last known list (serving goes on
/// with what it knew), retries with backoff and, once etcd answers, replaces the list with a fresh
/// listing, so members that died during the outage disappear. The task ends when the last clone
/// of the returned [`Membership`] is dropped.
pub async fn watch(cfg: EtcdConfig) -> Result<Membership, DiscoveryError> {
    cfg.validate()?;
    let prefix = cfg.normalized_prefix();
    let mut table = MemberTable::new(prefix.clone());
    let (client, listing) = list(&cfg, &prefix).await?;
    table.replace(listing.kvs().iter().map(|kv| (kv.key(), kv.value())));
    let (tx, rx) = watch::channel(table.members());
    tracing::info!(%prefix, members = tx.borrow().len(), "watching cluster membership in etcd");
    let watcher = Watcher { cfg, prefix, table, tx };
    tokio::spawn(watcher.run(client, revision(&listing)));
    Ok(Membership::from_receiver(rx))
}

/// One bounded listing of the prefix, on a fresh client that the following watch then uses.
async fn list(cfg: &EtcdConfig, prefix: &str) -> Result<(Client, GetResponse), DiscoveryError> {
    let work = async {
        let mut client = cfg.connect().await?;
        let listing = client
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|source| DiscoveryError::Etcd { what: "member listing", source })?;
        Ok((client, listing))
    };
    tokio::time::timeout(cfg.dial_timeout, work)
        .await
        .map_err(|_| DiscoveryError::Timeout { what: "member listing", after: cfg.dial_timeout })?
}

fn revision(listing: &GetResponse) -> i64 {
    listing.header().map_or(0, |header| header.revision())
}

/// How following the event stream ended.
enum Flow {
    /// Every [`Membership`] is gone; nobody needs the list any more.
    Stopped,
    Broken(String),
}

/// The background task behind an etcd-fed [`Membership`].
struct Watcher {
    cfg: EtcdConfig,
    prefix: String,
    table: MemberTable,
    tx: watch::Sender<Vec<Member>>,
}

impl Watcher {
    async fn run(mut self, mut client: Client, mut listed_at: i64) {
        let mut backoff = Backoff::standard();
        loop {
            match self.follow(&mut client, listed_at + 1, &mut backoff).await {
                Flow::Stopped => return,
                Flow::Broken(reason) => tracing::warn!(
                    prefix = %self.prefix, %reason,
                    "membership watch interrupted; serving the last known membership"
                ),
            }
            loop {
                let delay = backoff.next_delay();
                tokio::select! {
                    () = self.tx.closed() => return,
                    () = tokio::time::sleep(delay) => {}
                }
                let attempt = tokio::select! {
                    () = self.tx.closed() => return,
                    attempt = list(&self.cfg, &self.prefix) => attempt,
                };
                match attempt {
                    Ok((fresh, listing)) => {
                        client = fresh;
                        listed_at = revision(&listing);
                        if self.table.replace(listing.kvs().iter().map(|kv| (kv.key(), kv.value()))) {
                            self.tx.send_replace(self.table.members());
                        }
                        tracing::info!(
                            prefix = %self.prefix, members = self.tx.borrow().len(),
                            "membership watch re-established"
                        );
                        break;
                    }
                    Err(error) => {
                        tracing::debug!(prefix = %self.prefix, %error, "membership re-listing failed; retrying")
                    }
                }
            }
        }
    }

    /// Applies the events from revision `from` on until the watch breaks or nobody listens.
    async fn follow(&mut self, client: &mut Client, from: i64, backoff: &mut Backoff) -> Flow {
        let options = WatchOptions::new().with_prefix().with_start_revision(from);
        let opened = tokio::select! {
            () = self.tx.closed() => return Flow::Stopped,
            opened = bounded("watch", self.cfg.dial_timeout, client.watch(self.prefix.as_str(), Some(options))) => opened,
        };
        let mut stream = match opened {
            Ok(stream) => stream,
            Err(error) => return Flow::Broken(error.to_string()),
        };
        loop {
            let message = tokio::select! {
                () = self.tx.closed() => return Flow::Stopped,
                message = stream.message() => message,
            };
            let response = match message {
                Ok(Some(response)) => response,
                Ok(None) => return Flow::Broken("etcd closed the watch stream".into()),
                Err(error) => return Flow::Broken(format!("watch stream failed: {error}")),
            };
            if response.canceled() {
                // E.g. compaction past our revision, or the etcd member lost its leader.
                return Flow::Broken(format!(
                    "etcd cancelled the watch: {:?} (compact revision {})",
                    response.cancel_reason(),
                    response.compact_revision()
                ));
            }
            if response.created() {
                backoff.reset();
            }
            let mut changed = false;
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                changed |= match event.event_type() {
                    EventType::Put => self.table.put(kv.key(), kv.value()),
                    EventType::Delete => self.table.delete(kv.key()),
                };
            }
            if changed {
                self.tx.send_replace(self.table.members());
            }
        }
    }
}
