//! The router's configuration: flags with environment fallbacks, validated once.

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser, Clone, Debug)]
#[command(name = "router", version, about = "sluice router: client API, placement, prefill/decode orchestration")]
pub struct RouterConfig {
    /// Check the arguments and exit (0 when valid) without loading anything.
    #[arg(long)]
    pub check_config: bool,
    /// Model directory (config.json for limits, tokenizer.json for text prompts).
    #[arg(long, env = "SLUICE_MODEL")]
    pub model: PathBuf,
    /// Name the model is served as (default: the directory name).
    #[arg(long, env = "SLUICE_MODEL_NAME")]
    pub model_name: Option<String>,
    /// gRPC listen address (sluice.v1.Generation, grpc.health.v1).
    #[arg(long, env = "SLUICE_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// HTTP listen address (OpenAI-style /v1/completions, /v1/models, /health).
    #[arg(long, env = "SLUICE_HTTP_LISTEN", default_value = "127.0.0.1:8080")]
    pub http_listen: String,
    /// Static workers: `prefill=http://host:port,decode=http://host:port,…`.
    #[arg(long, env = "SLUICE_PEERS")]
    pub peers: Option<String>,
    /// etcd endpoints (comma-separated); workers registered there are discovered.
    #[arg(long, env = "SLUICE_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster name (etcd key prefix).
    #[arg(long, env = "SLUICE_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// Requests in flight at once; beyond it new ones get RESOURCE_EXHAUSTED at once.
    #[arg(long, env = "SLUICE_MAX_CONCURRENCY", default_value_t = 256)]
    pub max_concurrency: usize,
    /// Longest one request may take, from arrival to its last token (seconds).
    #[arg(long, env = "SLUICE_REQUEST_TIMEOUT_S", default_value_t = 600)]
    pub request_timeout_s: u64,
    /// Largest max_tokens a request may ask for.
    #[arg(long, env = "SLUICE_MAX_TOKENS_LIMIT", default_value_t = 4096)]
    pub max_tokens_limit: u32,
    /// Prefill attempts on other workers after one fails.
    #[arg(long, env = "SLUICE_PREFILL_RETRIES", default_value_t = 2)]
    pub prefill_retries: u32,
    /// Migrations per request: a decode worker lost mid-stream is replaced by another
    /// pair that re-prefills the prompt plus the tokens already streamed, and the stream
    /// continues (0: the stream fails with UNAVAILABLE instead).
    #[arg(long, env = "SLUICE_MIGRATION_LIMIT", default_value_t = 2)]
    pub migration_limit: u32,
    /// Longest one migration attempt may take, from the loss to the re-prefill's commit
    /// (seconds).
    #[arg(long, env = "SLUICE_MIGRATION_TIMEOUT_S", default_value_t = 30)]
    pub migration_timeout_s: u64,
    /// How often workers are asked for their load (ms).
    #[arg(long, env = "SLUICE_LOAD_POLL_MS", default_value_t = 200)]
    pub load_poll_ms: u64,
    /// The shared-prefix kvstore: placement counts what a prompt will restore instead
    /// of compute (prefill workers need their own --kvstore to use it).
    #[arg(long, env = "SLUICE_KVSTORE")]
    pub kvstore: Option<String>,
    /// Longest the placement lookup in the kvstore may take (ms); past it the prompt
    /// is placed as if nothing were cached.
    #[arg(long, env = "SLUICE_KVSTORE_LOOKUP_TIMEOUT_MS", default_value_t = 200)]
    pub kvstore_lookup_timeout_ms: u64,
    /// A file of API keys, one per line (blank lines and `#` comments skipped). With it,
    /// every `/v1/...` HTTP request needs `Authorization: Bearer <key>` (else 401), and
    /// every `sluice.v1.Generation` call the same in its `authorization` metadata (else
    /// UNAUTHENTICATED).
    #[arg(long, env = "SLUICE_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// TLS on the client API (no client certificates asked for) and towards the workers and
    /// the kvstore (with this router's certificate).
    #[command(flatten)]
    pub tls: cluster::tls::TlsArgs,
}

impl RouterConfig {
    /// Everything, including that the model directory holds a config.
    pub fn validate(&self) -> Result<(), String> {
        if !self.model.join("config.json").is_file() {
            return Err(format!("--model {}: no config.json there", self.model.display()));
        }
        self.validate_args()
    }

    /// The arguments alone, touching no files or ports (`--check-config`).
    pub fn validate_args(&self) -> Result<(), String> {
        cluster::net::check_listen("--listen", &self.listen)?;
        cluster::net::check_listen("--http-listen", &self.http_listen)?;
        self.tls.validate(&self.listeners())?;
        cluster::net::check_endpoints("--etcd", &self.etcd)?;
        if let Some(k) = &self.kvstore {
            cluster::net::check_endpoints("--kvstore", std::slice::from_ref(k))?;
        }
        if self.kvstore_lookup_timeout_ms == 0 {
            return Err("--kvstore-lookup-timeout-ms must be at least 1".into());
        }
        if self.peers.is_none() && self.etcd.is_empty() {
            return Err("no workers to route to: give --peers (single machine) or --etcd (cluster)".into());
        }
        if let Some(p) = &self.peers {
            cluster::peers::parse_peers(p).map_err(|e| format!("--peers: {e}"))?;
        }
        if self.max_concurrency == 0 || self.max_tokens_limit == 0 || self.request_timeout_s == 0 {
            return Err("--max-concurrency, --max-tokens-limit and --request-timeout-s must be at least 1".into());
        }
        if self.migration_timeout_s == 0 {
            return Err("--migration-timeout-s must be at least 1 (turn migration off with --migration-limit 0)".into());
        }
        Ok(())
    }

    /// The listeners, as TLS validation and the start-up log name them.
    pub fn listeners(&self) -> [(&'static str, &str); 2] {
        [("--listen", &self.listen), ("--http-listen", &self.http_listen)]
    }

    pub fn model_name(&self) -> String {
        self.model_name.clone().unwrap_or_else(|| {
            self.model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
        })
    }
}
