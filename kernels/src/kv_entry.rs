//! One KV entry as stored bytes, for every [`EntryDtype`]: the single encoder and
//! decoder that the CPU backend, the reference tests and the engine's rounding use.
//! The CUDA kernels mirror it in `cu/common.cuh` (`entry_encode_*` / `entry_load`) and
//! are tested to write the same bytes.
//!
//! f32 and bf16 entries are `dim` little-endian values. An fp8 entry is the byte record
//! [`EntryFormat`] describes: FP8 e4m3fn codes for dims `0..dim-tail` with one
//! power-of-two (ue8m0) scale per 64-dim block, the `tail` RoPE dims in BF16, the scale
//! bytes, zero padding to 8 bytes.
//!
//! Encoding a decoded entry gives back the same values (the block maximum can only
//! shrink, and every decoded value is representable at the smaller scale too), which is
//! what lets the engine round a fresh entry once ([`round`]) and have the ring, the
//! pages and this step's attention agree on it.

use std::sync::LazyLock;

use crate::EntryDtype;
use crate::kv_layout::{EntryFormat, FP8_SCALE_BLOCK};
use crate::quant::{bf16_to_f32, f32_to_bf16, f32_to_fp8_e4m3, fp8_e4m3_to_f32, ue8m0_to_f32};

/// Largest finite FP8 e4m3fn magnitude: a block's maximum maps at most here.
pub const FP8_MAX: f32 = 448.0;

static FP8_LUT: LazyLock<[f32; 256]> = LazyLock::new(|| std::array::from_fn(|c| fp8_e4m3_to_f32(c as u8)));

/// The ue8m0 byte `b` of the smallest power-of-two scale `2^(b-127)` with
/// `amax / scale <= 448`, i.e. `ceil(log2(amax / 448)) + 127`, read off the bits of the
/// (correctly rounded) quotient. This is `quant::ue8m0_for(amax, 448.0)` made exact: a
/// float `log2` can round a quotient just above a power of two down onto it, and the
/// CUDA kernels must reproduce this byte for byte.
pub fn fp8_scale_byte(amax: f32) -> u8 {
    // amax >= 1e-30 keeps the quotient a normal float (>= 2.2e-33), so its exponent
    // field is its floor(log2).
    let r = amax.max(1e-30) / FP8_MAX;
    let bits = r.to_bits();
    let floor = ((bits >> 23) & 0xff) as i32 - 127;
    let ceil = floor + i32::from(bits & 0x7f_ffff != 0);
    (ceil + 127).clamp(0, 254) as u8
}

/// Write `values` (`fmt.dim` of them) as stored bytes (`fmt.bytes()` of them).
pub fn encode(fmt: &EntryFormat, values: &[f32], out: &mut [u8]) {
    assert_eq!(values.len(), fmt.dim, "entry of {} values for a {}-dim format", values.len(), fmt.dim);
    assert_eq!(out.len(), fmt.bytes(), "entry bytes for {fmt:?}");
    match fmt.dtype {
        EntryDtype::F32 => out.chunks_exact_mut(4).zip(values).for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes())),
        EntryDtype::Bf16 => {
            out.chunks_exact_mut(2).zip(values).for_each(|(o, v)| o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes()))
        }
        EntryDtype::Fp8 => {
            let n8 = fmt.fp8_dims();
            let (codes, rest) = out.split_at_mut(n8);
            let (tail, rest) = rest.split_at_mut(2 * fmt.tail);
            let (scales, pad) = rest.split_at_mut(fmt.scales());
            for ((block, codes), s) in
                values[..n8].chunks(FP8_SCALE_BLOCK).zip(codes.chunks_mut(FP8_SCALE_BLOCK)).zip(scales)
            {
                *s = fp8_scale_byte(block.iter().fold(0f32, |a, v| a.max(v.abs())));
                let scale = ue8m0_to_f32(*s);
                codes.iter_mut().zip(block).for_each(|(c, v)| *c = f32_to_fp8_e4m3(v / scale));
            }
            tail.chunks_exact_mut(2)
                .zip(&values[n8..])
                .for_each(|(o, v)| o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes()));
            pad.fill(0);
        }
    }
}

/// Read stored bytes (`fmt.bytes()`) back as `fmt.dim` values.
pub fn decode(fmt: &EntryFormat, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len(), fmt.dim, "decoding a {}-dim entry into {} values", fmt.dim, out.len());
    assert!(bytes.len() >= fmt.bytes(), "entry bytes for {fmt:?}");
    match fmt.dtype {
        EntryDtype::F32 => {
            out.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(o, b)| *o = f32::from_le_bytes(b.try_into().unwrap()))
        }
        EntryDtype::Bf16 => out
            .iter_mut()
            .zip(bytes.chunks_exact(2))
            .for_each(|(o, b)| *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))),
        EntryDtype::Fp8 => {
            let lut = &*FP8_LUT;
            let n8 = fmt.fp8_dims();
            let scales = &bytes[fmt.scale_offset()..fmt.scale_offset() + fmt.scales()];
            for ((o, codes), s) in
                out[..n8].chunks_mut(FP8_SCALE_BLOCK).zip(bytes[..n8].chunks(FP8_SCALE_BLOCK)).zip(scales)
            {
                let scale = ue8m0_to_f32(*s);
                o.iter_mut().zip(codes).for_each(|(o, &c)| *o = lut[c as usize] * scale);
            }
            let tail = &bytes[fmt.tail_offset()..fmt.scale_offset()];
            out[n8..]
                .iter_mut()
                .zip(tail.chunks_exact(2))
                .for_each(|(o, b)| *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]])));
        }
    }
}

/// Replace each `fmt.dim`-long entry of `values` by what storing and loading it gives.
pub fn round(fmt: &EntryFormat, values: &mut [f32]) {
    assert_eq!(values.len() % fmt.dim.max(1), 0, "{} values are not whole {}-dim entries", values.len(), fmt.dim);
    match fmt.dtype {
        EntryDtype::F32 => {}
        EntryDtype::Bf16 => values.iter_mut().for_each(|v| *v = bf16_to_f32(f32_to_bf16(*v))),
        EntryDtype::Fp8 => {
            let mut rec = vec![0u8; fmt.bytes()];
            for e in values.chunks_exact_mut(fmt.dim) {
                encode(fmt, e, &mut rec);
                decode(fmt, &rec, e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::ue8m0_for;

    fn fmt(dtype: EntryDtype, dim: usize, tail: usize) -> EntryFormat {
        EntryFormat { dtype, dim, tail }
    }

    /// Deterministic values spanning several magnitudes per block.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(40503));
                let mag = ((x >> 8) % 10_000) as f32 / 2_500.0 - 2.0;
                mag * [1.0, 0.01, 30.0, 1e-4][(x as usize >> 3) % 4]
            })
            .collect()
    }

    #[test]
    fn scale_byte_is_the_exact_ceil_log2() {
        for amax in [448.0f32, 448.5, 224.0, 1.0, 1e-3, 3.5, 0.0, 1e30] {
            let b = fp8_scale_byte(amax);
            let scale = ue8m0_to_f32(b);
            assert!(amax / scale <= FP8_MAX, "amax {amax} byte {b}");
            assert!(amax == 0.0 || amax / (scale / 2.0) > FP8_MAX, "amax {amax}: byte {b} is not the smallest");
        }
        assert_eq!(fp8_scale_byte(448.0), 127);
        assert_eq!(fp8_scale_byte(448.0 * 2.0), 128);
        // Agrees with the float-log2 version wherever that one is right.
        for v in values(4096, 3) {
            let a = v.abs() + 1e-6;
            let (exact, float) = (fp8_scale_byte(a), ue8m0_for(a, FP8_MAX));
            assert!(exact == float || a / ue8m0_to_f32(float) > FP8_MAX, "amax {a}: {exact} vs {float}");
        }
    }

    #[test]
    fn fp8_record_bytes_follow_the_documented_layout() {
        let f = fmt(EntryDtype::Fp8, 144, 16); // two blocks: 64 + 64 codes, then 16 BF16
        let mut v = vec![0f32; 144];
        v[0] = 448.0; // block 0 scale 1
        v[1] = -1.0;
        v[64] = 2.0; // block 1: amax 2 → scale 2^-7
        v[128] = 1.5; // tail, BF16
        v[143] = -3.0;
        let mut b = vec![0xaau8; f.bytes()];
        encode(&f, &v, &mut b);
        assert_eq!(f.bytes(), 128 + 32 + 2 + 6);
        assert_eq!((b[0], b[1], b[2]), (0x7e, 0xb8, 0x00));
        assert_eq!(b[64], f32_to_fp8_e4m3(2.0 * 128.0));
        assert_eq!(&b[128..130], &f32_to_bf16(1.5).to_le_bytes());
        assert_eq!(&b[158..160], &f32_to_bf16(-3.0).to_le_bytes());
        assert_eq!((b[160], b[161]), (127, 120));
        assert!(b[162..].iter().all(|&x| x == 0), "padding is zeroed");
        let mut back = vec![f32::NAN; 144];
        decode(&f, &b, &mut back);
        assert_eq!(back, v);
    }

    #[test]
    fn every_dtype_round_trips_and_round_is_idempotent() {
        for f in [
            fmt(EntryDtype::F32, 40, 8),
            fmt(EntryDtype::Bf16, 40, 8),
            fmt(EntryDtype::Fp8, 512, 64),
            fmt(EntryDtype::Fp8, 128, 0),
            fmt(EntryDtype::Fp8, 32, 16),
            fmt(EntryDtype::Fp8, 100, 2), // partial last block
        ] {
            let v = values(3 * f.dim, f.dim as u32);
            let mut r = v.clone();
            round(&f, &mut r);
            for e in 0..3 {
                let (orig, got) = (&v[e * f.dim..(e + 1) * f.dim], &r[e * f.dim..(e + 1) * f.dim]);
                let mut b = vec![0u8; f.bytes()];
                encode(&f, orig, &mut b);
                let mut dec = vec![0f32; f.dim];
                decode(&f, &b, &mut dec);
                assert_eq!(dec, got, "round = decode(encode) for {f:?}");
                // Storing a rounded entry again changes no value.
                encode(&f, got, &mut b);
                decode(&f, &b, &mut dec);
                assert_eq!(dec, got, "round is idempotent for {f:?}");
                // FP8 keeps 3 mantissa bits: relative error at most 1/16 of the block
                // maximum's scale; BF16 dims at most 2^-9.
                let n8 = if f.dtype == EntryDtype::Fp8 { f.fp8_dims() } else { 0 };
                for blk in orig[..n8].chunks(FP8_SCALE_BLOCK).zip(got[..n8].chunks(FP8_SCALE_BLOCK)) {
                    let amax = blk.0.iter().fold(0f32, |a, x| a.max(x.abs()));
                    for (a, g) in blk.0.iter().zip(blk.1) {
                        assert!((a - g).abs() <= a.abs() / 16.0 + amax * 2f32.powi(-17), "{a} vs {g} ({f:?})");
                    }
                }
                for (a, g) in orig[n8..].iter().zip(&got[n8..]) {
                    assert!((a - g).abs() <= a.abs() * 2f32.powi(-8), "{a} vs {g} ({f:?})");
                }
            }
        }
    }
}
