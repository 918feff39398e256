// The KV compressors, fused: one block per completed entry computes the per-channel
// softmax(score)-weighted sum over the entry's window(s), the weighted RMSNorm and the
// RoPE at position ratio·i, and writes the entry into its page. Tokens of this batch
// are read straight from the projections (score + position bias added on the fly);
// older tokens from the sequence's compressor ring, which `compress_store` updates
// afterwards with the last `slots` tokens of each sequence.

struct CompressGeom {
    int ratio, slots, width, dim, overlap;
    int comp_elems, comp_off;
    int dtype, page_elems, page_off, per_page;
    float eps;
};

// Source u of entry i: token and channel offset (u < prev: previous window's first half).
__device__ __forceinline__ void comp_source(const CompressGeom& g, int i, int prev, int u, int* p, int* off) {
    *p = u < prev ? g.ratio * (i - 1) + u : g.ratio * i + (u - prev);
    *off = u < prev ? 0 : (g.overlap ? g.dim : 0);
}

// Block layout: `tg` token groups of blockDim/tg threads; a thread keeps an online
// softmax (max, sum, weighted sum) per channel over its group's tokens, one exp per
// token, and the groups are merged through shared memory. CSA entries (8 sources) use
// one group; HCA entries (128 sources) several, so each thread has fewer dependent
// steps and more loads in flight. Dynamic shared memory: (3·tg + 1)·dim floats.
extern "C" __global__ void compress_entries(const int* entries, const int* seqs, const u32* pages,
                                            const float* proj_kv, const float* proj_score, const float* ape,
                                            const float* norm, const float* comp, u8* page_base, CompressGeom g,
                                            RopeParams rp, int tg) {
    extern __shared__ float sm[];
    float* ent = sm;
    float* pm = sm + g.dim;
    float* ps = pm + tg * g.dim;
    float* pn = ps + tg * g.dim;
    const int sq = entries[2 * blockIdx.x], i = entries[2 * blockIdx.x + 1];
    const int* seq = seqs + sq * SEQ_STRIDE;
    const int first_row = seq[SEQ_FIRST_ROW], start = seq[SEQ_START], slot = seq[SEQ_SLOT];
    const float* ring_kv = comp + (long long)slot * g.comp_elems + g.comp_off;
    const float* ring_sc = ring_kv + (long long)g.slots * g.width;
    const int prev = (g.overlap && i > 0) ? g.ratio : 0;
    const int n_src = prev + g.ratio;
    const int ct = blockDim.x / tg, grp = threadIdx.x / ct, lane_c = threadIdx.x % ct;
    for (int c = lane_c; c < g.dim; c += ct) {
        float m = NEG_INF, sum = 0.0f, num = 0.0f;
        // Four sources' loads issued before any of them is used.
        for (int u0 = grp; u0 < n_src; u0 += 4 * tg) {
            float scv[4], kvv[4];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int u = u0 + q * tg;
                scv[q] = NEG_INF;
                kvv[q] = 0.0f;
                if (u < n_src) {
                    int p, off;
                    comp_source(g, i, prev, u, &p, &off);
                    const int ch = off + c;
                    if (p >= start) {
                        const long long at = (long long)(first_row + p - start) * g.width + ch;
                        scv[q] = proj_score[at] + ape[(p % g.ratio) * g.width + ch];
                        kvv[q] = proj_kv[at];
                    } else {
                        const int at = (p % g.slots) * g.width + ch;
                        scv[q] = ring_sc[at];
                        kvv[q] = ring_kv[at];
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float sc = scv[q], kv = kvv[q];
                if (sc == NEG_INF) continue;
                if (sc <= m) {
                    const float e = expf(sc - m);
                    sum += e;
                    num += e * kv;
                } else {
                    const float a = expf(m - sc);
                    sum = sum * a + 1.0f;
                    num = num * a + kv;
                    m = sc;
                }
            }
        }
        pm[grp * g.dim + c] = m;
        ps[grp * g.dim + c] = sum;
        pn[grp * g.dim + c] = num;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < g.dim; c += blockDim.x) {
        float m = NEG_INF;
        for (int t = 0; t < tg; t++) m = fmaxf(m, pm[t * g.dim + c]);
        float sum = 0.0f, num = 0.0f;
        for (int t = 0; t < tg; t++) {
            const float mt = pm[t * g.dim + c];
            if (mt == NEG_INF) continue;
            const float a = expf(mt - m);
            sum += ps[t * g.dim + c] * a;
            num += pn[t * g.dim + c] * a;
        }
        ent[c] = num / sum;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x; c < g.dim; c += blockDim.x) ss += ent[c] * ent[c];
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)g.dim + g.eps);
    for (int c = threadIdx.x; c < g.dim; c += blockDim.x) ent[c] = norm[c] * (ent[c] * inv);
    __syncthreads();
    const int rd = 2 * rp.pairs;
    for (int j = threadIdx.x; j < rp.pairs; j += blockDim.x) {
        float* a = &ent[g.dim - rd + 2 * j];
        rope_pair(a, a + 1, (float)(g.ratio * i), rp.inv_freq[j], rp.attention_factor, false);
    }
    __syncthreads();
    const u32 page = pages[seq[SEQ_PAGE_OFF] + i / g.per_page];
    const long long at = (long long)page * g.page_elems + g.page_off + (long long)(i % g.per_page) * g.dim;
    for (int c = threadIdx.x; c < g.dim; c += blockDim.x) store_entry(page_base, g.dtype, at + c, ent[c]);
}

// Ring update: each sequence's last `slots` tokens of this batch go to slot t % slots
// (kv, and score with the position bias added). One thread per (row, channel).
extern "C" __global__ void compress_store(const int* row_seq, const int* seqs, const float* proj_kv,
                                          const float* proj_score, const float* ape, float* comp, int rows,
                                          CompressGeom g) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)rows * g.width) return;
    const int r = (int)(idx / g.width), c = (int)(idx % g.width);
    const int* seq = seqs + row_seq[r] * SEQ_STRIDE;
    const int j = r - seq[SEQ_FIRST_ROW];
    if (j + g.slots < seq[SEQ_ROWS]) return;
    const int t = seq[SEQ_START] + j;
    float* ring_kv = comp + (long long)seq[SEQ_SLOT] * g.comp_elems + g.comp_off;
    float* ring_sc = ring_kv + (long long)g.slots * g.width;
    const int s = t % g.slots;
    ring_kv[s * g.width + c] = proj_kv[idx];
    ring_sc[s * g.width + c] = proj_score[idx] + ape[(t % g.ratio) * g.width + c];
}
