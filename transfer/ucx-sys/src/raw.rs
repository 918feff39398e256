//! Level 1: hand-written declarations for the subset of UCX 1.13 (`ucp/api/ucp.h`,
//! `ucs/type/status.h`) this crate uses, plus `poll(2)`.
//!
//! Everything here mirrors the C headers byte for byte; `tests/layout.rs` checks every
//! struct size, field offset and constant against what the C compiler sees (via
//! `csrc/layout.c`). Names keep the C spelling so they can be grepped in the headers.
#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_short, c_uint, c_ulong, c_void};

/// `ucs_status_t` is declared `UCS_S_PACKED` (`__attribute__((packed))`), so the enum
/// is a single signed byte, not an `int`.
pub type ucs_status_t = i8;
/// `void *` carrying either a request pointer or an encoded `ucs_status_t`.
pub type ucs_status_ptr_t = *mut c_void;
pub type ucs_thread_mode_t = c_uint;
pub type ucs_memory_type_t = c_uint;
pub type ucp_err_handling_mode_t = c_uint;
pub type ucp_datatype_t = u64;
pub type socklen_t = u32;
pub type nfds_t = c_ulong;

macro_rules! opaque {
    ($($(#[$m:meta])* $name:ident;)*) => {$(
        $(#[$m])*
        #[repr(C)]
        pub struct $name {
            _private: [u8; 0],
            // Opaque C objects are neither Send, Sync nor Unpin.
            _marker: std::marker::PhantomData<(*mut u8, std::marker::PhantomPinned)>,
        }
    )*};
}

opaque! {
    ucp_context;
    ucp_config_t;
    ucp_worker;
    ucp_ep;
    ucp_mem;
    ucp_rkey;
    ucp_address_t;
    ucp_conn_request;
    sockaddr;
}

pub type ucp_context_h = *mut ucp_context;
pub type ucp_worker_h = *mut ucp_worker;
pub type ucp_ep_h = *mut ucp_ep;
pub type ucp_mem_h = *mut ucp_mem;
pub type ucp_rkey_h = *mut ucp_rkey;
pub type ucp_conn_request_h = *mut ucp_conn_request;

pub type ucp_request_init_callback_t = Option<unsafe extern "C" fn(request: *mut c_void)>;
pub type ucp_request_cleanup_callback_t = Option<unsafe extern "C" fn(request: *mut c_void)>;
pub type ucp_err_handler_cb_t = Option<unsafe extern "C" fn(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t)>;
pub type ucp_send_nbx_callback_t =
    Option<unsafe extern "C" fn(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void)>;

// ---- ucs/type/status.h ----------------------------------------------------------------

pub const UCS_OK: ucs_status_t = 0;
pub const UCS_INPROGRESS: ucs_status_t = 1;
pub const UCS_ERR_NO_MESSAGE: ucs_status_t = -1;
pub const UCS_ERR_NO_RESOURCE: ucs_status_t = -2;
pub const UCS_ERR_IO_ERROR: ucs_status_t = -3;
pub const UCS_ERR_NO_MEMORY: ucs_status_t = -4;
pub const UCS_ERR_INVALID_PARAM: ucs_status_t = -5;
pub const UCS_ERR_UNREACHABLE: ucs_status_t = -6;
pub const UCS_ERR_INVALID_ADDR: ucs_status_t = -7;
pub const UCS_ERR_NOT_IMPLEMENTED: ucs_status_t = -8;
pub const UCS_ERR_NO_DEVICE: ucs_status_t = -14;
pub const UCS_ERR_BUSY: ucs_status_t = -15;
pub const UCS_ERR_CANCELED: ucs_status_t = -16;
pub const UCS_ERR_SHMEM_SEGMENT: ucs_status_t = -17;
pub const UCS_ERR_OUT_OF_RANGE: ucs_status_t = -19;
pub const UCS_ERR_TIMED_OUT: ucs_status_t = -20;
pub const UCS_ERR_EXCEEDS_LIMIT: ucs_status_t = -21;
pub const UCS_ERR_UNSUPPORTED: ucs_status_t = -22;
pub const UCS_ERR_REJECTED: ucs_status_t = -23;
pub const UCS_ERR_NOT_CONNECTED: ucs_status_t = -24;
pub const UCS_ERR_CONNECTION_RESET: ucs_status_t = -25;
pub const UCS_ERR_FIRST_LINK_FAILURE: ucs_status_t = -40;
pub const UCS_ERR_LAST_LINK_FAILURE: ucs_status_t = -59;
pub const UCS_ERR_FIRST_ENDPOINT_FAILURE: ucs_status_t = -60;
pub const UCS_ERR_ENDPOINT_TIMEOUT: ucs_status_t = -80;
pub const UCS_ERR_LAST_ENDPOINT_FAILURE: ucs_status_t = -89;
pub const UCS_ERR_LAST: ucs_status_t = -100;

/// `UCS_PTR_IS_ERR`: the pointer encodes an error status (the top 100 addresses).
#[inline]
pub fn UCS_PTR_IS_ERR(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize) >= (UCS_ERR_LAST as isize as usize)
}

/// `UCS_PTR_IS_PTR`: the pointer is a real request (neither NULL/`UCS_OK` nor an error).
#[inline]
pub fn UCS_PTR_IS_PTR(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize).wrapping_sub(1) < (UCS_ERR_LAST as isize as usize).wrapping_sub(1)
}

/// `UCS_PTR_RAW_STATUS`: the status bits of a pointer that is not a request.
#[inline]
pub fn UCS_PTR_RAW_STATUS(ptr: ucs_status_ptr_t) -> ucs_status_t {
    // Truncation is the C cast `(ucs_status_t)(intptr_t)ptr`.
    ptr as isize as ucs_status_t
}

/// `UCS_PTR_STATUS`: `UCS_INPROGRESS` for a request, else the encoded status.
#[inline]
pub fn UCS_PTR_STATUS(ptr: ucs_status_ptr_t) -> ucs_status_t {
    if UCS_PTR_IS_PTR(ptr) { UCS_INPROGRESS } else { UCS_PTR_RAW_STATUS(ptr) }
}

/// `UCS_STATUS_PTR`: encode a status as a pointer.
#[inline]
pub fn UCS_STATUS_PTR(status: ucs_status_t) -> ucs_status_ptr_t {
    status as isize as ucs_status_ptr_t
}

// ---- ucs/type/thread_mode.h, ucs/memory/memory_type.h ---------------------------------

pub const UCS_THREAD_MODE_SINGLE: ucs_thread_mode_t = 0;
pub const UCS_MEMORY_TYPE_HOST: ucs_memory_type_t = 0;
pub const UCS_MEMORY_TYPE_CUDA: ucs_memory_type_t = 1;

// ---- ucp/api/ucp_version.h -------------------------------------------------------------

pub const UCP_API_MAJOR: c_uint = 1;
pub const UCP_API_MINOR: c_uint = 13;

// ---- context ---------------------------------------------------------------------------

pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;
pub const UCP_ENTITY_NAME_MAX: usize = 32;

/// `ucp_context_attr_t` as UCX 1.13 declares it; later versions only append fields, and
/// `ucp_context_query` writes just the ones `field_mask` asks for.
#[repr(C)]
pub struct ucp_context_attr_t {
    pub field_mask: u64,
    pub request_size: usize,
    pub thread_mode: ucs_thread_mode_t,
    pub memory_types: u64,
    pub name: [c_char; UCP_ENTITY_NAME_MAX],
}

#[repr(C)]
pub struct ucp_params_t {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: ucp_request_init_callback_t,
    pub request_cleanup: ucp_request_cleanup_callback_t,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

// ---- worker ----------------------------------------------------------------------------

pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;

#[repr(C)]
pub struct ucs_cpu_set_t {
    /// `UCS_CPU_SETSIZE / (8 * sizeof(unsigned long))` = 1024 / 64 words.
    pub ucs_bits: [c_ulong; 16],
}

#[repr(C)]
pub struct ucp_worker_params_t {
    pub field_mask: u64,
    pub thread_mode: ucs_thread_mode_t,
    pub cpu_mask: ucs_cpu_set_t,
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

// ---- endpoint --------------------------------------------------------------------------

pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub const UCP_ERR_HANDLING_MODE_NONE: ucp_err_handling_mode_t = 0;
pub const UCP_ERR_HANDLING_MODE_PEER: ucp_err_handling_mode_t = 1;
/// Passed in `ucp_request_param_t::flags` to `ucp_ep_close_nbx`.
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

#[repr(C)]
pub struct ucp_err_handler_t {
    pub cb: ucp_err_handler_cb_t,
    pub arg: *mut c_void,
}

#[repr(C)]
pub struct ucs_sock_addr_t {
    pub addr: *const sockaddr,
    pub addrlen: socklen_t,
}

#[repr(C)]
pub struct ucp_ep_params_t {
    pub field_mask: u64,
    pub address: *const ucp_address_t,
    pub err_mode: ucp_err_handling_mode_t,
    pub err_handler: ucp_err_handler_t,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: ucs_sock_addr_t,
    pub conn_request: ucp_conn_request_h,
    pub name: *const c_char,
    pub local_sockaddr: ucs_sock_addr_t,
}

// ---- memory ----------------------------------------------------------------------------

pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
pub const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
pub const UCP_MEM_MAP_ALLOCATE: c_uint = 1 << 1;
pub const UCP_MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;

#[repr(C)]
pub struct ucp_mem_map_params_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: ucs_memory_type_t,
}

#[repr(C)]
pub struct ucp_mem_attr_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub mem_type: ucs_memory_type_t,
}

// ---- requests --------------------------------------------------------------------------

pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;
pub const UCP_OP_ATTR_FIELD_MEMH: u32 = 1 << 8;

/// The `cb` union of `ucp_request_param_t`: every member is a function pointer, so it is
/// represented by the one member this crate would ever set.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ucp_request_param_cb {
    pub send: ucp_send_nbx_callback_t,
}

/// The `recv_info` union of `ucp_request_param_t`: two pointer members.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ucp_request_param_recv_info {
    pub length: *mut usize,
    pub tag_info: *mut c_void,
}

#[repr(C)]
pub struct ucp_request_param_t {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: ucp_request_param_cb,
    pub datatype: ucp_datatype_t,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: ucs_memory_type_t,
    pub recv_info: ucp_request_param_recv_info,
    pub memh: ucp_mem_h,
}

// ---- poll(2) ---------------------------------------------------------------------------

pub const POLLIN: c_short = 0x1;
pub const POLLERR: c_short = 0x8;
pub const POLLHUP: c_short = 0x10;

#[repr(C)]
pub struct pollfd {
    pub fd: c_int,
    pub events: c_short,
    pub revents: c_short,
}

unsafe extern "C" {
    pub fn poll(fds: *mut pollfd, nfds: nfds_t, timeout: c_int) -> c_int;
}

// ---- functions -------------------------------------------------------------------------

// Linked by build.rs (libucp, libucs).
unsafe extern "C" {
    pub fn ucp_get_version(major_version: *mut c_uint, minor_version: *mut c_uint, release_number: *mut c_uint);

    pub fn ucp_context_query(context_p: ucp_context_h, attr: *mut ucp_context_attr_t) -> ucs_status_t;

    pub fn ucp_config_read(
        env_prefix: *const c_char,
        filename: *const c_char,
        config_p: *mut *mut ucp_config_t,
    ) -> ucs_status_t;
    pub fn ucp_config_modify(config: *mut ucp_config_t, name: *const c_char, value: *const c_char) -> ucs_status_t;
    pub fn ucp_config_release(config: *mut ucp_config_t);

    /// `ucp_init` is a `static inline` wrapper around this; pass
    /// [`UCP_API_MAJOR`]/[`UCP_API_MINOR`].
    pub fn ucp_init_version(
        api_major_version: c_uint,
        api_minor_version: c_uint,
        params: *const ucp_params_t,
        config: *const ucp_config_t,
        context_p: *mut ucp_context_h,
    ) -> ucs_status_t;
    pub fn ucp_cleanup(context_p: ucp_context_h);

    pub fn ucp_worker_create(
        context: ucp_context_h,
        params: *const ucp_worker_params_t,
        worker_p: *mut ucp_worker_h,
    ) -> ucs_status_t;
    pub fn ucp_worker_destroy(worker: ucp_worker_h);
    pub fn ucp_worker_get_address(
        worker: ucp_worker_h,
        address_p: *mut *mut ucp_address_t,
        address_length_p: *mut usize,
    ) -> ucs_status_t;
    pub fn ucp_worker_release_address(worker: ucp_worker_h, address: *mut ucp_address_t);
    pub fn ucp_worker_progress(worker: ucp_worker_h) -> c_uint;
    pub fn ucp_worker_get_efd(worker: ucp_worker_h, fd: *mut c_int) -> ucs_status_t;
    pub fn ucp_worker_arm(worker: ucp_worker_h) -> ucs_status_t;
    pub fn ucp_worker_flush_nbx(worker: ucp_worker_h, param: *const ucp_request_param_t) -> ucs_status_ptr_t;

    pub fn ucp_ep_create(worker: ucp_worker_h, params: *const ucp_ep_params_t, ep_p: *mut ucp_ep_h) -> ucs_status_t;
    pub fn ucp_ep_close_nbx(ep: ucp_ep_h, param: *const ucp_request_param_t) -> ucs_status_ptr_t;
    pub fn ucp_ep_flush_nbx(ep: ucp_ep_h, param: *const ucp_request_param_t) -> ucs_status_ptr_t;

    pub fn ucp_mem_map(
        context: ucp_context_h,
        params: *const ucp_mem_map_params_t,
        memh_p: *mut ucp_mem_h,
    ) -> ucs_status_t;
    pub fn ucp_mem_unmap(context: ucp_context_h, memh: ucp_mem_h) -> ucs_status_t;
    pub fn ucp_mem_query(memh: ucp_mem_h, attr: *mut ucp_mem_attr_t) -> ucs_status_t;

    pub fn ucp_rkey_pack(
        context: ucp_context_h,
        memh: ucp_mem_h,
        rkey_buffer_p: *mut *mut c_void,
        size_p: *mut usize,
    ) -> ucs_status_t;
    pub fn ucp_rkey_buffer_release(rkey_buffer: *mut c_void);
    pub fn ucp_ep_rkey_unpack(ep: ucp_ep_h, rkey_buffer: *const c_void, rkey_p: *mut ucp_rkey_h) -> ucs_status_t;
    pub fn ucp_rkey_destroy(rkey: ucp_rkey_h);

    pub fn ucp_put_nbx(
        ep: ucp_ep_h,
        buffer: *const c_void,
        count: usize,
        remote_addr: u64,
        rkey: ucp_rkey_h,
        param: *const ucp_request_param_t,
    ) -> ucs_status_ptr_t;
    pub fn ucp_get_nbx(
        ep: ucp_ep_h,
        buffer: *mut c_void,
        count: usize,
        remote_addr: u64,
        rkey: ucp_rkey_h,
        param: *const ucp_request_param_t,
    ) -> ucs_status_ptr_t;

    pub fn ucp_request_check_status(request: *mut c_void) -> ucs_status_t;
    pub fn ucp_request_cancel(worker: ucp_worker_h, request: *mut c_void);
    pub fn ucp_request_free(request: *mut c_void);
}

unsafe extern "C" {
    /// Returns a static, NUL-terminated string (never NULL).
    pub fn ucs_status_string(status: ucs_status_t) -> *const c_char;
}

// ---- dlfcn.h (which file a loaded symbol came from) -----------------------------------

#[repr(C)]
pub struct Dl_info {
    pub dli_fname: *const c_char,
    pub dli_fbase: *mut c_void,
    pub dli_sname: *const c_char,
    pub dli_saddr: *mut c_void,
}

unsafe extern "C" {
    pub fn dladdr(addr: *const c_void, info: *mut Dl_info) -> c_int;
}

// ---- csrc/layout.c ---------------------------------------------------------------------

unsafe extern "C" {
    pub fn ucx_sys_layout_len() -> usize;
    /// Returns 0 past the end of the table, 1 otherwise.
    pub fn ucx_sys_layout_entry(index: usize, name: *mut *const c_char, value: *mut i64) -> c_int;
}

impl ucp_request_param_t {
    /// All fields unset (`op_attr_mask == 0`): no callback, UCX-allocated request.
    pub fn empty() -> Self {
        ucp_request_param_t {
            op_attr_mask: 0,
            flags: 0,
            request: std::ptr::null_mut(),
            cb: ucp_request_param_cb { send: None },
            datatype: 0,
            user_data: std::ptr::null_mut(),
            reply_buffer: std::ptr::null_mut(),
            memory_type: UCS_MEMORY_TYPE_HOST,
            recv_info: ucp_request_param_recv_info { length: std::ptr::null_mut() },
            memh: std::ptr::null_mut(),
        }
    }
}
