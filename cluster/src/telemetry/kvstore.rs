//! What the kvstore records (DESIGN §9): lookups and the tokens they asked for and
//! found, bytes read and written, entries, stored bytes and evictions per KV pool,
//! the write-behind queue, dropped puts by reason, write errors and corrupt records.

use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use super::metrics::{self, DROP_REASONS, KV_POOLS, names};

#[derive(Clone, Debug)]
pub struct KvstoreMetrics {
    pub lookups: IntCounter,
    pub query_tokens: IntCounter,
    pub hit_tokens: IntCounter,
    pub miss_tokens: IntCounter,
    read_bytes: IntCounterVec,
    written_bytes: IntCounterVec,
    entries: IntGaugeVec,
    stored_bytes: IntGaugeVec,
    evictions: IntCounterVec,
    pub disk_bytes: IntGauge,
    pub capacity_bytes: IntGauge,
    pub queue_records: IntGauge,
    pub queue_bytes: IntGauge,
    dropped: IntCounterVec,
    pub write_errors: IntCounter,
    pub corrupt: IntCounter,
    pub get_seconds: Histogram,
}

impl KvstoreMetrics {
    pub fn new(registry: &Registry) -> Self {
        let per_pool = |name: &str, help: &str| {
            let v = metrics::counter_vec(registry, name, help, &["pool"]);
            for p in KV_POOLS {
                v.with_label_values(&[p]);
            }
            v
        };
        let gauge_per_pool = |name: &str, help: &str| {
            let v = metrics::gauge_vec(registry, name, help, &["pool"]);
            for p in KV_POOLS {
                v.with_label_values(&[p]);
            }
            v
        };
        let dropped = metrics::counter_vec(
            registry,
            names::KVSTORE_DROPPED,
            "Offered records not stored, by reason (queue_full, staging_full, no_room, checksum, too_large, lease).",
            &["reason"],
        );
        for r in DROP_REASONS {
            dropped.with_label_values(&[r]);
        }
        KvstoreMetrics {
            lookups: metrics::counter(registry, names::KVSTORE_LOOKUPS, "Prefix lookups served."),
            query_tokens: metrics::counter(
                registry,
                names::KVSTORE_QUERY_TOKENS,
                "Tokens of complete blocks looked up.",
            ),
            hit_tokens: metrics::counter(
                registry,
                names::KVSTORE_HIT_TOKENS,
                "Looked-up tokens found (the longest cached prefix).",
            ),
            miss_tokens: metrics::counter(registry, names::KVSTORE_MISS_TOKENS, "Looked-up tokens not found."),
            read_bytes: per_pool(names::KVSTORE_READ_BYTES, "Record bytes served to readers, per KV pool."),
            written_bytes: per_pool(names::KVSTORE_WRITTEN_BYTES, "Record bytes written to disk, per KV pool."),
            entries: gauge_per_pool(
                names::KVSTORE_ENTRIES,
                "Stored records holding bytes of each KV pool (a page holds three pools).",
            ),
            stored_bytes: gauge_per_pool(names::KVSTORE_STORED_BYTES, "Stored record bytes per KV pool."),
            evictions: per_pool(names::KVSTORE_EVICTIONS, "Records evicted for room, per KV pool."),
            disk_bytes: metrics::gauge(registry, names::KVSTORE_DISK_BYTES, "Bytes of segment files on disk."),
            capacity_bytes: metrics::gauge(registry, names::KVSTORE_CAPACITY_BYTES, "Configured disk capacity."),
            queue_records: metrics::gauge(
                registry,
                names::KVSTORE_QUEUE_RECORDS,
                "Records accepted and waiting for the disk writer.",
            ),
            queue_bytes: metrics::gauge(registry, names::KVSTORE_QUEUE_BYTES, "Bytes waiting for the disk writer."),
            dropped,
            write_errors: metrics::counter(
                registry,
                names::KVSTORE_WRITE_ERRORS,
                "Records the disk refused (full or failing); the store keeps serving.",
            ),
            corrupt: metrics::counter(
                registry,
                names::KVSTORE_CORRUPT,
                "Records that failed their checksum when read; they are dropped, never served.",
            ),
            get_seconds: metrics::histogram(
                registry,
                names::KVSTORE_GET_SECONDS,
                "Time to serve a Get: read the records and write them into the caller's memory.",
            ),
        }
    }

    /// Bytes per pool: `(label, bytes)` pairs.
    pub fn read(&self, pools: &[(&str, u64)]) {
        for (p, b) in pools {
            self.read_bytes.with_label_values(&[p]).inc_by(*b);
        }
    }

    pub fn written(&self, pools: &[(&str, u64)]) {
        for (p, b) in pools {
            self.written_bytes.with_label_values(&[p]).inc_by(*b);
        }
    }

    /// One record evicted: counted in every pool it holds bytes of.
    pub fn evicted(&self, pools: &[(&str, u64)]) {
        for (p, b) in pools {
            if *b > 0 {
                self.evictions.with_label_values(&[p]).inc();
            }
        }
    }

    pub fn dropped(&self, reason: &str) {
        self.dropped.with_label_values(&[reason]).inc();
    }

    /// Records dropped for `reason` so far.
    pub fn dropped_count(&self, reason: &str) -> u64 {
        self.dropped.with_label_values(&[reason]).get()
    }

    /// Set the stored-state gauges: `(pool, entries, bytes)`.
    pub fn set_stored(&self, pools: &[(&str, u64, u64)]) {
        for (p, n, b) in pools {
            self.entries.with_label_values(&[p]).set(*n as i64);
            self.stored_bytes.with_label_values(&[p]).set(*b as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::metrics::{encode, registry};

    #[test]
    fn every_series_exists_from_the_start() {
        let r = registry("kvstore");
        let m = KvstoreMetrics::new(&r);
        m.evicted(&[("csa_main", 5), ("swa", 0)]);
        let text = encode(&r);
        for pool in KV_POOLS {
            for name in [names::KVSTORE_READ_BYTES, names::KVSTORE_WRITTEN_BYTES, names::KVSTORE_ENTRIES] {
                assert!(text.contains(&format!(r#"{name}{{pool="{pool}"}}"#)), "{name} {pool}:\n{text}");
            }
        }
        for reason in DROP_REASONS {
            assert!(text.contains(&format!(r#"sluice_kvstore_put_dropped_total{{reason="{reason}"}} 0"#)), "{text}");
        }
        assert!(text.contains(r#"sluice_kvstore_evictions_total{pool="csa_main"} 1"#), "{text}");
        assert!(text.contains(r#"sluice_kvstore_evictions_total{pool="swa"} 0"#), "{text}");
    }
}
