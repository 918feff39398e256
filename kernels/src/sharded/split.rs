//! Where a step's rows and KV live when one backend spans several devices (pure logic).
//!
//! KV pools are split into equal contiguous blocks: of `pages` pages, device `r` holds
//! ids `r * pages / n ..` (likewise state slots), so a global id names its device and
//! its index there without a table. A sequence lives where its state slot is; its
//! pages must be on the same device. Its rows of a step are computed on that device
//! (attention is data-parallel), so a step's plan becomes one plan per device with
//! local slot and page ids and the rows renumbered, and a [`RowSplit`] records which
//! global rows each device holds.

use crate::plan::{BatchPlan, SeqSlice};

/// The KV pools and how they divide between `ranks` devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pools {
    pub ranks: usize,
    pub pages: usize,
    pub slots: usize,
}

impl Pools {
    /// Pools of `pages` pages and `slots` slots over `ranks` devices; each must divide
    /// evenly.
    pub fn new(ranks: usize, pages: usize, slots: usize) -> Result<Self, String> {
        if ranks == 0 {
            return Err("no devices".into());
        }
        if !pages.is_multiple_of(ranks) || !slots.is_multiple_of(ranks) {
            return Err(format!(
                "{pages} KV pages and {slots} sequence slots do not divide evenly over {ranks} devices: \
                 use multiples of {ranks}"
            ));
        }
        Ok(Pools { ranks, pages, slots })
    }

    pub fn pages_per_rank(&self) -> usize {
        self.pages / self.ranks
    }

    pub fn slots_per_rank(&self) -> usize {
        self.slots / self.ranks
    }

    /// `(device, local id)` of page `page`.
    pub fn page(&self, page: u32) -> (usize, u32) {
        let per = self.pages_per_rank() as u32;
        assert!((page as usize) < self.pages, "page {page} outside the pool of {}", self.pages);
        ((page / per) as usize, page % per)
    }

    /// `(device, local slot)` of state slot `slot`.
    pub fn slot(&self, slot: usize) -> (usize, usize) {
        let per = self.slots_per_rank();
        assert!(slot < self.slots, "slot {slot} outside the {} slots", self.slots);
        (slot / per, slot % per)
    }
}

/// Which device holds which rows of an activation buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowSplit {
    /// Global row ids each device holds, ascending: its part's rows in order.
    pub held: Vec<Vec<usize>>,
    /// `(device, index in its part)` of every global row.
    pub owner: Vec<(usize, usize)>,
}

impl RowSplit {
    /// Rows `0..owners.len()`, row `i` on device `owners[i]`.
    pub fn from_owners(ranks: usize, owners: &[usize]) -> Self {
        let mut held = vec![Vec::new(); ranks];
        let mut owner = Vec::with_capacity(owners.len());
        for (row, &r) in owners.iter().enumerate() {
            assert!(r < ranks, "row {row} on device {r} of {ranks}");
            owner.push((r, held[r].len()));
            held[r].push(row);
        }
        RowSplit { held, owner }
    }

    pub fn ranks(&self) -> usize {
        self.held.len()
    }

    pub fn rows(&self) -> usize {
        self.owner.len()
    }

    /// Rows device `r` holds.
    pub fn count(&self, r: usize) -> usize {
        self.held[r].len()
    }

    /// The split of a buffer made of rows `picked` of this one, in that order (each row
    /// stays on its device), and per device the local indices to gather there.
    pub fn pick(&self, picked: &[usize]) -> (RowSplit, Vec<Vec<usize>>) {
        let owners: Vec<usize> = picked.iter().map(|&g| self.owner[g].0).collect();
        let mut local = vec![Vec::new(); self.ranks()];
        for &g in picked {
            let (r, i) = self.owner[g];
            local[r].push(i);
        }
        (RowSplit::from_owners(self.ranks(), &owners), local)
    }

    /// The same layout read as `n` rows: coarser when groups of `rows / n` consecutive
    /// rows sit together on one device (a row copied into the hc residual streams is
    /// `hc` rows of a buffer read as one), finer when each row is `n / rows` rows. The
    /// parts' bytes do not move; only the bookkeeping changes.
    pub fn regroup(&self, n: usize) -> Result<RowSplit, String> {
        let rows = self.rows();
        if n == rows {
            return Ok(self.clone());
        }
        let owners: Vec<usize> = if n > 0 && rows.is_multiple_of(n) {
            let k = rows / n;
            (0..n)
                .map(|i| {
                    let (r, first) = self.owner[i * k];
                    let together = (1..k).all(|j| self.owner[i * k + j] == (r, first + j));
                    together
                        .then_some(r)
                        .ok_or_else(|| format!("rows {}..{} are not together on one device", i * k, i * k + k))
                })
                .collect::<Result<_, _>>()?
        } else if rows > 0 && n.is_multiple_of(rows) {
            let k = n / rows;
            (0..n).map(|i| self.owner[i / k].0).collect()
        } else {
            return Err(format!("a buffer of {rows} rows read as {n} rows"));
        };
        Ok(RowSplit::from_owners(self.ranks(), &owners))
    }

    /// First row of each device's block when the parts are laid end to end in device
    /// order (what a gather across devices produces), and the total.
    pub fn offsets(&self) -> (Vec<usize>, usize) {
        let mut at = 0;
        let offsets = self
            .held
            .iter()
            .map(|h| {
                let o = at;
                at += h.len();
                o
            })
            .collect();
        (offsets, at)
    }
}

/// A step as each device runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepSplit {
    pub rows: std::sync::Arc<RowSplit>,
    /// Per device: its sequences with local slot and page ids, rows renumbered from 0.
    pub plans: Vec<BatchPlan>,
}

/// Split `plan` over the devices of `pools`. Fails when a sequence's pages are not on
/// the device of its slot (the engine's allocator never does that).
pub fn split_plan(plan: &BatchPlan, pools: &Pools) -> Result<StepSplit, String> {
    let n = pools.ranks;
    let mut plans = vec![BatchPlan::default(); n];
    let mut owners = vec![0usize; plan.rows()];
    for s in &plan.seqs {
        let (r, slot) = pools.slot(s.slot);
        let mut pages = Vec::with_capacity(s.pages.len());
        for &p in &s.pages {
            let (pr, local) = pools.page(p);
            if pr != r {
                return Err(format!(
                    "a sequence in slot {} (device {r}) holds page {p}, which is on device {pr}",
                    s.slot
                ));
            }
            pages.push(local);
        }
        let rank_plan = &mut plans[r];
        let first_row = rank_plan.tokens.len();
        rank_plan.seqs.push(SeqSlice {
            first_row,
            rows: s.rows,
            start_pos: s.start_pos,
            slot,
            pages,
            pages_final_until: s.pages_final_until,
        });
        rank_plan.tokens.extend_from_slice(&plan.tokens[s.row_range()]);
        rank_plan.positions.extend_from_slice(&plan.positions[s.row_range()]);
        owners[s.row_range()].fill(r);
    }
    Ok(StepSplit { rows: std::sync::Arc::new(RowSplit::from_owners(n, &owners)), plans })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_divide_evenly_or_say_what_to_change() {
        let p = Pools::new(2, 8, 4).unwrap();
        assert_eq!(p.page(5), (1, 1));
        assert_eq!(p.slot(1), (0, 1));
        assert_eq!(p.slot(2), (1, 0));
        let e = Pools::new(2, 9, 4).unwrap_err();
        assert!(e.contains("multiples of 2"), "{e}");
    }

    #[test]
    fn plans_split_by_slot_with_local_ids_and_rows_renumbered() {
        let pools = Pools::new(2, 8, 4).unwrap();
        let (a, b, c) = ([1u32, 2, 3], [4u32], [5u32, 6]);
        // Slot 3 (device 1) first, then slot 0 (device 0), then slot 2 (device 1).
        let plan = BatchPlan::new(vec![(3, vec![4, 5], 200, &a), (0, vec![0], 10, &b), (2, vec![7], 5, &c)]);
        let s = split_plan(&plan, &pools).unwrap();
        assert_eq!(s.rows.held, vec![vec![3], vec![0, 1, 2, 4, 5]]);
        assert_eq!(s.rows.owner[4], (1, 3));
        let p1 = &s.plans[1];
        assert_eq!(p1.tokens, vec![1, 2, 3, 5, 6]);
        assert_eq!(p1.positions, vec![200, 201, 202, 5, 6]);
        assert_eq!((p1.seqs[0].slot, p1.seqs[0].pages.clone(), p1.seqs[0].first_row), (1, vec![0, 1], 0));
        assert_eq!((p1.seqs[1].slot, p1.seqs[1].pages.clone(), p1.seqs[1].first_row), (0, vec![3], 3));
        let p0 = &s.plans[0];
        assert_eq!((p0.seqs[0].slot, p0.seqs[0].pages.clone(), p0.tokens.clone()), (0, vec![0], vec![4]));
    }

    #[test]
    fn a_page_on_another_device_is_refused() {
        let pools = Pools::new(2, 8, 4).unwrap();
        let t = [1u32];
        let plan = BatchPlan::new(vec![(0, vec![6], 0, &t)]);
        assert!(split_plan(&plan, &pools).unwrap_err().contains("page 6, which is on device 1"));
    }

    #[test]
    fn rows_regroup_when_copies_sit_together() {
        let s = RowSplit::from_owners(2, &[1, 0]);
        let fine = s.regroup(6).unwrap();
        assert_eq!(fine.held, vec![vec![3, 4, 5], vec![0, 1, 2]]);
        assert_eq!(fine.regroup(2).unwrap(), s);
        let mixed = RowSplit::from_owners(2, &[0, 1, 1, 1]);
        assert!(mixed.regroup(2).unwrap_err().contains("not together"));
        assert!(s.regroup(3).is_err());
    }

    #[test]
    fn picked_rows_stay_on_their_device_in_the_listed_order() {
        let s = RowSplit::from_owners(2, &[1, 0, 1, 0]);
        let (p, local) = s.pick(&[2, 1, 0]);
        assert_eq!(p.held, vec![vec![1], vec![0, 2]]);
        assert_eq!(local, vec![vec![0], vec![1, 0]]);
        assert_eq!(s.offsets(), (vec![0, 2], 4));
    }
}
