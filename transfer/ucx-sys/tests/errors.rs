//! Bad input becomes an error, never a crash.

mod common;

use std::time::Duration;

use common::{TIMEOUT, pattern};
use ucx_sys::raw::{UCS_ERR_INVALID_PARAM, UCS_ERR_NOT_CONNECTED, UCS_ERR_OUT_OF_RANGE};
use ucx_sys::{Context, Features, MemRegion, Worker};

fn context() -> Context {
    Context::new(Features::RMA | Features::WAKEUP).expect("UCX context")
}

#[test]
fn garbage_addresses_are_rejected() {
    let ctx = context();
    let worker = Worker::new(&ctx).unwrap();
    let real = worker.address().unwrap();
    let mut flipped = real.clone();
    flipped[real.len() / 2] ^= 1;
    let cases: [(&str, Vec<u8>); 5] = [
        ("empty", vec![]),
        ("garbage", pattern(300, 1)),
        ("truncated", real[..real.len() - 9].to_vec()),
        ("one bit flipped", flipped),
        ("an rkey", MemRegion::allocate(&ctx, 4096).unwrap().pack_rkey().unwrap()),
    ];
    for (name, bytes) in cases {
        let err = worker.connect(&bytes).expect_err(name);
        assert_eq!(err.status, i32::from(UCS_ERR_INVALID_PARAM), "{name}: {err}");
        assert!(err.to_string().contains("worker address rejected"), "{name}: {err}");
    }
}

#[test]
fn garbage_rkeys_are_rejected() {
    let ctx = context();
    let worker = Worker::new(&ctx).unwrap();
    let ep = worker.connect(&worker.address().unwrap()).unwrap();
    let real = MemRegion::allocate(&ctx, 4096).unwrap().pack_rkey().unwrap();
    let mut flipped = real.clone();
    flipped[real.len() - 10] ^= 0x80;
    for (name, bytes) in [
        ("empty", vec![]),
        ("garbage", pattern(64, 2)),
        ("truncated", real[..real.len() / 2].to_vec()),
        ("one bit flipped", flipped),
        ("an address", worker.address().unwrap()),
    ] {
        let err = ep.unpack_rkey(&bytes).expect_err(name);
        assert!(err.to_string().contains("packed rkey rejected"), "{name}: {err}");
    }
}

#[test]
fn accesses_outside_the_region_are_rejected() {
    let ctx = context();
    let worker = Worker::new(&ctx).unwrap();
    let region = MemRegion::allocate(&ctx, 4096).unwrap();
    let ep = worker.connect(&worker.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&region.pack_rkey().unwrap()).unwrap();
    let base = region.address();
    let data = [1u8; 16];
    for addr in [base - 1, base + 4096 - 15, base + 1_000_000, u64::MAX - 4] {
        let err = worker.put_blocking(&ep, &data, addr, &rkey, TIMEOUT).unwrap_err();
        assert_eq!(err.status, i32::from(UCS_ERR_OUT_OF_RANGE), "{addr:#x}: {err}");
    }
    // A batch with one bad range sends nothing.
    let err = worker.put_all(&ep, &[(&data, base), (&data, base + 4090)], &rkey, TIMEOUT).unwrap_err();
    assert_eq!(err.status, i32::from(UCS_ERR_OUT_OF_RANGE));
    let mut first = [0u8; 16];
    // SAFETY: nothing was sent, and nothing else writes the region.
    unsafe { region.read_at(0, &mut first) };
    assert_eq!(first, [0u8; 16]);
    let mut into = [0u8; 16];
    assert!(worker.get_blocking(&ep, &mut into, base + 4095, &rkey, TIMEOUT).is_err());
}

#[test]
fn rkeys_are_tied_to_their_endpoint() {
    let ctx = context();
    let worker = Worker::new(&ctx).unwrap();
    let region = MemRegion::allocate(&ctx, 4096).unwrap();
    let address = worker.address().unwrap();
    let (ep1, ep2) = (worker.connect(&address).unwrap(), worker.connect(&address).unwrap());
    let rkey1 = ep1.unpack_rkey(&region.pack_rkey().unwrap()).unwrap();
    let err = worker.put_blocking(&ep2, &[1, 2, 3], region.address(), &rkey1, TIMEOUT).unwrap_err();
    assert_eq!(err.status, i32::from(UCS_ERR_INVALID_PARAM), "{err}");
    worker.put_blocking(&ep1, &[1, 2, 3], region.address(), &rkey1, TIMEOUT).unwrap();
}

#[test]
fn endpoints_of_another_worker_are_rejected() {
    let ctx = context();
    let (w1, w2) = (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap());
    let region = MemRegion::allocate(&ctx, 4096).unwrap();
    let ep = w1.connect(&w1.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&region.pack_rkey().unwrap()).unwrap();
    assert!(w2.put_blocking(&ep, &[1], region.address(), &rkey, TIMEOUT).is_err());
}

#[test]
fn remote_keys_may_outlive_an_explicit_close() {
    let ctx = context();
    let worker = Worker::new(&ctx).unwrap();
    let region = MemRegion::allocate(&ctx, 4096).unwrap();
    let ep = worker.connect(&worker.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&region.pack_rkey().unwrap()).unwrap();
    ep.close(TIMEOUT).unwrap();
    drop(rkey);
    let ep = worker.connect(&worker.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&region.pack_rkey().unwrap()).unwrap();
    worker.put_blocking(&ep, &[9; 8], region.address(), &rkey, TIMEOUT).unwrap();
}

#[test]
fn a_peer_that_never_progresses_times_out_and_closes_the_endpoint() {
    // Over tcp, puts and flushes need the target worker to progress; this one never does.
    let ctx = Context::with_config(Features::RMA | Features::WAKEUP, &[("TLS", "tcp")]).unwrap();
    let (sender, silent) = (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap());
    let region = MemRegion::allocate(&ctx, 1 << 20).unwrap();
    let ep = sender.connect(&silent.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&region.pack_rkey().unwrap()).unwrap();
    let data = pattern(1 << 20, 4);
    let started = std::time::Instant::now();
    let err = sender.put_all(&ep, &[(&data, region.address())], &rkey, Duration::from_millis(500)).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5), "gave up promptly: {:?}", started.elapsed());
    let err = sender.put_blocking(&ep, &data[..8], region.address(), &rkey, TIMEOUT).unwrap_err();
    assert_eq!(err.status, i32::from(UCS_ERR_NOT_CONNECTED), "{err}");
}

#[test]
fn bad_config_values_and_missing_wakeup_are_explained() {
    let err = Context::with_config(Features::RMA, &[("UCX_RNDV_THRESH", "banana")]).expect_err("bad value");
    assert!(err.to_string().contains("RNDV_THRESH=banana"), "{err}");
    assert!(Context::with_config(Features::RMA, &[("TLS\0", "tcp")]).is_err());
    let ctx = Context::new(Features::RMA).unwrap();
    let worker = Worker::new(&ctx).unwrap();
    let err = worker.efd().expect_err("efd needs WAKEUP");
    assert!(err.to_string().contains("Features::WAKEUP"), "{err}");
}
