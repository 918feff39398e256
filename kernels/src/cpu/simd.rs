//! Inner loops with explicit AVX2+FMA versions, chosen at run time (the release
//! binary targets baseline x86-64, which has neither). Decode is bound by streaming
//! weights from memory, so the dot products must keep up with the memory system; the
//! scalar fallbacks are used elsewhere and by the tests of the vector versions.

use std::sync::OnceLock;

fn has_avx2_fma() -> bool {
    static FLAG: OnceLock<bool> = OnceLock::new();
    *FLAG.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// `Σ a[i]·b[i]`.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot of unequal lengths");
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above); lengths are equal.
        return unsafe { x86::dot(a, b) };
    }
    dot_scalar(a, b)
}

/// `Σ a[i]·bf16(b[i])`.
#[inline]
pub(crate) fn dot_bf16(a: &[f32], b: &[u16]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot of unequal lengths");
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: as above.
        return unsafe { x86::dot_bf16(a, b) };
    }
    dot_bf16_scalar(a, b)
}

/// `y += a · x`.
#[inline]
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    assert_eq!(y.len(), x.len(), "axpy of unequal lengths");
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: as above.
        return unsafe { x86::axpy(y, a, x) };
    }
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// Widen bf16 values to f32.
#[inline]
pub(crate) fn widen_bf16(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s as u32) << 16);
    }
}

pub(crate) fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n = a.len() / 8 * 8;
    for i in (0..n).step_by(8) {
        for j in 0..8 {
            acc[j] += a[i + j] * b[i + j];
        }
    }
    let tail: f32 = (n..a.len()).map(|i| a[i] * b[i]).sum();
    acc.iter().sum::<f32>() + tail
}

pub(crate) fn dot_bf16_scalar(a: &[f32], b: &[u16]) -> f32 {
    let mut acc = [0f32; 8];
    let n = a.len() / 8 * 8;
    for i in (0..n).step_by(8) {
        for j in 0..8 {
            acc[j] += a[i + j] * f32::from_bits((b[i + j] as u32) << 16);
        }
    }
    let tail: f32 = (n..a.len()).map(|i| a[i] * f32::from_bits((b[i] as u32) << 16)).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let hi = _mm256_extractf128_ps(v, 1);
        let lo = _mm256_castps256_ps128(v);
        let s = _mm_add_ps(hi, lo);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// `Σ a[i]·b(i)` over `n` values: `load(i)` gives eight values of `b` from `i`,
    /// `at(i)` one. Four accumulators hide the FMA latency.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `load(i)` must be valid for `i + 8 <= n`.
    #[inline(always)]
    unsafe fn dot_by(a: &[f32], load: impl Fn(usize) -> __m256, at: impl Fn(usize) -> f32) -> f32 {
        let n = a.len();
        let pa = a.as_ptr();
        let mut acc = [unsafe { _mm256_setzero_ps() }; 4];
        let mut i = 0;
        // SAFETY (all loads): i + 32 <= n, resp. i + 8 <= n, bound every access.
        while i + 32 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                let x = unsafe { _mm256_loadu_ps(pa.add(i + 8 * k)) };
                *acc = unsafe { _mm256_fmadd_ps(x, load(i + 8 * k), *acc) };
            }
            i += 32;
        }
        while i + 8 <= n {
            let x = unsafe { _mm256_loadu_ps(pa.add(i)) };
            acc[0] = unsafe { _mm256_fmadd_ps(x, load(i), acc[0]) };
            i += 8;
        }
        let s = unsafe { _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])) };
        let mut total = unsafe { hsum(s) };
        while i < n {
            total += a[i] * at(i);
            i += 1;
        }
        total
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA, and `a.len() == b.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let pb = b.as_ptr();
        // SAFETY: b has a.len() values, so every load dot_by asks for is in bounds.
        unsafe { dot_by(a, |i| _mm256_loadu_ps(pb.add(i)), |i| b[i]) }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen8(p: *const u16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable u16 at p.
        let h = unsafe { _mm_loadu_si128(p as *const __m128i) };
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA, and `a.len() == b.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_bf16(a: &[f32], b: &[u16]) -> f32 {
        let pb = b.as_ptr();
        // SAFETY: b has a.len() values, so every load dot_by asks for is in bounds.
        unsafe { dot_by(a, |i| widen8(pb.add(i)), |i| f32::from_bits((b[i] as u32) << 16)) }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA, and `y.len() == x.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let n = y.len();
        let (py, px) = (y.as_mut_ptr(), x.as_ptr());
        let va = _mm256_set1_ps(a);
        let mut i = 0;
        // SAFETY (all loads and stores): i + 8 <= n bounds every access.
        while i + 8 <= n {
            unsafe {
                let v = _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
                _mm256_storeu_ps(py.add(i), v);
            }
            i += 8;
        }
        while i < n {
            y[i] += a * x[i];
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_and_scalar_dots_agree() {
        for n in [0usize, 1, 7, 8, 9, 31, 32, 33, 100, 515] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 53 % 97) as f32 - 48.0) / 30.0).collect();
            let bb: Vec<u16> = b.iter().map(|&x| (x.to_bits() >> 16) as u16).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let want_bf: f64 =
                a.iter().zip(&bb).map(|(x, y)| *x as f64 * f32::from_bits((*y as u32) << 16) as f64).sum();
            let tol = 1e-4 * (1.0 + want.abs());
            assert!((dot(&a, &b) as f64 - want).abs() < tol, "dot n={n}");
            assert!((dot_scalar(&a, &b) as f64 - want).abs() < tol, "dot_scalar n={n}");
            assert!((dot_bf16(&a, &bb) as f64 - want_bf).abs() < tol, "dot_bf16 n={n}");
            assert!((dot_bf16_scalar(&a, &bb) as f64 - want_bf).abs() < tol, "dot_bf16_scalar n={n}");
            let mut y = a.clone();
            axpy(&mut y, 0.5, &b);
            for i in 0..n {
                assert!((y[i] - (a[i] + 0.5 * b[i])).abs() < 1e-6, "axpy n={n} i={i}");
            }
        }
    }
}
