//! Offering a finished prompt's blocks to the prefix cache: the page of every
//! complete block and the window snapshots taken on the way. The store takes what it
//! lacks; a store that is down, slow or full costs a counted error, never the request.
//!
//! Usually the blocks are copied out of the engine's memory and handed to the put
//! thread (`put_queue`), so the engine goes on with the next prompt at once. When the
//! store reaches GPU memory in place (`--kvstore-gpu-direct`) the pages are written from
//! device memory on this thread, before they go back to the pool.

use sluice_proto::v1 as pb;

use engine::kv::Sequence;
use transfer::Source;
use transfer::checksum::kv_checksum;

use super::State;
use super::put_queue::{OwnedRecord, PutJob};
use crate::prefix_cache::{Prefix, PutRecord};

/// The finished prompt whose blocks are offered.
#[derive(Clone, Copy)]
pub(super) struct Offer<'a> {
    pub request_id: &'a str,
    pub tokens: &'a [u32],
    pub trace: &'a cluster::telemetry::TraceContext,
}

impl<B: kernels::Backend> State<B> {
    /// Offer the complete blocks of `tokens` (in `seq`) and the `snapshots` taken.
    pub(super) fn put_blocks(
        &mut self,
        job: Offer<'_>,
        prefix: Option<&Prefix>,
        seq: &Sequence,
        snapshots: &[(usize, Vec<u8>)],
    ) {
        let (Some(_), Some(prefix)) = (&self.cfg.cache, prefix) else { return };
        let layout = &self.engine.cache.layout;
        let full = (job.tokens.len() / layout.block).min(prefix.keys.len());
        if full == 0 {
            return;
        }
        let tokens_put = full * layout.block;
        let p = layout.pool_bytes_per_block();
        let pools =
            pb::PoolBytes { csa_main: p.csa_main as u64, csa_indexer: p.csa_index as u64, hca: p.hca as u64, swa: 0 };
        let keys = &prefix.keys;
        let page_record = |i: usize, len: usize| pb::PutRecord {
            key: keys[i].to_vec(),
            parent: if i == 0 { Vec::new() } else { keys[i - 1].to_vec() },
            depth: i as u32,
            kind: pb::RecordKind::Page as i32,
            len: len as u64,
            pools: Some(pools),
        };
        let snapshot_records: Vec<(pb::PutRecord, &Vec<u8>)> = snapshots
            .iter()
            .filter(|(k, _)| *k <= full)
            .map(|(k, snap)| {
                let record = pb::PutRecord {
                    key: keys[k - 1].to_vec(),
                    parent: Vec::new(),
                    depth: (k - 1) as u32,
                    kind: pb::RecordKind::Snapshot as i32,
                    len: snap.len() as u64,
                    pools: Some(pb::PoolBytes { swa: snap.len() as u64, ..Default::default() }),
                };
                (record, snap)
            })
            .collect();
        if !self.cfg.paths.kvstore_direct {
            // Copied out of the engine's own memory (one device-to-host copy on a GPU)
            // and offered by the put thread.
            let bytes = self.engine.read_sequence(seq, tokens_put);
            let mut records: Vec<OwnedRecord> = bytes
                .pages
                .into_iter()
                .enumerate()
                .map(|(i, page)| OwnedRecord {
                    record: page_record(i, page.len()),
                    checksum: kv_checksum(&page),
                    bytes: page,
                })
                .collect();
            records.extend(snapshot_records.into_iter().map(|(record, snap)| OwnedRecord {
                record,
                checksum: kv_checksum(snap),
                bytes: snap.clone(),
            }));
            let job = PutJob { request_id: job.request_id.to_string(), trace: job.trace.clone(), records };
            if let Some(q) = &self.puts {
                q.offer(job);
            }
            return;
        }
        // The store writes GPU memory in place: the pages go from device memory, now.
        self.engine.model.backend.synchronize();
        let (Some(ranges), Some(mem)) = (self.engine.sequence_device_ranges(seq, tokens_put), self.engine.device_kv())
        else {
            return;
        };
        let sums = self.engine.own_checksums(seq, tokens_put);
        let part = &mem[ranges.rank];
        let mut records: Vec<PutRecord<'_>> = ranges
            .pages
            .iter()
            .zip(&sums.pages)
            .enumerate()
            .map(|(i, (&(offset, len), &checksum))| PutRecord {
                record: page_record(i, len),
                source: Source::Device { mem: &*part.pages, offset, len },
                checksum,
            })
            .collect();
        records.extend(snapshot_records.into_iter().map(|(record, snap)| PutRecord {
            record,
            source: Source::Host(snap),
            checksum: kv_checksum(snap),
        }));
        let Some((cache, rt)) = &self.cfg.cache else { return };
        match cache.put(rt, &mut self.sender, &records) {
            Ok(written) => self.cfg.metrics.put_bytes.inc_by(written),
            Err(e) => {
                self.cfg.metrics.cache_error("put");
                tracing::warn!(request_id = %job.request_id, error = %e, "offering the prompt's blocks to the kvstore failed");
            }
        }
    }
}
