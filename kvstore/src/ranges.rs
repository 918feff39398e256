//! First-fit allocation of byte ranges in the staging area puts land in. Plain data.

use std::collections::BTreeMap;

#[derive(Debug)]
pub struct Ranges {
    /// Free ranges by start: `start → len`, never adjacent (freed ranges coalesce).
    free: BTreeMap<u64, u64>,
    total: u64,
}

/// Ranges start on this alignment, so that every record lands 8-byte aligned.
const ALIGN: u64 = 64;

impl Ranges {
    pub fn new(total: u64) -> Self {
        let total = total / ALIGN * ALIGN;
        let mut free = BTreeMap::new();
        if total > 0 {
            free.insert(0, total);
        }
        Ranges { free, total }
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }

    fn rounded(len: u64) -> u64 {
        len.max(1).div_ceil(ALIGN) * ALIGN
    }

    /// A range of `len` bytes, or `None` when no free range is large enough.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let want = Self::rounded(len);
        let (&start, &have) = self.free.iter().find(|&(_, &l)| l >= want)?;
        self.free.remove(&start);
        if have > want {
            self.free.insert(start + want, have - want);
        }
        Some(start)
    }

    /// Give back a range from [`Self::alloc`] with the same `len`.
    pub fn release(&mut self, start: u64, len: u64) {
        let mut start = start;
        let mut len = Self::rounded(len);
        assert!(start + len <= self.total, "range {start}+{len} outside the staging area");
        if let Some((&ps, &pl)) = self.free.range(..start).next_back() {
            assert!(ps + pl <= start, "double release of staging range at {start}");
            if ps + pl == start {
                self.free.remove(&ps);
                start = ps;
                len += pl;
            }
        }
        if let Some((&ns, &nl)) = self.free.range(start..).next() {
            assert!(start + len <= ns, "double release of staging range at {start}");
            if start + len == ns {
                self.free.remove(&ns);
                len += nl;
            }
        }
        self.free.insert(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_first_fit_and_coalesces_on_release() {
        let mut r = Ranges::new(1000); // 960 usable
        assert_eq!(r.total(), 960);
        let a = r.alloc(100).unwrap(); // 128
        let b = r.alloc(200).unwrap(); // 256
        let c = r.alloc(500).unwrap(); // 512
        assert_eq!((a, b, c), (0, 128, 384));
        assert_eq!(r.alloc(100), None, "64 bytes left");
        r.release(b, 200);
        assert_eq!(r.alloc(300), None, "256 free in the middle, 64 at the end");
        r.release(a, 100);
        assert_eq!(r.alloc(300), Some(0), "a and b coalesced");
        r.release(0, 300);
        r.release(c, 500);
        assert_eq!(r.free_bytes(), 960);
        assert_eq!(r.alloc(960), Some(0), "everything coalesced into one range");
    }

    #[test]
    #[should_panic(expected = "double release")]
    fn double_release_is_caught() {
        let mut r = Ranges::new(1024);
        let a = r.alloc(64).unwrap();
        r.release(a, 64);
        r.release(a, 64);
    }
}
