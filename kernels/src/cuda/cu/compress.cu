// The KV compressors: `compress_pool` computes the per-channel softmax(score)-weighted
// sum over each completed entry's window(s) with the work spread over many blocks (the
// bytes are the projections, read once), then `compress_finish` applies the weighted
// RMSNorm and the RoPE at position ratio·i per entry and writes it into its page. Tokens of this batch
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

// Pooling, spread for bandwidth: grid (ceil(dim / (256 / groups)), entries), 256
// threads = (256 / groups) channels × `groups` source groups (1 for CSA's 8 sources, 8
// for HCA's 128). A warp reads 32 consecutive channels of one source (128-byte loads);
// each thread keeps an online softmax (max, sum, weighted sum) over its group's sources
// with eight sources' loads issued before any is used, and the groups are merged in
// group order through shared memory. The pooled entry (before norm and RoPE) goes to
// `pooled` [entries, dim].
#define POOL_GROUPS_MAX 8
extern "C" __global__ void __launch_bounds__(256)
    compress_pool(const int* entries, const int* seqs, const float* proj_kv, const float* proj_score,
                  const float* ape, const float* comp, float* pooled, CompressGeom g, int groups) {
    __shared__ float pm[POOL_GROUPS_MAX][256], ps[POOL_GROUPS_MAX][256], pn[POOL_GROUPS_MAX][256];
    const int sq = entries[2 * blockIdx.y], i = entries[2 * blockIdx.y + 1];
    const int* seq = seqs + sq * SEQ_STRIDE;
    const int first_row = seq[SEQ_FIRST_ROW], start = seq[SEQ_START], slot = seq[SEQ_SLOT];
    const float* ring_kv = comp + (long long)slot * g.comp_elems + g.comp_off;
    const float* ring_sc = ring_kv + (long long)g.slots * g.width;
    const int prev = (g.overlap && i > 0) ? g.ratio : 0;
    const int n_src = prev + g.ratio;
    const int cpb = blockDim.x / groups, cl = threadIdx.x % cpb, grp = threadIdx.x / cpb;
    const int c = blockIdx.x * cpb + cl;
    float m = NEG_INF, sum = 0.0f, num = 0.0f;
    if (c < g.dim) {
        for (int u0 = grp; u0 < n_src; u0 += 8 * groups) {
            float scv[8], kvv[8];
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const int u = u0 + q * groups;
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
            for (int q = 0; q < 8; q++) {
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
    }
    pm[grp][cl] = m;
    ps[grp][cl] = sum;
    pn[grp][cl] = num;
    __syncthreads();
    if (grp != 0 || c >= g.dim) return;
    float mx = NEG_INF;
    for (int t = 0; t < groups; t++) mx = fmaxf(mx, pm[t][cl]);
    float tot = 0.0f, acc = 0.0f;
    for (int t = 0; t < groups; t++) {
        const float mt = pm[t][cl];
        if (mt == NEG_INF) continue;
        const float a = expf(mt - mx);
        tot += ps[t][cl] * a;
        acc += pn[t][cl] * a;
    }
    pooled[(long long)blockIdx.y * g.dim + c] = acc / tot;
}

// One block per entry: weighted RMSNorm of the pooled entry, RoPE at position ratio·i,
// and the page write. Dynamic shared memory: dim floats.
extern "C" __global__ void compress_finish(const int* entries, const int* seqs, const u32* pages, const float* pooled,
                                           const float* norm, u8* page_base, CompressGeom g, RopeParams rp) {
    extern __shared__ float ent[];
    const int sq = entries[2 * blockIdx.x], i = entries[2 * blockIdx.x + 1];
    const int* seq = seqs + sq * SEQ_STRIDE;
    const float* src = pooled + (long long)blockIdx.x * g.dim;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < g.dim; c += blockDim.x) {
        const float v = src[c];
        ent[c] = v;
        ss += v * v;
    }
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
