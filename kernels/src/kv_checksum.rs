//! The KV checksum: what a writer of KV bytes (a prefill worker sending a prompt's KV, a
//! kvstore restoring a prefix, a prefill worker offering blocks to the store) and its
//! reader compare to prove the bytes landed intact.
//!
//! It is defined so that the bytes can be summed where they are, GPU memory included,
//! without a copy to the host first: the bytes are read as little-endian 64-bit words
//! (the last one zero-padded), word `i` contributes `fmix64(word + i·K)`, the
//! contributions are added modulo 2^64, and the total is mixed once more with the byte
//! length. Addition makes the order of summation free (any number of GPU threads, any
//! split into pieces gives the same value), the index inside each term makes moved or
//! swapped words count, and `fmix64` (MurmurHash3's 64-bit finaliser, a bijection) makes
//! any change to one word change the sum. Like xxh3, which it replaced on the KV paths
//! (wire version 4), it detects corruption, not tampering; transport security is TLS's.
//!
//! The CUDA backend sums with `kv_checksum` in `cuda/cu/checksum.cu`; this file is the
//! reference the parity suite checks it against.

/// Multiplier of a word's index (the golden-ratio constant: odd, bits well spread).
pub const WORD_KEY: u64 = 0x9E37_79B9_7F4A_7C15;
/// Multiplier of the byte length in the final mix.
pub const LEN_KEY: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// MurmurHash3's 64-bit finaliser: a bijection that spreads every input bit over the
/// output.
#[inline]
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// Word `index`'s contribution to the sum.
#[inline]
pub fn word_term(word: u64, index: u64) -> u64 {
    fmix64(word.wrapping_add(index.wrapping_mul(WORD_KEY)))
}

/// Sum of the terms of `bytes`, whose first byte is byte `8 · first_word` of the range
/// being checksummed (pieces of a range start on word boundaries; only the range's last
/// piece may end inside a word, zero-padded).
pub fn partial_sum(bytes: &[u8], first_word: u64) -> u64 {
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let full = bytes.len() / 8;
    // Four independent sums keep the multiplier busy (each term is two dependent
    // multiplies); the total is the same in any order.
    let mut acc = [0u64; 4];
    let mut i = 0;
    while i + 4 <= full {
        for (lane, a) in acc.iter_mut().enumerate() {
            let k = i + lane;
            *a = a.wrapping_add(word_term(word(8 * k), first_word + k as u64));
        }
        i += 4;
    }
    let mut sum = acc.iter().fold(0u64, |s, &a| s.wrapping_add(a));
    for k in i..full {
        sum = sum.wrapping_add(word_term(word(8 * k), first_word + k as u64));
    }
    let tail = &bytes[8 * full..];
    if !tail.is_empty() {
        let mut last = [0u8; 8];
        last[..tail.len()].copy_from_slice(tail);
        sum = sum.wrapping_add(word_term(u64::from_le_bytes(last), first_word + full as u64));
    }
    sum
}

/// The checksum of a range of `len` bytes whose terms add up to `sum`.
#[inline]
pub fn finish(sum: u64, len: usize) -> u64 {
    fmix64(sum ^ (len as u64).wrapping_mul(LEN_KEY))
}

/// The checksum of `bytes`.
pub fn kv_checksum(bytes: &[u8]) -> u64 {
    finish(partial_sum(bytes, 0), bytes.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn pieces_on_word_boundaries_add_up_to_the_whole() {
        let b = bytes(1000, 3);
        let whole = partial_sum(&b, 0);
        for cut in [0, 8, 64, 496, 992] {
            let (a, c) = b.split_at(cut);
            assert_eq!(partial_sum(a, 0).wrapping_add(partial_sum(c, cut as u64 / 8)), whole, "cut at {cut}");
        }
    }

    #[test]
    fn one_changed_bit_or_swapped_words_or_another_length_change_the_checksum() {
        let b = bytes(4096, 7);
        let sum = kv_checksum(&b);
        for at in [0, 1, 7, 8, 2047, 4095] {
            for bit in 0..8 {
                let mut c = b.clone();
                c[at] ^= 1 << bit;
                assert_ne!(kv_checksum(&c), sum, "byte {at} bit {bit}");
            }
        }
        let mut swapped = b.clone();
        swapped[..8].copy_from_slice(&b[8..16]);
        swapped[8..16].copy_from_slice(&b[..8]);
        assert_ne!(kv_checksum(&swapped), sum, "two words swapped");
        // Zero padding of the last word does not make lengths equal.
        let mut longer = b.clone();
        longer.push(0);
        assert_ne!(kv_checksum(&longer), sum);
        assert_ne!(kv_checksum(&[0u8; 64]), kv_checksum(&[0u8; 128]));
        assert_ne!(kv_checksum(&[0u8; 64]), finish(0, 64), "zero words still contribute");
    }

    #[test]
    fn matches_the_definition_word_by_word() {
        // The loop above, unrolled by four with a tail, against the plain definition.
        for len in [0, 1, 5, 8, 13, 24, 31, 32, 33, 100] {
            let b = bytes(len, len as u8);
            let mut sum = 0u64;
            for (i, w) in b.chunks(8).enumerate() {
                let mut word = [0u8; 8];
                word[..w.len()].copy_from_slice(w);
                sum = sum.wrapping_add(word_term(u64::from_le_bytes(word), i as u64));
            }
            assert_eq!(kv_checksum(&b), finish(sum, len), "len {len}");
        }
    }
}
