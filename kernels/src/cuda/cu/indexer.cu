// Lightning indexer: per row, score every visible indexer key
// (Σ_h w_h · relu(q_h · k)), then keep the top_k by radix select (no sort) and write
// the chosen entry ids in ascending order, as the CPU does.

struct IndexGeom {
    int heads, dim, ratio, n_max;
    int dtype, page_elems, page_off, per_page;
};

// grid (ceil(n_max / 256), rows), 256 threads, one entry per thread; q and w of the row
// in shared memory (dynamic: heads*dim + heads floats). Entries past the row's visible
// count get -inf.
extern "C" __global__ void __launch_bounds__(256) index_scores(const float* q, const float* w, const u32* positions,
                                                               const int* row_seq, const int* seqs, const u32* pages,
                                                               const u8* page_base, float* scores, IndexGeom g) {
    extern __shared__ float sm[];
    float* qs = sm;
    float* ws = sm + g.heads * g.dim;
    const int r = blockIdx.y;
    const int hdim = g.heads * g.dim;
    for (int i = threadIdx.x; i < hdim; i += blockDim.x) qs[i] = q[(long long)r * hdim + i];
    for (int i = threadIdx.x; i < g.heads; i += blockDim.x) ws[i] = w[(long long)r * g.heads + i];
    __syncthreads();
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= g.n_max) return;
    const int n = (int)((positions[r] + 1) / (u32)g.ratio);
    float* out = scores + (long long)r * g.n_max;
    if (e >= n) {
        out[e] = NEG_INF;
        return;
    }
    const int* seq = seqs + row_seq[r] * SEQ_STRIDE;
    const u32 page = pages[seq[SEQ_PAGE_OFF] + e / g.per_page];
    const long long at = (long long)page * g.page_elems + g.page_off + (long long)(e % g.per_page) * g.dim;
    float score = 0.0f;
    for (int hg = 0; hg < g.heads; hg += 16) {
        float acc[16];
#pragma unroll
        for (int h = 0; h < 16; h++) acc[h] = 0.0f;
        for (int d0 = 0; d0 < g.dim; d0 += 8) {
            float k[8];
#pragma unroll
            for (int x = 0; x < 8; x++) k[x] = d0 + x < g.dim ? load_entry(page_base, g.dtype, at + d0 + x) : 0.0f;
#pragma unroll
            for (int h = 0; h < 16; h++) {
                if (hg + h < g.heads) {
                    const float* qh = qs + (hg + h) * g.dim + d0;
#pragma unroll
                    for (int x = 0; x < 8; x++)
                        if (d0 + x < g.dim) acc[h] += qh[x] * k[x];
                }
            }
        }
#pragma unroll
        for (int h = 0; h < 16; h++)
            if (hg + h < g.heads) score += ws[hg + h] * fmaxf(acc[h], 0.0f);
    }
    out[e] = score;
}

// Order-preserving map of f32 to u32 (larger float, larger key; -0 below +0 like total_cmp).
__device__ __forceinline__ u32 fkey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Radix select in three digits of 11, 11 and 10 bits, most significant first.
#define TK_BINS 2048
__device__ __forceinline__ int tk_shift(int pass) { return pass == 0 ? 21 : (pass == 1 ? 10 : 0); }
__device__ __forceinline__ u32 tk_bits(int pass) { return pass == 2 ? 0x3ffu : 0x7ffu; }

// Histogram add with the warp's equal bins merged first: scores cluster in few top
// bins, and one shared-memory atomic per distinct bin per warp avoids serialising the
// whole block on one address. Every lane of the warp must call it.
__device__ __forceinline__ void tk_hist_add(u32* hist, u32 bin, bool active) {
    const u32 key = active ? bin : 0xffffffffu;
    const u32 peers = __match_any_sync(0xffffffffu, key);
    if (active && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], (u32)__popc(peers));
}

// With blockDim.x == 1024: the bin b (of `nbins`, counted from the top) where the count
// of keys in bins above b is < `remaining` <= that count plus hist[b]. Thread 0 of the
// answer writes (*bin, *above). Every thread must call it.
__device__ void tk_find_bin(const u32* hist, int nbins, u32 remaining, u32* bin, u32* above) {
    __shared__ u32 warp_tot[32];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int per = nbins / 1024;
    u32 local = 0;
    for (int q = 0; q < per; q++) local += hist[nbins - 1 - (tid * per + q)];
    u32 incl = local;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        u32 v = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += v;
    }
    if (lane == 31) warp_tot[w] = incl;
    __syncthreads();
    if (w == 0) {
        u32 t = warp_tot[lane], x = t;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            u32 v = __shfl_up_sync(0xffffffffu, x, off);
            if (lane >= off) x += v;
        }
        warp_tot[lane] = x - t;
    }
    __syncthreads();
    incl += warp_tot[w];
    u32 acc = incl - local;
    if (acc < remaining && incl >= remaining) {
        for (int q = 0; q < per; q++) {
            u32 c = hist[nbins - 1 - (tid * per + q)];
            if (acc + c >= remaining) {
                *bin = (u32)(nbins - 1 - (tid * per + q));
                *above = acc;
                break;
            }
            acc += c;
        }
    }
    __syncthreads();
}

// Keep keys > T and the first `remaining` keys == T in index order over [lo, hi),
// writing ascending indices from o[base_sel]; eq_before counts the keys == T before lo.
// Every thread of the block must call it.
__device__ void tk_compact(const float* s, int lo, int hi, u32 T, u32 remaining, u32 base_eq, u32 base_sel, int* o) {
    __shared__ u32 cnt_eq[32], cnt_sel[32];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, nw = blockDim.x >> 5;
    const u32 lt_mask = (1u << lane) - 1u;
    for (int start = lo; start < hi; start += blockDim.x) {
        const int i = start + tid;
        const u32 key = i < hi ? fkey(s[i]) : 0u;
        const bool gt = i < hi && key > T;
        const bool eq = i < hi && key == T;
        const u32 beq = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) cnt_eq[w] = __popc(beq);
        __syncthreads();
        u32 eq_before = base_eq + __popc(beq & lt_mask), eq_total = 0;
        for (int q = 0; q < nw; q++) {
            if (q < w) eq_before += cnt_eq[q];
            eq_total += cnt_eq[q];
        }
        const bool sel = gt || (eq && eq_before < remaining);
        const u32 bsel = __ballot_sync(0xffffffffu, sel);
        if (lane == 0) cnt_sel[w] = __popc(bsel);
        __syncthreads();
        u32 pos = base_sel + __popc(bsel & lt_mask), sel_total = 0;
        for (int q = 0; q < nw; q++) {
            if (q < w) pos += cnt_sel[q];
            sel_total += cnt_sel[q];
        }
        if (sel) o[pos] = i;
        base_eq += eq_total;
        base_sel += sel_total;
        __syncthreads();
    }
}

// One block (1024 threads) per row: the three radix passes over the row's scores in
// shared-memory histograms, then the ordered compaction. Used while rows are short.
extern "C" __global__ void __launch_bounds__(1024) topk_select(const float* scores, int n_max, const u32* positions,
                                                               int ratio, int k, int* out) {
    const int r = blockIdx.x;
    const int n = (int)((positions[r] + 1) / (u32)ratio);
    const float* s = scores + (long long)r * n_max;
    int* o = out + (long long)r * k;
    const int tid = threadIdx.x;
    if (n <= k) {
        for (int j = tid; j < k; j += blockDim.x) o[j] = j < n ? j : -1;
        return;
    }
    __shared__ u32 hist[TK_BINS];
    __shared__ u32 sh_bin, sh_above;
    u32 prefix = 0, mask = 0, remaining = (u32)k;
    for (int pass = 0; pass < 3; pass++) {
        const int shift = tk_shift(pass);
        const u32 bits = tk_bits(pass);
        for (int b = tid; b < TK_BINS; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int base = 0; base < n; base += blockDim.x) {
            const int i = base + tid;
            const u32 key = i < n ? fkey(s[i]) : 0u;
            tk_hist_add(hist, (key >> shift) & bits, i < n && (key & mask) == prefix);
        }
        __syncthreads();
        tk_find_bin(hist, (int)bits + 1, remaining, &sh_bin, &sh_above);
        prefix |= sh_bin << shift;
        remaining -= sh_above;
        mask |= bits << shift;
        __syncthreads();
    }
    tk_compact(s, 0, n, prefix, remaining, 0, 0, o);
}

// Long rows: the same selection spread over `gridDim.x` blocks per row, each over a
// slice of `chunk` scores. Per pass, blocks add their slice's histogram into `ghist`
// and the last block to finish (a ticket counter) picks the digit, updates the row's
// (prefix, mask, remaining) in `state` and clears the histogram for the next pass.
extern "C" __global__ void __launch_bounds__(1024) topk_hist(const float* scores, int n_max, const u32* positions,
                                                             int ratio, int k, int pass, int chunk, u32* state,
                                                             u32* ghist, u32* tickets) {
    const int r = blockIdx.y;
    const int n = (int)((positions[r] + 1) / (u32)ratio);
    if (n <= k) return;
    const float* s = scores + (long long)r * n_max;
    const int tid = threadIdx.x;
    __shared__ u32 hist[TK_BINS];
    __shared__ u32 sh_bin, sh_above;
    __shared__ bool last;
    const u32 prefix = pass == 0 ? 0u : state[4 * r], mask = pass == 0 ? 0u : state[4 * r + 1];
    const u32 remaining = pass == 0 ? (u32)k : state[4 * r + 2];
    const int shift = tk_shift(pass);
    const u32 bits = tk_bits(pass);
    for (int b = tid; b < TK_BINS; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const int lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    for (int base = lo; base < hi; base += blockDim.x) {
        const int i = base + tid;
        const u32 key = i < hi ? fkey(s[i]) : 0u;
        tk_hist_add(hist, (key >> shift) & bits, i < hi && (key & mask) == prefix);
    }
    __syncthreads();
    u32* gh = ghist + (long long)r * TK_BINS;
    for (int b = tid; b <= (int)bits; b += blockDim.x)
        if (hist[b]) atomicAdd(&gh[b], hist[b]);
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(&tickets[r], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int b = tid; b < TK_BINS; b += blockDim.x) {
        hist[b] = b <= (int)bits ? __ldcg(&gh[b]) : 0u;
        gh[b] = 0;
    }
    __syncthreads();
    tk_find_bin(hist, (int)bits + 1, remaining, &sh_bin, &sh_above);
    if (tid == 0) {
        state[4 * r] = prefix | (sh_bin << shift);
        state[4 * r + 1] = mask | (bits << shift);
        state[4 * r + 2] = remaining - sh_above;
        tickets[r] = 0;
    }
}

// Per slice: keys > T and keys == T (T and the tie budget from `state`).
extern "C" __global__ void __launch_bounds__(1024) topk_count(const float* scores, int n_max, const u32* positions,
                                                              int ratio, int k, int chunk, const u32* state,
                                                              u32* counts) {
    const int r = blockIdx.y;
    const int n = (int)((positions[r] + 1) / (u32)ratio);
    if (n <= k) return;
    const float* s = scores + (long long)r * n_max;
    const u32 T = state[4 * r];
    const int lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    u32 gt = 0, eq = 0;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const u32 key = fkey(s[i]);
        gt += key > T;
        eq += key == T;
    }
    gt = block_sum(gt);
    eq = block_sum(eq);
    if (threadIdx.x == 0) {
        counts[((long long)r * gridDim.x + blockIdx.x) * 2] = gt;
        counts[((long long)r * gridDim.x + blockIdx.x) * 2 + 1] = eq;
    }
}

// Per slice: its place in the row's output from the counts of the slices before it,
// then the ordered compaction of the slice.
extern "C" __global__ void __launch_bounds__(1024) topk_write(const float* scores, int n_max, const u32* positions,
                                                              int ratio, int k, int chunk, const u32* state,
                                                              const u32* counts, int* out) {
    const int r = blockIdx.y;
    const int n = (int)((positions[r] + 1) / (u32)ratio);
    int* o = out + (long long)r * k;
    if (n <= k) {
        if (blockIdx.x == 0)
            for (int j = threadIdx.x; j < k; j += blockDim.x) o[j] = j < n ? j : -1;
        return;
    }
    const u32 T = state[4 * r], remaining = state[4 * r + 2];
    // Ties are taken in index order, so the slices before this one took min(their ties,
    // remaining) of them: two block-wide sums over those slices' counts, read in
    // parallel (a serial walk over up to 127 slices cost ~20 µs of dependent loads).
    u32 gt_before = 0, eq_before = 0;
    for (int b = threadIdx.x; b < (int)blockIdx.x; b += blockDim.x) {
        gt_before += counts[((long long)r * gridDim.x + b) * 2];
        eq_before += counts[((long long)r * gridDim.x + b) * 2 + 1];
    }
    gt_before = block_sum(gt_before);
    eq_before = block_sum(eq_before);
    const u32 base_eq = eq_before, base_sel = gt_before + min(eq_before, remaining);
    const int lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    tk_compact(scores + (long long)r * n_max, lo, hi, T, remaining, base_eq, base_sel, o);
}
