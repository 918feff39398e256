//! The requests of a serving benchmark and when they arrive, all from a seed (token ids,
//! no tokenizer), in the shapes the published serving benchmarks use:
//! - `random`: vLLM's `random` dataset — input and output lengths uniform over
//!   `[⌊len·(1−r)⌋, ⌈len·(1+r)⌉]` (output at least 1), uniformly random token ids;
//! - `shared-prefix`: SGLang's `generated-shared-prefix` — G groups of P prompts, every
//!   prompt of a group its group's S-token system prefix followed by its own Q-token
//!   question, all asking for O tokens, shuffled.
//!
//! Arrivals are a Poisson process (exponential gaps of mean 1/rate, as both tools draw
//! them with burstiness 1) or, at rate `inf`, all at once. Pure: tested here.

use std::fmt;

/// splitmix64: small, seedable, and the same stream on every machine (the workload of a
/// seed must not change with a dependency's version).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0), by a 128-bit multiply (no modulo bias worth the name).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    pub fn inclusive(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below((hi - lo + 1) as u64) as usize
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// An exponential gap of mean `1 / rate`.
    pub fn exponential(&mut self, rate: f64) -> f64 {
        -(1.0 - self.unit()).ln() / rate
    }

    pub fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab as u64) as u32).collect()
    }

    /// Fisher–Yates.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// Which requests a run sends.
#[derive(Clone, Debug, PartialEq)]
pub enum Shape {
    Random { num_prompts: usize, input_len: usize, output_len: usize, range_ratio: f64 },
    SharedPrefix { groups: usize, prompts_per_group: usize, system_len: usize, question_len: usize, output_len: usize },
}

/// One request to send.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// Tokens asked for (and, with no stop tokens, generated).
    pub output_len: u32,
    /// The shared-prefix group (shared-prefix workload only).
    pub group: Option<u32>,
}

/// vLLM's bounds: `⌊len·(1−r)⌋ ..= ⌈len·(1+r)⌉`, never below 1.
pub fn length_range(len: usize, ratio: f64) -> (usize, usize) {
    let lo = (len as f64 * (1.0 - ratio)).floor() as usize;
    let hi = (len as f64 * (1.0 + ratio)).ceil() as usize;
    (lo.max(1), hi.max(1))
}

impl Shape {
    pub fn name(&self) -> &'static str {
        match self {
            Shape::Random { .. } => "random",
            Shape::SharedPrefix { .. } => "shared-prefix",
        }
    }

    /// Say what to change when the shape cannot be generated.
    pub fn validate(&self) -> Result<(), String> {
        match *self {
            Shape::Random { num_prompts, input_len, output_len, range_ratio } => {
                if num_prompts == 0 || input_len == 0 || output_len == 0 {
                    return Err("--num-prompts, --input-len and --output-len must be at least 1".into());
                }
                if !(0.0..1.0).contains(&range_ratio) {
                    return Err(format!("--range-ratio must be in [0, 1) (as vLLM's), got {range_ratio}"));
                }
            }
            Shape::SharedPrefix { groups, prompts_per_group, system_len, question_len, output_len } => {
                if groups == 0 || prompts_per_group == 0 || output_len == 0 || system_len + question_len == 0 {
                    return Err(
                        "--groups, --prompts-per-group, --output-len and the prompt length must be at least 1".into()
                    );
                }
            }
        }
        Ok(())
    }

    /// The requests of `seed` over a vocabulary of `vocab` token ids.
    pub fn generate(&self, seed: u64, vocab: usize) -> Vec<Request> {
        let mut rng = Rng::new(seed);
        match *self {
            Shape::Random { num_prompts, input_len, output_len, range_ratio } => {
                let (ilo, ihi) = length_range(input_len, range_ratio);
                let (olo, ohi) = length_range(output_len, range_ratio);
                // Lengths first, then tokens (as vLLM draws them): a prompt's length does
                // not depend on the vocabulary.
                let lens: Vec<(usize, usize)> =
                    (0..num_prompts).map(|_| (rng.inclusive(ilo, ihi), rng.inclusive(olo, ohi))).collect();
                lens.into_iter()
                    .map(|(i, o)| Request { prompt: rng.tokens(i, vocab), output_len: o as u32, group: None })
                    .collect()
            }
            Shape::SharedPrefix { groups, prompts_per_group, system_len, question_len, output_len } => {
                let systems: Vec<Vec<u32>> = (0..groups).map(|_| rng.tokens(system_len, vocab)).collect();
                let mut out = Vec::with_capacity(groups * prompts_per_group);
                for (g, system) in systems.iter().enumerate() {
                    for _ in 0..prompts_per_group {
                        let mut prompt = system.clone();
                        prompt.extend(rng.tokens(question_len, vocab));
                        out.push(Request { prompt, output_len: output_len as u32, group: Some(g as u32) });
                    }
                }
                // SGLang shuffles, so a group's prompts are spread over the run.
                rng.shuffle(&mut out);
                out
            }
        }
    }
}

/// Requests per second, or all at once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rate {
    PerSecond(f64),
    Inf,
}

impl std::str::FromStr for Rate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("inf") {
            return Ok(Rate::Inf);
        }
        match s.parse::<f64>() {
            Ok(r) if r.is_finite() && r > 0.0 => Ok(Rate::PerSecond(r)),
            Ok(r) if r.is_infinite() && r > 0.0 => Ok(Rate::Inf),
            _ => Err(format!("`{s}` is not a request rate: a number of requests per second > 0, or inf")),
        }
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rate::PerSecond(r) => write!(f, "{r}"),
            Rate::Inf => f.write_str("inf"),
        }
    }
}

impl Rate {
    /// For JSON: requests per second, `null` for inf (JSON has no infinity).
    pub fn json(&self) -> serde_json::Value {
        match self {
            Rate::PerSecond(r) => serde_json::json!(r),
            Rate::Inf => serde_json::Value::Null,
        }
    }
}

/// Send times of `n` requests in seconds from the start: the first at 0, then
/// exponential gaps (Poisson arrivals); all at 0 for `inf`.
pub fn arrivals(n: usize, rate: Rate, rng: &mut Rng) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if let (Rate::PerSecond(r), true) = (rate, i > 0) {
                t += rng.exponential(r);
            }
            t
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_lengths_stay_in_vllms_bounds_and_the_seed_fixes_everything() {
        let shape = Shape::Random { num_prompts: 500, input_len: 100, output_len: 10, range_ratio: 0.5 };
        let a = shape.generate(7, 1000);
        assert_eq!(a, shape.generate(7, 1000));
        assert_ne!(a, shape.generate(8, 1000));
        assert_eq!(a.len(), 500);
        let ins: Vec<usize> = a.iter().map(|r| r.prompt.len()).collect();
        let outs: Vec<u32> = a.iter().map(|r| r.output_len).collect();
        assert_eq!((*ins.iter().min().unwrap(), *ins.iter().max().unwrap()), (50, 150));
        assert_eq!((*outs.iter().min().unwrap(), *outs.iter().max().unwrap()), (5, 15));
        assert!(a.iter().flat_map(|r| &r.prompt).all(|&t| t < 1000));
        let fixed = Shape::Random { num_prompts: 3, input_len: 64, output_len: 8, range_ratio: 0.0 };
        assert!(fixed.generate(1, 50).iter().all(|r| r.prompt.len() == 64 && r.output_len == 8));
        assert_eq!(length_range(1, 0.9), (1, 2));
        assert!(Shape::Random { num_prompts: 1, input_len: 1, output_len: 1, range_ratio: 1.0 }.validate().is_err());
    }

    #[test]
    fn shared_prefix_groups_share_exactly_their_system_prompt() {
        let shape =
            Shape::SharedPrefix { groups: 3, prompts_per_group: 4, system_len: 40, question_len: 5, output_len: 6 };
        let reqs = shape.generate(1, 5000);
        assert_eq!(reqs.len(), 12);
        for g in 0..3 {
            let members: Vec<&Request> = reqs.iter().filter(|r| r.group == Some(g)).collect();
            assert_eq!(members.len(), 4);
            assert!(members.iter().all(|r| r.prompt.len() == 45 && r.output_len == 6));
            assert!(members.iter().all(|r| r.prompt[..40] == members[0].prompt[..40]));
            assert_ne!(members[0].prompt[40..], members[1].prompt[40..], "questions differ");
        }
        let firsts: Vec<&[u32]> =
            (0..3).map(|g| &reqs.iter().find(|r| r.group == Some(g)).unwrap().prompt[..40]).collect();
        assert!(firsts[0] != firsts[1] && firsts[1] != firsts[2]);
        let order: Vec<u32> = reqs.iter().map(|r| r.group.unwrap()).collect();
        assert_ne!(order, vec![0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], "shuffled");
    }

    #[test]
    fn poisson_arrivals_have_the_asked_mean_rate() {
        let mut rng = Rng::new(3);
        let t = arrivals(20_000, Rate::PerSecond(4.0), &mut rng);
        assert_eq!(t[0], 0.0);
        assert!(t.windows(2).all(|w| w[1] >= w[0]));
        let rate = (t.len() - 1) as f64 / t[t.len() - 1];
        assert!((rate - 4.0).abs() < 0.15, "{rate}");
        assert!(arrivals(5, Rate::Inf, &mut rng).iter().all(|&x| x == 0.0));
        assert_eq!("inf".parse::<Rate>().unwrap(), Rate::Inf);
        assert_eq!("2.5".parse::<Rate>().unwrap(), Rate::PerSecond(2.5));
        assert!("0".parse::<Rate>().unwrap_err().contains("not a request rate"));
    }
}
