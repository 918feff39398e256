//! Token selection: greedy by default; with a temperature, seeded sampling restricted
//! by top-k and top-p. Logprobs are always those of the model's own distribution
//! (log-softmax of the raw logits), whatever the sampling transform, so clients can
//! compare them across sampling settings.

use kernels::backend::log_normaliser;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thiserror::Error;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Nucleus: keep the most likely tokens whose probabilities sum to at least this.
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: no limit).
    pub top_k: usize,
    /// Seed of the sampling RNG; the same seed and logits give the same tokens.
    pub seed: u64,
    /// How many alternatives (with logprobs) to report per token.
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0, top_logprobs: 0 }
    }
}

#[derive(Debug, Error, PartialEq)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("top_logprobs must be at most {max}, got {got}")]
    TopLogprobs { got: usize, max: usize },
}

/// Most alternatives a caller may ask for per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if self.top_p.is_nan() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(SamplingError::TopP(self.top_p));
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(SamplingError::TopLogprobs { got: self.top_logprobs, max: MAX_TOP_LOGPROBS });
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// One chosen token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens with their logprobs, best first.
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

/// `log_softmax` in f64 for a stable normaliser.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let (m, z) = log_normaliser(logits);
    logits.iter().map(|&l| (l as f64 - m - z) as f32).collect()
}

/// Index of the largest value (the first one on ties): the greedy token. The same
/// function picks greedy read-outs on backends that pick on the host.
pub use kernels::backend::argmax;

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Sampler { params, rng }
    }

    /// A sampler positioned after `steps` tokens were already sampled with `params`, as
    /// a request that continues on another worker needs (migration): every sampled token
    /// takes exactly one draw from the RNG (none when greedy), so skipping `steps` draws
    /// puts it where the first sampler was, and the rest of the sequence is the
    /// uninterrupted one. Seeds keep their existing token sequences.
    pub fn resumed(params: SamplingParams, steps: usize) -> Self {
        let mut s = Sampler::new(params);
        if !s.params.is_greedy() {
            for _ in 0..steps {
                s.next_uniform();
            }
        }
        s
    }

    /// The one draw a sampled token takes.
    fn next_uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// Whether this sampler needs a step's logits: it draws (a temperature) or reports
    /// top logprobs. A greedy sampler without them takes the step's greedy read-out
    /// ([`Sampler::greedy`]), which a GPU engine picks on the device.
    pub fn needs_logits(&self) -> bool {
        !self.params.is_greedy() || self.params.top_logprobs > 0
    }

    /// The token of a step's greedy read-out (`engine::Readout`): for a sampler that does
    /// not need logits, what [`Sampler::sample`] returns on the logits themselves.
    pub fn greedy(&self, token: u32, logprob: f32) -> Sampled {
        debug_assert!(!self.needs_logits(), "a sampler that draws or reports top logprobs needs the logits");
        Sampled { token, logprob, top: Vec::new() }
    }

    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        let token = if self.params.is_greedy() { argmax(logits) } else { self.draw(logits) };
        self.report(logits, token)
    }

    /// Sample among the tokens `allowed` accepts (constrained decoding; at least one must
    /// be allowed). Logprobs stay those of the unconstrained distribution.
    pub fn sample_allowed(&mut self, logits: &[f32], allowed: impl Fn(u32) -> bool) -> Sampled {
        let masked: Vec<f32> =
            logits.iter().enumerate().map(|(i, &l)| if allowed(i as u32) { l } else { f32::NEG_INFINITY }).collect();
        let token = if self.params.is_greedy() { argmax(&masked) } else { self.draw(&masked) };
        self.report(logits, token)
    }

    fn report(&self, logits: &[f32], token: u32) -> Sampled {
        let lp = log_softmax(logits);
        let top = if self.params.top_logprobs > 0 {
            let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
            let k = self.params.top_logprobs.min(idx.len());
            idx.select_nth_unstable_by(k - 1, |&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
            idx.truncate(k);
            idx.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
            idx.into_iter().map(|t| (t, lp[t as usize])).collect()
        } else {
            Vec::new()
        };
        Sampled { token, logprob: lp[token as usize], top }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let t = self.params.temperature as f64;
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        // Masked-out tokens (constrained decoding) are never candidates.
        if let Some(end) = order.iter().position(|&i| logits[i as usize] == f32::NEG_INFINITY) {
            order.truncate(end.max(1));
        }
        if self.params.top_k > 0 {
            order.truncate(self.params.top_k);
        }
        let m = logits[order[0] as usize] as f64;
        let mut probs: Vec<f64> = order.iter().map(|&i| ((logits[i as usize] as f64 - m) / t).exp()).collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= z);
        // Smallest prefix whose mass reaches top_p (always at least one token).
        let mut keep = probs.len();
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut u = self.next_uniform() * mass;
        for (i, p) in probs[..keep].iter().enumerate() {
            if u < *p {
                return order[i];
            }
            u -= p;
        }
        order[keep - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_argmax_with_its_logprob() {
        let mut s = Sampler::new(SamplingParams { top_logprobs: 2, ..Default::default() });
        let out = s.sample(&[0.0, 2.0, 1.0]);
        assert_eq!(out.token, 1);
        let z = (0f64.exp() + 2f64.exp() + 1f64.exp()).ln();
        assert!((out.logprob as f64 - (2.0 - z)).abs() < 1e-6);
        assert_eq!(out.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams { temperature: 1.0, top_k: 3, seed: 42, ..Default::default() };
        let run = || {
            let mut s = Sampler::new(params.clone());
            (0..200).map(|_| s.sample(&logits).token).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        let mut top3: Vec<u32> = (0..50).collect();
        top3.sort_by(|&x, &y| logits[y as usize].total_cmp(&logits[x as usize]));
        assert!(a.iter().all(|t| top3[..3].contains(t)));
        assert!(top3[..3].iter().all(|t| a.contains(t)), "all three candidates get drawn in 200 tries");
    }

    #[test]
    fn masked_sampling_only_picks_allowed_tokens_and_keeps_model_logprobs() {
        let logits: Vec<f32> = (0..40).map(|i| (i as f32 * 0.61).cos()).collect();
        let allowed = |t: u32| t % 5 == 3;
        for params in
            [SamplingParams::default(), SamplingParams { temperature: 1.3, top_k: 4, seed: 9, ..Default::default() }]
        {
            let mut s = Sampler::new(params);
            for _ in 0..50 {
                let out = s.sample_allowed(&logits, allowed);
                assert!(allowed(out.token), "{}", out.token);
                assert_eq!(out.logprob, log_softmax(&logits)[out.token as usize]);
            }
        }
    }

    /// Logits that change from step to step, as a model's would.
    fn step_logits(step: usize) -> Vec<f32> {
        (0..64).map(|i| ((i * 31 + step * 17) as f32 * 0.13).sin() * 2.0).collect()
    }

    #[test]
    fn a_resumed_sampler_continues_the_uninterrupted_sequence() {
        let mask = |t: u32| t % 3 != 1;
        for params in [
            SamplingParams { temperature: 0.9, top_p: 0.9, top_k: 20, seed: 7, ..Default::default() },
            SamplingParams { temperature: 1.5, seed: u64::MAX, ..Default::default() },
            SamplingParams::default(),
        ] {
            // Constrained and free steps interleaved: each takes one draw either way.
            let pick = |s: &mut Sampler, step: usize| {
                if step.is_multiple_of(4) {
                    s.sample_allowed(&step_logits(step), mask)
                } else {
                    s.sample(&step_logits(step))
                }
            };
            let mut whole = Sampler::new(params.clone());
            let uninterrupted: Vec<Sampled> = (0..120).map(|step| pick(&mut whole, step)).collect();
            for k in [0, 1, 2, 37, 119] {
                let mut resumed = Sampler::resumed(params.clone(), k);
                let rest: Vec<Sampled> = (k..120).map(|step| pick(&mut resumed, step)).collect();
                assert_eq!(rest, uninterrupted[k..], "{params:?} resumed at step {k}");
            }
            if !params.is_greedy() {
                // A resume that skipped nothing would differ: the check above has teeth.
                let mut unskipped = Sampler::new(params.clone());
                let rest: Vec<u32> = (37..120).map(|step| pick(&mut unskipped, step).token).collect();
                let want: Vec<u32> = uninterrupted[37..].iter().map(|s| s.token).collect();
                assert_ne!(rest, want, "{params:?}");
            }
        }
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let mut s = Sampler::new(SamplingParams { temperature: 5.0, top_p: 1e-6, seed: 1, ..Default::default() });
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.1, 0.3, 0.2]).token, 1);
        }
    }

    #[test]
    fn invalid_params_are_rejected() {
        let p = |f: fn(&mut SamplingParams)| {
            let mut x = SamplingParams::default();
            f(&mut x);
            x.validate()
        };
        assert_eq!(p(|x| x.temperature = -1.0), Err(SamplingError::Temperature(-1.0)));
        assert_eq!(p(|x| x.top_p = 0.0), Err(SamplingError::TopP(0.0)));
        assert!(p(|x| x.top_logprobs = 99).is_err());
        assert!(p(|_| {}).is_ok());
    }
}
