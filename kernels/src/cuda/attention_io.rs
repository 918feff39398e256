//! What attention reads and writes besides f32 rows, for the engine's attention
//! sub-block (`Backend::attention_preps_query`, `attention_of_raw_query`,
//! `attention_projected`): a raw query normed and rotated by `attention_wg` as it stages
//! it, and the output handed to `wo_a`'s cuBLAS product as bf16 rows rotated back —
//! `attention_wg` writes them where one key split holds each row — instead of f32 rows
//! read again by the `rope` launch and the product's rounding (an 8K prefill's 1 GB a
//! layer, written once and read twice).

use super::CudaBackend;
use super::attention::{attention, attention_kernel};
use super::cublas_bf16::{self, RoundedRows};
use super::matmul::{Operand, count_product};
use super::memory::{CudaBuf, CudaWeight};
use super::runtime::Gpu;
use crate::backend::{AttentionIo, Backend, KvView, OutputProjection};
use crate::kv_layout::KvLayout;
use crate::plan::BatchPlan;
use crate::rope::RopeTable;

/// Where [`attention`] leaves its output.
pub(crate) enum AttnOut<'a> {
    /// f32 rows, as `Backend::attention` has them.
    F32(&'a mut CudaBuf),
    /// bf16 rows at a device address (rows × heads × head_dim values), each head's last
    /// 2·pairs dims rotated back to the row's position (inverse RoPE from `rope`): what
    /// `wo_a`'s cuBLAS product reads ([`attention_projected`]).
    Bf16Rotated { at: u64, rope: &'a RopeTable },
}

/// Whether a batch's attention takes its query raw and norms and rotates each head in
/// `attention_wg`'s q staging (`Backend::attention_preps_query`): wherever that kernel
/// runs. `SLUICE_CUDA_ATT_WG_QPREP=0` keeps `head_norm_rope2`'s pass over the query, to compare.
pub(crate) fn preps_query(g: &Gpu, layout: &KvLayout, layer: usize, plan: &BatchPlan, heads: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_ATT_WG_QPREP").map_or(true, |v| v != "0"));
    on && plan.rows() > 0 && attention_kernel(g, layout, layer, plan, heads).0 == "attention_wg"
}

/// Whether `wo_a` takes the attention output as bf16 rows rotated back
/// ([`attention_projected`]): its product runs on cuBLAS with bf16 activations (BF16
/// weights, enough rows). `SLUICE_CUDA_ATT_BF16_OUT=0` keeps f32 rows, the `rope` launch
/// and the product's own rounding, to compare.
pub(crate) fn projects_in_bf16(g: &Gpu, rows: usize, groups: usize, wo_a: &CudaWeight) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_ATT_BF16_OUT").map_or(true, |v| v != "0"));
    let op = Operand { x: 0, x_stride: groups * wo_a.cols, out: 0, out_stride: wo_a.rows, rows, groups };
    on && cublas_bf16::reads_bf16_rows(g, &op, wo_a)
}

/// Whether `wo_a`'s product (which [`projects_in_bf16`]) hands `wo_b` bf16 rows: `wo_b`
/// runs on cuBLAS too. `SLUICE_CUDA_WO_A_BF16_OUT=0` keeps f32 rows between them, which
/// `wo_b`'s product rounds again, to compare.
pub(crate) fn wo_a_hands_bf16(g: &Gpu, rows: usize, wo_b: &CudaWeight) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SLUICE_CUDA_WO_A_BF16_OUT").map_or(true, |v| v != "0"));
    let op = Operand { x: 0, x_stride: wo_b.cols, out: 0, out_stride: wo_b.rows, rows, groups: 1 };
    on && cublas_bf16::reads_bf16_rows(g, &op, wo_b)
}

/// `Backend::attention_projected` where [`projects_in_bf16`]: attention into bf16 rows
/// rotated back, `wo_a`'s block-diagonal cuBLAS product from them, then `wo_b` — from
/// `wo_a`'s output stored in bf16 by cuBLAS where [`wo_a_hands_bf16`] (an 8K prefill's
/// 256 MB of f32 rows a layer neither written nor read again), else as any product.
pub(crate) fn attention_projected(
    b: &CudaBackend,
    kv: &KvView<'_, CudaBackend>,
    layout: &KvLayout,
    (layer, plan): (usize, &BatchPlan),
    io: AttentionIo<'_, CudaBackend>,
    proj: &OutputProjection<'_, CudaBackend>,
    out: &mut CudaBuf,
) {
    let g = &b.gpu;
    let (rows, width) = (plan.rows(), io.heads * layout.layers[layer].spec.head_dim);
    assert_eq!(width, proj.groups * proj.wo_a.cols, "attention output is not wo_a's input");
    let xb = g.alloc::<u16>(rows * width);
    attend(b, kv, layout, (layer, plan), io, AttnOut::Bf16Rotated { at: g.ptr(&xb), rope: proj.rope });
    count_product(g, rows, proj.wo_a);
    let attn = RoundedRows::from_bf16(xb, rows, width);
    let mid = proj.wo_a.rows;
    if wo_a_hands_bf16(g, rows, proj.wo_b) {
        let grouped = g.alloc::<u16>(rows * mid);
        let op = Operand::contiguous(0, 0, rows, proj.groups, proj.wo_a);
        attn.product_to_bf16(g, op, proj.wo_a, g.ptr(&grouped));
        drop(attn);
        count_product(g, rows, proj.wo_b);
        let op = Operand::contiguous(0, g.ptr(&out.mem), rows, 1, proj.wo_b);
        RoundedRows::from_bf16(grouped, rows, mid).product(g, op, proj.wo_b);
    } else {
        let grouped = b.alloc_buf(rows * mid);
        let op = Operand::contiguous(0, g.ptr(&grouped.mem), rows, proj.groups, proj.wo_a);
        attn.product(g, op, proj.wo_a);
        drop(attn);
        b.matmul(&grouped, rows, proj.wo_b, out);
    }
}

/// [`attention`] of `io`'s query, raw where `io.prep` is given: its prep folded into
/// `attention_wg` where that kernel runs this batch ([`preps_query`]), else
/// `head_norm_rope` first (in place).
pub(crate) fn attend(
    b: &CudaBackend,
    kv: &KvView<'_, CudaBackend>,
    layout: &KvLayout,
    (layer, plan): (usize, &BatchPlan),
    io: AttentionIo<'_, CudaBackend>,
    out: AttnOut<'_>,
) {
    let AttentionIo { q, new_kv, selected, sinks, heads, scale, mut prep } = io;
    if let Some(p) = prep
        && !preps_query(&b.gpu, layout, layer, plan, heads)
    {
        let hd = layout.layers[layer].spec.head_dim;
        b.head_norm_rope(q, heads, hd, None, p.eps, &plan.positions, p.rope, None);
        prep = None;
    }
    attention(b, kv, layout, layer, plan, q, new_kv, selected, sinks, heads, scale, prep, out);
}
