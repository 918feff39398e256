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

    /// The token's logprob and the `top_logprobs` best, from one log-normaliser pass (not
    /// a log-softmax of every token written out and ranked).
    /// The best are chosen by logit (best first, lower index first on ties) and ordered by
    /// logprob: the same tokens as ranking the logprobs themselves, except where two
    /// logits round to one f32 logprob across the k-th place.
    fn report(&self, logits: &[f32], token: u32) -> Sampled {
        let (m, z) = log_normaliser(logits);
        let lp = |t: u32| (logits[t as usize] as f64 - m - z) as f32;
        let top = if self.params.top_logprobs > 0 {
            let mut best = best_first((0..logits.len() as u32).collect(), self.params.top_logprobs, logits);
            best.sort_by(|&a, &b| lp(b).total_cmp(&lp(a)).then(a.cmp(&b)));
            best.into_iter().map(|t| (t, lp(t))).collect()
        } else {
            Vec::new()
        };
        Sampled { token, logprob: lp(token), top }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let u = self.next_uniform();
        draw_with(&self.params, logits, u)
    }
}

/// Best first: higher logit, then lower index (the order the draw walks).
fn by_logit<'a>(logits: &'a [f32]) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + 'a {
    |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b))
}

/// The `k` best of `ids` (all of them when fewer), best first: a selection, then a sort of
/// the k alone.
fn best_first(mut ids: Vec<u32>, k: usize, logits: &[f32]) -> Vec<u32> {
    let cmp = by_logit(logits);
    if k > 0 && k < ids.len() {
        ids.select_nth_unstable_by(k - 1, &cmp);
        ids.truncate(k);
    }
    ids.sort_unstable_by(&cmp);
    ids
}

/// Where in logits a draw's candidates are cut while it looks for its token: tokens within
/// `d · temperature` of the best (probabilities down to e^-d of the best's), wider each
/// time the walk runs past them.
const PREFIX_CUTS: [f64; 3] = [12.0, 30.0, 80.0];

/// One draw with uniform `u` in [0, 1): temperature, then top-k, then top-p (the smallest
/// prefix of the sorted distribution reaching the mass), then the token where `u` times
/// the kept mass falls, walking the kept tokens best first. What [`draw_sorted`] does,
/// without sorting the whole vocabulary (7 ms a token at 129K entries on one core): top-k
/// selects its k; otherwise only the tokens near the best are sorted, a wider prefix
/// only when the walk runs past it (every token outside a prefix is worse than every
/// token in it, so the walk is the same). The normaliser is summed in index order rather
/// than best first, so a seed's token can differ from [`draw_sorted`]'s only where `u`
/// lands within a rounding of a boundary (~1e-16 a draw); with top-k it is bit for bit.
fn draw_with(params: &SamplingParams, logits: &[f32], u: f64) -> u32 {
    let live: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize] != f32::NEG_INFINITY).collect();
    if live.is_empty() {
        return draw_sorted(params, logits, u);
    }
    if params.top_k > 0 {
        let order = best_first(live, params.top_k, logits);
        return walk(params, logits, &order, None, u).expect("a walk over every candidate ends");
    }
    let t = params.temperature as f64;
    let m = live.iter().map(|&i| logits[i as usize]).fold(f32::NEG_INFINITY, f32::max) as f64;
    let weights: Vec<f64> = live.iter().map(|&i| ((logits[i as usize] as f64 - m) / t).exp()).collect();
    let z: f64 = weights.iter().sum();
    if !m.is_finite() || !z.is_finite() || z <= 0.0 {
        return draw_sorted(params, logits, u);
    }
    // The kept mass when nothing is cut by top-p: every candidate's share.
    let all_mass = (params.top_p >= 1.0).then(|| weights.iter().map(|w| w / z).sum());
    for d in PREFIX_CUTS {
        let cut = m - d * t;
        let near: Vec<u32> = live.iter().copied().filter(|&i| logits[i as usize] as f64 >= cut).collect();
        if near.len() == live.len() {
            break;
        }
        if let Some(token) = walk(params, logits, &best_first(near, 0, logits), Some((m, z, all_mass)), u) {
            return token;
        }
    }
    draw_sorted(params, logits, u)
}

/// The walk over `order` (best first): top-p's prefix, then `u` times its mass. With
/// `partial = Some((m, z, all_mass))` `order` is a prefix of the candidates and `z` their
/// whole normaliser; None when the walk needs tokens past it. Without, `order` is every
/// candidate (the walk always ends).
fn walk(
    params: &SamplingParams,
    logits: &[f32],
    order: &[u32],
    partial: Option<(f64, f64, Option<f64>)>,
    u: f64,
) -> Option<u32> {
    let t = params.temperature as f64;
    let m = partial.map_or(logits[order[0] as usize] as f64, |p| p.0);
    let mut probs: Vec<f64> = order.iter().map(|&i| ((logits[i as usize] as f64 - m) / t).exp()).collect();
    let z = partial.map_or_else(|| probs.iter().sum(), |p| p.1);
    probs.iter_mut().for_each(|p| *p /= z);
    let mut keep = probs.len();
    if params.top_p < 1.0 {
        let mut acc = 0.0;
        let reached = probs.iter().position(|p| {
            acc += p;
            acc >= params.top_p as f64
        });
        match reached {
            Some(i) => keep = i + 1,
            None if partial.is_some() => return None,
            None => {}
        }
    }
    // Every candidate's share when top-p cut nothing and `order` is a prefix.
    let mass = match partial.and_then(|p| p.2) {
        Some(all) if params.top_p >= 1.0 => all,
        _ => probs[..keep].iter().sum(),
    };
    let mut left = u * mass;
    for (i, p) in probs[..keep].iter().enumerate() {
        if left < *p {
            return Some(order[i]);
        }
        left -= p;
    }
    // Past the prefix's end: a complete order's walk ends on its last kept token (the
    // rounding of `mass`); a partial one needs more tokens unless top-p kept fewer.
    if partial.is_some() && keep == probs.len() && params.top_p >= 1.0 {
        return None;
    }
    Some(order[keep - 1])
}

/// The draw over every candidate sorted (where [`draw_with`]'s shortcuts do not apply:
/// every token masked, non-finite logits).
fn draw_sorted(params: &SamplingParams, logits: &[f32], u: f64) -> u32 {
    let order = candidates_sorted(params, logits);
    walk(params, logits, &order, None, u).expect("a walk over every candidate ends")
}

/// Every candidate token, best first: masked-out tokens (constrained decoding) left out
/// (the best one kept if all are), then top-k.
fn candidates_sorted(params: &SamplingParams, logits: &[f32]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(by_logit(logits));
    if let Some(end) = order.iter().position(|&i| logits[i as usize] == f32::NEG_INFINITY) {
        order.truncate(end.max(1));
    }
    if params.top_k > 0 {
        order.truncate(params.top_k);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The draw as defined: every token sorted, top-k, top-p, the walk (the sampler's
    /// code before `draw_with`, kept here as the reference it must match).
    fn draw_by_definition(params: &SamplingParams, logits: &[f32], u: f64) -> u32 {
        let t = params.temperature as f64;
        let order = candidates_sorted(params, logits);
        let m = logits[order[0] as usize] as f64;
        let mut probs: Vec<f64> = order.iter().map(|&i| ((logits[i as usize] as f64 - m) / t).exp()).collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= z);
        // Smallest prefix whose mass reaches top_p (always at least one token).
        let mut keep = probs.len();
        if params.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut u = u * mass;
        for (i, p) in probs[..keep].iter().enumerate() {
            if u < *p {
                return order[i];
            }
            u -= p;
        }
        order[keep - 1]
    }

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

    /// Logits shaped like a model's: a few strong candidates over a long tail (the
    /// `spread` sets how flat), with ties, masked tokens and extremes mixed in.
    fn model_like(n: usize, spread: f32, salt: u64) -> Vec<f32> {
        let mut x = 0x2545_f491_4f6c_dd1du64 ^ salt;
        let mut next = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 40) as f32 / (1u64 << 24) as f32
        };
        let mut l: Vec<f32> = (0..n).map(|_| -spread * next() * next()).collect();
        for i in 0..8 {
            l[(i * 7919) % n] = 2.0 + next() * 4.0;
        }
        l[n / 3] = l[n / 5]; // a tie, which the index breaks
        l[n / 2] = l[(7919 * 3) % n];
        l
    }

    /// The draw that sorts a prefix of the vocabulary picks what sorting all of it picks,
    /// over temperatures, top-k and top-p settings, masks and 3,264 uniforms — including
    /// walks that run past the first prefix (a flat tail at high temperature) and top-k
    /// (bit for bit by construction).
    #[test]
    fn the_prefix_draw_picks_what_the_full_sort_picks() {
        let mut compared = 0;
        let mut widened = 0;
        for (salt, (n, spread)) in
            [(4096, 30.0), (4096, 4.0), (50_000, 12.0), (777, 0.5), (100_000, 0.0)].into_iter().enumerate()
        {
            let mut logits = model_like(n, spread, salt as u64);
            if spread == 0.0 {
                // A heavy tail: ~27% of the mass at temperature 1 lies past the first cut.
                logits
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, l)| *l = if i == 7 { 0.0 } else { -12.5 - (i % 7) as f32 * 0.01 });
            }
            if salt == 2 {
                for i in (0..n).step_by(3) {
                    logits[i] = f32::NEG_INFINITY;
                }
            }
            for temperature in [0.05f32, 0.7, 1.0, 3.0] {
                for (top_k, top_p) in [(0, 1.0f32), (0, 0.9), (0, 0.05), (40, 1.0), (40, 0.8), (n + 5, 0.95)] {
                    let params = SamplingParams { temperature, top_k, top_p, ..Default::default() };
                    // (Fewer uniforms on the long rows: the reference sorts the row each time.)
                    let us = if n > 10_000 { 8 } else { 40 };
                    for j in 0..us {
                        let u = (j as f64 + 0.37) / us as f64;
                        let want = draw_by_definition(&params, &logits, u);
                        assert_eq!(draw_with(&params, &logits, u), want, "{params:?} n={n} spread={spread} u={u}");
                        compared += 1;
                        let t = temperature as f64;
                        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                        widened += usize::from(top_k == 0 && (logits[want as usize] as f64) < m - PREFIX_CUTS[0] * t);
                    }
                }
            }
        }
        assert_eq!(compared, 3 * 4 * 6 * 40 + 2 * 4 * 6 * 8);
        assert!(widened > 0, "no draw ran past the first prefix: the widening went untested");
    }

    /// Every token masked but the ones allowed; all masked keeps the sorted draw's answer.
    #[test]
    fn the_prefix_draw_handles_masks_and_degenerate_rows() {
        let params = SamplingParams { temperature: 0.8, top_p: 0.9, ..Default::default() };
        let mut l = vec![f32::NEG_INFINITY; 1000];
        l[17] = 0.5;
        l[400] = 0.7;
        for j in 0..20 {
            let u = j as f64 / 20.0;
            assert!([17, 400].contains(&draw_with(&params, &l, u)));
            assert_eq!(draw_with(&params, &l, u), draw_by_definition(&params, &l, u));
        }
        let all_masked = vec![f32::NEG_INFINITY; 10];
        assert_eq!(draw_with(&params, &all_masked, 0.5), draw_by_definition(&params, &all_masked, 0.5));
        let flat = vec![1.0f32; 300];
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(draw_with(&params, &flat, u), draw_by_definition(&params, &flat, u), "ties walk in index order");
        }
    }

    /// The top logprobs from one normaliser pass equal ranking a full log-softmax.
    #[test]
    fn top_logprobs_match_the_full_log_softmax() {
        let logits = model_like(20_000, 10.0, 9);
        let s = Sampler::new(SamplingParams { top_logprobs: 20, ..Default::default() });
        let got = s.report(&logits, 5);
        let lp = log_softmax(&logits);
        let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
        idx.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
        let want: Vec<(u32, f32)> = idx[..20].iter().map(|&t| (t, lp[t as usize])).collect();
        assert_eq!(got.top, want);
        assert_eq!(got.logprob, lp[5]);
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
