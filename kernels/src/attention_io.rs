//! The engine's attention sub-block as the backends see it beyond `Backend::attention`:
//! a query handed over raw ([`QueryPrep`]: its head norm and RoPE still to do, which a
//! GPU kernel folds into its staging), and the output's way to `wo_a`
//! ([`OutputProjection`]), which a GPU keeps in the product's input format.
//! [`attention_projected_apart`] is what backends that fold nothing run.

use crate::backend::{Backend, KvView, Selection};
use crate::kv_layout::KvLayout;
use crate::plan::BatchPlan;
use crate::rope::RopeTable;

/// The output side of [`Backend::attention_projected`]: the RoPE table the output is
/// rotated back with, the block-diagonal `wo_a` over `groups`, then `wo_b`.
pub struct OutputProjection<'a, B: Backend + ?Sized> {
    pub rope: &'a RopeTable,
    pub groups: usize,
    pub wo_a: &'a B::Weight,
    pub wo_b: &'a B::Weight,
}

/// A batch's attention inputs as [`Backend::attention_projected`] passes them on.
pub struct AttentionIo<'a, B: Backend + ?Sized> {
    pub q: &'a mut B::Buf,
    pub new_kv: &'a B::Buf,
    pub selected: Option<&'a Selection<B>>,
    pub sinks: &'a B::Buf,
    pub heads: usize,
    pub scale: f32,
    pub prep: Option<&'a QueryPrep<'a>>,
}

/// [`Backend::attention_projected`] as its four ops (attention into f32 rows, the
/// inverse RoPE, the grouped product, `wo_b`): what backends that do not fold them run.
#[allow(clippy::too_many_arguments)]
pub fn attention_projected_apart<B: Backend + ?Sized>(
    b: &B,
    kv: &KvView<'_, B>,
    layout: &KvLayout,
    layer: usize,
    plan: &BatchPlan,
    io: AttentionIo<'_, B>,
    proj: &OutputProjection<'_, B>,
    out: &mut B::Buf,
) {
    let (rows, hd) = (plan.rows(), layout.layers[layer].spec.head_dim);
    let AttentionIo { q, new_kv, selected, sinks, heads, scale, prep } = io;
    let mut attn = b.output(rows * heads * hd);
    match prep {
        Some(p) => {
            b.attention_of_raw_query(kv, layout, layer, plan, q, new_kv, selected, sinks, heads, scale, p, &mut attn)
        }
        None => b.attention(kv, layout, layer, plan, q, new_kv, selected, sinks, heads, scale, &mut attn),
    }
    b.rope(&mut attn, heads, hd, &plan.positions, proj.rope, true);
    let mut grouped = b.output(rows * b.weight_shape(proj.wo_a).0);
    b.grouped_matmul(&attn, rows, proj.groups, proj.wo_a, &mut grouped);
    b.matmul(&grouped, rows, proj.wo_b, out);
}

/// What a raw query still needs before attention ([`Backend::attention_of_raw_query`]):
/// each head RMSNormed (no weight) with `eps`, then RoPE from `rope` at the rows' positions.
pub struct QueryPrep<'a> {
    pub eps: f32,
    pub rope: &'a RopeTable,
}
