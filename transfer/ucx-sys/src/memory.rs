//! Memory regions registered with UCX, which peers access with puts and gets: host
//! memory ([`MemRegion`]) and GPU memory ([`DeviceRegion`], where the loaded libucx has
//! CUDA transports: [`Context::supports`]).

use std::ffi::c_void;
use std::ptr;
use std::sync::Arc;

use crate::context::{Context, ContextInner};
use crate::envelope;
use crate::raw;
use crate::status::{UcxError, check};

/// Host memory mapped for remote access: allocated by UCX ([`MemRegion::allocate`]) or
/// registered ([`MemRegion::register`]). `Send + Sync`; unmapped on drop.
///
/// The region hands out no Rust references to its bytes: remote peers write them at
/// any time. Read and write it through raw pointers ([`MemRegion::read_at`],
/// [`MemRegion::write_at`], or `ExternalMemory::as_ptr` for the KV cache).
pub struct MemRegion {
    ctx: Arc<ContextInner>,
    memh: raw::ucp_mem_h,
    addr: *mut u8,
    len: usize,
}

// SAFETY: the context is created with mt_workers_shared, so ucp_rkey_pack and
// ucp_mem_unmap (the only calls made with memh after creation) take the context lock and
// may run on any thread. The memory itself is only reached through raw pointers whose
// users carry their own synchronisation obligations (see read_at/write_at).
unsafe impl Send for MemRegion {}
// SAFETY: as above; &MemRegion methods only read the immutable fields or call those
// thread-safe functions.
unsafe impl Sync for MemRegion {}

impl std::fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemRegion").field("address", &self.addr).field("len", &self.len).finish()
    }
}

/// Where a range of memory lives, as UCX's memory types name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryType {
    Host,
    /// NVIDIA GPU memory (`cuMemAlloc`), reachable through cuda_copy / cuda_ipc / gdr_copy
    /// (and GPUDirect RDMA on InfiniBand) when libucx was built with CUDA.
    Cuda,
}

impl MemoryType {
    pub(crate) fn raw(self) -> raw::ucs_memory_type_t {
        match self {
            MemoryType::Host => raw::UCS_MEMORY_TYPE_HOST,
            MemoryType::Cuda => raw::UCS_MEMORY_TYPE_CUDA,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MemoryType::Host => "host",
            MemoryType::Cuda => "cuda",
        }
    }
}

/// A range of local memory to put from or get into, by address: host or GPU memory
/// (Rust slices cannot point at GPU memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalRange {
    pub addr: u64,
    pub len: usize,
    pub memory: MemoryType,
}

impl LocalRange {
    pub fn host(bytes: &[u8]) -> LocalRange {
        LocalRange { addr: bytes.as_ptr() as u64, len: bytes.len(), memory: MemoryType::Host }
    }
}

/// Local bytes to put, borrowed for the put's duration: host memory, or a range of
/// device memory held by a [`DeviceMemory`](kernels::backend::DeviceMemory) handle (so
/// puts from GPU memory need no `unsafe` at the call site).
#[derive(Clone, Copy)]
pub enum Source<'a> {
    Host(&'a [u8]),
    Device {
        mem: &'a dyn kernels::backend::DeviceMemory,
        offset: usize,
        len: usize,
    },
    /// Device memory registered with the putting worker's context: its memory handle
    /// goes with the put (UCX's zero-copy GPU protocols need the source registered).
    Registered {
        region: &'a DeviceRegion,
        offset: usize,
        len: usize,
    },
}

impl std::fmt::Debug for Source<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Host(b) => write!(f, "Host({} bytes)", b.len()),
            Source::Device { mem, offset, len } => {
                write!(f, "Device(cuda:{} +{offset}, {len} bytes)", mem.ordinal())
            }
            Source::Registered { region, offset, len } => {
                write!(f, "Registered({:#x} +{offset}, {len} bytes)", region.address())
            }
        }
    }
}

impl Source<'_> {
    pub fn len(&self) -> usize {
        match self {
            Source::Host(b) => b.len(),
            Source::Device { len, .. } | Source::Registered { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Which allocation the bytes lie in, for merging puts ([`crate::coalesce`]): the
    /// device memory's or registration's base address; 0 for host memory (which is
    /// not merged).
    pub(crate) fn allocation(&self) -> u64 {
        match self {
            Source::Host(_) => 0,
            Source::Device { mem, .. } => mem.device_ptr(),
            Source::Registered { region, .. } => region.address(),
        }
    }

    /// The range by address (checked against its device memory) and the memory handle
    /// to pass with it, if any.
    pub(crate) fn range(&self) -> Result<(LocalRange, Option<raw::ucp_mem_h>), UcxError> {
        match *self {
            Source::Host(b) => Ok((LocalRange::host(b), None)),
            Source::Registered { region, offset, len } => {
                let addr = region.address() + offset as u64;
                if !region.contains(addr, len) {
                    return Err(UcxError::new(
                        raw::UCS_ERR_INVALID_PARAM,
                        format!("a put of {len} bytes at offset {offset} of a {}-byte registered region", region.len()),
                    ));
                }
                if let Some(m) = &region._keep {
                    m.make_current();
                }
                Ok((LocalRange { addr, len, memory: MemoryType::Cuda }, Some(region.memh())))
            }
            Source::Device { mem, offset, len } => {
                mem.make_current();
                if offset.checked_add(len).is_none_or(|end| end > mem.len()) {
                    return Err(UcxError::new(
                        raw::UCS_ERR_INVALID_PARAM,
                        format!("a put of {len} bytes at offset {offset} of {} bytes of device memory", mem.len()),
                    ));
                }
                Ok((LocalRange { addr: mem.device_ptr() + offset as u64, len, memory: MemoryType::Cuda }, None))
            }
        }
    }
}

/// GPU memory registered for remote access (peers put into it and get from it; UCX
/// picks cuda_ipc between GPUs of one host). Unmapped on drop; the memory itself stays
/// the allocator's. `Send + Sync` like [`MemRegion`].
pub struct DeviceRegion {
    /// Declared first so the registration is unmapped before the memory it covers can
    /// be freed.
    inner: MemRegion,
    /// The allocation, kept alive by the region when it was registered from a handle
    /// ([`DeviceRegion::register_memory`]).
    _keep: Option<Box<dyn kernels::backend::DeviceMemory>>,
}

impl std::fmt::Debug for DeviceRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRegion").field("address", &self.inner.addr).field("len", &self.inner.len).finish()
    }
}

impl DeviceRegion {
    /// Registers CUDA device memory `addr..addr + len`.
    ///
    /// # Safety
    /// The range must be live device memory of this process and stay allocated for as
    /// long as the returned region lives (peers may write it until then).
    pub unsafe fn register(ctx: &Context, addr: u64, len: usize) -> Result<DeviceRegion, UcxError> {
        if !ctx.supports(MemoryType::Cuda) {
            return Err(UcxError::new(raw::UCS_ERR_UNSUPPORTED, "register CUDA memory").with_hint(
                "the loaded libucx has no CUDA transports; load a CUDA-enabled UCX (e.g. the libucx-cu13 wheel's lib/ \
                 on LD_LIBRARY_PATH)",
            ));
        }
        if addr == 0 || !addr.is_multiple_of(8) {
            return Err(UcxError::new(raw::UCS_ERR_INVALID_PARAM, format!("register device memory at {addr:#x}"))
                .with_hint("the memory must be non-null and 8-byte aligned"));
        }
        let inner = map(ctx, addr as *mut c_void, len, 0, MemoryType::Cuda)?;
        Ok(DeviceRegion { inner, _keep: None })
    }

    /// Registers the whole of `mem`, which the region keeps (so the memory stays
    /// allocated for as long as peers may write it).
    pub fn register_memory(
        ctx: &Context,
        mem: Box<dyn kernels::backend::DeviceMemory>,
    ) -> Result<DeviceRegion, UcxError> {
        mem.make_current();
        // SAFETY: a DeviceMemory handle is live device memory of this process for as long
        // as it lives (its trait's contract), and the region holds it until after unmapping.
        let mut region = unsafe { DeviceRegion::register(ctx, mem.device_ptr(), mem.len()) }?;
        region._keep = Some(mem);
        Ok(region)
    }

    pub fn address(&self) -> u64 {
        self.inner.address()
    }

    pub fn len(&self) -> usize {
        self.inner.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// The sealed remote key, as [`MemRegion::pack_rkey`].
    pub fn pack_rkey(&self) -> Result<Vec<u8>, UcxError> {
        self.inner.pack_rkey()
    }

    /// The UCP memory handle, passed with puts from this memory so UCX's zero-copy
    /// protocols (cuda_ipc) take it as registered instead of falling back to copies
    /// through bounce buffers.
    pub(crate) fn memh(&self) -> raw::ucp_mem_h {
        self.inner.memh
    }

    /// Whether `addr..addr + len` lies inside the region.
    pub fn contains(&self, addr: u64, len: usize) -> bool {
        addr >= self.address()
            && addr.checked_add(len as u64).is_some_and(|end| end <= self.address() + self.len() as u64)
    }
}

impl MemRegion {
    /// Allocates `bytes` of zeroed memory through UCX (`UCP_MEM_MAP_ALLOCATE`). UCX picks
    /// the allocator, preferring memory domains that can share it: with shared-memory
    /// transports a peer on the same host then maps the region and puts become plain
    /// copies.
    pub fn allocate(ctx: &Context, bytes: usize) -> Result<MemRegion, UcxError> {
        let region = map(ctx, ptr::null_mut(), bytes, raw::UCP_MEM_MAP_ALLOCATE, MemoryType::Host)?;
        // SAFETY: UCX just allocated at least `bytes` writable bytes at addr, which nobody
        // else knows about yet.
        unsafe { ptr::write_bytes(region.addr, 0, region.len) };
        Ok(region)
    }

    /// Registers existing memory `ptr..ptr + len` (8-byte aligned) for remote access.
    ///
    /// # Safety
    /// The memory must stay allocated, and must not be unmapped or remapped, for as long
    /// as the returned region lives (peers may write it until then). While the region
    /// lives, the caller must not hold Rust references to the memory across points where
    /// a peer may write it.
    pub unsafe fn register(ctx: &Context, ptr: *mut u8, len: usize) -> Result<MemRegion, UcxError> {
        if ptr.is_null() || !(ptr as usize).is_multiple_of(8) {
            return Err(UcxError::new(raw::UCS_ERR_INVALID_PARAM, format!("register memory at {ptr:p}"))
                .with_hint("the memory must be non-null and 8-byte aligned"));
        }
        map(ctx, ptr.cast(), len, 0, MemoryType::Host)
    }

    /// The region's base address, as peers see it (pass it with the packed rkey).
    pub fn address(&self) -> u64 {
        self.addr as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The remote key for this region, sealed together with its base and length, for a
    /// peer's [`Endpoint::unpack_rkey`](crate::Endpoint::unpack_rkey).
    pub fn pack_rkey(&self) -> Result<Vec<u8>, UcxError> {
        let mut buf: *mut c_void = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: context and memh are alive (we hold both); buf and size are out-pointers.
        let status = unsafe { raw::ucp_rkey_pack(self.ctx.handle, self.memh, &mut buf, &mut size) };
        check(status, "ucp_rkey_pack")?;
        // SAFETY: UCX returned `size` readable bytes at buf, valid until released below.
        let packed = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) };
        let sealed = envelope::seal(envelope::RKEY_MAGIC, &[self.address(), self.len as u64], packed);
        // SAFETY: buf came from ucp_rkey_pack and is released once.
        unsafe { raw::ucp_rkey_buffer_release(buf) };
        Ok(sealed)
    }

    /// Copies `dst.len()` bytes at `offset` out of the region. Panics if the range is
    /// outside the region.
    ///
    /// # Safety
    /// Nothing may write the range meanwhile: no remote put in flight to it (synchronise
    /// with the writer, e.g. a message sent after its flush) and no local writer.
    pub unsafe fn read_at(&self, offset: usize, dst: &mut [u8]) {
        self.check_range(offset, dst.len());
        // SAFETY: the range is inside the region (checked), which is live; the caller
        // guarantees no concurrent writer; dst is a distinct Rust buffer.
        unsafe { ptr::copy_nonoverlapping(self.addr.add(offset), dst.as_mut_ptr(), dst.len()) }
    }

    /// Copies `src` into the region at `offset`. Panics if the range is outside the
    /// region.
    ///
    /// # Safety
    /// Nothing may read or write the range meanwhile, locally or remotely.
    pub unsafe fn write_at(&self, offset: usize, src: &[u8]) {
        self.check_range(offset, src.len());
        // SAFETY: the range is inside the region (checked), which is live and writable;
        // the caller guarantees exclusive access to it.
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), self.addr.add(offset), src.len()) }
    }

    fn check_range(&self, offset: usize, len: usize) {
        let end = offset.checked_add(len);
        assert!(end.is_some_and(|end| end <= self.len), "range {offset}+{len} is outside the {}-byte region", self.len);
    }
}

fn map(ctx: &Context, address: *mut c_void, len: usize, flags: u32, memory: MemoryType) -> Result<MemRegion, UcxError> {
    if len == 0 {
        return Err(UcxError::new(raw::UCS_ERR_INVALID_PARAM, "ucp_mem_map of 0 bytes"));
    }
    let what = match (address.is_null(), memory) {
        (true, _) => "ucp_mem_map (allocate)",
        (false, MemoryType::Host) => "ucp_mem_map (register)",
        (false, MemoryType::Cuda) => "ucp_mem_map (register CUDA memory)",
    };
    // Host memory keeps the field unset (as before: UCX detects it); device memory says
    // what it is, so UCX does not have to probe the pointer.
    let memory_field = if memory == MemoryType::Host { 0 } else { raw::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE };
    let params = raw::ucp_mem_map_params_t {
        field_mask: raw::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | raw::UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | raw::UCP_MEM_MAP_PARAM_FIELD_FLAGS
            | memory_field,
        address,
        length: len,
        flags,
        prot: 0,
        memory_type: memory.raw(),
    };
    let mut memh = ptr::null_mut();
    // SAFETY: the context is alive; params is valid for the call (for registration the
    // caller vouches for the memory); memh is an out-pointer.
    let status = unsafe { raw::ucp_mem_map(ctx.inner.handle, &params, &mut memh) };
    check(status, what)?;
    // From here on the region owns memh and unmaps it on every path.
    let mut region = MemRegion { ctx: ctx.inner.clone(), memh, addr: ptr::null_mut(), len };
    let mut attr = raw::ucp_mem_attr_t {
        field_mask: raw::UCP_MEM_ATTR_FIELD_ADDRESS | raw::UCP_MEM_ATTR_FIELD_LENGTH,
        address: ptr::null_mut(),
        length: 0,
        mem_type: raw::UCS_MEMORY_TYPE_HOST,
    };
    // SAFETY: memh is live; attr is a valid out-structure.
    let status = unsafe { raw::ucp_mem_query(memh, &mut attr) };
    check(status, "ucp_mem_query")?;
    if attr.address.is_null() || attr.length < len || !(attr.address as usize).is_multiple_of(8) {
        return Err(UcxError::new(
            raw::UCS_ERR_NO_MEMORY,
            format!("{what} returned {} bytes at {:p} for a request of {len}", attr.length, attr.address),
        ));
    }
    region.addr = attr.address.cast();
    Ok(region)
}

impl Drop for MemRegion {
    fn drop(&mut self) {
        // SAFETY: memh came from ucp_mem_map on this context and is unmapped once. A
        // failure cannot be reported from drop; UCX then keeps the mapping until
        // ucp_cleanup.
        let _ = unsafe { raw::ucp_mem_unmap(self.ctx.handle, self.memh) };
    }
}

// SAFETY: addr..addr+len is mapped, writable and (checked in `map`) 8-byte aligned for
// as long as the region lives, since it is unmapped only in Drop and UCX never moves it.
// The region creates no Rust references to the bytes.
unsafe impl kernels::backend::ExternalMemory for MemRegion {
    fn as_ptr(&self) -> *mut u8 {
        self.addr
    }

    fn len(&self) -> usize {
        self.len
    }
}
