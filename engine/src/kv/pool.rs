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

#[derive(Debug)]
pub struct PagePool {
    free: Vec<u32>,
    refs: Vec<u32>,
}

impl PagePool {
    pub fn new(total: usize) -> Self {
        PagePool { free: (0..total as u32).rev().collect(), refs: vec![0; total] }
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    pub fn free(&self) -> usize {
        self.free.len()
    }

    pub fn used(&self) -> usize {
        self.total() - self.free()
    }

    /// `n` fresh pages, each with one reference; all or nothing.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<u32>, PoolError> {
        if n > self.free.len() {
            return Err(PoolError::OutOfPages { wanted: n, free: self.free.len(), total: self.total() });
        }
        let ids = self.free.split_off(self.free.len() - n);
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
    pub fn release(&mut self, ids: &[u32]) {
        for &id in ids {
            let r = &mut self.refs[id as usize];
            assert!(*r > 0, "double release of page {id}");
            *r -= 1;
            if *r == 0 {
                self.free.push(id);
            }
        }
    }

    pub fn refs(&self, id: u32) -> u32 {
        self.refs[id as usize]
    }
}

#[derive(Debug)]
pub struct SlotPool {
    free: Vec<usize>,
    total: usize,
}

impl SlotPool {
    pub fn new(total: usize) -> Self {
        SlotPool { free: (0..total).rev().collect(), total }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn used(&self) -> usize {
        self.total - self.free.len()
    }

    pub fn alloc(&mut self) -> Result<usize, PoolError> {
        self.free.pop().ok_or(PoolError::NoFreeSlot { total: self.total })
    }

    pub fn release(&mut self, slot: usize) {
        assert!(slot < self.total && !self.free.contains(&slot), "bad release of slot {slot}");
        self.free.push(slot);
    }
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
}
