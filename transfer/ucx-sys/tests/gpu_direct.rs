//! GPU memory moved by UCX itself (a CUDA-enabled libucx: cuda_copy within a GPU and
//! between host and GPU, cuda_ipc between GPUs): bytes put from one device buffer into
//! another registered one land byte for byte, within one GPU and, when the machine has
//! two, from cuda:0 to cuda:1; gets fill device memory from a host region. Prints each
//! move's GB/s next to a device-to-device copy of the same bytes (`cuMemcpy`), measured
//! in the same run. Skipped, saying why, without a GPU or without CUDA in the loaded
//! libucx (point LD_LIBRARY_PATH at a CUDA-enabled UCX, e.g. the libucx-cu13 wheel).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use common::{TIMEOUT, pattern};
use kernels::EntryDtype;
use kernels::backend::Backend;
use kernels::cuda::{CudaBackend, CudaKv};
use ucx_sys::{Context, DeviceRegion, Features, LocalRange, MemRegion, MemoryType, Worker, library_path, version};

const BYTES: usize = 256 << 20;

fn ready() -> Option<Context> {
    if !kernels::cuda::driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this machine");
        return None;
    }
    let ctx = Context::new(Features::RMA).unwrap();
    if !ctx.supports(MemoryType::Cuda) {
        eprintln!("SKIPPED: libucx {:?} at {:?} has no CUDA transports", version(), library_path());
        return None;
    }
    eprintln!("libucx {:?} at {:?}, UCX_TLS={:?}", version(), library_path(), std::env::var("UCX_TLS").ok());
    Some(ctx)
}

fn buffer(b: &CudaBackend, fill: Option<u8>) -> CudaKv {
    let mut kv = b.kv_alloc(BYTES, EntryDtype::Fp8);
    if let Some(seed) = fill {
        b.kv_write(&mut kv, 0, &pattern(BYTES, seed));
    }
    b.synchronize();
    kv
}

/// The target side's worker, progressed on its own thread as a serving worker's is.
/// Within one process cuda_ipc cannot map a buffer of its own process, so UCX moves
/// device memory between two workers of one process with a protocol that needs the
/// target to progress; a real decode worker always does.
struct ProgressedPeer {
    address: Vec<u8>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ProgressedPeer {
    fn start(ctx: &Context) -> Self {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let (ctx, flag) = (ctx.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let worker = Worker::new(&ctx).unwrap();
            tx.send(worker.address().unwrap()).unwrap();
            while !flag.load(Ordering::Relaxed) {
                worker.progress();
            }
        });
        let address = rx.recv_timeout(TIMEOUT).expect("the peer worker's address");
        ProgressedPeer { address, stop, thread: Some(thread) }
    }
}

impl Drop for ProgressedPeer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Put `src` (on `from`) into `dst` (on `to`) through UCX; returns GB/s.
fn put(ctx: &Context, from: &CudaBackend, src: &CudaKv, to: &CudaBackend, dst: &CudaKv) -> f64 {
    let (dst_addr, len) = to.kv_device_range(dst);
    // SAFETY: `dst` is live device memory that outlives the region (dropped below).
    let region = unsafe { DeviceRegion::register(ctx, dst_addr, len) }.unwrap();
    let receiver = ProgressedPeer::start(ctx);
    let sender = Worker::new(ctx).unwrap();
    let ep = sender.connect_with(&receiver.address, sender.error_mode()).unwrap();
    let rkey = ep.unpack_rkey(&region.pack_rkey().unwrap()).unwrap();
    let (src_addr, _) = from.kv_device_range(src);
    let local = LocalRange { addr: src_addr, len, memory: MemoryType::Cuda };
    let t = Instant::now();
    // SAFETY: `src` is live device memory, unmodified during the call.
    unsafe { sender.put_ranges(&ep, &[(local, region.address())], &rkey, TIMEOUT) }.unwrap();
    len as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn copy_gbs(b: &CudaBackend, src: &CudaKv, dst: &mut CudaKv) -> f64 {
    b.synchronize();
    let t = Instant::now();
    b.kv_copy(src, 0, dst, 0, BYTES);
    b.synchronize();
    BYTES as f64 / t.elapsed().as_secs_f64() / 1e9
}

#[test]
fn device_to_device_puts_land_byte_for_byte() {
    let Some(ctx) = ready() else { return };
    let g0 = CudaBackend::new(0).unwrap();
    let src = buffer(&g0, Some(7));
    let dst = buffer(&g0, None);
    // Twice: the first put maps the region (handles, caches), the second is measured.
    // Both workers live in this process, where cuda_ipc cannot open its own process's
    // buffers, so UCX takes a slower protocol: the figure shows the path works, not
    // serving speed (ucx_perftest between two processes, gpu_checks.sh's ucx step, and
    // `sluice bench transfer` measure that).
    put(&ctx, &g0, &src, &g0, &dst);
    let gbs = put(&ctx, &g0, &src, &g0, &dst);
    assert_eq!(g0.kv_read(&dst, 0, BYTES), pattern(BYTES, 7), "bytes put within cuda:0");
    let mut twin = buffer(&g0, None);
    let copy = copy_gbs(&g0, &src, &mut twin);
    println!(
        "UCX put cuda:0 -> cuda:0, {} MiB: {gbs:.1} GB/s; cuMemcpy of the same bytes {copy:.1} GB/s ({:.2}x)",
        BYTES >> 20,
        gbs / copy
    );
    drop(dst);

    if CudaBackend::device_count() >= 2 {
        let g1 = CudaBackend::new(1).unwrap();
        let dst1 = buffer(&g1, None);
        put(&ctx, &g0, &src, &g1, &dst1);
        let gbs = put(&ctx, &g0, &src, &g1, &dst1);
        assert_eq!(g1.kv_read(&dst1, 0, BYTES), pattern(BYTES, 7), "bytes put from cuda:0 into cuda:1");
        println!("UCX put cuda:0 -> cuda:1, {} MiB: {gbs:.1} GB/s", BYTES >> 20);
    } else {
        eprintln!("one GPU: the cuda:0 -> cuda:1 put is SKIPPED");
    }
}

#[test]
fn gets_fill_device_memory_from_host_regions() {
    let Some(ctx) = ready() else { return };
    let g0 = CudaBackend::new(0).unwrap();
    let host = MemRegion::allocate(&ctx, 1 << 20).unwrap();
    let bytes = pattern(1 << 20, 3);
    // SAFETY: nothing else touches the new region.
    unsafe { host.write_at(0, &bytes) };
    let dst = g0.kv_alloc(1 << 20, EntryDtype::Fp8);
    g0.synchronize();
    let peer = ProgressedPeer::start(&ctx);
    let me = Worker::new(&ctx).unwrap();
    let ep = me.connect_with(&peer.address, me.error_mode()).unwrap();
    let rkey = ep.unpack_rkey(&host.pack_rkey().unwrap()).unwrap();
    let (addr, len) = g0.kv_device_range(&dst);
    let local = LocalRange { addr, len, memory: MemoryType::Cuda };
    // SAFETY: `dst` is live device memory nothing else uses during the call.
    unsafe { me.get_ranges(&ep, &[(local, host.address())], &rkey, TIMEOUT) }.unwrap();
    assert_eq!(g0.kv_read(&dst, 0, 1 << 20), bytes, "a get from a host region into cuda:0");
}
