//! The GPU a [`super::CudaBackend`] drives: context, one stream, cuBLAS handle and the
//! loaded kernels, plus allocation, copies and launches with every return code checked.
//!
//! Everything runs on one stream in issue order, so kernels need no events between them
//! and cudarc's per-buffer event tracking is switched off (it would add two event
//! records per launch argument). Host-visible results come back through synchronous
//! copies. Thread affinity: the context is bound to the calling thread before each
//! driver call that needs it (cudarc does this), so any thread may use the backend,
//! though the engine drives it from one.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};

pub(crate) use super::arena::DevBuf;

use super::nvrtc;

/// Why a CUDA backend could not start.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver: libcuda could not be loaded (no NVIDIA GPU or driver on this machine)")]
    NoDriver,
    #[error("CUDA library {0} could not be loaded; put its directory on LD_LIBRARY_PATH")]
    NoLibrary(&'static str),
    #[error("CUDA device {ordinal} is not available ({count} device(s) present)")]
    NoDevice { ordinal: usize, count: i32 },
    #[error("CUDA driver call failed: {0}")]
    Driver(String),
    #[error("kernel compilation failed: {0}")]
    Compile(String),
}

/// Every kernel the sources define but the v2 products ([`super::decode_v2::D2_KERNELS`]);
/// looked up once at start ([`loaded_kernels`]).
const KERNELS: &[&str] = &[
    "embed_f32",
    "embed_bf16",
    "embed_bf16_8",
    "embed_fp8",
    "embed_fp4",
    "gather_rows",
    "gather_rows4",
    "rms_norm",
    "rope",
    "head_norm_rope",
    "head_norm_rope2",
    "scale_f32",
    "greedy_parts",
    "greedy_finish",
    "round_to_bf16",
    "round_to_fp8",
    "split_bf16",
    "round_bf16_rows",
    "round_bf16_rows8",
    "gather_rows_bf16",
    "sum_split_halves",
    "gemv_f32_r1",
    "gemv_f32_r2",
    "gemv_f32_r4",
    "gemv_f32_r8",
    "gemv_bf16_r1",
    "gemv_bf16_r2",
    "gemv_bf16_r4",
    "gemv_bf16_r8",
    "gemv_many_bf16_r1",
    "gemv_many_bf16_r2",
    "products_from_chunks",
    "gemv_fp8_r1",
    "gemv_fp8_r2",
    "gemv_fp8_r4",
    "gemv_fp8_r8",
    "gemv_fp4_r1",
    "gemv_fp4_r2",
    "gemv_fp4_r4",
    "gemv_fp4_r8",
    "swiglu_f32_r1",
    "swiglu_f32_r2",
    "swiglu_f32_r4",
    "swiglu_f32_r8",
    "swiglu_bf16_r1",
    "swiglu_bf16_r2",
    "swiglu_bf16_r4",
    "swiglu_bf16_r8",
    "swiglu_fp8_r1",
    "swiglu_fp8_r2",
    "swiglu_fp8_r4",
    "swiglu_fp8_r8",
    "swiglu_fp4_r1",
    "swiglu_fp4_r2",
    "swiglu_fp4_r4",
    "swiglu_fp4_r8",
    "gemm_bf16",
    "gemm_fp8",
    "gemm_fp4",
    "tcgemv_bf16",
    "tcgemv_fp8",
    "tcgemv_fp4",
    "tcswiglu_bf16",
    "tcswiglu_fp8",
    "tcswiglu_fp4",
    "tcmoe_down_bf16",
    "tcmoe_down_fp8",
    "tcmoe_down_fp4",
    "tcmoe_swiglu_bf16",
    "tcmoe_swiglu_fp8",
    "tcmoe_swiglu_fp4",
    "gemm_bf16_hi",
    "gemm_fp8_hi",
    "gemm_fp4_hi",
    "gemm_fp4_f8",
    "quant_e4m3_rows",
    "hc_pre_finish",
    "hc_pre_finish_rows",
    "hc_weights_rows",
    "hc_collapse_rows",
    "hc_post",
    "hc_head_finish",
    "mix_rows_f32",
    "mix_rows_bf16",
    "hc_post_mix_f32",
    "hc_post_mix_bf16",
    "moe_route",
    "moe_slots_split",
    "moe_slots_swiglu",
    "moe_slots_out",
    "moe_lists",
    "moe_route_lists",
    "moe_localize",
    "moe_combine",
    "moe_combine_rows",
    "moe_combine_rows4",
    "moe_positions",
    "moe_down_f32_r1",
    "moe_down_f32_r2",
    "moe_down_f32_r4",
    "moe_down_f32_r8",
    "moe_down_bf16_r1",
    "moe_down_bf16_r2",
    "moe_down_bf16_r4",
    "moe_down_bf16_r8",
    "moe_down_fp8_r1",
    "moe_down_fp8_r2",
    "moe_down_fp8_r4",
    "moe_down_fp8_r8",
    "moe_down_fp4_r1",
    "moe_down_fp4_r2",
    "moe_down_fp4_r4",
    "moe_down_fp4_r8",
    "moe_swiglu_f32_r1",
    "moe_swiglu_f32_r2",
    "moe_swiglu_f32_r4",
    "moe_swiglu_f32_r8",
    "moe_swiglu_bf16_r1",
    "moe_swiglu_bf16_r2",
    "moe_swiglu_bf16_r4",
    "moe_swiglu_bf16_r8",
    "moe_swiglu_fp8_r1",
    "moe_swiglu_fp8_r2",
    "moe_swiglu_fp8_r4",
    "moe_swiglu_fp8_r8",
    "moe_swiglu_fp4_r1",
    "moe_swiglu_fp4_r2",
    "moe_swiglu_fp4_r4",
    "moe_swiglu_fp4_r8",
    "moe_accumulate",
    "moe_accumulate_rows",
    "add_into",
    "swiglu_act",
    "swiglu_bf16",
    "compress_stream",
    "compress_store",
    "index_scores",
    "index_scores_heads",
    "index_q_frags",
    "index_scores_mma",
    "index_scores_mma_bf16",
    "index_q_tile",
    "index_scores_wg",
    "topk_select",
    "topk_select_warp",
    "topk_hist",
    "topk_gather",
    "attention",
    "attention_merge",
    "attention_merge_rope_bf16",
    "attention_mma",
    "attention_wg",
    "attention_wg_whole",
    "hc_post_mix_rows_f32",
    "hc_post_mix_rows_bf16",
    "hc_post_mix_rows_tc_f32",
    "hc_post_mix_rows_tc_bf16",
    "hc_mix_copies_rows_f32",
    "hc_mix_copies_rows_bf16",
    "store_window",
    "gpu_sleep",
    "kv_checksum",
    "d2_rows_f16",
    "d2seg_swiglu_fp4_n1",
    "d2seg_swiglu_fp4_n2",
    "d2seg_down_fp4_n1",
    "d2seg_down_fp4_n2",
];

/// Kernels that take more than the default 48 KiB of dynamic shared memory, and the most
/// they are launched with (opted in at load; the shared-memory carveout set to its
/// maximum so several blocks of them fit an SM).
fn big_shared() -> Vec<(&'static str, usize)> {
    let mut v =
        vec![("compress_stream", super::compress::STREAM_MAX_SMEM), ("attention_mma", super::attention::MMA_DYN_SMEM)];
    v.push(("attention_wg", super::attention::WG_DYN_SMEM));
    v.push(("attention_wg_whole", super::attention::WG_DYN_SMEM));
    v.push(("hc_post_mix_rows_f32", super::hc::POST_MIX_ROWS_SMEM));
    v.push(("hc_post_mix_rows_bf16", super::hc::POST_MIX_ROWS_SMEM));
    v.push(("hc_post_mix_rows_tc_f32", super::hc::POST_MIX_ROWS_TC_SMEM));
    v.push(("hc_post_mix_rows_tc_bf16", super::hc::POST_MIX_ROWS_TC_SMEM));
    v.push(("index_scores_wg", super::indexer_wg::IW_DYN_SMEM));
    v.extend(super::matmul::GEMM_KERNELS.iter().map(|&n| (n, super::matmul::gemm_smem(n))));
    v.extend(super::decode_v2::D2_KERNELS.iter().map(|&n| (n, super::decode_v2::D2_MAX_SMEM)));
    v.extend(super::gemv_f8mma::F8MMA_KERNELS.iter().map(|&n| (n, super::gemv_f8mma::F8MMA_MAX_SMEM)));
    v.extend(super::gemv_f8wg::F8WG_KERNELS.iter().map(|&n| (n, super::gemv_f8wg::F8WG_MAX_SMEM)));
    v.extend(super::gemv_f8wg::F8WG_PAIR_KERNELS.iter().map(|&n| (n, super::gemv_f8wg::F8WG_MAX_SMEM)));
    v.extend(super::gemv_f8wg::F8WG_MANY_KERNELS.iter().map(|&n| (n, super::gemv_f8wg::F8WG_MAX_SMEM)));
    v.extend(super::moe_wgmma::WGMOE_KERNELS.iter().map(|&n| (n, super::moe_wgmma::WGMOE_MAX_SMEM)));
    v.extend(super::gemm_rows::GEMM_ROWS_KERNELS.iter().map(|&n| (n, super::gemm_rows::GEMM_ROWS_SMEM)));
    v.extend(super::moe_fp4wg::FP4WG_KERNELS.iter().zip(super::moe_fp4wg::FP4WG_SMEM).map(|(&n, s)| (n, s)));
    v.extend(super::moe_fp4wg::FP4WG_ONE_PART_KERNELS.iter().zip(super::moe_fp4wg::FP4WG_SMEM).map(|(&n, s)| (n, s)));
    v.extend(super::moe_fp4wg::WIDE_KERNELS);
    v
}

/// The kernels a backend looks up at start: [`KERNELS`], the v2 products, the FP8
/// tensor-core gemv, the BF16 products of 9-32 rows and the prefill `wgmma` products.
pub(super) fn loaded_kernels() -> impl Iterator<Item = &'static str> {
    KERNELS
        .iter()
        .chain(super::decode_v2::D2_KERNELS.iter())
        .chain(super::gemv_f8mma::F8MMA_KERNELS.iter())
        .chain(super::gemv_f8wg::F8WG_KERNELS.iter())
        .chain(super::gemv_f8wg::F8WG_PAIR_KERNELS.iter())
        .chain(super::gemv_f8wg::F8WG_MANY_KERNELS.iter())
        .chain(super::moe_wgmma::WGMOE_KERNELS.iter())
        .chain(super::gemm_rows::GEMM_ROWS_KERNELS.iter())
        .chain(super::moe_fp4wg::FP4WG_KERNELS.iter())
        .chain(super::moe_fp4wg::FP4WG_ONE_PART_KERNELS.iter())
        .copied()
        .chain(super::moe_fp4wg::WIDE_KERNELS.iter().map(|&(name, _)| name))
}

/// Scratch name of the device-side traffic counter.
const DEVICE_TRAFFIC: &str = "traffic_device";

/// Bytes the ops must move through device memory at least (each weight and each KV
/// entry read once), counted on the host as ops are issued; the benchmark divides them
/// by the step time to get the achieved bandwidth.
#[derive(Default)]
pub(crate) struct Traffic {
    pub weights: AtomicU64,
    pub kv: AtomicU64,
    /// Floating-point operations of the products (2 per multiply-add of every weight
    /// with every row it multiplies; the routed experts' too), for prefill's TFLOP/s.
    pub flops: AtomicU64,
}

impl Traffic {
    pub fn add_weights(&self, bytes: usize) {
        self.weights.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn add_flops(&self, flops: usize) {
        self.flops.fetch_add(flops as u64, Ordering::Relaxed);
    }

    pub fn add_kv(&self, bytes: usize) {
        self.kv.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// A constant table's words on the host (to tell tables of one hash apart) and its device copy.
type TableCopy = (Vec<u64>, CudaSlice<u64>);

pub(crate) struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// The main stream's cuBLAS handle, with its own workspace (`blas_op`); handles are
    /// not safe to use from two threads at once.
    pub blas: ManuallyDrop<Mutex<super::blas_op::BlasHandle>>,
    /// The kernels (each holds the module, unloaded with the last of them).
    funcs: ManuallyDrop<HashMap<&'static str, CudaFunction>>,
    pub sms: usize,
    pub name: String,
    pub cc: (i32, i32),
    /// Kernels launched with programmatic dependent launch ([`Gpu::launch_raw`]).
    pub pdl: bool,
    pub total_mem: usize,
    pub ordinal: usize,
    /// The activations' precision in bf16 tensor-core products (set before weights load).
    pub activations: crate::Activations,
    /// Where the kernels came from (compiled now, or the PTX cache file).
    pub ptx_origin: String,
    pub traffic: Traffic,
    /// Kernel launches and library calls (cuBLAS, NCCL) issued, for the benchmark's
    /// launches per step.
    pub launches: AtomicU64,
    /// Persistent scratch by name, and whether it serves a recorded branch's side lane
    /// (the two lanes may run at once, so each has its own).
    scratch: Mutex<HashMap<(&'static str, bool), CudaSlice<u32>>>,
    /// Resident blocks per SM by (kernel, threads, dynamic shared memory).
    occupancy: Mutex<HashMap<(&'static str, u32, u32), usize>>,
    /// Device copies of small constant tables (per-expert weight pointers), by content:
    /// buckets by a hash of the words.
    tables: Mutex<HashMap<u64, Vec<TableCopy>>>,
    /// Pinned buffers of large reads.
    pub(super) download: ManuallyDrop<super::download::Download>,
    /// Decode steps recorded and replayed as CUDA graphs (`step_graph`).
    pub(crate) steps: ManuallyDrop<super::step_graph::Steps>,
}

impl Drop for Gpu {
    /// The parts whose release may synchronize the context (cuBLAS handles, pinned
    /// buffers, graphs, the module) go first, under the device's `capture_lock`, so that
    /// no other engine's capture on the same GPU is running meanwhile.
    fn drop(&mut self) {
        let _sync = super::capture_lock::may_sync(self.ordinal);
        // SAFETY: each is dropped once, here, and never used after: this is the Gpu's drop.
        unsafe {
            ManuallyDrop::drop(&mut self.steps);
            ManuallyDrop::drop(&mut self.download);
            ManuallyDrop::drop(&mut self.blas);
            ManuallyDrop::drop(&mut self.funcs);
        }
    }
}

/// Whether this process can load the CUDA driver at all (false on machines without an
/// NVIDIA driver; nothing else is touched).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn drv<E: std::fmt::Debug>(e: E) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

impl Gpu {
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        // SAFETY: dlopen probes only.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaError::NoLibrary("libnvrtc"));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::NoLibrary("libcublas"));
        }
        cudarc::driver::result::init().map_err(drv)?;
        let count = CudaContext::device_count().map_err(drv)?;
        if ordinal as i32 >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        // Loading a module, making a cuBLAS handle and pinning memory may synchronize the
        // context: not while another engine of the process captures on this GPU.
        let _sync = super::capture_lock::may_sync(ordinal);
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        // SAFETY: every launch and copy of this backend goes to the one stream below, in
        // issue order, so the per-buffer events cudarc would otherwise record are not
        // needed to order them.
        unsafe { ctx.disable_event_tracking() };
        keep_pool_memory(&ctx)?;
        super::download::keep_host_allocations();
        let stream = ctx.new_stream().map_err(drv)?;
        let blas = super::blas_op::handle_with_workspace(&stream).map_err(CudaError::Driver)?;
        let cc = ctx.compute_capability().map_err(drv)?;
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv)? as usize;
        let (module, ptx_origin) = nvrtc::load(&ctx, cc)?;
        let mut funcs = HashMap::new();
        for name in loaded_kernels() {
            let f = module.load_function(name).map_err(|e| CudaError::Driver(format!("kernel {name}: {e:?}")))?;
            funcs.insert(name, f);
        }
        // Kernels that need more shared memory than this GPU lets a block opt in to (the
        // sm_90-only ones on smaller parts) are never launched there: left as they are.
        let optin = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv)? as usize;
        for (name, bytes) in big_shared().into_iter().filter(|&(_, bytes)| bytes <= optin) {
            use cudarc::driver::sys::CUfunction_attribute::{
                CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            };
            let f = &funcs[name];
            f.set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .and_then(|()| f.set_attribute(CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
                .map_err(|e| CudaError::Driver(format!("kernel {name}: {bytes} B of shared memory: {e:?}")))?;
        }
        Ok(Gpu {
            name: ctx.name().map_err(drv)?,
            total_mem: ctx.total_mem().map_err(drv)?,
            ctx,
            stream,
            blas: ManuallyDrop::new(Mutex::new(blas)),
            funcs: ManuallyDrop::new(funcs),
            sms,
            cc,
            pdl: super::launch::pdl_enabled(cc),
            ordinal,
            activations: crate::Activations::process_default(),
            ptx_origin,
            traffic: Traffic::default(),
            launches: AtomicU64::new(0),
            scratch: Mutex::new(HashMap::new()),
            occupancy: Mutex::new(HashMap::new()),
            tables: Mutex::new(HashMap::new()),
            download: Default::default(),
            steps: ManuallyDrop::new(super::step_graph::Steps::new()),
        })
    }

    pub fn func(&self, name: &str) -> &CudaFunction {
        self.funcs.get(name).unwrap_or_else(|| panic!("unknown CUDA kernel {name}"))
    }

    /// Device address of a u64 the kernels add weight bytes to where only the device
    /// knows what they read (experts routed on the device); see [`Gpu::take_device_traffic`].
    pub fn traffic_counter(&self) -> u64 {
        // One counter for both lanes of a branch: the kernels add to it atomically.
        self.scratch_of(DEVICE_TRAFFIC, 2, false)
    }

    /// The bytes added to [`Gpu::traffic_counter`] since the last call (waits for the
    /// device), and resets it.
    pub fn take_device_traffic(&self) -> u64 {
        self.traffic_counter();
        let mut map = self.scratch.lock().expect("scratch map poisoned");
        let buf = map.get_mut(&(DEVICE_TRAFFIC, false)).expect("traffic counter allocated above");
        let mut words = [0u32; 2];
        self.read(buf, 0, &mut words);
        self.memset_zero(buf);
        u64::from(words[0]) | (u64::from(words[1]) << 32)
    }

    /// Device address of a scratch buffer of at least `len` u32 that lives as long as
    /// the GPU: zeroed when first allocated (or regrown), then handed out again without
    /// a memset. Kernels that pass counters between blocks (tickets, histograms,
    /// append cursors) keep theirs zeroed when they finish, so a step issues no memsets
    /// and no allocations for them. One stream orders every use, so a regrown buffer's
    /// predecessor is freed only after the kernels that used it.
    pub fn scratch(&self, name: &'static str, len: usize) -> u64 {
        self.scratch_of(name, len, self.on_side_lane())
    }

    /// [`Gpu::scratch`] of one lane of a recorded branch (`side`), or the main lane's.
    fn scratch_of(&self, name: &'static str, len: usize, side: bool) -> u64 {
        let mut map = self.scratch.lock().expect("scratch map poisoned");
        let buf = map.entry((name, side)).or_insert_with(|| self.zeros_owned::<u32>(len));
        if buf.len() < len {
            let old = std::mem::replace(buf, self.zeros_owned::<u32>(len.next_power_of_two()));
            // Recorded ops may still name the old buffer.
            self.retire_during_recording(old);
        }
        self.ptr(buf)
    }

    /// Device address of a copy of `table`, uploaded once per distinct content and kept
    /// for the GPU's lifetime (tables of weight pointers are the same every step; a
    /// decode step then issues no host-to-device copy for them). Looked up by a cheap
    /// hash of the words and their comparison with the cached copy (a routed layer's
    /// tables are 1,024 words, looked up twice a layer and step).
    pub fn constant_table(&self, table: &[u64]) -> u64 {
        self.constant_table_within(table, usize::MAX).expect("no bound on the tables")
    }

    /// [`Gpu::constant_table`], or `None` (nothing uploaded) where the table is new and
    /// `max_tables` tables are kept already.
    pub fn constant_table_within(&self, table: &[u64], max_tables: usize) -> Option<u64> {
        let key =
            table.iter().fold(table.len() as u64, |h, &w| (h.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95));
        let mut map = self.tables.lock().expect("table map poisoned");
        if let Some((_, buf)) = map.get(&key).and_then(|b| b.iter().find(|(host, _)| host.as_slice() == table)) {
            return Some(self.ptr(buf));
        }
        if map.values().map(Vec::len).sum::<usize>() >= max_tables {
            return None;
        }
        let buf = self.upload_owned(table);
        let ptr = self.ptr(&buf);
        // Tables of the same hash share a bucket.
        map.entry(key).or_default().push((table.to_vec(), buf));
        Some(ptr)
    }

    /// How many blocks of `name` with `threads` threads and `smem` bytes of dynamic shared
    /// memory fit on one SM at once (the driver's occupancy figure, at least 1), cached.
    pub fn resident_blocks(&self, name: &'static str, threads: u32, smem: u32) -> usize {
        let mut map = self.occupancy.lock().expect("occupancy map poisoned");
        *map.entry((name, threads, smem)).or_insert_with(|| {
            let n = self
                .func(name)
                .occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
                .unwrap_or_else(|e| fail(&format!("occupancy of {name}"), e));
            n.max(1) as usize
        })
    }

    /// Uninitialised device memory of `len` elements (at least one, so every buffer has
    /// a real address): from the step arena while a decode step records (`arena`), else
    /// stream-ordered (freed memory is reused without a device sync).
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> DevBuf<T> {
        match self.arena_slice::<T>(len.max(1), false) {
            Some(buf) => buf,
            None => DevBuf::owned(self.alloc_owned(len)),
        }
    }

    /// [`Gpu::alloc`] from the pool always: memory that outlives a step (weights, tables).
    pub fn alloc_owned<T: DeviceRepr>(&self, len: usize) -> CudaSlice<T> {
        // SAFETY: callers write every element they later read (kernels fully cover
        // their outputs; `zeros` memsets).
        unsafe { self.stream.alloc::<T>(len.max(1)) }.unwrap_or_else(|e| fail("allocation", e))
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> DevBuf<T> {
        let mut buf = self.alloc::<T>(len);
        self.memset_zero(&mut buf);
        buf
    }

    pub fn zeros_owned<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> CudaSlice<T> {
        self.stream.alloc_zeros::<T>(len.max(1)).unwrap_or_else(|e| fail("allocation", e))
    }

    /// A device copy of `data`. While a step records, into the arena's top, copied now:
    /// the step's recorded kernels, issued later, read it after it has landed.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> DevBuf<T> {
        let Some(mut dst) = self.arena_slice::<T>(data.len().max(1), true) else {
            return DevBuf::owned(self.upload_owned(data));
        };
        if !data.is_empty() {
            self.stream.memcpy_htod(data, &mut *dst).unwrap_or_else(|e| fail("host-to-device copy", e));
        }
        dst
    }

    pub fn upload_owned<T: DeviceRepr>(&self, data: &[T]) -> CudaSlice<T> {
        let mut dst = self.alloc_owned::<T>(data.len());
        if !data.is_empty() {
            self.stream.memcpy_htod(data, &mut dst).unwrap_or_else(|e| fail("host-to-device copy", e));
        }
        dst
    }

    /// Copy `out.len()` elements starting at element `offset` to the host and wait.
    pub fn read<T: DeviceRepr>(&self, src: &CudaSlice<T>, offset: usize, out: &mut [T]) {
        self.flush_recording();
        if out.is_empty() {
            return;
        }
        let bytes = std::mem::size_of_val(out);
        if bytes >= super::download::STAGED_READ_MIN_BYTES && staged_reads() {
            assert!(
                offset + out.len() <= src.len(),
                "read of {} elements at {offset} past the buffer's {}",
                out.len(),
                src.len()
            );
            self.ctx.bind_to_thread().unwrap_or_else(|e| fail("binding the context", e));
            // The range lies inside `src` (asserted above).
            let at = self.ptr(src) + (offset * std::mem::size_of::<T>()) as u64;
            self.download.read(&self.stream, at, &mut [super::download::bytes_mut(out)]);
            return;
        }
        let view = src.slice(offset..offset + out.len());
        self.stream.memcpy_dtoh(&view, out).unwrap_or_else(|e| fail("device-to-host copy", e));
        self.sync();
    }

    /// Copy the first values of `src` into `parts`, one after another, and wait: through
    /// pinned pieces when large (`download`).
    pub fn read_parts(&self, src: &CudaSlice<f32>, parts: &mut [Vec<f32>]) {
        self.flush_recording();
        let total: usize = parts.iter().map(Vec::len).sum();
        assert!(total <= src.len(), "read parts of {total} values from a buffer of {}", src.len());
        if 4 * total < super::download::STAGED_READ_MIN_BYTES {
            let mut all = vec![0f32; total];
            self.read(src, 0, &mut all);
            let mut at = 0;
            for p in parts.iter_mut() {
                let n = p.len();
                p.copy_from_slice(&all[at..at + n]);
                at += n;
            }
            return;
        }
        self.ctx.bind_to_thread().unwrap_or_else(|e| fail("binding the context", e));
        let mut outs: Vec<&mut [u8]> = parts.iter_mut().map(|p| super::download::bytes_mut(p)).collect();
        self.download.read(&self.stream, self.ptr(src), &mut outs);
    }

    pub fn write<T: DeviceRepr>(&self, dst: &mut CudaSlice<T>, offset: usize, data: &[T]) {
        // Into memory recorded ops may use: not something to run ahead of them.
        self.flush_recording();
        if data.is_empty() {
            return;
        }
        let mut view = dst.slice_mut(offset..offset + data.len());
        self.stream.memcpy_htod(data, &mut view).unwrap_or_else(|e| fail("host-to-device copy", e));
    }

    /// Copy `out.len()` bytes at device address `src` to the host and wait. The address
    /// must lie in live device memory of this GPU (a buffer shared with a transport,
    /// reached by address because other owners hold it too).
    pub fn read_raw(&self, src: u64, out: &mut [u8]) {
        self.flush_recording();
        if out.is_empty() {
            return;
        }
        self.ctx.bind_to_thread().unwrap_or_else(|e| fail("binding the context", e));
        // SAFETY: the caller passes an address range inside a live allocation of this
        // context; `out` is a live host buffer of exactly the copied length, and the sync
        // below ends the copy before `out` is used again.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(out, src, self.stream.cu_stream()) }
            .unwrap_or_else(|e| fail("device-to-host copy", e));
        self.sync();
    }

    /// Copy `data` to device address `dst` (asynchronous from pinned memory, as
    /// [`Gpu::write`]). The range must lie in live device memory of this GPU.
    pub fn write_raw(&self, dst: u64, data: &[u8]) {
        self.flush_recording();
        if data.is_empty() {
            return;
        }
        self.ctx.bind_to_thread().unwrap_or_else(|e| fail("binding the context", e));
        // SAFETY: the caller passes a range inside a live allocation of this context;
        // the source is a live host slice (pinned sources are fenced by the caller, as
        // for `write`).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, self.stream.cu_stream()) }
            .unwrap_or_else(|e| fail("host-to-device copy", e));
    }

    /// Device-to-device copy of `bytes` between two ranges of live device memory of this
    /// GPU, in stream order.
    pub fn copy_raw(&self, dst: u64, src: u64, bytes: usize) {
        if bytes == 0 || self.record_copy(dst, src, bytes) {
            return;
        }
        self.ctx.bind_to_thread().unwrap_or_else(|e| fail("binding the context", e));
        // SAFETY: both ranges lie in live allocations of this context (the caller's
        // bounds checks), ordered on our one stream.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .unwrap_or_else(|e| fail("device-to-device copy", e));
    }

    pub fn memset_zero<T: DeviceRepr + ValidAsZeroBits>(&self, dst: &mut CudaSlice<T>) {
        if self.record_memset(self.ptr(dst), dst.len() * std::mem::size_of::<T>()) {
            return;
        }
        self.stream.memset_zeros(dst).unwrap_or_else(|e| fail("memset", e));
    }

    /// Wait for everything issued so far, and surface asynchronous kernel faults.
    pub fn sync(&self) {
        self.flush_recording();
        self.stream.synchronize().unwrap_or_else(|e| fail("stream synchronize", e));
    }

    /// Raw device address of a buffer, for kernel arguments.
    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _guard) = s.device_ptr(&self.stream);
        p
    }
}

/// Whether large reads go through the pinned pieces of `download` (the default) or one
/// pageable copy (`SLUICE_CUDA_STAGED_READS=0`, read once, to compare the two).
pub(crate) fn staged_reads() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_STAGED_READS").map_or(true, |v| v != "0"))
}

/// Keep freed memory in the device's stream-ordered pool. Its default release threshold
/// is 0, so every stream synchronisation (each decode step, each MoE routing read)
/// hands the pool's memory back to the driver and the next allocations map it again;
/// with the threshold at the maximum, a step's temporaries are reused from the pool.
fn keep_pool_memory(ctx: &Arc<CudaContext>) -> Result<(), CudaError> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the context is current on this thread (CudaContext::new binds it); the
    // out-pointer is a live local.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result().map_err(drv)?;
    let mut threshold = u64::MAX;
    // SAFETY: `pool` is the device's default pool; the attribute takes a u64 by pointer.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
    }
    .result()
    .map_err(drv)
}

/// A CUDA failure inside an op: the device state is unknown, so there is nothing to
/// recover; stop with the driver's message.
pub(crate) fn fail<E: std::fmt::Debug>(what: &str, e: E) -> ! {
    panic!("CUDA {what} failed: {e:?}")
}

/// `grid` blocks of `block` threads, `smem` bytes of dynamic shared memory.
pub(crate) fn cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: smem }
}

/// One thread per element, 256 per block.
pub(crate) fn cfg_elems(n: usize) -> cudarc::driver::LaunchConfig {
    cfg(((n.div_ceil(256)).max(1) as u32, 1, 1), 256, 0)
}

/// A thread a column (256 a block), a block row a row (≤ 65,535: kernels loop by gridDim.y).
pub(crate) fn cfg_row_cols(rows: usize, cols: usize) -> cudarc::driver::LaunchConfig {
    cfg((cols.div_ceil(256).max(1) as u32, rows.clamp(1, 65_535) as u32, 1), 256, 0)
}

/// Launch kernel `$name` with `$cfg` and the given arguments (device addresses as u64,
/// ints as i32, floats as f32, `#[repr(C)]` structs by value), checking the launch; see
/// [`Gpu::launch_raw`] for how it is ordered after the kernel before it.
macro_rules! launch {
    ($gpu:expr, $name:expr, $cfg:expr $(, $arg:expr)* $(,)?) => {{
        let gpu: &$crate::cuda::runtime::Gpu = $gpu;
        let mut args: Vec<*mut std::ffi::c_void> = Vec::with_capacity(16);
        let mut sizes: Vec<usize> = Vec::with_capacity(16);
        // Each value lives in its own (shadowed) binding until the end of this block,
        // after the launch (or the recording) has copied the arguments.
        $( let a = $arg; args.push($crate::cuda::runtime::arg_ptr(&a)); sizes.push(std::mem::size_of_val(&a)); )*
        gpu.launch_raw($name, $cfg, &mut args, &sizes);
    }};
}
pub(crate) use launch;

/// A kernel argument as the driver takes it: the address of its value.
pub(crate) fn arg_ptr<T: DeviceRepr>(value: &T) -> *mut std::ffi::c_void {
    value as *const T as *mut std::ffi::c_void
}

/// A count knob from the environment (rows: `SLUICE_CUDA_…_FROM`; blocks:
/// `SLUICE_CUDA_…_BLOCKS`), read by its caller once: the value when it parses as a
/// count, else None (the caller's default).
pub(crate) fn env_rows(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel given more shared memory at start is one the backend loads (a name
    /// missing from the tables fails every GPU backend at start, which no CPU test sees
    /// otherwise), and no kernel is listed twice.
    #[test]
    fn kernels_given_shared_memory_are_loaded_once() {
        let loaded: Vec<&str> = loaded_kernels().collect();
        for (name, _) in big_shared() {
            assert!(loaded.contains(&name), "{name} gets shared memory at start but is not loaded");
        }
        let mut sorted = loaded.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), loaded.len(), "a kernel is listed twice");
    }
}
