//! The compressors on the GPU: every entry this batch completes is pooled, normed,
//! rotated and written to its page by one kernel that streams the sources through
//! shared memory (HCA's long windows split into chunks whose last block finishes the
//! entry); the ring keeps each sequence's last window(s) of projections for the entries
//! later steps complete, written by the same launch when no entry of the batch reads a
//! ring, else by a second one after it.

use cudarc::driver::DeviceRepr;

use super::CudaBackend;
use super::devplan::CompressorWork;
use super::memory::{CudaBuf, dtype_code};
use super::rows::RopeParams;
use super::runtime::{cfg, launch};
use crate::backend::{CompressorParams, KvViewMut};
use crate::kv_layout::{AttnKind, Branch, KvLayout};
use crate::plan::BatchPlan;

/// Sources one work item of `compress_stream` pools at most (CS_MAX_SRC); an entry with
/// more is split into chunks merged by the entry's last block.
const STREAM_MAX_SOURCES: usize = 16;
/// Items one block of `compress_stream` takes at most (CS_MAX_ITEMS).
const STREAM_MAX_ITEMS: usize = 16;
/// `__launch_bounds__` of `compress_stream`: two channels per thread.
const STREAM_MAX_THREADS: usize = 256;
/// Shared-memory pipeline of `compress_stream`: CS_DEPTH groups of CS_GROUP sources,
/// kv and score, a float2 per thread.
const STREAM_DEPTH: usize = 3;
const STREAM_GROUP: usize = 4;
/// The most dynamic shared memory `compress_stream` is launched with.
pub(crate) const STREAM_MAX_SMEM: usize = stream_smem(STREAM_MAX_THREADS);

const fn stream_smem(threads: usize) -> usize {
    STREAM_DEPTH * STREAM_GROUP * 2 * threads * 8
}

/// `struct CompressGeom` in compress.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct CompressGeom {
    ratio: i32,
    slots: i32,
    width: i32,
    dim: i32,
    overlap: i32,
    comp_elems: i32,
    comp_off: i32,
    dtype: i32,
    tail: i32,
    stride: i32,
    page_elems: i32,
    page_off: i32,
    per_page: i32,
    eps: f32,
}

// SAFETY: #[repr(C)] ints and a float, laid out as the C struct.
unsafe impl DeviceRepr for CompressGeom {}

#[allow(clippy::too_many_arguments)]
pub(crate) fn compress(
    b: &CudaBackend,
    kv: &mut KvViewMut<'_, CudaBackend>,
    layout: &KvLayout,
    layer: usize,
    branch: Branch,
    plan: &BatchPlan,
    proj_kv: &CudaBuf,
    proj_score: &CudaBuf,
    p: &CompressorParams<'_, CudaBackend>,
) {
    let lk = &layout.layers[layer];
    assert_ne!(lk.kind(), AttnKind::Window, "layer {layer} has no compressor");
    let ratio = lk.spec.ratio;
    let width = lk.comp_width(branch);
    let dim = lk.branch_dim(branch);
    let rows = plan.rows();
    assert_eq!(proj_kv.len, rows * width, "compressor kv projection width");
    assert_eq!(proj_score.len, rows * width, "compressor score projection width");
    assert_eq!(p.ape.len, ratio * width, "compressor position bias shape");
    assert_eq!(p.norm.len, dim, "compressor norm weight length");
    assert!(p.rope.dims() <= dim, "compressor rope dims exceed the entry");
    // The kernel reads two channels per thread as float2 (docs/cuda.md).
    assert!(
        dim.is_multiple_of(2) && dim <= 2 * STREAM_MAX_THREADS,
        "compressor entries of {dim} dims: the CUDA kernel needs an even count, at most {}",
        2 * STREAM_MAX_THREADS
    );
    // Sources are located by i32 element offsets.
    assert!(
        rows * width < i32::MAX as usize && kv.comp.len < i32::MAX as usize,
        "compressor inputs of {rows} rows x {width} and a state of {} floats exceed i32 offsets",
        kv.comp.len
    );
    assert!(
        layout.comp_elems.is_multiple_of(2) && lk.comp_offset(branch).is_multiple_of(2),
        "compressor state is not 8-byte aligned (comp_elems {}, offset {})",
        layout.comp_elems,
        lk.comp_offset(branch)
    );
    if rows == 0 {
        return;
    }
    for s in &plan.seqs {
        let need = (s.end_pos() / ratio).div_ceil(lk.entries_per_page(layout.block));
        assert!(s.pages.len() >= need, "page table too short for the compressed entries of layer {layer}");
    }
    let g = &b.gpu;
    let dp = b.plans.get(g, plan);
    let geom = CompressGeom {
        ratio: ratio as i32,
        slots: lk.comp_slots() as i32,
        width: width as i32,
        dim: dim as i32,
        overlap: (lk.kind() == AttnKind::Csa) as i32,
        comp_elems: layout.comp_elems as i32,
        comp_off: lk.comp_offset(branch) as i32,
        dtype: dtype_code(layout.dtype),
        tail: lk.format(branch).tail as i32,
        stride: lk.stride(branch) as i32,
        page_elems: layout.page_elems as i32,
        page_off: lk.page_offset(branch) as i32,
        per_page: lk.entries_per_page(layout.block) as i32,
        eps: p.eps,
    };
    let per_page = lk.entries_per_page(layout.block);
    let overlap = lk.kind() == AttnKind::Csa;
    let CompressorWork { entries, n_entries: n, stores: fused } =
        dp.compressor_work(g, (ratio, per_page, overlap, lk.comp_slots()));
    let n_stores = fused.as_ref().map_or(0, |f| f.1);
    if n > 0 || n_stores > 0 {
        // Sources per entry: CSA pools two overlapping windows, HCA one. Chunks of at
        // most 16 sources (HCA's 128 → 8 items an entry), a function of the layer alone
        // so an entry pools the same way in every batch.
        let n_src = if overlap { 2 * ratio } else { ratio };
        let chunks = n_src.div_ceil(STREAM_MAX_SOURCES);
        let threads = (dim / 2).div_ceil(32) * 32;
        let smem = stream_smem(threads);
        let items = n * chunks + n_stores;
        // As many blocks as fit the GPU at once, unless that leaves a block more items
        // than its tables hold.
        let resident = g.sms * g.resident_blocks("compress_stream", threads as u32, smem as u32);
        let per_block = items.div_ceil(resident.min(items)).min(STREAM_MAX_ITEMS);
        let grid = items.div_ceil(per_block);
        let (partial, tickets) = if chunks > 1 {
            (g.scratch("compress_partial", n * chunks * 2 * dim), g.scratch("compress_tickets", n))
        } else {
            (0, 0)
        };
        // Launched to overlap the previous kernel's tail: before its wait the kernel
        // reads only the entry list, which a host-to-device copy wrote (copies are not
        // overlapped; only kernel after kernel is), and it waits for every earlier
        // kernel before it touches anything else.
        launch!(
            g,
            "compress_stream",
            cfg((grid as u32, 1, 1), threads as u32, smem as u32),
            g.ptr(&*entries),
            n as i32,
            chunks as i32,
            g.ptr(&dp.seqs),
            fused.as_ref().map_or(0, |f| g.ptr(&*f.0)),
            n_stores as i32,
            g.ptr(&proj_kv.mem),
            g.ptr(&proj_score.mem),
            g.ptr(&p.ape.mem),
            g.ptr(&kv.comp.mem),
            g.ptr(&p.norm.mem),
            g.ptr(&kv.pages.mem),
            partial,
            tickets,
            geom,
            RopeParams::new(p.rope),
        );
    }
    if fused.is_some() {
        return;
    }
    let slots = lk.comp_slots();
    launch!(
        g,
        "compress_store",
        cfg(((slots * width).div_ceil(256) as u32, plan.seqs.len() as u32, 1), 256, 0),
        g.ptr(&dp.seqs),
        g.ptr(&proj_kv.mem),
        g.ptr(&proj_score.mem),
        g.ptr(&p.ape.mem),
        g.ptr(&kv.comp.mem),
        geom,
    );
}
