use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use super::DiscoveryError;

/// Where the cluster's etcd is and how registrations behave there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Key prefix of this cluster's members, e.g. `/sluice/<cluster>/members/`. A missing trailing
    /// `/` is added, so that cluster `a` never sees the members of cluster `ab`.
    pub prefix: String,
    /// How long a member outlives its last keep-alive: the bound on how long a crashed worker stays
    /// in placement. Whole seconds (rounded up); etcd may raise very small values to its minimum.
    pub lease_ttl: Duration,
    /// Bound on every single etcd request and on the first registration or listing.
    pub dial_timeout: Duration,
}

impl EtcdConfig {
    pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);
    pub const DEFAULT_DIAL_TIMEOUT: Duration = Duration::from_secs(3);

    /// A configuration with the default lease TTL and dial timeout.
    pub fn new(endpoints: Vec<String>, prefix: impl Into<String>) -> Self {
        Self {
            endpoints,
            prefix: prefix.into(),
            lease_ttl: Self::DEFAULT_LEASE_TTL,
            dial_timeout: Self::DEFAULT_DIAL_TIMEOUT,
        }
    }

    /// The conventional member prefix of cluster `cluster`: `/sluice/<cluster>/members/`.
    pub fn members_prefix(cluster: &str) -> String {
        format!("/sluice/{cluster}/members/")
    }

    pub(crate) fn validate(&self) -> Result<(), DiscoveryError> {
        if self.endpoints.is_empty() {
            return Err(DiscoveryError::Config("no etcd endpoints".into()));
        }
        if self.prefix.is_empty() || self.prefix == "/" {
            // Watching everything would mix unrelated keys into the member list.
            return Err(DiscoveryError::Config("the member prefix must not be empty or '/'".into()));
        }
        if self.dial_timeout.is_zero() {
            return Err(DiscoveryError::Config("the dial timeout must be positive".into()));
        }
        if self.lease_ttl.is_zero() {
            return Err(DiscoveryError::Config("the lease TTL must be positive".into()));
        }
        Ok(())
    }

    pub(crate) fn normalized_prefix(&self) -> String {
        if self.prefix.ends_with('/') { self.prefix.clone() } else { format!("{}/", self.prefix) }
    }

    pub(crate) fn ttl_secs(&self) -> i64 {
        let secs = self.lease_ttl.as_secs() + u64::from(self.lease_ttl.subsec_nanos() > 0);
        i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
    }

    /// A fresh client. Connecting is lazy, so this does not prove etcd is up; the first request
    /// does. Discovery tasks make a new client for every reconnection attempt rather than trusting
    /// a channel that went through an outage.
    pub(crate) async fn connect(&self) -> Result<Client, DiscoveryError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(self.dial_timeout)
            // Detects a silently dead server (a partition, not a crash) under an open watch or
            // keep-alive stream. etcd refuses pings more often than every 5 s by default.
            .with_keep_alive(Duration::from_secs(10), self.dial_timeout.max(Duration::from_secs(1)))
            // In a multi-node etcd, a member cut off from the leader would otherwise keep serving
            // stale watches; with this it cancels them and we reconnect elsewhere.
            .with_require_leader(true);
        bounded("connect", self.dial_timeout, Client::connect(&self.endpoints, Some(options))).await
    }
}

/// Runs one etcd call with a deadline: the client waits indefinitely for an endpoint to become
/// ready, and the failure semantics need every wait bounded.
pub(crate) async fn bounded<T>(
    what: &'static str,
    limit: Duration,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, DiscoveryError> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(DiscoveryError::Etcd { what, source }),
        Err(_) => Err(DiscoveryError::Timeout { what, after: limit }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_rounds_up_to_whole_seconds() {
        let mut cfg = EtcdConfig::new(vec!["http://127.0.0.1:2379".into()], "/sluice/t/members");
        assert_eq!(cfg.ttl_secs(), 5);
        cfg.lease_ttl = Duration::from_millis(1500);
        assert_eq!(cfg.ttl_secs(), 2);
        cfg.lease_ttl = Duration::from_millis(10);
        assert_eq!(cfg.ttl_secs(), 1);
    }

    #[test]
    fn prefix_gets_a_trailing_slash() {
        let cfg = EtcdConfig::new(vec!["http://127.0.0.1:2379".into()], "/sluice/t/members");
        assert_eq!(cfg.normalized_prefix(), "/sluice/t/members/");
        let cfg = EtcdConfig::new(vec!["http://127.0.0.1:2379".into()], EtcdConfig::members_prefix("t"));
        assert_eq!(cfg.normalized_prefix(), "/sluice/t/members/");
    }

    #[test]
    fn rejects_unusable_configurations() {
        let good = EtcdConfig::new(vec!["http://127.0.0.1:2379".into()], "/p/");
        assert!(good.validate().is_ok());
        assert!(EtcdConfig { endpoints: vec![], ..good.clone() }.validate().is_err());
        assert!(EtcdConfig { prefix: "/".into(), ..good.clone() }.validate().is_err());
        assert!(EtcdConfig { dial_timeout: Duration::ZERO, ..good.clone() }.validate().is_err());
        assert!(EtcdConfig { lease_ttl: Duration::ZERO, ..good }.validate().is_err());
    }
}
