//! Service discovery: workers register themselves in etcd, the router watches the member list.
//!
//! Layout in etcd: one key per process, `<prefix><member id>`, whose value is the JSON of a
//! [`Member`] and which is attached to a lease the registering process keeps alive. A process that
//! dies stops keeping its lease alive, so etcd deletes its key within the lease TTL and watchers
//! drop it from placement without anyone having to notice the crash.
//!
//! Failure semantics: etcd being unreachable never stops a process. Registrations retry and
//! re-register under a fresh lease once etcd answers again; watchers keep serving the last known
//! membership and replace it with a fresh listing on reconnect.

mod backoff;
mod error;
mod etcd;
mod member;
mod membership;
mod register;
mod table;
mod watch;

pub use error::DiscoveryError;
pub use etcd::EtcdConfig;
pub use member::{Member, Role, new_member_id};
pub use membership::Membership;
pub use register::Registration;
pub use watch::watch;
