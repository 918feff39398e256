/*
 * The C compiler's view of the UCX headers, for the layout test: sizes and
 * offsets of every struct field and the value of every constant that
 * src/raw.rs declares. tests/layout.rs compares this table with the Rust side,
 * so a UCX upgrade that moves a field fails a test instead of corrupting memory.
 */
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

struct ucx_sys_layout_entry {
    const char *name;
    int64_t value;
};

#define SIZE(t) {"sizeof " #t, (int64_t)sizeof(t)}
#define ALIGN(t) {"alignof " #t, (int64_t)_Alignof(t)}
#define OFF(t, f) {"offsetof " #t "." #f, (int64_t)offsetof(t, f)}
#define CONST(c) {"const " #c, (int64_t)(c)}

static const struct ucx_sys_layout_entry table[] = {
    SIZE(ucs_status_t),
    SIZE(ucs_thread_mode_t),
    SIZE(ucs_memory_type_t),
    SIZE(ucp_err_handling_mode_t),
    SIZE(ucp_datatype_t),
    SIZE(socklen_t),
    SIZE(nfds_t),

    SIZE(ucp_params_t),
    ALIGN(ucp_params_t),
    OFF(ucp_params_t, field_mask),
    OFF(ucp_params_t, features),
    OFF(ucp_params_t, request_size),
    OFF(ucp_params_t, request_init),
    OFF(ucp_params_t, request_cleanup),
    OFF(ucp_params_t, tag_sender_mask),
    OFF(ucp_params_t, mt_workers_shared),
    OFF(ucp_params_t, estimated_num_eps),
    OFF(ucp_params_t, estimated_num_ppn),
    OFF(ucp_params_t, name),

    SIZE(ucs_cpu_set_t),
    OFF(ucs_cpu_set_t, ucs_bits),

    SIZE(ucp_worker_params_t),
    ALIGN(ucp_worker_params_t),
    OFF(ucp_worker_params_t, field_mask),
    OFF(ucp_worker_params_t, thread_mode),
    OFF(ucp_worker_params_t, cpu_mask),
    OFF(ucp_worker_params_t, events),
    OFF(ucp_worker_params_t, user_data),
    OFF(ucp_worker_params_t, event_fd),
    OFF(ucp_worker_params_t, flags),
    OFF(ucp_worker_params_t, name),
    OFF(ucp_worker_params_t, am_alignment),
    OFF(ucp_worker_params_t, client_id),

    SIZE(ucp_err_handler_t),
    OFF(ucp_err_handler_t, cb),
    OFF(ucp_err_handler_t, arg),

    SIZE(ucs_sock_addr_t),
    OFF(ucs_sock_addr_t, addr),
    OFF(ucs_sock_addr_t, addrlen),

    SIZE(ucp_ep_params_t),
    ALIGN(ucp_ep_params_t),
    OFF(ucp_ep_params_t, field_mask),
    OFF(ucp_ep_params_t, address),
    OFF(ucp_ep_params_t, err_mode),
    OFF(ucp_ep_params_t, err_handler),
    OFF(ucp_ep_params_t, user_data),
    OFF(ucp_ep_params_t, flags),
    OFF(ucp_ep_params_t, sockaddr),
    OFF(ucp_ep_params_t, conn_request),
    OFF(ucp_ep_params_t, name),
    OFF(ucp_ep_params_t, local_sockaddr),

    SIZE(ucp_context_attr_t),
    ALIGN(ucp_context_attr_t),
    OFF(ucp_context_attr_t, field_mask),
    OFF(ucp_context_attr_t, request_size),
    OFF(ucp_context_attr_t, thread_mode),
    OFF(ucp_context_attr_t, memory_types),
    OFF(ucp_context_attr_t, name),

    SIZE(ucp_mem_map_params_t),
    ALIGN(ucp_mem_map_params_t),
    OFF(ucp_mem_map_params_t, field_mask),
    OFF(ucp_mem_map_params_t, address),
    OFF(ucp_mem_map_params_t, length),
    OFF(ucp_mem_map_params_t, flags),
    OFF(ucp_mem_map_params_t, prot),
    OFF(ucp_mem_map_params_t, memory_type),

    SIZE(ucp_mem_attr_t),
    ALIGN(ucp_mem_attr_t),
    OFF(ucp_mem_attr_t, field_mask),
    OFF(ucp_mem_attr_t, address),
    OFF(ucp_mem_attr_t, length),
    OFF(ucp_mem_attr_t, mem_type),

    SIZE(ucp_request_param_t),
    ALIGN(ucp_request_param_t),
    OFF(ucp_request_param_t, op_attr_mask),
    OFF(ucp_request_param_t, flags),
    OFF(ucp_request_param_t, request),
    OFF(ucp_request_param_t, cb),
    OFF(ucp_request_param_t, datatype),
    OFF(ucp_request_param_t, user_data),
    OFF(ucp_request_param_t, reply_buffer),
    OFF(ucp_request_param_t, memory_type),
    OFF(ucp_request_param_t, recv_info),
    OFF(ucp_request_param_t, memh),

    SIZE(struct pollfd),
    OFF(struct pollfd, fd),
    OFF(struct pollfd, events),
    OFF(struct pollfd, revents),

    CONST(UCP_API_MAJOR),
    CONST(UCP_API_MINOR),

    CONST(UCS_OK),
    CONST(UCS_INPROGRESS),
    CONST(UCS_ERR_NO_MESSAGE),
    CONST(UCS_ERR_NO_RESOURCE),
    CONST(UCS_ERR_IO_ERROR),
    CONST(UCS_ERR_NO_MEMORY),
    CONST(UCS_ERR_INVALID_PARAM),
    CONST(UCS_ERR_UNREACHABLE),
    CONST(UCS_ERR_INVALID_ADDR),
    CONST(UCS_ERR_NOT_IMPLEMENTED),
    CONST(UCS_ERR_NO_DEVICE),
    CONST(UCS_ERR_BUSY),
    CONST(UCS_ERR_CANCELED),
    CONST(UCS_ERR_SHMEM_SEGMENT),
    CONST(UCS_ERR_OUT_OF_RANGE),
    CONST(UCS_ERR_TIMED_OUT),
    CONST(UCS_ERR_EXCEEDS_LIMIT),
    CONST(UCS_ERR_UNSUPPORTED),
    CONST(UCS_ERR_REJECTED),
    CONST(UCS_ERR_NOT_CONNECTED),
    CONST(UCS_ERR_CONNECTION_RESET),
    CONST(UCS_ERR_FIRST_LINK_FAILURE),
    CONST(UCS_ERR_LAST_LINK_FAILURE),
    CONST(UCS_ERR_FIRST_ENDPOINT_FAILURE),
    CONST(UCS_ERR_ENDPOINT_TIMEOUT),
    CONST(UCS_ERR_LAST_ENDPOINT_FAILURE),
    CONST(UCS_ERR_LAST),

    CONST(UCS_THREAD_MODE_SINGLE),
    CONST(UCS_MEMORY_TYPE_HOST),
    CONST(UCS_MEMORY_TYPE_CUDA),

    CONST(UCP_PARAM_FIELD_FEATURES),
    CONST(UCP_PARAM_FIELD_MT_WORKERS_SHARED),
    CONST(UCP_FEATURE_RMA),
    CONST(UCP_FEATURE_WAKEUP),
    CONST(UCP_ATTR_FIELD_MEMORY_TYPES),
    CONST(UCP_ENTITY_NAME_MAX),

    CONST(UCP_WORKER_PARAM_FIELD_THREAD_MODE),

    CONST(UCP_EP_PARAM_FIELD_REMOTE_ADDRESS),
    CONST(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE),
    CONST(UCP_EP_PARAM_FIELD_ERR_HANDLER),
    CONST(UCP_ERR_HANDLING_MODE_NONE),
    CONST(UCP_ERR_HANDLING_MODE_PEER),
    CONST(UCP_EP_CLOSE_FLAG_FORCE),

    CONST(UCP_MEM_MAP_PARAM_FIELD_ADDRESS),
    CONST(UCP_MEM_MAP_PARAM_FIELD_LENGTH),
    CONST(UCP_MEM_MAP_PARAM_FIELD_FLAGS),
    CONST(UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE),
    CONST(UCP_MEM_MAP_ALLOCATE),
    CONST(UCP_MEM_ATTR_FIELD_ADDRESS),
    CONST(UCP_MEM_ATTR_FIELD_LENGTH),

    CONST(UCP_OP_ATTR_FIELD_FLAGS),
    CONST(UCP_OP_ATTR_FIELD_MEMORY_TYPE),

    CONST(POLLIN),
    CONST(POLLERR),
    CONST(POLLHUP),
};

size_t ucx_sys_layout_len(void)
{
    return sizeof(table) / sizeof(table[0]);
}

/* Returns 0 past the end of the table, 1 otherwise. */
int ucx_sys_layout_entry(size_t index, const char **name, int64_t *value)
{
    if (index >= ucx_sys_layout_len()) {
        return 0;
    }
    *name  = table[index].name;
    *value = table[index].value;
    return 1;
}
