use std::fmt;
use std::sync::Arc;

use tokio::sync::watch;

use super::{DiscoveryError, Member, Role};

/// A live view of the members of the cluster.
///
/// Cheap to clone; all clones see the same list. An etcd-fed view stops its background watcher
/// once the last clone is dropped.
#[derive(Clone)]
pub struct Membership {
    rx: watch::Receiver<Vec<Member>>,
    /// Keeps the channel of a static list open, so that [`Membership::changed`] waits forever
    /// instead of reporting a closed source.
    _fixed: Option<Arc<watch::Sender<Vec<Member>>>>,
}

impl Membership {
    pub(crate) fn from_receiver(rx: watch::Receiver<Vec<Member>>) -> Self {
        Self { rx, _fixed: None }
    }

    /// A static list (`--peers`, single-machine use) that never changes.
    pub fn fixed(members: Vec<Member>) -> Membership {
        let (tx, rx) = watch::channel(members);
        Self { rx, _fixed: Some(Arc::new(tx)) }
    }

    /// All members, in id order for etcd-fed views, in the given order for a fixed list.
    pub fn current(&self) -> Vec<Member> {
        self.rx.borrow().clone()
    }

    pub fn of_role(&self, role: Role) -> Vec<Member> {
        self.rx.borrow().iter().filter(|m| m.role == role).cloned().collect()
    }

    pub fn get(&self, id: &str) -> Option<Member> {
        self.rx.borrow().iter().find(|m| m.id == id).cloned()
    }

    /// Waits until the list differs from the one this handle last saw through `changed` or
    /// `wait_for`. Errors only if the watcher task is gone (its runtime shut down).
    pub async fn changed(&mut self) -> Result<(), DiscoveryError> {
        self.rx.changed().await.map_err(|_| DiscoveryError::Closed)
    }

    /// Waits until the list satisfies `pred` (checked at once, then on every change) and returns
    /// that list. Callers bound the wait themselves, e.g. with `tokio::time::timeout`.
    pub async fn wait_for(&mut self, mut pred: impl FnMut(&[Member]) -> bool) -> Result<Vec<Member>, DiscoveryError> {
        let members = self.rx.wait_for(|members| pred(members)).await.map_err(|_| DiscoveryError::Closed)?;
        Ok(members.clone())
    }
}

impl fmt::Debug for Membership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<String> = self.rx.borrow().iter().map(|m| m.id.clone()).collect();
        f.debug_struct("Membership").field("members", &ids).field("fixed", &self._fixed.is_some()).finish()
    }
}
