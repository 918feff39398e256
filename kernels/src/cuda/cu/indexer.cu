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

// One block (1024 threads) per row. Radix select over the 32 key bits, 8 at a time,
// finds the k-th largest key T and how many keys equal to T to keep; a final pass in
// index order keeps every key > T and the lowest-indexed keys == T (the CPU's tie
// order), compacted with warp ballots so the output is ascending.
extern "C" __global__ void __launch_bounds__(1024) topk_select(const float* scores, int n_max, const u32* positions,
                                                               int ratio, int k, int* out) {
    const int r = blockIdx.x;
    const int n = (int)((positions[r] + 1) / (u32)ratio);
    const float* s = scores + (long long)r * n_max;
    int* o = out + (long long)r * k;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, nw = blockDim.x >> 5;
    if (n <= k) {
        for (int j = tid; j < k; j += blockDim.x) o[j] = j < n ? j : -1;
        return;
    }
    __shared__ u32 hist[256];
    __shared__ u32 sh_prefix, sh_remaining;
    __shared__ u32 cnt_eq[32], cnt_sel[32];
    u32 prefix = 0, mask = 0, remaining = (u32)k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int i = tid; i < n; i += blockDim.x) {
            u32 key = fkey(s[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (w == 0) {
            // Bins from the top: lane l holds bins 255-8l .. 248-8l; find the first bin
            // where the count from the top reaches `remaining`.
            u32 local[8];
            u32 tot = 0;
#pragma unroll
            for (int q = 0; q < 8; q++) {
                local[q] = hist[255 - 8 * lane - q];
                tot += local[q];
            }
            u32 incl = tot;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                u32 v = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += v;
            }
            u32 above = incl - tot;
            bool hit = above < remaining && incl >= remaining;
            if (hit) {
                u32 acc = above;
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    if (acc + local[q] >= remaining) {
                        sh_prefix = prefix | ((u32)(255 - 8 * lane - q) << shift);
                        sh_remaining = remaining - acc;
                        break;
                    }
                    acc += local[q];
                }
            }
        }
        __syncthreads();
        prefix = sh_prefix;
        remaining = sh_remaining;
        mask |= 255u << shift;
        __syncthreads();
    }
    const u32 T = prefix;
    const u32 lt_mask = (1u << lane) - 1u;
    u32 base_eq = 0, base_sel = 0;
    for (int start = 0; start < n; start += blockDim.x) {
        const int i = start + tid;
        const u32 key = i < n ? fkey(s[i]) : 0u;
        const bool gt = i < n && key > T;
        const bool eq = i < n && key == T;
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
