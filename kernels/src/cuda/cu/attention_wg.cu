// Attention on Hopper's warpgroup instruction (wgmma, sm_90a) for V4's geometry (64 heads
// a block, head_dim 512) with bf16 activations: prefill-sized batches and decode batches
// of 16+ rows; attention.rs (`attention_kernel`) says when it runs, docs/cuda.md
// ("What runs where") and docs/perf.md ("Prefill attention on `wgmma`") why.
//
// Why: `attention_mma` (attention_mma.cu) splits a 32-key tile's logits over 8 dim groups
// of warps and sums their partials through shared memory: three block barriers, the
// partial sums and a softmax on 16 threads a head for every 32 keys × 32 heads. An 8K
// prefill's CSA layer took ~10 ms in it, ~7% of the tensor cores' rate (docs/perf.md).
// Here a block is one row and 64 heads (the whole query of a row: V4's keys are shared by
// all heads, so the heads are wgmma's M), two warpgroups, and a tile is 64 keys:
// - QK: warpgroup w computes its half of the tile's logits, S_w[64 heads × 32 keys] =
//   q · K_wᵀ for keys 32w..32w+31 (32 `m64n32k16`, q and the keys both from shared memory).
// - The online softmax in registers (a row's 32 logits of the half on the 4 threads of a
//   quad), the halves' row maxima exchanged through shared memory so that both move a
//   row's reference point alike; each writes its weights as bf16 into a swizzled 64 × 64
//   plane (the fp8 staging rows, free by then).
// - PV: warpgroup w adds P · V over dims 256w..256w+255 and all 64 keys (4 `m64n256k16`,
//   P and V — the same key tile, read MN-major — from shared memory).
// Against both warpgroups computing all of S and keeping P in registers
// (`attention_wg_whole`, kept for comparisons), a third less tensor work and half the
// softmax a thread for two more block barriers a tile: flash-bench prefill 8K +1.7%.
// Numbers as `attention_mma` with `one_part`: q and the softmax weights rounded once to
// bf16 (as the reference model's bf16 attention has them), keys exact (bf16 entries, or
// fp8 codes times a power-of-two scale), f32 sums, the sink as there; the exponentials in
// base 2 by the hardware's `ex2` and a row's reference point moved only past 2^8 (below:
// both far inside the weights' bf16 rounding). A key split leaves (output, reference
// point, sum) in `attention_merge`'s layout, as `attention_mma` does.
//
// Shared memory (dynamic, 1 KiB aligned): q as bf16 and two key tiles as bf16, all in
// wgmma's 128-byte-swizzled layout (8 planes of 64 dims, a plane 64 rows × 128 bytes, the
// 16-byte piece c of row r at piece c ^ (r % 8)), and the fp8 codes and scale bytes of
// the next tile's keys (from their conversion to the tile's end, the softmax weights). The next tile is fetched by `cp.async` while this one is
// multiplied: bf16 values (this chunk's new entries, bf16 entries, fp8 entries' bf16
// tails) straight into their places in the other tile buffer, fp8 codes into the staging
// rows, converted into that buffer while this tile's q · Kᵀ runs on the tensor cores.

#define AW_HEADS 64
#define AW_HD 512
#define AW_KEYS 64
#define AW_THREADS 256
#define AW_PLANE (64 * 128)                 // 64 rows × 64 bf16
#define AW_MAT (AW_HD / 64 * AW_PLANE)      // q or a key tile: 64 KiB
#define AW_N8 448                           // fp8 entries: dims 0..447 as codes, 448..511 bf16
#define AW_CODES_KEY (AW_N8 + 8)            // a key's codes and its 7 scale bytes (8-byte pieces)
#define AW_SLOTS 4                          // key places: this tile, the next, the two after
#define AW_SLACK 8.0f                       // log2 units a tile's maximum may exceed the softmax's reference point
#define AW_DYN_SMEM (1024 + 3 * AW_MAT + AW_KEYS * AW_CODES_KEY)

// S (64 × 64, f32) = A · B, both bf16 from shared memory, K-major; `acc` 0: D's old values not read.
__device__ __forceinline__ void aw_qk(float (&d)[32], u64 da, u64 db, int acc) {
#if WG_AVAILABLE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{" WG_R0_31 "}, "
        "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_D32(d, 0)
        : "l"(da), "l"(db), "r"(acc));
#else
    __trap();
#endif
}

// D (64 × 256, f32) += A · B, A (bf16) from registers, B (bf16) from shared memory MN-major.
__device__ __forceinline__ void aw_pv(float (&d)[128], const u32 (&a)[4], u64 db) {
    wg_mma_n256_rs<1>(d, a, db);
}

// S_w (64 × 32, f32) = A · B, A and B bf16 from shared memory, K-major: a warpgroup's half
// of a tile's logits (the kernel that splits the keys).
__device__ __forceinline__ void aw_qk32(float (&d)[16], u64 da, u64 db, int acc) {
#if WG_AVAILABLE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "%16, %17, p, 1, 1, 0, 0;\n}\n"
        : WG_D16(d, 0)
        : "l"(da), "l"(db), "r"(acc));
#else
    __trap();
#endif
}

// D (64 × 256, f32) += A · B, A (bf16, K-major) and B (bf16, MN-major) from shared memory:
// P · V with both warpgroups' weights read from where they were exchanged.
__device__ __forceinline__ void aw_pv_ss(float (&d)[128], u64 da, u64 db) {
#if WG_AVAILABLE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{" WG_R0_31 ", " WG_R32_63 ", " WG_R64_127 "}, "
        "%128, %129, p, 1, 1, 0, 1;\n}\n"
        : WG_D128(d)
        : "l"(da), "l"(db), "r"(1));
#else
    __trap();
#endif
}

// Descriptor `d` with its start address moved `off` bytes on: the address field is the low
// 14 bits of addr / 16, and shared-memory addresses (< 256 KiB) never carry out of it, so
// one 32-bit add on the low word. A k-step's descriptor from the tile's, not rebuilt from
// its address (the rebuild was ~8 instructions a wgmma, a sixth of the loop's issue).
__device__ __forceinline__ u64 aw_moved(u64 d, u32 off) {
    return ((u64)(u32)(d >> 32) << 32) | (u32)((u32)d + (off >> 4));
}

// Byte offset of 16-byte piece `c` (8 dims from 8c) of row `r` in a swizzled matrix.
__device__ __forceinline__ u32 aw_at(int r, int c) { return (c >> 3) * AW_PLANE + r * 128 + (((c & 7) ^ (r & 7)) << 4); }

// Fetch a tile's keys (places from `kinds`/`offs`) by `cp.async`, a warp a key at a time
// (its place read once, the branch uniform): bf16 values into their places in `tile`
// (16-byte pieces; an fp8 record's tail in 8-byte halves, records being 8-byte aligned),
// fp8 codes and scale bytes into the key's staging row; a missing key's row of `tile`
// zeroed.
__device__ __forceinline__ void aw_fetch(u8* tile, u32 codes, const int* kinds, const long long* offs,
                                         const AttnGeom& g, const u16* new_kv, const u8* rings,
                                         const u8* page_base) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 t_addr = smem_addr(tile);
#pragma unroll 2
    for (int i = 0; i < AW_KEYS / 8; i++) {
        const int kk = warp * (AW_KEYS / 8) + i, kind = kinds[kk];
        if (kind < 0) {
            *(uint4*)(tile + aw_at(kk, lane)) = make_uint4(0u, 0u, 0u, 0u);
            *(uint4*)(tile + aw_at(kk, lane + 32)) = make_uint4(0u, 0u, 0u, 0u);
        } else if (kind == 0 || g.dtype == DTYPE_BF16) {
            const u8* src = kind == 0 ? (const u8*)(new_kv + offs[kk]) : (kind == 1 ? rings : page_base) + 2 * offs[kk];
            cp_async<16>(t_addr + aw_at(kk, lane), src + 16 * lane);
            cp_async<16>(t_addr + aw_at(kk, lane + 32), src + 16 * (lane + 32));
        } else {
            const u8* e = (kind == 1 ? rings : page_base) + offs[kk];
            const u32 dst = codes + kk * AW_CODES_KEY;
            cp_async<8>(dst + 8 * lane, e + 8 * lane);  // codes 0..255
            if (lane < 24) cp_async<8>(dst + 8 * (lane + 32), e + 8 * (lane + 32));  // codes 256..447
            else if (lane == 24) cp_async<8>(dst + AW_N8, e + AW_N8 + 2 * (AW_HD - AW_N8));  // the scale bytes
            if (lane < 16) {  // the tail: pieces 56..63 of the row, 8 bytes a lane
                const int c = AW_N8 / 8 + (lane >> 1);
                cp_async<8>(t_addr + aw_at(kk, c) + 8 * (lane & 1), e + AW_N8 + 8 * lane);
            }
        }
    }
    cp_async_commit();
}

// One staged fp8 key's piece c (8 dims, c < 56) as bf16: codes by bit placement
// (`e4m3x2_bf16`, exact for the scales TC_FAST_SCALE_MIN..MAX), else through f32, as
// attention_mma's `store_tile`.
__device__ __forceinline__ uint4 aw_fp8_piece(const u8* e, int c) {
    const uint2 x = *(const uint2*)(e + 8 * c);
    const u32 code = e[AW_N8 + c / (FP8_BLOCK / 8)];
    if (code >= TC_FAST_SCALE_MIN && code <= TC_FAST_SCALE_MAX) {
        const u32 ex = (code + 120u) << 7, f = ex | (ex << 16);
        return make_uint4(e4m3x2_bf16(x.x, 0, f), e4m3x2_bf16(x.x, 1, f), e4m3x2_bf16(x.y, 0, f), e4m3x2_bf16(x.y, 1, f));
    }
    return fp8x8_bf16_wide(x.x, x.y, code);
}

// The staged fp8 codes of a tile's fp8 keys into their places in `tile` (the other
// pieces came by `cp.async`): a warp a key at a time, a lane pieces lane and lane + 32.
// Whether every block scale of the key takes the bit placement is one vote a key (lanes
// 0..6 read the 7 scale bytes; a piece's factor comes from its block's lane by a
// shuffle), so the common case has no test or scale load a piece.
__device__ __forceinline__ void aw_convert(u8* tile, const u8* codes, const int* kinds, const AttnGeom& g) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (g.dtype != DTYPE_FP8) return;
#pragma unroll 2
    for (int i = 0; i < AW_KEYS / 8; i++) {
        const int kk = warp * (AW_KEYS / 8) + i;
        if (kinds[kk] <= 0) continue;
        const u8* e = codes + kk * AW_CODES_KEY;
        const u32 code = lane < AW_N8 / FP8_BLOCK ? e[AW_N8 + lane] : TC_FAST_SCALE_MIN;
        const bool second = lane < AW_N8 / 8 - 32;  // pieces 32..55
        if (__all_sync(0xffffffffu, code >= TC_FAST_SCALE_MIN && code <= TC_FAST_SCALE_MAX)) {
            const u32 ex = (code + 120u) << 7, f = ex | (ex << 16);  // 2^(code - 127) · 2^120, both halves
            const u32 f0 = __shfl_sync(0xffffffffu, f, lane >> 3), f1 = __shfl_sync(0xffffffffu, f, (lane + 32) >> 3);
            const uint2 x = *(const uint2*)(e + 8 * lane);
            *(uint4*)(tile + aw_at(kk, lane)) = make_uint4(e4m3x2_bf16(x.x, 0, f0), e4m3x2_bf16(x.x, 1, f0),
                                                           e4m3x2_bf16(x.y, 0, f0), e4m3x2_bf16(x.y, 1, f0));
            if (second) {
                const uint2 y = *(const uint2*)(e + 8 * (lane + 32));
                *(uint4*)(tile + aw_at(kk, lane + 32)) = make_uint4(e4m3x2_bf16(y.x, 0, f1), e4m3x2_bf16(y.x, 1, f1),
                                                                    e4m3x2_bf16(y.y, 0, f1), e4m3x2_bf16(y.y, 1, f1));
            }
        } else {
            *(uint4*)(tile + aw_at(kk, lane)) = aw_fp8_piece(e, lane);
            if (second) *(uint4*)(tile + aw_at(kk, lane + 32)) = aw_fp8_piece(e, lane + 32);
        }
    }
}

// A raw query's heads as head_norm_rope leaves them (rows.cu's `hnr_head`: RMSNorm
// without a weight, then RoPE on the last 2·pairs dims, interleaved pairs), in the
// registers of the staging above: piece u of this thread is dims 8c..8c+7 (c = tid % 64)
// of head tid / 64 + 4u, so a head's 64 pieces are on warps 2k and 2k + 1 (k = tid / 64)
// and its sum of squares is two warp sums added through shared memory. Folded here, the
// query's separate pass (an 8K prefill's 1 GB a layer read and written) goes.
__device__ __forceinline__ void aw_prep_query(float4 (&a)[16], float4 (&b)[16], float pos, float eps,
                                              const RopeParams& rp) {
    __shared__ float head_ss[16][AW_THREADS / 32];
    const int warp = threadIdx.x >> 5, c = threadIdx.x & 63;
#pragma unroll
    for (int u = 0; u < 16; u++) {
        const float ss = a[u].x * a[u].x + a[u].y * a[u].y + a[u].z * a[u].z + a[u].w * a[u].w + b[u].x * b[u].x +
                         b[u].y * b[u].y + b[u].z * b[u].z + b[u].w * b[u].w;
        const float sum = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) head_ss[u][warp] = sum;
    }
    // The angles depend on the position and the pair, not the head: this thread's four
    // pairs' cosines and sines (times the attention factor, as rope_pair takes them) once
    // for its 16 heads. Per head, sincosf was most of the staging (one block an SM).
    const int r0 = AW_HD - 2 * rp.pairs, d0 = 8 * c;
    float cs[4] = {1.0f, 1.0f, 1.0f, 1.0f}, sn[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int e = 0; e < 4; e++) {
        if (d0 + 2 * e >= r0) {
            sincosf(pos * rp.inv_freq[(d0 + 2 * e - r0) >> 1], &sn[e], &cs[e]);
            cs[e] *= rp.attention_factor;
            sn[e] *= rp.attention_factor;
        }
    }
    const bool rotates = d0 + 8 > r0;
    __syncthreads();
#pragma unroll
    for (int u = 0; u < 16; u++) {
        const float inv = 1.0f / sqrtf((head_ss[u][warp & ~1] + head_ss[u][warp | 1]) / (float)AW_HD + eps);
        float v[8] = {a[u].x * inv, a[u].y * inv, a[u].z * inv, a[u].w * inv,
                      b[u].x * inv, b[u].y * inv, b[u].z * inv, b[u].w * inv};
        if (rotates) {
            // rope_pair's arithmetic with the angle's factors above (pairs before r0 keep
            // cos 1, sin 0 and are not touched: the branch is per pair).
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (d0 + 2 * e >= r0) {
                    const float x = v[2 * e], y = v[2 * e + 1];
                    v[2 * e] = x * cs[e] - y * sn[e];
                    v[2 * e + 1] = y * cs[e] + x * sn[e];
                }
            }
        }
        a[u] = make_float4(v[0], v[1], v[2], v[3]);
        b[u] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

// The normalised output of heads `head` and `head` + 8 (row r; this thread's pairs of dims
// 256·wg + 8j + 2tq) as bf16, the last 2·pairs dims rotated back: what `attention_merge`
// (no split here), the `rope` launch and `round_bf16_rows8` leave. Into shared memory at
// `stage` (the block's 64 heads, AW_OUT_STRIDE bytes a head: with 16 bytes of padding a
// warp's 32 words fall on 32 banks), which `aw_copy_out` then writes out whole.
#define AW_OUT_STRIDE (2 * AW_HD + 16)
__device__ __forceinline__ void aw_stage_bf16(const float (&o)[128], u8* stage, int row0, int head, const AttnGeom& g,
                                              const float* sinks, const float (&m_run)[2], const float (&s_run)[2],
                                              float pos, const RopeParams& rp, int wg, int tq) {
    float f[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float sink = sinks[head + 8 * h], mf = fmaxf(m_run[h], sink), c = expf(m_run[h] - mf);
        f[h] = c / (s_run[h] * c + expf(sink - mf));
    }
    u8* dst0 = stage + row0 * AW_OUT_STRIDE + 2 * (256 * wg + 2 * tq);
    u8* dst1 = dst0 + 8 * AW_OUT_STRIDE;
    const int r0 = AW_HD - 2 * rp.pairs;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        float x0 = o[4 * j] * f[0], y0 = o[4 * j + 1] * f[0], x1 = o[4 * j + 2] * f[1], y1 = o[4 * j + 3] * f[1];
        const int d = 256 * wg + 8 * j + 2 * tq;
        if (d >= r0) {
            float sn, cs;
            sincosf(pos * rp.inv_freq[(d - r0) >> 1], &sn, &cs);
            cs *= rp.attention_factor;
            sn = -sn * rp.attention_factor;  // the inverse rotation, as rope_pair(inverse) negates s
            const float a0 = x0 * cs - y0 * sn, b0 = y0 * cs + x0 * sn;
            const float a1 = x1 * cs - y1 * sn, b1 = y1 * cs + x1 * sn;
            x0 = a0, y0 = b0, x1 = a1, y1 = b1;
        }
        *(u32*)(dst0 + 16 * j) = bf16x2_rn(x0, y0);
        *(u32*)(dst1 + 16 * j) = bf16x2_rn(x1, y1);
    }
}

// The staged rows of the block's 64 heads (row r) to `out`, where they are 64 KiB in a
// row: 16-byte pieces, a warp 512 contiguous bytes an instruction. Written from the
// registers, a warp's store touched 8 heads' 16 bytes each, ~16K stores a block.
__device__ __forceinline__ void aw_copy_out(const u8* stage, u16* out, int r, int h0, const AttnGeom& g) {
    uint4* dst = (uint4*)(out + ((long long)r * g.heads + h0) * AW_HD);
#pragma unroll 4
    for (int p = threadIdx.x; p < AW_HEADS * AW_HD / 8; p += AW_THREADS)
        dst[p] = *(const uint4*)(stage + (p >> 6) * AW_OUT_STRIDE + 16 * (p & 63));
}

// A tile's row maxima `mt` (log2 units) into the running reference points: a row's point
// moves only when a tile's maximum passes it by more than AW_SLACK (2^8): the weights then
// lie in [0, 256] (bf16 rounds them to the same relative precision, f32 sums hold them),
// and O's 128 registers are rescaled on the few tiles that move it instead of most tiles.
// The result is the same function of the logits (numerator and denominator share the
// point), to rounding. Leaves each row's factor for O and its running sum in `corr` and
// the point to subtract (0 while no key was seen) in `mz`.
__device__ __forceinline__ void aw_move_reference(const float (&mt)[2], float (&m_run)[2], float (&s_run)[2],
                                                  float (&corr)[2], float (&mz)[2]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float m_new = mt[h] > m_run[h] + AW_SLACK ? mt[h] : m_run[h];
        corr[h] = m_new == m_run[h] ? 1.0f : ex2(m_run[h] - m_new);  // from -inf: 0
        m_run[h] = m_new;
        s_run[h] *= corr[h];
        mz[h] = m_run[h] == NEG_INF ? 0.0f : m_run[h];
    }
}

// O (rows row0 and row0 + 8 of this thread's 256 dims) times its rows' factors, skipped
// when no row of the warp moved its point (an exact no-op then).
__device__ __forceinline__ void aw_rescale(float (&o)[128], const float (&corr)[2]) {
    if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
        for (int i = 0; i < 128; i++) o[i] *= corr[(i >> 1) & 1];
    }
}

// grid (heads / 64, splits, rows), AW_THREADS threads, AW_DYN_SMEM bytes of dynamic shared
// memory. Requires head_dim 512, bf16 new entries (`new_bf16`), bf16 or fp8 entries with
// aligned offsets (the launcher checks, as for attention_mma).
template <bool HALVES>
__device__ __forceinline__ void aw_attend(const float* q, const u16* new_kv, const u8* rings, const u8* page_base,
                                          const u32* pages, const int* sel, const float* sinks, const u32* positions,
                                          const int* row_seq, const int* seqs, float* out, float* part, AttnGeom g,
                                          RopeParams rp) {
    pdl_begin();
    extern __shared__ __align__(16) u8 aw_dyn[];
    __shared__ int kinds[AW_SLOTS][AW_KEYS];  // key places of tile i in slot i % AW_SLOTS
    __shared__ long long offs[AW_SLOTS][AW_KEYS];
    __shared__ u32 present[AW_SLOTS][2];      // the tiles' keys that exist, a bit a key
    __shared__ float halves[2][AW_HEADS];     // HALVES: each warpgroup's rows' maxima, then sums
    u8* qs = aw_dyn + ((1024 - (smem_addr(aw_dyn) & 1023)) & 1023);  // swizzle atoms need 1 KiB alignment
    u8* tiles = qs + AW_MAT;                                          // two, tile i in tiles + (i & 1) · AW_MAT
    u8* codes = tiles + 2 * AW_MAT;
    const u32 q_addr = smem_addr(qs), t_addr = smem_addr(tiles), c_addr = smem_addr(codes);

    const int r = blockIdx.z, h0 = blockIdx.x * AW_HEADS;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int gid = lane >> 2, tq = lane & 3;
    const AttnRow row = attn_row(g, r, blockIdx.y, positions, row_seq, seqs, sel);
    const int t = row.t, n_win = row.n_win, j0 = row.j0, j1 = row.j1;
    const int *seq = row.seq, *sel_row = row.sel_row;
    // Threads < AW_KEYS (warps 0 and 1): key j's place into `slot`, and the slot's bits.
    auto place = [&](int slot, int j) {
        long long off = 0;
        const int kind = j < j1 ? key_source(g, j, t, n_win, seq, pages, sel_row, &off) : -1;
        kinds[slot][threadIdx.x] = kind;
        offs[slot][threadIdx.x] = off;
        const u32 bits = __ballot_sync(0xffffffffu, kind >= 0);
        if (lane == 0) present[slot][threadIdx.x >> 5] = bits;
    };
    auto fetch = [&](int tile_i) {
        const int slot = tile_i % AW_SLOTS;
        aw_fetch(tiles + (tile_i & 1) * AW_MAT, c_addr, kinds[slot], offs[slot], g, new_kv, rings, page_base);
    };

    // Tile 0 fetched and converted, tile 1's fetch in flight, q as bf16 meanwhile. The
    // q loads go first (a thread 16 pieces of 8 dims, every load issued before the first
    // conversion: one block an SM, nothing else hides their latency), so they are in
    // flight under the first key places' dependent loads (the selection, the page table).
    constexpr int PIECES = AW_HEADS * AW_HD / 8 / AW_THREADS;
    float4 qa[PIECES], qb[PIECES];
#pragma unroll
    for (int u = 0; u < PIECES; u++) {
        const int p = threadIdx.x + AW_THREADS * u;
        const float* src = q + ((long long)r * g.heads + h0 + (p >> 6)) * AW_HD + 8 * (p & 63);
        qa[u] = *(const float4*)src;
        qb[u] = *(const float4*)(src + 4);
    }
    if (threadIdx.x < AW_KEYS) place(0, j0 + threadIdx.x);
    __syncthreads();
    fetch(0);
    if (threadIdx.x < AW_KEYS) place(1, j0 + AW_KEYS + threadIdx.x);
    {
        // q rounded once, swizzled.
        if (g.q_prep) aw_prep_query(qa, qb, (float)positions[r], g.q_eps, rp);
#pragma unroll
        for (int u = 0; u < PIECES; u++) {
            const int p = threadIdx.x + AW_THREADS * u;
            *(uint4*)(qs + aw_at(p >> 6, p & 63)) = make_uint4(bf16x2_rn(qa[u].x, qa[u].y), bf16x2_rn(qa[u].z, qa[u].w),
                                                               bf16x2_rn(qb[u].x, qb[u].y), bf16x2_rn(qb[u].z, qb[u].w));
        }
    }
    // A row's q (128 KiB of f32) was most of its start's wait; blocks start in row order,
    // one an SM, so the row about to start when this one ends is r + SMs: its q brought
    // into L2 now (a prefill's rows, one key split).
    if (gridDim.y == 1) {
        u32 nsm;
        asm("mov.u32 %0, %%nsmid;" : "=r"(nsm));
        const int nr = r + (int)nsm;
        if (nr < (int)gridDim.z) {
            const char* nq = (const char*)(q + ((long long)nr * g.heads + h0) * AW_HD);
#pragma unroll
            for (int i = 0; i < AW_HEADS * AW_HD * 4 / 128 / AW_THREADS; i++)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(nq + 128 * (threadIdx.x + AW_THREADS * i)));
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    aw_convert(tiles, codes, kinds[0], g);
    wg_proxy_fence();
    __syncthreads();
    if (j0 + AW_KEYS < j1) fetch(1);
    if (threadIdx.x < AW_KEYS) place(2, j0 + 2 * AW_KEYS + threadIdx.x);

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.0f;
    // The softmax in base 2: logits times scale · log2(e), the reference points in those units.
    const float scale2 = g.scale * 1.4426950408889634f;
    float m_run[2] = {NEG_INF, NEG_INF}, s_run[2] = {0.0f, 0.0f};
    const int row0 = 16 * warp + gid;  // this thread's rows (heads h0 + row0, + 8)

    for (int jt = j0, it = 0; jt < j1; jt += AW_KEYS, it++) {
        const int cur = it % AW_SLOTS;
        const u32 tile_addr = t_addr + (it & 1) * AW_MAT;
        const bool next = jt + AW_KEYS < j1;
        if (HALVES) {
            // 1. S_w = q · K_wᵀ, this warpgroup's half of the tile's keys (32·wg..32·wg + 31).
            float s[16];
            const u64 q_desc = wg_desc(q_addr, 16, 1024, 1);
            const u64 k_desc = wg_desc(tile_addr + wg * (AW_KEYS / 2) * 128, 16, 1024, 1);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < AW_HD / 16; ks++) {
                const u32 off = (ks >> 2) * AW_PLANE + (ks & 3) * 32;
                aw_qk32(s, aw_moved(q_desc, off), aw_moved(k_desc, off), ks > 0);
            }
            wg_commit();
            if (threadIdx.x < AW_KEYS) place((it + 3) % AW_SLOTS, jt + 3 * AW_KEYS + threadIdx.x);
            // 2. fp8: the next tile's staged codes into its buffer while the products run
            //    (every thread's copies landed first).
            if (g.dtype == DTYPE_FP8) {
                cp_async_wait<0>();
                __syncthreads();
                if (next) aw_convert(tiles + ((it + 1) & 1) * AW_MAT, codes, kinds[(it + 1) % AW_SLOTS], g);
            }
            wg_wait<0>();
            wm_hold(s);
            // 3. This half's logits (s[4j + e]: row row0 (e < 2) or row0 + 8, key 32·wg + 8j +
            //    2tq + (e & 1)); the rows' maxima of both halves through shared memory, so
            //    both warpgroups move the reference points alike.
            const u32 here = present[cur][wg];
            float mt[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int j = 0; j < 4; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = 8 * j + 2 * tq + (e & 1);
                    s[4 * j + e] = (here >> key) & 1u ? s[4 * j + e] * scale2 : NEG_INF;
                    mt[e >> 1] = fmaxf(mt[e >> 1], s[4 * j + e]);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 1));
                mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 2));
                if (tq == 0) halves[wg][row0 + 8 * h] = mt[h];
            }
            __syncthreads();  // the maxima; fp8: every conversion done, the staging rows free for P
#pragma unroll
            for (int h = 0; h < 2; h++) mt[h] = fmaxf(mt[h], halves[wg ^ 1][row0 + 8 * h]);
            float corr[2], mz[2];
            aw_move_reference(mt, m_run, s_run, corr, mz);
            // 4. This half's weights as bf16 into the staging rows, where PV reads P as wgmma's
            //    A (64 rows of 64 keys, 128-byte swizzled: piece 4·wg + j of each row).
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float p[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    p[e] = ex2(s[4 * j + e] - mz[e >> 1]);
                    s_run[e >> 1] += p[e];
                }
                const int piece = ((4 * wg + j) ^ (row0 & 7)) << 4;
                *(u32*)(codes + row0 * 128 + piece + 4 * tq) = bf16x2_rn(p[0], p[1]);
                *(u32*)(codes + (row0 + 8) * 128 + piece + 4 * tq) = bf16x2_rn(p[2], p[3]);
            }
            aw_rescale(o, corr);
            wg_proxy_fence();
            __syncthreads();  // P whole
            // 5. O = corr · O + P · V over this warpgroup's 256 dims and all 64 keys.
            const u64 p_desc = wg_desc(c_addr, 16, 1024, 1);
            const u64 v_desc = wg_desc(tile_addr + wg * 4 * AW_PLANE, AW_PLANE, 1024, 1);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < AW_KEYS / 16; ks++)
                aw_pv_ss(o, aw_moved(p_desc, ks * 32), aw_moved(v_desc, ks * 16 * 128));
            wg_commit();
            wg_wait<0>();
            wm_hold(o);
            // 6. The next tile's copies landed (bf16; fp8 waited in 2.) and visible to the
            //    tensor cores; this tile's buffer, P and the staging rows free: the tile
            //    after next is fetched into them.
            if (g.dtype != DTYPE_FP8) cp_async_wait<0>();
            wg_proxy_fence();
            __syncthreads();
            if (jt + 2 * AW_KEYS < j1) fetch(it + 2);
            continue;
        }
        // 1. S = q · Kᵀ over 32 k-steps of 16 dims, on the tensor cores while 2. runs.
        float s[32];
        const u64 q_desc = wg_desc(q_addr, 16, 1024, 1), k_desc = wg_desc(tile_addr, 16, 1024, 1);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < AW_HD / 16; ks++) {
            const u32 off = (ks >> 2) * AW_PLANE + (ks & 3) * 32;
            aw_qk(s, aw_moved(q_desc, off), aw_moved(k_desc, off), ks > 0);
        }
        wg_commit();
        // The tile after next's key places (slot (it + 3) % AW_SLOTS last held tile it - 1's,
        // all of whose readers passed the last barrier): their loads' latency (the
        // selection, then the page table) under the tensor cores' q · Kᵀ rather than in
        // front of the next tile's.
        if (threadIdx.x < AW_KEYS) place((it + 3) % AW_SLOTS, jt + 3 * AW_KEYS + threadIdx.x);
        // 2. The next tile's fp8 codes (landed: every thread waited for its copies) into
        //    the other tile buffer.
        cp_async_wait<0>();
        __syncthreads();
        if (next) aw_convert(tiles + ((it + 1) & 1) * AW_MAT, codes, kinds[(it + 1) % AW_SLOTS], g);
        wg_wait<0>();
        wm_hold(s);

        // 3. Online softmax: s[4j + e] is row row0 (e < 2) or row0 + 8, key 8j + 2tq + (e & 1).
        const u32 here[2] = {present[cur][0], present[cur][1]};
        float mt[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = 8 * j + 2 * tq + (e & 1);
                const bool ok = (here[key >> 5] >> (key & 31)) & 1u;
                s[4 * j + e] = ok ? s[4 * j + e] * scale2 : NEG_INF;
                mt[e >> 1] = fmaxf(mt[e >> 1], s[4 * j + e]);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 1));
            mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 2));
        }
        float corr[2], mz[2];
        aw_move_reference(mt, m_run, s_run, corr, mz);
        u32 pa[4][4];  // P's A fragments, k-step ks = keys 16ks..16ks+15
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                p[e] = ex2(s[4 * j + e] - mz[e >> 1]);  // exp2(-inf) = 0: missing keys weigh nothing
                s_run[e >> 1] += p[e];
            }
            pa[j >> 1][2 * (j & 1)] = bf16x2_rn(p[0], p[1]);
            pa[j >> 1][2 * (j & 1) + 1] = bf16x2_rn(p[2], p[3]);
        }
        // 4. O = corr · O + P · V over this warpgroup's 256 dims.
        aw_rescale(o, corr);
        const u64 v_desc = wg_desc(tile_addr + wg * 4 * AW_PLANE, AW_PLANE, 1024, 1);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < AW_KEYS / 16; ks++) aw_pv(o, pa[ks], aw_moved(v_desc, ks * 16 * 128));
        wg_commit();
        wg_wait<0>();
        wm_hold(o);
        // 5. The next tile complete and visible to the tensor cores; this one's buffer and
        //    the staging rows free: the tile after next is fetched into them.
        wg_proxy_fence();
        __syncthreads();
        if (jt + 2 * AW_KEYS < j1) fetch(it + 2);
    }

    // Row totals over the quad, the maxima back in natural units, then the sink and the
    // normalisation (or this split's partial triple, for attention_merge).
#pragma unroll
    for (int h = 0; h < 2; h++) {
        s_run[h] += __shfl_xor_sync(0xffffffffu, s_run[h], 1);
        s_run[h] += __shfl_xor_sync(0xffffffffu, s_run[h], 2);
        m_run[h] *= 0.6931471805599453f;
    }
    if (HALVES) {
        // Each warpgroup summed its own keys' weights: a row's total is both halves'.
        if (tq == 0) {
            halves[wg][row0] = s_run[0];
            halves[wg][row0 + 8] = s_run[1];
        }
        __syncthreads();
        s_run[0] = halves[0][row0] + halves[1][row0];
        s_run[1] = halves[0][row0 + 8] + halves[1][row0 + 8];
    }
    if (g.out_bf16) {
        // The output as the next product reads it: each head's tail rotated back to the
        // row's position (rope_pair's inverse; a pair's angle taken once for both of the
        // thread's heads) and rounded once to bf16 (cuBLAS's input for wo_a, which would
        // otherwise read the f32 output in one pass and the rotation in another).
        // q and the tiles are free (every warp passed the last tile's barrier, and every
        // wgmma that read them completed): the rows are staged there.
        aw_stage_bf16(o, qs, row0, h0 + row0, g, sinks, m_run, s_run, (float)positions[r], rp, wg, tq);
        __syncthreads();
        aw_copy_out(qs, (u16*)out, r, h0, g);
        return;
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int head = h0 + row0 + 8 * h;
        float f = 1.0f;
        float* dst;
        if (g.splits > 1) {
            dst = part + (((long long)r * g.heads + head) * g.splits + blockIdx.y) * (AW_HD + 2);
            if (wg == 0 && tq == 0) {
                dst[AW_HD] = m_run[h];
                dst[AW_HD + 1] = s_run[h];
            }
        } else {
            const float sink = sinks[head], mf = fmaxf(m_run[h], sink), c = expf(m_run[h] - mf);
            f = c / (s_run[h] * c + expf(sink - mf));
            dst = out + ((long long)r * g.heads + head) * AW_HD;
        }
        dst += 256 * wg + 2 * tq;
#pragma unroll
        for (int j = 0; j < 32; j++) *(float2*)(dst + 8 * j) = make_float2(o[4 * j + 2 * h] * f, o[4 * j + 2 * h + 1] * f);
    }
}

// The two warpgroups split each tile's keys for q · Kᵀ (half the products and half the
// softmax a thread) and exchange the weights through shared memory for P · V.
extern "C" __global__ void __launch_bounds__(AW_THREADS, 1)
    attention_wg(const float* q, const u16* new_kv, const u8* rings, const u8* page_base, const u32* pages,
                 const int* sel, const float* sinks, const u32* positions, const int* row_seq, const int* seqs,
                 float* out, float* part, AttnGeom g, RopeParams rp) {
    aw_attend<true>(q, new_kv, rings, page_base, pages, sel, sinks, positions, row_seq, seqs, out, part, g, rp);
}

// Both warpgroups compute the whole tile's logits (no exchange; `SLUICE_CUDA_ATT_WG_HALVES=0`).
extern "C" __global__ void __launch_bounds__(AW_THREADS, 1)
    attention_wg_whole(const float* q, const u16* new_kv, const u8* rings, const u8* page_base, const u32* pages,
                 const int* sel, const float* sinks, const u32* positions, const int* row_seq, const int* seqs,
                 float* out, float* part, AttnGeom g, RopeParams rp) {
    aw_attend<false>(q, new_kv, rings, page_base, pages, sel, sinks, positions, row_seq, seqs, out, part, g, rp);
}
