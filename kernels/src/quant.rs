//! Number formats checkpoints store weights in, and their block-scaled layouts:
//! BF16/F16, FP8 e4m3 (OCP "fn": no infinities, ±448 max) with one ue8m0 scale per
//! 128×128 block, FP4 e2m1 packed two per byte (low nibble first) with one ue8m0 scale
//! per 32 inputs. Decoders here feed the CPU path; encoders write test and `model init`
//! checkpoints in the same formats DeepSeek ships.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("scale grid {got:?} does not match weight {rows}x{cols} in blocks of {block:?} (expected {want:?})")]
    ScaleGrid { rows: usize, cols: usize, block: (usize, usize), want: (usize, usize), got: (usize, usize) },
    #[error("packed FP4 data has {got} bytes, expected {want} for {rows}x{cols}")]
    Fp4Len { rows: usize, cols: usize, want: usize, got: usize },
    #[error("FP8 data has {got} bytes, expected {want}")]
    Fp8Len { want: usize, got: usize },
    #[error("{dtype} data has {got} bytes, expected {want}")]
    DenseLen { dtype: &'static str, want: usize, got: usize },
}

#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Round-to-nearest-even, as torch's `.to(bfloat16)` does.
#[inline]
pub fn f32_to_bf16(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// FP8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; `S.1111.111` is NaN.
#[inline]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 { sign * (man / 8.0) * (2f32).powi(-6) } else { sign * (1.0 + man / 8.0) * (2f32).powi(exp - 7) }
}

/// ue8m0: a biased power-of-two exponent, `2^(b - 127)`; 0xff is NaN.
#[inline]
pub fn ue8m0_to_f32(b: u8) -> f32 {
    if b == 0xff { f32::NAN } else { (2f32).powi(b as i32 - 127) }
}

/// The power-of-two scale (as its ue8m0 byte) that maps `amax` into `[-qmax, qmax]`.
pub fn ue8m0_for(amax: f32, qmax: f32) -> u8 {
    let e = (amax.max(1e-30) / qmax).log2().ceil() as i32;
    (e + 127).clamp(0, 254) as u8
}

/// E2M1 values by nibble.
pub const FP4_E2M1: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

fn nearest_code(v: f32, table: &[(f32, u8)]) -> u8 {
    // `table` is sorted by value; ties go to the even code (round half to even).
    let idx = table.partition_point(|&(x, _)| x < v);
    let cand = |i: usize| table.get(i).copied();
    match (idx.checked_sub(1).and_then(cand), cand(idx)) {
        (Some((lo, lc)), Some((hi, hc))) => {
            let (dl, dh) = (v - lo, hi - v);
            if dl < dh || (dl == dh && lc % 2 == 0) { lc } else { hc }
        }
        (Some((_, c)), None) | (None, Some((_, c))) => c,
        (None, None) => 0,
    }
}

fn positive_table(decode: impl Fn(u8) -> f32, codes: impl Iterator<Item = u8>) -> Vec<(f32, u8)> {
    let mut t: Vec<(f32, u8)> = codes.map(|c| (decode(c), c)).filter(|(v, _)| v.is_finite() && *v >= 0.0).collect();
    t.sort_by(|a, b| a.0.total_cmp(&b.0));
    t.dedup_by(|a, b| a.0 == b.0);
    t
}

/// Encode to FP8 e4m3fn, saturating at ±448.
pub fn f32_to_fp8_e4m3(v: f32) -> u8 {
    thread_local! {
        static TABLE: Vec<(f32, u8)> = positive_table(fp8_e4m3_to_f32, 0u8..0x80);
    }
    let mag = v.abs().min(448.0);
    let code = TABLE.with(|t| nearest_code(mag, t));
    if v.is_sign_negative() && code != 0 { code | 0x80 } else { code }
}

/// Encode to an E2M1 nibble, saturating at ±6.
pub fn f32_to_fp4_e2m1(v: f32) -> u8 {
    thread_local! {
        static TABLE: Vec<(f32, u8)> = positive_table(|c| FP4_E2M1[c as usize], 0u8..8);
    }
    let code = TABLE.with(|t| nearest_code(v.abs().min(6.0), t));
    if v.is_sign_negative() && code != 0 { code | 0x8 } else { code }
}

/// Dequantise FP8 weights `[rows, cols]` with one scale per `block` (rows × cols),
/// scale grid `ceil(rows/br) × ceil(cols/bc)`.
pub fn dequant_fp8_blocks(
    q: &[u8],
    rows: usize,
    cols: usize,
    scales: &[f32],
    grid: (usize, usize),
    block: (usize, usize),
) -> Result<Vec<f32>, QuantError> {
    if q.len() != rows * cols {
        return Err(QuantError::Fp8Len { want: rows * cols, got: q.len() });
    }
    let want = (rows.div_ceil(block.0), cols.div_ceil(block.1));
    if grid != want || scales.len() != want.0 * want.1 {
        return Err(QuantError::ScaleGrid { rows, cols, block, want, got: grid });
    }
    let lut: Vec<f32> = (0..=255u8).map(fp8_e4m3_to_f32).collect();
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        let srow = &scales[(r / block.0) * want.1..(r / block.0 + 1) * want.1];
        for c in 0..cols {
            out[r * cols + c] = lut[q[r * cols + c] as usize] * srow[c / block.1];
        }
    }
    Ok(out)
}

/// Dequantise packed FP4 weights `[rows, cols]` (`cols / 2` bytes per row, low nibble
/// is the even column) with one scale per `group` consecutive columns.
pub fn dequant_fp4_groups(
    packed: &[u8],
    rows: usize,
    cols: usize,
    scales: &[f32],
    grid: (usize, usize),
    group: usize,
) -> Result<Vec<f32>, QuantError> {
    if packed.len() * 2 != rows * cols {
        return Err(QuantError::Fp4Len { rows, cols, want: rows * cols / 2, got: packed.len() });
    }
    let want = (rows, cols.div_ceil(group));
    if grid != want || scales.len() != want.0 * want.1 {
        return Err(QuantError::ScaleGrid { rows, cols, block: (1, group), want, got: grid });
    }
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let byte = packed[(r * cols + c) / 2];
            let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            out[r * cols + c] = FP4_E2M1[nib as usize] * scales[r * want.1 + c / group];
        }
    }
    Ok(out)
}

/// Quantise to FP8 with ue8m0 block scales; returns `(codes, scale bytes)`.
pub fn quantize_fp8_blocks(w: &[f32], rows: usize, cols: usize, block: (usize, usize)) -> (Vec<u8>, Vec<u8>) {
    let grid = (rows.div_ceil(block.0), cols.div_ceil(block.1));
    let mut scales = vec![0u8; grid.0 * grid.1];
    for (bi, s) in scales.iter_mut().enumerate() {
        let (br, bc) = (bi / grid.1, bi % grid.1);
        let mut amax = 0f32;
        for r in br * block.0..((br + 1) * block.0).min(rows) {
            for c in bc * block.1..((bc + 1) * block.1).min(cols) {
                amax = amax.max(w[r * cols + c].abs());
            }
        }
        *s = ue8m0_for(amax, 448.0);
    }
    let codes = (0..rows * cols)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            let scale = ue8m0_to_f32(scales[(r / block.0) * grid.1 + c / block.1]);
            f32_to_fp8_e4m3(w[i] / scale)
        })
        .collect();
    (codes, scales)
}

/// Quantise to packed FP4 with ue8m0 scales per `group` columns; returns
/// `(packed bytes, scale bytes)`.
pub fn quantize_fp4_groups(w: &[f32], rows: usize, cols: usize, group: usize) -> (Vec<u8>, Vec<u8>) {
    assert!(cols.is_multiple_of(2), "FP4 packing needs an even number of columns");
    let groups = cols.div_ceil(group);
    let mut scales = vec![0u8; rows * groups];
    for r in 0..rows {
        for g in 0..groups {
            let span = &w[r * cols + g * group..r * cols + ((g + 1) * group).min(cols)];
            scales[r * groups + g] = ue8m0_for(span.iter().fold(0f32, |a, v| a.max(v.abs())), 6.0);
        }
    }
    let mut packed = vec![0u8; rows * cols / 2];
    for r in 0..rows {
        for c in 0..cols {
            let scale = ue8m0_to_f32(scales[r * groups + c / group]);
            let nib = f32_to_fp4_e2m1(w[r * cols + c] / scale);
            packed[(r * cols + c) / 2] |= if c % 2 == 0 { nib } else { nib << 4 };
        }
    }
    (packed, scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_known_values() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0); // exp 7, man 0
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0); // largest finite
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
        assert!(fp8_e4m3_to_f32(0x7f).is_nan());
    }

    #[test]
    fn fp8_round_trips_every_finite_code() {
        for code in 0u8..=255 {
            let v = fp8_e4m3_to_f32(code);
            if v.is_nan() || (v == 0.0 && code == 0x80) {
                continue;
            }
            assert_eq!(f32_to_fp8_e4m3(v), code, "code {code:#x} value {v}");
        }
        assert_eq!(f32_to_fp8_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(-1e9), 0xfe);
    }

    #[test]
    fn fp4_and_ue8m0_known_values() {
        assert_eq!(f32_to_fp4_e2m1(2.9), 5); // nearest is 3.0
        assert_eq!(f32_to_fp4_e2m1(-0.74), 0x8 | 1); // -0.5
        assert_eq!(ue8m0_to_f32(127), 1.0);
        assert_eq!(ue8m0_to_f32(130), 8.0);
        assert_eq!(ue8m0_for(100.0, 448.0), 125); // 100 / 0.25 = 400 fits under 448
        assert_eq!(ue8m0_for(1000.0, 448.0), 129);
    }

    #[test]
    fn fp8_block_round_trip_is_close_and_grid_checked() {
        let (rows, cols) = (130, 200); // partial blocks on both axes
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0).collect();
        let (q, s) = quantize_fp8_blocks(&w, rows, cols, (128, 128));
        let scales: Vec<f32> = s.iter().map(|&b| ue8m0_to_f32(b)).collect();
        let d = dequant_fp8_blocks(&q, rows, cols, &scales, (2, 2), (128, 128)).unwrap();
        for (a, b) in w.iter().zip(&d) {
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-3, "{a} vs {b}");
        }
        let err = dequant_fp8_blocks(&q, rows, cols, &scales, (1, 2), (128, 128)).unwrap_err();
        assert!(matches!(err, QuantError::ScaleGrid { want: (2, 2), .. }));
    }

    #[test]
    fn fp4_packing_is_low_nibble_first() {
        let w = [1.0f32, -6.0, 0.5, 3.0];
        let (p, s) = quantize_fp4_groups(&w, 1, 4, 32);
        assert_eq!(s, vec![127]);
        assert_eq!(p, vec![0x2 | (0xf << 4), 0x1 | (0x5 << 4)]);
        let d = dequant_fp4_groups(&p, 1, 4, &[1.0], (1, 1), 32).unwrap();
        assert_eq!(d, w.to_vec());
    }
}
