//! The device abstraction the engine's forward pass is written against.
//!
//! Ops are at the granularity a GPU backend would fuse them (RMSNorm, RoPE, the mHC
//! mixing, a whole MoE block, one compressor branch, attention over window + compressed
//! entries), so a CUDA backend can implement this trait without the engine changing.
//! Activations are dense row-major f32 buffers whose shapes the caller tracks; every
//! op documents the shapes it reads and writes.

use crate::EntryDtype;
pub use crate::attention_io::{AttentionIo, OutputProjection, QueryPrep, attention_projected_apart};
pub use crate::hc_params::{HcHeadWeights, HcWeights, StreamCopies};
use crate::kv_layout::{Branch, EntryFormat, KvLayout};
use crate::plan::BatchPlan;
pub use crate::readout::{GreedyPicks, argmax, greedy_pick, log_normaliser, split_parts};
use crate::rope::RopeTable;
use crate::stored::WeightView;

/// A dense f32 matrix on the host, row-major `[rows, cols]` (torch `Linear` layout:
/// `rows` = output features).
#[derive(Clone, Debug, PartialEq)]
pub struct HostMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl HostMatrix {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(rows * cols, data.len(), "HostMatrix data does not match {rows}x{cols}");
        HostMatrix { rows, cols, data }
    }
}

/// One tensor of [`Backend::head_norm_rope2`]: `x[rows, heads, head_dim]`, its norm
/// weight (none: unweighted) and the entry format it is rounded to (none: kept f32).
pub struct HeadNormJob<'a, B: Backend + ?Sized> {
    pub x: &'a mut B::Buf,
    pub heads: usize,
    pub weight: Option<&'a B::Buf>,
    pub round: Option<&'a EntryFormat>,
}

/// [`Backend::indexer_select`] as its three ops, one call each: what backends that do not
/// fold them run (and the CUDA one where its scoring cannot take them).
#[allow(clippy::too_many_arguments)]
pub fn indexer_select_apart<B: Backend + ?Sized>(
    b: &B,
    kv: &KvView<'_, B>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    q: &mut B::Buf,
    weights: &mut B::Buf,
    heads: usize,
    top_k: usize,
    rope: &RopeTable,
    weight_scale: f32,
) -> Selection<B> {
    let dim = layout.layers[layer].spec.index_dim;
    b.rope(q, heads, dim, &plan.positions, rope, false);
    b.scale(weights, weight_scale);
    b.index_topk(kv, layout, layer, plan, q, weights, heads, top_k)
}

impl<B: Backend + ?Sized> HeadNormJob<'_, B> {
    /// This tensor's [`Backend::head_norm_rope`] on `b`.
    pub fn run_alone(&mut self, b: &B, s: &HeadNormShared<'_>) {
        b.head_norm_rope(self.x, self.heads, s.head_dim, self.weight, s.eps, s.positions, s.rope, self.round);
    }
}

/// What both tensors of [`Backend::head_norm_rope2`] share: head size, norm epsilon, the
/// rows' positions and the RoPE table.
pub struct HeadNormShared<'a> {
    pub head_dim: usize,
    pub eps: f32,
    pub positions: &'a [u32],
    pub rope: &'a RopeTable,
}

/// One SwiGLU expert: `w2 · (silu(min(w1·x, limit)) * clamp(w3·x, ±limit))`.
pub struct ExpertWeights<B: Backend + ?Sized> {
    pub w1: B::Weight,
    pub w2: B::Weight,
    pub w3: B::Weight,
}

/// How a MoE layer picks its experts.
#[derive(Clone, Debug)]
pub enum Routing {
    /// Top-k of `score + bias`; the bias only selects, weights use the raw score.
    TopK { bias: Vec<f32> },
    /// Fixed table `tid2eid[token * k + j]`.
    Hash { tid2eid: Vec<u32> },
}

/// A whole MoE block: router, routed experts and shared expert.
pub struct MoeWeights<B: Backend + ?Sized> {
    /// `[n_experts, hidden]` router.
    pub gate: B::Weight,
    pub routing: Routing,
    /// The routed experts this device holds: global ids `expert_base..expert_base +
    /// experts.len()` (all of them on one device; a slice under expert parallelism,
    /// where rows routed elsewhere contribute nothing here).
    pub experts: Vec<ExpertWeights<B>>,
    /// Global id of `experts[0]`.
    pub expert_base: usize,
    pub shared: Option<ExpertWeights<B>>,
    pub top_k: usize,
    pub route_scale: f32,
    pub swiglu_limit: f32,
}

/// Parameters of one compressor branch.
pub struct CompressorParams<'a, B: Backend + ?Sized> {
    /// Learned position bias `[ratio, width]`, added to the scores (`ape`).
    pub ape: &'a B::Buf,
    /// Weighted RMSNorm over the entry.
    pub norm: &'a B::Buf,
    pub eps: f32,
    pub rope: &'a RopeTable,
}

/// The KV state of every sequence a backend serves: pages (compressed entries),
/// window rings and compressor slots (always f32), indexed by page id and state slot.
pub struct KvState<B: Backend + ?Sized> {
    pub pages: B::Kv,
    pub rings: B::Kv,
    pub comp: B::Kv,
}

impl<B: Backend + ?Sized> KvState<B> {
    pub fn view(&self) -> KvView<'_, B> {
        KvView { pages: &self.pages, rings: &self.rings, comp: &self.comp }
    }

    pub fn view_mut(&mut self) -> KvViewMut<'_, B> {
        KvViewMut { pages: &mut self.pages, rings: &mut self.rings, comp: &mut self.comp }
    }
}

/// The three KV regions as the sequence-aware ops read them. Borrowed rather than
/// owned so a backend made of several devices can hand each one its own regions.
pub struct KvView<'a, B: Backend + ?Sized> {
    pub pages: &'a B::Kv,
    pub rings: &'a B::Kv,
    pub comp: &'a B::Kv,
}

/// [`KvView`] for the ops that write entries.
pub struct KvViewMut<'a, B: Backend + ?Sized> {
    pub pages: &'a mut B::Kv,
    pub rings: &'a mut B::Kv,
    pub comp: &'a mut B::Kv,
}

impl<B: Backend + ?Sized> KvViewMut<'_, B> {
    pub fn as_view(&self) -> KvView<'_, B> {
        KvView { pages: self.pages, rings: self.rings, comp: self.comp }
    }
}

/// Host memory owned by someone else, e.g. a transport-allocated region that remote
/// peers write KV pages into.
///
/// # Safety
/// Implementors guarantee that `as_ptr()..as_ptr() + len()` is valid, writable,
/// 8-byte-aligned memory that does not move for as long as the object lives, and that
/// nothing else in this process creates Rust references to it.
pub unsafe trait ExternalMemory: Send + Sync {
    fn as_ptr(&self) -> *mut u8;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Device memory that stays allocated for as long as this handle lives: a transport
/// that reaches GPU memory (UCX with CUDA transports) registers it, and peers then put
/// bytes into it or this process puts from it, without a host copy.
///
/// # Safety
/// Implementors guarantee that `device_ptr()..device_ptr() + len()` is device memory of
/// device `ordinal()` of this process, allocated for at least as long as the handle
/// lives (a handle keeps its allocation alive, even past the storage it came from).
pub unsafe trait DeviceMemory: Send + Sync {
    fn device_ptr(&self) -> u64;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device ordinal (`cuda:N`).
    fn ordinal(&self) -> usize;
    /// Make the memory's device context current on the calling thread, for a transport
    /// about to register or read it (a thread of a worker over several GPUs may have
    /// another one current).
    fn make_current(&self) {}
}

/// A range of a KV storage to checksum: `elems` elements from element `offset`, whose
/// first byte is byte `8 · first_word` of what is being checksummed (a range may be one
/// piece of a larger whole, such as a window snapshot made of rings and compressor
/// slots).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SumRange {
    pub offset: usize,
    pub elems: usize,
    pub first_word: u64,
}

impl SumRange {
    /// A whole range (its first byte is the first of what is checksummed).
    pub fn whole(offset: usize, elems: usize) -> Self {
        SumRange { offset, elems, first_word: 0 }
    }
}

/// Selected compressed entries of a CSA layer: `[rows, top_k]` entry indices, -1 where
/// fewer entries are visible than `top_k`.
pub struct Selection<B: Backend + ?Sized> {
    pub indices: B::Idx,
    pub top_k: usize,
}

/// A pinned host region; dropping it unpins the region.
pub trait HostPin: Send + Sync {}

/// Whether a backend's decode steps replay as CUDA graphs ([`Backend::graph_health`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphHealth {
    /// Steps are recorded and replayed (false: `SLUICE_CUDA_GRAPHS=0`, or turned off after
    /// a refused capture; every op is then issued as it comes, slower at small batches).
    pub on: bool,
    /// Captures the driver refused since the backend was made (each turns graphs off).
    pub refused: u64,
}

pub trait Backend: Send + Sync + 'static {
    /// Dense f32 activations.
    type Buf: Send + Sync;
    /// A weight matrix.
    type Weight: Send + Sync;
    /// Entry storage (pages or window rings) in an [`EntryDtype`].
    type Kv: Send + Sync;
    /// Integer indices.
    type Idx: Send + Sync;
    /// An mHC site's parameters as the device keeps them ([`Backend::hc_weights`]).
    type Hc: Send + Sync;
    /// The final collapse's parameters ([`Backend::hc_head_weights`]).
    type HcHead: Send + Sync;
    /// A MoE block as the device keeps it ([`Backend::moe_weights`]).
    type Moe: Send + Sync;

    /// One line naming the device, for logs.
    fn describe(&self) -> String;

    /// Whether decode steps replay as CUDA graphs; None for a backend without them.
    fn graph_health(&self) -> Option<GraphHealth> {
        None
    }

    /// Run a whole forward step "on the device". The CPU backend moves it onto its
    /// worker pool so the many small parallel ops inside run there instead of each
    /// handing work across threads from outside.
    fn enter<R: Send, F: FnOnce() -> R + Send>(&self, f: F) -> R {
        f()
    }

    // ---- memory -------------------------------------------------------------------

    fn zeros(&self, len: usize) -> Self::Buf;
    /// A buffer whose contents are undefined, for the output of an op that writes every
    /// element (every op here does: the parity suites poison outputs to check it). On a
    /// GPU this saves the memset `zeros` issues.
    fn output(&self, len: usize) -> Self::Buf {
        self.zeros(len)
    }
    fn upload(&self, data: &[f32]) -> Self::Buf;
    fn download(&self, buf: &Self::Buf) -> Vec<f32>;
    /// `buf` read back as consecutive parts of `lens` values (a step's logits, a part a
    /// sequence; the lengths sum to the buffer's). By default one download split on the
    /// host; the CUDA backend reads straight into the parts, since one host buffer of a
    /// large batch's logits (66 MB at 128 rows) is fresh, page-faulting memory every step.
    fn download_parts(&self, buf: &Self::Buf, lens: &[usize]) -> Vec<Vec<f32>> {
        split_parts(&self.download(buf), lens)
    }
    /// Per row of `logits` (`[rows, vocab]`), the greedy token and its log-probability
    /// ([`greedy_pick`]): what a greedy sequence needs of a step, without reading its
    /// logits back. By default the rows are downloaded and picked on the host; the CUDA
    /// backend picks on the device and reads 8 bytes a row.
    fn greedy_rows(&self, logits: &Self::Buf, rows: usize, vocab: usize) -> Vec<(u32, f32)> {
        let all = self.download(logits);
        assert_eq!(all.len(), rows * vocab, "greedy rows of a buffer that is not [rows, vocab]");
        all.chunks(vocab.max(1)).map(greedy_pick).collect()
    }
    /// [`Backend::greedy_rows`] without waiting for the device where the backend can
    /// (the CUDA backend issues its kernels and returns): [`Backend::greedy_rows_finish`]
    /// reads the picks. By default the picks are made at once.
    fn greedy_rows_start(&self, logits: &Self::Buf, rows: usize, vocab: usize) -> GreedyPicks<Self::Buf> {
        GreedyPicks::Ready(self.greedy_rows(logits, rows, vocab))
    }
    /// The picks [`Backend::greedy_rows_start`] made, read back where they are still on
    /// the device (the one wait of a greedy decode step).
    fn greedy_rows_finish(&self, picks: GreedyPicks<Self::Buf>) -> Vec<(u32, f32)> {
        match picks {
            GreedyPicks::Ready(picks) => picks,
            GreedyPicks::OnDevice { buf, rows } => {
                let words = self.download(&buf);
                assert_eq!(words.len(), 2 * rows, "greedy picks buffer is not 2 values a row");
                words.chunks(2).map(|p| (p[0].to_bits(), p[1])).collect()
            }
        }
    }
    /// New buffer holding rows `rows` (each `width` long) of `src`, in that order.
    fn gather_rows(&self, src: &Self::Buf, width: usize, rows: &[usize]) -> Self::Buf;
    /// A weight as the checkpoint stores it (validated by the caller): device backends
    /// keep FP8 and FP4 in those formats, the CPU backend dequantises.
    fn weight(&self, w: WeightView<'_>) -> Self::Weight;
    /// Routed expert `expert` of `n_experts`: where expert parallelism splits the
    /// experts over devices, the one device that holds it keeps it; otherwise as
    /// [`Backend::weight`].
    fn expert_weight(&self, w: WeightView<'_>, expert: usize, n_experts: usize) -> Self::Weight {
        let _ = (expert, n_experts);
        self.weight(w)
    }
    /// Parameter bundles, once loaded, in the form the ops take (a backend over several
    /// devices splits them per device; single devices keep them as they are).
    fn hc_weights(&self, w: HcWeights<Self>) -> Self::Hc;
    fn hc_head_weights(&self, w: HcHeadWeights<Self>) -> Self::HcHead;
    fn moe_weights(&self, w: MoeWeights<Self>) -> Self::Moe;
    /// Devices the backend computes on; KV pages and state slots are split evenly
    /// between them in id order (page `p` of `n` lives on device `p / (n / ranks)`),
    /// so KV pools must be sized in multiples of it.
    fn ranks(&self) -> usize {
        1
    }
    /// The KV pools this backend's memory will hold (`pages` pages, `slots` state slots),
    /// declared before they are allocated; a backend over several devices refuses pools
    /// that do not divide evenly between them.
    fn set_kv_pools(&self, pages: usize, slots: usize) -> Result<(), String> {
        let _ = (pages, slots);
        Ok(())
    }
    /// Every weight has been handed over: wait for queued uploads and free what loading
    /// needed (a device backend's pinned staging buffers).
    fn finish_load(&self) {}
    /// A forward step over `plan` starts: the ops until [`Backend::end_step`] are one
    /// step (a CUDA backend records decode steps and replays them as graphs). Buffers
    /// made during the step must not outlive it.
    fn begin_step(&self, plan: &BatchPlan) {
        let _ = plan;
    }
    /// The step begun by [`Backend::begin_step`] has been read back.
    fn end_step(&self) {}
    /// `(rows, cols)` of a weight.
    fn weight_shape(&self, w: &Self::Weight) -> (usize, usize);

    fn kv_alloc(&self, elems: usize, dtype: EntryDtype) -> Self::Kv;
    /// Entry storage in memory someone else allocated (host memory a transport
    /// registered for remote writes). Backends that cannot use host memory say why.
    fn kv_adopt(&self, mem: Box<dyn ExternalMemory>, elems: usize, dtype: EntryDtype) -> Result<Self::Kv, String> {
        let _ = (mem, elems, dtype);
        Err(format!("the {} backend cannot use host memory for KV storage", self.describe()))
    }
    /// The storage's bytes when they live in host memory (so a transport can send
    /// them without a staging copy); `None` for device memory.
    fn kv_host_bytes<'a>(&self, kv: &'a Self::Kv) -> Option<&'a [u8]> {
        let _ = kv;
        None
    }
    /// Raw bytes of `elems` entry elements starting at element `offset`.
    fn kv_read(&self, kv: &Self::Kv, offset: usize, elems: usize) -> Vec<u8>;
    /// The same bytes straight into `out` (which must hold exactly `elems` elements): a
    /// device backend copies into caller memory without an intermediate buffer, at DMA
    /// speed when that memory is pinned ([`Backend::pin_host`]).
    fn kv_read_into(&self, kv: &Self::Kv, offset: usize, elems: usize, out: &mut [u8]) {
        out.copy_from_slice(&self.kv_read(kv, offset, elems));
    }
    /// Overwrite entry elements starting at element `offset` with raw bytes. From
    /// pinned host memory a device backend may still be reading `bytes` on return; call
    /// [`Backend::kv_fence`] before that memory changes.
    fn kv_write(&self, kv: &mut Self::Kv, offset: usize, bytes: &[u8]);
    /// Wait until every `kv_write` issued so far has read its source bytes.
    fn kv_fence(&self) {}
    /// The storage's device memory, one handle per device (a backend over several
    /// devices holds one part on each, in rank order), so a transport can register it or
    /// send from it; empty when the storage is host memory.
    fn kv_device_memory(&self, kv: &Self::Kv) -> Vec<Box<dyn DeviceMemory>> {
        let _ = kv;
        Vec::new()
    }
    /// Partial sums of the [KV checksum](crate::kv_checksum) of `ranges` of a storage
    /// ([`crate::kv_checksum::finish`] turns a whole range's sum into its checksum),
    /// computed where the bytes are: a GPU sums its own memory after the ops issued
    /// before, and nothing is copied to the host.
    fn kv_sums(&self, kv: &Self::Kv, ranges: &[SumRange]) -> Vec<u64> {
        ranges
            .iter()
            .map(|r| crate::kv_checksum::partial_sum(&self.kv_read(kv, r.offset, r.elems), r.first_word))
            .collect()
    }
    /// Wait until everything issued so far is done (device backends: before a transport
    /// reads device memory the ops wrote).
    fn synchronize(&self) {}
    /// Pin a host region for fast device copies (page-locked and mapped for the
    /// device's DMA) for as long as the returned guard lives; `None` where there is
    /// nothing to pin (host backends) or pinning failed (then copies still work, at
    /// pageable speed). The region must outlive the guard.
    fn pin_host(&self, region: &[u8]) -> Option<Box<dyn HostPin>> {
        let _ = region;
        None
    }
    /// Read `len` f32 values of an activation buffer starting at `offset`.
    fn buf_read(&self, buf: &Self::Buf, offset: usize, len: usize) -> Vec<f32>;
    fn buf_write(&self, buf: &mut Self::Buf, offset: usize, data: &[f32]);
    fn idx_download(&self, idx: &Self::Idx) -> Vec<i32>;

    // ---- branches ------------------------------------------------------------------

    /// Open a branch: the ops issued from here until [`Backend::to_main`] do not depend on
    /// those issued from there until [`Backend::join`], so a backend may run the two runs
    /// of ops at once (the CUDA backend does in the decode steps it replays as graphs: at
    /// small batches both are chains of latency-bound kernels). Neither run may read what
    /// the other writes. By default everything runs in order.
    fn fork(&self) {}
    /// The ops issued next form the branch's second run (see [`Backend::fork`]).
    fn to_main(&self) {}
    /// Close the branch: the ops issued next see both runs' results.
    fn join(&self) {}

    // ---- row-wise ops ----------------------------------------------------------------

    /// `out[r, :] = table[plan.tokens[r], :]`: the first op of a step, which lays the
    /// batch's rows out (over devices, for a backend of several).
    fn embed(&self, table: &Self::Weight, plan: &BatchPlan, out: &mut Self::Buf);
    /// `out[rows, w.rows] = x[rows, w.cols] · wᵀ`.
    fn matmul(&self, x: &Self::Buf, rows: usize, w: &Self::Weight, out: &mut Self::Buf);
    /// `outs[i][rows, ws[i].rows] = x[rows, K] · ws[i]ᵀ`: products of the same
    /// activations (a layer's projections of its hidden state). One by one by default;
    /// the CUDA backend issues few-row BF16 ones as one launch and splits x once for its
    /// cuBLAS products.
    fn matmul_many(&self, x: &Self::Buf, rows: usize, ws: &[&Self::Weight], outs: &mut [&mut Self::Buf]) {
        assert_eq!(ws.len(), outs.len(), "matmul_many needs one output per weight");
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(x, rows, w, out);
        }
    }
    /// Block-diagonal product: `x[rows, groups * w.cols]`, `w[groups * g_out, w.cols]`;
    /// group `g` of the output is `x_g · w_gᵀ`.
    fn grouped_matmul(&self, x: &Self::Buf, rows: usize, groups: usize, w: &Self::Weight, out: &mut Self::Buf);
    /// RMSNorm over consecutive runs of `dim` values, optionally scaled by `weight[dim]`.
    fn rms_norm(&self, x: &mut Self::Buf, dim: usize, weight: Option<&Self::Buf>, eps: f32);
    /// Interleaved RoPE on the last `rope.dims()` values of each head:
    /// `x[rows, heads, head_dim]`, row `r` at `positions[r]`. `inverse` rotates by the
    /// conjugate (used on the attention output).
    fn rope(
        &self,
        x: &mut Self::Buf,
        heads: usize,
        head_dim: usize,
        positions: &[u32],
        rope: &RopeTable,
        inverse: bool,
    );
    /// `x *= factor`.
    fn scale(&self, x: &mut Self::Buf, factor: f32);
    /// `acc += x`, element-wise.
    fn add_into(&self, acc: &mut Self::Buf, x: &Self::Buf);
    /// Replace each `fmt.dim`-long entry of `x` (`[rows, fmt.dim]`) by what storing it
    /// in `fmt` and reading it back gives (identity for f32; per-entry FP8 block scales
    /// for fp8), so that values used straight from activations equal the ones later
    /// read back from storage.
    fn round_to(&self, x: &mut Self::Buf, fmt: &EntryFormat);
    /// What a layer's q heads and new KV entry go through: [`Backend::rms_norm`] of each
    /// head of `x[rows, heads, head_dim]` (times `weight` when given), [`Backend::rope`]
    /// at `positions`, then [`Backend::round_to`] `round` when given. Backends may fuse
    /// them (the CUDA one does: one pass instead of three launches).
    #[allow(clippy::too_many_arguments)]
    fn head_norm_rope(
        &self,
        x: &mut Self::Buf,
        heads: usize,
        head_dim: usize,
        weight: Option<&Self::Buf>,
        eps: f32,
        positions: &[u32],
        rope: &RopeTable,
        round: Option<&EntryFormat>,
    ) {
        self.rms_norm(x, head_dim, weight, eps);
        self.rope(x, heads, head_dim, positions, rope, false);
        if let Some(fmt) = round {
            self.round_to(x, fmt);
        }
    }

    /// [`Backend::head_norm_rope`] of two tensors at the same positions with the same
    /// RoPE (a layer's q heads, then its new KV entry): `first`, then `second`. Backends
    /// may run both in one pass (the CUDA one does: one launch instead of two).
    fn head_norm_rope2(
        &self,
        first: &mut HeadNormJob<'_, Self>,
        second: &mut HeadNormJob<'_, Self>,
        shared: &HeadNormShared<'_>,
    ) {
        first.run_alone(self, shared);
        second.run_alone(self, shared);
    }

    /// mHC mixing before a sub-block. `streams[rows, hc, hidden]` →
    /// `collapsed[rows, hidden]` (input of the sub-block), `post[rows, hc]`,
    /// `comb[rows, hc, hc]` (Sinkhorn-projected). With `norm = Some((weight, eps))`,
    /// `collapsed` is then RMSNormed with that weight (the sub-block's input norm, which
    /// backends may fuse into the mixing).
    #[allow(clippy::too_many_arguments)]
    fn hc_pre(
        &self,
        streams: &Self::Buf,
        rows: usize,
        w: &Self::Hc,
        norm: Option<(&Self::Buf, f32)>,
        collapsed: &mut Self::Buf,
        post: &mut Self::Buf,
        comb: &mut Self::Buf,
    );
    /// `streams[k] ← post[k] · out + Σ_j comb[j, k] · streams[j]`, per row.
    fn hc_post(
        &self,
        streams: &mut Self::Buf,
        rows: usize,
        hc: usize,
        out: &Self::Buf,
        post: &Self::Buf,
        comb: &Self::Buf,
    );
    /// [`Backend::hc_post`] with `post` and `comb`, then [`Backend::hc_pre`] of the next
    /// sub-block (`w`, `norm`) on the updated streams into `collapsed`, `post` and `comb`
    /// (read by the first, overwritten by the second). Backends may take the next
    /// mixing product while the streams are written.
    #[allow(clippy::too_many_arguments)]
    fn hc_post_pre(
        &self,
        streams: &mut Self::Buf,
        rows: usize,
        hc: usize,
        out: &Self::Buf,
        w: &Self::Hc,
        norm: Option<(&Self::Buf, f32)>,
        collapsed: &mut Self::Buf,
        post: &mut Self::Buf,
        comb: &mut Self::Buf,
    ) {
        self.hc_post(streams, rows, hc, out, post, comb);
        self.hc_pre(streams, rows, w, norm, collapsed, post, comb);
    }
    /// [`Backend::hc_pre`] on streams that are `hc` copies of each row of `streams.x` (a
    /// step's first sub-block: every stream starts as the token's embedding), which need
    /// not be made: backends may read the rows alone, a `hc`-th of the bytes. By default
    /// the streams are made ([`StreamCopies::make`]) and [`Backend::hc_pre`] runs on them.
    fn hc_pre_copies(
        &self,
        streams: &StreamCopies<'_, Self>,
        w: &Self::Hc,
        norm: Option<(&Self::Buf, f32)>,
        collapsed: &mut Self::Buf,
        post: &mut Self::Buf,
        comb: &mut Self::Buf,
    ) {
        self.hc_pre(&streams.make(self), streams.rows, w, norm, collapsed, post, comb);
    }
    /// [`Backend::hc_post_pre`] whose streams before the update are `hc` copies of each
    /// row of `streams.x` (the first residual update of a step); returns the updated
    /// streams `[rows, hc, hidden]`. By default the copies are made first.
    #[allow(clippy::too_many_arguments)]
    fn hc_post_pre_copies(
        &self,
        streams: &StreamCopies<'_, Self>,
        out: &Self::Buf,
        w: &Self::Hc,
        norm: Option<(&Self::Buf, f32)>,
        collapsed: &mut Self::Buf,
        post: &mut Self::Buf,
        comb: &mut Self::Buf,
    ) -> Self::Buf {
        let mut made = streams.make(self);
        self.hc_post_pre(&mut made, streams.rows, streams.hc, out, w, norm, collapsed, post, comb);
        made
    }
    /// Final collapse: `out[rows, hidden] = Σ_j pre_j · streams[j]`.
    fn hc_head(&self, streams: &Self::Buf, rows: usize, w: &Self::HcHead, out: &mut Self::Buf);

    /// A MoE block on `x[rows, hidden]` (already normed); `tokens[r]` feeds hash routing.
    /// Every row is routed over all experts; the experts this device holds contribute,
    /// and the shared expert is added on `shared_rows` only (all rows on one device;
    /// under expert parallelism a device's own rows of the gathered batch).
    fn moe(
        &self,
        x: &Self::Buf,
        rows: usize,
        tokens: &[u32],
        w: &Self::Moe,
        shared_rows: std::ops::Range<usize>,
        out: &mut Self::Buf,
    );

    // ---- sequence-aware ops -------------------------------------------------------

    /// Feed one compressor branch of `layer` with this batch's projections
    /// (`kv`, `score` of `[rows, layout.comp_width]`), emitting every entry a window
    /// completes into the sequence's page (normed, roped at position `ratio·i`).
    #[allow(clippy::too_many_arguments)]
    fn compress(
        &self,
        kv: &mut KvViewMut<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        branch: Branch,
        plan: &BatchPlan,
        proj_kv: &Self::Buf,
        proj_score: &Self::Buf,
        p: &CompressorParams<'_, Self>,
    );

    /// Lightning-indexer selection for a CSA layer: `q[rows, heads, index_dim]`
    /// (roped), `weights[rows, heads]` (already scaled). Per row, scores every visible
    /// indexer key `Σ_h w_h · relu(q_h · k)` and keeps the `top_k` best.
    #[allow(clippy::too_many_arguments)]
    fn index_topk(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &Self::Buf,
        weights: &Self::Buf,
        heads: usize,
        top_k: usize,
    ) -> Selection<Self>;

    /// A CSA layer's indexer from its projections: `q[rows, heads, index_dim]` rotated by
    /// [`Backend::rope`] with `rope` at the rows' positions, the head weights times
    /// `weight_scale` ([`Backend::scale`]), then [`Backend::index_topk`]. `q` and `weights`
    /// are used up (what they hold afterwards is unspecified): a backend may fold the
    /// rotation and the scale into the scoring (the CUDA one does: two launches fewer on
    /// a decode step's longest chain).
    #[allow(clippy::too_many_arguments)]
    fn indexer_select(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &mut Self::Buf,
        weights: &mut Self::Buf,
        heads: usize,
        top_k: usize,
        rope: &RopeTable,
        weight_scale: f32,
    ) -> Selection<Self> {
        indexer_select_apart(self, kv, layout, layer, plan, q, weights, heads, top_k, rope, weight_scale)
    }

    /// Attention of `q[rows, heads, head_dim]` over each row's window (ring entries
    /// before this step, `new_kv[rows, head_dim]` for this step's tokens) and its
    /// compressed entries (all visible ones for HCA, `selected` for CSA), with one
    /// softmax whose denominator also holds `exp(sinks[h])`. Keys are values.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &Self::Buf,
        new_kv: &Self::Buf,
        selected: Option<&Selection<Self>>,
        sinks: &Self::Buf,
        heads: usize,
        scale: f32,
        out: &mut Self::Buf,
    );

    /// Whether [`Backend::attention_of_raw_query`] folds the query's head norm and RoPE
    /// into this batch's attention (where it reads the query anyway) instead of running
    /// them first; callers then leave the query raw. Default: never.
    fn attention_preps_query(&self, _layout: &KvLayout, _layer: usize, _plan: &BatchPlan, _heads: usize) -> bool {
        false
    }

    /// [`Backend::attention`] of a query not yet head-normed and rotated: what
    /// `head_norm_rope(q, heads, head_dim, None, prep.eps, positions, prep.rope, None)`
    /// would do to it first (and here does, unless the backend folds it in: see
    /// [`Backend::attention_preps_query`]). `q` may be left either way.
    #[allow(clippy::too_many_arguments)]
    fn attention_of_raw_query(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &mut Self::Buf,
        new_kv: &Self::Buf,
        selected: Option<&Selection<Self>>,
        sinks: &Self::Buf,
        heads: usize,
        scale: f32,
        prep: &QueryPrep<'_>,
        out: &mut Self::Buf,
    ) {
        let head_dim = layout.layers[layer].spec.head_dim;
        self.head_norm_rope(q, heads, head_dim, None, prep.eps, &plan.positions, prep.rope, None);
        self.attention(kv, layout, layer, plan, q, new_kv, selected, sinks, heads, scale, out);
    }

    /// The attention sub-block from the query to its output: [`Backend::attention`] (or
    /// [`Backend::attention_of_raw_query`] with `io.prep`), the output rotated back at the
    /// rows' positions (inverse RoPE from `proj.rope`: K = V carried the rotation into
    /// it), `grouped_matmul(.., proj.groups, proj.wo_a)`, then `matmul(.., proj.wo_b)`
    /// into `out`. A backend may keep what passes between them in its products' input
    /// format instead of f32 (the CUDA one: bf16 rows straight from its prefill kernel,
    /// and `wo_a`'s output in bf16 for `wo_b`).
    #[allow(clippy::too_many_arguments)]
    fn attention_projected(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        io: AttentionIo<'_, Self>,
        proj: &OutputProjection<'_, Self>,
        out: &mut Self::Buf,
    ) {
        attention_projected_apart(self, kv, layout, layer, plan, io, proj, out)
    }

    /// Write this step's window entries into each sequence's ring.
    fn store_window(
        &self,
        kv: &mut KvViewMut<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        new_kv: &Self::Buf,
    );
}
