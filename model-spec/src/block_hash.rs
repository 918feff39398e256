//! Prefix block hashes: a chain over 128-token blocks of token ids, salted with the
//! model fingerprint, so that equal hashes mean "same model, same tokens from the
//! start of the sequence through this block". Only complete blocks are hashed.

use sha2::{Digest, Sha256};

use crate::Fingerprint;
use crate::config::BLOCK_TOKENS;

pub type BlockHash = [u8; 32];

/// Hashes of every complete block of `tokens`: `h_i = H(h_{i-1} ‖ block_i)`, with
/// `h_{-1} = H(fingerprint)`.
pub fn block_hashes(fingerprint: &Fingerprint, tokens: &[u32]) -> Vec<BlockHash> {
    let mut prev: BlockHash = Sha256::digest([b"sluice-prefix-v1\0".as_slice(), &fingerprint.0].concat()).into();
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            let mut h = Sha256::new();
            h.update(prev);
            for t in block {
                h.update(t.to_le_bytes());
            }
            prev = h.finalize().into();
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_prefix_and_model() {
        let fp = Fingerprint([1; 32]);
        let a: Vec<u32> = (0..300).collect();
        let mut b = a.clone();
        b[5] = 999; // differs in block 0 only
        let ha = block_hashes(&fp, &a);
        let hb = block_hashes(&fp, &b);
        assert_eq!(ha.len(), 2, "only complete blocks");
        assert_ne!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1], "a change in block 0 changes every later hash");
        assert_eq!(block_hashes(&fp, &a[..256]), ha);
        assert_ne!(block_hashes(&Fingerprint([2; 32]), &a)[0], ha[0]);
    }
}
