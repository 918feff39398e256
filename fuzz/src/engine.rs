//! The bounded run in `cargo test`: each target gets a fixed time (`SLUICE_FUZZ_SECONDS`,
//! default 2) of inputs made by mutating its corpus with a seeded generator
//! (`SLUICE_FUZZ_SEED`), so a run is repeatable and its length does not depend on the
//! machine. It is not coverage-guided (libFuzzer is, `scripts/fuzz.sh`); starting from
//! the real encoders' output is what gets it past magic numbers, checksums and protobuf
//! or JSON framing in a few seconds, which random bytes never do.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::Body;

/// Largest input a mutation makes.
const MAX_LEN: usize = 1 << 16;

/// Integers that sit on the edges parsers get wrong (as little-endian bytes).
const EDGES: [u64; 12] =
    [0, 1, 0x7f, 0x80, 0xff, 0xffff, 0x7fff_ffff, 0xffff_ffff, 1 << 32, i64::MAX as u64, 1 << 63, u64::MAX];

#[derive(Clone, Copy, Debug)]
pub struct Report {
    pub executions: u64,
    pub elapsed: Duration,
}

/// Seconds per target and the generator's seed, from the environment.
pub fn settings() -> (Duration, u64) {
    let secs = std::env::var("SLUICE_FUZZ_SECONDS").ok().and_then(|s| s.parse::<f64>().ok()).unwrap_or(2.0);
    let seed = std::env::var("SLUICE_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed);
    (Duration::from_secs_f64(secs.max(0.0)), seed)
}

/// One to four mutations of `input`, some borrowing from another corpus entry.
pub fn mutate(rng: &mut ChaCha8Rng, input: &mut Vec<u8>, pool: &[Vec<u8>]) {
    for _ in 0..rng.random_range(1..=4) {
        let len = input.len();
        match rng.random_range(0..9) {
            0 if len > 0 => {
                let i = rng.random_range(0..len);
                input[i] ^= 1 << rng.random_range(0..8);
            }
            1 if len > 0 => {
                let i = rng.random_range(0..len);
                input[i] = rng.random();
            }
            2 if len > 0 => {
                let width = [1usize, 2, 4, 8][rng.random_range(0..4)].min(len);
                let at = rng.random_range(0..=len - width);
                let v = EDGES[rng.random_range(0..EDGES.len())].wrapping_add(rng.random_range(0..3)).wrapping_sub(1);
                input[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
            }
            3 if len < MAX_LEN => {
                let at = rng.random_range(0..=len);
                let n = rng.random_range(1..=16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                input.splice(at..at, bytes);
            }
            4 if len > 0 => {
                let at = rng.random_range(0..len);
                let n = rng.random_range(1..=(len - at).min(64));
                input.drain(at..at + n);
            }
            5 if len > 0 && len < MAX_LEN => {
                let at = rng.random_range(0..len);
                let n = rng.random_range(1..=(len - at).min(64));
                let copy = input[at..at + n].to_vec();
                let to = rng.random_range(0..=len);
                input.splice(to..to, copy);
            }
            6 if !pool.is_empty() => {
                let other = &pool[rng.random_range(0..pool.len())];
                let cut = rng.random_range(0..=len);
                let from = rng.random_range(0..=other.len());
                input.truncate(cut);
                input.extend_from_slice(&other[from..]);
            }
            7 if len > 0 => input.truncate(rng.random_range(0..len)),
            _ => {
                let at = rng.random_range(0..=len);
                input.insert(at, rng.random());
            }
        }
        input.truncate(MAX_LEN);
    }
}

/// Run `body` on mutations of `seeds` for `budget`. A failing input is written to the
/// system temp directory and the panic names it (add it to `regressions/<name>/`).
pub fn run(name: &str, body: Body, seeds: &[Vec<u8>], budget: Duration, seed: u64) -> Report {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let started = Instant::now();
    let mut executions = 0u64;
    let pool: Vec<Vec<u8>> = if seeds.is_empty() { vec![Vec::new()] } else { seeds.to_vec() };
    while executions == 0 || started.elapsed() < budget {
        let mut input = pool[rng.random_range(0..pool.len())].clone();
        mutate(&mut rng, &mut input, &pool);
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| body(&input))) {
            let path = save(name, &input);
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(non-string panic)");
            panic!(
                "fuzz target {name} failed after {executions} executions (seed {seed}): {why}\ninput saved to {}",
                path.display()
            );
        }
        executions += 1;
    }
    Report { executions, elapsed: started.elapsed() }
}

fn save(name: &str, input: &[u8]) -> PathBuf {
    let hash = input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    let path = std::env::temp_dir().join(format!("sluice-fuzz-{name}-{hash:016x}"));
    if let Err(e) = std::fs::write(&path, input) {
        eprintln!("cannot save the failing input to {}: {e}", path.display());
    }
    path
}
