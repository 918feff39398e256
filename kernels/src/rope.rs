//! Rotary frequency tables. V4 rotates the last `rope_dim` values of a head in
//! interleaved pairs `(2j, 2j+1)` by angle `position · inv_freq[j]`; window-only layers
//! use plain frequencies, layers with a compressor use YaRN-scaled ones.

pub use model_spec::Yarn;

#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    /// One frequency per rotated pair.
    pub inv_freq: Vec<f32>,
    /// Multiplier on cos/sin (YaRN's attention factor; V4 uses 1).
    pub attention_factor: f32,
}

impl RopeTable {
    /// Plain RoPE: `inv_freq[j] = theta^(-2j / dims)`.
    pub fn plain(theta: f64, dims: usize) -> Self {
        RopeTable { inv_freq: base_freqs(theta, dims).into_iter().map(|f| f as f32).collect(), attention_factor: 1.0 }
    }

    /// YaRN: frequencies above the fast boundary keep their value, those below the
    /// slow boundary are divided by `factor`, with a linear ramp between (boundaries
    /// rounded outward, as the reference does).
    pub fn yarn(theta: f64, dims: usize, y: Yarn, attention_factor: f64) -> Self {
        let correction_dim = |rotations: f64| {
            dims as f64 * (y.original_max_position / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
        };
        let low = correction_dim(y.beta_fast).floor().max(0.0);
        let high = correction_dim(y.beta_slow).ceil().min(dims as f64 - 1.0);
        let span = if low == high { 0.001 } else { high - low };
        let inv_freq = base_freqs(theta, dims)
            .into_iter()
            .enumerate()
            .map(|(j, extrapolated)| {
                let interpolated = extrapolated / y.factor;
                let ramp = ((j as f64 - low) / span).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                (interpolated * (1.0 - keep) + extrapolated * keep) as f32
            })
            .collect();
        RopeTable { inv_freq, attention_factor: attention_factor as f32 }
    }

    /// Number of rotated values per head.
    pub fn dims(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// `(cos, sin)` of pair `j` at `position`, computed as the reference does: the
    /// angle as an f32 product, then cos/sin of that f32.
    #[inline]
    pub fn cos_sin(&self, position: u32, j: usize) -> (f32, f32) {
        let angle = position as f32 * self.inv_freq[j];
        let (s, c) = angle.sin_cos();
        (c * self.attention_factor, s * self.attention_factor)
    }

    /// `(cos, sin)` of every pair at `position`.
    pub fn angles(&self, position: u32) -> (Vec<f32>, Vec<f32>) {
        (0..self.inv_freq.len()).map(|j| self.cos_sin(position, j)).unzip()
    }
}

fn base_freqs(theta: f64, dims: usize) -> Vec<f64> {
    (0..dims / 2).map(|j| 1.0 / theta.powf((2 * j) as f64 / dims as f64)).collect()
}

/// Rotate one head's rope slice in place (`x.len() == table.dims()`).
#[inline]
pub fn rotate(x: &mut [f32], position: u32, table: &RopeTable, inverse: bool) {
    let (cos, sin) = table.angles(position);
    rotate_with(x, &cos, &sin, inverse);
}

/// Rotate by precomputed `(cos, sin)` per pair (shared by all heads of a row).
#[inline]
pub fn rotate_with(x: &mut [f32], cos: &[f32], sin: &[f32], inverse: bool) {
    for j in 0..cos.len() {
        let (c, s) = (cos[j], if inverse { -sin[j] } else { sin[j] });
        let (a, b) = (x[2 * j], x[2 * j + 1]);
        x[2 * j] = a * c - b * s;
        x[2 * j + 1] = b * c + a * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_frequencies_start_at_one_and_fall() {
        let t = RopeTable::plain(10000.0, 64);
        assert_eq!(t.dims(), 64);
        assert_eq!(t.inv_freq[0], 1.0);
        assert!((t.inv_freq[1] as f64 - 10000f64.powf(-2.0 / 64.0)).abs() < 1e-7);
        assert!(t.inv_freq.windows(2).all(|w| w[1] < w[0]));
    }

    #[test]
    fn yarn_keeps_fast_and_scales_slow_frequencies() {
        let y = Yarn { factor: 16.0, original_max_position: 65536.0, beta_fast: 32.0, beta_slow: 1.0 };
        let plain = RopeTable::plain(160000.0, 64);
        let yarn = RopeTable::yarn(160000.0, 64, y, 1.0);
        assert_eq!(yarn.inv_freq[0], plain.inv_freq[0]);
        let last = plain.inv_freq.len() - 1;
        assert!((yarn.inv_freq[last] - plain.inv_freq[last] / 16.0).abs() < 1e-12);
        let mid = plain.inv_freq.len() / 2;
        assert!(yarn.inv_freq[mid] < plain.inv_freq[mid] && yarn.inv_freq[mid] > plain.inv_freq[mid] / 16.0);
    }

    #[test]
    fn inverse_rotation_undoes_rotation() {
        let t = RopeTable::plain(10000.0, 8);
        let orig = [0.3f32, -1.2, 0.7, 2.0, -0.1, 0.4, 1.5, -0.9];
        let mut x = orig;
        rotate(&mut x, 1234, &t, false);
        assert!(x.iter().zip(&orig).any(|(a, b)| (a - b).abs() > 1e-3));
        rotate(&mut x, 1234, &t, true);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
