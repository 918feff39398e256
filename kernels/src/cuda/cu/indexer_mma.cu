// Lightning-indexer scores on tensor cores for FP8 keys (the serving format). The SIMT
// kernels of indexer.cu spend 8,192 FMAs and 2,048 shared-memory loads of q per key of
// a V4-Flash row (64 heads × 128 dims): at batch 64 and a 64K context that was ~2 ms a
// CSA layer, 21% of the step. Here a warp takes 16 keys as the A operand of
// mma.m16n8k16 (e4m3 codes are exact in f16), q is the B operand (n = 4 heads × its f16
// hi and lo halves, so q keeps ~22 bits), and the block scale of each key's 64-dim
// FP8 block multiplies that block's f32 partial sums. The sum over dims is in tensor-core
// order, not the CPU's, so scores differ in the last bits: selections may differ only
// where two scores are that close (the parity suite checks the picks are a top-k).
//
// Input order: a thread reads 16 contiguous key bytes per 64-dim block (dims 16t..16t+15
// of the block, t = lane % 4) and uses word s of them for k-step s; within a word bytes
// (0, 2) are the fragment's k = (2t, 2t + 1) and bytes (1, 3) k = (2t + 8, 2t + 9)
// (d2_fp8_pairs). q's fragments are written in that same order by index_q_frags.
//
// BF16 keys (`index_scores_mma_bf16`, the bf16 KV format) take the same tiling with bf16
// mma: a thread reads the same 16 dims (32 bytes) per 64-dim block, k-step s uses its
// words 2s (k = 2t, 2t + 1) and 2s + 1 (k = 2t + 8, 2t + 9), q's halves are bf16 (hi + lo,
// ~16 bits) in that order, and there is no block scale. At batch 32 and an 8K context
// the SIMT kernel took 365 µs a CSA layer (flash-bench, 13% of the step).

#define IDX_MMA_NT 16  // n-tiles of 4 heads: at most 64 heads
#define IDX_Q_STAGE 8192  // floats of a row's q index_q_frags stages in shared memory

// Row r's q as B fragments: frags[r][ks][nt][lane] = two f16x2 words for k-step ks, heads
// 4·nt .. 4·nt + 3 (column g = lane / 4 is head 4·nt + g / 2, half g % 2: hi, lo), q
// divided by the power of two qscale[r] that puts its maximum under 2^14. Heads past
// `heads` are zero. One block of 1,024 threads a row (with 256, a decode row's 4,096
// fragments took 16 loops of dependent loads a thread: 16 µs at batch 1).
// `bf16`: the halves are bf16 and paired (dims 0, 1), (2, 3) of each 4 (the bf16-key order).
// gridDim.y blocks a row share its fragments (each stages the row and takes its maximum,
// the same value in each; block 0 writes qscale): a decode row's 4,096 fragments took
// one block 8.7 µs, a serial step on the indexer's chain.
// With `positions` (not null; the row staged, which the host checks) each head's last
// 2·p.pairs dims are rotated at the row's position as they are staged, as the `rope`
// kernel would have done to q first (the same rope_pair on the same values: the same
// bits), one launch fewer on that chain.
extern "C" __global__ void __launch_bounds__(1024) index_q_frags(const float* q, uint2* frags, float* qscale, int heads,
                                                                 int dim, int bf16, const u32* positions,
                                                                 RopeParams p) {
    pdl_begin();
    __shared__ float red[32];
    // The row staged once (V4: 64 heads × 128 dims): the fragments below read it in
    // another order, and from global memory each of their passes waited on its loads.
    __shared__ float q_sh[IDX_Q_STAGE];
    const int r = blockIdx.x, tid = threadIdx.x;
    const bool staged = heads * dim <= IDX_Q_STAGE;
    const float* qg = q + (long long)r * heads * dim;
    float m = 0.0f;
    if (positions) {
        // Pairs (2j, 2j + 1) of the row; dim is even.
        const float pos = (float)positions[r];
        const int r0 = dim - 2 * p.pairs;
#pragma unroll 4
        for (int i = tid; i < heads * dim / 2; i += blockDim.x) {
            float2 v = reinterpret_cast<const float2*>(qg)[i];
            const int d0 = (2 * i) % dim;
            if (d0 >= r0) rope_pair(&v.x, &v.y, pos, p.inv_freq[(d0 - r0) >> 1], p.attention_factor, false);
            q_sh[2 * i] = v.x;
            q_sh[2 * i + 1] = v.y;
            m = fmaxf(m, fmaxf(fabsf(v.x), fabsf(v.y)));
        }
    } else {
#pragma unroll 8
        for (int i = tid; i < heads * dim; i += blockDim.x) {
            const float v = qg[i];
            if (staged) q_sh[i] = v;
            m = fmaxf(m, fabsf(v));
        }
    }
    const float* qr = staged ? q_sh : qg;
    m = warp_max(m);
    if ((tid & 31) == 0) red[tid >> 5] = m;
    __syncthreads();
    m = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, red[w]);
    const float s = d2_pow2_scale(m);
    if (tid == 0 && blockIdx.y == 0) qscale[r] = s;
    const float inv = 1.0f / s;  // a power of two: exact
    const int ks_n = dim / 16, n = ks_n * IDX_MMA_NT * 32;
    for (int i = blockIdx.y * blockDim.x + tid; i < n; i += gridDim.y * blockDim.x) {
        const int lane = i & 31, nt = (i >> 5) % IDX_MMA_NT, ks = i / (32 * IDX_MMA_NT);
        const int g = lane >> 2, t = lane & 3, h = 4 * nt + g / 2, lo = g & 1;
        const int base = 64 * (ks / 4) + 16 * t + 4 * (ks % 4);
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (h < heads)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float x = qr[h * dim + base + j] * inv;
                const float hi = bf16 ? round_bf16(x) : f16lo_to_f32(pack_f16x2(x, 0.0f));
                v[j] = lo ? x - hi : hi;
            }
        frags[(long long)r * n + i] =
            bf16 ? make_uint2((u32)f2bf(v[0]) | ((u32)f2bf(v[1]) << 16), (u32)f2bf(v[2]) | ((u32)f2bf(v[3]) << 16))
                 : make_uint2(pack_f16x2(v[0], v[2]), pack_f16x2(v[1], v[3]));
    }
}

// A quad's partial scores of its two keys (rows g and g + 8) added over its four lanes;
// every lane ends with the sums.
__device__ __forceinline__ void idx_quad_sum2(float (&sc)[2]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        sc[h] += __shfl_xor_sync(0xffffffffu, sc[h], 1);
        sc[h] += __shfl_xor_sync(0xffffffffu, sc[h], 2);
    }
}

// grid (ceil(n_max / keys_per_block), rows), 256 threads; keys_per_block a multiple of 16.
// Dynamic shared memory: the row's q fragments (dim · 256 bytes) and 64 head weights.
// Entries past the row's visible count get -inf.
template <bool BF16>
__device__ void index_scores_mma_body(const uint2* frags, const float* qscale, const float* w, const u32* positions,
                                      const int* row_seq, const int* seqs, const u32* pages, const u8* page_base,
                                      float* scores, IndexGeom geo, int keys_per_block, float wscale) {
    pdl_begin();
    extern __shared__ __align__(16) unsigned char idx_smem[];
    const int ks_n = geo.dim / 16, nfrag = ks_n * IDX_MMA_NT * 32;
    uint2* bf = (uint2*)idx_smem;
    float* ws = (float*)(bf + nfrag);
    const int r = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    {
        const uint4* src = (const uint4*)(frags + (long long)r * nfrag);
        uint4* dst = (uint4*)bf;
        for (int i = tid; i < nfrag / 2; i += blockDim.x) dst[i] = src[i];
        // (Times wscale: the head weights' scale, one rounding as a `scale_f32` launch before
        // would have made; 1 when they come scaled.)
        for (int i = tid; i < 4 * IDX_MMA_NT; i += blockDim.x)
            ws[i] = i < geo.heads ? w[(long long)r * geo.heads + i] * wscale : 0.0f;
    }
    __syncthreads();
    const int n = (int)((positions[r] + 1) / (u32)geo.ratio);
    const int* seq = seqs + row_seq[r] * SEQ_STRIDE;
    const float qs = qscale[r];
    float* out = scores + (long long)r * geo.n_max;
    const int k0 = blockIdx.x * keys_per_block, k1 = min(k0 + keys_per_block, geo.n_max);
    for (int e0 = k0 + 16 * warp; e0 < k1; e0 += 16 * D2_WARPS) {
        // This thread's two keys (rows g and g + 8 of the m-tile).
        const u8* key[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int e = e0 + g + 8 * h;
            key[h] = nullptr;
            if (e < n) {
                const u32 page = pages[seq[SEQ_PAGE_OFF] + e / geo.per_page];
                key[h] = page_base + (BF16 ? 2 : 1) * ((long long)page * geo.page_elems + geo.page_off +
                                                       (long long)(e % geo.per_page) * geo.stride);
            }
        }
        float tot[IDX_MMA_NT][2];
#pragma unroll
        for (int nt = 0; nt < IDX_MMA_NT; nt++) tot[nt][0] = tot[nt][1] = 0.0f;
        for (int b = 0; b < geo.dim / FP8_BLOCK; b++) {
            // The thread's 16 dims of the block: 4 words (FP8) or 8 (bf16) a key.
            u32 wd[2][8];
            float f[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
                f[h] = 0.0f;
                if (key[h]) {
                    if (BF16) {
                        const uint4* p = (const uint4*)(key[h] + 2 * (FP8_BLOCK * b + 16 * t));
                        lo = p[0];
                        hi = p[1];
                        f[h] = 1.0f;
                    } else {
                        const u8* p = key[h] + FP8_BLOCK * b + 16 * t;
                        const uint2 a = *(const uint2*)p, c = *(const uint2*)(p + 8);
                        lo = make_uint4(a.x, a.y, c.x, c.y);
                        f[h] = ue8m0_scale(key[h][geo.dim + b]) * FP8_F16_SCALE;
                    }
                }
                wd[h][0] = lo.x;
                wd[h][1] = lo.y;
                wd[h][2] = lo.z;
                wd[h][3] = lo.w;
                wd[h][4] = hi.x;
                wd[h][5] = hi.y;
                wd[h][6] = hi.z;
                wd[h][7] = hi.w;
            }
            float acc[IDX_MMA_NT][4];
#pragma unroll
            for (int nt = 0; nt < IDX_MMA_NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
            for (int s = 0; s < 4; s++) {
                u32 a[4];
                if (BF16) {
                    a[0] = wd[0][2 * s];
                    a[1] = wd[1][2 * s];
                    a[2] = wd[0][2 * s + 1];
                    a[3] = wd[1][2 * s + 1];
                } else {
                    u32 p02a, p13a, p02b, p13b;
                    d2_fp8_pairs(wd[0][s], p02a, p13a);
                    d2_fp8_pairs(wd[1][s], p02b, p13b);
                    a[0] = p02a;
                    a[1] = p02b;
                    a[2] = p13a;
                    a[3] = p13b;
                }
                const uint2* bk = bf + (4 * b + s) * IDX_MMA_NT * 32 + lane;
#pragma unroll
                for (int nt = 0; nt < IDX_MMA_NT; nt++) {
                    const uint2 bb = bk[nt * 32];
                    if (BF16)
                        mma_bf16x(acc[nt], a, bb.x, bb.y);
                    else
                        mma_f16(acc[nt], a, bb.x, bb.y);
                }
            }
            // Columns 2t, 2t + 1 are head 4·nt + t's hi and lo halves.
#pragma unroll
            for (int nt = 0; nt < IDX_MMA_NT; nt++) {
                tot[nt][0] = fmaf(acc[nt][0] + acc[nt][1], f[0], tot[nt][0]);
                tot[nt][1] = fmaf(acc[nt][2] + acc[nt][3], f[1], tot[nt][1]);
            }
        }
        float sc[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < IDX_MMA_NT; nt++) {
            const float wh = ws[4 * nt + t];
            sc[0] = fmaf(wh, fmaxf(tot[nt][0], 0.0f), sc[0]);
            sc[1] = fmaf(wh, fmaxf(tot[nt][1], 0.0f), sc[1]);
        }
        idx_quad_sum2(sc);
        if (t == 0)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int e = e0 + g + 8 * h;
                if (e < k1) out[e] = e < n ? sc[h] * qs : NEG_INF;
            }
    }
}

extern "C" __global__ void __launch_bounds__(256)
    index_scores_mma(const uint2* frags, const float* qscale, const float* w, const u32* positions, const int* row_seq,
                     const int* seqs, const u32* pages, const u8* page_base, float* scores, IndexGeom geo,
                     int keys_per_block, float wscale) {
    index_scores_mma_body<false>(frags, qscale, w, positions, row_seq, seqs, pages, page_base, scores, geo,
                                 keys_per_block, wscale);
}

extern "C" __global__ void __launch_bounds__(256)
    index_scores_mma_bf16(const uint2* frags, const float* qscale, const float* w, const u32* positions,
                          const int* row_seq, const int* seqs, const u32* pages, const u8* page_base, float* scores,
                          IndexGeom geo, int keys_per_block, float wscale) {
    index_scores_mma_body<true>(frags, qscale, w, positions, row_seq, seqs, pages, page_base, scores, geo,
                                keys_per_block, wscale);
}
