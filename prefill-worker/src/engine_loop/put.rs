//! Offering a finished prompt's blocks to the prefix cache: the page of every
//! complete block and the window snapshots taken on the way, written from this
//! worker's memory into the store's staging. The store takes what it lacks; a store
//! that is down or full costs a counted error, never the request.

use sluice_proto::v1 as pb;

use engine::kv::Sequence;

use super::State;
use crate::prefix_cache::{Prefix, PutRecord};

impl<B: kernels::Backend> State<B> {
    /// Offer the complete blocks of `tokens` (in `seq`) and the `snapshots` taken.
    pub(super) fn put_blocks(
        &mut self,
        request_id: &str,
        tokens: &[u32],
        prefix: Option<&Prefix>,
        seq: &Sequence,
        snapshots: &[(usize, Vec<u8>)],
    ) {
        let (Some((cache, rt)), Some(prefix)) = (&self.cfg.cache, prefix) else { return };
        let layout = &self.engine.cache.layout;
        let full = (tokens.len() / layout.block).min(prefix.keys.len());
        if full == 0 {
            return;
        }
        let tokens_put = full * layout.block;
        self.engine.stage_out(seq, tokens_put);
        let layout = &self.engine.cache.layout;
        let Some(bytes) = self.engine.sequence_bytes(seq, tokens_put) else { return };
        let p = layout.pool_bytes_per_block();
        let pools =
            pb::PoolBytes { csa_main: p.csa_main as u64, csa_indexer: p.csa_index as u64, hca: p.hca as u64, swa: 0 };
        let keys = &prefix.keys;
        let mut records: Vec<PutRecord<'_>> = bytes
            .pages
            .iter()
            .enumerate()
            .map(|(i, page)| PutRecord {
                record: pb::PutRecord {
                    key: keys[i].to_vec(),
                    parent: if i == 0 { Vec::new() } else { keys[i - 1].to_vec() },
                    depth: i as u32,
                    kind: pb::RecordKind::Page as i32,
                    len: page.len() as u64,
                    pools: Some(pools),
                },
                bytes: page,
            })
            .collect();
        for (k, snap) in snapshots.iter().filter(|(k, _)| *k <= full) {
            records.push(PutRecord {
                record: pb::PutRecord {
                    key: keys[k - 1].to_vec(),
                    parent: Vec::new(),
                    depth: (k - 1) as u32,
                    kind: pb::RecordKind::Snapshot as i32,
                    len: snap.len() as u64,
                    pools: Some(pb::PoolBytes { swa: snap.len() as u64, ..Default::default() }),
                },
                bytes: snap,
            });
        }
        match cache.put(rt, &mut self.sender, &records) {
            Ok(written) => self.cfg.metrics.put_bytes.inc_by(written),
            Err(e) => {
                self.cfg.metrics.cache_error("put");
                tracing::warn!(%request_id, error = %e, "offering the prompt's blocks to the kvstore failed");
            }
        }
    }
}
