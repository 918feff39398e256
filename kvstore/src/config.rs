//! The kvstore's configuration: flags with environment fallbacks, validated once.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use model_spec::{BLOCK_TOKENS, SwaPolicy};

use crate::store::StoreConfig;

/// `10GiB`, `512MiB`, `4096` (bytes): binary units, optional `B`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().map_err(|_| format!("`{s}` is not a size: use e.g. 4096, 512MiB or 10GiB"))?;
    let mul: u64 = match unit.trim().to_ascii_lowercase().trim_end_matches('b') {
        "" => 1,
        "k" | "ki" => 1 << 10,
        "m" | "mi" => 1 << 20,
        "g" | "gi" => 1 << 30,
        "t" | "ti" => 1 << 40,
        _ => return Err(format!("`{s}`: unknown size unit `{unit}` (use KiB, MiB, GiB or TiB)")),
    };
    n.checked_mul(mul).ok_or_else(|| format!("`{s}` is too large"))
}

fn policy(s: &str) -> Result<SwaPolicy, String> {
    let p: SwaPolicy = s.parse()?;
    p.validate(BLOCK_TOKENS)?;
    Ok(p)
}

#[derive(Parser, Clone, Debug)]
#[command(name = "kvstore", version, about = "sluice kvstore: SSD-backed shared-prefix KV store")]
pub struct KvstoreConfig {
    /// Check the arguments and exit (0 when valid) without touching files or ports.
    #[arg(long)]
    pub check_config: bool,
    /// Directory for the segment files (an NVMe mount in production).
    #[arg(long, env = "SLUICE_KVSTORE_DIR")]
    pub dir: PathBuf,
    /// Most bytes the store may take on disk.
    #[arg(long, env = "SLUICE_KVSTORE_CAPACITY", default_value = "10GiB", value_parser = parse_bytes)]
    pub capacity: u64,
    /// Segment file size, the unit of compaction (default: capacity / 16, between
    /// 1 MiB and 256 MiB). Records larger than a segment are refused.
    #[arg(long, env = "SLUICE_KVSTORE_SEGMENT_BYTES", value_parser = parse_bytes)]
    pub segment_bytes: Option<u64>,
    /// Bytes accepted but not yet on disk; puts beyond it are dropped (and counted).
    #[arg(long, env = "SLUICE_KVSTORE_QUEUE_BYTES", default_value = "256MiB", value_parser = parse_bytes)]
    pub queue_bytes: u64,
    /// Registered memory puts are written into before they are queued.
    #[arg(long, env = "SLUICE_KVSTORE_STAGING_BYTES", default_value = "256MiB", value_parser = parse_bytes)]
    pub staging_bytes: u64,
    /// What to keep of the sliding-window state: full, periodic:P (P a multiple of
    /// 128) or zero. See the README's "Choosing an SWA policy".
    #[arg(long, env = "SLUICE_SWA_POLICY", default_value = "periodic:1024", value_parser = policy)]
    pub swa_policy: SwaPolicy,
    /// gRPC listen address.
    #[arg(long, env = "SLUICE_LISTEN", default_value = "127.0.0.1:50070")]
    pub listen: String,
    /// Prometheus `/metrics` listen address; `off` disables it.
    #[arg(long, env = "SLUICE_METRICS_LISTEN", default_value = "127.0.0.1:9102")]
    pub metrics_listen: String,
    /// How long a writer may take between BeginPut and CommitPut (ms).
    #[arg(long, env = "SLUICE_KVSTORE_PUT_LEASE_MS", default_value_t = 10_000)]
    pub put_lease_ms: u64,
    /// Longest a Get may take to write records into the caller's memory (ms).
    #[arg(long, env = "SLUICE_KVSTORE_GET_TIMEOUT_MS", default_value_t = 10_000)]
    pub get_timeout_ms: u64,
    /// On SIGTERM, how long to finish requests and write out queued records.
    #[arg(long, env = "SLUICE_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    #[command(flatten)]
    pub tls: cluster::tls::TlsArgs,
}

impl KvstoreConfig {
    pub fn segment_bytes(&self) -> u64 {
        self.segment_bytes.unwrap_or((self.capacity / 16).clamp(1 << 20, 256 << 20))
    }

    pub fn store(&self) -> StoreConfig {
        StoreConfig {
            dir: self.dir.clone(),
            capacity: self.capacity,
            segment_bytes: self.segment_bytes(),
            queue_bytes: self.queue_bytes,
        }
    }

    pub fn put_lease(&self) -> Duration {
        Duration::from_millis(self.put_lease_ms)
    }

    pub fn get_timeout(&self) -> Duration {
        Duration::from_millis(self.get_timeout_ms)
    }

    /// The listeners, as TLS validation and the start-up log name them.
    pub fn listeners(&self) -> [(&'static str, &str); 2] {
        [("--listen", &self.listen), ("--metrics-listen", &self.metrics_listen)]
    }

    /// The arguments alone, touching no files or ports (`--check-config`).
    pub fn validate_args(&self) -> Result<(), String> {
        cluster::net::check_listen("--listen", &self.listen)?;
        cluster::telemetry::serve::check_listen("--metrics-listen", &self.metrics_listen)?;
        self.tls.validate(&self.listeners())?;
        self.store().validate()?;
        if self.staging_bytes < self.store().max_record() {
            return Err(format!(
                "--staging-bytes {} cannot hold one record of up to {} bytes (--segment-bytes less its header)",
                self.staging_bytes,
                self.store().max_record()
            ));
        }
        for (flag, v) in [("--put-lease-ms", self.put_lease_ms), ("--get-timeout-ms", self.get_timeout_ms)] {
            if v == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("10GiB"), Ok(10 << 30));
        assert_eq!(parse_bytes("2g"), Ok(2 << 30));
        assert_eq!(parse_bytes("64KB"), Ok(64 << 10));
        assert!(parse_bytes("ten").unwrap_err().contains("not a size"));
        assert!(parse_bytes("5 parsecs").unwrap_err().contains("unknown size unit"));
    }

    #[test]
    fn arguments_are_checked_with_messages_that_name_the_flag() {
        let parse = |extra: &[&str]| {
            let mut args = vec!["kvstore", "--dir", "/tmp/x"];
            args.extend_from_slice(extra);
            KvstoreConfig::try_parse_from(args)
        };
        let ok = parse(&[]).unwrap();
        assert_eq!(ok.swa_policy, SwaPolicy::Periodic { tokens: 1024 });
        assert_eq!(ok.segment_bytes(), 256 << 20, "capacity / 16, at most 256 MiB");
        assert!(ok.validate_args().is_ok());
        assert!(parse(&["--swa-policy", "periodic:100"]).unwrap_err().to_string().contains("multiple of the 128"));
        let small = parse(&["--capacity", "1MiB", "--segment-bytes", "1MiB"]).unwrap();
        assert!(small.validate_args().unwrap_err().contains("at least two segments"));
        let staging = parse(&["--staging-bytes", "1KiB"]).unwrap();
        assert!(staging.validate_args().unwrap_err().contains("--staging-bytes"));
    }
}
