// Attention over each row's window (ring entries before this step, this step's new_kv
// rows) and its compressed entries (every visible one for HCA, the indexer's selection
// for CSA), one softmax per head with the sink in the denominator. K = V, shared by all
// heads (MQA), so a block loads a tile of keys once into shared memory and its 16 warps
// (one head each) reuse it. For few rows the key axis is split across blocks; partial
// (max, sum, weighted sum) triples are merged in split order by `attention_merge`, so
// results do not depend on scheduling.

#define ATT_T 16
#define ATT_HD_MAX 512
#define ATT_DPL (ATT_HD_MAX / 32)

// Ring and page entries share one format: `dtype`, `tail` BF16 dims (fp8), `stride`
// storage elements from one entry to the next.
struct AttnGeom {
    int heads, hd, window, kind, ratio, top_k;
    int dtype, tail, stride;
    int ring_elems, ring_off;
    int page_elems, page_off, per_page;
    int splits, keys_per_split;
    float scale;
    int win_mask;    // window - 1 if the window is a power of two, else -1
    int page_shift;  // log2(per_page) if that is a power of two, else -1
    int new_bf16;    // attention_mma: new_kv holds bf16 values (u16), not f32
    int one_part;    // attention_mma: q and the softmax weights as one bf16 part, not hi + lo
    int q_prep;      // attention_wg: q raw, each head RMSNormed (q_eps) and rotated while staged
    float q_eps;
    int out_bf16;    // attention_wg, one split: out holds bf16 values (u16), rotated back (inverse RoPE)
};

// Where key j of row r lives: 0 = new_kv (f32, or its bf16 copy: AttnGeom.new_bf16), 1 =
// ring, 2 = page, -1 = no key; *off is in elements of that storage.
__device__ __forceinline__ int key_source(const AttnGeom& g, int j, int t, int n_win, const int* seq,
                                          const u32* pages, const int* sel_row, long long* off) {
    const int first = t + 1 - n_win;
    if (j < n_win) {
        const int p = first + j;
        const int start = seq[SEQ_START];
        if (p >= start) {
            *off = (long long)(seq[SEQ_FIRST_ROW] + p - start) * g.hd;
            return 0;
        }
        // A run-time division is ~20 instructions and every key pays it: mask when we can.
        const int slot = g.win_mask >= 0 ? (p & g.win_mask) : p % g.window;
        *off = (long long)seq[SEQ_SLOT] * g.ring_elems + g.ring_off + (long long)slot * g.stride;
        return 1;
    }
    const int c = j - n_win;
    const int i = g.kind == 1 ? sel_row[c] : c;
    if (i < 0) return -1;
    const int pi = g.page_shift >= 0 ? i >> g.page_shift : i / g.per_page;
    const u32 page = pages[seq[SEQ_PAGE_OFF] + pi];
    *off = (long long)page * g.page_elems + g.page_off + (long long)(i - pi * g.per_page) * g.stride;
    return 2;
}

// Row r's keys as a kernel of blockIdx.y = `split` sees them: its position t, its
// sequence's record, its window's length, the split's range [j0, j1) of its n_win +
// compressed keys, and its selection (CSA).
struct AttnRow {
    int t, n_win, j0, j1;
    const int* seq;
    const int* sel_row;
};
__device__ __forceinline__ AttnRow attn_row(const AttnGeom& g, int r, int split, const u32* positions,
                                            const int* row_seq, const int* seqs, const int* sel) {
    AttnRow a;
    a.t = (int)positions[r];
    a.seq = seqs + row_seq[r] * SEQ_STRIDE;
    a.n_win = min(a.t + 1, g.window);
    // A CSA row's selection holds its ids first and -1 after (every top-k here and the
    // CPU's write it so): with fewer than top_k entries visible, the keys past them are
    // all missing and are not walked (an 8K prefill's rows before position 2,048).
    const int visible = (a.t + 1) / g.ratio;
    const int n = a.n_win + (g.kind == 2 ? visible : (g.kind == 1 ? min(g.top_k, visible) : 0));
    a.j0 = split * g.keys_per_split;
    a.j1 = min(n, a.j0 + g.keys_per_split);
    a.sel_row = g.kind == 1 ? sel + (long long)r * g.top_k : nullptr;
    return a;
}

// grid (ceil(heads / warps), splits, rows), one warp per head (up to 16 warps).
extern "C" __global__ void __launch_bounds__(512)
    attention(const float* q, const float* new_kv, const u8* rings, const u8* page_base, const u32* pages,
              const int* sel, const float* sinks, const u32* positions, const int* row_seq, const int* seqs,
              float* out, float* part, AttnGeom g,
              RopeParams /* attention_wg's rotations; unused here: one launch for the three kernels */) {
    pdl_begin();
    __shared__ float keys[ATT_T * ATT_HD_MAX];
    __shared__ int src_kind[ATT_T];
    __shared__ long long src_off[ATT_T];
    const int r = blockIdx.z, split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.x * (blockDim.x >> 5) + warp;
    const bool active = h < g.heads;
    const AttnRow row = attn_row(g, r, split, positions, row_seq, seqs, sel);
    const int t = row.t, n_win = row.n_win, j0 = row.j0, j1 = row.j1;
    const int *seq = row.seq, *sel_row = row.sel_row;

    float qv[ATT_DPL], acc[ATT_DPL];
#pragma unroll
    for (int i = 0; i < ATT_DPL; i++) {
        int d = lane + 32 * i;
        qv[i] = (active && d < g.hd) ? q[((long long)r * g.heads + h) * g.hd + d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, s = 0.0f;

    for (int jt = j0; jt < j1; jt += ATT_T) {
        const int nt = min(ATT_T, j1 - jt);
        if (threadIdx.x < ATT_T) {
            long long off = 0;
            int kind = threadIdx.x < nt ? key_source(g, jt + threadIdx.x, t, n_win, seq, pages, sel_row, &off) : -1;
            src_kind[threadIdx.x] = kind;
            src_off[threadIdx.x] = off;
        }
        __syncthreads();
        // Warp w loads keys w, w + warps, … (one key a warp for 16 warps), lanes across the
        // key's dims: each warp's loads come from one entry and are unrolled, so they are
        // in flight together instead of one key after another.
        for (int kk = warp; kk < ATT_T; kk += (int)(blockDim.x >> 5)) {
            const int kind = kk < nt ? src_kind[kk] : -1;
            const long long off = src_off[kk];
            float* dst = keys + kk * ATT_HD_MAX;
            if (kind == 0) {
                const float* src = new_kv + off;
#pragma unroll 8
                for (int d = lane; d < g.hd; d += WARP) dst[d] = src[d];
            } else if (kind == 1 || kind == 2) {
                const u8* e = entry_at(kind == 1 ? rings : page_base, g.dtype, off);
#pragma unroll 8
                for (int d = lane; d < g.hd; d += WARP) dst[d] = entry_load(e, g.dtype, g.hd, g.tail, d);
            } else {
                for (int d = lane; d < g.hd; d += WARP) dst[d] = 0.0f;
            }
        }
        __syncthreads();
        if (active) {
            float lg[ATT_T];
            float mt = NEG_INF;
#pragma unroll
            for (int kk = 0; kk < ATT_T; kk++) {
                float l = NEG_INF;
                if (kk < nt) {
                    float p = 0.0f;
#pragma unroll
                    for (int i = 0; i < ATT_DPL; i++) {
                        int d = lane + 32 * i;
                        if (d < g.hd) p += qv[i] * keys[kk * ATT_HD_MAX + d];
                    }
                    p = warp_sum(p) * g.scale;
                    if (src_kind[kk] >= 0) l = p;
                }
                lg[kk] = l;
                mt = fmaxf(mt, l);
            }
            const float m_new = fmaxf(m, mt);
            if (m_new != NEG_INF) {
                const float corr = expf(m - m_new);
                s *= corr;
#pragma unroll
                for (int i = 0; i < ATT_DPL; i++) acc[i] *= corr;
#pragma unroll
                for (int kk = 0; kk < ATT_T; kk++) {
                    // Slots past the tile's keys hold stale shared memory (possibly NaN
                    // bits): skip them rather than multiply them by zero.
                    if (kk < nt) {
                        const float p = expf(lg[kk] - m_new);
                        s += p;
#pragma unroll
                        for (int i = 0; i < ATT_DPL; i++) {
                            int d = lane + 32 * i;
                            if (d < g.hd) acc[i] += p * keys[kk * ATT_HD_MAX + d];
                        }
                    }
                }
                m = m_new;
            }
        }
        __syncthreads();
    }
    if (!active) return;
    if (g.splits == 1) {
        const float sink = sinks[h];
        const float mf = fmaxf(m, sink);
        const float corr = expf(m - mf);
        const float den = s * corr + expf(sink - mf);
        float* o = out + ((long long)r * g.heads + h) * g.hd;
#pragma unroll
        for (int i = 0; i < ATT_DPL; i++) {
            int d = lane + 32 * i;
            if (d < g.hd) o[d] = acc[i] * corr / den;
        }
    } else {
        float* pp = part + (((long long)r * g.heads + h) * g.splits + split) * (g.hd + 2);
#pragma unroll
        for (int i = 0; i < ATT_DPL; i++) {
            int d = lane + 32 * i;
            if (d < g.hd) pp[d] = acc[i];
        }
        if (lane == 0) {
            pp[g.hd] = m;
            pp[g.hd + 1] = s;
        }
    }
}

// One block per (row, head): merge the splits' partials with the sink. The first warp
// takes the maximum and the denominator over the splits and leaves each split's factor in
// shared memory (`splits` floats of dynamic shared memory), so the outputs' loops load
// partials only; every thread walking the splits for the maximum, the denominator and
// again per output with an exp each was ~25 µs at 40 splits.
//
// The splits' factors (the first warp: the maximum and the denominator over the splits,
// lane-strided, then a warp reduction — a fixed order) into `factor`, the denominator
// returned to every thread.
__device__ __forceinline__ float merge_factors(const float* pp, const float* sinks, int h, int hd, int splits,
                                               float* factor) {
    __shared__ float den_s;
    if (threadIdx.x < WARP) {
        const float sink = sinks[h];
        float mx = sink;
        for (int sp = threadIdx.x; sp < splits; sp += WARP) mx = fmaxf(mx, pp[sp * (hd + 2) + hd]);
        mx = warp_max(mx);
        float den = 0.0f;
        for (int sp = threadIdx.x; sp < splits; sp += WARP) {
            const float f = expf(pp[sp * (hd + 2) + hd] - mx);
            factor[sp] = f;
            den += pp[sp * (hd + 2) + hd + 1] * f;
        }
        den = warp_sum(den);
        if (threadIdx.x == 0) den_s = den + expf(sink - mx);
    }
    __syncthreads();
    return den_s;
}

// Output value d of a (row, head) from its splits' partials.
__device__ __forceinline__ float merge_value(const float* pp, const float* factor, int hd, int splits, int d,
                                            float den) {
    float v = 0.0f;
#pragma unroll 8
    for (int sp = 0; sp < splits; sp++) v += pp[sp * (hd + 2) + d] * factor[sp];
    return v / den;
}

extern "C" __global__ void attention_merge(const float* part, const float* sinks, float* out, int heads, int hd,
                                           int splits) {
    pdl_begin();
    extern __shared__ float factor[];
    const int rh = blockIdx.x, h = rh % heads;
    const float* pp = part + (long long)rh * splits * (hd + 2);
    const float den = merge_factors(pp, sinks, h, hd, splits, factor);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) out[(long long)rh * hd + d] = merge_value(pp, factor, hd, splits, d, den);
}

// attention_merge, then the output's RoPE undone on the head's last 2·pairs values (the
// `rope` kernel's rotation, inverse) and the values rounded to bf16 (`round_rows`): the
// three launches a key-split `attention_wg` output took, in one, with the same bits. A
// thread a value (blockDim = hd, a multiple of 64), so a pair's two values are neighbouring
// lanes of one warp.
extern "C" __global__ void attention_merge_rope_bf16(const float* part, const float* sinks, u16* out,
                                                     const u32* positions, int heads, int hd, int splits,
                                                     RopeParams p) {
    pdl_begin();
    extern __shared__ float factor[];
    const int rh = blockIdx.x, h = rh % heads, d = threadIdx.x;
    const float* pp = part + (long long)rh * splits * (hd + 2);
    const float den = merge_factors(pp, sinks, h, hd, splits, factor);
    float v = merge_value(pp, factor, hd, splits, d, den);
    const float other = __shfl_xor_sync(0xffffffffu, v, 1);
    const int j = (d - (hd - 2 * p.pairs)) >> 1;
    if (j >= 0) {
        float a = d & 1 ? other : v, b = d & 1 ? v : other;
        rope_pair(&a, &b, (float)positions[rh / heads], p.inv_freq[j], p.attention_factor, true);
        v = d & 1 ? b : a;
    }
    out[(long long)rh * hd + d] = f2bf(v);
}

// Window ring update: each sequence's last `window` rows of new_kv go to slot p % window.
// FP8 entries take a warp per (row, FP8 block) and one for the bf16 tail and padding
// (a warp walking a row's blocks waited on each block's loads in turn); other dtypes a
// warp per row.
extern "C" __global__ void store_window(const float* new_kv, u8* rings, const int* row_seq, const int* seqs, int rows,
                                        int hd, int window, int dtype, int tail, int stride, int ring_elems,
                                        int ring_off) {
    pdl_begin();
    const int n8 = hd - tail, nb = dtype == DTYPE_FP8 ? (n8 + FP8_BLOCK - 1) / FP8_BLOCK : 0;
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    if (w >= (long long)rows * (nb + 1)) return;
    const int r = (int)(w / (nb + 1)), b = (int)(w % (nb + 1));
    const int* seq = seqs + row_seq[r] * SEQ_STRIDE;
    const int j = r - seq[SEQ_FIRST_ROW];
    if (j + window < seq[SEQ_ROWS]) return;
    const int p = seq[SEQ_START] + j;
    const long long at = (long long)seq[SEQ_SLOT] * ring_elems + ring_off + (long long)(p % window) * stride;
    const float* x = new_kv + (long long)r * hd;
    u8* e = entry_at(rings, dtype, at);
    const int bytes = stride * entry_elem_bytes(dtype);
    if (dtype != DTYPE_FP8)
        entry_store_warp(x, e, nullptr, dtype, hd, tail, bytes);
    else if (b < nb)
        entry_fp8_block_warp(x, e, nullptr, n8, tail, b);
    else
        entry_fp8_tail_warp(x, e, nullptr, n8, tail, bytes);
}
