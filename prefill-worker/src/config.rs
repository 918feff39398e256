//! The prefill worker's configuration: flags with environment fallbacks, validated once.

use std::path::PathBuf;

use clap::Parser;
use kernels::EntryDtype;

#[derive(Parser, Clone, Debug)]
#[command(
    name = "prefill-worker",
    version,
    about = "sluice prefill worker: computes prompt KV and writes it into decode workers"
)]
pub struct PrefillConfig {
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
    #[arg(long, env = "SLUICE_METRICS_LISTEN", default_value = "127.0.0.1:9100")]
    pub metrics_listen: String,
    /// KV entry storage (must match the decode workers').
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
    /// On GPUs, whether a prompt's KV is sent to the decode worker straight from device
    /// memory (`auto`: when the loaded libucx has CUDA transports; `on`: refuse to start
    /// otherwise; `off`: staged through a registered host mirror).
    #[arg(long, env = "SLUICE_GPU_DIRECT", default_value = "auto")]
    pub gpu_direct: transfer::GpuDirect,
    /// Let the kvstore write restored prefixes straight into GPU memory (and read
    /// offered blocks from it), for transports that reach GPU memory from the store's
    /// host memory (GPUDirect RDMA: UCX_TLS with rc/dc on GPUDirect-capable NICs).
    /// Off: kvstore traffic goes through a registered host mirror, copied to and from
    /// the GPU; sends to decode workers are direct either way (`--gpu-direct`).
    #[arg(long, env = "SLUICE_KVSTORE_GPU_DIRECT")]
    pub kvstore_gpu_direct: bool,
    /// KV pages for prompts in flight.
    #[arg(long, env = "SLUICE_MAX_PAGES", default_value_t = 512)]
    pub max_pages: usize,
    /// Prompts prefilled at once.
    #[arg(long, env = "SLUICE_MAX_SEQUENCES", default_value_t = 16)]
    pub max_sequences: usize,
    /// Tokens computed per step, across the prompts in it (longer prompts are chunked).
    #[arg(long, env = "SLUICE_TOKEN_BUDGET", default_value_t = 2048)]
    pub token_budget: usize,
    /// Longest a KV transfer may take (ms).
    #[arg(long, env = "SLUICE_TRANSFER_TIMEOUT_MS", default_value_t = 20_000)]
    pub transfer_timeout_ms: u64,
    /// etcd endpoints (comma-separated).
    #[arg(long, env = "SLUICE_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster name (etcd key prefix).
    #[arg(long, env = "SLUICE_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// On SIGTERM, how long running requests may take to finish before the worker exits.
    #[arg(long, env = "SLUICE_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// CPU threads for compute (default: all cores).
    #[arg(long, env = "SLUICE_THREADS")]
    pub threads: Option<usize>,
    /// The shared-prefix kvstore (e.g. http://kvstore:50070); prompts sharing a cached
    /// prefix restore it instead of computing it. Without it every prompt is cold.
    #[arg(long, env = "SLUICE_KVSTORE")]
    pub kvstore: Option<String>,
    /// Longest a kvstore lookup or fetch may take before the prompt goes on cold (ms).
    #[arg(long, env = "SLUICE_KVSTORE_TIMEOUT_MS", default_value_t = 2_000)]
    pub kvstore_timeout_ms: u64,
    /// Most bytes of finished prompts' blocks waiting to be offered to the kvstore (by
    /// a thread of their own); offers past it are dropped and counted.
    #[arg(long, env = "SLUICE_KVSTORE_PUT_QUEUE_BYTES", default_value = "1GiB", value_parser = engine::memory_plan::parse_size)]
    pub kvstore_put_queue_bytes: u64,
    /// Skip the start-up warm-up on GPUs: short prefills and decode steps of made-up
    /// tokens before the worker takes requests, so that cuBLAS's kernel loading and the
    /// first CUDA-graph captures are not paid by the first requests (CPU engines never
    /// warm up).
    #[arg(long, env = "SLUICE_NO_WARMUP")]
    pub no_warmup: bool,
    /// Serve test hooks (DumpKv).
    #[arg(long, env = "SLUICE_DEBUG_HOOKS")]
    pub debug_hooks: bool,
    /// Test hook: sleep this long before writing a prompt's KV (needs --debug-hooks).
    #[arg(long, default_value_t = 0)]
    pub debug_transfer_delay_ms: u64,
    #[command(flatten)]
    pub tls: cluster::tls::TlsArgs,
}

impl PrefillConfig {
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
        if let Some(k) = &self.kvstore {
            cluster::net::check_endpoints("--kvstore", std::slice::from_ref(k))?;
        }
        if self.kvstore_timeout_ms == 0 {
            return Err("--kvstore-timeout-ms must be at least 1".into());
        }
        if self.kvstore_gpu_direct && (self.kvstore.is_none() || self.gpu_direct == transfer::GpuDirect::Off) {
            return Err("--kvstore-gpu-direct needs --kvstore and GPU-direct sends (--gpu-direct auto or on)".into());
        }
        for (flag, v) in [
            ("--max-pages", self.max_pages),
            ("--max-sequences", self.max_sequences),
            ("--token-budget", self.token_budget),
        ] {
            if v == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        if self.debug_transfer_delay_ms > 0 && !self.debug_hooks {
            return Err("--debug-transfer-delay-ms is a test hook; it needs --debug-hooks".into());
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
