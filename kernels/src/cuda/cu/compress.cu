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

extern "C" __global__ void compress_entries(const int* entries, const int* seqs, const u32* pages,
                                            const float* proj_kv, const float* proj_score, const float* ape,
                                            const float* norm, const float* comp, u8* page_base, CompressGeom g,
                                            RopeParams rp) {
    extern __shared__ float ent[];
    const int sq = entries[2 * blockIdx.x], i = entries[2 * blockIdx.x + 1];
    const int* seq = seqs + sq * SEQ_STRIDE;
    const int first_row = seq[SEQ_FIRST_ROW], start = seq[SEQ_START], slot = seq[SEQ_SLOT];
    const float* ring_kv = comp + (long long)slot * g.comp_elems + g.comp_off;
    const float* ring_sc = ring_kv + (long long)g.slots * g.width;
    const int prev = (g.overlap && i > 0) ? g.ratio : 0;
    const int cur_off = g.overlap ? g.dim : 0;
    const int n_src = prev + g.ratio;
    for (int c = threadIdx.x; c < g.dim; c += blockDim.x) {
        // Source u < prev: token ratio*(i-1)+u, first-half channel; else ratio*i+(u-prev), cur_off.
        float m = NEG_INF;
        for (int u = 0; u < n_src; u++) {
            int p = u < prev ? g.ratio * (i - 1) + u : g.ratio * i + (u - prev);
            int ch = (u < prev ? 0 : cur_off) + c;
            float sc = p >= start ? proj_score[(long long)(first_row + p - start) * g.width + ch] +
                                        ape[(p % g.ratio) * g.width + ch]
                                  : ring_sc[(p % g.slots) * g.width + ch];
            m = fmaxf(m, sc);
        }
        float num = 0.0f, den = 0.0f;
        for (int u = 0; u < n_src; u++) {
            int p = u < prev ? g.ratio * (i - 1) + u : g.ratio * i + (u - prev);
            int ch = (u < prev ? 0 : cur_off) + c;
            float sc, kv;
            if (p >= start) {
                long long at = (long long)(first_row + p - start) * g.width + ch;
                sc = proj_score[at] + ape[(p % g.ratio) * g.width + ch];
                kv = proj_kv[at];
            } else {
                int at = (p % g.slots) * g.width + ch;
                sc = ring_sc[at];
                kv = ring_kv[at];
            }
            float e = expf(sc - m);
            den += e;
            num += e * kv;
        }
        ent[c] = num / den;
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
