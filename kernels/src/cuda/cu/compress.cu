// The KV compressors. `compress_entries` pools every entry this batch completes (the
// per-channel softmax(score)-weighted sum over the entry's window or windows), applies
// the weighted RMSNorm and the RoPE at position ratio·i, and writes the entry into its
// page. Tokens of this batch are read straight from the projections (score + position
// bias added on the fly); older tokens from the sequence's compressor ring, which
// `compress_store` updates afterwards with the last `slots` tokens of each sequence.

struct CompressGeom {
    int ratio, slots, width, dim, overlap;
    int comp_elems, comp_off;
    int dtype, page_elems, page_off, per_page;
    float eps;
};

__device__ __forceinline__ float f2_get(const float2& v, int j) { return j == 0 ? v.x : v.y; }
__device__ __forceinline__ void f2_set(float2& v, int j, float x) {
    if (j == 0) v.x = x;
    else v.y = x;
}

// One thread's running softmax over its two channels, in base 2 (scores times log2 e,
// so each weight is one exp2f: the accurate expf costs several instructions more per
// source and channel, and at eight sources a thread that was most of the kernel's
// time): max, sum of weights, weighted sum.
#define LOG2E 1.4426950408889634f
struct Pool2 {
    float2 m, s, n;
};

// Folds `cnt` loaded sources (scores already in base 2) into the running softmax: the
// batch's max first, then one exp2f per source.
__device__ __forceinline__ void pool_fold(Pool2& p, const float2* sc, const float2* kv, int cnt) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
        float bm = NEG_INF;
#pragma unroll
        for (int q = 0; q < 8; q++)
            if (q < cnt) bm = fmaxf(bm, f2_get(sc[q], j));
        const float m0 = f2_get(p.m, j), m1 = fmaxf(m0, bm);
        if (m1 == NEG_INF) continue;
        const float a = m0 == NEG_INF ? 0.0f : exp2f(m0 - m1);
        float s = f2_get(p.s, j) * a, n = f2_get(p.n, j) * a;
#pragma unroll
        for (int q = 0; q < 8; q++) {
            if (q < cnt) {
                const float e = exp2f(f2_get(sc[q], j) - m1);
                s += e;
                n += e * f2_get(kv[q], j);
            }
        }
        f2_set(p.m, j, m1);
        f2_set(p.s, j, s);
        f2_set(p.n, j, n);
    }
}

// Merges another running softmax into `p` (the other's sources come after p's).
__device__ __forceinline__ void pool_merge(Pool2& p, const float2& m, const float2& s, const float2& n) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const float m0 = f2_get(p.m, j), mo = f2_get(m, j), m1 = fmaxf(m0, mo);
        if (m1 == NEG_INF) continue;
        const float a0 = m0 == NEG_INF ? 0.0f : exp2f(m0 - m1), ao = mo == NEG_INF ? 0.0f : exp2f(mo - m1);
        f2_set(p.s, j, f2_get(p.s, j) * a0 + f2_get(s, j) * ao);
        f2_set(p.n, j, f2_get(p.n, j) * a0 + f2_get(n, j) * ao);
        f2_set(p.m, j, m1);
    }
}

__device__ __forceinline__ float2 f2_scale(float2 v, float k) { return make_float2(v.x * k, v.y * k); }

// Weighted RMSNorm over the block's entry, RoPE of the last 2·pairs channels at position
// ratio·i, and the page write. `v` holds channels c, c+1 (c = 2·threadIdx.x): one
// interleaved RoPE pair, since pairs start at even channels.
__device__ void comp_finish(float2 v, bool live, int c, int i, u32 page, float2 w, u8* page_base,
                            const CompressGeom& g, const RopeParams& rp) {
    float ss = live ? v.x * v.x + v.y * v.y : 0.0f;
    ss = block_sum(ss);
    if (!live) return;
    const float inv = 1.0f / sqrtf(ss / (float)g.dim + g.eps);
    v.x = w.x * (v.x * inv);
    v.y = w.y * (v.y * inv);
    const int rope_from = g.dim - 2 * rp.pairs;
    if (c >= rope_from)
        rope_pair(&v.x, &v.y, (float)(g.ratio * i), rp.inv_freq[(c - rope_from) / 2], rp.attention_factor, false);
    const long long at = (long long)page * g.page_elems + g.page_off + (long long)(i % g.per_page) * g.dim + c;
    store_entry(page_base, g.dtype, at, v.x);
    store_entry(page_base, g.dtype, at + 1, v.y);
}

// grid (chunks, entries), blockDim = dim/2 rounded up to a warp; thread t owns channels
// 2t, 2t+1 and reads them as float2 (a warp moves 256 contiguous bytes per source).
// Each block pools its chunk of the entry's sources, eight sources' loads (score and kv)
// in flight per thread before any is used. With one chunk the block finishes the entry
// itself; with several (HCA's 128 sources) each block leaves its running softmax in
// `partial` [entries, chunks, 3, dim] and the entry's last block to arrive (a ticket
// per entry, reset by that block) merges them in chunk order, so the result does not
// depend on which block came last.
// At most 64 registers (four 256-thread blocks an SM, two channels a thread): a block's
// life is mostly waiting on its loads, so more resident blocks is more bandwidth (four
// channels a thread needed 119 registers, a quarter of the SM's warps).
extern "C" __global__ void __launch_bounds__(512, 2)
    compress_entries(const int* entries, const int* seqs, const u32* pages, const float* proj_kv,
                     const float* proj_score, const float* ape, const float* comp, const float* norm, u8* page_base,
                     float* partial, u32* tickets, CompressGeom g, RopeParams rp) {
    const int chunks = gridDim.x, chunk = blockIdx.x, e = blockIdx.y;
    const int sq = entries[2 * e], i = entries[2 * e + 1];
    const int* seq = seqs + sq * SEQ_STRIDE;
    const int first_row = seq[SEQ_FIRST_ROW], start = seq[SEQ_START], slot = seq[SEQ_SLOT];
    const float* ring_kv = comp + (long long)slot * g.comp_elems + g.comp_off;
    const float* ring_sc = ring_kv + (long long)g.slots * g.width;
    const int prev = (g.overlap && i > 0) ? g.ratio : 0;
    const int n_src = prev + g.ratio;
    const int per = (n_src + chunks - 1) / chunks;
    const int u_lo = chunk * per, u_hi = min(n_src, u_lo + per);
    const int c = 2 * threadIdx.x;
    const bool live = c < g.dim;
    // What the finish needs, loaded now so it arrives with the sources, not after them.
    const u32 page = pages[seq[SEQ_PAGE_OFF] + i / g.per_page];
    const float2 w = live ? *(const float2*)(norm + c) : make_float2(0.f, 0.f);
    Pool2 p;
    p.m = make_float2(NEG_INF, NEG_INF);
    p.s = make_float2(0.f, 0.f);
    p.n = p.s;
    if (live) {
        // Source u < prev is token ratio·(i-1) + u (first half of the channels), else
        // token ratio·i + u - prev; either way its phase in the window is the offset.
        const int cur_ch = (g.overlap ? g.dim : 0) + c;
        for (int u0 = u_lo; u0 < u_hi; u0 += 8) {
            float2 sc[8], kv[8];
            const int cnt = min(8, u_hi - u0);
#pragma unroll
            for (int q = 0; q < 8; q++) {
                if (q < cnt) {
                    const int u = u0 + q;
                    const bool early = u < prev;
                    const int phase = early ? u : u - prev;
                    const int t = g.ratio * (early ? i - 1 : i) + phase;
                    const int ch = early ? c : cur_ch;
                    if (t >= start) {
                        const long long at = (long long)(first_row + t - start) * g.width + ch;
                        const float2 s = *(const float2*)(proj_score + at);
                        const float2 b = *(const float2*)(ape + phase * g.width + ch);
                        sc[q] = make_float2((s.x + b.x) * LOG2E, (s.y + b.y) * LOG2E);
                        kv[q] = *(const float2*)(proj_kv + at);
                    } else {
                        const int at = (t % g.slots) * g.width + ch;
                        sc[q] = f2_scale(*(const float2*)(ring_sc + at), LOG2E);
                        kv[q] = *(const float2*)(ring_kv + at);
                    }
                }
            }
            pool_fold(p, sc, kv, cnt);
        }
    }
    if (chunks > 1) {
        __shared__ bool last;
        float* mine = partial + ((long long)e * chunks + chunk) * 3 * g.dim;
        if (live) {
            *(float2*)(mine + c) = p.m;
            *(float2*)(mine + g.dim + c) = p.s;
            *(float2*)(mine + 2 * g.dim + c) = p.n;
        }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(&tickets[e], 1u) == (u32)chunks - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        p.m = make_float2(NEG_INF, NEG_INF);
        p.s = make_float2(0.f, 0.f);
        p.n = p.s;
        if (live) {
            const float* o = partial + (long long)e * chunks * 3 * g.dim + c;
            // Four chunks' partials in flight at a time, merged in chunk order.
            for (int t0 = 0; t0 < chunks; t0 += 4) {
                float2 m4[4], s4[4], n4[4];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    if (t0 + q < chunks) {
                        const float* ot = o + (long long)(t0 + q) * 3 * g.dim;
                        m4[q] = __ldcg((const float2*)ot);
                        s4[q] = __ldcg((const float2*)(ot + g.dim));
                        n4[q] = __ldcg((const float2*)(ot + 2 * g.dim));
                    }
                }
#pragma unroll
                for (int q = 0; q < 4; q++)
                    if (t0 + q < chunks) pool_merge(p, m4[q], s4[q], n4[q]);
            }
        }
        if (threadIdx.x == 0) tickets[e] = 0;
    }
    const float2 v = make_float2(p.n.x / p.s.x, p.n.y / p.s.y);
    comp_finish(v, live, c, i, page, w, page_base, g, rp);
}

// Ring update: each sequence's last `slots` tokens of this batch go to slot t % slots
// (kv, and score with the position bias added). grid (ceil(slots·width / 256), seqs):
// only the rows that land in the ring are visited.
extern "C" __global__ void compress_store(const int* seqs, const float* proj_kv, const float* proj_score,
                                          const float* ape, float* comp, CompressGeom g) {
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
