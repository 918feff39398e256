// Mixture-of-experts routing and combination. Expert products run through the
// gemv/cuBLAS paths on the rows each expert received.

struct F512 {
    float v[512];
};

__device__ __forceinline__ float softplus_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// A float's order as an unsigned key: larger key, later in the CPU's `f32::total_cmp`
// order (-0 below +0, NaNs at the ends by sign). Every float but one NaN (all ones) maps
// above 0, so 0 can mark an expert that is taken or absent.
__device__ __forceinline__ u32 route_order_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u32 warp_max_u32(u32 v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_max_sync(0xffffffffu, v);
#else
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#endif
}

// The minimum as the complement of the complements' maximum (exact for unsigned).
__device__ __forceinline__ u32 warp_min_u32(u32 v) { return ~warp_max_u32(~v); }

// The k largest of `key[0..n_exp]` (n_exp <= 512) in descending order into chosen[0..k],
// ties to the lower expert id (as the CPU sorts), by one warp: lane l holds experts l,
// l + 32, ... in registers (ascending, so its first maximum is its lowest id); a round
// is the lanes' maxima reduced across the warp, then the lowest id holding that value,
// and its lane drops it. No block barrier a round: the block-wide version (k rounds of
// two __syncthreads and a serial pass over the warps' bests) was 4.7 of the kernel's
// ~14 µs at batch 1 on the H200.
__device__ __forceinline__ void route_topk_warp(const float* key, int n_exp, int k, int* chosen) {
    const int lane = threadIdx.x & 31;
    u32 kv[16];
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const int e = j * 32 + lane;
        kv[j] = e < n_exp ? route_order_key(key[e]) : 0u;
    }
    for (int round = 0; round < k; round++) {
        u32 best = 0u;
        int at = 0;
#pragma unroll
        for (int j = 0; j < 16; j++)
            if (kv[j] > best) {
                best = kv[j];
                at = j;
            }
        const u32 top = warp_max_u32(best);
        const u32 id = warp_min_u32(best == top && top != 0u ? (u32)(at * 32 + lane) : 0xffffffffu);
        // No expert left (k > n_exp, which the config forbids): n_exp, as the block scan gave.
        if (lane == 0) chosen[round] = top == 0u ? n_exp : (int)id;
        if (top != 0u && (int)(id & 31u) == lane) {
#pragma unroll
            for (int j = 0; j < 16; j++)
                if (j == (int)(id >> 5)) kv[j] = 0u;
        }
    }
}

// One block per row (256 threads; n_exp <= 512): scores sqrt(softplus(logit)) once per
// expert in shared memory; experts by the hash table rows (`hash_rows[r*k..]`, gathered
// by token on the host) or by k rounds of an argmax of score + bias in one warp
// (`route_topk_warp`); weights = normalised chosen scores times `route_scale`, summed
// in choice order. Returns the block's shared copy of the row's choices.
__device__ const int* moe_route_row(const float* logits, int n_exp, int k, const u32* hash_rows, const F512& bias,
                              float route_scale, int* experts, float* weights) {
    __shared__ float score[512];
    __shared__ float key[512];
    __shared__ int chosen[16];
    const int r = blockIdx.x, tid = threadIdx.x, warp = tid >> 5;
    const float* l = logits + (long long)r * n_exp;
    for (int e = tid; e < n_exp; e += blockDim.x) {
        score[e] = sqrtf(softplus_(l[e]));
        key[e] = score[e] + bias.v[e];
    }
    __syncthreads();
    // The choice and the weights stay in the first warp (k <= 16): no block barrier
    // between them, and lane j writes choice j's weight, where thread 0 wrote all k in
    // turn (each lane adds the chosen scores in choice order, the same sum). Under the
    // step's other kernels a batch-1 routing spent ~2 µs there on the H200.
    if (warp == 0) {
        if (hash_rows) {
            if (tid < k) chosen[tid] = (int)hash_rows[(long long)r * k + tid];
        } else {
            route_topk_warp(key, n_exp, k, chosen);
        }
        __syncwarp();
        if (tid < k) {
            float sum = 0.0f;
            for (int j = 0; j < k; j++) sum += score[chosen[j]];
            const int e = chosen[tid];
            experts[(long long)r * k + tid] = e;
            weights[(long long)r * k + tid] = score[e] / (sum + 1e-20f) * route_scale;
        }
    }
    __syncthreads();
    return chosen;
}

extern "C" __global__ void __launch_bounds__(256) moe_route(const float* logits, int rows, int n_exp, int k,
                                                           const u32* hash_rows, F512 bias, float route_scale,
                                                           int* experts, float* weights) {
    pdl_begin();
    moe_route_row(logits, n_exp, k, hash_rows, bias, route_scale, experts, weights);
}

// out[rows_of[i], :] += weights[widx[i]] · y[i, :] for i in order (one thread per column,
// so a row listed twice is still summed in order).
extern "C" __global__ void moe_accumulate(float* out, const float* y, const int* rows_of, const int* widx,
                                          const float* weights, int n, int d) {
    pdl_begin();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    for (int i = 0; i < n; i++) out[(long long)rows_of[i] * d + c] += weights[widx[i]] * y[(long long)i * d + c];
}

// The same when no row appears twice in the list: one thread per (listed row, column).
extern "C" __global__ void moe_accumulate_rows(float* out, const float* y, const int* rows_of, const int* widx,
                                               const float* weights, int n, int d) {
    pdl_begin();
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)n * d) return;
    const int i = (int)(t / d), c = (int)(t % d);
    out[(long long)rows_of[i] * d + c] += weights[widx[i]] * y[t];
}

// out += y (elementwise).
extern "C" __global__ void add_into(float* out, const float* y, long long n) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] += y[i];
}

// g = silu(min(g, limit)) * clamp(u, -limit, limit), in place in g.
extern "C" __global__ void swiglu_act(float* g, const float* u, long long n, float limit) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float a = fminf(g[i], limit);
    float b = fminf(fmaxf(u[i], -limit), limit);
    g[i] = a / (1.0f + expf(-a)) * b;
}

// swiglu_act's SwiGLU rounded to bf16 as it is written (the down product of BF16 experts
// on cuBLAS reads bf16 rows): the same value the f32 pass and a rounding after it give.
extern "C" __global__ void swiglu_bf16(u16* out, const float* g, const float* u, long long n, float limit) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float a = fminf(g[i], limit);
    float b = fminf(fmaxf(u[i], -limit), limit);
    out[i] = f2bf(a / (1.0f + expf(-a)) * b);
}

// Three exclusive prefix sums over the block at once (one value of each a thread), with
// the barriers of one (blockDim.x a multiple of 32, at most 1,024; every thread must
// call it): the lists' offsets, active ranks and segment starts, which three one-value
// scans took ~2 µs of a batch-1 routing on the H200. Totals to tot[3].
__device__ __forceinline__ int3 block_exclusive_scan3(int3 v, int* tot) {
    __shared__ int3 warp_sums3[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int3 inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int a = __shfl_up_sync(0xffffffffu, inc.x, o), b = __shfl_up_sync(0xffffffffu, inc.y, o),
                  c = __shfl_up_sync(0xffffffffu, inc.z, o);
        if (lane >= o) inc = make_int3(inc.x + a, inc.y + b, inc.z + c);
    }
    __syncthreads();
    if (lane == 31) warp_sums3[w] = inc;
    __syncthreads();
    if (w == 0) {
        const int3 t = lane < nw ? warp_sums3[lane] : make_int3(0, 0, 0);
        int3 ti = t;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, ti.x, o), b = __shfl_up_sync(0xffffffffu, ti.y, o),
                      c = __shfl_up_sync(0xffffffffu, ti.z, o);
            if (lane >= o) ti = make_int3(ti.x + a, ti.y + b, ti.z + c);
        }
        if (lane < nw) warp_sums3[lane] = make_int3(ti.x - t.x, ti.y - t.y, ti.z - t.z);
        if (lane == 31) {
            tot[0] = ti.x;
            tot[1] = ti.y;
            tot[2] = ti.z;
        }
    }
    __syncthreads();
    const int3 base = warp_sums3[w];
    return make_int3(base.x + inc.x - v.x, base.y + inc.y - v.y, base.z + inc.z - v.z);
}

// The device-side routing lists of a decode batch (one block): per expert the number of
// (row, slot) pairs routed to it and where its run starts, and the pairs in expert
// order, row order within an expert (the order the host-routed path uses); the experts
// that received rows, in order (`active`, `*n_active` of them), so grouped launches
// index only those. Adds the bytes of the experts that received rows to `traffic`
// (what the step must stream).
//
// With `segs` (not null), each expert's run is also cut into segments of at most
// `seg_rows` consecutive list positions, in list order: segs[s] = the first position,
// segs[max_segs + s] = how many, segs[2·max_segs + s] = the expert; their number at
// segs[3·max_segs] (the kernels of decode2_segments.cu take a unit a segment). With
// `pos` (not null), row r's list positions ascending at pos[r·k ..], -1 after its last
// (what moe_positions computes, for the combine).
//
// One block of MOE_LIST_THREADS threads, two experts a thread (n_exp ≤ 2 · threads):
// counts by shared-memory atomics, offsets and the active list by block-wide prefix sums,
// and the lists filled by one warp walking the pairs 32 at a time in order (a pair's
// place: its expert's running count plus its rank among the lanes naming the same
// expert). Each thread scanning all pairs for its experts was 33 µs at 64 rows.
#define MOE_LIST_THREADS 256
// What moe_lists writes and how (a #[repr(C)] struct on the host, `ListsOut` in moe.rs;
// pointers first, no padding).
struct MoeListsOut {
    int* counts;
    int* offsets;
    int* list_rows;
    int* list_widx;
    int* active;
    int* n_active;
    unsigned long long* traffic;
    int* segs;
    int* pos;
    unsigned long long expert_bytes;
    int seg_rows;
    int max_segs;
};

// `chosen_here` (not null): the routing is also in this block's shared memory (one
// block routed the only row), read from there instead of back from global memory.
__device__ void moe_lists_body(const int* experts, const int* chosen_here, int rows, int k, int n_exp,
                               const MoeListsOut& o) {
    int *counts = o.counts, *offsets = o.offsets, *list_rows = o.list_rows, *list_widx = o.list_widx;
    int *active = o.active, *n_active = o.n_active, *segs = o.segs, *pos = o.pos;
    unsigned long long* traffic = o.traffic;
    const unsigned long long expert_bytes = o.expert_bytes;
    const int seg_rows = o.seg_rows, max_segs = o.max_segs;
    // The routing, then each pair's list position (-1: not listed), in shared memory
    // (2n ints, dynamic).
    extern __shared__ int routed[];
    int* pair_pos = routed + rows * k;
    __shared__ int cnt[2 * MOE_LIST_THREADS], run[2 * MOE_LIST_THREADS];
    __shared__ int totals[3];  // pairs listed, experts used, segments
    const int n = rows * k;
    for (int e = threadIdx.x; e < 2 * MOE_LIST_THREADS; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        // (From L2: under moe_route_lists other blocks of this grid wrote them.)
        const int e = chosen_here ? chosen_here[i] : __ldcg(experts + i);
        routed[i] = e;
        pair_pos[i] = -1;
        if (e >= 0 && e < n_exp) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    const int e0 = 2 * threadIdx.x, e1 = e0 + 1;
    const int c0 = e0 < n_exp ? cnt[e0] : 0, c1 = e1 < n_exp ? cnt[e1] : 0;
    if (e0 < n_exp) counts[e0] = c0;
    if (e1 < n_exp) counts[e1] = c1;
    const int ns0 = segs ? (c0 + seg_rows - 1) / seg_rows : 0, ns1 = segs ? (c1 + seg_rows - 1) / seg_rows : 0;
    const int3 starts = block_exclusive_scan3(make_int3(c0 + c1, (c0 > 0) + (c1 > 0), ns0 + ns1), totals);
    const int at0 = starts.x, rank0 = starts.y;
    const int total = totals[0], used = totals[1];
    if (e0 < n_exp) {
        offsets[e0] = at0;
        run[e0] = at0;
        if (c0 > 0) active[rank0] = e0;
        if (e1 < n_exp) {
            offsets[e1] = at0 + c0;
            run[e1] = at0 + c0;
            if (c1 > 0) active[rank0 + (c0 > 0)] = e1;
        }
    }
    if (segs) {
        int s = starts.z;
        for (int e = e0, c = c0, at = at0; e <= e1 && e < n_exp; at += c, c = c1, e++)
            for (int first = 0; first < c; first += seg_rows, s++) {
                segs[s] = at + first;
                segs[max_segs + s] = min(seg_rows, c - first);
                segs[2 * max_segs + s] = e;
            }
        if (threadIdx.x == 0) segs[3 * max_segs] = totals[2];
    }
    if (threadIdx.x == 0) {
        *n_active = used;
        if (traffic) atomicAdd(traffic, (unsigned long long)used * expert_bytes);
    }
    __syncthreads();  // run[] complete
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        for (int c = 0; c < n; c += 32) {
            const int i = c + lane;
            const int e = i < n ? routed[i] : -1;
            const bool listed = e >= 0 && e < n_exp;
            const unsigned same = __match_any_sync(0xffffffffu, listed ? e : -1);
            const int rank = __popc(same & ((1u << lane) - 1u));
            int at = 0;
            if (listed) {
                at = run[e] + rank;
                list_rows[at] = i / k;
                list_widx[at] = i;
                pair_pos[i] = at;
            }
            __syncwarp();
            // The last lane naming the expert moves its running count past this chunk.
            if (listed && (same >> lane) == 1u) run[e] = at + 1;
            __syncwarp();
        }
    }
    // Under expert parallelism pairs routed to experts held elsewhere (id -1 after
    // moe_localize) are not listed: the list's tail is marked empty (-1), which
    // gather_rows turns into zero rows and the combines never match.
    for (int i = total + threadIdx.x; i < n; i += blockDim.x) {
        list_rows[i] = -1;
        list_widx[i] = -1;
    }
    if (!pos) return;
    __syncthreads();  // pair_pos complete
    // Row r's j-th position ascending: a listed pair's j counts the row's listed pairs
    // before it in the list; the unlisted ones fill the places after them with -1.
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int r0 = (i / k) * k, p = pair_pos[i];
        int j = 0;
        if (p >= 0) {
            for (int x = r0; x < r0 + k; x++) j += pair_pos[x] >= 0 && pair_pos[x] < p;
        } else {
            for (int x = r0; x < r0 + k; x++) j += pair_pos[x] >= 0 || x < i;
        }
        pos[r0 + j] = p;
    }
}

extern "C" __global__ void __launch_bounds__(MOE_LIST_THREADS)
    moe_lists(const int* experts, int rows, int k, int n_exp, MoeListsOut out) {
    pdl_begin();
    moe_lists_body(experts, nullptr, rows, k, n_exp, out);
}

// moe_route and then moe_lists in one launch (a decode batch's routing is a chain of
// one-block kernels, each launch ~3-4 µs of the step at batch 1): a block routes its row
// as moe_route does, and the last block to finish (a ticket the host keeps zeroed, which
// that block zeroes again) builds the lists from every row's choice as moe_lists does.
// n_exp is every expert (no slice of them: moe_localize would sit between the two).
extern "C" __global__ void __launch_bounds__(MOE_LIST_THREADS)
    moe_route_lists(const float* logits, int rows, int n_exp, int k, const u32* hash_rows, F512 bias,
                    float route_scale, int* experts, float* weights, u32* ticket, MoeListsOut out) {
    pdl_begin();
    __shared__ bool last;
    const int* chosen = moe_route_row(logits, n_exp, k, hash_rows, bias, route_scale, experts, weights);
    // The only block is the last: no ticket, no fences (~2.5 µs at batch 1), and the
    // lists read the choice from shared memory (moe_route_row's last barrier orders it).
    if (gridDim.x > 1) {
        __threadfence();  // this row's choice (the first k lanes wrote it) before the ticket
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        if (threadIdx.x == 0) *ticket = 0u;
    }
    moe_lists_body(experts, gridDim.x == 1 ? chosen : nullptr, rows, k, n_exp, out);
}

// Expert ids as this device's experts number them: `base..base + held` become
// `0..held`, experts held on other devices -1 (expert parallelism: their rows get
// nothing from here).
extern "C" __global__ void moe_localize(int* local, const int* chosen, int n, int base, int held) {
    pdl_begin();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int e = chosen[i] - base;
    local[i] = (e >= 0 && e < held) ? e : -1;
}

// The shared expert's output for batch row r, column c, when `shared` holds rows
// first .. first + count (else 0): added to the routed sum as the combine writes it, the
// add an add_into launch after it did.
__device__ __forceinline__ float moe_shared_term(const float* shared, int first, int count, int r, int c, int d) {
    return shared && r >= first && r < first + count ? shared[(long long)(r - first) * d + c] : 0.0f;
}

// out[r, c] = Σ over the list in order of weights[widx[i]] · y[i, c] for the pairs of
// row r: the same sums, in the same order, as the host-routed path's per-expert adds;
// then the shared expert's term (moe_shared_term).
extern "C" __global__ void moe_combine(float* out, const float* y, const int* list_rows, const int* list_widx,
                                       const float* weights, int n, int rows, int d, const float* shared,
                                       int shared_first, int shared_rows) {
    pdl_begin();
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)rows * d) return;
    const int r = (int)(t / d), c = (int)(t % d);
    float acc = 0.0f;
    for (int i = 0; i < n; i++)
        if (list_rows[i] == r) acc += weights[list_widx[i]] * y[(long long)i * d + c];
    if (shared) acc += moe_shared_term(shared, shared_first, shared_rows, r, c, d);
    out[t] = acc;
}

// The same sums for batches of any size: row r's k list positions `pos[r*k .. r*k+k]`
// (ascending, i.e. in expert order) are summed in that order, so each output costs k
// reads instead of a scan of the whole list. A negative position ends a row's list (its
// other experts live on another device under expert parallelism).
extern "C" __global__ void moe_combine_rows(float* out, const float* y, const int* pos, const int* list_widx,
                                            const float* weights, int k, int rows, int d, const float* shared,
                                            int shared_first, int shared_rows) {
    pdl_begin();
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)rows * d) return;
    const int r = (int)(t / d), c = (int)(t % d);
    float acc = 0.0f;
    for (int j = 0; j < k; j++) {
        const int i = pos[r * k + j];
        if (i < 0) break;
        acc += weights[list_widx[i]] * y[(long long)i * d + c];
    }
    if (shared) acc += moe_shared_term(shared, shared_first, shared_rows, r, c, d);
    out[t] = acc;
}

// moe_combine_rows four columns a thread (d a multiple of 4, 16-byte aligned rows): a
// block's threads share a row (grid (rows, ceil(d / 4 / blockDim))), so no 64-bit
// division a value, the row's positions and weights read once for four columns, and
// 16-byte loads and stores. The same sums in the same order as moe_combine_rows (an 8K
// prefill's call ran at ~40% of the copy bandwidth there, a thread a value).
extern "C" __global__ void moe_combine_rows4(float* out, const float* y, const int* pos, const int* list_widx,
                                             const float* weights, int k, int rows, int d, const float* shared,
                                             int shared_first, int shared_rows) {
    pdl_begin();
    const int r = blockIdx.x, c4 = blockIdx.y * blockDim.x + threadIdx.x;
    if (r >= rows || 4 * c4 >= d) return;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int j = 0; j < k; j++) {
        const int i = pos[r * k + j];
        if (i < 0) break;
        const float wt = weights[list_widx[i]];
        const float4 v = reinterpret_cast<const float4*>(y + (long long)i * d)[c4];
        acc.x += wt * v.x;
        acc.y += wt * v.y;
        acc.z += wt * v.z;
        acc.w += wt * v.w;
    }
    if (shared) {
        // moe_shared_term's: the row's value, or 0 added outside the shared expert's rows.
        const bool in = r >= shared_first && r < shared_first + shared_rows;
        const float4 s = in ? reinterpret_cast<const float4*>(shared + (long long)(r - shared_first) * d)[c4]
                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        acc.x += s.x;
        acc.y += s.y;
        acc.z += s.z;
        acc.w += s.w;
    }
    reinterpret_cast<float4*>(out + (long long)r * d)[c4] = acc;
}

// pos[r*k + j] = the j-th list position (ascending) whose row is r: one thread a row,
// scanning the list from shared memory in chunks of MOE_POS_CHUNK the block loads
// together (each thread reading the list itself, one load after another, was ~37 µs for
// a 64-row batch).
#define MOE_POS_CHUNK 4096
extern "C" __global__ void moe_positions(int* pos, const int* list_rows, int n, int rows, int k) {
    pdl_begin();
    __shared__ int chunk[MOE_POS_CHUNK];
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    int j = 0;
    for (int c0 = 0; c0 < n; c0 += MOE_POS_CHUNK) {
        const int len = min(MOE_POS_CHUNK, n - c0);
        __syncthreads();
        for (int i = threadIdx.x; i < len; i += blockDim.x) chunk[i] = list_rows[c0 + i];
        __syncthreads();
        if (r < rows)
            for (int i = 0; i < len && j < k; i++)
                if (chunk[i] == r) pos[r * k + j++] = c0 + i;
    }
    if (r >= rows) return;
    // Fewer than k when some of the row's experts live on another device.
    for (; j < k; j++) pos[r * k + j] = -1;
}
