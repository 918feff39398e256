// Tensor-core attention for prefill-sized batches over bf16 or fp8 KV entries
// (attention.cu defines AttnGeom, key_source and the SIMT kernel that decode and f32 KV
// use).
//
// The SIMT kernel spends ~90% of an 8K prefill's attention time on one-warp-per-head dot
// products in f32. Here both products run on the tensor cores (mma.sync m16n8k16, bf16
// in, f32 accumulate): a block takes one row and 32 heads; its 16 warps are 2 head groups
// (the mma's 16 rows) × 8 dim groups (head_dim / 8 dims each). Sixteen warps of ~128
// registers rather than eight of ~240: the work between a tile's barriers is short chains
// of dependent mmas, shared-memory loads and exps, and twice the warps hide twice the
// latency. Keys are exact in bf16 (pages and rings store bf16, or fp8 codes times a
// power-of-two scale, which bf16 holds exactly and which the tile load converts; this
// step's new_kv was rounded to the entry dtype before attention), and the f32 operands (q
// and the softmax weights) are split into two bf16 halves, x ≈ hi + lo, multiplied
// separately into the same f32 accumulator: ~16 mantissa bits, so results stay within
// f32-summation-order distance of the SIMT kernel. With `one_part`
// (`SLUICE_CUDA_BF16_ACTIVATIONS=bf16`) only the hi halves are multiplied: q and the
// weights rounded once to bf16, as the reference model's bf16 attention has them, and
// half the products.
//
// Per tile of 32 keys: load keys to shared memory (double-buffered), each warp computes
// its dim group's partial logits [16 heads × 32 keys], the partials are summed in a fixed
// order and the online softmax runs with 16 threads per head (two keys each), then each
// warp rescales its output accumulator [16 heads × head_dim/8] and adds P·V. A tile's
// three barriers, partial-logit sums and softmax reductions are paid once per 32 keys.
// Prefill-sized batches take one block per (row, 32 heads); decode batches also split the
// key axis over blockIdx.y (a row's 64 heads are only 2 blocks) and leave (unnormalised
// output, max, sum) per split in `part`, in the SIMT kernel's layout, for
// `attention_merge`, which adds them in split order: results do not depend on scheduling
// either way.

#define TC_KEYS 32
#define TC_KSTRIDE (ATT_HD_MAX + 8)  // bf16 per key row: the pad spreads rows over banks
#define TC_HEADS 32
#define TC_PSTRIDE (TC_KEYS + 8)
#define TC_DGROUPS 8
#define TC_THREADS (32 * 2 * TC_DGROUPS)
#define TC_KSTEPS_MAX (ATT_HD_MAX / TC_DGROUPS / 16)
#define TC_NTILES_MAX (ATT_HD_MAX / TC_DGROUPS / 8)

__device__ __forceinline__ u32 pack_bf16x2(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }

// A thread's share of one tile's keys: 16 threads a key (thread t takes key t / 16), each
// its 16-byte pieces t % 16, t % 16 + 16, … of the key's head_dim / 8 (head_dim ≤ 512: at
// most 4). No division by the run-time piece count.
#define TC_KEY_THREADS (TC_THREADS / TC_KEYS)
#define TC_PIECES (ATT_HD_MAX / 8 / TC_KEY_THREADS)

// One 16-byte piece of a key tile as fetched from global memory, before its conversion
// to bf16. A tile's pieces are fetched while the tile before it is multiplied: with one
// block an SM nothing else would hide the loads' latency between two barriers.
// f32 new entries (decode rows: one a row) are converted when fetched, so a piece is 16
// bytes of registers and four fit a thread's budget.
struct KeyPiece {
    uint4 a;  // bf16: 8 values; fp8 entry: codes in a.x, a.y, the ue8m0 scale byte in a.z
    int how;  // PIECE_*
};
#define PIECE_NONE 0
#define PIECE_BF16 2
#define PIECE_FP8 3

// Where keys live is worked out for TC_GROUP_TILES tiles at a time, a thread a key
// (`key_source`: the selection, the page table, the ring slot), one group ahead of the
// tiles that fetch them; a tile's fetch then reads its key's place from shared memory.
// Per tile and warp that is a shared-memory load instead of the whole chain.
#define TC_GROUP_TILES 8
#define TC_GROUP_KEYS (TC_GROUP_TILES * TC_KEYS)

// Issue the loads of this thread's pieces of its key (kind and offset from key_source;
// kind < 0: no key); returns whether the key exists.
__device__ __forceinline__ bool fetch_tile(KeyPiece (&p)[TC_PIECES], const AttnGeom& g, int kind, long long off,
                                           const float* new_kv, const u8* rings, const u8* page_base) {
    const int chunks = g.hd >> 3, c0 = threadIdx.x % TC_KEY_THREADS;
#pragma unroll
    for (int u = 0; u < TC_PIECES; u++) p[u].how = PIECE_NONE;
    if (kind < 0) return false;
    if (kind == 0 && !g.new_bf16) {
#pragma unroll
        for (int u = 0; u < TC_PIECES; u++) {
            const int c = c0 + TC_KEY_THREADS * u;
            if (c >= chunks) continue;
            const uint4 a = *(const uint4*)(new_kv + off + c * 8), b = *(const uint4*)(new_kv + off + c * 8 + 4);
            p[u].a = make_uint4(pack_bf16x2(f2bf(__uint_as_float(a.x)), f2bf(__uint_as_float(a.y))),
                                pack_bf16x2(f2bf(__uint_as_float(a.z)), f2bf(__uint_as_float(a.w))),
                                pack_bf16x2(f2bf(__uint_as_float(b.x)), f2bf(__uint_as_float(b.y))),
                                pack_bf16x2(f2bf(__uint_as_float(b.z)), f2bf(__uint_as_float(b.w))));
            p[u].how = PIECE_BF16;
        }
        return true;
    }
    const u8* base = kind == 0 ? (const u8*)new_kv : kind == 1 ? rings : page_base;
    if (kind == 0 || g.dtype == DTYPE_BF16) {  // bf16 values: new entries passed as bf16, or bf16 entries
        const u16* src = (const u16*)base + off;
#pragma unroll
        for (int u = 0; u < TC_PIECES; u++) {
            const int c = c0 + TC_KEY_THREADS * u;
            if (c >= chunks) continue;
            p[u].a = *(const uint4*)(src + c * 8);
            p[u].how = PIECE_BF16;
        }
        return true;
    }
    // FP8 record: n8 codes, then the BF16 tail, then one scale code per FP8_BLOCK. d0, n8
    // and the tail are multiples of 8 (use_mma checks), so a piece is all codes or all
    // tail, and every load is 8-byte aligned (records are).
    const u8* e = base + off;
    const int n8 = g.hd - g.tail;
#pragma unroll
    for (int u = 0; u < TC_PIECES; u++) {
        const int c = c0 + TC_KEY_THREADS * u, d0 = c * 8;
        if (c >= chunks) continue;
        if (d0 >= n8) {
            const u8* tl = e + n8 + 2 * (d0 - n8);
            const uint2 x = *(const uint2*)tl, y = *(const uint2*)(tl + 8);
            p[u].a = make_uint4(x.x, x.y, y.x, y.y);
            p[u].how = PIECE_BF16;
        } else {
            // The block's scale byte goes to a.z as loaded: folded into `how` here, it
            // made the fetch wait for the load (Nsight Compute: the stalls of a whole
            // tile's fetch on one byte), where the point is to leave it in flight.
            const uint2 x = *(const uint2*)(e + d0);
            p[u].a = make_uint4(x.x, x.y, (u32)e[n8 + 2 * g.tail + d0 / FP8_BLOCK], 0u);
            p[u].how = PIECE_FP8;
        }
    }
    return true;
}

// The block scales whose codes `e4m3x2_bf16` converts exactly: the multiplier 2^(code - 7)
// must be a bf16 normal (code ≤ 134) and so must the smallest code times the scale, 2^-9 ·
// 2^(code - 127) (code ≥ 11). KV scales are a 64-dim block's amax / 448 rounded up to a
// power of two, so this is every block whose amax lies in (448 · 2^-117, 448 · 2^7]; the
// others take the f32 conversion (the same bits: both are exact).
#define TC_FAST_SCALE_MIN 11u
#define TC_FAST_SCALE_MAX 134u

// Eight fp8 codes (x, y: low byte first) times the block scale 2^(code - 127) as bf16,
// through f32: the route for scales outside TC_FAST_SCALE_MIN..MAX.
__device__ __forceinline__ uint4 fp8x8_bf16_wide(u32 x, u32 y, u32 code) {
    const float s = ue8m0_scale(code);
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const u32 word = (j < 2 ? x : y) >> (16 * (j & 1));
        w[j] = pack_bf16x2(f2bf(fp8_to_f32(word & 0xffu) * s), f2bf(fp8_to_f32((word >> 8) & 0xffu) * s));
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Convert this thread's fetched pieces to bf16 (exactly: an fp8 code times a power of two
// needs 4 significant bits) into the tile buffer; missing keys (past the end, unselected)
// become 0. The conversion was half the kernel's instructions with fp8_to_f32 per code
// (Nsight Compute's SASS profile of an 8K prefill: ALU the busiest pipe at 44%).
__device__ __forceinline__ void store_tile(const KeyPiece (&p)[TC_PIECES], u16* kb, int hd) {
    const int chunks = hd >> 3, kk = threadIdx.x / TC_KEY_THREADS, c0 = threadIdx.x % TC_KEY_THREADS;
#pragma unroll
    for (int u = 0; u < TC_PIECES; u++) {
        const int c = c0 + TC_KEY_THREADS * u;
        if (c >= chunks) continue;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        const int how = p[u].how;
        if (how == PIECE_BF16) {
            v = p[u].a;
        } else if (how == PIECE_FP8) {
            const u32 code = p[u].a.z;
            if (code >= TC_FAST_SCALE_MIN && code <= TC_FAST_SCALE_MAX) {
                // 2^(code - 127) · 2^120 as bf16 in both halves.
                const u32 e = (code + 120u) << 7, f = e | (e << 16);
                v = make_uint4(e4m3x2_bf16(p[u].a.x, 0, f), e4m3x2_bf16(p[u].a.x, 1, f), e4m3x2_bf16(p[u].a.y, 0, f),
                               e4m3x2_bf16(p[u].a.y, 1, f));
            } else {
                v = fp8x8_bf16_wide(p[u].a.x, p[u].a.y, code);
            }
        }
        *(uint4*)(kb + kk * TC_KSTRIDE + c * 8) = v;
    }
}

// Four 8×8 bf16 matrices from shared memory, transposed: lane l names row l % 8 of
// matrix l / 8 and receives, per matrix, (row 2·(l % 4), column l / 4) and the row after —
// the B fragment of an m16n8k16 product whose k runs along the rows (keys).
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const u16* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// (a, b) ≈ (hi + lo) per element, both halves packed as bf16 pairs.
__device__ __forceinline__ void split_pair(float a, float b, u32* hi, u32* lo) {
    const u16 ah = f2bf(a), bh = f2bf(b);
    *hi = pack_bf16x2(ah, bh);
    *lo = pack_bf16x2(f2bf(a - bf2f(ah)), f2bf(b - bf2f(bh)));
}

// c[16×8] += a[16×16] · b[16×8], bf16 operands, f32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// Where key `key` of head row `h` lies in a row of the partial logits `sp`: bits 3-4 of
// the key flipped by the row's h % 4. A warp stores its [16 heads × 32 keys] partials as
// float2s whose lanes' rows are 32 floats apart; unswizzled, the rows of a half-warp's four
// heads fall on the same 8 banks (4-way conflicts, 8-way with scalar stores, on every
// store of every warp a tile), swizzled on four different 8-bank groups. Pairs (key, key
// + 1), key even, stay adjacent.
__device__ __forceinline__ int tc_sp_key(int h, int key) { return key ^ ((h & 3) << 3); }

// Dynamic shared memory: the two key tiles.
#define TC_DYN_SMEM (2 * TC_KEYS * TC_KSTRIDE * 2)

// grid (ceil(heads / 32), splits, rows), TC_THREADS threads, TC_DYN_SMEM bytes of dynamic
// shared memory. Requires bf16 or fp8 entries, head_dim a multiple of 128 (≤ 512) and
// aligned entry offsets (checked by the launcher).
extern "C" __global__ void __launch_bounds__(TC_THREADS, 1)
    attention_mma(const float* q, const float* new_kv, const u8* rings, const u8* page_base, const u32* pages,
                  const int* sel, const float* sinks, const u32* positions, const int* row_seq, const int* seqs,
                  float* out, float* part, AttnGeom g,
              RopeParams /* attention_wg's rotations; unused here: one launch for the three kernels */) {
    pdl_begin();
    extern __shared__ __align__(16) u16 tc_keys[];  // [2][TC_KEYS * TC_KSTRIDE]
    __shared__ float sp[TC_DGROUPS][TC_HEADS][TC_KEYS];
    __shared__ __align__(16) u16 ph[2][TC_HEADS * TC_PSTRIDE];
    __shared__ float corr_s[TC_HEADS], m_s[TC_HEADS], s_s[TC_HEADS];
    __shared__ int key_ok[TC_KEYS];  // the tile's keys that exist (read by the softmax)
    __shared__ long long src_off[2][TC_GROUP_KEYS];  // key places of two tile groups
    __shared__ int src_kind[2][TC_GROUP_KEYS];

    const int r = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gid = lane >> 2, tig = lane & 3;
    const int hg = warp / TC_DGROUPS, dg = warp % TC_DGROUPS;
    const int h_base = blockIdx.x * TC_HEADS;
    const int dw = g.hd / TC_DGROUPS, nk = dw >> 4, nn = dw >> 3;
    const int d_base = dg * dw;
    const AttnRow row = attn_row(g, r, blockIdx.y, positions, row_seq, seqs, sel);
    const int t = row.t, n_win = row.n_win, j0 = row.j0, j1 = row.j1;
    const int *seq = row.seq, *sel_row = row.sel_row;

    // Where key j of this split lives (kind -1: past the split, or not selected).
    auto place = [&](int j, long long* off) {
        *off = 0;
        return j < j1 ? key_source(g, j, t, n_win, seq, pages, sel_row, off) : -1;
    };
    // The first group's key places, then the first tile's fetch.
    int next_kind = -1;  // a key of the next group (threads < TC_GROUP_KEYS), stored a tile later
    long long next_off = 0;
    if (threadIdx.x < TC_GROUP_KEYS) {
        long long off;
        src_kind[0][threadIdx.x] = place(j0 + threadIdx.x, &off);
        src_off[0][threadIdx.x] = off;
    }
    __syncthreads();
    KeyPiece pc[TC_PIECES];
    const int kk = threadIdx.x / TC_KEY_THREADS;
    bool ok = false;
    if (j0 < j1) ok = fetch_tile(pc, g, src_kind[0][kk], src_off[0][kk], new_kv, rings, page_base);

    // This warp's q fragments (rows: heads gid and gid + 8 of its group; columns: its dims).
    u32 qh[TC_KSTEPS_MAX][4], ql[TC_KSTEPS_MAX][4];
    {
        const int ha = h_base + hg * 16 + gid, hb = ha + 8;
        const float* qa = q + ((long long)r * g.heads + ha) * g.hd + d_base + 2 * tig;
        const float* qb = q + ((long long)r * g.heads + hb) * g.hd + d_base + 2 * tig;
#pragma unroll
        for (int k = 0; k < TC_KSTEPS_MAX; k++) {
            if (k < nk) {
                const float2 z = make_float2(0.0f, 0.0f);
                const float2 a0 = ha < g.heads ? *(const float2*)(qa + 16 * k) : z;
                const float2 b0 = hb < g.heads ? *(const float2*)(qb + 16 * k) : z;
                const float2 a1 = ha < g.heads ? *(const float2*)(qa + 16 * k + 8) : z;
                const float2 b1 = hb < g.heads ? *(const float2*)(qb + 16 * k + 8) : z;
                split_pair(a0.x, a0.y, &qh[k][0], &ql[k][0]);
                split_pair(b0.x, b0.y, &qh[k][1], &ql[k][1]);
                split_pair(a1.x, a1.y, &qh[k][2], &ql[k][2]);
                split_pair(b1.x, b1.y, &qh[k][3], &ql[k][3]);
            }
        }
    }
    float acc[TC_NTILES_MAX][4];
#pragma unroll
    for (int i = 0; i < TC_NTILES_MAX; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    // Softmax state: 16 threads per head, two keys of each tile per thread.
    const int sh = threadIdx.x >> 4, sk = threadIdx.x & 15;
    float m_run = NEG_INF, s_run = 0.0f;

    for (int jt = j0, tile = 0; jt < j1; jt += TC_KEYS, tile++) {
        u16* kb = tc_keys + (tile & 1) * (TC_KEYS * TC_KSTRIDE);
        const int group = tile / TC_GROUP_TILES, in_group = tile % TC_GROUP_TILES;
        // 1. The fetched keys into shared memory as bf16 (and the next group's key places,
        //    looked up a tile ago), then the next tile's fetch, whose loads are in flight
        //    while this tile is multiplied.
        store_tile(pc, kb, g.hd);
        if (threadIdx.x % TC_KEY_THREADS == 0) key_ok[kk] = ok;
        if (in_group == 1 && threadIdx.x < TC_GROUP_KEYS) {
            src_kind[(group + 1) & 1][threadIdx.x] = next_kind;
            src_off[(group + 1) & 1][threadIdx.x] = next_off;
        }
        __syncthreads();
        if (jt + TC_KEYS < j1) {
            const int next = tile + 1, slot = (next / TC_GROUP_TILES) & 1;
            const int i = (next % TC_GROUP_TILES) * TC_KEYS + kk;
            ok = fetch_tile(pc, g, src_kind[slot][i], src_off[slot][i], new_kv, rings, page_base);
        }
        // The next group's key places: their loads are in flight until the next tile.
        if (in_group == 0 && threadIdx.x < TC_GROUP_KEYS) next_kind = place(jt + TC_GROUP_KEYS + threadIdx.x, &next_off);

        // 2. Partial logits over this warp's dims: [16 heads × 32 keys]. One ldmatrix gives
        //    a k-step's B fragments for two 8-key blocks (lane l names key l % 8 + 8·(l / 16)
        //    of the pair, dims +8·((l / 8) % 2)); four blocks are four independent chains.
        {
            float sc[4][4];
#pragma unroll
            for (int n8 = 0; n8 < 4; n8++) sc[n8][0] = sc[n8][1] = sc[n8][2] = sc[n8][3] = 0.0f;
            const u16* kl = kb + ((lane & 7) + 8 * (lane >> 4)) * TC_KSTRIDE + d_base + 8 * ((lane >> 3) & 1);
#pragma unroll
            for (int k = 0; k < TC_KSTEPS_MAX; k++) {
                if (k < nk) {
#pragma unroll
                    for (int pair = 0; pair < 2; pair++) {
                        u32 b[4];
                        ldmatrix_x4(b, kl + 16 * TC_KSTRIDE * pair + 16 * k);
                        mma_bf16_16816(sc[2 * pair], qh[k], b[0], b[1]);
                        mma_bf16_16816(sc[2 * pair + 1], qh[k], b[2], b[3]);
                        if (!g.one_part) {
                            mma_bf16_16816(sc[2 * pair], ql[k], b[0], b[1]);
                            mma_bf16_16816(sc[2 * pair + 1], ql[k], b[2], b[3]);
                        }
                    }
                }
            }
            const int ha = hg * 16 + gid;
#pragma unroll
            for (int n8 = 0; n8 < 4; n8++) {
                const int key = tc_sp_key(ha, n8 * 8 + 2 * tig);  // ha + 8: the same swizzle
                *(float2*)&sp[dg][ha][key] = make_float2(sc[n8][0], sc[n8][1]);
                *(float2*)&sp[dg][ha + 8][key] = make_float2(sc[n8][2], sc[n8][3]);
            }
        }
        __syncthreads();

        // 3. Online softmax per head (16 threads a head, keys sk and sk + 16 each); the
        //    weights go to shared memory as bf16 halves.
        {
            // Odd heads take their keys in the other order, so that a warp's two heads
            // read other banks (with tc_sp_key's swizzle: none shared).
            float l[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int kk2 = sk + 16 * (e ^ (sh & 1)), at = tc_sp_key(sh, kk2);
                float v = sp[0][sh][at];
#pragma unroll
                for (int w = 1; w < TC_DGROUPS; w++) v += sp[w][sh][at];
                l[e] = key_ok[kk2] ? v * g.scale : NEG_INF;
            }
            float mt = fmaxf(l[0], l[1]);
#pragma unroll
            for (int x = 1; x < 16; x <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, x));
            const float m_new = fmaxf(m_run, mt);
            float c = 1.0f, p0 = 0.0f, p1 = 0.0f;
            if (m_new != NEG_INF) {
                c = expf(m_run - m_new);
                p0 = expf(l[0] - m_new);
                p1 = expf(l[1] - m_new);
            }
            s_run = s_run * c + (p0 + p1);
            m_run = m_new;
            const u16 h0 = f2bf(p0), h1 = f2bf(p1);
            const int k0 = sh * TC_PSTRIDE + sk + 16 * (sh & 1), k1 = sh * TC_PSTRIDE + sk + 16 * (~sh & 1);
            ph[0][k0] = h0;
            ph[1][k0] = f2bf(p0 - bf2f(h0));
            ph[0][k1] = h1;
            ph[1][k1] = f2bf(p1 - bf2f(h1));
            if (sk == 0) corr_s[sh] = c;
        }
        __syncthreads();

        // 4. Rescale this warp's output rows and add P·V over its dims.
        {
            const int ha = hg * 16 + gid;
            const float ca = corr_s[ha], cb = corr_s[ha + 8];
            // Once a head's running maximum settles its correction is exactly 1: the
            // rescale is skipped when no head of the warp's 16 needs it.
            const bool rescale = __any_sync(0xffffffffu, ca != 1.0f || cb != 1.0f);
            // P's A fragments for the tile's two 16-key steps, hi and lo halves.
            u32 pah[2][4], pal[2][4];
#pragma unroll
            for (int ks = 0; ks < 2; ks++) {
                const u16* p0 = ph[0] + ha * TC_PSTRIDE + 16 * ks + 2 * tig;
                const u16* p1 = ph[1] + ha * TC_PSTRIDE + 16 * ks + 2 * tig;
                pah[ks][0] = *(const u32*)p0;
                pah[ks][1] = *(const u32*)(p0 + 8 * TC_PSTRIDE);
                pah[ks][2] = *(const u32*)(p0 + 8);
                pah[ks][3] = *(const u32*)(p0 + 8 * TC_PSTRIDE + 8);
                pal[ks][0] = *(const u32*)p1;
                pal[ks][1] = *(const u32*)(p1 + 8 * TC_PSTRIDE);
                pal[ks][2] = *(const u32*)(p1 + 8);
                pal[ks][3] = *(const u32*)(p1 + 8 * TC_PSTRIDE + 8);
            }
            // One ldmatrix.trans gives a key step's B fragments of two 8-dim tiles: lane l
            // names key l % 8 + 8·((l / 8) % 2) of the step, dims 8·(l / 16) on from the
            // tile pair's first.
            const u16* vl = kb + ((lane & 7) + 8 * ((lane >> 3) & 1)) * TC_KSTRIDE + d_base + 8 * (lane >> 4);
#pragma unroll
            for (int n8 = 0; n8 < TC_NTILES_MAX; n8 += 2) {
                if (n8 < nn) {
                    u32 b[2][4];
                    ldmatrix_x4_trans(b[0], vl + 8 * n8);
                    ldmatrix_x4_trans(b[1], vl + 16 * TC_KSTRIDE + 8 * n8);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        float* a = acc[n8 + h];
                        if (rescale) {
                            a[0] *= ca;
                            a[1] *= ca;
                            a[2] *= cb;
                            a[3] *= cb;
                        }
#pragma unroll
                        for (int ks = 0; ks < 2; ks++) {
                            mma_bf16_16816(a, pah[ks], b[ks][2 * h], b[ks][2 * h + 1]);
                            if (!g.one_part) mma_bf16_16816(a, pal[ks], b[ks][2 * h], b[ks][2 * h + 1]);
                        }
                    }
                }
            }
        }
    }

    // Softmax totals per head, then the sink and the normalisation.
#pragma unroll
    for (int x = 1; x < 16; x <<= 1) s_run += __shfl_xor_sync(0xffffffffu, s_run, x);
    if (sk == 0) {
        m_s[sh] = m_run;
        s_s[sh] = s_run;
    }
    __syncthreads();
    if (g.splits > 1) {
        // This split's partial triple per head; the merge applies the sink.
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int hl = hg * 16 + gid + 8 * half, h = h_base + hl;
            if (h >= g.heads) continue;
            float* pp = part + (((long long)r * g.heads + h) * g.splits + blockIdx.y) * (g.hd + 2);
#pragma unroll
            for (int n8 = 0; n8 < TC_NTILES_MAX; n8++) {
                if (n8 < nn)
                    *(float2*)(pp + d_base + 2 * tig + 8 * n8) = make_float2(acc[n8][2 * half], acc[n8][2 * half + 1]);
            }
            if (dg == 0 && tig == 0) {
                pp[g.hd] = m_s[hl];
                pp[g.hd + 1] = s_s[hl];
            }
        }
        return;
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int hl = hg * 16 + gid + 8 * half, h = h_base + hl;
        if (h >= g.heads) continue;
        const float m = m_s[hl], sink = sinks[h];
        const float mf = fmaxf(m, sink);
        const float corr = expf(m - mf);
        const float f = corr / (s_s[hl] * corr + expf(sink - mf));
        float* o = out + ((long long)r * g.heads + h) * g.hd + d_base + 2 * tig;
#pragma unroll
        for (int n8 = 0; n8 < TC_NTILES_MAX; n8++) {
            if (n8 < nn) *(float2*)(o + 8 * n8) = make_float2(acc[n8][2 * half] * f, acc[n8][2 * half + 1] * f);
        }
    }
}
