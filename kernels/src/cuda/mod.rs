//! The CUDA backend: f32 activations, weights and KV storage in device memory, kernels
//! compiled at run time with NVRTC for the device's architecture (sm_90a on Hopper),
//! GEMMs through cuBLAS. The driver, NVRTC and cuBLAS are loaded when a backend is
//! created, so a binary built with this module runs (CPU-only) on machines without
//! CUDA; [`CudaBackend::new`] then says what is missing.
//!
//! Module map:
//! - `runtime`: context, stream, cuBLAS handle, kernel table, copies and the `launch!`
//!   macro (every call checked).
//! - `launch`: kernel launches (programmatic dependent launch where the GPU has it).
//! - `nvrtc`: compilation of `cu/*.cu` and the on-disk PTX cache.
//! - `memory`: the buffer types ([`CudaBuf`], [`CudaWeight`], [`CudaKv`], [`CudaIdx`]);
//!   weights keep the checkpoint's format (BF16, FP8 + block scales, FP4 + ue8m0 scales).
//! - `kv_buffer`: KV storage from `cuMemAlloc` (exportable to peers: UCX cuda_ipc, peer copies).
//! - `upload`: host → device streaming of weights through bounded pinned buffers.
//! - `download`: large device → host reads (logits) through two pinned buffers.
//! - `devplan`: the batch plan in device memory, uploaded once per step.
//! - `matmul`: gemv kernels for decode, tensor-core tiles for prefill over stored formats.
//! - `matmul_many`: products of the same activations in one launch (few rows) or one split.
//! - `chunked_products`: a layer's small BF16 products of one input at 3-64 rows as one
//!   batched cuBLAS call over 64-row chunks of their weights.
//! - `blas_op`: a cuBLAS product as a value (recorded into decode steps' graphs), and
//!   the handles' own workspaces.
//! - `step_graph`, `arena`: decode steps recorded and replayed as CUDA graphs, and the
//!   step's temporaries at repeating addresses.
//! - `capture_lock`: a device's captures kept apart from other threads' calls that may
//!   synchronize its context (cuBLAS, pinned memory, synchronous allocations).
//! - `cublas_bf16`: BF16 weights of many rows (prefill, decode past 8 rows) on cuBLAS.
//! - `activations`: the precision of the activations in bf16 products, set per backend.
//! - `decode_v2`: the second-version decode products (cu/decode2.cu): kernel table,
//!   argument block, the plan of a launch ([`decode_v2::d2_plan`] is crate-private).
//! - `gemm_rows`: BF16 products of 9-32 decode rows in one tensor-core launch
//!   (cu/gemm_rows.cu; activations split in the kernel), opt-in, tried before cuBLAS.
//! - `gemv_f8mma`: FP8 products of 1-2 decode rows on FP8 tensor cores, tried before v2.
//! - `gemv_f8wg`: FP8 products of 1-2 decode rows on Hopper's `wgmma`, weights copied by
//!   the tensor memory accelerator (cu/gemv_f8wg.cu), tried before `gemv_f8mma`.
//! - `rows`, `hc`, `moe`, `compress`, `attention`: the trait's ops; `attention_io`: a raw
//!   query prepped in `attention_wg`, its output handed to `wo_a` as bf16 rows;
//!   `indexer_wg`: prefill indexer scores on `wgmma`; `topk`: the indexer's top-k.
//! - `moe_cublas`: routed BF16 experts of decode batches as cuBLAS batched products.
//! - `moe_host`: routed experts of batches whose routing is read back (prefill).
//! - `moe_fp4wg`: prefill-sized products on Hopper's `wgmma` (cu/moe_fp4wg.cu): those
//!   experts' FP4 ones and FP8 projections, codes made bf16 in registers, rows in bf16.
//! - `moe_v2`: the v2 routed-expert kernels of decode batches (1-8 rows; more by segments).
//! - `moe_wgmma`: routed FP4 experts of 1-8 decode rows on Hopper's `wgmma` (e2m1 codes
//!   turned into e4m3 in registers; cu/moe_wgmma.cu), tried before the v2 segments.
//! - `bench`: the stored-format products alone, for the benchmark's kernel table.
//! - `checksum`: KV checksums summed on the device (transfers check GPU memory in place).
//! - [`collective`]: rows between GPUs for the sharded backend (NCCL, peer copies).
//! - [`peer`]: GPU-to-GPU copy bandwidth, the ceiling of KV transfers between GPUs.
//! - `timing`: device-timed calls, stream holds and the copy bandwidth (benchmarks).
//! - `counters`: what a benchmark reads back of the ops issued (bytes, FLOPs, launches,
//!   graph replays, the per-op profile) and the graphs switch tests flip.
//! - `profile`: time per op (`SLUICE_CUDA_PROFILE=1` synchronised, `events` device-side,
//!   `host` the issuing thread's).
//!
//! The kernels' sources are in `cu/`; `cu/common.cuh` documents what they share.

mod activations;
mod arena;
mod attention;
mod attention_io;
mod bench;
mod blas_op;
mod capture_lock;
mod checksum;
mod chunked_products;
pub mod collective;
mod compress;
mod counters;
mod cublas_bf16;
mod decode_v2;
mod devplan;
mod download;
mod gemm_rows;
mod gemv_f8mma;
mod gemv_f8wg;
mod hc;
mod indexer_wg;
mod kv_buffer;
mod launch;
#[cfg(test)]
mod launch_names;
mod matmul;
mod matmul_many;
mod memory;
mod moe;
mod moe_cublas;
mod moe_fp4wg;
mod moe_host;
mod moe_v2;
mod moe_wgmma;
mod nvrtc;
pub mod peer;
mod profile;
mod rows;
pub(crate) mod runtime;
mod step_graph;
mod timing;
mod topk;
mod upload;

use crate::EntryDtype;
use crate::backend::{
    AttentionIo, Backend, CompressorParams, GreedyPicks, HcHeadWeights, HcWeights, HeadNormJob, HeadNormShared, KvView,
    KvViewMut, MoeWeights, OutputProjection, QueryPrep, Selection, StreamCopies, attention_projected_apart,
    indexer_select_apart,
};
use crate::kv_layout::{Branch, EntryFormat, KvLayout};
use crate::plan::BatchPlan;
use crate::rope::RopeTable;
use crate::stored::WeightView;
use attention::AttnOut;
use runtime::launch;

pub use bench::ProductTime;
pub use memory::{CudaBuf, CudaIdx, CudaKv, CudaWeight};
pub use profile::HOST_OUTERMOST;
pub use runtime::{CudaError, driver_present};
pub use step_graph::GraphStats;
pub use timing::KernelTime;

/// One GPU (one per device and process). Ops are issued by one thread at a time, as the engine does.
pub struct CudaBackend {
    gpu: runtime::Gpu,
    plans: devplan::PlanCache,
    /// Pinned buffers weights stream through while a model loads.
    staging: upload::Staging,
    /// `SLUICE_CUDA_PROFILE=1|events|host`: time per op (see `profile`).
    profile: Option<profile::OpProfile>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBackend({})", self.describe())
    }
}

impl CudaBackend {
    /// Open device `ordinal`, compile (or load cached) kernels.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        let profile = profile::OpProfile::from_env();
        Ok(CudaBackend {
            gpu: runtime::Gpu::new(ordinal)?,
            plans: devplan::PlanCache::default(),
            staging: upload::Staging::default(),
            profile,
        })
    }

    /// Total memory of device `ordinal` in bytes, without starting a backend (no kernels
    /// are compiled): for plans made before loading.
    pub fn device_memory(ordinal: usize) -> Result<usize, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        cudarc::driver::result::init().map_err(|e| CudaError::Driver(format!("{e:?}")))?;
        let count = cudarc::driver::CudaContext::device_count().map_err(|e| CudaError::Driver(format!("{e:?}")))?;
        if ordinal as i32 >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        // No context: making one and dropping it here would leave a destroyed context
        // current on this thread, and the next CUDA user on it (a CUDA-enabled UCX
        // registering host memory, say) would fail with "context is destroyed".
        let dev =
            cudarc::driver::result::device::get(ordinal as i32).map_err(|e| CudaError::Driver(format!("{e:?}")))?;
        // SAFETY: `dev` is a valid device handle just obtained from the initialised driver.
        unsafe { cudarc::driver::result::device::total_mem(dev) }.map_err(|e| CudaError::Driver(format!("{e:?}")))
    }

    /// Number of CUDA devices, 0 when there is no driver.
    pub fn device_count() -> usize {
        if !driver_present() {
            return 0;
        }
        if cudarc::driver::result::init().is_err() {
            return 0;
        }
        cudarc::driver::CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.gpu.ordinal
    }

    /// Where the kernels came from (compiled now or the PTX cache), for start-up logs.
    pub fn kernel_origin(&self) -> &str {
        &self.gpu.ptx_origin
    }

    /// Multiprocessors of the device.
    pub fn multiprocessors(&self) -> usize {
        self.gpu.sms
    }

    /// The device's compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.gpu.cc
    }

    /// Wait for all issued work (for timing from the host).
    pub fn synchronize(&self) {
        self.gpu.sync();
    }

    /// Bytes of device memory `(free, total)`.
    pub fn memory_info(&self) -> (usize, usize) {
        self.gpu.ctx.mem_get_info().unwrap_or((0, self.gpu.total_mem))
    }

    /// Device-to-device copy of one whole KV storage into another of the same size
    /// (bench set-up: fill many sequences from one prefill).
    pub fn kv_copy(&self, src: &CudaKv, src_elem: usize, dst: &mut CudaKv, dst_elem: usize, elems: usize) {
        assert_eq!(src.dtype, dst.dtype, "kv_copy between dtypes");
        let sz = src.dtype.size();
        assert!(src_elem + elems <= src.len && dst_elem + elems <= dst.len, "kv_copy out of range");
        if elems == 0 {
            return;
        }
        let (s, d) = (self.gpu.ptr(&src.mem), self.gpu.ptr(&dst.mem));
        self.gpu.copy_raw(d + (dst_elem * sz) as u64, s + (src_elem * sz) as u64, elems * sz);
    }

    /// Device address and length in bytes of a KV storage, for registering it with a
    /// transport that reaches GPU memory (the storage must outlive the registration).
    pub fn kv_device_range(&self, kv: &CudaKv) -> (u64, usize) {
        (self.gpu.ptr(&kv.mem), kv.len * kv.dtype.size())
    }

    fn prof<R>(&self, name: &'static str, f: impl FnOnce() -> R) -> R {
        match &self.profile {
            Some(p) => p.measure(&self.gpu, name, f),
            None => f(),
        }
    }

    /// [`CudaBackend::prof`] over several GPUs' work issued together (an NCCL group):
    /// every rank that profiles gets `f`'s time on its own stream.
    pub(crate) fn prof_all<R>(ranks: &[CudaBackend], name: &'static str, f: impl FnOnce() -> R) -> R {
        let gpus: Vec<_> = ranks.iter().filter_map(|b| Some((b.profile.as_ref()?, &b.gpu))).collect();
        profile::OpProfile::measure_all(&gpus, name, f)
    }

    pub(crate) fn gpu(&self) -> &runtime::Gpu {
        &self.gpu
    }

    fn alloc_buf(&self, len: usize) -> CudaBuf {
        CudaBuf { mem: self.gpu.alloc(len), len, bf16: None }
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Weight = CudaWeight;
    type Kv = CudaKv;
    type Idx = CudaIdx;
    type Hc = HcWeights<Self>;
    type HcHead = HcHeadWeights<Self>;
    type Moe = MoeWeights<Self>;

    fn graph_health(&self) -> Option<crate::GraphHealth> {
        Some(self.gpu.graph_health())
    }

    fn describe(&self) -> String {
        let g = &self.gpu;
        format!(
            "cuda:{} ({}, sm_{}{}, {} SMs, {:.0} GiB)",
            g.ordinal,
            g.name,
            g.cc.0,
            g.cc.1,
            g.sms,
            g.total_mem as f64 / (1u64 << 30) as f64
        )
    }

    fn zeros(&self, len: usize) -> CudaBuf {
        CudaBuf { mem: self.gpu.zeros(len), len, bf16: None }
    }

    fn output(&self, len: usize) -> CudaBuf {
        self.alloc_buf(len)
    }

    fn upload(&self, data: &[f32]) -> CudaBuf {
        CudaBuf { mem: self.gpu.upload(data), len: data.len(), bf16: None }
    }

    fn download(&self, buf: &CudaBuf) -> Vec<f32> {
        let mut out = vec![0f32; buf.len];
        self.prof("download", || self.gpu.read(&buf.mem, 0, &mut out));
        out
    }

    fn download_parts(&self, buf: &CudaBuf, lens: &[usize]) -> Vec<Vec<f32>> {
        assert_eq!(lens.iter().sum::<usize>(), buf.len, "download parts do not cover the buffer");
        if !runtime::staged_reads() {
            return crate::backend::split_parts(&self.download(buf), lens);
        }
        let mut parts: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0f32; n]).collect();
        self.prof("download", || self.gpu.read_parts(&buf.mem, &mut parts));
        parts
    }

    fn gather_rows(&self, src: &CudaBuf, width: usize, rows: &[usize]) -> CudaBuf {
        self.prof("gather_rows", || rows::gather_rows(self, src, width, rows))
    }

    fn greedy_rows(&self, logits: &CudaBuf, rows: usize, vocab: usize) -> Vec<(u32, f32)> {
        let picks = self.greedy_rows_start(logits, rows, vocab);
        self.greedy_rows_finish(picks)
    }

    fn greedy_rows_start(&self, logits: &CudaBuf, rows: usize, vocab: usize) -> GreedyPicks<CudaBuf> {
        if rows == 0 {
            return GreedyPicks::Ready(Vec::new());
        }
        let buf = self.prof("greedy_rows", || rows::greedy_rows_start(self, logits, rows, vocab));
        GreedyPicks::OnDevice { buf, rows }
    }

    fn weight(&self, w: WeightView<'_>) -> CudaWeight {
        memory::upload_weight(&self.gpu, &self.staging, &w)
    }

    fn finish_load(&self) {
        self.staging.release(&self.gpu.stream);
    }

    fn begin_step(&self, plan: &BatchPlan) {
        let decode = plan.seqs.iter().all(|s| s.rows == 1);
        let rows = plan.rows();
        if decode
            && (1..=step_graph::GRAPH_MAX_ROWS).contains(&rows)
            && self.profile.as_ref().is_none_or(|p| p.times_host())
        {
            // The cached plan may hold pool memory of an eager op; the step's own goes
            // to the arena (its addresses are part of what a graph replays).
            self.plans.clear();
            self.gpu.begin_recording();
        }
    }

    fn end_step(&self) {
        if self.gpu.arena_active() {
            self.gpu.end_recording();
            // Its buffers are arena pieces the next step reuses.
            self.plans.clear();
        }
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

    fn weight_shape(&self, w: &CudaWeight) -> (usize, usize) {
        (w.rows, w.cols)
    }

    fn kv_alloc(&self, elems: usize, dtype: EntryDtype) -> CudaKv {
        let bytes = elems * dtype.size();
        let mem = kv_buffer::KvBuffer::zeroed(&self.gpu.stream, bytes)
            .unwrap_or_else(|e| panic!("allocating {bytes} bytes of KV storage on cuda:{}: {e}", self.gpu.ordinal));
        CudaKv { mem: std::sync::Arc::new(mem), dtype, len: elems }
    }

    fn kv_read(&self, kv: &CudaKv, offset: usize, elems: usize) -> Vec<u8> {
        let sz = kv.dtype.size();
        assert!(offset + elems <= kv.len, "kv_read past the end of the storage");
        let mut out = vec![0u8; elems * sz];
        self.gpu.read(&kv.mem, offset * sz, &mut out);
        out
    }

    fn kv_read_into(&self, kv: &CudaKv, offset: usize, elems: usize, out: &mut [u8]) {
        let sz = kv.dtype.size();
        assert!(offset + elems <= kv.len, "kv_read past the end of the storage");
        assert_eq!(out.len(), elems * sz, "kv_read_into buffer is not {elems} elements");
        self.gpu.read(&kv.mem, offset * sz, out);
    }

    fn kv_fence(&self) {
        self.gpu.sync();
    }

    fn kv_device_memory(&self, kv: &CudaKv) -> Vec<Box<dyn crate::backend::DeviceMemory>> {
        let (ptr, len) = self.kv_device_range(kv);
        vec![Box::new(memory::CudaKvMemory { _mem: kv.mem.clone(), ptr, len, ordinal: self.gpu.ordinal })]
    }

    fn kv_sums(&self, kv: &CudaKv, ranges: &[crate::backend::SumRange]) -> Vec<u64> {
        let sz = kv.dtype.size();
        assert!(ranges.iter().all(|r| r.offset + r.elems <= kv.len), "kv_sums past the end of the storage");
        let bytes: Vec<checksum::ByteRange> = ranges
            .iter()
            .map(|r| checksum::ByteRange { offset: r.offset * sz, len: r.elems * sz, first_word: r.first_word })
            .collect();
        // The sums read what earlier ops wrote: the kernel runs after them on the stream.
        checksum::partial_sums(&self.gpu, self.gpu.ptr(&kv.mem), &bytes)
    }

    fn synchronize(&self) {
        self.gpu.sync();
    }

    fn pin_host(&self, region: &[u8]) -> Option<Box<dyn crate::backend::HostPin>> {
        memory::HostRegistration::new(&self.gpu.ctx, region).map(|p| Box::new(p) as Box<dyn crate::backend::HostPin>)
    }

    fn kv_write(&self, kv: &mut CudaKv, offset: usize, bytes: &[u8]) {
        let sz = kv.dtype.size();
        assert_eq!(bytes.len() % sz, 0, "kv_write of a partial element");
        assert!(offset * sz + bytes.len() <= kv.len * sz, "kv_write past the end of the storage");
        self.gpu.write_raw(self.gpu.ptr(&kv.mem) + (offset * sz) as u64, bytes);
    }

    fn buf_read(&self, buf: &CudaBuf, offset: usize, len: usize) -> Vec<f32> {
        assert!(offset + len <= buf.len, "buf_read past the end of the buffer");
        let mut out = vec![0f32; len];
        self.gpu.read(&buf.mem, offset, &mut out);
        out
    }

    fn buf_write(&self, buf: &mut CudaBuf, offset: usize, data: &[f32]) {
        assert!(offset + data.len() <= buf.len, "buf_write past the end of the buffer");
        self.gpu.write(&mut buf.mem, offset, data);
    }

    fn idx_download(&self, idx: &CudaIdx) -> Vec<i32> {
        let mut out = vec![0i32; idx.len];
        self.gpu.read(&idx.mem, 0, &mut out);
        out
    }

    fn embed(&self, table: &CudaWeight, plan: &BatchPlan, out: &mut CudaBuf) {
        self.prof("embed", || rows::embed(self, table, &plan.tokens, out))
    }

    fn matmul(&self, x: &CudaBuf, rows: usize, w: &CudaWeight, out: &mut CudaBuf) {
        assert_eq!(x.len, rows * w.cols, "matmul input is not [rows, {}]", w.cols);
        assert_eq!(out.len, rows * w.rows, "matmul output is not [rows, {}]", w.rows);
        let g = &self.gpu;
        let op = matmul::Operand::contiguous(g.ptr(&x.mem), g.ptr(&out.mem), rows, 1, w);
        let label = if gemm_rows::gemm_rows_plan(g, &op, w).is_some() {
            "matmul (rows)"
        } else if matmul::fp8_rows_on_wgmma(g, &op, w) {
            "matmul (fp8wg)"
        } else if matmul::gemv_loops(g, rows, w.rows) && !cublas_bf16::takes(rows, w) {
            "matmul (gemv)"
        } else {
            "matmul (cuBLAS)"
        };
        self.prof(label, || matmul::matmul(g, op, w));
    }

    fn fork(&self) {
        self.gpu.fork()
    }

    fn to_main(&self) {
        self.gpu.to_main()
    }

    fn join(&self) {
        self.gpu.join()
    }

    fn matmul_many(&self, x: &CudaBuf, rows: usize, ws: &[&CudaWeight], outs: &mut [&mut CudaBuf]) {
        assert_eq!(ws.len(), outs.len(), "matmul_many needs one output per weight");
        let g = &self.gpu;
        for (w, out) in ws.iter().zip(outs.iter()) {
            assert_eq!(x.len, rows * w.cols, "matmul input is not [rows, {}]", w.cols);
            assert_eq!(out.len, rows * w.rows, "matmul output is not [rows, {}]", w.rows);
        }
        let products: Vec<(&CudaWeight, u64)> = ws.iter().zip(outs.iter()).map(|(w, o)| (*w, g.ptr(&o.mem))).collect();
        self.prof("matmul (many)", || matmul_many::matmul_many(g, g.ptr(&x.mem), rows, &products, x.bf16.as_ref()));
    }

    fn grouped_matmul(&self, x: &CudaBuf, rows: usize, groups: usize, w: &CudaWeight, out: &mut CudaBuf) {
        assert!(groups > 0 && w.rows.is_multiple_of(groups), "grouped weight rows not divisible by groups");
        assert_eq!(x.len, rows * groups * w.cols, "grouped_matmul input shape");
        assert_eq!(out.len, rows * w.rows, "grouped_matmul output shape");
        let g = &self.gpu;
        let op = matmul::Operand::contiguous(g.ptr(&x.mem), g.ptr(&out.mem), rows, groups, w);
        self.prof("grouped_matmul", || matmul::matmul(g, op, w));
    }

    fn rms_norm(&self, x: &mut CudaBuf, dim: usize, weight: Option<&CudaBuf>, eps: f32) {
        self.prof("rms_norm", || rows::rms_norm(self, x, dim, weight, eps))
    }

    fn rope(&self, x: &mut CudaBuf, heads: usize, head_dim: usize, positions: &[u32], rope: &RopeTable, inverse: bool) {
        self.prof("rope", || rows::rope(self, x, heads, head_dim, positions, rope, inverse))
    }

    fn scale(&self, x: &mut CudaBuf, factor: f32) {
        self.prof("scale", || rows::scale(self, x, factor))
    }

    fn add_into(&self, acc: &mut CudaBuf, x: &CudaBuf) {
        assert_eq!(acc.len, x.len, "add_into of buffers of different lengths");
        let g = &self.gpu;
        if acc.len > 0 {
            launch!(g, "add_into", runtime::cfg_elems(acc.len), g.ptr(&acc.mem), g.ptr(&x.mem), acc.len as i64);
        }
    }

    fn round_to(&self, x: &mut CudaBuf, fmt: &EntryFormat) {
        self.prof("round_to", || rows::round_to(self, x, fmt))
    }

    fn head_norm_rope(
        &self,
        x: &mut CudaBuf,
        heads: usize,
        head_dim: usize,
        weight: Option<&CudaBuf>,
        eps: f32,
        positions: &[u32],
        rope: &RopeTable,
        round: Option<&EntryFormat>,
    ) {
        let fused = self.prof("head_norm_rope", || {
            rows::head_norm_rope(self, x, heads, head_dim, weight, eps, positions, rope, round)
        });
        if !fused {
            self.rms_norm(x, head_dim, weight, eps);
            self.rope(x, heads, head_dim, positions, rope, false);
            if let Some(fmt) = round {
                self.round_to(x, fmt);
            }
        }
    }

    fn head_norm_rope2(
        &self,
        first: &mut HeadNormJob<'_, Self>,
        second: &mut HeadNormJob<'_, Self>,
        shared: &HeadNormShared<'_>,
    ) {
        if !self.prof("head_norm_rope", || rows::head_norm_rope2(self, first, second, shared)) {
            first.run_alone(self, shared);
            second.run_alone(self, shared);
        }
    }

    fn hc_pre(
        &self,
        streams: &CudaBuf,
        rows: usize,
        w: &HcWeights<Self>,
        norm: Option<(&CudaBuf, f32)>,
        collapsed: &mut CudaBuf,
        post: &mut CudaBuf,
        comb: &mut CudaBuf,
    ) {
        self.prof("hc_pre", || hc::hc_pre(self, streams, rows, w, norm, collapsed, post, comb))
    }

    fn hc_pre_copies(
        &self,
        streams: &StreamCopies<'_, Self>,
        w: &HcWeights<Self>,
        norm: Option<(&CudaBuf, f32)>,
        collapsed: &mut CudaBuf,
        post: &mut CudaBuf,
        comb: &mut CudaBuf,
    ) {
        self.prof("hc_pre", || hc::hc_pre_copies(self, streams, w, norm, collapsed, post, comb))
    }

    fn hc_post_pre_copies(
        &self,
        streams: &StreamCopies<'_, Self>,
        out: &CudaBuf,
        w: &HcWeights<Self>,
        norm: Option<(&CudaBuf, f32)>,
        collapsed: &mut CudaBuf,
        post: &mut CudaBuf,
        comb: &mut CudaBuf,
    ) -> CudaBuf {
        hc::hc_post_pre_copies(self, streams, out, w, norm, collapsed, post, comb)
    }

    fn hc_post(&self, streams: &mut CudaBuf, rows: usize, hc: usize, out: &CudaBuf, post: &CudaBuf, comb: &CudaBuf) {
        self.prof("hc_post", || hc::hc_post(self, streams, rows, hc, out, post, comb))
    }

    fn hc_post_pre(
        &self,
        streams: &mut CudaBuf,
        rows: usize,
        hc: usize,
        out: &CudaBuf,
        w: &HcWeights<Self>,
        norm: Option<(&CudaBuf, f32)>,
        collapsed: &mut CudaBuf,
        post: &mut CudaBuf,
        comb: &mut CudaBuf,
    ) {
        hc::hc_post_pre(self, streams, rows, hc, out, w, norm, collapsed, post, comb)
    }

    fn hc_head(&self, streams: &CudaBuf, rows: usize, w: &HcHeadWeights<Self>, out: &mut CudaBuf) {
        self.prof("hc_head", || hc::hc_head(self, streams, rows, w, out))
    }

    fn moe(
        &self,
        x: &CudaBuf,
        rows: usize,
        tokens: &[u32],
        w: &MoeWeights<Self>,
        shared_rows: std::ops::Range<usize>,
        out: &mut CudaBuf,
    ) {
        self.prof("moe", || moe::moe(self, x, rows, tokens, w, shared_rows, out))
    }

    fn compress(
        &self,
        kv: &mut KvViewMut<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        branch: Branch,
        plan: &BatchPlan,
        proj_kv: &CudaBuf,
        proj_score: &CudaBuf,
        p: &CompressorParams<'_, Self>,
    ) {
        self.prof("compress", || compress::compress(self, kv, layout, layer, branch, plan, proj_kv, proj_score, p))
    }

    fn index_topk(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &CudaBuf,
        weights: &CudaBuf,
        heads: usize,
        top_k: usize,
    ) -> Selection<Self> {
        self.prof("index_topk", || attention::index_topk(self, kv, layout, layer, plan, q, weights, heads, top_k, None))
    }

    fn indexer_select(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &mut CudaBuf,
        weights: &mut CudaBuf,
        heads: usize,
        top_k: usize,
        rope: &RopeTable,
        weight_scale: f32,
    ) -> Selection<Self> {
        if !attention::takes_prep(self, layout, layer, plan, heads, top_k) {
            let (k, scale) = (top_k, weight_scale);
            return indexer_select_apart(self, kv, layout, layer, plan, q, weights, heads, k, rope, scale);
        }
        // The rotation and the scale inside the scoring's own launches.
        let prep = attention::IndexerPrep { rope, weight_scale };
        self.prof("index_topk", || {
            attention::index_topk(self, kv, layout, layer, plan, q, weights, heads, top_k, Some(prep))
        })
    }

    fn attention(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &CudaBuf,
        new_kv: &CudaBuf,
        selected: Option<&Selection<Self>>,
        sinks: &CudaBuf,
        heads: usize,
        scale: f32,
        out: &mut CudaBuf,
    ) {
        self.prof("attention", || {
            attention::attention(
                self,
                kv,
                layout,
                layer,
                plan,
                q,
                new_kv,
                selected,
                sinks,
                heads,
                scale,
                None,
                AttnOut::F32(out),
            )
        })
    }

    fn attention_preps_query(&self, layout: &KvLayout, layer: usize, plan: &BatchPlan, heads: usize) -> bool {
        attention_io::preps_query(&self.gpu, layout, layer, plan, heads)
    }

    fn attention_of_raw_query(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        q: &mut CudaBuf,
        new_kv: &CudaBuf,
        selected: Option<&Selection<Self>>,
        sinks: &CudaBuf,
        heads: usize,
        scale: f32,
        prep: &QueryPrep<'_>,
        out: &mut CudaBuf,
    ) {
        let io = AttentionIo { q, new_kv, selected, sinks, heads, scale, prep: Some(prep) };
        self.prof("attention", || attention_io::attend(self, kv, layout, (layer, plan), io, AttnOut::F32(out)))
    }

    fn attention_projected(
        &self,
        kv: &KvView<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        io: AttentionIo<'_, Self>,
        proj: &OutputProjection<'_, Self>,
        out: &mut CudaBuf,
    ) {
        if !attention_io::projects_in_bf16(&self.gpu, plan.rows(), proj.groups, proj.wo_a) {
            return attention_projected_apart(self, kv, layout, layer, plan, io, proj, out);
        }
        self.prof("attention", || attention_io::attention_projected(self, kv, layout, (layer, plan), io, proj, out))
    }

    fn store_window(
        &self,
        kv: &mut KvViewMut<'_, Self>,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        new_kv: &CudaBuf,
    ) {
        self.prof("store_window", || attention::store_window(self, kv, layout, layer, plan, new_kv))
    }
}
