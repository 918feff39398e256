//! Geometry of the hybrid KV state: where each layer's entries live inside a page
//! (one 128-token block of one sequence, all layers) and inside a state-cache slot
//! (one running sequence's window rings and compressor slots).
//!
//! The layout is plain data so every backend, the transfer layer and the kvstore
//! agree on byte offsets without sharing code paths.

/// How KV entries (pages and window rings) are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EntryDtype {
    F32,
    Bf16,
    /// The reference's serving format: each entry is one byte record (see
    /// [`EntryFormat`]) of FP8 e4m3 codes with power-of-two block scales, its RoPE
    /// tail in BF16. Storage "elements" are bytes.
    Fp8,
}

impl EntryDtype {
    pub const ALL: [EntryDtype; 3] = [EntryDtype::F32, EntryDtype::Bf16, EntryDtype::Fp8];

    /// Bytes of one storage element: a value for f32/bf16, a byte of a record for fp8.
    pub fn size(self) -> usize {
        match self {
            EntryDtype::F32 => 4,
            EntryDtype::Bf16 => 2,
            EntryDtype::Fp8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EntryDtype::F32 => "f32",
            EntryDtype::Bf16 => "bf16",
            EntryDtype::Fp8 => "fp8",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" | "float32" => Some(EntryDtype::F32),
            "bf16" | "bfloat16" => Some(EntryDtype::Bf16),
            "fp8" | "fp8_e4m3" => Some(EntryDtype::Fp8),
            _ => None,
        }
    }

    /// `--kv-dtype` of every command and worker: the dtype, or a message naming the choices.
    pub fn parse_arg(s: &str) -> Result<Self, String> {
        Self::parse(s).ok_or_else(|| format!("`{s}` is not a KV dtype; use f32, bf16 or fp8"))
    }
}

/// Dims that share one power-of-two scale in an FP8 entry.
pub const FP8_SCALE_BLOCK: usize = 64;

/// How one entry of `dim` values is stored. For f32/bf16 an entry is `dim` elements.
/// For fp8 it is a byte record (the reference's serving format):
/// 1. `dim - tail` FP8 e4m3fn codes, each its value divided by its block's scale
///    (blocks of [`FP8_SCALE_BLOCK`] dims from dim 0; the last may be partial);
/// 2. `tail` BF16 values, little endian (the RoPE dims, which FP8 would blur);
/// 3. one ue8m0 scale byte per block (`2^(b-127)`);
/// 4. zero padding to a multiple of 8 bytes, so every record starts 8-byte aligned.
///
/// V4: main entries 448 + 2·64 + 7 = 583 → 584 bytes; indexer keys 128 + 2 → 136.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryFormat {
    pub dtype: EntryDtype,
    pub dim: usize,
    /// Trailing dims kept in BF16 by fp8 (the RoPE dims of main entries, 0 for
    /// indexer keys); ignored by f32/bf16.
    pub tail: usize,
}

impl EntryFormat {
    /// FP8-coded dims.
    pub fn fp8_dims(&self) -> usize {
        self.dim - self.tail
    }

    /// Scale bytes of an fp8 record.
    pub fn scales(&self) -> usize {
        self.fp8_dims().div_ceil(FP8_SCALE_BLOCK)
    }

    /// Byte offset of the BF16 tail inside an fp8 record.
    pub fn tail_offset(&self) -> usize {
        self.fp8_dims()
    }

    /// Byte offset of the scale bytes inside an fp8 record.
    pub fn scale_offset(&self) -> usize {
        self.fp8_dims() + 2 * self.tail
    }

    /// Storage elements of one entry (bytes of a record for fp8).
    pub fn stride(&self) -> usize {
        match self.dtype {
            EntryDtype::F32 | EntryDtype::Bf16 => self.dim,
            EntryDtype::Fp8 => (self.scale_offset() + self.scales()).next_multiple_of(8),
        }
    }

    /// Bytes of one entry.
    pub fn bytes(&self) -> usize {
        self.stride() * self.dtype.size()
    }
}

/// Which attention a layer runs; fixed by its compression ratio (0, 4 or 128 in V4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttnKind {
    /// Sliding window only (ratio 0).
    Window,
    /// Compressed sparse attention: overlapping compressor + lightning indexer top-k.
    Csa,
    /// Heavily compressed attention: non-overlapping compressor, every entry visible.
    Hca,
}

impl AttnKind {
    pub fn name(self) -> &'static str {
        match self {
            AttnKind::Window => "window",
            AttnKind::Csa => "csa",
            AttnKind::Hca => "hca",
        }
    }
}

/// What a layer needs stored, as the model config describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub kind: AttnKind,
    /// Raw tokens per compressed entry (0 for window-only layers).
    pub ratio: usize,
    /// Dimension of a KV entry (window and compressed entries alike).
    pub head_dim: usize,
    /// Dimension of an indexer key (CSA only; 0 otherwise).
    pub index_dim: usize,
    /// Trailing RoPE dims of a KV entry (fp8 storage keeps them in BF16).
    pub rope_dim: usize,
}

/// The two compressors a CSA layer runs (HCA layers only have `Main`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Branch {
    Main,
    Indexer,
}

/// One layer's offsets. Page and ring offsets are in storage elements (bytes for
/// fp8); compressor offsets are in f32 elements of the slot's compressor region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerKv {
    pub spec: LayerSpec,
    /// How a main entry (compressed or window) is stored.
    pub main: EntryFormat,
    /// How an indexer key is stored (dim 0 outside CSA layers).
    pub index: EntryFormat,
    pub page_main: usize,
    pub page_index: usize,
    pub ring: usize,
    pub comp_main: usize,
    pub comp_index: usize,
}

impl LayerKv {
    pub fn kind(&self) -> AttnKind {
        self.spec.kind
    }

    /// Compressed entries of this layer in one page (one block of raw tokens).
    pub fn entries_per_page(&self, block: usize) -> usize {
        match self.spec.kind {
            AttnKind::Window => 0,
            _ => block / self.spec.ratio,
        }
    }

    /// Entry dimension of a compressor branch.
    pub fn branch_dim(&self, branch: Branch) -> usize {
        match branch {
            Branch::Main => self.spec.head_dim,
            Branch::Indexer => self.spec.index_dim,
        }
    }

    /// How a branch's entries are stored.
    pub fn format(&self, branch: Branch) -> EntryFormat {
        match branch {
            Branch::Main => self.main,
            Branch::Indexer => self.index,
        }
    }

    /// Storage elements from one entry of a branch to the next (pages and rings).
    pub fn stride(&self, branch: Branch) -> usize {
        self.format(branch).stride()
    }

    /// Element offset of a branch's entries inside a page.
    pub fn page_offset(&self, branch: Branch) -> usize {
        match branch {
            Branch::Main => self.page_main,
            Branch::Indexer => self.page_index,
        }
    }

    /// Raw-token slots the compressor keeps: the current window, plus the previous one
    /// for CSA because entry i mixes windows i-1 and i.
    pub fn comp_slots(&self) -> usize {
        match self.spec.kind {
            AttnKind::Window => 0,
            AttnKind::Csa => 2 * self.spec.ratio,
            AttnKind::Hca => self.spec.ratio,
        }
    }

    /// Per-token width of what a compressor branch stores (kv, and the same again for
    /// scores): CSA tokens carry two series (next window's and current window's).
    pub fn comp_width(&self, branch: Branch) -> usize {
        let dim = self.branch_dim(branch);
        match self.spec.kind {
            AttnKind::Csa => 2 * dim,
            _ => dim,
        }
    }

    /// f32 offset of a branch's compressor region (kv slots, then score slots).
    pub fn comp_offset(&self, branch: Branch) -> usize {
        match branch {
            Branch::Main => self.comp_main,
            Branch::Indexer => self.comp_index,
        }
    }
}

/// Byte sizes of one block's worth of KV, split by pool as operators see them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolBytes {
    pub csa_main: usize,
    pub csa_index: usize,
    pub hca: usize,
}

/// The full layout table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Raw tokens per page (lcm of the compression ratios; 128 for V4).
    pub block: usize,
    /// Sliding window length (current token and the ones before it).
    pub window: usize,
    pub dtype: EntryDtype,
    /// Storage elements per page (bytes for fp8).
    pub page_elems: usize,
    /// Storage elements of window rings per state slot.
    pub ring_elems: usize,
    /// f32 elements of compressor slots per state slot.
    pub comp_elems: usize,
    /// The leading part of a slot's compressor elements that carries state across a
    /// block boundary (CSA slots); the rest (HCA slots) is dead at every boundary.
    pub comp_carry_elems: usize,
    pub layers: Vec<LayerKv>,
}

impl KvLayout {
    pub fn new(block: usize, window: usize, dtype: EntryDtype, specs: &[LayerSpec]) -> Self {
        let mut page = 0;
        let mut ring = 0;
        let mut layers = Vec::with_capacity(specs.len());
        for spec in specs {
            assert!(spec.rope_dim <= spec.head_dim, "rope dims {} exceed head_dim {}", spec.rope_dim, spec.head_dim);
            // fp8 records put the BF16 tail right after the codes: keep it 2-byte aligned
            // (RoPE dims come in pairs, so V4-style entries always are).
            assert!(
                dtype != EntryDtype::Fp8 || (spec.head_dim - spec.rope_dim).is_multiple_of(2),
                "fp8 entries need an even count of FP8 dims (head_dim {} - rope dims {})",
                spec.head_dim,
                spec.rope_dim
            );
            let main = EntryFormat { dtype, dim: spec.head_dim, tail: spec.rope_dim };
            let index = EntryFormat { dtype, dim: spec.index_dim, tail: 0 };
            let mut lk =
                LayerKv { spec: *spec, main, index, page_main: 0, page_index: 0, ring, comp_main: 0, comp_index: 0 };
            ring += window * main.stride();
            if spec.kind != AttnKind::Window {
                lk.page_main = page;
                page += (block / spec.ratio) * main.stride();
            }
            if spec.kind == AttnKind::Csa {
                lk.page_index = page;
                page += (block / spec.ratio) * index.stride();
            }
            layers.push(lk);
        }
        // Compressor slots: every CSA layer's first, then every HCA layer's. At a block
        // boundary only the CSA slots carry state forward (the previous window feeds the
        // next entry; an HCA window is complete and its slots are all rewritten before
        // they are read again), so a state snapshot is the rings plus this prefix.
        let mut comp = 0;
        for kind in [AttnKind::Csa, AttnKind::Hca] {
            for lk in layers.iter_mut().filter(|l| l.spec.kind == kind) {
                lk.comp_main = comp;
                comp += 2 * lk.comp_slots() * lk.comp_width(Branch::Main);
                if kind == AttnKind::Csa {
                    lk.comp_index = comp;
                    comp += 2 * lk.comp_slots() * lk.comp_width(Branch::Indexer);
                }
            }
        }
        let comp_carry_elems = layers
            .iter()
            .filter(|l| l.spec.kind == AttnKind::Csa)
            .map(|l| 2 * l.comp_slots() * (l.comp_width(Branch::Main) + l.comp_width(Branch::Indexer)))
            .sum();
        KvLayout {
            block,
            window,
            dtype,
            page_elems: page,
            ring_elems: ring,
            comp_elems: comp,
            comp_carry_elems,
            layers,
        }
    }

    pub fn page_bytes(&self) -> usize {
        self.page_elems * self.dtype.size()
    }

    /// Bytes of one state-cache slot: window rings in the entry dtype, compressor
    /// slots in f32 (they accumulate softmax inputs; rounding them would make chunked
    /// prefill drift from one-shot prefill).
    pub fn state_bytes(&self) -> usize {
        self.ring_elems * self.dtype.size() + self.comp_elems * 4
    }

    /// Page bytes split into the pools operators watch.
    pub fn pool_bytes_per_block(&self) -> PoolBytes {
        let mut p = PoolBytes::default();
        for l in &self.layers {
            let n = l.entries_per_page(self.block);
            match l.kind() {
                AttnKind::Window => {}
                AttnKind::Csa => {
                    p.csa_main += n * l.main.bytes();
                    p.csa_index += n * l.index.bytes();
                }
                AttnKind::Hca => p.hca += n * l.main.bytes(),
            }
        }
        p
    }

    /// Window-ring bytes per state slot (the SWA state the kvstore policies are about).
    pub fn window_bytes(&self) -> usize {
        self.ring_elems * self.dtype.size()
    }

    /// Bytes of the state a sequence carries across a block boundary: its window rings
    /// and the CSA compressor slots. Restoring these (plus the pages before the
    /// boundary) into a fresh slot resumes the sequence exactly.
    pub fn snapshot_bytes(&self) -> usize {
        self.window_bytes() + self.comp_carry_elems * 4
    }

    /// Keys the token at position `t` attends to in layer `layer`: its window (itself
    /// and up to `window - 1` tokens before it) and the compressed entries it sees
    /// (entry i summarises tokens up to `ratio·(i+1) - 1`): all of them in an HCA layer,
    /// the indexer's `top_k` at most in a CSA layer. What attention's FLOPs are counted
    /// over (`sluice bench engine`).
    pub fn attended_keys(&self, layer: usize, t: usize, top_k: usize) -> usize {
        let spec = &self.layers[layer].spec;
        let window = (t + 1).min(self.window);
        let visible = (t + 1).checked_div(spec.ratio).unwrap_or(0);
        window
            + match spec.kind {
                AttnKind::Window => 0,
                AttnKind::Hca => visible,
                AttnKind::Csa => visible.min(top_k),
            }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The window grows to its length, an HCA layer sees every finished entry, a CSA
    /// layer at most its top-k of them.
    #[test]
    fn attended_keys_count_the_window_and_the_entries_seen() {
        let layout = KvLayout::new(128, 128, EntryDtype::Bf16, &flash_like());
        let (w, c, h) = (0, 2, layout.layers.iter().position(|l| l.kind() == AttnKind::Hca).expect("an HCA layer"));
        assert_eq!(layout.attended_keys(w, 0, 512), 1);
        assert_eq!(layout.attended_keys(w, 5000, 512), 128);
        assert_eq!(layout.attended_keys(c, 2, 512), 3);
        assert_eq!(layout.attended_keys(c, 3, 512), 4 + 1);
        assert_eq!(layout.attended_keys(c, 2047, 512), 128 + 512);
        assert_eq!(layout.attended_keys(c, 8191, 512), 128 + 512);
        assert_eq!(layout.attended_keys(c, 8191, 4096), 128 + 2048);
        assert_eq!(layout.attended_keys(h, 126, 512), 127);
        assert_eq!(layout.attended_keys(h, 127, 512), 128 + 1);
        assert_eq!(layout.attended_keys(h, 8191, 512), 128 + 64);
    }

    fn flash_like() -> Vec<LayerSpec> {
        let w = LayerSpec { kind: AttnKind::Window, ratio: 0, head_dim: 512, index_dim: 0, rope_dim: 64 };
        let c = LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: 512, index_dim: 128, rope_dim: 64 };
        let h = LayerSpec { kind: AttnKind::Hca, ratio: 128, head_dim: 512, index_dim: 0, rope_dim: 64 };
        let mut v = vec![w, w];
        for _ in 0..20 {
            v.push(c);
            v.push(h);
        }
        v.push(c);
        v
    }

    #[test]
    fn flash_geometry_matches_design_numbers() {
        let layout = KvLayout::new(128, 128, EntryDtype::Bf16, &flash_like());
        let pools = layout.pool_bytes_per_block();
        // 21 CSA layers x 32 entries x 512 dims x 2 bytes; indexer 128 dims; 20 HCA x 1 entry.
        assert_eq!(pools.csa_main, 21 * 32 * 512 * 2);
        assert_eq!(pools.csa_index, 21 * 32 * 128 * 2);
        assert_eq!(pools.hca, 20 * 512 * 2);
        assert_eq!(layout.page_bytes(), pools.csa_main + pools.csa_index + pools.hca);
        // Window state: 43 layers x 128 entries x 512 dims: ~8x the compressed bytes per block.
        assert_eq!(layout.window_bytes(), 43 * 128 * 512 * 2);
        let ratio = layout.window_bytes() as f64 / layout.page_bytes() as f64;
        assert!(ratio > 5.0 && ratio < 10.0, "window/compressed ratio {ratio}");
    }

    #[test]
    fn csa_compressor_slots_come_first_and_form_the_carried_state() {
        let layout = KvLayout::new(128, 128, EntryDtype::Bf16, &flash_like());
        for l in &layout.layers {
            match l.kind() {
                AttnKind::Csa => {
                    assert!(l.comp_main < layout.comp_carry_elems && l.comp_index < layout.comp_carry_elems)
                }
                AttnKind::Hca => assert!(l.comp_main >= layout.comp_carry_elems),
                AttnKind::Window => {}
            }
        }
        // 21 CSA layers x 2 (kv, score) x 8 slots x (2*512 + 2*128) f32.
        assert_eq!(layout.comp_carry_elems, 21 * 2 * 8 * (1024 + 256));
        assert_eq!(layout.snapshot_bytes(), layout.window_bytes() + layout.comp_carry_elems * 4);
        assert!(layout.comp_carry_elems < layout.comp_elems / 4, "HCA tails dominate the slot");
    }

    #[test]
    fn offsets_do_not_overlap() {
        for dtype in EntryDtype::ALL {
            let layout = KvLayout::new(128, 128, dtype, &flash_like());
            let mut spans = Vec::new();
            for l in &layout.layers {
                let n = l.entries_per_page(128);
                if l.kind() != AttnKind::Window {
                    spans.push((l.page_main, l.page_main + n * l.stride(Branch::Main)));
                }
                if l.kind() == AttnKind::Csa {
                    spans.push((l.page_index, l.page_index + n * l.stride(Branch::Indexer)));
                }
            }
            spans.sort();
            for w in spans.windows(2) {
                assert!(w[0].1 <= w[1].0, "overlapping page spans {:?} ({})", w, dtype.name());
            }
            assert_eq!(spans.last().unwrap().1, layout.page_elems);
        }
    }

    #[test]
    fn fp8_records_match_the_reference_serving_format() {
        // V4: 448 FP8 codes + 64 BF16 rope dims + 7 scales = 583, padded to 584 bytes;
        // indexer keys 128 codes + 2 scales = 130, padded to 136.
        let main = EntryFormat { dtype: EntryDtype::Fp8, dim: 512, tail: 64 };
        assert_eq!((main.tail_offset(), main.scale_offset(), main.scales(), main.stride()), (448, 576, 7, 584));
        let index = EntryFormat { dtype: EntryDtype::Fp8, dim: 128, tail: 0 };
        assert_eq!((index.scale_offset(), index.scales(), index.stride()), (128, 2, 136));
        // Tiny test models: 16 codes in one partial block, 16 BF16 dims, 1 scale.
        let tiny = EntryFormat { dtype: EntryDtype::Fp8, dim: 32, tail: 16 };
        assert_eq!((tiny.scale_offset(), tiny.stride()), (48, 56));
        for dtype in [EntryDtype::F32, EntryDtype::Bf16] {
            let f = EntryFormat { dtype, ..main };
            assert_eq!((f.stride(), f.bytes()), (512, 512 * dtype.size()));
        }

        let bf16 = KvLayout::new(128, 128, EntryDtype::Bf16, &flash_like());
        let fp8 = KvLayout::new(128, 128, EntryDtype::Fp8, &flash_like());
        let pools = fp8.pool_bytes_per_block();
        assert_eq!(pools.csa_main, 21 * 32 * 584);
        assert_eq!(pools.csa_index, 21 * 32 * 136);
        assert_eq!(pools.hca, 20 * 584);
        assert_eq!(fp8.page_bytes(), pools.csa_main + pools.csa_index + pools.hca);
        assert_eq!(fp8.window_bytes(), 43 * 128 * 584);
        // Compressor slots stay f32 whatever the entry dtype.
        assert_eq!(fp8.comp_elems, bf16.comp_elems);
        assert_eq!(fp8.state_bytes(), fp8.window_bytes() + fp8.comp_elems * 4);
        for l in &fp8.layers {
            assert_eq!(l.ring % 8, 0, "ring records stay 8-byte aligned");
            assert_eq!((l.page_main % 8, l.page_index % 8), (0, 0), "page records stay 8-byte aligned");
        }
    }
}
