//! Kernel launches: `cuLaunchKernelEx` with programmatic dependent launch where the GPU
//! has it, or kept in a decode step's recording (`step_graph`).

use std::sync::atomic::Ordering;

use super::runtime::{Gpu, fail};

/// Whether kernels are launched with programmatic dependent launch: compute capability
/// 9.0 and later, unless `SLUICE_CUDA_PDL=0` (plain stream order, to compare or rule it
/// out).
pub(super) fn pdl_enabled(cc: (i32, i32)) -> bool {
    cc.0 >= 9 && std::env::var("SLUICE_CUDA_PDL").map(|v| v != "0").unwrap_or(true)
}

impl Gpu {
    /// Launches `name` with the argument values `args` points at (in the kernel's order).
    ///
    /// Where programmatic dependent launch is on ([`Gpu::pdl`]), a kernel may be placed
    /// on the SMs while the kernel before it in the stream is finishing: once every block
    /// of that one has executed `griddepcontrol.launch_dependents` (every kernel does it
    /// right after its wait, `pdl_begin` in common.cuh), this one's blocks take the SM room
    /// the earlier one's leave, so the launch latency and block placement of each kernel
    /// overlap the tail of the one before instead of following it. Every kernel executes
    /// `griddepcontrol.wait` before it touches memory an earlier kernel writes or reads
    /// (the wait returns once the previous kernel has completed and its writes are
    /// visible); `kernels/tests/cuda_sources.rs` checks that each kernel of the sources
    /// does. Copies,
    /// cuBLAS and NCCL keep ordinary stream order.
    pub(crate) fn launch_raw(
        &self,
        name: &str,
        cfg: cudarc::driver::LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
        sizes: &[usize],
    ) {
        self.launches.fetch_add(1, Ordering::Relaxed);
        let func = self.func(name).cu_function();
        if self.record_launch(func, cfg, args, sizes) {
            return;
        }
        // SAFETY: the function belongs to this context's module; `args` holds one pointer
        // per kernel parameter to a live value of the parameter's C type (the call site
        // establishes this, and the parity suite checks it on a GPU); buffers passed are
        // live device allocations of the sizes the kernel indexes; the stream is ours.
        unsafe { self.launch_now(func, cfg, args, self.stream.cu_stream()) }
            .unwrap_or_else(|e| fail(&format!("launch of {name}"), e));
    }

    /// Launch `func` on `stream` (the backend's, or a recorded branch's side stream) now,
    /// with programmatic dependent launch where on.
    ///
    /// # Safety
    /// `func` is a kernel of this context and `args` one pointer per parameter to a live
    /// value of its C type, buffers live and large enough for what the kernel indexes.
    pub(crate) unsafe fn launch_now(
        &self,
        func: cudarc::driver::sys::CUfunction,
        cfg: cudarc::driver::LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread()?;
        // SAFETY: zero is a valid bit pattern for this plain C struct; id and value are
        // set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream,
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl),
        };
        // SAFETY: the caller's contract (above).
        unsafe { sys::cuLaunchKernelEx(&config, func, args.as_mut_ptr(), std::ptr::null_mut()) }.result()
    }
}
