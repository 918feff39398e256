// Kernel timeline of a CUDA program, as the device really ran it: loaded by the CUDA
// driver through CUDA_INJECTION64_PATH (no change to the program), it asks CUPTI for
// concurrent-kernel activity records (start and end of every kernel, graph nodes
// included, without serialising them as Nsight Compute does) and writes one CSV line a
// kernel to $SLUICE_TIMELINE (default timeline.csv). The device machines have no Nsight
// Systems; tools/bench/timeline.sh builds this file there and tools/bench/timeline.py
// reads what it writes.
//
// With MEMCPY_RECORD / MEMSET_RECORD (the newest CUpti_ActivityMemcpyN / MemsetN) it also
// writes a line a copy or memset (a step's uploads, the read-back), named memcpy_HtoD,
// memcpy_DtoH, memcpy_DtoD (memcpy_kN otherwise) or memset, with its bytes in grid_x and
// zeros in grid_y and block_x.
//
// Build: cc -shared -fPIC -O2 -DKERNEL_RECORD=CUpti_ActivityKernelN [-DMEMCPY_RECORD=…
//        -DMEMSET_RECORD=…] -I<cupti include> cupti_trace.c -L<cupti lib> -lcupti -o libcupti_trace.so
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef KERNEL_RECORD
#error "define KERNEL_RECORD as the newest CUpti_ActivityKernelN your cupti_activity.h declares"
#endif

#define BUFFER_BYTES (8u << 20)

static FILE *out;

static void fail(const char *what, CUptiResult r) {
    const char *msg = "?";
    cuptiGetResultString(r, &msg);
    fprintf(stderr, "cupti_trace: %s failed: %s\n", what, msg);
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    // Records are 8-byte aligned inside the buffer; aligned_alloc gives more.
    *buffer = aligned_alloc(64, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *record = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
#ifdef MEMCPY_RECORD
        if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const MEMCPY_RECORD *m = (const MEMCPY_RECORD *)record;
            const char *what = m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "memcpy_HtoD"
                               : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "memcpy_DtoH"
                               : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOD ? "memcpy_DtoD"
                                                                                : NULL;
            if (what)
                fprintf(out, "%llu,%llu,%u,0,%llu,0,0,%s\n", (unsigned long long)m->start, (unsigned long long)m->end,
                        m->streamId, (unsigned long long)m->bytes, what);
            else
                fprintf(out, "%llu,%llu,%u,0,%llu,0,0,memcpy_k%u\n", (unsigned long long)m->start,
                        (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes, (unsigned)m->copyKind);
            continue;
        }
#endif
#ifdef MEMSET_RECORD
        if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const MEMSET_RECORD *m = (const MEMSET_RECORD *)record;
            fprintf(out, "%llu,%llu,%u,0,%llu,0,0,memset\n", (unsigned long long)m->start, (unsigned long long)m->end,
                    m->streamId, (unsigned long long)m->bytes);
            continue;
        }
#endif
        if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL)
            continue;
        const KERNEL_RECORD *k = (const KERNEL_RECORD *)record;
        fprintf(out, "%llu,%llu,%u,%u,%d,%d,%d,%s\n", (unsigned long long)k->start, (unsigned long long)k->end,
                k->streamId, k->graphId, k->gridX, k->gridY, k->blockX, k->name ? k->name : "?");
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
        fprintf(stderr, "cupti_trace: %zu records dropped\n", dropped);
    free(buffer);
}

static void flush_all(void) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (out) fflush(out);
}

// Contexts torn down before exit take their pending records with them: flush first.
static void CUPTIAPI on_resource(void *user, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void *data) {
    (void)user;
    (void)data;
    if (domain == CUPTI_CB_DOMAIN_RESOURCE && id == CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING) flush_all();
}

int InitializeInjection(void) {
    const char *path = getenv("SLUICE_TIMELINE");
    out = fopen(path && *path ? path : "timeline.csv", "w");
    if (!out) {
        perror("cupti_trace: open the timeline file");
        return 0;
    }
    fprintf(out, "start_ns,end_ns,stream,graph,grid_x,grid_y,block_x,name\n");
    CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    if (r != CUPTI_SUCCESS) {
        fail("cuptiActivityRegisterCallbacks", r);
        return 0;
    }
    r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    if (r != CUPTI_SUCCESS) {
        fail("cuptiActivityEnable(CONCURRENT_KERNEL)", r);
        return 0;
    }
#ifdef MEMCPY_RECORD
    if ((r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY)) != CUPTI_SUCCESS) fail("cuptiActivityEnable(MEMCPY)", r);
#endif
#ifdef MEMSET_RECORD
    if ((r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET)) != CUPTI_SUCCESS) fail("cuptiActivityEnable(MEMSET)", r);
#endif
    CUpti_SubscriberHandle sub;
    if (cuptiSubscribe(&sub, (CUpti_CallbackFunc)on_resource, NULL) == CUPTI_SUCCESS)
        cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING);
    atexit(flush_all);
    return 1;
}
