// Prefill-sized products of FP4 experts (grouped) and FP8 weights on Hopper's warpgroup
// instruction (wgmma, sm_90a): kernels/src/cuda/moe_fp4wg.rs plans and launches them;
// docs/cuda.md ("fp4wg_gemm") says when they run.
//
// Why: the `gemm_fp4` / `gemm_fp8` tiles (gemm.cu) dequantise each weight tile to bf16 in
// shared memory and run the warp-level mma on split activations: ~91 TFLOP/s for the
// experts, 28.6% of an 8K prefill on 20 Flash layers, the FP8 projections about as slow.
// Here each lane turns its codes into bf16 A fragments in registers and the rows are
// wgmma's B operand, brought into shared memory by the tensor memory accelerator: the
// weights never pass through shared memory as bf16.
//
// Precision: bf16 products with f32 sums, as the tiles', so the results match them.
// A first version on e4m3 (codes as e4m3, rows as three e4m3 parts) measured 4-5e-4 of
// the CPU's products (the tensor core adds FP8 products in fewer bits than f32 — DeepSeek-V3
// report §3.3.2 — and its sums had to be scaled a 32-input group at a time) and changed
// greedy tokens of the small FP4 checkpoint against the CPU engine; bf16 sums need neither.
//
// Codes → bf16, exactly: an e2m1 nibble s.e1 e0.m placed as the bf16 bits s at 15,
// e1 e0 m at 8..6 is its value times 2^-126 (a normal code 2^(e-1)·(1 + m/2) reads as
// 2^(e-127)·(1 + m/2); the subnormal 0.5 becomes bf16's subnormal 2^-127), and one bf16x2
// multiply by 2^(s - 1) (the group's ue8m0 scale s times 2^126; the scales this path
// takes lie in 2^-23..2^1) gives the weight. An e4m3 byte placed as sign at 15 and its
// seven other bits at 10..4 is its value times 2^-120 (subnormals too); the multiply is by
// 2^120 times the 128×128 block's scale (a power of two in 2^-100..2^7).
//
// Activations: each row as two bf16 parts (x = hi + lo, hi the rounding of x, lo of what
// is left: ~16 significant bits; or, with `SLUICE_CUDA_BF16_ACTIVATIONS=bf16`, hi alone —
// the reference model's bf16 activations, half the products), one plane a part:
// parts[p][row][K], written by
// `fp4wg_parts` in the A fragments' input order, so that a lane's one u32 of codes a row
// holds exactly its fragment's inputs. FP4: within each group of 32 inputs, k-step s
// (16 inputs) holds logical inputs 2t, 2t + 1 = inputs 8t + 2s, 8t + 2s + 4 and logical
// 2t + 8, 2t + 9 = inputs 8t + 2s + 1, 8t + 2s + 5 (a lane reads inputs 8t..8t+7, one
// nibble each: nibbles 2s and 2s + 4 of its u32 for the first pair, 2s + 1 and 2s + 5 for
// the second — the pairs fw_codes_bf16 converts with one multiply). FP8: within each
// k-step, logical 2t, 2t + 1 = inputs 4t, + 1 and 2t + 8, 2t + 9 = inputs 4t + 2, + 3 (a
// lane reads inputs 4t..4t+3).
//
// Block: two warpgroups, 128 outputs (weight rows; warpgroup h takes rows 64h..64h+63) ×
// one tile of up to 128 rows (`_n64` kernels: up to 64, an expert's last few rows, with
// `wgmma.m64n64k16` and half the parts; FP4's `_n32`: up to 32, `m64n32k16`, a quarter of
// them, and `_n16`: up to 16, `m64n16k16`; FP4's short tiles also with four warpgroups,
// 256 outputs (`w`: half the parts' bytes a byte of codes); the host's tile list, as the
// `gemm_*` tiles: expert, first row, rows; a plain FP8 product is one "expert"; a grouped
// one's block reads its group's inputs). A chunk is 128 inputs (FP4) or 64 (FP8): the
// tile's two parts (TMA boxes of 64 inputs × 128 rows, 128-byte swizzle as the descriptors
// name) and the block's codes (128 rows × 64 bytes either way, `cp.async` by every thread,
// 16-byte pieces permuted by (row / 2) mod 4 so that the fragment loads are free of bank
// conflicts), FP4 with its 4 scale bytes a row. A ring of chunks (`FW_S`), one block
// barrier a chunk (the codes come from every thread's copies); a warpgroup converts the
// chunk's codes, then issues its 16 or 8 wgmmas (k-steps × 2 parts) into one chain of f32
// sums. The plain kernels wait for them before the next chunk; the `_p` ones convert the
// next chunk's codes into a second set of fragments while these run (one chunk fewer
// requested ahead: a stage is free once its products are done). Rows of a tile past its
// count read whatever rows follow (or the map's zero fill): their columns are never
// written.

#define FW_BN(WG) ((WG) * 64)               // outputs a block: 64 a warpgroup (2, or 4 for FP4's short tiles)
#define FW_BOX(BT) ((BT) * 128)              // one TMA box: 64 bf16 inputs × BT rows (tiles of 128, 64, 32 or 16)
#define FW_A_BYTES(WG) (FW_BN(WG) * 64)      // the block's codes of a chunk: 64 bytes a row
#define FW_THREADS(WG) ((WG) * 128)
// Inputs a chunk: FP4 128, FP8 64 (64 bytes of codes a row either way); a stage is the
// parts' boxes, the codes and (FP4) their scale bytes. Stages: FP8 4; FP4 3 for tiles of
// 128 rows, and for the smaller stages of FP4's short tiles as many as ~200 KiB hold (5
// of 64 rows, 8 of 32): one block an SM streams its expert's codes with S - 2 chunks in
// flight, so a small prefill's experts of a few rows each (all 256 streamed once) ran at
// ~1 TB/s with one (docs/perf.md, "Small prefills").
// The one-part tiles of 256 rows (`_n256`) hold one plane of parts a stage: FP8 five
// stages of 41 KiB, FP4 three of 73 KiB.
#define FW_KC(FP8) ((FP8) ? 64 : 128)
#define FW_S(FP8, BT, WG) \
    ((FP8) ? ((BT) == 256 ? 5 : 4) : (BT) >= 128 ? 3 : (BT) == 64 ? 5 : (WG) == 4 && (BT) == 32 ? 6 : 8)
#define FW_STAGE(FP8, BT, WG, NP) ((NP) * (FW_KC(FP8) / 64) * FW_BOX(BT) + FW_A_BYTES(WG) + 1024)

// Kernel arguments (`Fp4wgArgs` in moe_fp4wg.rs): the parts' tensor map first.
struct __align__(64) Fp4wgArgs {
    WgTensorMap parts;   // bf16 [2 · plane][x_cols], boxes of 64 inputs × the tile rows (128 or 64)
    float* out;          // [row][out_stride]
    const u64* wtab;     // (codes, scales) per expert (FP8: one entry, f32 block scales)
    const int* tiles;    // (expert, first row, rows) per token tile
    int K, plane;        // inputs (of a group), rows of one part's plane
    int g_out;           // outputs a group (FP8 grouped products; else all): group g reads inputs gK..
    int out_stride;
    int splits;          // blocks along K (gridDim.z): block z sums chunks z·n/splits .. (z+1)·n/splits
    int split_stride;    // floats between two K slices' partial sums in `out` (splits > 1)
    unsigned pad[20];    // zero (the host's struct has no undefined padding bytes)
};

// D += A · B over 64 × 128 × 16 (bf16, f32 sums), A from registers, B K-major; `acc` 0:
// D = A · B (D's old values not read; the indexer's first k-step, indexer_wg.cu).
__device__ __forceinline__ void fw_mma(float (&d)[64], const u32 (&a)[4], u64 db, int acc = 1) {
#if WG_AVAILABLE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{" WG_R0_31 ", " WG_R32_63 "}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : WG_D64(d, 0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
#else
    __trap();
#endif
}

// D += A · B over 64 × 256 × 16 (the one-part tiles of 256 rows: each converted A
// fragment, and each chunk's barrier and waits, serve twice the products of a 128-row
// tile's).
__device__ __forceinline__ void fw_mma(float (&d)[128], const u32 (&a)[4], u64 db) {
    wg_mma_n256_rs<0>(d, a, db);
}

// D += A · B over 64 × 64 × 16 (tiles of at most 64 rows: half the sums and products).
__device__ __forceinline__ void fw_mma(float (&d)[32], const u32 (&a)[4], u64 db) {
#if WG_AVAILABLE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{" WG_R0_31 "}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : WG_D32(d, 0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
#else
    __trap();
#endif
}

// D += A · B over 64 × 32 × 16 (FP4 tiles of at most 32 rows: an expert's few rows of a
// small prefill).
__device__ __forceinline__ void fw_mma(float (&d)[16], const u32 (&a)[4], u64 db) {
#if WG_AVAILABLE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
#else
    __trap();
#endif
}

// D += A · B over 64 × 16 × 16 (FP4 tiles of at most 16 rows).
__device__ __forceinline__ void fw_mma(float (&d)[8], const u32 (&a)[4], u64 db) {
#if WG_AVAILABLE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
#else
    __trap();
#endif
}

// wg_hold for the sums of fw_mma: their reads are tied to after the wait.
template <int N>
__device__ __forceinline__ void fw_hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i += 4)
        asm volatile("" : "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])::"memory");
}

// Two FP4 codes of a u32, at nibbles p and p + 4, as bf16 (nibble p in the low half) times
// 2^-126, then times `f` (2^(s - 1) in both halves). `x` holds just those two nibbles, at
// bits 0-3 and 16-19 (`SH` 6: x · 4160 = x << 6 | x << 12) or 4-7 and 20-23 (`SH` 2:
// x · 260 = x << 2 | x << 8; the two shifted copies never overlap, so the product is
// their OR): the magnitude lands at bits 8..6 of its half, the sign at 15 — a multiply
// and a mask for two codes where a byte permute, two shifts and two masks were.
template <int SH>
__device__ __forceinline__ u32 fw_codes_bf16(u32 x, u32 f) {
    const u32 v = (x * ((1u << SH) + (1u << (SH + 6)))) & 0x81C081C0u;
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(f), "r"(0x80008000u));
    return r;
}

// 2^(s - 1) as bf16 in both halves, s the ue8m0 byte b of `word`.
__device__ __forceinline__ u32 fw_scale2(u32 word, int b) {
    const u32 e = (((word >> (8 * b)) & 0xFFu) + 126u) << 7;
    return e | (e << 16);
}

// 2^120 · s as bf16 in both halves, s an f32 power of two (the host checks the range).
__device__ __forceinline__ u32 fw_block_scale2(float s) {
    const u32 e = (__float_as_uint(s) + (120u << 23)) >> 16;
    return e | (e << 16);
}

// Word i of w (i in 0..3) without indexing registers by a run-time value.
__device__ __forceinline__ u32 fw_word(const u32 (&w)[4], int i) {
    return i == 0 ? w[0] : i == 1 ? w[1] : i == 2 ? w[2] : w[3];
}

// A lane's four words of one plane (word m = 2s + h: the pair (s, h) below) rearranged
// so that the lane holds 16 contiguous bytes of the plane's row, which it stores at
// the returned offset (bf16 units from the row's start). FP4: the four lanes of a quad
// (piece j, j & 3 = q) cover 32 bf16 at (j >> 2) · 32, block m (8 bf16 at 8m) holding word
// m of lanes 0..3 in order: a 4×4 transpose over the quad, lane q keeping block q.
// FP8: the two lanes of a pair cover 16 bf16 at (j >> 1) · 16, block h holding words
// (s, h) = (0, h), (1, h) of the even lane then of the odd one: lane j & 1 keeps block
// j & 1 and swaps the other two words with its partner.
__device__ __forceinline__ int fw_gather_words(u32 (&w)[4], int j, int fp8) {
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    if (fp8) {
        const int odd = j & 1;
        const u32 g0 = __shfl_xor_sync(all, odd ? w[0] : w[1], 1);
        const u32 g1 = __shfl_xor_sync(all, odd ? w[2] : w[3], 1);
        const u32 k0 = odd ? w[1] : w[0], k1 = odd ? w[3] : w[2];
        w[0] = odd ? g0 : k0;
        w[1] = odd ? g1 : k1;
        w[2] = odd ? k0 : g0;
        w[3] = odd ? k1 : g1;
        return (j >> 1) * 16 + 8 * odd;
    }
    const int q = j & 3;
    u32 out[4];
#pragma unroll
    for (int i = 0; i < 4; i++) out[i] = w[i];  // slot q: the lane's own word q
#pragma unroll
    for (int r = 1; r < 4; r++) {
        // Lane p = (q - r) & 3 sends its word (p + r) & 3 = q: this lane's block.
        const int p = (q - r) & 3;
        const u32 got = __shfl_sync(all, fw_word(w, (q + r) & 3), (lane & ~3) | p);
#pragma unroll
        for (int i = 0; i < 4; i++) out[i] = i == p ? got : out[i];
    }
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = out[i];
    return (j >> 2) * 32 + 8 * q;
}

// Rows of x (f32, `x_stride` apart, `K` inputs) as two bf16 parts each (`lo` 0: only
// the first, x rounded once to bf16, `SLUICE_CUDA_BF16_ACTIVATIONS=bf16`) in the A
// fragments' input order: FP4 (`fp8` 0) within each group of 32 inputs, k-step s holds
// inputs 8t + 2s, + 4 at logical 2t, 2t + 1 and 8t + 2s + 1, + 5 at 2t + 8, 2t + 9; FP8
// within each k-step of 16 inputs, inputs 4t, + 1 at 2t, 2t + 1 and 4t + 2, + 3 at
// 2t + 8, 2t + 9. A block of 128 threads a row (gridDim.y blocks a row at decode batch
// sizes, each a strided share of its inputs), a thread 8 inputs (a piece) at a time; the
// lanes trade words (`fw_gather_words`) so that each stores 16 contiguous bytes a plane
// (a warp's store one 512-byte run, where the words as computed would be 4-byte pieces
// 64 bytes apart: twice the write transactions). `rows_of` (or null): part row r is x's
// row rows_of[r] — a MoE block's routed rows gathered in expert order as they are split,
// instead of copied in f32 first (`gather_rows`). `up` (or null): split
// silu(min(x, limit)) · clamp(up, ±limit) instead (`swiglu_act`'s expression: an expert's
// SwiGLU output never written as f32).
extern "C" __global__ void __launch_bounds__(128) fp4wg_parts(u16* parts, const float* x, int rows, int K,
                                                              int x_stride, int plane, int fp8, int lo,
                                                              const int* rows_of, const float* up,
                                                              float limit) {
    pdl_begin();
    const int r = blockIdx.x, tid = threadIdx.x, pieces = K / 8;
    if (r >= rows) return;
    const long long src = (long long)(rows_of ? rows_of[r] : r) * x_stride;
    const float* xr = x + src;
    const long long row = (long long)r * K;
    // The warp's lanes walk their pieces together (j0 the same for all of them), so that
    // every lane of a quad is present for the trade; a quad's (a pair's) pieces are all in
    // range or all past it (K is a multiple of 128 for FP4, 64 for FP8).
    for (int j0 = blockIdx.y * 128 + (tid & ~31); j0 < pieces; j0 += 128 * gridDim.y) {
        const int j = j0 + (tid & 31);
        const bool on = j < pieces;
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (on) {
            const float4 a = *(const float4*)(xr + 8 * j), b = *(const float4*)(xr + 8 * j + 4);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
            if (up) {
                const float4 c = *(const float4*)(up + src + 8 * j), d = *(const float4*)(up + src + 8 * j + 4);
                const float w[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const float g = fminf(v[i], limit), u = fminf(fmaxf(w[i], -limit), limit);
                    v[i] = g / (1.0f + expf(-g)) * u;
                }
            }
        }
        u32 hw[4], lw[4];
#pragma unroll
        for (int s = 0; s < 2; s++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                // FP4: the pair of codes 2s + h and 2s + h + 4 (fw_codes_bf16's pairs);
                // FP8: inputs 4s + 2h and 4s + 2h + 1.
                const float x0 = fp8 ? v[4 * s + 2 * h] : v[2 * s + h];
                const float x1 = fp8 ? v[4 * s + 2 * h + 1] : v[2 * s + h + 4];
                const u16 h0 = f2bf(x0), h1 = f2bf(x1);
                const u16 l0 = f2bf(x0 - bf2f(h0)), l1 = f2bf(x1 - bf2f(h1));
                hw[2 * s + h] = (u32)h0 | ((u32)h1 << 16);
                lw[2 * s + h] = (u32)l0 | ((u32)l1 << 16);
            }
        }
        const long long e = row + fw_gather_words(hw, j, fp8);
        if (lo) fw_gather_words(lw, j, fp8);
        if (on) {
            *(uint4*)(parts + e) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
            if (lo) *(uint4*)(parts + (long long)plane * K + e) = make_uint4(lw[0], lw[1], lw[2], lw[3]);
        }
    }
}

template <bool FP8, bool PIPE, int BT, int WG, int NP>
__device__ void fw_gemm(const Fp4wgArgs& a) {
    constexpr int KC = FW_KC(FP8), S = FW_S(FP8, BT, WG), STAGE = FW_STAGE(FP8, BT, WG, NP), NB = KC / 64;
    constexpr int STEPS = KC / 16, BOX = FW_BOX(BT), B_BYTES = NP * NB * BOX, BN = FW_BN(WG), A_BYTES = FW_A_BYTES(WG);
    static_assert(!FP8 || WG == 2, "an FP8 block's 128 rows are one scale block row");
    extern __shared__ __align__(128) u8 fw_smem[];
    __shared__ __align__(8) u64 bars[S];
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int half = tid >> 7, wq = (tid >> 5) & 3;  // warpgroup, warp in it
    const int n0 = blockIdx.x * BN, K = a.K;
    // This block's slice of the chunks (all of them unless the product is split along K):
    // chunk c below is the slice's c-th, c0 + c of the row.
    const int z = blockIdx.z, all_chunks = K / KC;
    const int c0 = z * all_chunks / a.splits, chunks = (z + 1) * all_chunks / a.splits - c0;
    const int xk0 = (n0 / a.g_out) * K;  // the group's first input in the parts' rows
    const u32 base = (smem_addr(fw_smem) + 1023) & ~1023u;
    const u8* gbase = fw_smem + (base - smem_addr(fw_smem));
    const u32 bar0 = smem_addr(bars);
    if (tid == 0) {
        for (int i = 0; i < S; i++) wg_mbar_init(bar0 + 8 * i, 1);
#if __CUDA_ARCH__ >= 900
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
    }
    pdl_begin();  // the parts come from the kernel before
    const int* tile = a.tiles + 3 * blockIdx.y;
    const int expert = tile[0], p0 = tile[1], count = tile[2];
    const u8* w = (const u8*)a.wtab[2 * expert];
    const u8* sc = (const u8*)a.wtab[2 * expert + 1];
    __syncthreads();  // the barriers are initialised

    // Chunk c into stage c % S: thread 0 the parts (NP · NB boxes on the stage's
    // mbarrier), every thread two 16-byte pieces of codes, FP4: threads 0-127 a row's scales.
    // With one plane of parts (NP 1: the rows rounded once to bf16) the lo boxes are
    // neither copied nor multiplied: half the parts' bytes and half the tensor-core work.
    // NP is a template parameter: as a run-time flag it cost the two-part kernels ~7% of
    // an 8K prefill on the H200 (their SASS gained warpgroup waits and lost registers).
    const long long row_bytes = FP8 ? K : K / 2;
    constexpr bool two_parts = NP == 2;
    auto request = [&](int c) {
        if (c < chunks) {
            const int st = c % S;
            const u32 stage = base + st * STAGE;
            if (tid == 0) {
                wg_mbar_expect(bar0 + 8 * st, B_BYTES);
#pragma unroll
                for (int i = 0; i < (two_parts ? 2 : 1) * NB; i++)  // part i / NB, inputs 64 (i % NB) ..
                    wg_tma_load(stage + i * BOX, &a.parts, xk0 + (c0 + c) * KC + 64 * (i % NB), (i / NB) * a.plane + p0,
                                bar0 + 8 * st);
            }
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int piece = tid + i * FW_THREADS(WG), row = piece >> 2, q = piece & 3;
                const u32 dst = stage + B_BYTES + row * 64 + ((q ^ ((row >> 1) & 3)) << 4);
                cp_async<16>(dst, w + (n0 + row) * row_bytes + (c0 + c) * 64 + q * 16);
            }
            if (!FP8 && tid < BN)
                cp_async<4>(stage + B_BYTES + A_BYTES + tid * 4, sc + (n0 + tid) * (K / 32) + (c0 + c) * 4);
        }
        cp_async_commit();  // one group a chunk, empty past the end, so the waits count chunks
    };
    // PIPE: a chunk's codes are converted while the chunk before is still multiplied, so
    // only S - 2 chunks are requested ahead (a stage is free once its products are done).
    constexpr int AHEAD = PIPE ? S - 2 : S - 1;
    for (int c = 0; c < AHEAD; c++) request(c);

    const int rlo = half * 64 + wq * 16 + g;  // this thread's rows of the block: rlo, rlo + 8
    const int swz = (rlo >> 1) & 3;           // rows rlo and rlo + 8 share it
    float acc[BT / 2];
#pragma unroll
    for (int i = 0; i < BT / 2; i++) acc[i] = 0.0f;
    // Chunk c with its A fragments in `f` (one of two sets, so that the next chunk's can be
    // written while this one's wgmmas still read theirs).
    auto chunk = [&](int c, u32 (&f)[STEPS][4]) {
        const int st = c % S;
        cp_async_wait<AHEAD - 1>();                 // this thread's copies of chunk c
        __syncthreads();                            // everyone's; the stage requested next is done
        wg_mbar_wait(bar0 + 8 * st, (c / S) & 1);   // the parts of chunk c
        request(c + AHEAD);                         // into the stage of chunk c + AHEAD - S, done
        const u32 stage = base + st * STAGE;
        const u8* codes = gbase + st * STAGE + B_BYTES;
        if constexpr (FP8) {
            // The block's 128 rows are one scale block row; a chunk is half a scale block.
            const float* bs = (const float*)sc + (long long)(n0 / 128) * (K / 128) + ((c0 + c) * KC) / 128;
            const u32 fs = fw_block_scale2(__ldg(bs));
#pragma unroll
            for (int q = 0; q < 4; q++) {  // k-step q: 16 bytes of a row
                const int off = ((q ^ swz) << 4) + 4 * t;
                const u32 wl = *(const u32*)(codes + rlo * 64 + off), wh = *(const u32*)(codes + (rlo + 8) * 64 + off);
                f[q][0] = e4m3x2_bf16(wl, 0, fs);
                f[q][1] = e4m3x2_bf16(wh, 0, fs);
                f[q][2] = e4m3x2_bf16(wl, 1, fs);
                f[q][3] = e4m3x2_bf16(wh, 1, fs);
            }
        } else {
            const u32 s_lo = *(const u32*)(codes + A_BYTES + rlo * 4);
            const u32 s_hi = *(const u32*)(codes + A_BYTES + (rlo + 8) * 4);
#pragma unroll
            for (int q = 0; q < 4; q++) {  // scale group q: 16 bytes of a row, two k-steps
                const int off = ((q ^ swz) << 4) + 4 * t;
                const u32 wl = *(const u32*)(codes + rlo * 64 + off), wh = *(const u32*)(codes + (rlo + 8) * 64 + off);
                const u32 fl = fw_scale2(s_lo, q), fh = fw_scale2(s_hi, q);
                // k-step 2q + s: codes 2s and 2s + 4 of the lane's eight, then 2s + 1 and 2s + 5.
                const u32 wl8 = wl >> 8, wh8 = wh >> 8;
                f[2 * q][0] = fw_codes_bf16<6>(wl & 0x000F000Fu, fl);
                f[2 * q][1] = fw_codes_bf16<6>(wh & 0x000F000Fu, fh);
                f[2 * q][2] = fw_codes_bf16<2>(wl & 0x00F000F0u, fl);
                f[2 * q][3] = fw_codes_bf16<2>(wh & 0x00F000F0u, fh);
                f[2 * q + 1][0] = fw_codes_bf16<6>(wl8 & 0x000F000Fu, fl);
                f[2 * q + 1][1] = fw_codes_bf16<6>(wh8 & 0x000F000Fu, fh);
                f[2 * q + 1][2] = fw_codes_bf16<2>(wl8 & 0x00F000F0u, fl);
                f[2 * q + 1][3] = fw_codes_bf16<2>(wh8 & 0x00F000F0u, fh);
            }
        }
        wg_fence();
        if constexpr (two_parts) {
#pragma unroll
            for (int j = 0; j < STEPS; j++) {
                const u32 b = stage + (j >> 2) * BOX + (j & 3) * 32;  // box j / 4, 32 bytes (j % 4) in
                fw_mma(acc, f[j], wg_desc(b, 16, 1024, 1));
                fw_mma(acc, f[j], wg_desc(b + NB * BOX, 16, 1024, 1));
            }
        } else {
#pragma unroll
            for (int j = 0; j < STEPS; j++) fw_mma(acc, f[j], wg_desc(stage + (j >> 2) * BOX + (j & 3) * 32, 16, 1024, 1));
        }
        wg_commit();
        if (PIPE) wg_wait<1>();  // the chunk before is done: its fragments and stage are free
        else wg_wait<0>();
    };
    u32 fa[STEPS][4], fb[STEPS][4];
    for (int c = 0; c < chunks; c += 2) {
        chunk(c, fa);
        if (c + 1 < chunks) chunk(c + 1, fb);
    }
    wg_wait<0>();
    fw_hold(acc);
    cp_async_wait<0>();
    // Sums j (j = 4i + e): token 8i + 2t + (e & 1), row rlo + 8 (e >> 1); a K slice's
    // into its own plane of partial sums (fw_split_sum adds them).
    const int o = n0 + rlo;
    float* out = a.out + (long long)z * a.split_stride;
#pragma unroll
    for (int i = 0; i < BT / 8; i++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int tok = 8 * i + 2 * t + e;
            if (tok < count) {
                float* dst = out + (long long)(p0 + tok) * a.out_stride + o;
                dst[0] = acc[4 * i + e];
                dst[8] = acc[4 * i + 2 + e];
            }
        }
    }
}

// FP4 experts (grouped tiles) and FP8 products (plain or grouped by outputs); `_p`: the
// next chunk's codes converted while this one's products run; `_n64`: tiles of at most
// 64 rows (an expert's last rows), half the products of a 128-row tile. Each kernel comes
// twice: over two planes of parts (its name) and over one (`fp4wg1_…`, `fp8wg1_…`: the
// rows rounded once to bf16).
#define FW_KERNEL_NP(NAME, FP8, PIPE, BT, WG, NP)                                                             \
    extern "C" __global__ void __launch_bounds__(FW_THREADS(WG), 1) NAME(const __grid_constant__ Fp4wgArgs a) { \
        fw_gemm<FP8, PIPE, BT, WG, NP>(a);                                                                    \
    }
#define FW_KERNEL_WG(NAME, ONE, FP8, PIPE, BT, WG) \
    FW_KERNEL_NP(NAME, FP8, PIPE, BT, WG, 2)       \
    FW_KERNEL_NP(ONE, FP8, PIPE, BT, WG, 1)
#define FW_KERNEL(NAME, ONE, FP8, PIPE, BT) FW_KERNEL_WG(NAME, ONE, FP8, PIPE, BT, 2)
FW_KERNEL(fp4wg_gemm, fp4wg1_gemm, false, false, 128)
FW_KERNEL(fp8wg_gemm, fp8wg1_gemm, true, false, 128)
FW_KERNEL(fp4wg_gemm_p, fp4wg1_gemm_p, false, true, 128)
FW_KERNEL(fp8wg_gemm_p, fp8wg1_gemm_p, true, true, 128)
FW_KERNEL(fp4wg_gemm_n64, fp4wg1_gemm_n64, false, false, 64)
FW_KERNEL(fp8wg_gemm_n64, fp8wg1_gemm_n64, true, false, 64)
FW_KERNEL(fp4wg_gemm_p_n64, fp4wg1_gemm_p_n64, false, true, 64)
FW_KERNEL(fp8wg_gemm_p_n64, fp8wg1_gemm_p_n64, true, true, 64)
// FP4 tiles of at most 32 rows (`_n32`): a small prefill's experts, each a few rows.
FW_KERNEL(fp4wg_gemm_n32, fp4wg1_gemm_n32, false, false, 32)
FW_KERNEL(fp4wg_gemm_p_n32, fp4wg1_gemm_p_n32, false, true, 32)
// FP4 tiles of at most 16 rows (`_n16`) and four warpgroups a block (`w`: 256 outputs):
// the tile's parts, read again by every block of the expert, are then fewer bytes for
// each byte of codes.
FW_KERNEL_WG(fp4wg_gemm_n32w, fp4wg1_gemm_n32w, false, false, 32, 4)
FW_KERNEL_WG(fp4wg_gemm_p_n32w, fp4wg1_gemm_p_n32w, false, true, 32, 4)
FW_KERNEL(fp4wg_gemm_n16, fp4wg1_gemm_n16, false, false, 16)
FW_KERNEL(fp4wg_gemm_p_n16, fp4wg1_gemm_p_n16, false, true, 16)
FW_KERNEL_WG(fp4wg_gemm_n16w, fp4wg1_gemm_n16w, false, false, 16, 4)
FW_KERNEL_WG(fp4wg_gemm_p_n16w, fp4wg1_gemm_p_n16w, false, true, 16, 4)
// Tiles of 256 rows over one plane of parts (`_n256`: a prefill's FP8 projections and its
// experts of more than 192 rows, in bf16 activations; two planes of 256-row boxes would
// not fit shared memory).
FW_KERNEL_NP(fp8wg1_gemm_p_n256, true, true, 256, 2, 1)
FW_KERNEL_NP(fp4wg1_gemm_p_n256, false, true, 256, 2, 1)

// out[r][c] (out_stride apart) = the sum over z in order of part[z][r][c] (each plane
// rows × n, the K slices' sums of a product split along K): one thread an output.
extern "C" __global__ void fw_split_sum(float* out, int out_stride, const float* part, int rows, int n, int splits) {
    pdl_begin();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * n) return;
    const int plane = rows * n;
    float acc = part[i];
    for (int z = 1; z < splits; z++) acc += part[(long long)z * plane + i];
    out[(long long)(i / n) * out_stride + i % n] = acc;
}
