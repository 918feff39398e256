//! Partial sums of the KV checksum over byte ranges of one device buffer, summed on the
//! device (`cu/checksum.cu`): a transfer's sender and receiver check GPU memory without
//! copying it to the host. Ranges the kernel cannot read in 4-byte words (odd offsets or
//! lengths; none of the KV layouts has them) are read and summed on the host instead.

use super::runtime::{Gpu, cfg, launch};
use crate::kv_checksum::partial_sum;

/// Threads per block and the most blocks one range gets (a V4-Flash page is ~0.4–0.9 MB:
/// up to 64 blocks of 256 threads read it with a few words per thread).
const THREADS: u32 = 256;
const MAX_BLOCKS: u64 = 64;
/// `gridDim.y` limit: more ranges go in several launches.
const MAX_RANGES_PER_LAUNCH: usize = 65_535;

/// `len` bytes at byte `offset` of a buffer, the first being byte `8 · first_word` of
/// what is checksummed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ByteRange {
    pub offset: usize,
    pub len: usize,
    pub first_word: u64,
}

/// Partial sums of `ranges` of the buffer at device address `base` (which must hold them
/// all), in order; waits for the device.
pub(crate) fn partial_sums(g: &Gpu, base: u64, ranges: &[ByteRange]) -> Vec<u64> {
    let summable = |r: &ByteRange| r.offset.is_multiple_of(4) && r.len.is_multiple_of(4) && r.len > 0;
    let on_device: Vec<usize> = (0..ranges.len()).filter(|&i| summable(&ranges[i])).collect();
    let mut out: Vec<Option<u64>> = vec![None; ranges.len()];
    if !on_device.is_empty() {
        let table: Vec<u64> = on_device
            .iter()
            .flat_map(|&i| [ranges[i].offset as u64, ranges[i].len as u64, ranges[i].first_word])
            .collect();
        let longest = on_device.iter().map(|&i| ranges[i].len as u64).max().unwrap_or(0);
        let blocks = longest.div_ceil(8 * u64::from(THREADS) * 4).clamp(1, MAX_BLOCKS) as u32;
        let table_dev = g.upload(&table);
        let sums = g.zeros::<u64>(on_device.len());
        for first in (0..on_device.len()).step_by(MAX_RANGES_PER_LAUNCH) {
            let n = (on_device.len() - first).min(MAX_RANGES_PER_LAUNCH);
            launch!(
                g,
                "kv_checksum",
                cfg((blocks, n as u32, 1), THREADS, 0),
                base,
                g.ptr(&table_dev) + (24 * first) as u64,
                g.ptr(&sums) + (8 * first) as u64,
            );
        }
        let mut raw = vec![0u64; on_device.len()];
        g.read(&sums, 0, &mut raw);
        for (k, &i) in on_device.iter().enumerate() {
            out[i] = Some(raw[k]);
        }
    }
    ranges
        .iter()
        .zip(out)
        .map(|(r, sum)| {
            sum.unwrap_or_else(|| {
                let mut host = vec![0u8; r.len];
                g.read_raw(base + r.offset as u64, &mut host);
                partial_sum(&host, r.first_word)
            })
        })
        .collect()
}
