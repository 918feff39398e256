//! Host time of one sampled token over a V4-sized vocabulary (129,280 logits), per
//! sampling setting: `cargo run --release -p engine --example sampler_speed` (`FLAT=1`:
//! logits spread evenly over 20 units, where many tokens lie near the best, the draw's
//! worst case short of a full sort). The decode worker samples requests that draw on all
//! cores (docs/engine.md "Sampling").

use std::time::Instant;

use engine::sampling::{Sampler, SamplingParams};

fn main() {
    let vocab = 129_280;
    let mut x = 12_345u64;
    let mut next = || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 40) as f32 / (1u64 << 24) as f32
    };
    let flat = std::env::var_os("FLAT").is_some();
    // A model's logits: roughly Gaussian (a sum of four uniforms, std ~2.5) with a few
    // tokens 12-20 above the bulk.
    let logits: Vec<f32> = (0..vocab)
        .map(|i| match (flat, i % 9973 == 0) {
            (true, _) => next() * 20.0 - 10.0,
            (false, true) => 12.0 + next() * 8.0,
            (false, false) => (next() + next() + next() + next() - 2.0) * 4.33,
        })
        .collect();
    let settings = [
        ("greedy, 5 top logprobs", SamplingParams { top_logprobs: 5, ..Default::default() }),
        ("temperature 0.7", SamplingParams { temperature: 0.7, seed: 1, ..Default::default() }),
        ("temperature 0.7, top-p 0.9", SamplingParams { temperature: 0.7, top_p: 0.9, seed: 1, ..Default::default() }),
        ("temperature 1, top-k 50", SamplingParams { temperature: 1.0, top_k: 50, seed: 1, ..Default::default() }),
    ];
    println!("{vocab} logits ({}):", if flat { "flat" } else { "model-like" });
    for (name, params) in settings {
        let mut s = Sampler::new(params);
        let n = 100;
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(s.sample(std::hint::black_box(&logits)));
        }
        println!("  {name:<28} {:.3} ms a token", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    }
}
