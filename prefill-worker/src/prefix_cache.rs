//! The prefill worker's side of the shared-prefix kvstore: find the longest cached
//! prefix of a prompt and choose how to resume from it (lookup), have the store write
//! its pages (and a window snapshot) into a sequence's pages and slot (fetch), and
//! offer a finished prompt's blocks back (put).
//!
//! Every call is bounded by `--kvstore-timeout-ms`; a store that is down, slow or
//! missing a record makes the prompt go on cold, counted, never failed.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use cluster::telemetry::propagation::{PropagateContext, Traced};
use model_spec::block_hash::{BlockHash, block_hashes};
use model_spec::prefix::{RestoreInput, restorable_blocks};
use model_spec::{Fingerprint, KvLayout, RestorePlan, SwaPolicy};
use sluice_proto::v1 as pb;
use sluice_proto::v1::kv_store_client::KvStoreClient;
use tonic::transport::Channel;
use transfer::{RegionSpec, RemoteWrite, Sender, Source};

use crate::memory::KvRegions;

/// What a lookup found for one prompt and how to resume from it.
#[derive(Clone, Debug)]
pub struct Prefix {
    /// Keys of every complete block of the prompt.
    pub keys: Vec<BlockHash>,
    pub policy: SwaPolicy,
    pub plan: RestorePlan,
}

/// A fetch that did not deliver.
#[derive(Clone, Debug)]
pub struct FetchError {
    pub message: String,
    /// Whether the store might have written some bytes (and might still, until the
    /// fetch's deadline).
    pub may_have_written: bool,
}

/// One record of a put: its description, where its bytes are (host memory, or a GPU's
/// KV memory when the store reaches it) and their KV checksum.
pub struct PutRecord<'a> {
    pub record: pb::PutRecord,
    pub source: Source<'a>,
    pub checksum: u64,
}

pub struct PrefixCache {
    client: KvStoreClient<Traced<Channel>>,
    /// Learned from the store's Info (None until it answered once).
    policy: RwLock<Option<SwaPolicy>>,
    fingerprint: Fingerprint,
    layout: KvLayout,
    layers: usize,
    regions: KvRegions,
    pub timeout: Duration,
}

impl PrefixCache {
    pub fn new(
        url: &str,
        dialer: &cluster::tls::Dialer,
        fingerprint: Fingerprint,
        layout: KvLayout,
        layers: usize,
        regions: KvRegions,
        timeout: Duration,
    ) -> Result<Arc<Self>, String> {
        let endpoint = dialer.endpoint(url).map_err(|e| format!("--kvstore {e}"))?.connect_timeout(timeout);
        let channel = dialer.lazy(&endpoint);
        Ok(Arc::new(PrefixCache {
            client: KvStoreClient::with_interceptor(channel, PropagateContext),
            policy: RwLock::new(None),
            fingerprint,
            layout,
            layers,
            regions,
            timeout,
        }))
    }

    /// The store's SWA policy (asked once; until the store answers, None).
    pub async fn policy(&self) -> Result<SwaPolicy, String> {
        if let Some(p) = *self.policy.read().expect("not poisoned") {
            return Ok(p);
        }
        let mut req = tonic::Request::new(pb::KvInfoRequest {});
        req.set_timeout(self.timeout);
        let info = self.client.clone().info(req).await.map_err(|s| format!("kvstore info: {}", s.message()))?;
        let p: SwaPolicy = info.into_inner().swa_policy.parse()?;
        *self.policy.write().expect("not poisoned") = Some(p);
        tracing::info!(policy = %p, "kvstore policy");
        Ok(p)
    }

    /// Look up a prompt's prefix and choose how to resume from it.
    pub async fn lookup(&self, tokens: &[u32]) -> Result<Prefix, String> {
        let policy = self.policy().await?;
        let keys = block_hashes(&self.fingerprint, tokens);
        let usable = restorable_blocks(tokens.len(), self.layout.block);
        if usable == 0 {
            return Ok(Prefix { keys, policy, plan: RestorePlan::choose(&self.input(0, &[])) });
        }
        let mut req =
            tonic::Request::new(pb::LookupRequest { keys: keys[..usable].iter().map(|k| k.to_vec()).collect() });
        req.set_timeout(self.timeout);
        let r = self.client.clone().lookup(req).await.map_err(|s| format!("kvstore lookup: {}", s.message()))?;
        let r = r.into_inner();
        let snapshots: Vec<usize> = r.snapshots.iter().map(|&s| s as usize).collect();
        let plan = RestorePlan::choose(&self.input((r.cached_blocks as usize).min(usable), &snapshots));
        Ok(Prefix { keys, policy, plan })
    }

    fn input<'a>(&self, cached_blocks: usize, snapshots: &'a [usize]) -> RestoreInput<'a> {
        RestoreInput {
            cached_blocks,
            snapshots,
            block: self.layout.block,
            window: self.layout.window,
            layers: self.layers,
        }
    }

    /// Have the store write the first `blocks` pages (into `page_ids`) and, when
    /// `snapshot` is set, the snapshot at that boundary (into `slot`), through the regions
    /// of part `part` of this worker's KV memory (ids relative to it). Returns the
    /// store's KV checksums: pages in order, then the snapshot's.
    pub async fn fetch(
        &self,
        keys: &[BlockHash],
        page_ids: &[u32],
        slot: usize,
        snapshot: bool,
        part: usize,
    ) -> Result<Vec<u64>, FetchError> {
        let l = &self.layout;
        let p = self.regions.part(part);
        let mut req = pb::GetRequest {
            deadline_ms: self.timeout.as_millis() as u64,
            ucx_address: self.regions.ucx_address.clone(),
            regions: [&p.pages, &p.rings, &p.comp].map(region).to_vec(),
            ..Default::default()
        };
        for (i, (key, &page)) in keys.iter().zip(page_ids).enumerate() {
            req.keys.push(key.to_vec());
            req.kinds.push(pb::RecordKind::Page as i32);
            let len = l.page_bytes() as u64;
            req.pieces.push(pb::Piece { record: i as u32, region: 0, offset: page as u64 * len, len });
        }
        if snapshot {
            let i = keys.len() as u32;
            req.keys.push(keys.last().expect("a snapshot follows its block").to_vec());
            req.kinds.push(pb::RecordKind::Snapshot as i32);
            let ring = l.window_bytes() as u64;
            let comp_slot = (l.comp_elems * 4) as u64;
            req.pieces.push(pb::Piece { record: i, region: 1, offset: slot as u64 * ring, len: ring });
            req.pieces.push(pb::Piece {
                record: i,
                region: 2,
                offset: slot as u64 * comp_slot,
                len: (l.comp_carry_elems * 4) as u64,
            });
        }
        let mut r = tonic::Request::new(req);
        r.set_timeout(self.timeout);
        let reply = self.client.clone().get(r).await.map_err(|s| FetchError {
            message: format!("kvstore get: {}", s.message()),
            // These are refused before anything is written.
            may_have_written: !matches!(
                s.code(),
                tonic::Code::NotFound
                    | tonic::Code::InvalidArgument
                    | tonic::Code::FailedPrecondition
                    | tonic::Code::DataLoss
            ),
        })?;
        Ok(reply.into_inner().checksums)
    }

    /// Offer records to the store and write the ones it takes into its staging
    /// (blocking: runs on the engine thread, which owns the UCX sender and the memory
    /// the bytes are in). Returns the bytes written.
    pub fn put(
        &self,
        rt: &tokio::runtime::Handle,
        sender: &mut Sender,
        records: &[PutRecord<'_>],
    ) -> Result<u64, String> {
        if records.is_empty() {
            return Ok(0);
        }
        let client = self.client.clone();
        let timeout = self.timeout;
        let mut begin =
            tonic::Request::new(pb::BeginPutRequest { records: records.iter().map(|r| r.record.clone()).collect() });
        begin.set_timeout(timeout);
        let reply = rt
            .block_on(client.clone().begin_put(begin))
            .map_err(|s| format!("kvstore begin-put: {}", s.message()))?
            .into_inner();
        let taken: Vec<&PutRecord<'_>> =
            records.iter().zip(&reply.accepted).filter(|(_, a)| **a).map(|(r, _)| r).collect();
        if taken.is_empty() {
            return Ok(0);
        }
        let staging = region_spec(reply.staging.as_ref().ok_or("kvstore begin-put: no staging region")?);
        if taken.len() != reply.offsets.len() {
            return Err("kvstore begin-put: offsets do not match the accepted records".into());
        }
        let writes: Vec<RemoteWrite<'_>> = taken
            .iter()
            .zip(&reply.offsets)
            .map(|(r, &offset)| RemoteWrite { region: &staging, offset, source: r.source })
            .collect();
        let written = sender.write(&reply.ucx_address, &writes, timeout);
        let abort = |client: KvStoreClient<Traced<Channel>>, id: String| {
            let _ = rt.block_on(client.clone().abort_put(pb::AbortPutRequest { put_id: id }));
        };
        let stats = match written {
            Ok(s) => s,
            Err(e) => {
                abort(client, reply.put_id);
                return Err(format!("writing into the kvstore's staging: {e}"));
            }
        };
        let mut commit = tonic::Request::new(pb::CommitPutRequest {
            put_id: reply.put_id,
            checksums: taken.iter().map(|r| r.checksum).collect(),
        });
        commit.set_timeout(timeout);
        let done = rt
            .block_on(client.clone().commit_put(commit))
            .map_err(|s| format!("kvstore commit-put: {}", s.message()))?;
        let done = done.into_inner();
        if done.rejected > 0 {
            tracing::debug!(rejected = done.rejected, "the kvstore dropped some records (full queue or checksum)");
        }
        Ok(stats.bytes)
    }
}

fn region(r: &RegionSpec) -> pb::RemoteRegion {
    pb::RemoteRegion { base: r.base, len: r.len, rkey: r.rkey.clone() }
}

fn region_spec(r: &pb::RemoteRegion) -> RegionSpec {
    RegionSpec { base: r.base, len: r.len, rkey: r.rkey.clone() }
}
