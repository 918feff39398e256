//! `sluice`: model tooling, in-process generation and benchmarks (and, as the serving
//! crates land, the local cluster and its client).
//!
//! Module map:
//! - `model_cmd`: `sluice model init|inspect`.
//! - `generate_cmd`: `sluice generate` (in-process, or through a router).
//! - `up_cmd`: `sluice up`, a local cluster of child processes (started by `local`).
//! - `local`: starting and stopping a local cluster.
//! - `gpu_layout`: which devices each worker of `sluice up` computes on.
//! - `client`: the gRPC client of the router (TLS and API keys when the router wants them).
//! - `health_cmd`: `sluice health`, one gRPC health check (the Helm chart's probe of TLS ports).
//! - `bench_cmd`: `sluice bench engine`, and dispatch of `bench transfer`.
//! - `bench_engine`: `sluice bench engine --device cuda:N` (the GPU benchmark), over
//!   `bench_gpus` (one GPU or several: what is measured on them), refused before loading
//!   by `bench_memory` when the memory plan says the run cannot fit.
//! - `bench_transfer`: `sluice bench transfer` (KV sender GB/s next to ucx_perftest), its
//!   GPU children in `bench_transfer_gpu`, its child processes driven by `child_proc`.
//! - `bench_kvstore`: `sluice bench kvstore` (kvstore GB/s next to fio).
//! - `bench_prefix`: `sluice bench prefix` (the SWA policy table: bytes, recompute, TTFT).
//! - `bench_collectives`: `sluice bench collectives` (MoE row exchanges between GPUs:
//!   all-gather + reduce-scatter vs all-to-all, bytes and NCCL times).
//! - `bench_serve`: `sluice bench serve` (load through a router: rate sweeps, TTFT, ITL, hit rate).
//! - `args`: shared argument parsing helpers.
//! - `progress`: a progress bar over a byte counter (long `model init` writes).

mod args;
mod bench_cmd;
mod bench_collectives;
mod bench_engine;
mod bench_gpus;
mod bench_kvstore;
mod bench_memory;
mod bench_prefix;
mod bench_serve;
mod bench_transfer;
mod bench_transfer_gpu;
mod child_proc;
mod client;
mod generate_cmd;
mod gpu_layout;
mod health_cmd;
mod local;
mod model_cmd;
mod progress;
mod up_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "sluice", version, about = "Disaggregated DeepSeek-V4 serving: tools and local cluster")]
struct Cli {
    /// Worker threads for CPU compute (default: one per core).
    #[arg(long, global = true, env = "SLUICE_THREADS")]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or describe model checkpoints.
    #[command(subcommand)]
    Model(model_cmd::ModelCmd),
    /// Start a local cluster (router, prefill and decode workers) and keep it running.
    Up(up_cmd::UpArgs),
    /// Generate tokens from a prompt, in this process or through a router.
    Generate(generate_cmd::GenerateArgs),
    /// Measure performance.
    #[command(subcommand)]
    Bench(bench_cmd::BenchCmd),
    /// Check a service's gRPC health (exit 0 when SERVING), over TLS with --tls-dir.
    Health(health_cmd::HealthArgs),
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,engine=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Some(n) = cli.threads
        && let Err(e) = rayon::ThreadPoolBuilder::new().num_threads(n).build_global()
    {
        eprintln!("error: cannot set {n} threads: {e}");
        std::process::exit(2);
    }
    let result = match cli.command {
        Command::Model(cmd) => model_cmd::run(cmd),
        Command::Up(args) => up_cmd::run(args),
        Command::Generate(args) => generate_cmd::run(args),
        Command::Bench(cmd) => bench_cmd::run(cmd),
        Command::Health(args) => health_cmd::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
