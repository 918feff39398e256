//! A step's read-out on the host: the greedy token and its log-probability exactly as
//! the engine's sampler computes them, the picks a backend may still hold on the
//! device ([`GreedyPicks`]), and a downloaded buffer cut into a part a sequence.

/// Index of the largest value, the first one on ties (NaN values never win; a row that
/// starts with NaN keeps index 0): the greedy token, on the host (`engine::sampling`)
/// and in [`greedy_pick`].
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// `(m, ln Σ exp(lⱼ - m))` of a row of logits, `m` its largest non-NaN value, in f64: the
/// log-softmax of `l` is `l - m - z` (`engine::sampling::log_softmax`, [`greedy_pick`]).
pub fn log_normaliser(logits: &[f32]) -> (f64, f64) {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z = logits.iter().map(|&l| (l as f64 - m).exp()).sum::<f64>().ln();
    (m, z)
}

/// Greedy picks of a step's rows ([`crate::Backend::greedy_rows_start`]): made already, or in a
/// device buffer of `2 · rows` values holding each row's token and log-probability as
/// f32 bits, to be read by [`crate::Backend::greedy_rows_finish`].
pub enum GreedyPicks<Buf> {
    Ready(Vec<(u32, f32)>),
    OnDevice { buf: Buf, rows: usize },
}

/// The greedy token of a row of logits and its log-probability, exactly as the engine's
/// sampler computes them ([`argmax`], [`log_normaliser`]).
pub fn greedy_pick(row: &[f32]) -> (u32, f32) {
    let best = argmax(row);
    let (m, z) = log_normaliser(row);
    (best, (row.get(best as usize).map_or(f64::NAN, |&l| l as f64) - m - z) as f32)
}

/// `all` cut into consecutive parts of `lens` values (which must cover it exactly).
pub fn split_parts(all: &[f32], lens: &[usize]) -> Vec<Vec<f32>> {
    assert_eq!(lens.iter().sum::<usize>(), all.len(), "download parts do not cover the buffer");
    let mut at = 0;
    lens.iter()
        .map(|&n| {
            at += n;
            all[at - n..at].to_vec()
        })
        .collect()
}
