//! The CPU backend: f32 activations in `Vec`s, weights dequantised to f32 at load,
//! products through the `gemm` crate, everything else parallel over rows with rayon.
//! Thread count follows rayon's global pool (`RAYON_NUM_THREADS`).

mod attention;
mod compress;
mod hc;
mod kvmem;
mod matmul;
mod matrix;
mod moe;
mod rows;
mod simd;

use crate::EntryDtype;
use crate::backend::{
    Backend, CompressorParams, ExternalMemory, HcHeadWeights, HcWeights, KvView, KvViewMut, MoeWeights, Selection,
};
use crate::kv_layout::{Branch, EntryFormat, KvLayout};
use crate::plan::BatchPlan;
use crate::rope::RopeTable;
use crate::stored::WeightView;

pub use kvmem::CpuKv;
pub use matrix::{CpuMatrix, WeightData};

#[derive(Clone, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Weight = CpuMatrix;
    type Kv = CpuKv;
    type Idx = Vec<i32>;
    type Hc = HcWeights<Self>;
    type HcHead = HcHeadWeights<Self>;
    type Moe = MoeWeights<Self>;

    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn enter<R: Send, F: FnOnce() -> R + Send>(&self, f: F) -> R {
        rayon::scope(|_| f())
    }

    fn zeros(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn upload(&self, data: &[f32]) -> Vec<f32> {
        data.to_vec()
    }

    fn download(&self, buf: &Vec<f32>) -> Vec<f32> {
        buf.clone()
    }

    fn gather_rows(&self, src: &Vec<f32>, width: usize, rows: &[usize]) -> Vec<f32> {
        rows.iter().flat_map(|&r| src[r * width..(r + 1) * width].iter().copied()).collect()
    }

    fn weight(&self, w: WeightView<'_>) -> CpuMatrix {
        CpuMatrix::from_view(&w)
    }

    fn hc_weights(&self, w: HcWeights<Self>) -> HcWeights<Self> {
        w
    }

    fn hc_head_weights(&self, w: HcHeadWeights<Self>) -> HcHeadWeights<Self> {
        w
    }

    fn moe_weights(&self, w: MoeWeights<Self>) -> MoeWeights<Self> {
        w
    }

    fn weight_shape(&self, w: &CpuMatrix) -> (usize, usize) {
        (w.rows, w.cols)
    }

    fn kv_alloc(&self, elems: usize, dtype: EntryDtype) -> CpuKv {
        CpuKv::zeroed(elems, dtype)
    }

    fn kv_adopt(&self, mem: Box<dyn ExternalMemory>, elems: usize, dtype: EntryDtype) -> Result<CpuKv, String> {
        CpuKv::adopt(mem, elems, dtype)
    }

    fn kv_host_bytes<'a>(&self, kv: &'a CpuKv) -> Option<&'a [u8]> {
        Some(kv.bytes())
    }

    fn kv_read(&self, kv: &CpuKv, offset: usize, elems: usize) -> Vec<u8> {
        let sz = kv.dtype().size();
        kv.bytes()[offset * sz..(offset + elems) * sz].to_vec()
    }

    fn kv_sums(&self, kv: &CpuKv, ranges: &[crate::backend::SumRange]) -> Vec<u64> {
        let sz = kv.dtype().size();
        let bytes = kv.bytes();
        ranges
            .iter()
            .map(|r| crate::kv_checksum::partial_sum(&bytes[r.offset * sz..(r.offset + r.elems) * sz], r.first_word))
            .collect()
    }

    fn kv_write(&self, kv: &mut CpuKv, offset: usize, bytes: &[u8]) {
        let sz = kv.dtype().size();
        assert_eq!(bytes.len() % sz, 0, "kv_write of a partial element");
        kv.bytes_mut()[offset * sz..offset * sz + bytes.len()].copy_from_slice(bytes);
    }

    fn buf_read(&self, buf: &Vec<f32>, offset: usize, len: usize) -> Vec<f32> {
        buf[offset..offset + len].to_vec()
    }

    fn buf_write(&self, buf: &mut Vec<f32>, offset: usize, data: &[f32]) {
        buf[offset..offset + data.len()].copy_from_slice(data);
    }

    fn idx_download(&self, idx: &Vec<i32>) -> Vec<i32> {
        idx.clone()
    }

    fn embed(&self, table: &CpuMatrix, plan: &BatchPlan, out: &mut Vec<f32>) {
        rows::embed(table, &plan.tokens, out)
    }

    fn matmul(&self, x: &Vec<f32>, rows: usize, w: &CpuMatrix, out: &mut Vec<f32>) {
        matmul::matmul(x, rows, w, out)
    }

    fn grouped_matmul(&self, x: &Vec<f32>, rows: usize, groups: usize, w: &CpuMatrix, out: &mut Vec<f32>) {
        matmul::grouped_matmul(x, rows, groups, w, out)
    }

    fn rms_norm(&self, x: &mut Vec<f32>, dim: usize, weight: Option<&Vec<f32>>, eps: f32) {
        rows::rms_norm(x, dim, weight.map(|w| w.as_slice()), eps)
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        heads: usize,
        head_dim: usize,
        positions: &[u32],
        rope: &RopeTable,
        inverse: bool,
    ) {
        rows::rope(x, heads, head_dim, positions, rope, inverse)
    }

    fn scale(&self, x: &mut Vec<f32>, factor: f32) {
        x.iter_mut().for_each(|v| *v *= factor);
    }

    fn add_into(&self, acc: &mut Vec<f32>, x: &Vec<f32>) {
        assert_eq!(acc.len(), x.len(), "add_into of buffers of different lengths");
        acc.iter_mut().zip(x).for_each(|(a, v)| *a += v);
    }

    fn round_to(&self, x: &mut Vec<f32>, fmt: &EntryFormat) {
        rows::round_to(x, fmt)
    }

    fn hc_pre(
        &self,
        streams: &Vec<f32>,
        rows: usize,
        w: &HcWeights<Self>,
        norm: Option<(&Vec<f32>, f32)>,
        collapsed: &mut Vec<f32>,
        post: &mut Vec<f32>,
        comb: &mut Vec<f32>,
    ) {
        hc::hc_pre(streams, rows, w, collapsed, post, comb);
        if let Some((weight, eps)) = norm {
            self.rms_norm(collapsed, w.hidden, Some(weight), eps);
        }
    }

    fn hc_post(
        &self,
        streams: &mut Vec<f32>,
        rows: usize,
        hc: usize,
        out: &Vec<f32>,
        post: &Vec<f32>,
        comb: &Vec<f32>,
    ) {
        hc::hc_post(streams, rows, hc, out, post, comb)
    }

    fn hc_head(&self, streams: &Vec<f32>, rows: usize, w: &HcHeadWeights<Self>, out: &mut Vec<f32>) {
        hc::hc_head(streams, rows, w, out)
    }

    fn moe(
        &self,
        x: &Vec<f32>,
        rows: usize,
        tokens: &[u32],
        w: &MoeWeights<Self>,
        shared_rows: std::ops::Range<usize>,
        out: &mut Vec<f32>,
    ) {
        moe::moe(x, rows, tokens, w, shared_rows, out)
    }

    fn compress(
        &self,
        kv: &mut KvViewMut<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        branch: Branch,
        plan: &BatchPlan,
        proj_kv: &Vec<f32>,
        proj_score: &Vec<f32>,
        p: &CompressorParams<'_, Self>,
    ) {
        compress::compress(kv, layout, layer, branch, plan, proj_kv, proj_score, p)
    }

    fn index_topk(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &Vec<f32>,
        weights: &Vec<f32>,
        heads: usize,
        top_k: usize,
    ) -> Selection<Self> {
        Selection { indices: attention::index_topk(kv, layout, layer, plan, q, weights, heads, top_k), top_k }
    }

    fn attention(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &Vec<f32>,
        new_kv: &Vec<f32>,
        selected: Option<&Selection<Self>>,
        sinks: &Vec<f32>,
        heads: usize,
        scale: f32,
        out: &mut Vec<f32>,
    ) {
        attention::attention(kv, layout, layer, plan, q, new_kv, selected, sinks, heads, scale, out)
    }

    fn store_window(
        &self,
        kv: &mut KvViewMut<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        new_kv: &Vec<f32>,
    ) {
        attention::store_window(kv, layout, layer, plan, new_kv)
    }
}
