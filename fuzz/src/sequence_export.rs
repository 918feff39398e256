//! A sequence's KV export (`engine/src/kv/export.rs`) imported into an engine's KV
//! memory, as a decode worker imports bytes another process exported.
//!
//! Asserts: import never panics; an accepted export gives a sequence whose pages hold
//! exactly its tokens (`pages == ceil(tokens / block)`), takes exactly those pages and
//! one slot, and exports back to the same bytes (padding aside); a refused export takes nothing from
//! the pools (no pages or slot leak). The first byte picks the KV dtype and whether the
//! rest is raw bytes or a real export of `n` tokens with its token and page counts
//! overwritten (so the fields behind magic, version and fingerprint are reached).

use engine::kv::KvCache;
use engine::{CpuBackend, EntryDtype, Fingerprint};
use kernels::{AttnKind, Backend, KvLayout, LayerSpec};

/// Offsets of the token and page counts in the export header.
const TOKENS_AT: usize = 56;
const PAGES_AT: usize = 64;
const HEADER_LEN: usize = 92;
/// The header's padding after the dtype code.
const PAD: std::ops::Range<usize> = 45..48;
const MAX_PAGES: usize = 4;

pub fn layout(dtype: EntryDtype) -> KvLayout {
    let specs = [
        LayerSpec { kind: AttnKind::Window, ratio: 0, head_dim: 16, index_dim: 0, rope_dim: 8 },
        LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: 16, index_dim: 8, rope_dim: 8 },
        LayerSpec { kind: AttnKind::Hca, ratio: 32, head_dim: 16, index_dim: 0, rope_dim: 8 },
    ];
    KvLayout::new(128, 8, dtype, &specs)
}

pub fn fingerprint() -> Fingerprint {
    Fingerprint([0x5e; 32])
}

pub fn cache(dtype: EntryDtype) -> KvCache<CpuBackend> {
    KvCache::new(&CpuBackend::new(), layout(dtype), MAX_PAGES, 2)
}

/// The export of a sequence of `tokens` tokens whose KV bytes follow `salt`: the engine's
/// export of an open sequence (header, rings, compressor slots) with the token and page
/// counts set and the pages spliced in after the header, as the documented layout has it.
pub fn export(dtype: EntryDtype, tokens: usize, salt: u8) -> Vec<u8> {
    let b = CpuBackend::new();
    let mut kv = cache(dtype);
    let seq = kv.open().expect("a slot");
    let l = kv.layout.clone();
    let fill = |n: usize, k: usize| -> Vec<u8> { (0..n).map(|i| (i * 31 + k) as u8 ^ salt).collect() };
    b.kv_write(&mut kv.state.rings, seq.slot() * l.ring_elems, &fill(l.ring_elems * dtype.size(), 7));
    b.kv_write(&mut kv.state.comp, seq.slot() * l.comp_elems, &fill(l.comp_elems * 4, 9));
    let mut bytes = kv.export(&b, &seq, &fingerprint());
    let pages = tokens.div_ceil(l.block);
    bytes[TOKENS_AT..TOKENS_AT + 8].copy_from_slice(&(tokens as u64).to_le_bytes());
    bytes[PAGES_AT..PAGES_AT + 4].copy_from_slice(&(pages as u32).to_le_bytes());
    let body: Vec<u8> = (0..pages).flat_map(|p| fill(l.page_bytes(), p)).collect();
    bytes.splice(HEADER_LEN..HEADER_LEN, body);
    bytes
}

pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let dtype = [EntryDtype::F32, EntryDtype::Bf16, EntryDtype::Fp8][(mode >> 1) as usize % 3];
    let bytes = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let (Some(&n), Some(tokens), Some(pages)) = (rest.first(), rest.get(1..9), rest.get(9..13)) else { return };
        let mut bytes = export(dtype, n as usize % (MAX_PAGES * 128 + 1), n);
        bytes[TOKENS_AT..TOKENS_AT + 8].copy_from_slice(tokens);
        if rest.len() > 13 {
            bytes[PAGES_AT..PAGES_AT + 4].copy_from_slice(pages);
        }
        bytes
    };
    check(dtype, &bytes);
}

fn check(dtype: EntryDtype, bytes: &[u8]) {
    let b = CpuBackend::new();
    let mut kv = cache(dtype);
    let before = kv.stats();
    match kv.import(&b, bytes, &fingerprint()) {
        Ok(seq) => {
            assert_eq!(
                seq.pages().len(),
                seq.len().div_ceil(kv.layout.block),
                "an imported sequence's pages hold its tokens"
            );
            let taken = kv.stats();
            assert_eq!(taken.pages_used, before.pages_used + seq.pages().len());
            assert_eq!(taken.slots_used, before.slots_used + 1);
            let again = kv.export(&b, &seq, &fingerprint());
            // The three pad bytes after the dtype are not read (nor checked): ignore them.
            let same = again.len() == bytes.len()
                && again[..PAD.start] == bytes[..PAD.start]
                && again[PAD.end..] == bytes[PAD.end..];
            assert!(same, "an accepted export exports back to the same bytes");
            kv.release(seq);
            assert_eq!(kv.stats(), before);
        }
        Err(e) => {
            assert!(!e.to_string().is_empty());
            assert_eq!(kv.stats(), before, "a refused import takes no pages or slot");
        }
    }
}
