// The KV compressors. `compress_stream` pools every entry this batch completes (the
// per-channel softmax(score)-weighted sum over the entry's window or windows), applies
// the weighted RMSNorm and the RoPE at position ratio·i, and writes the entry into its
// page. Tokens of this batch are read straight from the projections (score + position
// bias added on the fly); older tokens from the sequence's compressor ring. Each
// sequence's ring then takes its last `slots` tokens: written by the same launch when no
// entry of the batch reads a ring, else by `compress_store` afterwards.

// Ints per entry in the entry list (devplan.rs): i, row of token 0 (first_row - start),
// start, ring slot, page, unused ×3 (a multiple of four, so the first four are one int4).
#define ENTRY_META 8

#define LOG2E 1.4426950408889634f

// Page entries: `dtype`, `tail` BF16 dims (fp8), `stride` storage elements apart.
struct CompressGeom {
    int ratio, slots, width, dim, overlap;
    int comp_elems, comp_off;
    int dtype, tail, stride, page_elems, page_off, per_page;
    float eps;
};

// ---- The streaming compressor -------------------------------------------------------
// Work item = one chunk of one entry's sources (CSA: the entry's 2·ratio sources in one
// chunk; HCA: 128 sources in chunks of 16). Each block walks a contiguous range of items
// (neighbouring entries share rows and DRAM pages) and every thread streams its NC
// channels of each source into shared memory with cp.async, DEPTH - 1 groups of GROUP
// sources ahead of the group it folds: the loads in flight are held by shared memory,
// not registers, so they keep flowing while the thread folds, takes an entry's norm or
// waits on a merge. A thread reads back only what it copied, so the pipeline needs no
// barrier. Where each source lives is worked out once per block into shared memory, so
// the loop is copies, shared-memory reads and the softmax arithmetic.

// Items one block takes at most, and sources one item pools at most (the host picks
// the chunks so an item has ≤ CS_MAX_SRC).
#define CS_MAX_ITEMS 16
#define CS_MAX_SRC 16

// 2^x in one instruction (flushes results below 2^-126 to zero: a softmax weight that
// small next to the largest one, which is 1, changes no sum).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One item of the stream: its entry's number in this batch's list, index i and page,
// and how many sources it pools.
struct CompItem {
    int e, i, page, n;
};

// Where source u of an entry (meta m: i, row of token 0, start, slot) is: its kv and
// score rows (channel 0 of its half) and its position bias row, or -1 for a ring source
// (bias already added). Source u < prev is token ratio·(i-1) + u (first half of the
// channels), else token ratio·i + u - prev; its phase in the window is the offset.
__device__ __forceinline__ void comp_locate(int4 m, int u, const CompressGeom& g, const float* proj_kv,
                                            const float* proj_score, const float* comp, const float*& kv,
                                            const float*& sc, int& ape) {
    const int i = m.x, row0 = m.y, start = m.z, slot = m.w;
    const int prev = (g.overlap && i > 0) ? g.ratio : 0;
    const bool early = u < prev;
    const int phase = early ? u : u - prev;
    const int win = early ? i - 1 : i;
    const int t = g.ratio * win + phase;
    const int half = early || !g.overlap ? 0 : g.dim;
    if (t >= start) {
        const long long at = (long long)(row0 + t) * g.width + half;
        kv = proj_kv + at;
        sc = proj_score + at;
        ape = phase * g.width + half;
    } else {
        // Ring row t % slots without a division: windows are ratio-aligned and the ring
        // holds one window (HCA) or two (CSA).
        const int ring_row = (g.slots > g.ratio ? (win & 1) * g.ratio : 0) + phase;
        kv = comp + (long long)slot * g.comp_elems + g.comp_off + ring_row * g.width + half;
        sc = kv + g.slots * g.width;
        ape = -1;
    }
}

// How a vector load goes: plain (shared memory, or global data this kernel does not
// revisit), through the read-only cache (`__ldg`: weights, position biases), or L2 only
// (`__ldcg`: partials another block just wrote).
enum LoadVia { VIA_PLAIN, VIA_RO, VIA_L2 };

template <LoadVia VIA, typename V>
__device__ __forceinline__ V ld_via(const V* p) {
    return VIA == VIA_RO ? __ldg(p) : VIA == VIA_L2 ? __ldcg(p) : *p;
}

// NC consecutive floats (8 or 16 bytes, aligned) into v.
template <int NC, LoadVia VIA = VIA_PLAIN>
__device__ __forceinline__ void ld_vec(const float* p, float* v) {
    if (NC == 4) {
        const float4 x = ld_via<VIA>((const float4*)p);
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    } else {
        const float2 x = ld_via<VIA>((const float2*)p);
        v[0] = x.x, v[1] = x.y;
    }
}
template <int NC>
__device__ __forceinline__ void st_vec(float* p, const float* v) {
    if (NC == 4) *(float4*)p = make_float4(v[0], v[1], v[2], v[3]);
    else *(float2*)p = make_float2(v[0], v[1]);
}

// Running softmax of NC channels over raw (natural-log) scores: max m, and the sums of
// weights s and of weighted values n, both scaled by 2^(-m·log2 e).
template <int NC>
struct Pool {
    float m[NC], s[NC], n[NC];
    __device__ __forceinline__ void reset() {
#pragma unroll
        for (int j = 0; j < NC; j++) m[j] = NEG_INF, s[j] = 0.0f, n[j] = 0.0f;
    }
    // Folds `cnt` sources (all G when FULL): the batch's max first, then one ex2 a source
    // and channel (the scale to base 2 and the max subtracted in one FMA).
    template <int G, bool FULL>
    __device__ __forceinline__ void fold(const float (*sc)[NC], const float (*kv)[NC], int cnt) {
#pragma unroll
        for (int j = 0; j < NC; j++) {
            float m1 = m[j];
#pragma unroll
            for (int q = 0; q < G; q++)
                if (FULL || q < cnt) m1 = fmaxf(m1, sc[q][j]);
            const float ml = m1 * LOG2E;
            // Before the first source m is -inf and the rescale is ex2(-inf) = 0.
            const float a = ex2(fmaf(m[j], LOG2E, -ml));
            float ss = s[j] * a, nn = n[j] * a;
#pragma unroll
            for (int q = 0; q < G; q++) {
                if (FULL || q < cnt) {
                    const float e = ex2(fmaf(sc[q][j], LOG2E, -ml));
                    ss += e;
                    nn = fmaf(e, kv[q][j], nn);
                }
            }
            m[j] = m1, s[j] = ss, n[j] = nn;
        }
    }
};

// log2 in one instruction (a chunk's sum of weights is at least 1: its largest source's).
__device__ __forceinline__ float lg2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Adds 1 to a ticket at GPU scope with release and acquire semantics: what this block
// wrote before (its barrier orders every thread's writes before this one's) is visible
// to the block that draws the last ticket, and that block sees every earlier block's.
// One instruction in place of a fence and an atomic.
__device__ __forceinline__ u32 ticket_acq_rel(u32* t) {
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(t) : "memory");
    return old;
}

// A chunk's end: leaves its running softmax in `partial` [entries, chunks, 2, dim] as
// the weighted mean and the base-2 log-sum-exp of each channel (two numbers, not three,
// so the merge loads less) and takes a ticket; the entry's last block to arrive (the
// ticket, reset by that block) merges every chunk's partial in chunk order, so the
// result does not depend on which block came last, and returns true: it finishes the
// entry.
template <int NC>
__device__ bool comp_merge_chunks(Pool<NC>& p, bool live, int c, int e, int chunk, int chunks, float* partial,
                                  u32* tickets, const CompressGeom& g) {
    __shared__ bool last;
    float* mine = partial + ((long long)e * chunks + chunk) * 2 * g.dim;
    if (live) {
        float v[NC], l[NC];
#pragma unroll
        for (int j = 0; j < NC; j++) v[j] = p.n[j] / p.s[j], l[j] = fmaf(p.m[j], LOG2E, lg2(p.s[j]));
        st_vec<NC>(mine + c, v);
        st_vec<NC>(mine + g.dim + c, l);
    }
    __syncthreads();
    if (threadIdx.x == 0) last = ticket_acq_rel(&tickets[e]) == (u32)chunks - 1;
    __syncthreads();
    if (!last) return false;
    if (live) {
        // MB chunks' partials in flight at a time (HCA's eight in two rounds), merged in
        // chunk order into a running (max, sum of weights, weighted sum), base 2.
        const float* o = partial + (long long)e * chunks * 2 * g.dim + c;
        float m[NC], ss[NC], nn[NC];
#pragma unroll
        for (int j = 0; j < NC; j++) m[j] = NEG_INF, ss[j] = 0.0f, nn[j] = 0.0f;
        constexpr int MB = 8 / NC;
        for (int t0 = 0; t0 < chunks; t0 += MB) {
            float v[MB][NC], l[MB][NC];
#pragma unroll
            for (int q = 0; q < MB; q++) {
                if (t0 + q < chunks) {
                    const float* ot = o + (long long)(t0 + q) * 2 * g.dim;
                    ld_vec<NC, VIA_L2>(ot, v[q]);
                    ld_vec<NC, VIA_L2>(ot + g.dim, l[q]);
                }
            }
#pragma unroll
            for (int q = 0; q < MB; q++) {
                if (t0 + q < chunks) {
#pragma unroll
                    for (int j = 0; j < NC; j++) {
                        const float m1 = fmaxf(m[j], l[q][j]);
                        const float a = ex2(m[j] - m1), w = ex2(l[q][j] - m1);
                        ss[j] = fmaf(ss[j], a, w);
                        nn[j] = fmaf(nn[j], a, w * v[q][j]);
                        m[j] = m1;
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < NC; j++) p.s[j] = ss[j], p.n[j] = nn[j];
    }
    if (threadIdx.x == 0) tickets[e] = 0;
    return true;
}

// Weighted RMSNorm over the entry, RoPE of the last 2·pairs channels at position ratio·i
// (pairs start at even channels, so a thread's NC channels hold whole pairs), and the
// page write of channels c..c+NC-1.
// Sum over the block with one barrier: warps' sums go to one of two buffers (`parity`
// alternating per call; the barrier of call k+1 keeps call k+2 from overwriting what a
// slow thread still reads of call k) and every thread adds them up in the same order.
__device__ __forceinline__ float block_sum_1bar(float v, int parity) {
    __shared__ float part[2][32];
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) part[parity][threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += part[parity][w];
    return s;
}

// A thread's NC channels c.. of an fp8 entry record `e` (see entry_store_warp in
// common.cuh for the format). Thread t holds channels NC·t.., so the 64/NC lanes of one
// scale block are neighbours inside one warp; their maximum is a butterfly over them.
template <int NC>
__device__ __forceinline__ void comp_store_fp8(u8* e, const float* v, bool live, int c, const CompressGeom& g) {
    const int n8 = g.dim - g.tail;
    const bool coded = live && c < n8;
    float a = 0.0f;
#pragma unroll
    for (int j = 0; j < NC; j++) a = coded ? fmaxf(a, fabsf(v[j])) : a;
#pragma unroll
    for (int o = FP8_BLOCK / NC / 2; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    if (!live) return;
    if (coded) {
        const u32 sb = fp8_scale_byte(a);
        const float scale = ue8m0_scale(sb);
#pragma unroll
        for (int j = 0; j < NC; j++) e[c + j] = (u8)f2fp8(__fdiv_rn(v[j], scale));
        if (c % FP8_BLOCK == 0) e[n8 + 2 * g.tail + c / FP8_BLOCK] = (u8)sb;
    } else {
#pragma unroll
        for (int j = 0; j < NC; j++) ((u16*)(e + n8))[c - n8 + j] = f2bf(v[j]);
    }
    if (c == 0)
        for (int p = n8 + 2 * g.tail + (n8 + FP8_BLOCK - 1) / FP8_BLOCK; p < g.stride; p++) e[p] = 0;
}

template <int NC>
__device__ void comp_finish(float* v, bool live, int c, int i, u32 page, u8* page_base, const float* norm,
                            const CompressGeom& g, const RopeParams& rp, int parity) {
    // The norm weights are loaded before the barrier, so their latency hides behind it.
    float ss = 0.0f, w[NC];
    if (live) {
        ld_vec<NC, VIA_RO>(norm + c, w);
#pragma unroll
        for (int j = 0; j < NC; j++) ss = fmaf(v[j], v[j], ss);
    }
    ss = block_sum_1bar(ss, parity);
    if (live) {
        const float inv = 1.0f / sqrtf(ss / (float)g.dim + g.eps);
#pragma unroll
        for (int j = 0; j < NC; j++) v[j] = w[j] * (v[j] * inv);
        const int rope_from = g.dim - 2 * rp.pairs;
#pragma unroll
        for (int j = 0; j < NC; j += 2)
            if (c + j >= rope_from)
                rope_pair(&v[j], &v[j + 1], (float)(g.ratio * i), rp.inv_freq[(c + j - rope_from) / 2],
                          rp.attention_factor, false);
    }
    const long long entry = (long long)page * g.page_elems + g.page_off + (long long)(i % g.per_page) * g.stride;
    if (g.dtype == DTYPE_FP8) {
        // Every lane takes part in its 64-channel block's maximum, live or not.
        comp_store_fp8<NC>(page_base + entry, v, live, c, g);
        return;
    }
    if (!live) return;
    const long long at = entry + c;
    if (g.dtype == 0) {
        st_vec<NC>((float*)page_base + at, v);
    } else {
        u32 b[NC / 2];
#pragma unroll
        for (int j = 0; j < NC / 2; j++) b[j] = (u32)f2bf(v[2 * j]) | ((u32)f2bf(v[2 * j + 1]) << 16);
        if (NC == 4) *(uint2*)((u16*)page_base + at) = make_uint2(b[0], b[NC / 2 - 1]);
        else *(u32*)((u16*)page_base + at) = b[0];
    }
}

// Entry metadata of `item` and the range of its sources [u_lo, u_lo + cnt).
__device__ __forceinline__ int4 comp_item_range(const int* meta, int item, int chunks, const CompressGeom& g, int& u_lo,
                                                int& cnt) {
    const int e = item / chunks;
    const int4 m = __ldg((const int4*)(meta + (long long)ENTRY_META * e));
    const int n_src = ((g.overlap && m.x > 0) ? g.ratio : 0) + g.ratio, per = (n_src + chunks - 1) / chunks;
    u_lo = (item - e * chunks) * per;
    cnt = min(per, n_src - u_lo);
    return m;
}

// Rows of a sequence's ring one store item writes.
#define CS_STORE_ROWS 8

// One ring-store item (sequence, first ring row k0): ring rows k0 .. k0 + CS_STORE_ROWS
// of the sequence's last `slots` tokens (kv, and score with the position bias added), as
// compress_store does. Only launched where no entry of the batch reads a ring. Four
// float2 of each array are loaded before any is stored (the ring could alias the
// projections as far as the compiler knows, so it would not reorder them).
__device__ void comp_ring_store(const int* seqs, const int* item, const float* proj_kv, const float* proj_score,
                                const float* ape, float* comp, const CompressGeom& g) {
    const int* seq = seqs + item[0] * SEQ_STRIDE;
    const int rows = seq[SEQ_ROWS], first_row = seq[SEQ_FIRST_ROW], start = seq[SEQ_START];
    float* ring_kv = comp + (long long)seq[SEQ_SLOT] * g.comp_elems + g.comp_off;
    float* ring_sc = ring_kv + (long long)g.slots * g.width;
    const int k0 = item[1], half = g.width / 2, n = min(CS_STORE_ROWS, g.slots - k0) * half;
    for (int base = threadIdx.x; base < n; base += 4 * blockDim.x) {
        float2 kv[4], sc[4];
        int dst[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int idx = base + q * blockDim.x, k = k0 + idx / half, x = 2 * (idx % half);
            const int j = rows - g.slots + k, t = start + j;
            dst[q] = -1;
            if (idx < n && j >= 0) {
                const long long src = (long long)(first_row + j) * g.width + x;
                kv[q] = *(const float2*)(proj_kv + src);
                sc[q] = *(const float2*)(proj_score + src);
                const float2 b = __ldg((const float2*)(ape + (t % g.ratio) * g.width + x));
                sc[q].x += b.x;
                sc[q].y += b.y;
                dst[q] = (t % g.slots) * g.width + x;
            }
        }
#pragma unroll
        for (int q = 0; q < 4; q++) {
            if (dst[q] >= 0) {
                *(float2*)(ring_kv + dst[q]) = kv[q];
                *(float2*)(ring_sc + dst[q]) = sc[q];
            }
        }
    }
}

// grid: blocks of ≤ CS_MAX_ITEMS contiguous items of the `n_entries · chunks`;
// blockDim = dim/NC rounded up to a warp (thread t owns channels NC·t ..); dynamic
// shared memory DEPTH · GROUP · 2 · blockDim · NC floats.
template <int NC, int GROUP, int DEPTH>
__device__ __forceinline__ void compress_stream_body(const int* meta, int n_entries, int chunks, const int* seqs,
                                                     const int* stores, int n_stores, const float* proj_kv,
                                                     const float* proj_score, const float* ape, float* comp,
                                                     const float* norm, u8* page_base, float* partial, u32* tickets,
                                                     const CompressGeom& g, const RopeParams& rp) {
    extern __shared__ float cs_stage[];
    __shared__ CompItem items[CS_MAX_ITEMS];
    __shared__ const float* src_kv[CS_MAX_ITEMS][CS_MAX_SRC];
    __shared__ const float* src_sc[CS_MAX_ITEMS][CS_MAX_SRC];
    __shared__ int src_ape[CS_MAX_ITEMS][CS_MAX_SRC];
    __shared__ int groups[CS_MAX_ITEMS * CS_MAX_SRC / GROUP], n_groups;
    const int nt = blockDim.x, c = NC * threadIdx.x;
    const bool live = c < g.dim;
    // Items: the ring stores (if this launch does them), then the entries' chunks.
    const long long n_items = (long long)n_entries * chunks + n_stores;
    const int b_lo = (int)(n_items * blockIdx.x / gridDim.x), b_hi = (int)(n_items * (blockIdx.x + 1) / gridDim.x);
    const int lo = max(b_lo, n_stores) - n_stores, n = max(0, b_hi - n_stores - lo);
    // Thread's NC floats of (stage, source q, kv|score) at
    // cs_stage[(((stage·GROUP + q)·2 + a)·nt + t)·NC].
    const u32 my = smem_addr(cs_stage) + threadIdx.x * NC * 4;
    const u32 arr = nt * NC * 4;
    // Launched to overlap the previous kernel's tail (Gpu::launch_raw): the next
    // kernel may be placed as soon as every block here has started, and nothing below
    // touches memory an earlier kernel writes until the wait after the tables.
    pdl_launch_dependents();
    for (int k = threadIdx.x; k < n * CS_MAX_SRC; k += nt) {
        const int j = k / CS_MAX_SRC, q = k % CS_MAX_SRC, item = lo + j, e = item / chunks;
        int u_lo, cnt;
        const int4 m = comp_item_range(meta, item, chunks, g, u_lo, cnt);
        if (q == 0) {
            CompItem it;
            it.e = e;
            it.i = m.x;
            it.page = __ldg(meta + (long long)ENTRY_META * e + 4);
            it.n = cnt;
            items[j] = it;
        }
        // Slots past the item's end point at a valid row and are never folded.
        const float *kv = proj_kv, *sc = proj_score;
        int b = -1;
        if (q < cnt) comp_locate(m, u_lo + q, g, proj_kv, proj_score, comp, kv, sc, b);
        src_kv[j][q] = kv;
        src_sc[j][q] = sc;
        src_ape[j][q] = b;
    }
    // The block's groups in order: (item << 8) | (last group of its item << 7) | first
    // source. The first warp works out the items' source counts again and scans them
    // (n ≤ CS_MAX_ITEMS ≤ 32), so one barrier covers both tables.
    if (threadIdx.x < WARP) {
        const int lane = threadIdx.x;
        int u_lo, cnt = 0;
        if (lane < n) comp_item_range(meta, lo + lane, chunks, g, u_lo, cnt);
        const int ng = lane < n ? max(1, (cnt + GROUP - 1) / GROUP) : 0;
        int end = ng;
#pragma unroll
        for (int o = 1; o < WARP; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, end, o);
            if (lane >= o) end += v;
        }
        for (int k = 0; k < ng; k++) groups[end - ng + k] = (lane << 8) | ((k == ng - 1) << 7) | (k * GROUP);
        if (lane == WARP - 1) n_groups = end;
    }
    __syncthreads();
    const int ng = n_groups;

    // Every earlier kernel done and its writes visible (the projections, rings, pages).
    pdl_wait();
    auto produce = [&](int k, int stage) {
        if (k < ng && live) {
            const int gk = groups[k], j = gk >> 8, u0 = gk & 0x7f, cnt = items[j].n;
            const u32 d = my + stage * GROUP * 2 * arr;
#pragma unroll
            for (int q = 0; q < GROUP; q++) {
                if (u0 + q < cnt) {
                    cp_async<NC * 4>(d + q * 2 * arr, src_kv[j][u0 + q] + c);
                    cp_async<NC * 4>(d + (q * 2 + 1) * arr, src_sc[j][u0 + q] + c);
                }
            }
        }
        cp_async_commit();
    };

#pragma unroll
    for (int k = 0; k < DEPTH - 1; k++) produce(k, k);
    // Ring stores while the first copies are in flight.
    for (int k = b_lo; k < min(b_hi, n_stores); k++) comp_ring_store(seqs, stores + 2 * k, proj_kv, proj_score, ape, comp, g);
    Pool<NC> p;
    p.reset();
    int parity = 0;
    for (int k = 0, stage = 0; k < ng; k++, stage = stage + 1 == DEPTH ? 0 : stage + 1) {
        produce(k + DEPTH - 1, stage == 0 ? DEPTH - 1 : stage - 1);
        cp_async_wait<DEPTH - 1>();
        const int gk = groups[k], j = gk >> 8, u0 = gk & 0x7f, cnt = items[j].n - u0;
        if (live) {
            // All GROUP slots are read (past the item's end they hold stale values the
            // fold leaves out, and bias -1), so the bias loads go out together.
            float sc[GROUP][NC], kv[GROUP][NC], b[GROUP][NC];
            int b_at[GROUP];
#pragma unroll
            for (int q = 0; q < GROUP; q++) {
                b_at[q] = src_ape[j][u0 + q];
                ld_vec<NC, VIA_RO>(ape + (u32)(max(b_at[q], 0) + c), b[q]);
            }
            const float* st = cs_stage + ((stage * GROUP * 2) * nt + threadIdx.x) * NC;
#pragma unroll
            for (int q = 0; q < GROUP; q++) {
                ld_vec<NC>(st + (q * 2) * nt * NC, kv[q]);
                ld_vec<NC>(st + (q * 2 + 1) * nt * NC, sc[q]);
                if (b_at[q] >= 0)
#pragma unroll
                    for (int x = 0; x < NC; x++) sc[q][x] += b[q][x];
            }
            if (cnt >= GROUP) p.template fold<GROUP, true>(sc, kv, GROUP);
            else p.template fold<GROUP, false>(sc, kv, cnt);
        }
        if (!(gk & 0x80)) continue;
        // The item's last group: finish the entry (or hand the chunk to its merge).
        const CompItem it = items[j];
        if (chunks == 1 || comp_merge_chunks<NC>(p, live, c, it.e, lo + j - it.e * chunks, chunks, partial, tickets, g)) {
            float v[NC];
#pragma unroll
            for (int x = 0; x < NC; x++) v[x] = p.n[x] / p.s[x];
            comp_finish<NC>(v, live, c, it.i, (u32)it.page, page_base, norm, g, rp, parity);
            parity ^= 1;
        }
        p.reset();
    }
    cp_async_wait<0>();
}

#define COMPRESS_STREAM(NAME, NC, G, D, THREADS, BLOCKS)                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS)                                         \
        NAME(const int* meta, int n_entries, int chunks, const int* seqs, const int* stores, int n_stores, \
             const float* proj_kv, const float* proj_score, const float* ape, float* comp, const float* norm, \
             u8* page_base, float* partial, u32* tickets, CompressGeom g, RopeParams rp) {                 \
        compress_stream_body<NC, G, D>(meta, n_entries, chunks, seqs, stores, n_stores, proj_kv, proj_score, \
                                       ape, comp, norm, page_base, partial, tickets, g, rp);               \
    }
// Two channels a thread, groups of four sources, three groups in shared memory (48 KiB
// for 256 threads), at most 64 registers: four blocks an SM. Measured against four
// channels a thread (128-thread blocks, 16-byte copies), two blocks an SM with six
// groups in flight, and five 32-KiB blocks: each slower (docs/perf.md).
COMPRESS_STREAM(compress_stream, 2, 4, 3, 256, 4)

// Ring update: each sequence's last `slots` tokens of this batch go to slot t % slots
// (kv, and score with the position bias added). grid (ceil(slots·width / 256), seqs):
// only the rows that land in the ring are visited.
extern "C" __global__ void compress_store(const int* seqs, const float* proj_kv, const float* proj_score,
                                          const float* ape, float* comp, CompressGeom g) {
    pdl_begin();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)g.slots * g.width) return;
    const int k = (int)(idx / g.width), c = (int)(idx % g.width);
    const int* seq = seqs + blockIdx.y * SEQ_STRIDE;
    const int j = seq[SEQ_ROWS] - g.slots + k;
    if (j < 0) return;
    const long long src = (long long)(seq[SEQ_FIRST_ROW] + j) * g.width + c;
    const int t = seq[SEQ_START] + j;
    float* ring_kv = comp + (long long)seq[SEQ_SLOT] * g.comp_elems + g.comp_off;
    float* ring_sc = ring_kv + (long long)g.slots * g.width;
    const int s = t % g.slots;
    ring_kv[s * g.width + c] = proj_kv[src];
    ring_sc[s * g.width + c] = proj_score[src] + ape[(t % g.ratio) * g.width + c];
}
