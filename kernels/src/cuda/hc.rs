//! mHC on the GPU: the mixing product runs on the raw streams (the unweighted RMSNorm
//! is one scalar per row, applied by the finishing kernel), then one block per row does
//! the sigmoids and the collapse, and for decode-sized batches a second block per row
//! the Sinkhorn projection (else the first block's first warp does it). The product runs
//! in `mix_rows` (few outputs, long rows, K split over blocks when rows are few) from 2
//! to 64 rows, in the gemv at one row, and through `matmul` (cuBLAS) for prefill-sized
//! batches — where the residual update comes first (`hc_post_pre`), in the same pass over
//! the streams as the update (`hc_post_mix` for decode rows, `hc_post_mix_rows` for a
//! prefill's).

use cudarc::driver::DeviceRepr;

use super::CudaBackend;
use super::matmul::{GEMV_MAX_ROWS, Operand, matmul};
use super::memory::{CudaBuf, WeightData};
use super::runtime::{cfg, cfg_row_cols, env_rows, launch};
use crate::backend::{HcHeadWeights, HcWeights, StreamCopies};

/// Largest number of residual streams the kernels handle.
const HC_MAX: usize = 8;

/// Mixing biases by value ((2 + hc) · hc ≤ 80).
#[repr(C)]
#[derive(Clone, Copy)]
struct F80 {
    v: [f32; 80],
}

// SAFETY: a plain #[repr(C)] float array, `struct F80` in hc.cu.
unsafe impl DeviceRepr for F80 {}

fn f80(v: &[f32]) -> F80 {
    assert!(v.len() <= 80, "mHC bias of {} values exceeds the CUDA kernels' 80", v.len());
    let mut a = F80 { v: [0.0; 80] };
    a.v[..v.len()].copy_from_slice(v);
    a
}

/// A mixing weight as the mHC kernels read it: f32 or bf16 values at a device address
/// (each kernel has a variant for either; FP8 and FP4 weights take the general paths).
#[derive(Clone, Copy)]
enum MixWeight {
    F32(u64),
    Bf16(u64),
}

impl MixWeight {
    fn of(g: &super::runtime::Gpu, w: &super::CudaWeight) -> Option<MixWeight> {
        match &w.data {
            WeightData::F32(d) => Some(MixWeight::F32(g.ptr(d))),
            WeightData::Bf16(d) => Some(MixWeight::Bf16(g.ptr(d))),
            WeightData::Fp8 { .. } | WeightData::Fp4 { .. } => None,
        }
    }

    /// The kernel of `pair` (f32 variant, bf16 variant) for this weight, and its address.
    fn kernel(self, (f32_kernel, bf16_kernel): (&'static str, &'static str)) -> (&'static str, u64) {
        match self {
            MixWeight::F32(p) => (f32_kernel, p),
            MixWeight::Bf16(p) => (bf16_kernel, p),
        }
    }
}

/// Outputs the many-row mixing kernel handles (`MAXN` in hc.cu).
const MIX_ROWS_MAX_N: usize = 24;
/// Rows per block of that kernel (`ROWS` in hc.cu).
const MIX_ROWS_PER_BLOCK: usize = 4;

fn mix(b: &CudaBackend, streams: &CudaBuf, rows: usize, w: &super::CudaWeight) -> CudaBuf {
    let out = b.alloc_buf(rows * w.rows);
    let g = &b.gpu;
    let kernel = MixWeight::of(g, w).map(|m| m.kernel(("mix_rows_f32", "mix_rows_bf16")));
    if (mix_rows_from()..=mix_rows_upto()).contains(&rows)
        && w.rows <= MIX_ROWS_MAX_N
        && let Some((name, wp)) = kernel
    {
        g.traffic.add_weights(w.device_bytes());
        let row_blocks = rows.div_ceil(MIX_ROWS_PER_BLOCK);
        let parts = mix_rows_parts(g.sms, row_blocks, w.cols);
        let (partials, tickets) = if parts > 1 {
            (g.scratch("mix_partials", parts * rows * w.rows), g.scratch("mix_tickets", row_blocks))
        } else {
            (0, 0)
        };
        launch!(
            g,
            name,
            cfg((row_blocks as u32, parts as u32, 1), 256, 0),
            g.ptr(&out.mem),
            g.ptr(&streams.mem),
            wp,
            rows as i32,
            w.rows as i32,
            w.cols as i32,
            partials,
            tickets
        );
        return out;
    }
    let op =
        Operand { x: g.ptr(&streams.mem), x_stride: w.cols, out: g.ptr(&out.mem), out_stride: w.rows, rows, groups: 1 };
    matmul(g, op, w);
    out
}

/// Fewest rows the mixing product takes `mix_rows` for (`SLUICE_CUDA_MIX_ROWS_FROM`,
/// default 2): the gemv's blocks each read every row's 64 KiB of streams, so a batch of 8
/// took 28 µs a call with its 24 blocks; at one row the gemv is the faster.
fn mix_rows_from() -> usize {
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| env_rows("SLUICE_CUDA_MIX_ROWS_FROM").unwrap_or(2).clamp(1, GEMV_MAX_ROWS + 1))
}

/// Most rows the mixing product takes `mix_rows` for (`SLUICE_CUDA_MIX_ROWS_UPTO`, read
/// once; default 64, the largest decode batch a CUDA graph records). Each of its blocks
/// reads the whole weight (1.5 MB for V4's 24 × 16,384) for 4 rows and keeps 96
/// accumulators a thread, so a prefill's 8,192 rows took 1.26 ms a call on `flash-bench`
/// (10 of a 175 ms prefill); more rows go to `matmul`, i.e. a cuBLAS GEMM (f32 weights,
/// no TF32) or the BF16 path.
fn mix_rows_upto() -> usize {
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE.get_or_init(|| env_rows("SLUICE_CUDA_MIX_ROWS_UPTO").unwrap_or(64).max(1))
}

/// K parts of a `mix_rows` launch: enough blocks for about two an SM when the row blocks
/// are few (a decode batch), each part at least [`MIX_MIN_PART`] inputs; 1 for prefill.
fn mix_rows_parts(sms: usize, row_blocks: usize, k: usize) -> usize {
    if row_blocks >= sms {
        return 1;
    }
    (2 * sms).div_ceil(row_blocks).clamp(1, (k / MIX_MIN_PART).max(1))
}

/// Fewest inputs a `mix_rows` K part takes (two loop rounds of its 256 threads).
const MIX_MIN_PART: usize = 512;

/// Whether `hc_pre_finish` may run each row's Sinkhorn rounds in a block of their own
/// (`SLUICE_CUDA_HC_SINKHORN_BLOCK=0`, read once: in the first warp of the row's block).
/// It does for fewer rows than SMs, where the rounds held up the row's only block; a
/// prefill's blocks fill the SMs anyway, and the second block would read every row's
/// streams again for its sum of squares.
fn sinkhorn_block() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_HC_SINKHORN_BLOCK").map(|v| v != "0").unwrap_or(true))
}

/// Whether `rows` one-block-per-row blocks leave SMs idle (a decode batch), as opposed
/// to a prefill's, which fill them.
fn fewer_rows_than_sms(g: &super::runtime::Gpu, rows: usize) -> bool {
    rows < g.sms
}

/// Threads of `hc_pre_finish_rows` (`HCR_THREADS` in hc_rows.cu) and the shape it is
/// compiled for (`HCR_HC` streams of `HCR_COLS` float4 columns a thread).
const ROWS_THREADS: u32 = 256;
const ROWS_SHAPE: (usize, usize) = (4, 4 * 256 * 4);

/// Whether a prefill's `hc_pre_finish` may hold each row in its threads' registers
/// (`hc_pre_finish_rows`, V4's 4 streams × 4096): one pass over the streams where three
/// read them. `SLUICE_CUDA_HC_PRE_ROWS=0` (read once) keeps the one kernel.
fn finish_rows_takes(hc: usize, d: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_HC_PRE_ROWS").map_or(true, |v| v != "0"));
    on && (hc, d) == ROWS_SHAPE
}

/// Whether a prefill's mHC boundary takes its rows' mixing weights from
/// `hc_post_mix_rows`' part sums in a kernel of their own (`hc_weights_rows`, then
/// `hc_collapse_rows`) instead of in `hc_pre_finish_rows`' block of each row, whose norm
/// waited for the Sinkhorn rounds. `SLUICE_CUDA_HC_WEIGHTS_APART=0` (read once) keeps the
/// one kernel, to compare.
fn weights_apart() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_HC_WEIGHTS_APART").map_or(true, |v| v != "0"))
}

/// Whether a prefill's collapse also stores its normed rows in bf16 (`CudaBuf::bf16`), which
/// the sub-block's cuBLAS products read instead of rounding them again (two 128 MB
/// passes over an 8K prefill's rows a layer): with bf16 activations, unless
/// `SLUICE_CUDA_HC_ROUNDED=0` (read once).
fn collapse_rounds(g: &super::runtime::Gpu) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_HC_ROUNDED").map_or(true, |v| v != "0"));
    on && g.activations == crate::Activations::Bf16
}

/// Threads of a one-block-per-row kernel over the `hc · hidden` streams: 1,024 when the
/// rows are fewer than the SMs (a decode batch: each block reads its 64 KiB row alone,
/// bound by how many loads it has in flight), 256 otherwise.
fn row_block_threads(g: &super::runtime::Gpu, rows: usize) -> u32 {
    if fewer_rows_than_sms(g, rows) { 1024 } else { 256 }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn hc_pre(
    b: &CudaBackend,
    streams: &CudaBuf,
    rows: usize,
    w: &HcWeights<CudaBackend>,
    norm: Option<(&CudaBuf, f32)>,
    collapsed: &mut CudaBuf,
    post: &mut CudaBuf,
    comb: &mut CudaBuf,
) {
    check_pre(streams, rows, w, norm, collapsed, post, comb);
    if rows == 0 {
        return;
    }
    let m = b.prof("hc_pre: mix", || mix(b, streams, rows, &w.mix));
    finish(b, streams, false, rows, w, norm, Mixed::Product(&m), collapsed, post, comb);
}

/// [`crate::Backend::hc_pre_copies`]: a prefill's rows of V4's shape (those
/// `hc_post_mix_rows` takes) mix, weigh and collapse from each row alone
/// ([`pre_of_copies`]); other batches make the streams and take [`hc_pre`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn hc_pre_copies(
    b: &CudaBackend,
    s: &StreamCopies<'_, CudaBackend>,
    w: &HcWeights<CudaBackend>,
    norm: Option<(&CudaBuf, f32)>,
    collapsed: &mut CudaBuf,
    post: &mut CudaBuf,
    comb: &mut CudaBuf,
) {
    assert_eq!((s.hc, s.hidden), (w.hc, w.hidden), "hc_pre_copies: the streams and the mHC weights disagree");
    assert_eq!(s.x.len, s.rows * s.hidden, "hc_pre_copies: the copied rows are not [rows, hidden]");
    match copies_weight(&b.gpu, s.rows, w) {
        Some(weight) => pre_of_copies(b, s, weight, w, norm, collapsed, post, comb),
        None => hc_pre(b, &s.make(b), s.rows, w, norm, collapsed, post, comb),
    }
}

/// [`crate::Backend::hc_post_pre_copies`]: where [`hc_pre_copies`] reads the rows alone,
/// `hc_post_mix_rows` reads them for the update too, and writes the made streams.
#[allow(clippy::too_many_arguments)]
pub(crate) fn hc_post_pre_copies(
    b: &CudaBackend,
    s: &StreamCopies<'_, CudaBackend>,
    out: &CudaBuf,
    w: &HcWeights<CudaBackend>,
    norm: Option<(&CudaBuf, f32)>,
    collapsed: &mut CudaBuf,
    post: &mut CudaBuf,
    comb: &mut CudaBuf,
) -> CudaBuf {
    assert_eq!((s.hc, s.hidden), (w.hc, w.hidden), "hc_post_pre_copies: the streams and the mHC weights disagree");
    assert_eq!(s.x.len, s.rows * s.hidden, "hc_post_pre_copies: the copied rows are not [rows, hidden]");
    let Some(weight) = copies_weight(&b.gpu, s.rows, w) else {
        let mut made = s.make(b);
        hc_post_pre(b, &mut made, s.rows, s.hc, out, w, norm, collapsed, post, comb);
        return made;
    };
    let mut made = b.alloc_buf(s.rows * s.hc * s.hidden);
    post_mix_rows(b, &mut made, Some(s.x), s.rows, out, w, norm, weight, collapsed, post, comb);
    made
}

/// Whether copies of `rows` rows mix from the rows alone, with the mixing weight if so:
/// where `hc_post_mix_rows` would take the made streams (a prefill's rows, V4's shape, an
/// f32 or bf16 mixing weight) and the weights are taken apart (`hc_collapse_rows` is the
/// finish that reads copies). `SLUICE_CUDA_HC_COPIES=0` (read once) makes the streams
/// first, as before.
fn copies_weight(g: &super::runtime::Gpu, rows: usize, w: &HcWeights<CudaBackend>) -> Option<MixWeight> {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_HC_COPIES").map_or(true, |v| v != "0"));
    MixWeight::of(g, &w.mix).filter(|_| on && weights_apart() && post_pre_in_one_pass(g, rows, w))
}

/// Whether [`hc_pre_copies`] and [`hc_post_pre_copies`] of `rows` rows read the rows
/// alone (the parity suite asserts which cases do).
pub(crate) fn copies_from_rows(g: &super::runtime::Gpu, rows: usize, w: &HcWeights<CudaBackend>) -> bool {
    copies_weight(g, rows, w).is_some()
}

/// Shared memory of `hc_mix_copies_rows`: the part's summed weights, laid out as stream
/// 0's of `hc_post_mix_rows` (`HPR_KCHUNKS` 16-byte chunks).
const MIX_COPIES_SMEM: usize = (7 * POST_MIX_ROWS_COLS + POST_MIX_ROWS_COLS / 4) * 16;

/// The mixing product of copied rows from the rows alone (`hc_mix_copies_rows`: the
/// weights summed over the streams; `hc_post_mix_rows`' part sums), then the weights and
/// the collapse of the copies (`hc_weights_rows`, `hc_collapse_rows`): a quarter of the
/// bytes of the streams, which are never made (where cuBLAS's product of the streams,
/// `hc_pre_finish_rows` and the copying read or wrote them).
#[allow(clippy::too_many_arguments)]
fn pre_of_copies(
    b: &CudaBackend,
    s: &StreamCopies<'_, CudaBackend>,
    weight: MixWeight,
    w: &HcWeights<CudaBackend>,
    norm: Option<(&CudaBuf, f32)>,
    collapsed: &mut CudaBuf,
    post: &mut CudaBuf,
    comb: &mut CudaBuf,
) {
    let (rows, d) = (s.rows, s.hidden);
    assert_eq!((collapsed.len, post.len, comb.len), (rows * d, rows * s.hc, rows * s.hc * s.hc), "hc_pre outputs");
    let g = &b.gpu;
    let (kernel, wp) = weight.kernel(("hc_mix_copies_rows_f32", "hc_mix_copies_rows_bf16"));
    let (parts, partials) = rows_part_sums(g, rows, w);
    b.prof("hc_pre: mix of copies (rows)", || {
        launch!(
            g,
            kernel,
            rows_parts_cfg(parts, rows, MIX_COPIES_SMEM),
            g.ptr(&s.x.mem),
            rows as i32,
            d as i32,
            wp,
            partials
        )
    });
    finish(b, s.x, true, rows, w, norm, Mixed::Parts { partials, parts }, collapsed, post, comb);
}

fn check_pre(
    streams: &CudaBuf,
    rows: usize,
    w: &HcWeights<CudaBackend>,
    norm: Option<(&CudaBuf, f32)>,
    collapsed: &CudaBuf,
    post: &CudaBuf,
    comb: &CudaBuf,
) {
    let (hc, d) = (w.hc, w.hidden);
    if let Some((nw, _)) = norm {
        assert_eq!(nw.len, d, "hc_pre norm weight length");
    }
    assert!(hc <= HC_MAX, "{hc} residual streams exceed the CUDA kernels' {HC_MAX}");
    assert_eq!(streams.len, rows * hc * d, "hc_pre streams are not [rows, hc, hidden]");
    assert_eq!((collapsed.len, post.len, comb.len), (rows * d, rows * hc, rows * hc * hc), "hc_pre outputs");
}

/// Where `hc_pre_finish` finds the mixing product of a row.
enum Mixed<'a> {
    /// `[rows, (2 + hc) · hc]`; the kernel takes the rows' sums of squares itself.
    Product(&'a CudaBuf),
    /// `hc_post_mix`'s `[rows, parts, 32]` part sums, the sum of squares in slot 31.
    Parts { partials: u64, parts: usize },
}

/// The sigmoids, the Sinkhorn projection and the collapse of each row (`hc_pre_finish`),
/// with the sub-block's input norm. With `copies`, `streams` is `[rows, hidden]`, each
/// row every stream of its row (only `hc_collapse_rows` reads such: [`pre_of_copies`]).
#[allow(clippy::too_many_arguments)]
fn finish(
    b: &CudaBackend,
    streams: &CudaBuf,
    copies: bool,
    rows: usize,
    w: &HcWeights<CudaBackend>,
    norm: Option<(&CudaBuf, f32)>,
    mixed: Mixed<'_>,
    collapsed: &mut CudaBuf,
    post: &mut CudaBuf,
    comb: &mut CudaBuf,
) {
    let (hc, d) = (w.hc, w.hidden);
    let g = &b.gpu;
    // Whatever bf16 rows the buffer carried are of its old values.
    collapsed.bf16 = None;
    // The sub-block's input RMSNorm in the same kernel (its block holds the collapsed
    // row), unless `SLUICE_CUDA_FUSE_NORMS=0`.
    let fused = norm.filter(|_| super::rows::fuse_norms());
    let (norm_w, norm_eps) = fused.map(|(nw, eps)| (g.ptr(&nw.mem), eps)).unwrap_or((0, 0.0));
    // A second block a row for the Sinkhorn rounds where one warp holds the matrix.
    let blocks_a_row = if hc * hc <= 32 && fewer_rows_than_sms(g, rows) && sinkhorn_block() { 2 } else { 1 };
    let (m, partials, parts) = match mixed {
        Mixed::Product(m) => (g.ptr(&m.mem), 0, 0),
        Mixed::Parts { partials, parts } => (0, partials, parts),
    };
    let threads = row_block_threads(g, rows);
    // A prefill's rows of V4's shape held in registers (the same arguments; part sums
    // there are `hc_post_mix_rows`': `hc_post_mix`'s batches are fewer rows than SMs).
    let in_registers = blocks_a_row == 1 && threads == ROWS_THREADS && finish_rows_takes(hc, d);
    let apart = in_registers && partials != 0 && weights_apart();
    assert!(apart || !copies, "only hc_collapse_rows collapses a row's copies");
    if apart {
        // The weights of every row at once (16 lanes a row), then the collapse as a pass
        // over the streams (hc_rows.cu says why), with the normed rows also in bf16 where
        // the sub-block's products read them so.
        let pre = g.scratch("hc_pre_weights", rows * hc);
        let rounded = (fused.is_some() && collapse_rounds(g)).then(|| g.alloc::<u16>(rows * d));
        launch!(
            g,
            "hc_weights_rows",
            cfg((rows.div_ceil(16) as u32, 1, 1), 256, 0),
            partials,
            parts as i32,
            f80(&w.base),
            w.scale[0],
            w.scale[1],
            w.scale[2],
            (hc * d) as i32,
            w.sinkhorn_iters as i32,
            w.norm_eps,
            w.hc_eps,
            pre,
            g.ptr(&post.mem),
            g.ptr(&comb.mem),
            rows as i32,
        );
        launch!(
            g,
            "hc_collapse_rows",
            cfg((rows as u32, 1, 1), ROWS_THREADS, 0),
            g.ptr(&streams.mem),
            pre,
            d as i32,
            g.ptr(&collapsed.mem),
            norm_w,
            norm_eps,
            copies as i32,
            rounded.as_ref().map_or(0, |r| g.ptr(r)),
        );
        collapsed.bf16 = rounded;
    } else {
        launch!(
            g,
            if in_registers { "hc_pre_finish_rows" } else { "hc_pre_finish" },
            cfg((rows as u32, blocks_a_row, 1), threads, 0),
            g.ptr(&streams.mem),
            m,
            f80(&w.base),
            w.scale[0],
            w.scale[1],
            w.scale[2],
            hc as i32,
            d as i32,
            w.sinkhorn_iters as i32,
            w.norm_eps,
            w.hc_eps,
            g.ptr(&collapsed.mem),
            g.ptr(&post.mem),
            g.ptr(&comb.mem),
            norm_w,
            norm_eps,
            partials,
            parts as i32,
        );
    }
    if let (None, Some((nw, eps))) = (fused, norm) {
        super::rows::rms_norm(b, collapsed, d, Some(nw), eps);
    }
}

/// `hc_post`, then `hc_pre` of the next sub-block on the updated streams; decode-sized
/// batches of V4's shapes (≤ [`post_mix_max_rows`] rows, hc = 4, an f32 or bf16 mixing
/// weight, hidden a multiple of 64) take `hc_post_mix` + `hc_pre_finish`: the mixing
/// product and the sum of squares are taken as the streams are written (two launches and
/// one pass over the row instead of three launches and three passes).
#[allow(clippy::too_many_arguments)]
pub(crate) fn hc_post_pre(
    b: &CudaBackend,
    streams: &mut CudaBuf,
    rows: usize,
    hc: usize,
    out: &CudaBuf,
    w: &HcWeights<CudaBackend>,
    norm: Option<(&CudaBuf, f32)>,
    collapsed: &mut CudaBuf,
    post: &mut CudaBuf,
    comb: &mut CudaBuf,
) {
    assert_eq!(hc, w.hc, "hc_post_pre: the streams and the next sub-block's mHC weights disagree on hc");
    let d = w.hidden;
    let g = &b.gpu;
    let weight = MixWeight::of(g, &w.mix);
    let fits = post_mix_fits(w);
    if let Some(weight) = weight.filter(|_| post_pre_in_one_pass(g, rows, w)) {
        post_mix_rows(b, streams, None, rows, out, w, norm, weight, collapsed, post, comb);
        return;
    }
    let kernel = weight.map(|m| m.kernel(("hc_post_mix_f32", "hc_post_mix_bf16")));
    let Some((name, wp)) = kernel.filter(|_| fits && (1..=post_mix_max_rows()).contains(&rows)) else {
        hc_post(b, streams, rows, hc, out, post, comb);
        hc_pre(b, streams, rows, w, norm, collapsed, post, comb);
        return;
    };
    check_pre(streams, rows, w, norm, collapsed, post, comb);
    assert_eq!(out.len, rows * d, "hc_post_pre: the sub-block output is not [rows, hidden]");
    g.traffic.add_weights(w.mix.device_bytes());
    let parts = post_mix_parts(d);
    let partials = g.scratch("hc_post_mix_partials", rows * parts * POST_MIX_SLOTS);
    let per_block = post_mix_rows_per_block(rows);
    b.prof("hc_post_pre: post + mix", || {
        launch!(
            g,
            name,
            cfg((parts as u32, rows.div_ceil(per_block) as u32, 1), (POST_MIX_COLS * per_block) as u32, 0),
            g.ptr(&streams.mem),
            g.ptr(&out.mem),
            g.ptr(&post.mem),
            g.ptr(&comb.mem),
            d as i32,
            wp,
            partials,
            rows as i32,
            per_block as i32
        )
    });
    finish(b, streams, false, rows, w, norm, Mixed::Parts { partials, parts }, collapsed, post, comb);
}

/// Columns of each stream a `hc_post_mix_rows` block takes (`HPR_COLS` in hc_rows.cu),
/// its rows (`HPR_ROWS`) and threads, and its dynamic shared memory (`HPR_SMEM`: the
/// part's 24 logits' weights for its 4 × 128 stream columns, in f32, 7 16-byte chunks a
/// column and one more every 4 columns).
const POST_MIX_ROWS_COLS: usize = 128;
const POST_MIX_ROWS_ROWS: usize = 256;
const POST_MIX_ROWS_THREADS: u32 = 256;
pub(crate) const POST_MIX_ROWS_SMEM: usize = 4 * (7 * POST_MIX_ROWS_COLS + POST_MIX_ROWS_COLS / 4) * 16;
/// `hc_post_mix_rows_tc` (hc_rows_tc.cu): rows a block (`HPT_ROWS`) and its dynamic shared
/// memory (`HPT_SMEM`: the part's f32 weights, then each of its 8 warps' ring of two units
/// of 5 arrays × 16 rows × 128 bytes; one block an SM).
const POST_MIX_ROWS_TC_ROWS: usize = 512;
pub(crate) const POST_MIX_ROWS_TC_SMEM: usize = POST_MIX_ROWS_COLS * POST_MIX_HC * (2 + POST_MIX_HC) * POST_MIX_HC * 4
    + (POST_MIX_ROWS_THREADS as usize / 32) * 2 * (POST_MIX_HC + 1) * 16 * 128;

/// Whether a prefill's mixing product takes the tensor cores (`hc_post_mix_rows_tc`;
/// `SLUICE_CUDA_HC_POST_MIX_TC=0`, read once, keeps `hc_post_mix_rows`' CUDA cores).
fn post_mix_rows_on_tensor_cores() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_HC_POST_MIX_TC").map_or(true, |v| v != "0"))
}

/// Whether a prefill-sized batch takes `hc_post_mix_rows` (`SLUICE_CUDA_HC_POST_MIX_PREFILL=0`,
/// read once, keeps `hc_post`, the cuBLAS mixing product and `hc_pre_finish_rows`): rows
/// that `hc_pre_finish_rows` then finishes (at least as many as SMs, V4's shape), hidden a
/// multiple of its parts.
fn post_mix_rows_takes(g: &super::runtime::Gpu, rows: usize, d: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_HC_POST_MIX_PREFILL").map_or(true, |v| v != "0"));
    on && rows > post_mix_max_rows()
        && !fewer_rows_than_sms(g, rows)
        && finish_rows_takes(4, d)
        && d.is_multiple_of(POST_MIX_ROWS_COLS)
}

/// Whether `hc_post_pre` of `rows` rows with these weights runs `hc_post_mix_rows` (its
/// dispatch asks this; the parity suite asserts which cases do): V4's shape with an f32
/// or bf16 mixing weight, prefill-sized rows.
pub(crate) fn post_pre_in_one_pass(g: &super::runtime::Gpu, rows: usize, w: &HcWeights<CudaBackend>) -> bool {
    MixWeight::of(g, &w.mix).is_some() && post_mix_fits(w) && post_mix_rows_takes(g, rows, w.hidden)
}

/// Whether the mHC weights have the shape the `hc_post_mix` kernels are built for: V4's 4
/// streams, hidden a multiple of a block's columns, the mixing weight [(2 + hc)·hc, hc·hidden].
fn post_mix_fits(w: &HcWeights<CudaBackend>) -> bool {
    let (hc, d) = (w.hc, w.hidden);
    hc == POST_MIX_HC && d.is_multiple_of(POST_MIX_COLS) && w.mix.rows == (2 + hc) * hc && w.mix.cols == hc * d
}

/// A prefill's `hc_post` and the next sub-block's mixing product in one pass over the
/// streams (`hc_post_mix_rows_tc`: the product on the tensor cores, a warp 16 rows whose
/// values it copies into shared memory a unit ahead; with `SLUICE_CUDA_HC_POST_MIX_TC=0`
/// `hc_post_mix_rows`: 8 lanes a row, each adding its own 24 sums over its columns of a
/// part, folded over the row's lanes), then the rows' finish on the part sums. Where
/// `hc_post`, cuBLAS's f32 product (24 outputs in a tile of 64 or more) and the pre-mix
/// each read the 512 MB of an 8K prefill's streams, the streams are read twice.
/// With `copies`, the streams before the update are `hc` copies of each of its rows
/// (`[rows, hidden]`; the kernel reads those) and `streams` is only written.
#[allow(clippy::too_many_arguments)]
fn post_mix_rows(
    b: &CudaBackend,
    streams: &mut CudaBuf,
    copies: Option<&CudaBuf>,
    rows: usize,
    out: &CudaBuf,
    w: &HcWeights<CudaBackend>,
    norm: Option<(&CudaBuf, f32)>,
    weight: MixWeight,
    collapsed: &mut CudaBuf,
    post: &mut CudaBuf,
    comb: &mut CudaBuf,
) {
    check_pre(streams, rows, w, norm, collapsed, post, comb);
    let d = w.hidden;
    assert_eq!(out.len, rows * d, "hc_post_pre: the sub-block output is not [rows, hidden]");
    let g = &b.gpu;
    let (parts, partials) = rows_part_sums(g, rows, w);
    let (kernel, wp, launch_cfg) = if post_mix_rows_on_tensor_cores() {
        let (k, wp) = weight.kernel(("hc_post_mix_rows_tc_f32", "hc_post_mix_rows_tc_bf16"));
        let grid = (parts as u32, rows.div_ceil(POST_MIX_ROWS_TC_ROWS) as u32, 1);
        (k, wp, cfg(grid, POST_MIX_ROWS_THREADS, POST_MIX_ROWS_TC_SMEM as u32))
    } else {
        let (k, wp) = weight.kernel(("hc_post_mix_rows_f32", "hc_post_mix_rows_bf16"));
        (k, wp, rows_parts_cfg(parts, rows, POST_MIX_ROWS_SMEM))
    };
    b.prof("hc_post_pre: post + mix (rows)", || {
        launch!(
            g,
            kernel,
            launch_cfg,
            g.ptr(&streams.mem),
            g.ptr(&copies.unwrap_or(streams).mem),
            copies.is_some() as i32,
            g.ptr(&out.mem),
            g.ptr(&post.mem),
            g.ptr(&comb.mem),
            rows as i32,
            d as i32,
            wp,
            partials
        )
    });
    finish(b, streams, false, rows, w, norm, Mixed::Parts { partials, parts }, collapsed, post, comb);
}

/// The parts of a prefill row's mixing product (`hidden / POST_MIX_ROWS_COLS`, a block's
/// columns each) and the scratch their sums go to (`[rows, parts, 32]`), the mixing
/// weight's bytes counted as read: what `hc_post_mix_rows` and `hc_mix_copies_rows` leave
/// for `hc_weights_rows`.
fn rows_part_sums(g: &super::runtime::Gpu, rows: usize, w: &HcWeights<CudaBackend>) -> (usize, u64) {
    g.traffic.add_weights(w.mix.device_bytes());
    let parts = w.hidden / POST_MIX_ROWS_COLS;
    (parts, g.scratch("hc_post_mix_partials", rows * parts * POST_MIX_SLOTS))
}

/// The launch of a kernel over a prefill's rows by parts (`hc_post_mix_rows`,
/// `hc_mix_copies_rows`): a block a part and [`POST_MIX_ROWS_ROWS`] rows.
fn rows_parts_cfg(parts: usize, rows: usize, smem: usize) -> cudarc::driver::LaunchConfig {
    cfg((parts as u32, rows.div_ceil(POST_MIX_ROWS_ROWS) as u32, 1), POST_MIX_ROWS_THREADS, smem as u32)
}

/// `hc_post_mix`'s sums a row and part (`HC_MIX_SLOTS` in hc.cu): (2 + hc)·hc ≤ 31
/// logits, the sum of squares last.
const POST_MIX_SLOTS: usize = 32;
/// The streams `hc_post_mix` is built for (V4's 4: 24 logits and the sum of squares fill
/// one warp's 32 slots).
const POST_MIX_HC: usize = 4;
/// Columns of a row a `hc_post_mix` block takes (`HC_POST_MIX_COLS` in hc.cu), a thread
/// each: V4's 4,096 make 64 blocks a row, each copying 24 KB of the f32 mixing weight.
const POST_MIX_COLS: usize = 64;
/// Most rows a `hc_post_mix` block takes side by side (`HC_POST_MIX_ROWS_MAX`): 512 threads.
const POST_MIX_ROWS_MAX: usize = 8;
/// Groups of rows past one row a block: each copies the weight slices once.
const POST_MIX_GROUPS: usize = 8;

fn post_mix_parts(d: usize) -> usize {
    d / POST_MIX_COLS
}

/// Rows a `hc_post_mix` block takes from one copy of its weight slice, side by side (64
/// threads each): one up to 8 rows (every row its own block, as latency wants), past that
/// enough for at most 8 groups of rows, so a batch of 32 copies the slices 8 times instead
/// of 32.
/// `SLUICE_CUDA_HC_POST_MIX_GROUP=1` (read once): one row a block always, to compare.
fn post_mix_rows_per_block(rows: usize) -> usize {
    static ONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let one = *ONE.get_or_init(|| std::env::var("SLUICE_CUDA_HC_POST_MIX_GROUP").is_ok_and(|v| v == "1"));
    let per_block = if one || rows <= POST_MIX_GROUPS { 1 } else { rows.div_ceil(POST_MIX_GROUPS) };
    assert!(per_block <= POST_MIX_ROWS_MAX, "hc_post_mix takes at most {} rows", POST_MIX_GROUPS * POST_MIX_ROWS_MAX);
    per_block
}

/// Most rows that take `hc_post_mix` (`SLUICE_CUDA_HC_POST_MIX_ROWS`, read once; 0 = never):
/// 64, the largest decode batch a CUDA graph records. Its blocks read the mixing weight
/// (L2-resident) once a group of rows ([`post_mix_rows_per_block`]), so it is for
/// decode-sized batches; there it still beat the three kernels it replaces (flash-bench on
/// the H200, batch 16 / 32 / 64 1.45–1.49 → 1.41–1.44, 1.69–1.70 → 1.67–1.68, 2.15–2.18 →
/// 2.08–2.11 ms a step; it was 8 before, docs/perf.md). At most 64: [`POST_MIX_GROUPS`]
/// groups of [`POST_MIX_ROWS_MAX`] rows.
fn post_mix_max_rows() -> usize {
    static ONCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ONCE
        .get_or_init(|| env_rows("SLUICE_CUDA_HC_POST_MIX_ROWS").unwrap_or(64).min(POST_MIX_GROUPS * POST_MIX_ROWS_MAX))
}

pub(crate) fn hc_post(
    b: &CudaBackend,
    streams: &mut CudaBuf,
    rows: usize,
    hc: usize,
    out: &CudaBuf,
    post: &CudaBuf,
    comb: &CudaBuf,
) {
    assert!(hc <= HC_MAX, "{hc} residual streams exceed the CUDA kernels' {HC_MAX}");
    if rows == 0 {
        return;
    }
    let d = out.len / rows;
    assert_eq!(streams.len, rows * hc * d, "hc_post streams are not [rows, hc, hidden]");
    let g = &b.gpu;
    launch!(
        g,
        "hc_post",
        cfg_row_cols(rows, d),
        g.ptr(&streams.mem),
        g.ptr(&out.mem),
        g.ptr(&post.mem),
        g.ptr(&comb.mem),
        rows as i32,
        hc as i32,
        d as i32
    );
}

pub(crate) fn hc_head(
    b: &CudaBackend,
    streams: &CudaBuf,
    rows: usize,
    w: &HcHeadWeights<CudaBackend>,
    out: &mut CudaBuf,
) {
    let (hc, d) = (w.hc, w.hidden);
    assert!(hc <= HC_MAX, "{hc} residual streams exceed the CUDA kernels' {HC_MAX}");
    assert_eq!(streams.len, rows * hc * d, "hc_head streams are not [rows, hc, hidden]");
    assert_eq!(out.len, rows * d, "hc_head output is not [rows, hidden]");
    if rows == 0 {
        return;
    }
    let m = mix(b, streams, rows, &w.mix);
    let g = &b.gpu;
    launch!(
        g,
        "hc_head_finish",
        cfg((rows as u32, 1, 1), row_block_threads(g, rows), 0),
        g.ptr(&streams.mem),
        g.ptr(&m.mem),
        f80(&w.base),
        w.scale,
        hc as i32,
        d as i32,
        w.norm_eps,
        w.hc_eps,
        g.ptr(&out.mem),
    );
}

#[cfg(test)]
mod tests {
    use super::mix_rows_parts;

    #[test]
    fn mix_rows_splits_k_only_for_few_row_blocks() {
        // Prefill: a block per 4 rows already fills the GPU.
        assert_eq!(mix_rows_parts(132, 2048, 16384), 1);
        // 64 decode rows = 16 row blocks: 17 parts would give ~2 blocks an SM.
        assert_eq!(mix_rows_parts(132, 16, 16384), 17);
        // One row block: capped so each part keeps 512 inputs.
        assert_eq!(mix_rows_parts(132, 1, 16384), 32);
        assert_eq!(mix_rows_parts(132, 1, 100), 1);
    }
}
