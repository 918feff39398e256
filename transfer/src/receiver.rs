//! The receiving side: a UCX context whose regions hold a decode worker's KV memory,
//! and a thread that keeps the worker progressing (transports such as TCP carry puts
//! as messages the receiver must process; shared memory lands without it).
//!
//! Thread affinity: the UCX worker lives on the `ucx-progress` thread and never leaves
//! it; [`Receiver`] itself and the regions it allocates are `Send + Sync`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use kernels::backend::DeviceMemory;
use ucx_sys::{Context, DeviceRegion, Features, MemRegion, Worker};

use crate::TransferError;
use crate::target::RegionSpec;

/// How long the progress thread sleeps on the worker's event fd before checking
/// whether it should stop.
const WAKE_INTERVAL: Duration = Duration::from_millis(50);

pub struct Receiver {
    ctx: Context,
    address: Vec<u8>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// A region peers can write, and how they find it.
pub struct RegisteredRegion {
    pub region: MemRegion,
    pub spec: RegionSpec,
}

/// Device memory peers can write, and how they find it.
pub struct RegisteredDevice {
    pub region: DeviceRegion,
    pub spec: RegionSpec,
}

impl Receiver {
    /// Create the UCX context (transports from `UCX_TLS` etc.) and start progressing.
    pub fn start() -> Result<Self, TransferError> {
        let ctx = Context::new(Features::RMA | Features::WAKEUP)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("ucx-progress".into())
            .spawn({
                let ctx = ctx.clone();
                let stop = stop.clone();
                move || progress_loop(&ctx, &stop, tx)
            })
            .map_err(|e| TransferError::Thread(e.to_string()))?;
        let address =
            rx.recv().map_err(|_| TransferError::Thread("progress thread exited before starting".into()))??;
        let r = Receiver { ctx, address, stop, thread: Some(thread) };
        tracing::info!("{}", r.describe_library());
        Ok(r)
    }

    /// One line on the loaded libucx: version, file, transports and whether it reaches
    /// GPU memory.
    pub fn describe_library(&self) -> String {
        let (major, minor, release) = ucx_sys::version();
        let path = ucx_sys::library_path().unwrap_or_else(|| "an unknown file".into());
        let cuda = self.supports_cuda();
        format!(
            "UCX {major}.{minor}.{release} from {path}, UCX_TLS={}, CUDA memory {}",
            self.ctx.transports().unwrap_or("(all)"),
            if cuda {
                "supported"
            } else {
                "not supported (a CUDA-enabled UCX: tools/ucx/fetch_cuda_ucx.sh, then LD_LIBRARY_PATH)"
            }
        )
    }

    /// Whether the loaded libucx reaches GPU memory (cuda_copy, cuda_ipc).
    pub fn supports_cuda(&self) -> bool {
        self.ctx.supports(ucx_sys::MemoryType::Cuda)
    }

    /// The worker address peers connect to.
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// Register device memory (a GPU engine's KV pool on one device) so peers write into
    /// it directly; needs a libucx with CUDA transports ([`Receiver::supports_cuda`]).
    /// The region keeps the memory allocated while it lives.
    pub fn register_device(&self, mem: Box<dyn DeviceMemory>) -> Result<RegisteredDevice, TransferError> {
        let region = DeviceRegion::register_memory(&self.ctx, mem)?;
        let spec = RegionSpec { base: region.address(), len: region.len() as u64, rkey: region.pack_rkey()? };
        Ok(RegisteredDevice { region, spec })
    }

    /// Allocate a zeroed region of `bytes` that peers can write into.
    pub fn allocate(&self, bytes: usize) -> Result<RegisteredRegion, TransferError> {
        let region = MemRegion::allocate(&self.ctx, bytes.max(8))?;
        let spec = RegionSpec { base: region.address(), len: region.len() as u64, rkey: region.pack_rkey()? };
        Ok(RegisteredRegion { region, spec })
    }
}

fn progress_loop(ctx: &Context, stop: &AtomicBool, started: std::sync::mpsc::Sender<Result<Vec<u8>, TransferError>>) {
    let worker = match Worker::new(ctx).and_then(|w| w.address().map(|a| (w, a))) {
        Ok((w, address)) => {
            let _ = started.send(Ok(address));
            w
        }
        Err(e) => {
            let _ = started.send(Err(e.into()));
            return;
        }
    };
    while !stop.load(Ordering::Relaxed) {
        while worker.progress() > 0 {}
        if let Err(e) = worker.wait_for_events(WAKE_INTERVAL) {
            tracing::warn!(error = %e, "UCX worker wait failed; polling instead");
            std::thread::sleep(WAKE_INTERVAL);
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
