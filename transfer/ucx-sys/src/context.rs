//! The UCP context: transports, memory domains and configuration for one process.

use std::ffi::CString;
use std::ops::BitOr;
use std::ptr;
use std::sync::Arc;

use crate::raw;
use crate::status::{UcxError, check};

/// UCP features a [`Context`] is created with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features(u64);

impl Features {
    /// One-sided put/get.
    pub const RMA: Features = Features(raw::UCP_FEATURE_RMA);
    /// An event fd per worker ([`Worker::efd`](crate::Worker::efd)), so a progress
    /// thread can sleep instead of spinning.
    pub const WAKEUP: Features = Features(raw::UCP_FEATURE_WAKEUP);

    pub const fn bits(self) -> u64 {
        self.0
    }

    pub const fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        Features(self.0 | rhs.0)
    }
}

/// Owns the `ucp_context_h`; shared by every object created from it so that
/// `ucp_cleanup` runs only after the last worker and memory region is gone.
pub(crate) struct ContextInner {
    pub(crate) handle: raw::ucp_context_h,
    pub(crate) features: Features,
    /// `UCX_TLS` as the context was created with it (override, else environment;
    /// `None`: unset, all transports).
    pub(crate) tls: Option<String>,
}

// SAFETY: the context is created with `mt_workers_shared = 1`, so UCX guards the calls
// this crate makes on it from several threads (ucp_mem_map/unmap, ucp_rkey_pack,
// ucp_worker_create) with the context's own lock. ucp_cleanup runs once, in Drop.
unsafe impl Send for ContextInner {}
// SAFETY: as above; shared references only reach the context through those calls.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_init_version; every Worker and MemRegion holds
        // an Arc to this object, so none of them is alive any more.
        unsafe { raw::ucp_cleanup(self.handle) }
    }
}

/// A UCP context. Cheap to clone; `Send + Sync`.
///
/// Configuration comes from the environment (`UCX_TLS`, `UCX_NET_DEVICES`, ...), as for
/// every UCX program, with optional overrides from [`Context::with_config`].
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("handle", &self.inner.handle).field("features", &self.inner.features).finish()
    }
}

impl Context {
    /// A context configured from the `UCX_*` environment variables.
    pub fn new(features: Features) -> Result<Context, UcxError> {
        Context::with_config(features, &[])
    }

    /// A context configured from the environment, then `overrides` on top: pairs of
    /// UCX variable name (with or without the `UCX_` prefix) and value, e.g.
    /// `[("TLS", "shm")]`. Overrides win over the environment. UCX accepts unknown names
    /// silently (it passes them on to transports), but rejects bad values.
    pub fn with_config(features: Features, overrides: &[(&str, &str)]) -> Result<Context, UcxError> {
        let config = Config::read()?;
        for (name, value) in overrides {
            config.modify(name, value)?;
        }
        let tls = overrides
            .iter()
            .rev()
            .find(|(name, _)| name.strip_prefix("UCX_").unwrap_or(name) == "TLS")
            .map(|(_, value)| value.to_string())
            .or_else(|| std::env::var("UCX_TLS").ok());
        let params = raw::ucp_params_t {
            field_mask: raw::UCP_PARAM_FIELD_FEATURES | raw::UCP_PARAM_FIELD_MT_WORKERS_SHARED,
            features: features.bits(),
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            // Memory regions are mapped and unmapped from threads other than the worker's.
            mt_workers_shared: 1,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: ptr::null(),
        };
        let mut handle = ptr::null_mut();
        // SAFETY: params and config are valid for the call; handle is an out-pointer.
        let status =
            unsafe { raw::ucp_init_version(raw::UCP_API_MAJOR, raw::UCP_API_MINOR, &params, config.0, &mut handle) };
        check(status, "ucp_init (create UCX context)")?;
        Ok(Context { inner: Arc::new(ContextInner { handle, features, tls }) })
    }

    pub fn features(&self) -> Features {
        self.inner.features
    }

    /// The `UCX_TLS` this context was created with (`None`: unset, all transports).
    pub fn transports(&self) -> Option<&str> {
        self.inner.tls.as_deref()
    }

    /// Whether the context's transports reach memory of type `memory` (a libucx built
    /// without CUDA, such as Debian's, reaches host memory only).
    pub fn supports(&self, memory: crate::MemoryType) -> bool {
        self.memory_types() & (1u64 << memory.raw()) != 0
    }

    /// Bit set of the UCX memory types (`1 << ucs_memory_type_t`) this context supports.
    pub fn memory_types(&self) -> u64 {
        let mut attr = raw::ucp_context_attr_t {
            field_mask: raw::UCP_ATTR_FIELD_MEMORY_TYPES,
            request_size: 0,
            thread_mode: 0,
            memory_types: 0,
            name: [0; raw::UCP_ENTITY_NAME_MAX],
        };
        // SAFETY: the context is alive; attr is a valid out-structure of which UCX writes
        // only the field the mask asks for.
        let status = unsafe { raw::ucp_context_query(self.inner.handle, &mut attr) };
        if check(status, "ucp_context_query").is_err() {
            return 1 << raw::UCS_MEMORY_TYPE_HOST;
        }
        attr.memory_types
    }

    /// The endpoint error mode this context's transports can honour
    /// ([`ErrorMode::for_transports`](crate::ErrorMode::for_transports)).
    pub fn error_mode(&self) -> crate::ErrorMode {
        crate::ErrorMode::for_transports(self.transports())
    }
}

/// A `ucp_config_t`, released on drop.
struct Config(*mut raw::ucp_config_t);

impl Config {
    fn read() -> Result<Config, UcxError> {
        let mut config = ptr::null_mut();
        // SAFETY: NULL prefix and file mean "UCX_" and no config file; config is an
        // out-pointer.
        let status = unsafe { raw::ucp_config_read(ptr::null(), ptr::null(), &mut config) };
        check(status, "ucp_config_read (read UCX_* environment)")?;
        Ok(Config(config))
    }

    fn modify(&self, name: &str, value: &str) -> Result<(), UcxError> {
        let what = || format!("ucp_config_modify({name}={value})");
        let bare = name.strip_prefix("UCX_").unwrap_or(name);
        let invalid =
            || UcxError::new(raw::UCS_ERR_INVALID_PARAM, what()).with_hint("names and values cannot hold NUL");
        let c_name = CString::new(bare).map_err(|_| invalid())?;
        let c_value = CString::new(value).map_err(|_| invalid())?;
        // SAFETY: self.0 is a live config; both strings are NUL-terminated and outlive the call.
        let status = unsafe { raw::ucp_config_modify(self.0, c_name.as_ptr(), c_value.as_ptr()) };
        check(status, &what()).map_err(|e| e.with_hint("check the value against `ucx_info -cf`"))
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: self.0 came from ucp_config_read and is released exactly once.
        unsafe { raw::ucp_config_release(self.0) }
    }
}

/// The file the UCX library was loaded from (`libucp.so.0` of the system, or the one
/// `LD_LIBRARY_PATH` put first, e.g. a CUDA-enabled build), when the loader says.
pub fn library_path() -> Option<String> {
    let mut info = raw::Dl_info {
        dli_fname: ptr::null(),
        dli_fbase: ptr::null_mut(),
        dli_sname: ptr::null(),
        dli_saddr: ptr::null_mut(),
    };
    let symbol = raw::ucp_get_version as *const std::ffi::c_void;
    // SAFETY: dladdr reads the loader's tables for a function of libucp; info is a valid
    // out-structure whose file name stays valid while the library is loaded (always).
    let found = unsafe { raw::dladdr(symbol, &mut info) } != 0;
    if !found || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated path owned by the loader (checked non-null).
    Some(unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned())
}

/// The version of the UCX library loaded at run time: (major, minor, release).
pub fn version() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: three out-pointers to live integers.
    unsafe { raw::ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}
