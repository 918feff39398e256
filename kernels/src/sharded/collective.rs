//! The two exchanges expert parallelism needs, between the devices of one process.
//!
//! Devices hold different numbers of rows, so both are the "v" forms: every device
//! contributes its own count. Sums are taken in device order on every device, whatever
//! the transport, so a result does not depend on which collective carried it.

use crate::backend::Backend;

/// Gather and reduce-scatter between the devices (`ranks`) of a sharded backend.
/// Implementations order their copies after the work already issued on each device and
/// before the work issued after the call, and keep the buffers they read alive as long
/// as the copies need them.
pub trait Collective<B: Backend>: Send + Sync {
    /// What carries the bytes, for logs (`host`, `nccl`, `peer copies`).
    fn name(&self) -> &'static str;

    /// `parts[r]` holds `counts[r]` values on device `r`; every device gets all of them,
    /// device 0's first (`Σ counts` values).
    fn all_gather(&self, ranks: &[B], parts: &[&B::Buf], counts: &[usize]) -> Vec<B::Buf>;

    /// `partials[r]` holds `Σ counts` values on device `r`; device `r` gets the sum over
    /// devices `s = 0, 1, …` (in that order) of `partials[s]`'s block `r` (`counts[r]`
    /// values starting at `Σ counts[..r]`).
    fn reduce_scatter(&self, ranks: &[B], partials: &[B::Buf], counts: &[usize]) -> Vec<B::Buf>;
}

/// Through host memory: download, assemble, upload. Works for every backend; what the
/// CPU backend uses (its "devices" share the host's memory anyway).
#[derive(Debug, Default)]
pub struct HostCollective;

impl<B: Backend> Collective<B> for HostCollective {
    fn name(&self) -> &'static str {
        "host"
    }

    fn all_gather(&self, ranks: &[B], parts: &[&B::Buf], counts: &[usize]) -> Vec<B::Buf> {
        let mut all = Vec::with_capacity(counts.iter().sum());
        for ((b, part), &n) in ranks.iter().zip(parts).zip(counts) {
            let v = b.download(part);
            assert_eq!(v.len(), n, "all_gather: a part of {} values, {n} announced", v.len());
            all.extend(v);
        }
        ranks.iter().map(|b| b.upload(&all)).collect()
    }

    fn reduce_scatter(&self, ranks: &[B], partials: &[B::Buf], counts: &[usize]) -> Vec<B::Buf> {
        let total: usize = counts.iter().sum();
        let host: Vec<Vec<f32>> = ranks.iter().zip(partials).map(|(b, p)| b.download(p)).collect();
        assert!(host.iter().all(|h| h.len() == total), "reduce_scatter: partials of the wrong length");
        let mut at = 0;
        ranks
            .iter()
            .zip(counts)
            .map(|(b, &n)| {
                let mut acc = host[0][at..at + n].to_vec();
                for h in &host[1..] {
                    acc.iter_mut().zip(&h[at..at + n]).for_each(|(a, v)| *a += v);
                }
                at += n;
                b.upload(&acc)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;

    #[test]
    fn host_collective_gathers_in_device_order_and_sums_each_block() {
        let ranks = vec![CpuBackend::new(), CpuBackend::new()];
        let (a, b) = (vec![1.0f32, 2.0], vec![3.0f32]);
        let all = HostCollective.all_gather(&ranks, &[&a, &b], &[2, 1]);
        assert_eq!(all, vec![vec![1.0, 2.0, 3.0], vec![1.0, 2.0, 3.0]]);
        let partials = vec![vec![1.0f32, 2.0, 3.0], vec![10.0, 20.0, 30.0]];
        let out = HostCollective.reduce_scatter(&ranks, &partials, &[2, 1]);
        assert_eq!(out, vec![vec![11.0, 22.0], vec![33.0]]);
    }
}
