//! `sluice bench collectives`: the two ways expert parallelism can move a MoE layer's
//! rows between the GPUs of one worker, timed side by side over NCCL at V4-Flash sizes.
//!
//! - **all-gather + reduce-scatter** (what `kernels::sharded::moe` runs): every GPU
//!   gathers every GPU's rows, computes its experts' share of every row, and a
//!   reduce-scatter returns each row's sum to its owner. Each GPU sends its rows to
//!   every other GPU and each other GPU's block of partial sums back:
//!   `2 · (N − 1) · rows · row_bytes` per GPU and layer, whatever the routing.
//! - **all-to-all dispatch + combine** (`kernels::cuda::collective::Nccl::all_to_all`):
//!   a row goes only to the GPUs holding at least one of its top-k experts, and those
//!   GPUs' outputs come back the same way (counts transposed); local experts read their
//!   rows in place. Bytes follow the routing: with top-6 of 256 experts in contiguous
//!   blocks, a row reaches 0.99 of the 1 other GPU of two, 2.5 of 3 of four, 3.9 of 7 of
//!   eight.
//!
//! The routing is drawn at random (k distinct experts a row, uniform, seeded), which is
//! what a balanced router gives; expert `e` of `E` lives on GPU `⌊e·N/E⌋` as in the
//! engine. Rows are f32 as the sharded MoE exchanges them (`--value-bytes 2` times bf16
//! rows as the same bytes of f32 values). Times are device time over all GPUs' streams
//! (CUDA events, the slowest GPU; host issue included), the median of `--reps` after
//! `--warmup`. The all-to-all is reported twice: the two exchanges alone, and with the
//! packing a real dispatch adds (gathering each destination's rows into one buffer,
//! and on return adding each peer's outputs into the owner's rows).

use anyhow::{Result, bail};
use clap::Args;
use engine::Device;
use serde_json::{Value, json};

#[derive(Args)]
pub struct CollectivesArgs {
    /// The GPUs of one worker, e.g. `cuda:0,cuda:1` (each once: NCCL takes a GPU once).
    #[arg(long)]
    devices: engine::device::DeviceList,
    /// Rows each GPU holds when a MoE layer starts: decode batches, then prefill chunks.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,128,2048,8192")]
    rows: Vec<usize>,
    /// Values a row (V4-Flash's hidden size).
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    /// Routed experts a layer.
    #[arg(long, default_value_t = 256)]
    experts: usize,
    /// Experts each row is routed to.
    #[arg(long, default_value_t = 6)]
    top_k: usize,
    /// Bytes a value: 4 (f32, what the sharded MoE exchanges), 2 (bf16 rows, timed as
    /// the same bytes of f32 values), or both (`4,2`).
    #[arg(long, value_delimiter = ',', default_value = "4")]
    value_bytes: Vec<usize>,
    /// Timed repetitions of each exchange (the median is reported).
    #[arg(long, default_value_t = 100)]
    reps: usize,
    /// Untimed repetitions first (NCCL connects its peers on the first exchanges).
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Seed of the random routing.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Only the bytes each scheme moves for this many devices (no GPU needed).
    #[arg(long)]
    bytes_only: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// splitmix64: a seeded stream for the routing (the values only need to be uniform).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The GPU holding routed expert `e` of `experts` over `n` GPUs (contiguous blocks, as
/// `Backend::expert_weight` places them).
fn expert_gpu(e: usize, n: usize, experts: usize) -> usize {
    e * n / experts
}

/// Where each GPU's rows go: `to[r][s]`, the rows of GPU `r` (ascending) with at least
/// one of their `top_k` experts on GPU `s` (`s == r` included: the rows its own experts
/// read in place).
struct Routing {
    to: Vec<Vec<Vec<usize>>>,
}

impl Routing {
    fn draw(n: usize, rows: usize, experts: usize, top_k: usize, rng: &mut Rng) -> Self {
        assert!(top_k <= experts, "top-k above the expert count");
        let to = (0..n)
            .map(|_| {
                let mut to = vec![Vec::new(); n];
                for row in 0..rows {
                    let mut chosen: Vec<usize> = Vec::with_capacity(top_k);
                    while chosen.len() < top_k {
                        let e = rng.below(experts);
                        if !chosen.contains(&e) {
                            chosen.push(e);
                        }
                    }
                    let mut hit = vec![false; n];
                    chosen.iter().for_each(|&e| hit[expert_gpu(e, n, experts)] = true);
                    hit.iter().enumerate().filter(|(_, h)| **h).for_each(|(s, _)| to[s].push(row));
                }
                to
            })
            .collect();
        Routing { to }
    }

    /// Other GPUs a row reaches, on average over every GPU's rows.
    fn peers_per_row(&self, rows: usize) -> f64 {
        let n = self.to.len();
        let sent: usize = (0..n).map(|r| (0..n).filter(|&s| s != r).map(|s| self.to[r][s].len()).sum::<usize>()).sum();
        sent as f64 / (n * rows).max(1) as f64
    }
}

/// The expected number of other GPUs a row reaches: for each other GPU, one minus the
/// chance that none of the row's `top_k` distinct experts is among its block
/// (`C(E − block, k) / C(E, k)`), averaged over the row's own GPU.
fn expected_peers(n: usize, experts: usize, top_k: usize) -> f64 {
    let block = |s: usize| (0..experts).filter(|&e| expert_gpu(e, n, experts) == s).count();
    let miss =
        |b: usize| (0..top_k).map(|i| (experts - b).saturating_sub(i) as f64 / (experts - i) as f64).product::<f64>();
    let per_own: f64 = (0..n).map(|r| (0..n).filter(|&s| s != r).map(|s| 1.0 - miss(block(s))).sum::<f64>()).sum();
    per_own / n as f64
}

/// Bytes one GPU sends per MoE layer (dispatch and combine; it receives as much on
/// average): `(all-gather + reduce-scatter, all-to-all)`.
fn bytes_per_gpu(n: usize, rows: usize, row_bytes: usize, peers_per_row: f64) -> (f64, f64) {
    let gather = 2.0 * (n - 1) as f64 * rows as f64 * row_bytes as f64;
    let a2a = 2.0 * peers_per_row * rows as f64 * row_bytes as f64;
    (gather, a2a)
}

/// One row of the report: the sizes, the bytes, and (on GPUs) the times.
fn entry(n: usize, rows: usize, value_bytes: usize, a: &CollectivesArgs, routing: &Routing) -> Value {
    let row_bytes = a.hidden * value_bytes;
    let peers = routing.peers_per_row(rows);
    let (gather, a2a) = bytes_per_gpu(n, rows, row_bytes, peers);
    json!({
        "gpus": n,
        "rows_per_gpu": rows,
        "value_bytes": value_bytes,
        "row_bytes": row_bytes,
        "peers_per_row": peers,
        "gather_rs_bytes_per_gpu": gather,
        "all_to_all_bytes_per_gpu": a2a,
    })
}

pub fn run(a: CollectivesArgs) -> Result<()> {
    let devices = &a.devices.0;
    let n = devices.len();
    if n < 2 {
        bail!("--devices names {n} device; the exchanges are between at least two GPUs (e.g. cuda:0,cuda:1)");
    }
    if !a.bytes_only && !devices.iter().all(|d| d.is_cuda()) {
        bail!("--devices {}: the exchanges run on GPUs (cuda:N); --bytes-only counts bytes for any list", a.devices);
    }
    if a.rows.is_empty() || a.rows.contains(&0) || a.value_bytes.iter().any(|b| ![2, 4].contains(b)) {
        bail!("--rows needs values of at least 1, --value-bytes 4 and/or 2");
    }
    if a.hidden == 0 || a.top_k == 0 || a.experts < n || a.top_k > a.experts {
        bail!("--hidden and --top-k at least 1, --experts at least one per GPU and at least --top-k");
    }
    if !a.bytes_only && (a.reps == 0 || !a.hidden.is_multiple_of(2)) {
        bail!("--reps at least 1 and an even --hidden");
    }
    let expected = expected_peers(n, a.experts, a.top_k);
    let mut rng = Rng(a.seed ^ 0x5eed_c011_ec71_7e5a);
    let mut entries = Vec::new();
    let mut routings = Vec::new();
    for &rows in &a.rows {
        let routing = Routing::draw(n, rows, a.experts, a.top_k, &mut rng);
        for &vb in &a.value_bytes {
            entries.push(entry(n, rows, vb, &a, &routing));
        }
        routings.push(routing);
    }
    let mut gpus_line = format!("{n} devices (bytes only)");
    if !a.bytes_only {
        let ordinals: Vec<usize> = devices.iter().map(|d| if let Device::Cuda(o) = d { *o } else { 0 }).collect();
        gpus_line = time_all(&ordinals, &a, &routings, &mut entries)?;
    }
    let setting = format!(
        "hidden {}, top-{} of {} experts in contiguous blocks of {}; a row reaches {expected:.3} of {} other GPUs \
         on average (drawn: {:.3} over {} rows a GPU)",
        a.hidden,
        a.top_k,
        a.experts,
        a.experts / n,
        n - 1,
        entries.last().map(|e| e["peers_per_row"].as_f64().unwrap_or(0.0)).unwrap_or(0.0),
        a.rows.last().copied().unwrap_or(0),
    );
    if a.json {
        let report = json!({
            "bench": "collectives",
            "devices": a.devices.to_string(),
            "gpus": gpus_line,
            "hidden": a.hidden,
            "experts": a.experts,
            "top_k": a.top_k,
            "expected_peers_per_row": expected,
            "reps": a.reps,
            "warmup": a.warmup,
            "results": entries,
        });
        println!("{report}");
        return Ok(());
    }
    println!("{gpus_line}");
    println!("{setting}");
    print_table(&entries, &a);
    Ok(())
}

/// The report as a table: bytes, and the times when there are any.
fn print_table(entries: &[Value], a: &CollectivesArgs) {
    let timed = !a.bytes_only;
    let mut head =
        format!("{:>9} {:>6} {:>8} {:>12} {:>11} {:>6}", "rows/GPU", "value", "peers", "AG+RS MB", "A2A MB", "A2A/AG");
    if timed {
        head += &format!(" {:>10} {:>9} {:>12}  faster", "AG+RS ms", "A2A ms", "A2A+pack ms");
        println!(
            "MB sent per GPU per MoE layer (dispatch + combine); ms: device time, slowest GPU, median of {} after {} \
             warm-up",
            a.reps, a.warmup
        );
    } else {
        println!("MB sent per GPU per MoE layer (dispatch + combine; as much is received)");
    }
    println!("{head}");
    for e in entries {
        let f = |k: &str| e[k].as_f64().unwrap_or(f64::NAN);
        let mut line = format!(
            "{:>9} {:>6} {:>8.3} {:>12.3} {:>11.3} {:>6.3}",
            f("rows_per_gpu"),
            if f("value_bytes") == 4.0 { "f32" } else { "bf16" },
            f("peers_per_row"),
            f("gather_rs_bytes_per_gpu") / 1e6,
            f("all_to_all_bytes_per_gpu") / 1e6,
            f("all_to_all_bytes_per_gpu") / f("gather_rs_bytes_per_gpu"),
        );
        if timed {
            let (ag, a2a) = (f("gather_rs_ms"), f("all_to_all_ms"));
            let faster =
                if a2a < ag { format!("all-to-all ×{:.2}", ag / a2a) } else { format!("gather/RS ×{:.2}", a2a / ag) };
            line += &format!(" {ag:>10.3} {a2a:>9.3} {:>12.3}  {faster}", f("all_to_all_with_pack_ms"));
        }
        println!("{line}");
    }
}

#[cfg(not(feature = "cuda"))]
fn time_all(_: &[usize], _: &CollectivesArgs, _: &[Routing], _: &mut [Value]) -> Result<String> {
    bail!("this sluice was built without CUDA support (feature `cuda`); --bytes-only counts bytes without GPUs")
}

/// Time both schemes for every entry; returns the line naming the GPUs.
#[cfg(feature = "cuda")]
fn time_all(ordinals: &[usize], a: &CollectivesArgs, routings: &[Routing], entries: &mut [Value]) -> Result<String> {
    use anyhow::Context;
    use kernels::Backend;

    let gpus = engine::CudaBackend::device_count();
    if let Some(o) = ordinals.iter().find(|&&o| o >= gpus) {
        let why = if kernels::cuda::driver_present() { "" } else { " (no CUDA driver)" };
        bail!(
            "cuda:{o} is not there: this machine has {gpus} CUDA device(s){why}; the exchanges need two GPUs \
             (--bytes-only prints the byte counts without them)"
        );
    }
    let ranks = ordinals.iter().map(|&o| engine::device::cuda_backend(o)).collect::<Result<Vec<_>, _>>()?;
    let nccl = kernels::cuda::collective::Nccl::new(&ranks).context(
        "NCCL did not load (a machine with only libnccl.so.2 needs the link libnccl.so -> libnccl.so.2 on \
         LD_LIBRARY_PATH)",
    )?;
    let line = format!("NCCL between {}", ranks.iter().map(|b| b.describe()).collect::<Vec<_>>().join(" and "));
    eprintln!("{line}");
    let mut at = 0;
    for (routing, &rows) in routings.iter().zip(&a.rows) {
        for &vb in &a.value_bytes {
            // A row as f32 values of the same bytes.
            let width = a.hidden * vb / 4;
            let t = timed::Exchange::new(&ranks, &nccl, routing, rows, width).measure(a.reps, a.warmup);
            let e = entries[at].as_object_mut().expect("an object");
            e.insert("gather_rs_ms".into(), json!(t.gather_rs.median));
            e.insert("gather_rs_p10_p90_ms".into(), json!([t.gather_rs.p10, t.gather_rs.p90]));
            e.insert("all_to_all_ms".into(), json!(t.all_to_all.median));
            e.insert("all_to_all_p10_p90_ms".into(), json!([t.all_to_all.p10, t.all_to_all.p90]));
            e.insert("all_to_all_with_pack_ms".into(), json!(t.with_pack.median));
            eprintln!(
                "  {rows} rows/GPU, {vb}-byte values: gather/RS {:.3} ms, all-to-all {:.3} ms ({:.3} with packing)",
                t.gather_rs.median, t.all_to_all.median, t.with_pack.median
            );
            at += 1;
        }
    }
    Ok(line)
}

/// The exchanges on the GPUs.
#[cfg(feature = "cuda")]
mod timed {
    use kernels::Backend;
    use kernels::cuda::collective::{Nccl, all_to_all_offsets, time_ms};
    use kernels::cuda::{CudaBackend, CudaBuf};
    use kernels::sharded::Collective;

    use super::Routing;

    pub struct Stats {
        pub median: f64,
        pub p10: f64,
        pub p90: f64,
    }

    pub struct Times {
        pub gather_rs: Stats,
        pub all_to_all: Stats,
        pub with_pack: Stats,
    }

    /// One size's buffers. The values are zeros: what is timed does not depend on them.
    pub struct Exchange<'a> {
        ranks: &'a [CudaBackend],
        nccl: &'a Nccl,
        width: usize,
        /// Each GPU's rows, and its partial sums of every row (all-gather scheme).
        own: Vec<CudaBuf>,
        partials: Vec<CudaBuf>,
        rows: usize,
        /// Dispatch counts (values) `[from][to]`, none to itself; combine: transposed.
        dispatch: Vec<Vec<usize>>,
        combine: Vec<Vec<usize>>,
        /// Each GPU's rows for the others, by destination (what packing makes).
        packed: Vec<CudaBuf>,
        /// Rows received from the others, and their outputs come back; one spare zero
        /// row past the blocks, which unpacking reads for rows a peer did not get.
        recv: Vec<CudaBuf>,
        back: Vec<CudaBuf>,
        /// Per GPU: the row ids it sends, in dispatch order (packing's gather).
        pack_rows: Vec<Vec<usize>>,
        /// Per GPU and peer: for each own row, where its output from that peer lies in
        /// `back` (the spare zero row when the peer did not get it).
        unpack_rows: Vec<Vec<Vec<usize>>>,
    }

    fn stats(mut v: Vec<f64>) -> Stats {
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        Stats { median: at(0.5), p10: at(0.1), p90: at(0.9) }
    }

    impl<'a> Exchange<'a> {
        pub fn new(ranks: &'a [CudaBackend], nccl: &'a Nccl, routing: &Routing, rows: usize, width: usize) -> Self {
            let n = ranks.len();
            let dispatch: Vec<Vec<usize>> = (0..n)
                .map(|r| (0..n).map(|s| if s == r { 0 } else { routing.to[r][s].len() * width }).collect())
                .collect();
            let combine: Vec<Vec<usize>> = (0..n).map(|r| (0..n).map(|s| dispatch[s][r]).collect()).collect();
            let sent = |r: usize| dispatch[r].iter().sum::<usize>();
            let got = |s: usize| dispatch.iter().map(|c| c[s]).sum::<usize>();
            let pack_rows = (0..n)
                .map(|r| (0..n).filter(|&s| s != r).flat_map(|s| routing.to[r][s].iter().copied()).collect())
                .collect();
            let (_, back_at) = all_to_all_offsets(&combine);
            let unpack_rows = (0..n)
                .map(|r| {
                    let spare = sent(r) / width;
                    // Peers that got none of this GPU's rows send nothing back.
                    (0..n)
                        .filter(|&s| s != r && !routing.to[r][s].is_empty())
                        .map(|s| {
                            let mut at = vec![spare; rows];
                            let first = back_at[r][s] / width;
                            routing.to[r][s].iter().enumerate().for_each(|(i, &row)| at[row] = first + i);
                            at
                        })
                        .collect()
                })
                .collect();
            Exchange {
                ranks,
                nccl,
                width,
                own: ranks.iter().map(|b| b.zeros(rows * width)).collect(),
                partials: ranks.iter().map(|b| b.zeros(n * rows * width)).collect(),
                rows,
                packed: (0..n).map(|r| ranks[r].zeros(sent(r))).collect(),
                recv: (0..n).map(|s| ranks[s].zeros(got(s) + width)).collect(),
                back: (0..n).map(|r| ranks[r].zeros(sent(r) + width)).collect(),
                dispatch,
                combine,
                pack_rows,
                unpack_rows,
            }
        }

        /// Today's exchange, as `kernels::sharded::moe` issues it.
        fn gather_rs(&self) {
            let counts = vec![self.rows * self.width; self.ranks.len()];
            let parts: Vec<&CudaBuf> = self.own.iter().collect();
            let gathered = self.nccl.all_gather(self.ranks, &parts, &counts);
            let sums = self.nccl.reduce_scatter(self.ranks, &self.partials, &counts);
            drop((gathered, sums));
        }

        /// Dispatch then combine, from buffers already packed.
        fn all_to_all(&mut self) {
            let packed: Vec<&CudaBuf> = self.packed.iter().collect();
            self.nccl.all_to_all_into(self.ranks, &packed, &self.dispatch, &mut self.recv);
            // The experts' outputs have the received rows' shape: sent back from there.
            let outputs: Vec<&CudaBuf> = self.recv.iter().collect();
            self.nccl.all_to_all_into(self.ranks, &outputs, &self.combine, &mut self.back);
        }

        /// Pack each GPU's rows for the others, exchange, and add what comes back into
        /// the owners' rows.
        fn with_pack(&mut self) {
            let n = self.ranks.len();
            let packed: Vec<CudaBuf> =
                (0..n).map(|r| self.ranks[r].gather_rows(&self.own[r], self.width, &self.pack_rows[r])).collect();
            let refs: Vec<&CudaBuf> = packed.iter().collect();
            self.nccl.all_to_all_into(self.ranks, &refs, &self.dispatch, &mut self.recv);
            let outputs: Vec<&CudaBuf> = self.recv.iter().collect();
            self.nccl.all_to_all_into(self.ranks, &outputs, &self.combine, &mut self.back);
            for r in 0..n {
                let b = &self.ranks[r];
                let mut sum = b.zeros(self.rows * self.width);
                for at in &self.unpack_rows[r] {
                    b.add_into(&mut sum, &b.gather_rows(&self.back[r], self.width, at));
                }
            }
        }

        fn time(&mut self, reps: usize, warmup: usize, f: fn(&mut Self)) -> Stats {
            let ranks = self.ranks;
            for _ in 0..warmup {
                time_ms(ranks, || f(self));
            }
            let v = (0..reps).map(|_| time_ms(ranks, || f(self)) as f64).collect();
            stats(v)
        }

        pub fn measure(mut self, reps: usize, warmup: usize) -> Times {
            Times {
                gather_rs: self.time(reps, warmup, |e| e.gather_rs()),
                all_to_all: self.time(reps, warmup, Self::all_to_all),
                with_pack: self.time(reps, warmup, Self::with_pack),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experts_split_in_contiguous_blocks() {
        assert_eq!((expert_gpu(0, 2, 256), expert_gpu(127, 2, 256), expert_gpu(128, 2, 256)), (0, 0, 1));
        assert_eq!((expert_gpu(31, 8, 256), expert_gpu(32, 8, 256), expert_gpu(255, 8, 256)), (0, 1, 7));
    }

    #[test]
    fn a_row_reaches_nearly_every_gpu_of_two_and_about_four_of_eight() {
        // 1 − C(128,6)/C(256,6) and 7 · (1 − C(224,6)/C(256,6)).
        let two = expected_peers(2, 256, 6);
        let four = expected_peers(4, 256, 6);
        let eight = expected_peers(8, 256, 6);
        assert!((two - 0.9855).abs() < 1e-3, "{two}");
        assert!((four - 2.478).abs() < 1e-2, "{four}");
        assert!((eight - 3.885).abs() < 1e-2, "{eight}");
        // Drawn routing agrees with the expectation.
        let mut rng = Rng(7);
        for (n, want) in [(2, two), (4, four), (8, eight)] {
            let r = Routing::draw(n, 4096, 256, 6, &mut rng);
            let got = r.peers_per_row(4096);
            assert!((got - want).abs() < 0.03 * want, "{n} GPUs: drawn {got}, expected {want}");
            // A row's own GPU is listed when one of its experts is local; every row reaches some GPU.
            for own in &r.to {
                let reached: usize = own.iter().map(Vec::len).sum();
                assert!(reached >= 4096);
            }
        }
    }

    #[test]
    fn all_to_all_bytes_are_the_gather_bytes_scaled_by_the_peers_reached() {
        let row = 4096 * 4;
        let (g, a) = bytes_per_gpu(2, 128, row, 1.0);
        assert_eq!(g, a, "two GPUs, every row reaching the other: the same bytes");
        let (g, a) = bytes_per_gpu(8, 128, row, 3.885);
        assert_eq!(g, 2.0 * 7.0 * 128.0 * row as f64);
        assert!((a / g - 3.885 / 7.0).abs() < 1e-12);
    }
}
