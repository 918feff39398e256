//! The decode worker's configuration: flags with environment fallbacks, validated once.

use std::path::PathBuf;

use clap::Parser;
use kernels::EntryDtype;

#[derive(Parser, Clone, Debug)]
#[command(
    name = "decode-worker",
    version,
    about = "sluice decode worker: receives KV over UCX, decodes, streams tokens"
)]
pub struct DecodeConfig {
    /// Check the arguments and exit (0 when valid) without loading anything.
    #[arg(long)]
    pub check_config: bool,
    /// Model directory (config.json, safetensors).
    #[arg(long, env = "SLUICE_MODEL")]
    pub model: PathBuf,
    /// Where the model computes: cpu, or cuda:N (KV then lives in GPU memory and moves
    /// through a registered host mirror).
    #[arg(long, env = "SLUICE_DEVICE", default_value = "cpu")]
    pub device: engine::device::Device,
    /// Several GPUs of this host as one worker, e.g. `cuda:0,cuda:1` (routed experts
    /// split over them, each sequence and its KV on one of them); replaces --device.
    /// `cpu,cpu` runs that layout on the CPU (for trials and tests).
    #[arg(long, env = "SLUICE_DEVICES", conflicts_with = "device")]
    pub devices: Option<engine::device::DeviceList>,
    /// Name the model is served as (default: the directory name).
    #[arg(long, env = "SLUICE_MODEL_NAME")]
    pub model_name: Option<String>,
    /// gRPC listen address.
    #[arg(long, env = "SLUICE_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Address other hosts use to reach this worker (default: the bound address).
    #[arg(long, env = "SLUICE_ADVERTISE")]
    pub advertise: Option<String>,
    /// Prometheus `/metrics` listen address (nothing else is served there); `off` disables it.
    #[arg(long, env = "SLUICE_METRICS_LISTEN", default_value = "127.0.0.1:9101")]
    pub metrics_listen: String,
    /// KV entry storage (must match the prefill workers').
    #[arg(long, env = "SLUICE_KV_DTYPE", default_value = "bf16", value_parser = EntryDtype::parse_arg)]
    pub kv_dtype: EntryDtype,
    /// On GPUs, the precision of the activations in the bf16 tensor-core products: `bf16`
    /// (rounded once, the reference model's precision; the default) or `split` (two bf16
    /// parts: results at f32 distance from the CPU engine, prefill ~16% slower). CPU
    /// engines compute in f32 either way.
    #[arg(long, env = "SLUICE_ACTIVATIONS")]
    pub activations: Option<kernels::Activations>,
    /// Device memory to plan for (e.g. `70GiB` on a shared GPU); default: the whole
    /// device. The worker refuses to start when its model, workspace and KV pool do not fit.
    #[arg(long, env = "SLUICE_GPU_MEMORY", value_parser = engine::memory_plan::parse_size)]
    pub gpu_memory: Option<u64>,
    /// On GPUs, whether prefill workers write KV straight into device memory (`auto`:
    /// when the loaded libucx has CUDA transports; `on`: refuse to start otherwise;
    /// `off`: always through a registered host mirror).
    #[arg(long, env = "SLUICE_GPU_DIRECT", default_value = "auto")]
    pub gpu_direct: transfer::GpuDirect,
    /// KV pages (128-token blocks) in the pool.
    #[arg(long, env = "SLUICE_MAX_PAGES", default_value_t = 1024)]
    pub max_pages: usize,
    /// State-cache slots: reserved plus running sequences.
    #[arg(long, env = "SLUICE_MAX_SEQUENCES", default_value_t = 64)]
    pub max_sequences: usize,
    /// Most sequences decoded per step.
    #[arg(long, env = "SLUICE_MAX_BATCH", default_value_t = 32)]
    pub max_batch: usize,
    /// How long a reservation waits for its prefill worker, and a commit for its
    /// decode request, before the pages are reclaimed (ms).
    #[arg(long, env = "SLUICE_LEASE_MS", default_value_t = 30_000)]
    pub lease_ms: u64,
    /// etcd endpoints (comma-separated); without them the worker only serves whoever
    /// was told its address (static peers).
    #[arg(long, env = "SLUICE_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster name (etcd key prefix).
    #[arg(long, env = "SLUICE_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// CPU threads for compute (default: all cores).
    /// On SIGTERM, how long running requests may take to finish before the worker exits.
    #[arg(long, env = "SLUICE_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    #[arg(long, env = "SLUICE_THREADS")]
    pub threads: Option<usize>,
    /// Skip the start-up warm-up on GPUs: short prefills and decode steps of made-up
    /// tokens before the worker takes requests, so that cuBLAS's kernel loading and the
    /// first CUDA-graph captures are not paid by the first requests (CPU engines never
    /// warm up).
    #[arg(long, env = "SLUICE_NO_WARMUP")]
    pub no_warmup: bool,
    /// Serve test hooks (DumpKv).
    #[arg(long, env = "SLUICE_DEBUG_HOOKS")]
    pub debug_hooks: bool,
    /// Test hook: sleep this long before every decode step (needs --debug-hooks).
    #[arg(long, default_value_t = 0)]
    pub debug_step_delay_ms: u64,
    #[command(flatten)]
    pub tls: cluster::tls::TlsArgs,
}

impl DecodeConfig {
    /// The devices the engine computes on (`--devices`, else `--device`).
    pub fn devices(&self) -> Vec<engine::device::Device> {
        engine::device::chosen(self.device, self.devices.as_ref())
    }

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
        engine::device::check_pools(&self.devices(), self.gpu_memory.is_some(), self.max_pages, self.max_sequences)?;
        cluster::telemetry::serve::check_listen("--metrics-listen", &self.metrics_listen)?;
        cluster::net::check_endpoints("--etcd", &self.etcd)?;
        self.tls.validate(&self.listeners())?;
        for (flag, v) in
            [("--max-pages", self.max_pages), ("--max-sequences", self.max_sequences), ("--max-batch", self.max_batch)]
        {
            if v == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        if self.debug_step_delay_ms > 0 && !self.debug_hooks {
            return Err("--debug-step-delay-ms is a test hook; it needs --debug-hooks".into());
        }
        if self.lease_ms < 100 {
            return Err(format!("--lease-ms {} is too short to prefill anything; use at least 100", self.lease_ms));
        }
        Ok(())
    }

    /// The listeners, as TLS validation and the start-up log name them.
    pub fn listeners(&self) -> [(&'static str, &str); 2] {
        [("--listen", &self.listen), ("--metrics-listen", &self.metrics_listen)]
    }

    pub fn model_name(&self) -> String {
        self.model_name.clone().unwrap_or_else(|| {
            self.model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
        })
    }
}
