//! RMA within one process: a worker connected to itself, and two workers on two threads.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::Instant;

use common::{TIMEOUT, pattern};
use ucx_sys::{Context, ErrorMode, Features, MemRegion, Worker};

fn context() -> Context {
    Context::new(Features::RMA | Features::WAKEUP).expect("UCX context")
}

fn region_bytes(region: &MemRegion) -> Vec<u8> {
    let mut out = vec![0u8; region.len()];
    // SAFETY: every put to the region has been flushed and nothing else writes it.
    unsafe { region.read_at(0, &mut out) };
    out
}

#[test]
fn worker_connected_to_itself_puts_and_gets() {
    let ctx = context();
    let worker = Worker::new(&ctx).unwrap();
    let region = MemRegion::allocate(&ctx, 256 * 1024).unwrap();
    assert!(region_bytes(&region).iter().all(|&b| b == 0), "allocate zeroes the region");

    let ep = worker.connect(&worker.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&region.pack_rkey().unwrap()).unwrap();
    assert_eq!((rkey.base(), rkey.len()), (region.address(), region.len() as u64));

    let data = pattern(region.len(), 7);
    let (a, b) = data.split_at(100_000);
    worker.put_all(&ep, &[(b, region.address() + 100_000), (a, region.address())], &rkey, TIMEOUT).unwrap();
    assert!(region_bytes(&region) == data, "region holds the pattern after put_all");

    let mut back = vec![0u8; 4096];
    worker.get_blocking(&ep, &mut back, region.address() + 12_345, &rkey, TIMEOUT).unwrap();
    assert_eq!(back, data[12_345..12_345 + 4096]);

    let small = pattern(64, 99);
    worker.put_blocking(&ep, &small, region.address() + 64, &rkey, TIMEOUT).unwrap();
    let mut check = vec![0u8; 64];
    // SAFETY: the put above was flushed; nothing else writes the region.
    unsafe { region.read_at(64, &mut check) };
    assert_eq!(check, small);
    ep.close(TIMEOUT).unwrap();
}

#[test]
fn nonblocking_put_then_wait() {
    let ctx = context();
    let worker = Worker::new(&ctx).unwrap();
    let region = MemRegion::allocate(&ctx, 1 << 20).unwrap();
    let ep = worker.connect(&worker.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&region.pack_rkey().unwrap()).unwrap();
    let data = pattern(1 << 20, 3);
    // SAFETY: `data` outlives the request, which is waited for right below.
    let pending = unsafe { ep.put(&data, region.address(), &rkey) }.unwrap();
    worker.wait(pending, TIMEOUT).unwrap();
    ep.flush(TIMEOUT).unwrap();
    worker.flush(TIMEOUT).unwrap();
    assert!(region_bytes(&region) == data);
}

#[test]
fn two_workers_on_two_threads() {
    two_workers(&context(), ErrorMode::Peer);
}

#[test]
fn two_workers_over_shared_memory() {
    let ctx = Context::with_config(Features::RMA | Features::WAKEUP, &[("TLS", "shm")]).unwrap();
    two_workers(&ctx, ErrorMode::None);
}

#[test]
fn the_mode_chosen_for_the_transports_connects() {
    for (tls, want) in [("shm", ErrorMode::None), ("tcp", ErrorMode::Peer), ("shm,tcp", ErrorMode::Peer)] {
        let ctx = Context::with_config(Features::RMA | Features::WAKEUP, &[("TLS", tls)]).unwrap();
        assert_eq!(ctx.transports(), Some(tls));
        let mode = Worker::new(&ctx).unwrap().error_mode();
        assert_eq!((mode, ctx.error_mode()), (want, want), "UCX_TLS={tls}");
        two_workers(&ctx, mode);
    }
}

#[test]
fn worker_connected_to_itself_over_the_self_transport() {
    let ctx = Context::with_config(Features::RMA | Features::WAKEUP, &[("TLS", "self")]).unwrap();
    let worker = Worker::new(&ctx).unwrap();
    let region = MemRegion::allocate(&ctx, 8192).unwrap();
    let ep = worker.connect_with(&worker.address().unwrap(), ErrorMode::None).unwrap();
    let rkey = ep.unpack_rkey(&region.pack_rkey().unwrap()).unwrap();
    let data = pattern(8192, 11);
    worker.put_blocking(&ep, &data, region.address(), &rkey, TIMEOUT).unwrap();
    assert!(region_bytes(&region) == data);
}

/// A receiver worker on its own thread, sleeping on its event fd; a sender on this one.
fn two_workers(ctx: &Context, mode: ErrorMode) {
    let stop = Arc::new(AtomicBool::new(false));
    let (publish, published) = mpsc::channel();
    let receiver = {
        let (ctx, stop) = (ctx.clone(), stop.clone());
        thread::spawn(move || {
            let worker = Worker::new(&ctx).unwrap();
            let region = MemRegion::allocate(&ctx, 512 * 1024).unwrap();
            publish.send((worker.address().unwrap(), region.address(), region.pack_rkey().unwrap())).unwrap();
            let deadline = Instant::now() + TIMEOUT;
            while !stop.load(Ordering::Acquire) && Instant::now() < deadline {
                while worker.progress() > 0 {}
                worker.wait_for_events(std::time::Duration::from_millis(20)).unwrap();
            }
            region_bytes(&region)
        })
    };

    let (address, base, packed) = published.recv_timeout(TIMEOUT).unwrap();
    let worker = Worker::new(ctx).unwrap();
    let ep = worker.connect_with(&address, mode).unwrap();
    let rkey = ep.unpack_rkey(&packed).unwrap();
    let data = pattern(512 * 1024, 42);
    let puts: Vec<(&[u8], u64)> =
        data.chunks(64 * 1024).enumerate().map(|(i, c)| (c, base + (i * 65536) as u64)).collect();
    worker.put_all(&ep, &puts, &rkey, TIMEOUT).unwrap();
    drop(rkey);
    ep.close(TIMEOUT).unwrap();
    stop.store(true, Ordering::Release);
    assert!(receiver.join().unwrap() == data, "receiver's region holds the pattern");
}

#[test]
fn regions_can_be_made_and_packed_from_any_thread() {
    let ctx = context();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let ctx = ctx.clone();
            thread::spawn(move || {
                let region = MemRegion::allocate(&ctx, 4096 * (i + 1)).unwrap();
                assert!(!region.pack_rkey().unwrap().is_empty());
                region
            })
        })
        .collect();
    let regions: Vec<MemRegion> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(regions.iter().map(MemRegion::len).sum::<usize>(), 4096 * 10);
}

#[test]
fn registered_memory_is_usable_as_a_target() {
    let ctx = context();
    let worker = Worker::new(&ctx).unwrap();
    let mut backing = vec![0u64; 8192];
    // SAFETY: `backing` outlives the region (dropped first, below) and is not touched
    // through Rust references while the region lives.
    let region = unsafe { MemRegion::register(&ctx, backing.as_mut_ptr().cast(), 8192 * 8) }.unwrap();
    let ep = worker.connect(&worker.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&region.pack_rkey().unwrap()).unwrap();
    let data = pattern(8192 * 8, 5);
    worker.put_blocking(&ep, &data, region.address(), &rkey, TIMEOUT).unwrap();
    drop((rkey, ep, region));
    let bytes: Vec<u8> = backing.iter().flat_map(|w| w.to_ne_bytes()).collect();
    assert!(bytes == data);
}

#[test]
fn region_is_external_memory_for_the_kv_cache() {
    use kernels::backend::ExternalMemory;
    let ctx = context();
    let region = MemRegion::allocate(&ctx, 10_000).unwrap();
    let mem: &dyn ExternalMemory = &region;
    assert_eq!(mem.len(), 10_000);
    assert_eq!(mem.as_ptr() as u64, region.address());
    assert!((mem.as_ptr() as usize).is_multiple_of(8));
}
