//! Choosing workers (pure functions over load snapshots).
//!
//! Prefill: fewest queued prompt tokens (the worker's own report plus what this
//! router has sent since). Decode: enough free pages for the request first, then most
//! free pages, then smallest running batch — so identical requests spread out instead
//! of piling onto one worker.

/// What the router knows about a prefill worker's load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillView {
    pub healthy: bool,
    pub queued_tokens: u64,
}

/// What the router knows about a decode worker's load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeView {
    pub healthy: bool,
    pub free_pages: u64,
    pub free_slots: u64,
    pub running: u64,
}

/// Indices of healthy prefill workers, best first.
pub fn rank_prefill(workers: &[PrefillView]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..workers.len()).filter(|&i| workers[i].healthy).collect();
    idx.sort_by_key(|&i| (workers[i].queued_tokens, i));
    idx
}

/// Indices of healthy decode workers, best first; those that cannot fit `need_pages`
/// (as far as the router knows) go last rather than nowhere, since load reports lag.
pub fn rank_decode(workers: &[DecodeView], need_pages: u64) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..workers.len()).filter(|&i| workers[i].healthy).collect();
    idx.sort_by_key(|&i| {
        let w = &workers[i];
        let fits = w.free_pages >= need_pages && w.free_slots > 0;
        (!fits, std::cmp::Reverse(w.free_pages), w.running, i)
    });
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_prefers_short_queues_and_skips_unhealthy() {
        let w = [
            PrefillView { healthy: true, queued_tokens: 500 },
            PrefillView { healthy: false, queued_tokens: 0 },
            PrefillView { healthy: true, queued_tokens: 20 },
        ];
        assert_eq!(rank_prefill(&w), vec![2, 0]);
    }

    #[test]
    fn decode_prefers_room_then_free_pages_then_small_batches() {
        let d = |free_pages, running| DecodeView { healthy: true, free_pages, free_slots: 4, running };
        let w =
            [d(10, 0), d(300, 5), d(300, 1), DecodeView { healthy: false, free_pages: 999, free_slots: 9, running: 0 }];
        assert_eq!(rank_decode(&w, 20), vec![2, 1, 0]);
        // Nobody fits: still offered, roomiest first.
        assert_eq!(rank_decode(&w, 1000), vec![2, 1, 0]);
    }
}
