//! The live TLS material of a process, re-read when its files change: a bounded poll
//! that compares the files' digests (a renewed Kubernetes secret swaps the files under
//! the mount; cert-manager renews before expiry). Digests rather than modification
//! times: a file rewritten within one tick of a coarse file-system clock, at the same
//! length, is still seen. New handshakes use the new certificate and trust roots; open
//! connections keep theirs.
//!
//! Files caught half-written (a certificate without its new key yet) fail to load: the
//! old material stays in use and the load is tried again at the next poll.

use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::TlsError;
use super::material::{Material, Paths};

/// What a poll sees of one file: the SHA-256 of its bytes (`None`: unreadable).
pub type FileStamp = Option<[u8; 32]>;

/// The stamps of the files (a few small reads).
pub fn stamps(paths: &Paths) -> Vec<FileStamp> {
    paths.all().iter().map(|p| std::fs::read(p).ok().map(|b| Sha256::digest(&b).into())).collect()
}

/// When to load again (pure): whenever the files differ from what was loaded last; a
/// failed load is retried at every poll until it succeeds, and reported once per change.
#[derive(Debug, Default)]
pub struct Watch {
    loaded: Vec<FileStamp>,
    failed: Option<Vec<FileStamp>>,
}

impl Watch {
    pub fn new(loaded: Vec<FileStamp>) -> Self {
        Watch { loaded, failed: None }
    }

    /// Whether files with `now`'s stamps should be loaded.
    pub fn changed(&self, now: &[FileStamp]) -> bool {
        self.loaded != now
    }

    pub fn loaded(&mut self, now: Vec<FileStamp>) {
        self.loaded = now;
        self.failed = None;
    }

    /// A load of `now` failed; returns whether this is news (worth a warning).
    pub fn failed(&mut self, now: Vec<FileStamp>) -> bool {
        let news = self.failed.as_ref() != Some(&now);
        self.failed = Some(now);
        news
    }
}

/// The material in use now, and how to refresh it.
#[derive(Debug)]
pub struct Live {
    paths: Paths,
    current: RwLock<Arc<Material>>,
    watch: Mutex<Watch>,
}

impl Live {
    pub fn load(paths: Paths) -> Result<Arc<Self>, TlsError> {
        let before = stamps(&paths);
        let material = Material::load(&paths)?;
        Ok(Arc::new(Live { paths, current: RwLock::new(Arc::new(material)), watch: Mutex::new(Watch::new(before)) }))
    }

    pub fn paths(&self) -> &Paths {
        &self.paths
    }

    pub fn current(&self) -> Arc<Material> {
        self.current.read().expect("not poisoned").clone()
    }

    /// Load the files again if they changed since the last load; `Ok(true)` when new
    /// material is in use.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let now = stamps(&self.paths);
        let mut watch = self.watch.lock().expect("not poisoned");
        if !watch.changed(&now) {
            return Ok(false);
        }
        match Material::load(&self.paths) {
            Ok(m) => {
                let old = std::mem::replace(&mut *self.current.write().expect("not poisoned"), Arc::new(m));
                watch.loaded(now);
                tracing::info!(
                    was = %old.fingerprint,
                    now = %self.current().fingerprint,
                    "TLS certificate files changed: new handshakes use the new material"
                );
                Ok(true)
            }
            Err(e) => {
                if watch.failed(now) {
                    tracing::warn!(error = %e, "TLS certificate files changed but do not load; still serving the old ones");
                }
                Err(e)
            }
        }
    }

    /// Poll the files every `every` for as long as this `Live` is in use.
    pub fn spawn_watch(self: &Arc<Self>, every: Duration) {
        let weak: Weak<Live> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(live) = weak.upgrade() else { break };
                // Reading a few small files: cheap, but blocking.
                let _ = tokio::task::spawn_blocking(move || live.reload_if_changed()).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::generate::Ca;

    fn t(s: u8) -> [u8; 32] {
        [s; 32]
    }

    #[test]
    fn loads_on_change_and_retries_a_failed_load_reporting_it_once() {
        let a = vec![Some(t(1)), Some(t(2)), Some(t(3))];
        let mut w = Watch::new(a.clone());
        assert!(!w.changed(&a));
        let half = vec![Some(t(4)), Some(t(2)), Some(t(3))];
        assert!(w.changed(&half));
        assert!(w.failed(half.clone()), "first failure is news");
        assert!(w.changed(&half), "retried at the next poll");
        assert!(!w.failed(half.clone()), "the same failure is not reported again");
        let whole = vec![Some(t(4)), Some(t(5)), Some(t(3))];
        assert!(w.changed(&whole));
        w.loaded(whole.clone());
        assert!(!w.changed(&whole));
        let gone = vec![None, Some(t(5)), Some(t(3))];
        assert!(w.changed(&gone));
        assert!(w.failed(gone));
    }

    #[test]
    fn replaced_files_are_picked_up_and_broken_ones_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new("reload CA").unwrap();
        let first = ca.issue(&["svc.test".into()]).unwrap();
        first.write(dir.path(), &ca).unwrap();
        let live = Live::load(Paths::in_dir(dir.path())).unwrap();
        let was = live.current().fingerprint.clone();
        assert!(!live.reload_if_changed().unwrap(), "nothing changed");

        let second = ca.issue(&["svc.test".into()]).unwrap();
        // A certificate whose key has not arrived yet: the old material stays.
        std::fs::write(dir.path().join("tls.crt"), &second.cert_pem).unwrap();
        assert!(live.reload_if_changed().is_err());
        assert_eq!(live.current().fingerprint, was);
        std::fs::write(dir.path().join("tls.key"), &second.key_pem).unwrap();
        assert!(live.reload_if_changed().unwrap());
        assert_ne!(live.current().fingerprint, was);
        assert_eq!(live.current().fingerprint, second.fingerprint());
    }
}
