//! What the loaded libucx can reach: its file and version are known at start, host
//! memory always, CUDA memory only with a CUDA-enabled build (Debian's has none, so
//! registering device memory is refused with a message that says how to get one).

use ucx_sys::{Context, DeviceRegion, Features, MemoryType, library_path, version};

#[test]
fn the_loaded_library_names_its_file_version_and_memory_types() {
    let path = library_path().expect("dladdr finds libucp");
    assert!(path.contains("libucp"), "{path}");
    let (major, minor, _) = version();
    assert!(major == 1 && minor >= 13, "UCX {major}.{minor}");
    let ctx = Context::new(Features::RMA).unwrap();
    assert!(ctx.supports(MemoryType::Host));
    assert_ne!(ctx.memory_types() & 1, 0, "host memory is memory type 0");
}

#[test]
fn device_memory_needs_a_cuda_enabled_libucx() {
    let ctx = Context::new(Features::RMA).unwrap();
    if ctx.supports(MemoryType::Cuda) {
        eprintln!("SKIPPED: this libucx ({:?}) has CUDA transports; tests/gpu_direct.rs covers it", library_path());
        return;
    }
    // SAFETY: refused before UCX looks at the address.
    let err = unsafe { DeviceRegion::register(&ctx, 1 << 20, 4096) }.unwrap_err().to_string();
    assert!(err.contains("no CUDA transports") && err.contains("LD_LIBRARY_PATH"), "{err}");
}
