use std::time::Duration;

/// Why a discovery operation failed.
///
/// Only the start of a registration or a watch reports errors; once running, both retry forever
/// and log instead, so that an etcd outage never takes a serving process down.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("invalid discovery configuration: {0}")]
    Config(String),
    #[error("etcd {what} failed: {source}")]
    Etcd {
        what: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    #[error("etcd {what} did not complete within {after:?}")]
    Timeout { what: &'static str, after: Duration },
    #[error("member cannot be encoded as JSON: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("the membership source has stopped")]
    Closed,
}
