//! The NCCL exchanges between GPUs, byte for byte: the all-to-all of variable counts
//! (expert parallelism's dispatch and combine, timed by `sluice bench collectives`)
//! delivers every rank exactly the blocks addressed to it, laid out by source, and the
//! transposed counts bring them back; the all-gather and reduce-scatter the sharded MoE
//! runs today deliver what their contract says. Every value names its sender, its
//! receiver and its place, so a block that lands in the wrong rank or at the wrong
//! offset fails by value. Needs two GPUs (NCCL takes a GPU once); with fewer, or without
//! NCCL, every test prints why it is skipped and passes.
#![cfg(feature = "cuda")]

use kernels::Backend;
use kernels::cuda::CudaBackend;
use kernels::cuda::collective::{Nccl, all_to_all_offsets};
use kernels::sharded::Collective;

/// Every GPU of the machine (up to 8) and NCCL communicators over them; `None`, with the
/// reason on stderr, with fewer than two GPUs or no libnccl.
fn gpus(test: &str) -> Option<(Vec<CudaBackend>, Nccl)> {
    let count = CudaBackend::device_count();
    if count < 2 {
        eprintln!("SKIPPED {test}: {count} CUDA device(s); the NCCL exchanges need two GPUs");
        return None;
    }
    let ranks: Vec<CudaBackend> = (0..count.min(8)).map(|o| CudaBackend::new(o).expect("CUDA backend")).collect();
    match Nccl::new(&ranks) {
        Ok(n) => Some((ranks, n)),
        Err(e) => {
            eprintln!(
                "SKIPPED {test}: NCCL unavailable ({e}); a machine with only libnccl.so.2 needs the link \
                 libnccl.so -> libnccl.so.2 on its library path"
            );
            None
        }
    }
}

/// Value `i` of the block rank `from` sends rank `to`: distinct and exact in f32 (below
/// 2^24) for up to 8 ranks and blocks below 2^18 values.
fn tag(from: usize, to: usize, i: usize) -> f32 {
    assert!(i < 1 << 18, "blocks of the test stay below 2^18 values");
    (((from * 8 + to) << 18) + i) as f32
}

/// Uneven counts with empty blocks (rank `r` sends nothing to rank `r + 1`), a rank's
/// block for itself included, scaled by `unit`.
fn counts(n: usize, unit: usize) -> Vec<Vec<usize>> {
    (0..n)
        .map(|r| (0..n).map(|s| if s == (r + 1) % n { 0 } else { unit * (1 + (3 * r + 5 * s) % 7) }).collect())
        .collect()
}

fn send_buffers(ranks: &[CudaBackend], counts: &[Vec<usize>]) -> Vec<kernels::cuda::CudaBuf> {
    ranks
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let host: Vec<f32> =
                counts[r].iter().enumerate().flat_map(|(s, &c)| (0..c).map(move |i| tag(r, s, i))).collect();
            b.upload(&host)
        })
        .collect()
}

#[test]
fn all_to_all_delivers_each_block_to_its_rank_by_source() {
    let Some((ranks, nccl)) = gpus("all_to_all_delivers_each_block_to_its_rank_by_source") else { return };
    let n = ranks.len();
    // Single values and rows of V4-Flash's hidden size (4096 f32): blocks of 1 to 7
    // values, of 1 to 7 rows, and of 8 to 56 rows (0.9 MiB).
    for unit in [1usize, 4096, 8 * 4096] {
        let counts = counts(n, unit);
        let sends = send_buffers(&ranks, &counts);
        let refs: Vec<&kernels::cuda::CudaBuf> = sends.iter().collect();
        let got = nccl.all_to_all(&ranks, &refs, &counts);
        let (_, recv_at) = all_to_all_offsets(&counts);
        let mut bytes = 0usize;
        for (s, (b, buf)) in ranks.iter().zip(&got).enumerate() {
            let host = b.download(buf);
            let want: usize = counts.iter().map(|c| c[s]).sum();
            assert_eq!(host.len(), want, "rank {s}: received {} values, {want} addressed to it", host.len());
            for (r, c) in counts.iter().enumerate() {
                let block = &host[recv_at[s][r]..recv_at[s][r] + c[s]];
                for (i, &v) in block.iter().enumerate() {
                    assert_eq!(v, tag(r, s, i), "rank {s}, value {i} of the block from rank {r} (unit {unit})");
                }
            }
            bytes += 4 * host.len();
        }
        eprintln!("ALL_TO_ALL {n} GPUs, unit {unit}: {bytes} bytes received, every block in place");

        // The combine: the transposed counts send every block back where it came from.
        let transposed: Vec<Vec<usize>> = (0..n).map(|r| (0..n).map(|s| counts[s][r]).collect()).collect();
        let back_refs: Vec<&kernels::cuda::CudaBuf> = got.iter().collect();
        let back = nccl.all_to_all(&ranks, &back_refs, &transposed);
        for (r, (b, buf)) in ranks.iter().zip(&back).enumerate() {
            assert_eq!(b.download(buf), b.download(&sends[r]), "rank {r}: the round trip changed its rows");
        }
    }
}

#[test]
fn all_to_all_into_leaves_the_room_past_the_blocks() {
    let Some((ranks, nccl)) = gpus("all_to_all_into_leaves_the_room_past_the_blocks") else { return };
    let n = ranks.len();
    let counts = counts(n, 3);
    let sends = send_buffers(&ranks, &counts);
    let refs: Vec<&kernels::cuda::CudaBuf> = sends.iter().collect();
    // Each receive buffer has 5 values of room after its blocks, poisoned with -1.
    let mut recvs: Vec<kernels::cuda::CudaBuf> = ranks
        .iter()
        .enumerate()
        .map(|(s, b)| b.upload(&vec![-1.0f32; counts.iter().map(|c| c[s]).sum::<usize>() + 5]))
        .collect();
    nccl.all_to_all_into(&ranks, &refs, &counts, &mut recvs);
    for (s, (b, buf)) in ranks.iter().zip(&recvs).enumerate() {
        let host = b.download(buf);
        let blocks = host.len() - 5;
        assert!(host[..blocks].iter().all(|&v| v >= 0.0), "rank {s}: a block was not written");
        assert_eq!(&host[blocks..], &[-1.0; 5], "rank {s}: the room past the blocks was written");
    }
}

/// What the sharded MoE exchanges today over NCCL: an all-gather in rank order and a
/// reduce-scatter summed in rank order, with uneven counts (a rank with no rows too).
#[test]
fn nccl_all_gather_and_reduce_scatter_keep_their_contract() {
    let Some((ranks, nccl)) = gpus("nccl_all_gather_and_reduce_scatter_keep_their_contract") else { return };
    let n = ranks.len();
    let counts: Vec<usize> = (0..n).map(|r| if r == 1 { 0 } else { 4096 * (r + 1) }).collect();
    let parts: Vec<kernels::cuda::CudaBuf> = ranks
        .iter()
        .enumerate()
        .map(|(r, b)| b.upload(&(0..counts[r]).map(|i| tag(r, r, i)).collect::<Vec<_>>()))
        .collect();
    let refs: Vec<&kernels::cuda::CudaBuf> = parts.iter().collect();
    let gathered = nccl.all_gather(&ranks, &refs, &counts);
    let want: Vec<f32> = (0..n).flat_map(|r| (0..counts[r]).map(move |i| tag(r, r, i))).collect();
    for (b, g) in ranks.iter().zip(&gathered) {
        assert_eq!(b.download(g), want, "all-gather on {}", b.describe());
    }
    // Partials: rank r contributes (r + 1) · x, so every block sums to (1 + … + n) · x exactly.
    let total: usize = counts.iter().sum();
    let partials: Vec<kernels::cuda::CudaBuf> = ranks
        .iter()
        .enumerate()
        .map(|(r, b)| b.upload(&(0..total).map(|i| ((r + 1) * (i % 1000)) as f32).collect::<Vec<_>>()))
        .collect();
    let sums = nccl.reduce_scatter(&ranks, &partials, &counts);
    let k = (n * (n + 1) / 2) as f32;
    let mut at = 0;
    for (r, (b, s)) in ranks.iter().zip(&sums).enumerate() {
        let want: Vec<f32> = (at..at + counts[r]).map(|i| k * (i % 1000) as f32).collect();
        assert_eq!(b.download(s), want, "reduce-scatter block of rank {r}");
        at += counts[r];
    }
}
