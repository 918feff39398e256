// Lightning-indexer scores of prefill-sized batches on Hopper's warpgroup instruction
// (wgmma, sm_90a) for V4's indexer (64 heads × 128 dims): indexer_wg.rs says when they run,
// docs/perf.md ("The indexer's prefill scores on `wgmma`") why.
//
// Why: `index_scores_mma` (indexer_mma.cu) is a block a query row; each warp takes 16
// keys as mma.sync's A and reads q's B fragments from shared memory, one 8-byte load a
// product, and every row converts and loads its keys again. An 8K prefill's CSA layer
// took ~2.2 ms in it, ~7% of the tensor cores' rate. Here the keys stay put and the rows
// stream past them:
// - A block is 256 keys of one sequence (four warpgroups, 64 keys each: wgmma's M) and a
//   run of that sequence's rows. A warpgroup converts its keys to bf16 once (FP8 codes
//   times their block's scale: exact), into registers in the A-fragment layout, and keeps
//   them for all the rows (reloaded only where the run reaches another sequence).
// - Each row's q comes as a ready shared-memory image (`index_q_tile`, 32 KiB: B of
//   wgmma, 128 columns = 64 heads × q's bf16 hi and lo halves, K-major, 128-byte
//   swizzle) by `cp.async`, the next row's while this one multiplies.
// - A row is 8 `m64n128k16` a warpgroup (`fw_mma`, A from registers); a thread's sums are 2 keys ×
//   16 heads × (hi, lo); the score Σ_h w_h · relu(hi + lo) is summed over its heads and
//   then over the quad's 4 lanes.
// Numbers: keys exact, q as hi + lo (~16 significant bits, as `index_scores_mma_bf16`),
// f32 sums in the tensor cores' order: scores differ from the CPU's in the last bits, and
// selections only where two scores are that close (the parity suite checks the picks).
//
// Dims order: k-step s (16 dims) of 64-dim block b covers dims 64b + 16t + 4(s % 4) + j
// for the quad's lane t: a lane's A words hold key dims (…+0, +1) as k = (2t, 2t + 1) and
// (…+2, +3) as k = (2t + 8, 2t + 9), so a lane reads 16 contiguous dims of its key a
// block. `index_q_tile` writes q's columns in that same order.

#define IW_WGS 4                         // warpgroups a block
#define IW_KEYS (IW_WGS * 64)            // keys a block
#define IW_THREADS (IW_WGS * 128)
#define IW_COLS 128                      // B's N: 64 heads × (hi, lo)
#define IW_PLANE (IW_COLS * 128)         // 64 dims of every column, bf16: 16 KiB
#define IW_TILE (2 * IW_PLANE)           // a row's q: 32 KiB
#define IW_DYN_SMEM (1024 + 2 * IW_TILE)

// Row r's q (heads × 128 dims, f32; rotated at the row's position first when `positions`
// is given, as index_q_frags does) as the shared-memory image of `index_scores_wg`'s B:
// plane b (dims 64b..64b+63), column n = 2h + half (h's bf16 hi, then lo = q − hi), the
// column's 128 bytes in 16-byte pieces, piece c at c ^ (n % 8). Piece c holds positions
// 8c..8c+7 of the plane: k-step s = c / 2, k = 8(c % 2) + i. Heads past `heads` are zero.
// A block of 256 threads a row.
extern "C" __global__ void __launch_bounds__(256) index_q_tile(const float* q, u16* tiles, int heads,
                                                               const u32* positions, RopeParams p) {
    pdl_begin();
    __shared__ float q_sh[64 * 128];
    const int r = blockIdx.x, tid = threadIdx.x;
    const float* qg = q + (long long)r * heads * 128;
    const float pos = positions ? (float)positions[r] : 0.0f;
    const int r0 = 128 - 2 * p.pairs;
    // The rotation's cos and sin (times the attention factor) of each pair, once a row: the
    // angle depends on the position and the pair alone, and every head's pair took its own
    // sincosf (16 M of them an 8K prefill's layer). rope_pair's arithmetic, in its order.
    __shared__ float2 rot[64];
    if (positions && tid < p.pairs) {
        float sn, cs;
        sincosf(pos * p.inv_freq[tid], &sn, &cs);
        rot[tid] = make_float2(cs * p.attention_factor, sn * p.attention_factor);
    }
    // A row's 32 KiB in 16-byte loads, all of a thread's issued before any is used (2-value
    // loads, one at a time around the rotation, ran at ~60% of the copy rate).
    float4 v[8];
#pragma unroll
    for (int u = 0; u < 8; u++) {
        const int i = tid + 256 * u;
        v[u] = i < heads * 32 ? reinterpret_cast<const float4*>(qg)[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __syncthreads();
    auto rotate = [&](float& a, float& b, int pair) {
        const float2 r = rot[pair], x = make_float2(a, b);
        a = x.x * r.x - x.y * r.y;
        b = x.y * r.x + x.x * r.y;
    };
#pragma unroll
    for (int u = 0; u < 8; u++) {
        const int i = tid + 256 * u, d0 = (4 * i) & 127;
        if (positions && i < heads * 32) {
            if (d0 >= r0) rotate(v[u].x, v[u].y, (d0 - r0) >> 1);
            if (d0 + 2 >= r0) rotate(v[u].z, v[u].w, (d0 + 2 - r0) >> 1);
        }
        reinterpret_cast<float4*>(q_sh)[i] = v[u];
    }
    __syncthreads();
    u8* out = (u8*)(tiles + (long long)r * (IW_TILE / 2));
    // 2 planes × 128 columns × 8 pieces.
    for (int i = tid; i < 2 * IW_COLS * 8; i += 256) {
        const int c = i & 7, n = (i >> 3) & (IW_COLS - 1), b = i >> 10;
        const int h = n >> 1, lo = n & 1, s = c >> 1, half = c & 1;
        const float* qh = q_sh + h * 128 + 64 * b + 4 * s + 2 * half;
        float v[8];
#pragma unroll
        for (int t = 0; t < 4; t++) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const float x = qh[16 * t + j];
                const float hi = round_bf16(x);
                v[2 * t + j] = lo ? x - hi : x;
            }
        }
        const uint4 w = make_uint4(bf16x2_rn(v[0], v[1]), bf16x2_rn(v[2], v[3]), bf16x2_rn(v[4], v[5]),
                                   bf16x2_rn(v[6], v[7]));
        *(uint4*)(out + b * IW_PLANE + n * 128 + ((c ^ (n & 7)) << 4)) = w;
    }
}

// This thread's A fragments (8 k-steps × 4 words) of keys e (rows g) and e + 8 (rows g + 8):
// dims 64b + 16t .. + 15 of each, bf16 (FP8 codes times their block's scale); keys at or
// past `n` are zero.
__device__ __forceinline__ void iw_keys(u32 (&a)[8][4], int e, int n, const int* seq, const u32* pages,
                                        const u8* page_base, const IndexGeom& geo, int t, bool bf16) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int ee = e + 8 * h;
        const u8* key = nullptr;
        if (ee < n) {
            const u32 page = pages[seq[SEQ_PAGE_OFF] + ee / geo.per_page];
            key = page_base + (bf16 ? 2 : 1) * ((long long)page * geo.page_elems + geo.page_off +
                                                (long long)(ee % geo.per_page) * geo.stride);
        }
#pragma unroll
        for (int b = 0; b < 2; b++) {
            u32 w[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};  // bf16 pairs: dims 16t + 2i, + 1
            if (key && bf16) {
                const uint4* src = (const uint4*)(key + 2 * (64 * b + 16 * t));
                const uint4 x = src[0], y = src[1];
                w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w, w[4] = y.x, w[5] = y.y, w[6] = y.z, w[7] = y.w;
            } else if (key) {
                // (FP8 entries are 8-byte aligned: a stride of 136 bytes for 128 dims.)
                const uint2 x = *(const uint2*)(key + 64 * b + 16 * t), y = *(const uint2*)(key + 64 * b + 16 * t + 8);
                const float f = ue8m0_scale(key[geo.dim + b]);
                const u32 words[4] = {x.x, x.y, y.x, y.y};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const u32 c = words[i];
                    w[2 * i] = bf16x2_rn(fp8_to_f32(c & 0xffu) * f, fp8_to_f32((c >> 8) & 0xffu) * f);
                    w[2 * i + 1] = bf16x2_rn(fp8_to_f32((c >> 16) & 0xffu) * f, fp8_to_f32(c >> 24) * f);
                }
            }
            // k-step 4b + s: dims 16t + 4s + (0, 1) → a[h] (k 2t, 2t + 1), + (2, 3) → a[2 + h].
#pragma unroll
            for (int s = 0; s < 4; s++) {
                a[4 * b + s][h] = w[2 * s];
                a[4 * b + s][2 + h] = w[2 * s + 1];
            }
        }
    }
}

// Row r's q image into `dst` (all threads: 32 KiB, 64 bytes each), one commit group.
__device__ __forceinline__ void iw_fetch(u32 dst, const u16* tiles, int r) {
    const u8* src = (const u8*)(tiles + (long long)r * (IW_TILE / 2));
#pragma unroll
    for (int i = 0; i < IW_TILE / 16 / IW_THREADS; i++) {
        const int piece = threadIdx.x + IW_THREADS * i;
        cp_async<16>(dst + 16 * piece, src + 16 * piece);
    }
}

// Scores of keys [256·blockIdx.x, +256) for rows [blockIdx.y·rows_per_block, +rows_per_block)
// (in `scores`, n_max a row; keys a row does not see get -inf).
extern "C" __global__ void __launch_bounds__(IW_THREADS, 1)
    index_scores_wg(const u16* tiles, const float* w, const u32* positions, const int* row_seq, const int* seqs,
                    const u32* pages, const u8* page_base, float* scores, IndexGeom geo, int rows,
                    int rows_per_block, float wscale) {
    pdl_begin();
    extern __shared__ __align__(16) u8 iw_raw[];
    __shared__ float ws[2][64];
    const u32 base = (smem_addr(iw_raw) + 1023u) & ~1023u;  // 128-byte swizzle: 1 KiB aligned
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int k0 = blockIdx.x * IW_KEYS, kw = k0 + 64 * wg, e = kw + 16 * warp + g;
    const int r0 = blockIdx.y * rows_per_block, r1 = min(rows, r0 + rows_per_block);
    if (r0 >= r1) return;
    const bool bf16 = geo.dtype == DTYPE_BF16;
    const int kend = min(k0 + IW_KEYS, geo.n_max);
    // Whether row r sees a key of this block's tile. A prefill's rows see keys up to their
    // position / ratio, so about half the (tile, rows) blocks are the causal triangle's
    // other side: such a block only writes -inf, and elsewhere the rows that see none of
    // the tile are not fetched (each row's q image is 32 KiB: an 8K prefill's blocks read
    // ~2 GB of them a CSA layer, half for rows that multiply nothing).
    auto visible = [&](int r) { return (int)((positions[r] + 1) / (u32)geo.ratio); };  // keys row r sees
    auto sees = [&](int r) { return k0 < visible(r); };
    // (A thread a row: rows_per_block is at most 64, indexer_wg.rs::block_rows.)
    if (!__syncthreads_or(r0 + tid < r1 && sees(r0 + tid))) {
        for (int r = r0; r < r1; r++)
            for (int ee = k0 + tid; ee < kend; ee += IW_THREADS) scores[(long long)r * geo.n_max + ee] = NEG_INF;
        return;
    }

    u32 a[8][4];
    int cur_seq = -1;
    if (sees(r0)) iw_fetch(base, tiles, r0);
    cp_async_commit();
    if (r0 + 1 < r1 && sees(r0 + 1)) iw_fetch(base + IW_TILE, tiles, r0 + 1);
    cp_async_commit();
    for (int r = r0; r < r1; r++) {
        const int buf = (r - r0) & 1;
        const int n = visible(r);
        const int sq = row_seq[r];
        if (sq != cur_seq && k0 < n) {
            // The keys this run of the sequence sees: up to its last row in the block's rows.
            int hi = n;
            for (int rr = r + 1; rr < r1 && row_seq[rr] == sq; rr++)
                hi = max(hi, visible(rr));
            iw_keys(a, e, hi, seqs + sq * SEQ_STRIDE, pages, page_base, geo, t, bf16);
            cur_seq = sq;
        }
        if (tid < 64) ws[buf][tid] = tid < geo.heads ? w[(long long)r * geo.heads + tid] * wscale : 0.0f;
        cp_async_wait<1>();  // this row's image (the next one's may still be in flight)
        wg_proxy_fence();
        __syncthreads();
        const bool live = kw < n;  // uniform over the warpgroup
        float d[64];
        if (live) {
            const u32 tile = base + buf * IW_TILE;
            wg_fence();
#pragma unroll
            for (int s = 0; s < 8; s++) fw_mma(d, a[s], wg_desc(tile + (s >> 2) * IW_PLANE + (s & 3) * 32, 16, 1024, 1), s > 0);
            wg_commit();
            wg_wait<0>();
            wm_hold(d);
        }
        __syncthreads();  // every warpgroup is done with this buffer: the row after next may land in it
        if (r + 2 < r1 && sees(r + 2)) iw_fetch(base + buf * IW_TILE, tiles, r + 2);
        cp_async_commit();
        float* out = scores + (long long)r * geo.n_max;
        if (live) {
            // d[4j + i]: key g (i < 2) or g + 8, column 8j + 2t + (i & 1) = head 4j + t, hi or lo.
            float sc[2] = {0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const float wh = ws[buf][4 * j + t];
                sc[0] = fmaf(wh, fmaxf(d[4 * j] + d[4 * j + 1], 0.0f), sc[0]);
                sc[1] = fmaf(wh, fmaxf(d[4 * j + 2] + d[4 * j + 3], 0.0f), sc[1]);
            }
            idx_quad_sum2(sc);
            if (t == 0)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int ee = e + 8 * h;
                    if (ee < kend) out[ee] = ee < n ? sc[h] : NEG_INF;
                }
        } else {
            for (int ee = kw + (tid & 127); ee < min(kw + 64, kend); ee += 128) out[ee] = NEG_INF;
        }
    }
}
