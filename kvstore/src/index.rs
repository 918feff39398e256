//! The in-memory index: which records exist, where (queued for disk, or in a
//! segment), how blocks chain, when each was last used, and who is reading what.
//! Plain data; the store keeps it behind its lock.
//!
//! Eviction order (DESIGN §6): snapshots before pages, leaf blocks before the blocks
//! other cached blocks chain from, least recently used first, and never a record being
//! read.

use std::collections::HashMap;

use crate::record::{HEADER_LEN, Key, Kind, Payload, Pools};

/// Where a record's bytes are.
#[derive(Clone, Debug)]
pub enum Loc {
    /// Accepted, waiting for the writer (served from memory meanwhile).
    Queued(Payload),
    Disk {
        seg: u64,
        offset: u64,
    },
}

#[derive(Clone, Debug)]
pub struct Rec {
    pub loc: Loc,
    pub len: u64,
    pub checksum: u64,
    pub pools: Pools,
    /// Readers in progress; a pinned record is never evicted.
    pub pins: u32,
}

impl Rec {
    /// Bytes on disk (header + payload).
    pub fn total(&self) -> u64 {
        HEADER_LEN as u64 + self.len
    }

    pub fn disk(&self) -> Option<(u64, u64)> {
        match self.loc {
            Loc::Disk { seg, offset } => Some((seg, offset)),
            Loc::Queued(_) => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Block {
    pub parent: Option<Key>,
    pub depth: u32,
    pub page: Option<Rec>,
    pub snapshot: Option<Rec>,
    /// Last lookup or put that touched it (a logical clock).
    pub used: u64,
}

#[derive(Default)]
pub struct Index {
    blocks: HashMap<Key, Block>,
    /// Blocks with a page, by the key they chain from.
    kids: HashMap<Key, Vec<Key>>,
    clock: u64,
}

impl Index {
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    pub fn get(&self, key: &Key, kind: Kind) -> Option<&Rec> {
        let b = self.blocks.get(key)?;
        match kind {
            Kind::Page => b.page.as_ref(),
            Kind::Snapshot => b.snapshot.as_ref(),
            Kind::Tombstone => None,
        }
    }

    pub fn get_mut(&mut self, key: &Key, kind: Kind) -> Option<&mut Rec> {
        let b = self.blocks.get_mut(key)?;
        match kind {
            Kind::Page => b.page.as_mut(),
            Kind::Snapshot => b.snapshot.as_mut(),
            Kind::Tombstone => None,
        }
    }

    pub fn block(&self, key: &Key) -> Option<&Block> {
        self.blocks.get(key)
    }

    pub fn has(&self, key: &Key, kind: Kind) -> bool {
        self.get(key, kind).is_some()
    }

    /// Insert (or replace) a record; returns the record it replaced.
    pub fn insert(&mut self, key: Key, kind: Kind, parent: Option<Key>, depth: u32, rec: Rec) -> Option<Rec> {
        let used = self.tick();
        let b = self.blocks.entry(key).or_insert(Block { parent, depth, page: None, snapshot: None, used });
        b.used = used;
        let old = match kind {
            Kind::Page => {
                b.parent = parent;
                b.depth = depth;
                b.page.replace(rec)
            }
            Kind::Snapshot => b.snapshot.replace(rec),
            Kind::Tombstone => panic!("tombstones are not indexed"),
        };
        if kind == Kind::Page
            && old.is_none()
            && let Some(p) = parent
        {
            self.kids.entry(p).or_default().push(key);
        }
        old
    }

    /// Remove one record; the block goes when it holds nothing any more.
    pub fn remove(&mut self, key: &Key, kind: Kind) -> Option<Rec> {
        let b = self.blocks.get_mut(key)?;
        let rec = match kind {
            Kind::Page => b.page.take(),
            Kind::Snapshot => b.snapshot.take(),
            Kind::Tombstone => None,
        }?;
        let parent = b.parent;
        let empty = b.page.is_none() && b.snapshot.is_none();
        if kind == Kind::Page
            && let Some(p) = parent
            && let Some(k) = self.kids.get_mut(&p)
        {
            k.retain(|c| c != key);
            if k.is_empty() {
                self.kids.remove(&p);
            }
        }
        if empty {
            self.blocks.remove(key);
        }
        Some(rec)
    }

    /// Blocks chained from `key` that have pages.
    pub fn children(&self, key: &Key) -> usize {
        self.kids.get(key).map_or(0, Vec::len)
    }

    /// The longest run of leading `keys` with pages, and the boundaries (1-based, up
    /// to that run) with snapshots. Marks what it found as used.
    pub fn lookup(&mut self, keys: &[Key]) -> (usize, Vec<usize>) {
        let mut n = 0;
        let mut snapshots = Vec::new();
        for key in keys {
            let used = self.tick();
            let Some(b) = self.blocks.get_mut(key) else { break };
            if b.page.is_none() {
                break;
            }
            b.used = used;
            n += 1;
            if b.snapshot.is_some() {
                snapshots.push(n);
            }
        }
        (n, snapshots)
    }

    /// The next record to evict, or `None` when every candidate is being read.
    pub fn victim(&self) -> Option<(Key, Kind)> {
        let free = |r: &Option<Rec>| r.as_ref().is_none_or(|r| r.pins == 0);
        let snapshot = self
            .blocks
            .iter()
            .filter(|(_, b)| b.snapshot.as_ref().is_some_and(|r| r.pins == 0))
            .min_by_key(|(k, b)| (b.used, **k));
        if let Some((k, _)) = snapshot {
            return Some((*k, Kind::Snapshot));
        }
        self.blocks
            .iter()
            .filter(|(k, b)| b.page.is_some() && free(&b.page) && free(&b.snapshot) && self.children(k) == 0)
            .min_by_key(|(k, b)| (b.used, **k))
            .map(|(k, _)| (*k, Kind::Page))
    }

    /// `key` and every block chained after it.
    pub fn subtree(&self, key: &Key) -> Vec<Key> {
        let mut out = Vec::new();
        let mut stack = vec![*key];
        while let Some(k) = stack.pop() {
            if self.blocks.contains_key(&k) {
                out.push(k);
            }
            if let Some(kids) = self.kids.get(&k) {
                stack.extend(kids.iter().copied());
            }
        }
        out
    }

    /// Every key with a record.
    pub fn keys(&self) -> Vec<Key> {
        self.blocks.keys().copied().collect()
    }

    /// Every record: `(key, kind, record)`.
    pub fn records(&self) -> impl Iterator<Item = (&Key, Kind, &Rec)> {
        self.blocks.iter().flat_map(|(k, b)| {
            b.page.iter().map(move |r| (k, Kind::Page, r)).chain(b.snapshot.iter().map(move |r| (k, Kind::Snapshot, r)))
        })
    }

    /// Remove what no lookup can reach any more: snapshots without their page, and
    /// pages whose parent block has no page (after a crash or a partial eviction).
    /// Returns the removed records.
    pub fn prune_unreachable(&mut self) -> Vec<(Key, Kind, Rec)> {
        let mut removed = Vec::new();
        loop {
            let doomed: Vec<(Key, Kind)> = self
                .blocks
                .iter()
                .flat_map(|(k, b)| {
                    let orphan_page = b.page.is_some()
                        && b.parent.is_some_and(|p| self.blocks.get(&p).is_none_or(|pb| pb.page.is_none()));
                    let orphan_snapshot = b.snapshot.is_some() && (b.page.is_none() || orphan_page);
                    let mut v = Vec::new();
                    if orphan_page {
                        v.push((*k, Kind::Page));
                    }
                    if orphan_snapshot {
                        v.push((*k, Kind::Snapshot));
                    }
                    v
                })
                .collect();
            if doomed.is_empty() {
                return removed;
            }
            for (k, kind) in doomed {
                if let Some(r) = self.remove(&k, kind) {
                    removed.push((k, kind, r));
                }
            }
        }
    }

    /// Pages, snapshots and stored bytes per pool.
    pub fn totals(&self) -> (u64, u64, Pools) {
        let (mut pages, mut snapshots, mut pools) = (0, 0, Pools::default());
        for (_, kind, r) in self.records() {
            match kind {
                Kind::Page => pages += 1,
                _ => snapshots += 1,
            }
            pools.csa_main += r.pools.csa_main;
            pools.csa_indexer += r.pools.csa_indexer;
            pools.hca += r.pools.hca;
            pools.swa += r.pools.swa;
        }
        (pages, snapshots, pools)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(len: u64) -> Rec {
        Rec { loc: Loc::Disk { seg: 1, offset: 0 }, len, checksum: 0, pools: Pools::default(), pins: 0 }
    }

    fn k(i: u8) -> Key {
        [i; 32]
    }

    /// Two prompts sharing block 1: 1 → 2 → 3 and 1 → 4.
    fn tree() -> Index {
        let mut ix = Index::default();
        ix.insert(k(1), Kind::Page, None, 0, rec(10));
        ix.insert(k(2), Kind::Page, Some(k(1)), 1, rec(10));
        ix.insert(k(3), Kind::Page, Some(k(2)), 2, rec(10));
        ix.insert(k(4), Kind::Page, Some(k(1)), 1, rec(10));
        ix.insert(k(3), Kind::Snapshot, None, 0, rec(100));
        ix.insert(k(1), Kind::Snapshot, None, 0, rec(100));
        ix
    }

    #[test]
    fn lookup_finds_the_longest_run_and_its_snapshots() {
        let mut ix = tree();
        assert_eq!(ix.lookup(&[k(1), k(2), k(3), k(9)]), (3, vec![1, 3]));
        assert_eq!(ix.lookup(&[k(1), k(4)]), (2, vec![1]));
        assert_eq!(ix.lookup(&[k(2)]), (1, vec![]), "keys are chained hashes: any key stands for its prefix");
        assert_eq!(ix.lookup(&[k(9), k(1)]), (0, vec![]));
        assert_eq!(ix.children(&k(1)), 2);
    }

    #[test]
    fn eviction_takes_snapshots_then_leaves_least_recently_used_and_never_pinned() {
        let mut ix = tree();
        ix.lookup(&[k(1), k(4)]); // 4 is now more recent than 3
        let mut order = Vec::new();
        ix.get_mut(&k(1), Kind::Snapshot).unwrap().pins = 1;
        while let Some((key, kind)) = ix.victim() {
            order.push((key[0], kind));
            ix.remove(&key, kind);
            if order.len() == 2 {
                ix.get_mut(&k(1), Kind::Snapshot).unwrap().pins = 0;
            }
        }
        assert_eq!(
            order,
            vec![
                (3, Kind::Snapshot), // snapshots first (1's is pinned)
                (3, Kind::Page),     // then the least recently used leaf
                (1, Kind::Snapshot), // unpinned now: snapshots before pages again
                (2, Kind::Page),     // a leaf once 3 went
                (4, Kind::Page),
                (1, Kind::Page), // the shared parent last
            ]
        );
        assert!(ix.is_empty());
    }

    #[test]
    fn subtrees_and_unreachable_records() {
        let mut ix = tree();
        let mut sub = ix.subtree(&k(2));
        sub.sort();
        assert_eq!(sub, vec![k(2), k(3)]);
        assert_eq!(ix.subtree(&k(1)).len(), 4);
        // Losing block 2's page strands block 3 (and its snapshot).
        ix.remove(&k(2), Kind::Page);
        ix.insert(k(7), Kind::Snapshot, None, 0, rec(1)); // a snapshot without a page
        let mut pruned: Vec<(u8, Kind)> = ix.prune_unreachable().iter().map(|(k, kind, _)| (k[0], *kind)).collect();
        pruned.sort();
        assert_eq!(pruned, vec![(3, Kind::Page), (3, Kind::Snapshot), (7, Kind::Snapshot)]);
        assert_eq!(ix.totals().0, 2);
        assert!(ix.prune_unreachable().is_empty());
    }
}
