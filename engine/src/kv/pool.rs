//! Allocators for the two KV pools: pages (one 128-token block of compressed entries
//! each, reference-counted so full prefix blocks can be shared) and state-cache slots
//! (one per running sequence). Plain data structures; the backend memory they index
//! lives in [`super::KvCache`].

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PoolError {
    #[error("out of KV pages: {wanted} needed, {free} free of {total}")]
    OutOfPages { wanted: usize, free: usize, total: usize },
    #[error("no free sequence slot: all {total} are in use")]
    NoFreeSlot { total: usize },
}

/// Pages split into equal contiguous blocks, one per device (`ranks`): page `p` lives
/// on device `p / (total / ranks)`, and a sequence's pages all come from its device.
#[derive(Debug)]
pub struct PagePool {
    /// Free ids per device, popped from the end (lowest id first).
    free: Vec<Vec<u32>>,
    refs: Vec<u32>,
}

impl PagePool {
    /// `total` pages on one device.
    pub fn new(total: usize) -> Self {
        Self::split(total, 1)
    }

    /// `total` pages over `ranks` devices (`total` a multiple of `ranks`).
    pub fn split(total: usize, ranks: usize) -> Self {
        assert!(ranks > 0 && total.is_multiple_of(ranks), "{total} pages do not divide over {ranks} devices");
        let per = total / ranks;
        let free = (0..ranks).map(|r| (r * per..(r + 1) * per).rev().map(|p| p as u32).collect()).collect();
        PagePool { free, refs: vec![0; total] }
    }

    pub fn ranks(&self) -> usize {
        self.free.len()
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    pub fn free(&self) -> usize {
        self.free.iter().map(Vec::len).sum()
    }

    /// Free pages on device `rank`.
    pub fn free_on(&self, rank: usize) -> usize {
        self.free[rank].len()
    }

    pub fn used(&self) -> usize {
        self.total() - self.free()
    }

    /// Device of page `id`.
    pub fn rank_of(&self, id: u32) -> usize {
        id as usize / (self.total() / self.ranks())
    }

    /// `n` fresh pages, each with one reference; all or nothing. One device only.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<u32>, PoolError> {
        assert_eq!(self.ranks(), 1, "pages of a pool split over devices come from one device: alloc_on");
        self.alloc_on(0, n)
    }

    /// `n` fresh pages of device `rank`, each with one reference; all or nothing.
    pub fn alloc_on(&mut self, rank: usize, n: usize) -> Result<Vec<u32>, PoolError> {
        let free = &mut self.free[rank];
        if n > free.len() {
            return Err(PoolError::OutOfPages {
                wanted: n,
                free: free.len(),
                total: self.refs.len() / self.free.len(),
            });
        }
        let ids = free.split_off(free.len() - n);
        for &id in &ids {
            self.refs[id as usize] = 1;
        }
        Ok(ids.into_iter().rev().collect())
    }

    /// Another holder of an allocated page (a sequence sharing a cached prefix block).
    pub fn retain(&mut self, id: u32) {
        let r = &mut self.refs[id as usize];
        assert!(*r > 0, "retain of free page {id}");
        *r += 1;
    }

    /// Drop one reference to each page; pages nobody holds return to the free list.
    /// They go back last first, so a run released together is handed out again as the
    /// same ascending run (a transfer puts contiguous pages as one).
    pub fn release(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            let r = &mut self.refs[id as usize];
            assert!(*r > 0, "double release of page {id}");
            *r -= 1;
            if *r == 0 {
                let rank = self.rank_of(id);
                self.free[rank].push(id);
            }
        }
    }

    pub fn refs(&self, id: u32) -> u32 {
        self.refs[id as usize]
    }
}

/// State slots split like pages: slot `s` lives on device `s / (total / ranks)`.
#[derive(Debug)]
pub struct SlotPool {
    free: Vec<Vec<usize>>,
    total: usize,
}

impl SlotPool {
    pub fn new(total: usize) -> Self {
        Self::split(total, 1)
    }

    /// `total` slots over `ranks` devices (`total` a multiple of `ranks`).
    pub fn split(total: usize, ranks: usize) -> Self {
        assert!(ranks > 0 && total.is_multiple_of(ranks), "{total} slots do not divide over {ranks} devices");
        let per = total / ranks;
        SlotPool { free: (0..ranks).map(|r| (r * per..(r + 1) * per).rev().collect()).collect(), total }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn used(&self) -> usize {
        self.total - self.free.iter().map(Vec::len).sum::<usize>()
    }

    /// Free slots on device `rank`.
    pub fn free_on(&self, rank: usize) -> usize {
        self.free[rank].len()
    }

    /// Device of slot `slot`.
    pub fn rank_of(&self, slot: usize) -> usize {
        slot / (self.total / self.free.len())
    }

    /// A slot on one device.
    pub fn alloc(&mut self) -> Result<usize, PoolError> {
        assert_eq!(self.free.len(), 1, "slots of a pool split over devices come from one device: alloc_on");
        self.alloc_on(0)
    }

    pub fn alloc_on(&mut self, rank: usize) -> Result<usize, PoolError> {
        self.free[rank].pop().ok_or(PoolError::NoFreeSlot { total: self.total })
    }

    pub fn release(&mut self, slot: usize) {
        let rank = if slot < self.total { self.rank_of(slot) } else { 0 };
        assert!(slot < self.total && !self.free[rank].contains(&slot), "bad release of slot {slot}");
        self.free[rank].push(slot);
    }
}

/// The device a new sequence goes to: the one with the most free pages among those with
/// a free slot (the lowest on ties), so sequences spread and a long prompt finds room.
pub fn pick_rank(pages: &PagePool, slots: &SlotPool) -> Result<usize, PoolError> {
    (0..pages.ranks())
        .filter(|&r| slots.free_on(r) > 0)
        .max_by_key(|&r| (pages.free_on(r), std::cmp::Reverse(r)))
        .ok_or(PoolError::NoFreeSlot { total: slots.total() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_all_or_nothing_and_refcounted() {
        let mut p = PagePool::new(4);
        let a = p.alloc(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(p.alloc(2).unwrap_err(), PoolError::OutOfPages { wanted: 2, free: 1, total: 4 });
        assert_eq!(p.free(), 1, "a failed alloc takes nothing");
        p.retain(1);
        p.release(&a);
        assert_eq!(p.free(), 3, "page 1 is still held");
        assert_eq!(p.refs(1), 1);
        p.release(&[1]);
        assert_eq!(p.free(), 4);
    }

    #[test]
    fn a_run_released_together_comes_back_ascending() {
        let mut p = PagePool::new(8);
        let a = p.alloc(4).unwrap();
        p.release(&a);
        assert_eq!(p.alloc(4).unwrap(), a, "same pages, same order");
        assert_eq!(p.alloc(2).unwrap(), vec![4, 5]);
    }

    #[test]
    fn slots_run_out_and_come_back() {
        let mut s = SlotPool::new(2);
        let a = s.alloc().unwrap();
        let b = s.alloc().unwrap();
        assert_ne!(a, b);
        assert_eq!(s.alloc().unwrap_err(), PoolError::NoFreeSlot { total: 2 });
        s.release(a);
        assert_eq!(s.alloc().unwrap(), a);
        assert_eq!(s.used(), 2);
    }

    #[test]
    fn split_pools_hand_out_ids_of_one_device_and_spread_new_sequences() {
        let mut p = PagePool::split(8, 2);
        let mut s = SlotPool::split(4, 2);
        assert_eq!(pick_rank(&p, &s).unwrap(), 0, "ties go to the lowest device");
        assert_eq!(p.alloc_on(1, 3).unwrap(), vec![4, 5, 6]);
        assert_eq!(p.rank_of(5), 1);
        assert_eq!(pick_rank(&p, &s).unwrap(), 0, "device 0 has more free pages");
        assert_eq!(p.alloc_on(1, 2).unwrap_err(), PoolError::OutOfPages { wanted: 2, free: 1, total: 4 });
        assert_eq!(s.alloc_on(1).unwrap(), 2);
        assert_eq!(s.rank_of(3), 1);
        s.alloc_on(0).unwrap();
        s.alloc_on(0).unwrap();
        assert_eq!(pick_rank(&p, &s).unwrap(), 1, "device 0 has no free slot left");
        p.release(&[5]);
        assert_eq!(p.free_on(1), 2);
        s.release(2);
        assert_eq!(s.free_on(1), 2);
    }
}
