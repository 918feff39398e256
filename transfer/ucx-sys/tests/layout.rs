//! The `#[repr(C)]` declarations in `ucx_sys::raw` against the C compiler's view of the
//! UCX headers (csrc/layout.c): every size, alignment, field offset and constant.

use std::collections::BTreeMap;
use std::mem::{align_of, offset_of, size_of};

use ucx_sys::raw::*;

macro_rules! size {
    ($t:ty) => {
        (format!("sizeof {}", stringify!($t)), size_of::<$t>() as i64)
    };
}
macro_rules! align {
    ($t:ty) => {
        (format!("alignof {}", stringify!($t)), align_of::<$t>() as i64)
    };
}
macro_rules! off {
    ($t:ident, $($f:ident),+) => {
        [$((format!("offsetof {}.{}", stringify!($t), stringify!($f)), offset_of!($t, $f) as i64)),+]
    };
}
macro_rules! consts {
    ($($c:ident),+ $(,)?) => {
        [$((format!("const {}", stringify!($c)), $c as i64)),+]
    };
}

fn rust_table() -> Vec<(String, i64)> {
    let mut t = vec![
        size!(ucs_status_t),
        size!(ucs_thread_mode_t),
        size!(ucs_memory_type_t),
        size!(ucp_err_handling_mode_t),
        size!(ucp_datatype_t),
        size!(socklen_t),
        size!(nfds_t),
        size!(ucp_params_t),
        align!(ucp_params_t),
        size!(ucs_cpu_set_t),
        size!(ucp_worker_params_t),
        align!(ucp_worker_params_t),
        size!(ucp_err_handler_t),
        size!(ucs_sock_addr_t),
        size!(ucp_ep_params_t),
        align!(ucp_ep_params_t),
        size!(ucp_context_attr_t),
        align!(ucp_context_attr_t),
        size!(ucp_mem_map_params_t),
        align!(ucp_mem_map_params_t),
        size!(ucp_mem_attr_t),
        align!(ucp_mem_attr_t),
        size!(ucp_request_param_t),
        align!(ucp_request_param_t),
        // C spells it `struct pollfd`.
        ("sizeof struct pollfd".to_string(), size_of::<pollfd>() as i64),
    ];
    t.extend(off!(
        ucp_params_t,
        field_mask,
        features,
        request_size,
        request_init,
        request_cleanup,
        tag_sender_mask,
        mt_workers_shared,
        estimated_num_eps,
        estimated_num_ppn,
        name
    ));
    t.extend(off!(ucs_cpu_set_t, ucs_bits));
    t.extend(off!(
        ucp_worker_params_t,
        field_mask,
        thread_mode,
        cpu_mask,
        events,
        user_data,
        event_fd,
        flags,
        name,
        am_alignment,
        client_id
    ));
    t.extend(off!(ucp_err_handler_t, cb, arg));
    t.extend(off!(ucs_sock_addr_t, addr, addrlen));
    t.extend(off!(
        ucp_ep_params_t,
        field_mask,
        address,
        err_mode,
        err_handler,
        user_data,
        flags,
        sockaddr,
        conn_request,
        name,
        local_sockaddr
    ));
    t.extend(off!(ucp_context_attr_t, field_mask, request_size, thread_mode, memory_types, name));
    t.extend(off!(ucp_mem_map_params_t, field_mask, address, length, flags, prot, memory_type));
    t.extend(off!(ucp_mem_attr_t, field_mask, address, length, mem_type));
    t.extend(off!(
        ucp_request_param_t,
        op_attr_mask,
        flags,
        request,
        cb,
        datatype,
        user_data,
        reply_buffer,
        memory_type,
        recv_info,
        memh
    ));
    for (field, offset) in [
        ("fd", offset_of!(pollfd, fd)),
        ("events", offset_of!(pollfd, events)),
        ("revents", offset_of!(pollfd, revents)),
    ] {
        t.push((format!("offsetof struct pollfd.{field}"), offset as i64));
    }
    t.extend(consts!(UCP_API_MAJOR, UCP_API_MINOR));
    t.extend(consts!(
        UCS_OK,
        UCS_INPROGRESS,
        UCS_ERR_NO_MESSAGE,
        UCS_ERR_NO_RESOURCE,
        UCS_ERR_IO_ERROR,
        UCS_ERR_NO_MEMORY,
        UCS_ERR_INVALID_PARAM,
        UCS_ERR_UNREACHABLE,
        UCS_ERR_INVALID_ADDR,
        UCS_ERR_NOT_IMPLEMENTED,
        UCS_ERR_NO_DEVICE,
        UCS_ERR_BUSY,
        UCS_ERR_CANCELED,
        UCS_ERR_SHMEM_SEGMENT,
        UCS_ERR_OUT_OF_RANGE,
        UCS_ERR_TIMED_OUT,
        UCS_ERR_EXCEEDS_LIMIT,
        UCS_ERR_UNSUPPORTED,
        UCS_ERR_REJECTED,
        UCS_ERR_NOT_CONNECTED,
        UCS_ERR_CONNECTION_RESET,
        UCS_ERR_FIRST_LINK_FAILURE,
        UCS_ERR_LAST_LINK_FAILURE,
        UCS_ERR_FIRST_ENDPOINT_FAILURE,
        UCS_ERR_ENDPOINT_TIMEOUT,
        UCS_ERR_LAST_ENDPOINT_FAILURE,
        UCS_ERR_LAST,
    ));
    t.extend(consts!(
        UCS_THREAD_MODE_SINGLE,
        UCS_MEMORY_TYPE_HOST,
        UCS_MEMORY_TYPE_CUDA,
        UCP_PARAM_FIELD_FEATURES,
        UCP_PARAM_FIELD_MT_WORKERS_SHARED,
        UCP_FEATURE_RMA,
        UCP_FEATURE_WAKEUP,
        UCP_ATTR_FIELD_MEMORY_TYPES,
        UCP_ENTITY_NAME_MAX,
        UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        UCP_EP_PARAM_FIELD_ERR_HANDLER,
        UCP_ERR_HANDLING_MODE_NONE,
        UCP_ERR_HANDLING_MODE_PEER,
        UCP_EP_CLOSE_FLAG_FORCE,
        UCP_MEM_MAP_PARAM_FIELD_ADDRESS,
        UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
        UCP_MEM_MAP_ALLOCATE,
        UCP_MEM_ATTR_FIELD_ADDRESS,
        UCP_MEM_ATTR_FIELD_LENGTH,
        UCP_OP_ATTR_FIELD_FLAGS,
        UCP_OP_ATTR_FIELD_MEMORY_TYPE,
        POLLIN,
        POLLERR,
        POLLHUP,
    ));
    t
}

#[test]
fn rust_declarations_match_the_c_headers() {
    let c: BTreeMap<String, i64> = ucx_sys::layout::c_table().into_iter().collect();
    let rust: BTreeMap<String, i64> = rust_table().into_iter().collect();
    let mut problems = Vec::new();
    for (name, value) in &rust {
        match c.get(name) {
            Some(c_value) if c_value == value => {}
            Some(c_value) => problems.push(format!("{name}: Rust {value}, C {c_value}")),
            None => problems.push(format!("{name}: not in csrc/layout.c")),
        }
    }
    for name in c.keys().filter(|name| !rust.contains_key(*name)) {
        problems.push(format!("{name}: in csrc/layout.c but not checked on the Rust side"));
    }
    assert!(problems.is_empty(), "layout mismatches:\n{}", problems.join("\n"));
    assert!(rust.len() > 100, "table suspiciously small: {}", rust.len());
}

#[test]
fn status_pointer_encoding() {
    let null = std::ptr::null_mut();
    assert!(!UCS_PTR_IS_ERR(null) && !UCS_PTR_IS_PTR(null));
    assert_eq!(UCS_PTR_STATUS(null), UCS_OK);
    for status in [UCS_ERR_NO_MESSAGE, UCS_ERR_UNREACHABLE, UCS_ERR_LAST] {
        let ptr = UCS_STATUS_PTR(status);
        assert!(UCS_PTR_IS_ERR(ptr) && !UCS_PTR_IS_PTR(ptr), "{status}");
        assert_eq!(UCS_PTR_STATUS(ptr), status);
    }
    let request = 0x7f00_0000_1000usize as ucs_status_ptr_t;
    assert!(UCS_PTR_IS_PTR(request) && !UCS_PTR_IS_ERR(request));
    assert_eq!(UCS_PTR_STATUS(request), UCS_INPROGRESS);
}

#[test]
fn library_is_at_least_the_bindings_version() {
    let (major, minor, _) = ucx_sys::version();
    // Later 1.x releases only append fields to the structs used here.
    assert!((major, minor) >= (UCP_API_MAJOR, UCP_API_MINOR), "bindings need UCX >= 1.13, loaded {major}.{minor}");
}
