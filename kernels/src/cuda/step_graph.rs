//! Decode steps replayed as CUDA graphs (`SLUICE_CUDA_GRAPHS`, on unless `0`).
//!
//! A decode step (every sequence one row, at most [`GRAPH_MAX_ROWS`] rows) is recorded
//! instead of issued: its kernel launches, memsets and device copies are kept with their
//! argument bytes while its temporaries come from the step arena (`arena`), at addresses
//! that repeat when the step's ops repeat, and its host-to-device copies (the batch
//! plan, token ids, work lists) run at once into the arena's top, so no recorded op can
//! read them before they land. Every [`segment_ops`] ops (the step's first segment
//! after [`first_segment_ops`]), and at the step's first read back (the logits), the
//! segment recorded so far is compared, word for word, with the segments captured
//! before: an equal one replays that segment's graph; one seen once before is captured
//! (stream capture of the same ops) and replayed; anything else is issued as recorded,
//! which is what the step would have done without graphs. The device runs a segment
//! while the host records the next. Equality of every launch's function, grid, block,
//! shared memory and argument bytes is what makes a replay correct: the host values a
//! graph bakes in are exactly those this step computed, and everything else the kernels
//! read comes from device memory (the plan's positions and pages, the KV state, the
//! weights).
//!
//! Branches: between [`Gpu::fork`] and [`Gpu::join`] a step's ops are recorded on two
//! lanes — the side lane from the fork, the main lane again from [`Gpu::to_main`] — for
//! work that does not depend on each other (a CSA layer's indexer beside its main
//! compressor and query norms, the shared expert beside the routed ones). A captured graph runs the
//! lanes on two streams joined by the graph's edges, so at small batches two chains of
//! latency-bound kernels overlap; a segment issued as recorded runs every op on the one
//! stream in recorded order (a valid order of the same work). Temporaries freed inside a
//! branch are not reused before its join (`ArenaState::hold`), and a segment never ends
//! inside one (a flush joins it first).
//!
//! cuBLAS products are recorded too ([`BlasOp`]: the call's arguments, compared like a
//! launch's) and captured on their lane with that lane's handle, each with its own
//! workspace; `SLUICE_CUDA_GRAPH_CUBLAS=0` (read once) ends the recording at a step's
//! first cuBLAS call instead, as before they were recorded.
//!
//! A step is not replayed when something in it cannot be recorded (a read back, a copy
//! from the host into an existing buffer: the record is issued at that point and the
//! rest of the step runs eagerly), when the arena overflowed (what is recorded is issued
//! then and the rest runs eagerly, so that the pool memory taken instead is freed after
//! its users; the next step gets a larger arena), or when a persistent scratch buffer was
//! regrown (every captured graph is dropped: they point at the old one).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{CudaGraph, CudaSlice, LaunchConfig};

use super::arena::{ArenaState, DevBuf};
use super::blas_op::{BlasHandle, BlasOp, handle_with_workspace};
use super::runtime::{Gpu, fail};

/// Most rows of a step recorded for a graph: beyond it the arena would grow large and
/// batches are rarely repeated exactly.
pub(crate) const GRAPH_MAX_ROWS: usize = 64;
/// Graphs kept (least recently replayed dropped first).
const GRAPH_CACHE: usize = 512;
/// The first arena, grown to what a step needed when a step overflows it.
const FIRST_ARENA: usize = 64 << 20;

/// Recorded ops a segment holds (`SLUICE_CUDA_GRAPH_OPS`, read once; default 64). A
/// step is replayed segment by segment: the device starts on the first while the host
/// records the rest, instead of idling until the whole step is recorded (at batch 32 a
/// step takes the host ~0.5 ms to record). Segments end at fixed op counts, so equal
/// steps cut into equal segments.
fn segment_ops() -> usize {
    static OPS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *OPS.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_GRAPH_OPS").unwrap_or(64).max(1))
}

/// Recorded ops of a step's first segment (`SLUICE_CUDA_GRAPH_FIRST_OPS`, read once;
/// default 16): the device idles from the step's start until its first segment is
/// issued, so that one is cut short; the host, ahead from then on, records the rest in
/// [`segment_ops`] pieces while the device runs.
fn first_segment_ops() -> usize {
    static OPS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *OPS.get_or_init(|| super::runtime::env_rows("SLUICE_CUDA_GRAPH_FIRST_OPS").unwrap_or(16).max(1))
}

/// Whether decode steps are recorded for graphs: `SLUICE_CUDA_GRAPHS` is not `0` (read
/// once).
pub(crate) fn graphs_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_GRAPHS").map_or(true, |v| v != "0"))
}

/// Whether cuBLAS calls are recorded into steps (`SLUICE_CUDA_GRAPH_CUBLAS`, on unless `0`;
/// read once): off, the first one issues the step's record and the rest runs eagerly.
fn cublas_recorded() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_GRAPH_CUBLAS").map_or(true, |v| v != "0"))
}

/// Whether recorded steps keep the model's branches (`SLUICE_CUDA_BRANCHES`, on unless
/// `0`; read once): off, every op is recorded on the main lane.
fn branches_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_CUDA_BRANCHES").map_or(true, |v| v != "0"))
}

/// One recorded device op.
enum Op {
    Launch {
        func: usize,
        cfg: LaunchConfig,
        params: Vec<u64>,
        offsets: Vec<usize>,
    },
    Memset {
        dst: u64,
        bytes: usize,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    Blas(BlasOp),
    /// The ops that follow go on the side lane, after everything before.
    Fork,
    /// The ops that follow go on the main lane again (the side lane runs on).
    Main,
    /// The main lane waits for the side lane.
    Join,
}

#[derive(Default)]
struct Recording {
    ops: Vec<Op>,
    /// Something in the step makes its record unfit for a graph.
    spoiled: bool,
    /// The lane ops recorded now go on while a branch is open (a Fork without its Join).
    branch: Option<Lane>,
    /// Segments of this step issued before this one.
    issued: usize,
}

/// A lane of an open branch: the side one from its Fork, the main one again from its Main.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lane {
    Side,
    Main,
}

impl Recording {
    /// Close an open branch (before the record is issued: a segment holds whole ones).
    fn join(&mut self, arena: &ArenaState) {
        if self.branch.take().is_some() {
            self.ops.push(Op::Join);
            arena.hold(false);
        }
    }

    /// The ops recorded so far, as a segment to issue; this recording goes on with the
    /// step's next segment (counted, so the first one keeps its own length).
    fn take_segment(&mut self) -> Recording {
        let issued = self.issued + 1;
        let part = std::mem::take(self);
        self.issued = issued;
        part
    }
}

/// A captured step.
struct Replay {
    key: Vec<u64>,
    graph: CudaGraph,
    used: u64,
}

// SAFETY: a graph is only touched under the `Steps::cache` mutex, one thread at a time,
// which is what the driver requires of graph objects.
unsafe impl Send for Replay {}

#[derive(Default)]
struct Cache {
    graphs: HashMap<u64, Replay>,
    /// Keys seen once and not captured yet.
    seen: HashMap<u64, ()>,
    clock: u64,
}

/// Counts since the last [`Steps::take_stats`]: steps recorded; their segments, and of
/// those how many were replayed from a graph, captured (and replayed), issued as recorded;
/// captures the driver refused (those segments were issued as recorded) and the last
/// refusal's error; ops (launches, memsets, copies, cuBLAS products) a recorded step
/// issued after its recording had ended (a read back or a copy from the host mid-step;
/// past the step's final read back there is normally nothing left); the host's time
/// issuing the segments.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GraphStats {
    pub recorded: u64,
    pub segments: u64,
    pub replayed: u64,
    pub captured: u64,
    pub eager: u64,
    pub capture_failures: u64,
    pub capture_error: Option<String>,
    pub unrecorded: u64,
    /// The host's time issuing segments (comparing, capturing, launching them).
    pub issue_seconds: f64,
}

/// The recording state of one GPU.
pub(crate) struct Steps {
    on: AtomicU64,
    arena: Arc<ArenaState>,
    region: Mutex<Option<CudaSlice<u8>>>,
    next_size: AtomicU64,
    /// The arena keeps `next_size` after an overflow instead of growing (tests).
    pinned: std::sync::atomic::AtomicBool,
    rec: Mutex<Option<Recording>>,
    cache: Mutex<Cache>,
    /// Scratch buffers replaced while a step was recorded, kept until its ops are issued.
    graveyard: Mutex<Vec<CudaSlice<u32>>>,
    /// The second stream a captured branch's side lane runs on (made at the first).
    side: std::sync::OnceLock<Arc<cudarc::driver::CudaStream>>,
    /// The side lane's cuBLAS handle (made before the first capture of a segment with a
    /// cuBLAS product on the side lane; None if it could not be: that capture is then
    /// refused).
    side_blas: std::sync::OnceLock<Option<Mutex<BlasHandle>>>,
    /// Counts ([`GraphStats`]' fields in order), then nanoseconds spent issuing segments.
    stats: [AtomicU64; 8],
    /// Captures refused since the GPU was set up (never reset: [`Gpu::graph_health`]).
    refused: AtomicU64,
    capture_error: Mutex<Option<String>>,
}

impl Steps {
    pub(crate) fn new() -> Self {
        Steps {
            on: AtomicU64::new(u64::from(graphs_enabled())),
            arena: ArenaState::new(),
            region: Mutex::new(None),
            next_size: AtomicU64::new(FIRST_ARENA as u64),
            pinned: std::sync::atomic::AtomicBool::new(false),
            rec: Mutex::new(None),
            cache: Mutex::new(Cache::default()),
            graveyard: Mutex::new(Vec::new()),
            side: std::sync::OnceLock::new(),
            side_blas: std::sync::OnceLock::new(),
            stats: Default::default(),
            refused: AtomicU64::new(0),
            capture_error: Mutex::new(None),
        }
    }

    pub(crate) fn take_stats(&self) -> GraphStats {
        let t = |i: usize| self.stats[i].swap(0, Ordering::Relaxed);
        GraphStats {
            recorded: t(0),
            segments: t(1),
            replayed: t(2),
            captured: t(3),
            eager: t(4),
            capture_failures: t(5),
            capture_error: self.capture_error.lock().expect("capture error poisoned").take(),
            unrecorded: t(6),
            issue_seconds: t(7) as f64 * 1e-9,
        }
    }

    fn count(&self, i: usize) {
        self.stats[i].fetch_add(1, Ordering::Relaxed);
    }
}

impl Gpu {
    /// Start recording a decode step (false when graphs are off or the arena could not
    /// be allocated; the step then runs eagerly).
    pub(crate) fn begin_recording(&self) -> bool {
        let s = &self.steps;
        if s.on.load(Ordering::Relaxed) == 0 {
            return false;
        }
        self.flush_recording();
        let want = s.next_size.load(Ordering::Relaxed) as usize;
        let mut region = s.region.lock().expect("arena region poisoned");
        if region.as_ref().is_none_or(|r| r.len() < want) {
            // Graphs point into the old region: drop them before it goes.
            s.cache.lock().expect("graph cache poisoned").graphs.clear();
            *region = None;
            // SAFETY: arena memory is written by the kernels of the steps that use it
            // before they read it (as any temporary).
            match unsafe { self.stream.alloc::<u8>(want) } {
                Ok(r) => {
                    tracing::info!(mib = want >> 20, "step arena for CUDA graphs allocated");
                    *region = Some(r);
                }
                Err(e) => {
                    tracing::warn!(bytes = want, error = ?e, "no device memory for the step arena; CUDA graphs off");
                    s.on.store(0, Ordering::Relaxed);
                    return false;
                }
            }
        }
        let size = region.as_ref().map_or(0, |r| r.len());
        s.arena.begin(size);
        *s.rec.lock().expect("recording poisoned") = Some(Recording::default());
        s.count(0);
        true
    }

    /// Issue what is recorded and stop handing out arena memory; a step that
    /// overflowed the arena makes the next one larger.
    pub(crate) fn end_recording(&self) {
        self.flush_recording();
        let (peak, overflow) = self.steps.arena.end();
        if overflow > 0 && !self.steps.pinned.load(Ordering::Relaxed) {
            let want = ((peak + overflow) * 5 / 4).next_multiple_of(1 << 20);
            self.steps.next_size.fetch_max(want as u64, Ordering::Relaxed);
        }
    }

    /// Steps record into an arena of `bytes` from the next on, which no overflow grows
    /// (a test's way to make every step overflow).
    pub(crate) fn pin_step_arena(&self, bytes: usize) {
        self.steps.next_size.store(bytes.max(1 << 16) as u64, Ordering::Relaxed);
        self.steps.pinned.store(true, Ordering::Relaxed);
    }

    pub(crate) fn set_graphs(&self, on: bool) {
        self.steps.on.store(u64::from(on), Ordering::Relaxed);
    }

    /// Whether steps replay as graphs now, and the captures refused so far.
    pub(crate) fn graph_health(&self) -> crate::GraphHealth {
        let s = &self.steps;
        crate::GraphHealth { on: s.on.load(Ordering::Relaxed) != 0, refused: s.refused.load(Ordering::Relaxed) }
    }

    /// Whether a step is under way (recording, or flushed and running eagerly: recording
    /// starts only with the arena's step, and ends no later).
    pub(crate) fn arena_active(&self) -> bool {
        self.steps.arena.active()
    }

    /// A piece of the step arena for `len` values of `T`, if a step is recording.
    ///
    /// When the piece does not fit (the step overflowed its arena) the caller takes pool
    /// memory instead, which its `DevBuf` frees on the stream when dropped — before the
    /// recorded launches that use it would be issued, and the pool may hand the same
    /// memory to the next request of the segment. So what is recorded is issued now and
    /// the rest of the step runs eagerly, each free after the launches before it.
    pub(crate) fn arena_slice<T>(&self, len: usize, upload: bool) -> Option<DevBuf<T>> {
        let Some(lease) = self.steps.arena.take(len * std::mem::size_of::<T>(), upload) else {
            if self.steps.arena.active() {
                self.flush_recording();
            }
            return None;
        };
        let region = self.steps.region.lock().expect("arena region poisoned");
        let base = self.ptr(region.as_ref()?);
        // SAFETY: the range lies inside the arena region (the arena hands out pieces of
        // its size only), which lives until no graph or step can use it; the slice is
        // leaked, not freed, when its DevBuf drops.
        let slice = unsafe { self.stream.upgrade_device_ptr::<T>(base + lease.offset() as u64, len) };
        Some(DevBuf::leased(slice, lease))
    }

    /// Whether the op was recorded (else the caller issues it now).
    pub(crate) fn record_launch(
        &self,
        func: sys::CUfunction,
        cfg: LaunchConfig,
        args: &[*mut std::ffi::c_void],
        sizes: &[usize],
    ) -> bool {
        let rec = self.steps.rec.lock().expect("recording poisoned");
        if rec.is_none() {
            self.note_unrecorded();
            return false;
        }
        let mut params = Vec::with_capacity(args.len() * 2);
        let mut offsets = Vec::with_capacity(args.len());
        for (&arg, &size) in args.iter().zip(sizes) {
            offsets.push(params.len());
            let words = size.div_ceil(8);
            let at = params.len();
            params.resize(at + words, 0);
            // SAFETY: `arg` points at a live kernel argument of `size` bytes (the launch!
            // macro passes each value's address and size); the destination holds
            // `words * 8 >= size` bytes.
            unsafe { std::ptr::copy_nonoverlapping(arg as *const u8, params[at..].as_mut_ptr() as *mut u8, size) };
        }
        self.keep(rec, Op::Launch { func: func as usize, cfg, params, offsets });
        true
    }

    pub(crate) fn record_memset(&self, dst: u64, bytes: usize) -> bool {
        self.record(Op::Memset { dst, bytes })
    }

    pub(crate) fn record_copy(&self, dst: u64, src: u64, bytes: usize) -> bool {
        self.record(Op::Copy { dst, src, bytes })
    }

    fn record(&self, op: Op) -> bool {
        let rec = self.steps.rec.lock().expect("recording poisoned");
        if rec.is_none() {
            self.note_unrecorded();
            return false;
        }
        self.keep(rec, op);
        true
    }

    /// An op issued now: counted when a recorded step is under way (its recording ended
    /// early).
    fn note_unrecorded(&self) {
        // (After an overflow the rest of the step runs eagerly on purpose: `arena_slice`.)
        if self.steps.arena.active() && !self.steps.arena.overflowed() {
            self.steps.count(6);
        }
    }

    /// Open a branch: the ops recorded next go on the side lane. Nothing happens when no
    /// step is recording (eager ops run on the one stream in order).
    pub(crate) fn fork(&self) {
        if !branches_enabled() {
            return;
        }
        let mut rec = self.steps.rec.lock().expect("recording poisoned");
        let Some(r) = rec.as_mut() else { return };
        assert!(r.branch.is_none(), "a branch opened inside another");
        r.ops.push(Op::Fork);
        r.branch = Some(Lane::Side);
        self.steps.arena.hold(true);
    }

    /// Whether the op being recorded goes on a branch's side lane.
    pub(crate) fn on_side_lane(&self) -> bool {
        self.steps.rec.lock().expect("recording poisoned").as_ref().is_some_and(|r| r.branch == Some(Lane::Side))
    }

    /// The ops recorded next go on the main lane again, beside the side lane's.
    pub(crate) fn to_main(&self) {
        let mut rec = self.steps.rec.lock().expect("recording poisoned");
        if let Some(r) = rec.as_mut().filter(|r| r.branch.is_some()) {
            r.ops.push(Op::Main);
            r.branch = Some(Lane::Main);
        }
    }

    /// Close the branch: what follows waits for both lanes.
    pub(crate) fn join(&self) {
        let mut rec = self.steps.rec.lock().expect("recording poisoned");
        let Some(r) = rec.as_mut().filter(|r| r.branch.is_some()) else { return };
        r.join(&self.steps.arena);
        if r.ops.len() >= segment_ops() {
            let full = std::mem::take(r);
            drop(rec);
            self.issue_segment(full);
        }
    }

    /// Keep `op` in the recording `rec` holds; a full segment is issued (the device starts
    /// on it while the host records the next).
    fn keep(&self, mut rec: std::sync::MutexGuard<'_, Option<Recording>>, op: Op) {
        let Some(r) = rec.as_mut() else { return };
        r.ops.push(op);
        let limit = if r.issued == 0 { first_segment_ops() } else { segment_ops() };
        if r.ops.len() >= limit && r.branch.is_none() {
            let full = r.take_segment();
            drop(rec);
            self.issue_segment(full);
        }
    }

    /// A persistent buffer the recorded ops use is being replaced: keep the old one until
    /// they are issued, and drop every graph (they point at it).
    pub(crate) fn retire_during_recording(&self, old: CudaSlice<u32>) {
        let mut rec = self.steps.rec.lock().expect("recording poisoned");
        if let Some(r) = rec.as_mut() {
            r.spoiled = true;
            self.steps.graveyard.lock().expect("graveyard poisoned").push(old);
        }
        self.steps.cache.lock().expect("graph cache poisoned").graphs.clear();
    }

    /// Issue what is recorded as a segment and go on recording: for work that cannot be
    /// recorded but keeps the step's memory as it is (NCCL exchanges, peer copies between
    /// the ranks of a sharded step). Segments cut at the same ops in every step compare.
    pub(crate) fn cut_segment(&self) {
        let mut rec = self.steps.rec.lock().expect("recording poisoned");
        let Some(r) = rec.as_mut() else { return };
        r.join(&self.steps.arena);
        let part = r.take_segment();
        drop(rec);
        self.issue_segment(part);
    }

    /// One cuBLAS product, counted as a launch: recorded when a step is recording (unless
    /// `SLUICE_CUDA_GRAPH_CUBLAS=0`, which issues the record first), else issued now.
    ///
    /// # Safety
    /// As [`BlasOp::issue`]: live operands, written by work ordered before this call.
    pub(crate) unsafe fn blas(&self, op: BlasOp) {
        self.launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if cublas_recorded() {
            let rec = self.steps.rec.lock().expect("recording poisoned");
            if rec.is_some() {
                return self.keep(rec, Op::Blas(op));
            }
        } else {
            self.flush_recording();
        }
        self.note_unrecorded();
        // cuBLAS may load a kernel at its first use, which synchronizes the context.
        let _sync = super::capture_lock::may_sync(self.ordinal);
        let blas = self.blas.lock().expect("cuBLAS handle poisoned");
        // SAFETY: this function's contract; the handle is bound to the main stream.
        unsafe { op.issue(blas.handle()) }.unwrap_or_else(|e| fail("cuBLAS product", e));
    }

    /// A recorded cuBLAS product on `side` (with the side lane's handle) or on the main
    /// stream; a failure is the driver's `CUDA_ERROR_UNKNOWN` after a warning naming the
    /// cuBLAS status, so a capture that meets it is refused like any other.
    fn issue_blas(&self, op: &BlasOp, side: bool) -> Result<(), cudarc::driver::DriverError> {
        let failed = |e: cudarc::cublas::result::CublasError| {
            tracing::warn!(status = ?e, ?op, "a recorded cuBLAS product failed");
            cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN)
        };
        // Issued eagerly, a product may load a cuBLAS kernel (a context synchronization);
        // inside this thread's capture this takes nothing.
        let _sync = super::capture_lock::may_sync(self.ordinal);
        if !side {
            let blas = self.blas.lock().expect("cuBLAS handle poisoned");
            // SAFETY: the operands are those the recording call was given (`Gpu::blas`),
            // live as long as the step's memory; the handle is bound to the main stream.
            return unsafe { op.issue(blas.handle()) }.map_err(failed);
        }
        // Made before the capture began ([`Gpu::capture`]): a capture refuses the
        // allocations of a new handle.
        let Some(Some(blas)) = self.steps.side_blas.get() else {
            return Err(cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED));
        };
        let blas = blas.lock().expect("cuBLAS handle poisoned");
        // SAFETY: as above; this handle is bound to the side lane's stream.
        unsafe { op.issue(blas.handle()) }.map_err(failed)
    }

    /// Issue the recorded ops (replaying or capturing a graph where the record allows)
    /// and stop recording: what the step does from here on is issued as it comes.
    pub(crate) fn flush_recording(&self) {
        let Some(mut rec) = self.steps.rec.lock().expect("recording poisoned").take() else { return };
        rec.join(&self.steps.arena);
        self.issue_segment(rec);
    }

    /// Replay, capture or issue one segment of a step's record.
    fn issue_segment(&self, rec: Recording) {
        let s = &self.steps;
        if rec.ops.is_empty() {
            return;
        }
        let t = std::time::Instant::now();
        s.count(1);
        let graphable = !rec.spoiled && !s.arena.overflowed();
        if !graphable {
            self.issue_all(&rec.ops);
            s.count(4);
        } else {
            let key = record_key(&rec.ops);
            let hash = {
                use std::hash::{Hash, Hasher};
                let mut h = std::collections::hash_map::DefaultHasher::new();
                key.hash(&mut h);
                h.finish()
            };
            let mut cache = s.cache.lock().expect("graph cache poisoned");
            cache.clock += 1;
            let now = cache.clock;
            if let Some(r) = cache.graphs.get_mut(&hash).filter(|r| r.key == key) {
                r.used = now;
                r.graph.launch().unwrap_or_else(|e| fail("graph launch", e));
                s.count(2);
            } else if cache.seen.remove(&hash).is_some() {
                match self.capture(&rec.ops) {
                    Some(graph) => {
                        graph.launch().unwrap_or_else(|e| fail("graph launch", e));
                        if cache.graphs.len() >= GRAPH_CACHE
                            && let Some(&old) = cache.graphs.iter().min_by_key(|(_, r)| r.used).map(|(h, _)| h)
                        {
                            cache.graphs.remove(&old);
                        }
                        cache.graphs.insert(hash, Replay { key, graph, used: now });
                        s.count(3);
                    }
                    None => {
                        self.issue_all(&rec.ops);
                        s.count(4);
                    }
                }
            } else {
                if cache.seen.len() > 4 * GRAPH_CACHE {
                    cache.seen.clear();
                }
                cache.seen.insert(hash, ());
                self.issue_all(&rec.ops);
                s.count(4);
            }
        }
        s.graveyard.lock().expect("graveyard poisoned").clear();
        s.stats[7].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Capture `ops` into a graph (None, with a warning and graphs switched off, if the
    /// driver refuses: the caller then issues them).
    fn capture(&self, ops: &[Op]) -> Option<CudaGraph> {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        let side = self.side_stream();
        if let Some(stream) = side.as_ref().filter(|_| side_lane_blas(ops)) {
            self.steps.side_blas.get_or_init(|| {
                let _sync = super::capture_lock::may_sync(self.ordinal);
                handle_with_workspace(stream)
                    .map_err(|e| tracing::warn!(error = %e, "no cuBLAS handle for the side lane"))
                    .ok()
                    .map(Mutex::new)
            });
        }
        // Nothing on another thread may synchronize this context while capturing.
        let _alone = super::capture_lock::capturing(self.ordinal);
        let result = self.stream.begin_capture(mode).and_then(|()| {
            let mut on_side = false;
            let issued = ops.iter().try_for_each(|op| match op {
                Op::Fork => {
                    on_side = true;
                    side.as_ref().map_or(Ok(()), |s| s.join(&self.stream))
                }
                Op::Main => {
                    on_side = false;
                    Ok(())
                }
                Op::Join => {
                    on_side = false;
                    side.as_ref().map_or(Ok(()), |s| self.stream.join(s))
                }
                _ => self.issue(op, if on_side { side.as_deref() } else { None }),
            });
            let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            issued.and(graph)
        });
        match result {
            Ok(Some(graph)) => Some(graph),
            other => {
                // The driver refuses a capture that another thread of the process broke
                // with a call that synchronizes the context; those this backend makes
                // wait for captures (`capture_lock`), so a refusal means another library
                // or an unlisted call did: graphs stay off for this GPU.
                // Capturing again after such a refusal was tried: several engines in one
                // process then crashed inside the driver now and then.
                let error = format!("{:?}", other.err());
                tracing::warn!(%error, "capturing a decode step failed; CUDA graphs off");
                let s = &self.steps;
                s.count(5);
                s.refused.fetch_add(1, Ordering::Relaxed);
                *s.capture_error.lock().expect("capture error poisoned") = Some(error);
                s.on.store(0, Ordering::Relaxed);
                None
            }
        }
    }

    /// The side lane's stream (None, and branches run on one stream, if it cannot be made).
    fn side_stream(&self) -> Option<Arc<cudarc::driver::CudaStream>> {
        if let Some(s) = self.steps.side.get() {
            return Some(s.clone());
        }
        match self.stream.fork() {
            Ok(s) => Some(self.steps.side.get_or_init(|| s).clone()),
            Err(e) => {
                tracing::warn!(error = ?e, "no second stream for recorded branches; they run in order");
                None
            }
        }
    }

    /// Every op on the main stream in recorded order (branch markers need nothing there).
    fn issue_all(&self, ops: &[Op]) {
        for op in ops {
            self.issue(op, None).unwrap_or_else(|e| fail("issuing a recorded op", e));
        }
    }

    /// One op on `side`, or on the main stream.
    fn issue(&self, op: &Op, side: Option<&cudarc::driver::CudaStream>) -> Result<(), cudarc::driver::DriverError> {
        let stream = side.unwrap_or(&self.stream).cu_stream();
        match op {
            Op::Launch { func, cfg, params, offsets } => {
                let mut args: Vec<*mut std::ffi::c_void> =
                    offsets.iter().map(|&o| params[o..].as_ptr() as *mut std::ffi::c_void).collect();
                // SAFETY: the function and arguments are those a launch of this step
                // recorded (the values copied at record time, one pointer per parameter).
                unsafe { self.launch_now(*func as sys::CUfunction, *cfg, &mut args, stream) }
            }
            // SAFETY: the ranges are those the recording calls were given: live device
            // memory of this context (arena pieces live as long as the arena).
            Op::Memset { dst, bytes } => unsafe { cudarc::driver::result::memset_d8_async(*dst, 0, *bytes, stream) },
            Op::Copy { dst, src, bytes } => unsafe {
                cudarc::driver::result::memcpy_dtod_async(*dst, *src, *bytes, stream)
            },
            Op::Blas(call) => self.issue_blas(call, side.is_some()),
            Op::Fork | Op::Main | Op::Join => Ok(()),
        }
    }
}

/// Whether a cuBLAS product of `ops` is on a branch's side lane (it needs the side lane's
/// handle when captured).
fn side_lane_blas(ops: &[Op]) -> bool {
    let mut on_side = false;
    ops.iter().any(|op| {
        match op {
            Op::Fork => on_side = true,
            Op::Main | Op::Join => on_side = false,
            _ => {}
        }
        on_side && matches!(op, Op::Blas(_))
    })
}

/// Every op's kind, function, shape and argument words, in order: two steps with equal
/// keys issue the same device work.
fn record_key(ops: &[Op]) -> Vec<u64> {
    let mut key = Vec::with_capacity(ops.len() * 16);
    for op in ops {
        match op {
            Op::Launch { func, cfg, params, offsets } => {
                let (g, b) = (cfg.grid_dim, cfg.block_dim);
                key.extend_from_slice(&[1, *func as u64, g.0 as u64, g.1 as u64, g.2 as u64]);
                key.extend_from_slice(&[b.0 as u64, b.1 as u64, b.2 as u64, cfg.shared_mem_bytes as u64]);
                key.push(offsets.len() as u64);
                key.extend_from_slice(params);
            }
            Op::Memset { dst, bytes } => key.extend_from_slice(&[2, *dst, *bytes as u64]),
            Op::Copy { dst, src, bytes } => key.extend_from_slice(&[3, *dst, *src, *bytes as u64]),
            Op::Blas(call) => call.key(&mut key),
            Op::Fork => key.push(4),
            Op::Main => key.push(5),
            Op::Join => key.push(6),
        }
    }
    key
}

#[cfg(test)]
mod tests;
