//! The compressors on the GPU: every entry this batch completes is pooled, normed,
//! rotated and written to its page by one kernel (one block an entry, or for HCA's long
//! windows a few blocks an entry whose last one finishes it); the ring keeps each
//! sequence's last window(s) of projections for the entries later steps complete.

use cudarc::driver::DeviceRepr;

use super::CudaBackend;
use super::memory::{CudaBuf, dtype_code};
use super::rows::RopeParams;
use super::runtime::{cfg, launch};
use crate::backend::{CompressorParams, KvState};
use crate::kv_layout::{AttnKind, Branch, KvLayout};
use crate::plan::BatchPlan;

/// Sources one block pools (`compress_entries`); more per entry split over blocks.
const COMPRESS_CHUNK_SOURCES: usize = 16;
/// `__launch_bounds__` of `compress_entries`: two channels per thread.
const COMPRESS_MAX_THREADS: usize = 512;

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
    kv: &mut KvState<CudaBackend>,
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
        dim.is_multiple_of(2) && dim <= 2 * COMPRESS_MAX_THREADS,
        "compressor entries of {dim} dims: the CUDA kernel needs an even count, at most {}",
        2 * COMPRESS_MAX_THREADS
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
        page_elems: layout.page_elems as i32,
        page_off: lk.page_offset(branch) as i32,
        per_page: lk.entries_per_page(layout.block) as i32,
        eps: p.eps,
    };
    let (entries, n) = dp.entries(g, ratio);
    if n > 0 {
        // Sources per entry: CSA pools two overlapping windows, HCA one. Chunks of 16
        // sources per block (HCA's 128 → 8 blocks an entry), a function of the layer
        // alone so an entry pools the same way in every batch.
        let n_src = if lk.kind() == AttnKind::Csa { 2 * ratio } else { ratio };
        let chunks = (n_src / COMPRESS_CHUNK_SOURCES).max(1);
        let threads = (dim / 2).div_ceil(32) * 32;
        let (partial, tickets) = if chunks > 1 {
            (g.scratch("compress_partial", n * chunks * 3 * dim), g.scratch("compress_tickets", n))
        } else {
            (0, 0)
        };
        launch!(
            g,
            "compress_entries",
            cfg((chunks as u32, n as u32, 1), threads as u32, 0),
            g.ptr(&*entries),
            g.ptr(&dp.seqs),
            g.ptr(&dp.pages),
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
