//! What a prompt will cost its prefill worker once the prefix cache is counted: the
//! tokens not covered by the longest cached prefix, plus what the store's SWA policy
//! makes the worker recompute (DESIGN §7). One bounded lookup per request; a store
//! that does not answer in time means the prompt is placed as if nothing were cached.

use std::sync::RwLock;
use std::time::Duration;

use cluster::telemetry::propagation::{PropagateContext, Traced};
use model_spec::block_hash::block_hashes;
use model_spec::prefix::{RestoreInput, restorable_blocks};
use model_spec::{Fingerprint, RestorePlan, SwaPolicy};
use sluice_proto::v1 as pb;
use sluice_proto::v1::kv_store_client::KvStoreClient;
use tonic::transport::Channel;

pub struct PrefixLookup {
    client: KvStoreClient<Traced<Channel>>,
    policy: RwLock<Option<SwaPolicy>>,
    timeout: Duration,
    block: usize,
    window: usize,
    layers: usize,
}

impl PrefixLookup {
    pub fn new(
        url: &str,
        dialer: &cluster::tls::Dialer,
        timeout: Duration,
        block: usize,
        window: usize,
        layers: usize,
    ) -> Result<Self, String> {
        let endpoint =
            dialer.endpoint(url).map_err(|e| format!("--kvstore {e}"))?.connect_timeout(Duration::from_secs(2));
        let channel = dialer.lazy(&endpoint);
        Ok(PrefixLookup {
            client: KvStoreClient::with_interceptor(channel, PropagateContext),
            policy: RwLock::new(None),
            timeout,
            block,
            window,
            layers,
        })
    }

    async fn policy(&self) -> Option<SwaPolicy> {
        if let Some(p) = *self.policy.read().expect("not poisoned") {
            return Some(p);
        }
        let mut req = tonic::Request::new(pb::KvInfoRequest {});
        req.set_timeout(self.timeout);
        let p: SwaPolicy = self.client.clone().info(req).await.ok()?.into_inner().swa_policy.parse().ok()?;
        *self.policy.write().expect("not poisoned") = Some(p);
        Some(p)
    }

    /// How the prompt's prefill worker will resume it, as far as the store knows now.
    pub async fn plan(&self, fingerprint_hex: &str, tokens: &[u32]) -> Option<RestorePlan> {
        let fingerprint = Fingerprint::from_hex(fingerprint_hex)?;
        let usable = restorable_blocks(tokens.len(), self.block);
        if usable == 0 {
            return None;
        }
        tokio::time::timeout(self.timeout, async {
            self.policy().await?;
            let keys = block_hashes(&fingerprint, &tokens[..usable * self.block]);
            let mut req = tonic::Request::new(pb::LookupRequest { keys: keys.iter().map(|k| k.to_vec()).collect() });
            req.set_timeout(self.timeout);
            let r = self.client.clone().lookup(req).await.ok()?.into_inner();
            let snapshots: Vec<usize> = r.snapshots.iter().map(|&s| s as usize).collect();
            Some(RestorePlan::choose(&RestoreInput {
                cached_blocks: (r.cached_blocks as usize).min(usable),
                snapshots: &snapshots,
                block: self.block,
                window: self.window,
                layers: self.layers,
            }))
        })
        .await
        .ok()
        .flatten()
    }
}

/// Prompt tokens a prefill worker will spend on a prompt: what it computes from
/// scratch plus what it recomputes to restore the rest.
pub fn prefill_cost(prompt: usize, plan: Option<&RestorePlan>) -> u64 {
    match plan {
        Some(p) => (prompt - p.cached_tokens.min(prompt) + p.recompute_tokens) as u64,
        None => prompt as u64,
    }
}

#[cfg(test)]
mod tests {
    use model_spec::Restore;

    use super::*;

    #[test]
    fn cost_counts_what_is_computed_and_recomputed() {
        assert_eq!(prefill_cost(1000, None), 1000);
        let hit = RestorePlan {
            restore: Restore::Snapshot { blocks: 6 },
            cached_tokens: 768,
            recompute_tokens: 128,
            recompute_cost: 1024,
        };
        assert_eq!(prefill_cost(1000, Some(&hit)), 1000 - 768 + 128);
    }
}
