//! The decode worker's reservations: pages and a state slot held for a request while
//! a prefill worker writes into them, until decoding starts or they are given back.
//!
//! A reservation whose writer may still be writing is never freed early: given back
//! before its prefill worker confirmed it stopped, it is quarantined until its lease
//! ends, so a late write cannot land in pages another request already owns.

use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Handed out; a prefill worker may be writing.
    Reserved,
    /// Written and verified; waiting for its decode request.
    Committed { tokens: usize },
    /// Given back while a writer may still write; freed when the lease ends.
    Quarantined,
}

#[derive(Debug)]
pub struct Entry<S> {
    pub seq: S,
    pub state: State,
    pub deadline: Instant,
    pub request_id: String,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
}

#[derive(Debug, PartialEq, Eq)]
pub enum TableError {
    Unknown(String),
    LeaseEnded(String),
    WrongState { id: String, state: State, wanted: &'static str },
}

impl std::fmt::Display for TableError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TableError::Unknown(id) => write!(f, "reservation {id} does not exist (expired or already used)"),
            TableError::LeaseEnded(id) => write!(f, "the lease of reservation {id} ended; its pages are reclaimed"),
            TableError::WrongState { id, state, wanted } => {
                write!(f, "reservation {id} is {state:?}, expected {wanted}")
            }
        }
    }
}

pub struct Table<S> {
    entries: HashMap<String, Entry<S>>,
    lease: Duration,
    next_id: u64,
}

impl<S> Table<S> {
    pub fn new(lease: Duration) -> Self {
        Table { entries: HashMap::new(), lease, next_id: 0 }
    }

    /// Add a reservation; returns its id.
    pub fn insert(
        &mut self,
        seq: S,
        request_id: &str,
        prompt_tokens: usize,
        max_tokens: usize,
        now: Instant,
    ) -> String {
        self.next_id += 1;
        let id = format!("r{}-{}", self.next_id, request_id);
        let entry = Entry {
            seq,
            state: State::Reserved,
            deadline: now + self.lease,
            request_id: request_id.to_string(),
            prompt_tokens,
            max_tokens,
        };
        self.entries.insert(id.clone(), entry);
        id
    }

    pub fn get(&self, id: &str) -> Result<&Entry<S>, TableError> {
        self.entries.get(id).ok_or_else(|| TableError::Unknown(id.to_string()))
    }

    pub fn get_mut(&mut self, id: &str) -> Result<&mut Entry<S>, TableError> {
        self.entries.get_mut(id).ok_or_else(|| TableError::Unknown(id.to_string()))
    }

    /// A reservation its writer may still commit: reserved, and within its lease (a
    /// commit after the lease is refused even before the expiry sweep reclaims it).
    pub fn writable(&self, id: &str, now: Instant) -> Result<&Entry<S>, TableError> {
        let e = self.get(id)?;
        if e.state != State::Reserved {
            return Err(TableError::WrongState { id: id.into(), state: e.state, wanted: "Reserved" });
        }
        if e.deadline <= now {
            return Err(TableError::LeaseEnded(id.into()));
        }
        Ok(e)
    }

    /// The writer finished: the bytes for `tokens` tokens are in place. The decode
    /// request must follow within a lease.
    pub fn commit(&mut self, id: &str, tokens: usize, now: Instant) -> Result<&mut Entry<S>, TableError> {
        let lease = self.lease;
        self.writable(id, now)?;
        let e = self.get_mut(id)?;
        e.state = State::Committed { tokens };
        e.deadline = now + lease;
        Ok(e)
    }

    /// Give a reservation back. Returns the sequence to free now, or `None` when it is
    /// quarantined until its lease ends (a writer may still write).
    pub fn release(&mut self, id: &str, writer_done: bool) -> Result<Option<S>, TableError> {
        let e = self.get_mut(id)?;
        let free_now = writer_done || matches!(e.state, State::Committed { .. });
        if free_now {
            Ok(self.entries.remove(id).map(|e| e.seq))
        } else {
            e.state = State::Quarantined;
            Ok(None)
        }
    }

    /// Take a committed reservation to decode it.
    pub fn take_committed(&mut self, id: &str) -> Result<(Entry<S>, usize), TableError> {
        match self.get(id)?.state {
            State::Committed { tokens } => Ok((self.entries.remove(id).expect("present"), tokens)),
            state => Err(TableError::WrongState { id: id.into(), state, wanted: "Committed" }),
        }
    }

    /// Remove every entry whose lease has ended; their sequences are to be freed.
    pub fn expire(&mut self, now: Instant) -> Vec<(String, Entry<S>)> {
        let ids: Vec<String> = self.entries.iter().filter(|(_, e)| e.deadline <= now).map(|(k, _)| k.clone()).collect();
        ids.into_iter().filter_map(|id| self.entries.remove(&id).map(|e| (id, e))).collect()
    }

    /// The earliest lease end, for sleeping until the next expiry.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.entries.values().map(|e| e.deadline).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle_and_quarantine() {
        let t0 = Instant::now();
        let lease = Duration::from_secs(10);
        let mut t: Table<u32> = Table::new(lease);
        let a = t.insert(1, "req-a", 100, 16, t0);
        let b = t.insert(2, "req-b", 50, 8, t0);
        assert_ne!(a, b);

        assert!(matches!(t.take_committed(&a), Err(TableError::WrongState { .. })), "not committed yet");
        t.commit(&a, 100, t0 + Duration::from_secs(1)).unwrap();
        assert!(matches!(t.commit(&a, 100, t0), Err(TableError::WrongState { .. })), "double commit");
        let (e, tokens) = t.take_committed(&a).unwrap();
        assert_eq!((e.seq, tokens), (1, 100));
        assert_eq!(t.take_committed(&a).unwrap_err(), TableError::Unknown(a.clone()));

        // Given back while the writer may still write: quarantined, freed at lease end only.
        assert_eq!(t.release(&b, false).unwrap(), None);
        assert_eq!(t.get(&b).unwrap().state, State::Quarantined);
        assert!(t.expire(t0 + Duration::from_secs(9)).is_empty());
        let gone = t.expire(t0 + lease);
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].1.seq, 2);
        assert_eq!(t.next_deadline(), None);

        // Writer known to be done: freed at once.
        let c = t.insert(3, "req-c", 10, 1, t0);
        assert_eq!(t.release(&c, true).unwrap(), Some(3));
    }

    #[test]
    fn a_commit_after_the_lease_is_refused_even_before_the_sweep() {
        let t0 = Instant::now();
        let mut t: Table<u32> = Table::new(Duration::from_secs(5));
        let a = t.insert(1, "r", 1, 1, t0);
        assert!(t.writable(&a, t0 + Duration::from_secs(4)).is_ok());
        assert_eq!(t.commit(&a, 1, t0 + Duration::from_secs(5)).unwrap_err(), TableError::LeaseEnded(a.clone()));
        assert_eq!(t.get(&a).unwrap().state, State::Reserved, "a refused commit changes nothing");
        assert!(matches!(t.writable("r99-nope", t0), Err(TableError::Unknown(_))));
    }

    #[test]
    fn committed_reservations_expire_if_nobody_decodes_them() {
        let t0 = Instant::now();
        let mut t: Table<u32> = Table::new(Duration::from_secs(5));
        let a = t.insert(7, "r", 1, 1, t0);
        t.commit(&a, 1, t0 + Duration::from_secs(4)).unwrap();
        assert!(t.expire(t0 + Duration::from_secs(6)).is_empty(), "commit renews the lease");
        assert_eq!(t.next_deadline(), Some(t0 + Duration::from_secs(9)));
        assert_eq!(t.expire(t0 + Duration::from_secs(9)).len(), 1);
    }
}
