use std::fmt;

use serde::{Deserialize, Serialize};

use super::backoff::random_u64;

/// What a process does in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Router,
    Prefill,
    Decode,
    Kvstore,
}

impl Role {
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Router => "router",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Kvstore => "kvstore",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One process of the cluster as the others see it; stored as JSON under `<prefix><id>`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Member {
    /// Unique per process (see [`new_member_id`]); also the last component of the etcd key.
    pub id: String,
    pub role: Role,
    /// gRPC endpoint, e.g. `http://127.0.0.1:5001`.
    pub grpc_addr: String,
    /// Base64 of the UCX worker address (opaque bytes), for processes that move KV pages.
    #[serde(default)]
    pub ucx_address: Option<String>,
    /// Served model name.
    pub model: String,
    /// Hex model fingerprint; peers must agree on it before exchanging KV pages.
    pub fingerprint: String,
    /// Role-specific numbers (pages, batch, token budget); opaque to discovery. Defaults to null
    /// so that members written by a version without it still parse.
    #[serde(default)]
    pub capacity: serde_json::Value,
}

/// A member id unique per process: `<role>-<host>-<pid>-<random>`.
///
/// The random part keeps a restarted process that got the same pid from taking over the key of
/// its predecessor, whose lease may still be alive.
pub fn new_member_id(role: Role) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    // Keys are paths; keep the id a single clean component.
    let host: String = host.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect();
    format!("{role}-{host}-{}-{:08x}", std::process::id(), random_u64() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_json_round_trips_with_lowercase_roles() {
        let m = Member {
            id: "decode-h-1-0".into(),
            role: Role::Decode,
            grpc_addr: "http://127.0.0.1:5001".into(),
            ucx_address: Some("AAEC".into()),
            model: "m".into(),
            fingerprint: "ab".into(),
            capacity: serde_json::json!({"pages": 10}),
        };
        let json = serde_json::to_value(&m).unwrap();
        assert_eq!(json["role"], "decode");
        assert_eq!(serde_json::from_value::<Member>(json).unwrap(), m);
    }

    #[test]
    fn member_ids_are_unique_and_start_with_the_role() {
        let a = new_member_id(Role::Prefill);
        let b = new_member_id(Role::Prefill);
        assert!(a.starts_with("prefill-"), "{a}");
        assert!(!a.contains('/'), "{a}");
        assert_ne!(a, b);
    }
}
