// FP8 products and SwiGLU pairs of one or two decode rows on Hopper's warpgroup
// tensor-core instruction (wgmma, sm_90a): kernels/src/cuda/gemv_f8wg.rs plans them;
// docs/cuda.md ("gemv_f8wg") says when they run.
//
// Why a third FP8 gemv: the two before (decode2.cu's v2 and gemv_f8mma.cu) issue the
// warp-level mma, which sm_90 runs for e4m3 operands as f16 unpacks and two f16 mmas;
// Nsight Compute counted ~157 warp instructions for every 16 rows × 1024 bytes of weight
// a warp multiplies in gemv_f8mma, 10.6 cycles apart, so those kernels are bound by
// their instruction chains at 37-42% of the DRAM bandwidth. One wgmma reads a 64-row ×
// 32-byte e4m3 tile straight from shared memory (2 KB, no unpack, no register fragment),
// so a chunk of 64 rows × 128 inputs (8 KB) costs one tensor copy (TMA), four wgmmas
// and a few adds.
//
// Layout: a block is one warpgroup (128 threads). A tile is 64 output rows; a chunk is
// the tile's 128 inputs of one FP8 scale block (one scale for the chunk). Thread 0 copies
// each chunk with the tensor memory accelerator (`cp.async.bulk.tensor`, a 64-row ×
// 128-byte box of the weight's tensor map, gemv_f8wg.rs) into a 1024-byte-aligned ring
// slot in the 128-byte-swizzled layout that wgmma reads (K-major, rows 128 bytes apart,
// 16-byte pieces permuted by row; a k-step of 32 inputs starts 32 bytes further); the
// copy signals the slot's mbarrier with its byte count, and every thread waits on that
// barrier. The copies are in the async proxy, as the wgmma's reads are, so no proxy
// fence is paid a chunk (a `cp.async` version of this kernel fenced each chunk — ptxas
// emits a membar for it, which by all appearances waited for every copy in flight — and
// ran 2-3 times slower than gemv_f8mma; docs/perf.md). A ring of S
// chunks (8, or 4 so that more blocks fit an SM) keeps S - 2 requested ahead across tiles.
//
// Activations: the mma's B is 8 "rows" of n × K, e4m3: each decode row r is scaled by a
// power of two s_r (its largest magnitude over the block's inputs lands in [128, 256))
// and written as three e4m3 parts (x·s = hi + mid + lo, each the e4m3 rounding of what
// the parts before left: gemv_f8mma.cu's `f8_pair`), parts of row r in n = 3r .. 3r + 2,
// the rest zero, in the canonical layout without swizzle: one "core matrix" of 8 parts ×
// 16 inputs every 128 bytes (descriptor: 128 bytes between core matrices along K). They
// are ordinary stores, so a proxy fence follows each staging.
//
// Sums: each wgmma (32 inputs) writes fresh registers (scale-d = 0) that are added in
// f32 to the tile's sums once it completes — the tensor core's own accumulation of FP8
// products keeps fewer bits than f32 (DeepSeek-V3 report §3.3.2), so it never spans more
// than one instruction — and each chunk's sum is multiplied by its weight scale block's
// scale. A chunk's four wgmmas are issued together and waited for before the next chunk
// (ptxas serialises every wgmma of a kernel that reads one set of results while another
// set is in flight; the copies of the chunks ahead stream meanwhile, and the other blocks
// of the SM — several with rings of 4 — fill the wait). At a tile's end the warps' sums
// (thread (w, l) holds rows 16w + l/4 and + 8, parts 2(l%4) and + 1) meet in shared
// memory; a row's parts are added and divided by s_r.
//
// K split: where a product has too few tiles to fill the GPU, a thread-block cluster of
// KS blocks takes each tile, block rank s the inputs [s·K/KS, (s+1)·K/KS) with its own
// activation scales; after a cluster barrier block s sums rows [s·64/KS, (s+1)·64/KS) of
// the tile over the ranks in rank order (gemm_rows.cu's `gr_cluster_*`), so results do
// not depend on scheduling. A cluster takes a contiguous run of tiles.
// Grouped products (wo_a: group g of output rows reads x[:, g·K .. g·K + K]) re-stage
// the activations when a tile starts a new group. SwiGLU pairs (NM 2, the shared
// expert's gate and up): each chunk of w1 is followed in the ring by the same chunk of
// w3 (its own tensor map and scales), the two keep separate sums, and the tile's output
// is SwiGLU of the pair's (cluster-summed) results. Several products of one input
// (MANY: a layer's `wq_a` and `wkv` at decode, `gemv_f8wg_many_*`) are one walk over their
// tiles in order, each tile reading its own matrix's tensor map, scales and output: one
// launch's ramp and tail instead of one a product (the small ones are latency-bound).

#define WG_THREADS 128
#define WG_TILE 64
#define WG_KC 128
#define WG_CHUNK (WG_TILE * WG_KC)

// wgmma needs the sm_90a target (nvrtc.rs compiles Hopper for compute_90a); elsewhere
// these kernels are never launched (gemv_f8wg.rs) and trap.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_AVAILABLE 1
#else
#define WG_AVAILABLE 0
#endif

// A wgmma's accumulator registers d[i..i+N) as inline-asm operands (read and written).
#define WG_D8(d, i)                                                                                          \
    "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), \
        "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define WG_D16(d, i) WG_D8(d, i), WG_D8(d, (i) + 8)
#define WG_D32(d, i) WG_D16(d, i), WG_D16(d, (i) + 16)
#define WG_D64(d, i) WG_D32(d, i), WG_D32(d, (i) + 32)
#define WG_D128(d) WG_D64(d, 0), WG_D64(d, 64)
// Their placeholders in the instruction's text: %0..%31, %32..%63, %64..%127.
#define WG_R0_31 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_R32_63 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_R64_127 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
                   "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
                   "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
                   "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// D (64 × 256, f32) += A · B over k 16, A (bf16) from registers, B (bf16) from shared
// memory, K-major (`TRANS_B` 0) or MN-major (1): the prefill products' 256-row tiles
// (moe_fp4wg.cu) and the warpgroup attention's P · V (attention_wg.cu).
template <int TRANS_B>
__device__ __forceinline__ void wg_mma_n256_rs(float (&d)[128], const u32 (&a)[4], u64 db) {
#if WG_AVAILABLE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{" WG_R0_31 ", " WG_R32_63 ", " WG_R64_127 "}, "
        "{%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n"
        : WG_D128(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1), "n"(TRANS_B));
#else
    __trap();
#endif
}

// A shared-memory matrix descriptor: byte offsets between core matrices along K (`lbo`,
// unused with swizzling) and along M or N (`sbo`); `swizzle`: 0 none, 1 128-byte.
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo, u32 swizzle) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | ((u64)swizzle << 62);
}

// A tensor map (CUtensorMap: 128 opaque bytes, made on the host by cuTensorMapEncodeTiled),
// and the kernels' argument block: the weight's map and `F8Args` (`WgArgs` in gemv_f8wg.rs).
struct __align__(64) WgTensorMap {
    u64 opaque[16];
};
struct __align__(64) WgArgs {
    WgTensorMap map;
    F8Args a;
};
// A SwiGLU pair (gate w1 in `map` and `a.scales`, up w3 in `map3` and `scales3`):
// out = silu(min(x·w1ᵀ, limit)) · clamp(x·w3ᵀ, ±limit). `WgPairArgs` in gemv_f8wg.rs.
struct __align__(64) WgPairArgs {
    WgTensorMap map, map3;
    F8Args a;
    const float* scales3;
    float limit;
    unsigned pad[13];  // zero (the host's struct has no undefined padding bytes)
};

// Up to WG_MANY_MAX products of the same activations in one launch (`WgManyArgs` in
// gemv_f8wg.rs): matrix m's tiles are [first[m], first[m + 1]) of the walk (every matrix
// but the last has whole 128-row scale blocks, so a tile's scale row is its matrix's
// (tile - first[m]) / 2), its output `outs[m]` of `n[m]` values a row. `a` carries the
// activations, K, the rows and the tile total; its `out`, `w` and `scales` are unused.
#define WG_MANY_MAX 4
struct __align__(64) WgManyArgs {
    WgTensorMap maps[WG_MANY_MAX];
    F8Args a;
    const float* scales[WG_MANY_MAX];
    float* outs[WG_MANY_MAX];
    int first[WG_MANY_MAX + 1];
    int n[WG_MANY_MAX];
    int count;
    unsigned pad[6];  // zero (the host's struct has no undefined padding bytes)
};

// mbarriers (sm_90): init with an arrival count, arrive announcing the bytes a copy will
// complete, wait for a phase.
__device__ __forceinline__ void wg_mbar_init(u32 bar, u32 count) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void wg_mbar_expect(u32 bar, u32 bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void wg_mbar_wait(u32 bar, u32 parity) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#endif
}
// Box (x = byte offset along K, y = row) of the map into shared memory at `dst`,
// completing on the mbarrier `bar`.
__device__ __forceinline__ void wg_tma_load(u32 dst, const WgTensorMap* map, int x, int y, u32 bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            dst),
        "l"(map), "r"(x), "r"(y), "r"(bar)
        : "memory");
#endif
}

// D = A · B (64 × 8 × 32, e4m3, f32 sums; D's old values are not read).
__device__ __forceinline__ void wg_mma(float (&d)[4], u64 da, u64 db) {
#if WG_AVAILABLE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db), "r"(0));
#else
    __trap();
#endif
}
__device__ __forceinline__ void wg_fence() {
#if WG_AVAILABLE
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if WG_AVAILABLE
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wg_wait() {
#if WG_AVAILABLE
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// The compiler sees a wgmma's registers written when it is issued; this ties their reads
// to after the wait that really completes them.
__device__ __forceinline__ void wg_hold(float (&d)[4]) {
    asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])::"memory");
}
// A tile's m64n8 sums `acc` (thread (w, l) holds rows 16w + l/4 and + 8, columns 2(l%4)
// and + 1) into `rd` (64 rows of 9 floats: padded against bank conflicts), then zeroed for
// the next tile. Every thread of the warpgroup calls it; a barrier must follow.
__device__ __forceinline__ void wg_sums_to_shared(float* rd, float (&acc)[4]) {
    const int lane = threadIdx.x & 31, row = (threadIdx.x >> 5) * 16 + (lane >> 2), q = lane & 3;
    rd[row * 9 + 2 * q] = acc[0];
    rd[row * 9 + 2 * q + 1] = acc[1];
    rd[(row + 8) * 9 + 2 * q] = acc[2];
    rd[(row + 8) * 9 + 2 * q + 1] = acc[3];
#pragma unroll
    for (int i = 0; i < 4; i++) acc[i] = 0.0f;
}

// Shared-memory writes of ordinary stores (the staged activations) seen by the wgmmas.
__device__ __forceinline__ void wg_proxy_fence() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Each thread's largest magnitudes m[r] of R rows → every row's power-of-two scale s[r]
// (in every thread; the row's largest magnitude lands in [128, 256), 1 for a row of zeros
// or non-finite values) and 1 / s into inv_s (thread 0), through red_max. The same rule
// as gemv_f8mma.cu's staging, whose compiled code is left as measured.
template <int R>
__device__ __forceinline__ void wg_row_scales(float (&m)[R], float* red_max, float (&s)[R], float* inv_s) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int r = 0; r < R; r++) {
        m[r] = warp_max(m[r]);
        if (lane == 0) red_max[warp * R + r] = m[r];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; r++) {
        float mm = 0.0f;
#pragma unroll
        for (int w = 0; w < WG_THREADS / 32; w++) mm = fmaxf(mm, red_max[w * R + r]);
        int e = 0;
        frexpf(mm, &e);  // mm = f · 2^e, f in [0.5, 1): mm · 2^(8 - e) in [128, 256)
        const bool usable = mm > 0.0f && mm < 3.0e38f;
        s[r] = usable ? ldexpf(1.0f, 8 - e) : 1.0f;
        if (tid == 0) inv_s[r] = usable ? ldexpf(1.0f, e - 8) : 1.0f;
    }
}

// Rows 0..R-1 of x (inputs [0, KB) from `x`, rows `x_stride` apart) as three e4m3 parts
// each into `act` (the canonical layout above), 1 / s_r into inv_s. Starts and ends with
// a barrier (the caller fences the async proxy after it).
template <int R>
__device__ void wg_stage_activations(u8* act, const float* x, int x_stride, int KB, float* inv_s, float* red_max) {
    const int tid = threadIdx.x;
    __syncthreads();  // the tile before has read inv_s and the wgmmas before have read act
    // Four loads in flight a thread (the block has 128 threads for up to 8,192 inputs).
    constexpr int STEP = 4 * WG_THREADS;
    float m[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        m[r] = 0.0f;
        for (int k0 = 4 * tid; k0 < KB; k0 += 4 * STEP) {
            float4 v[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                v[j] = k0 + j * STEP < KB ? *(const float4*)(x + (long long)r * x_stride + k0 + j * STEP)
                                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int j = 0; j < 4; j++)
                m[r] = fmaxf(m[r], fmaxf(fmaxf(fabsf(v[j].x), fabsf(v[j].y)), fmaxf(fabsf(v[j].z), fabsf(v[j].w))));
        }
    }
    float s[R];
    wg_row_scales<R>(m, red_max, s, inv_s);
#pragma unroll 4
    for (int k = 4 * tid; k < KB; k += 4 * WG_THREADS) {
        u8* piece = act + (k >> 4) * 128 + (k & 15);  // part n of inputs k..k+3 at piece + 16n
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float4 v4 = *(const float4*)(x + (long long)r * x_stride + k);
            float v[4] = {v4.x * s[r], v4.y * s[r], v4.z * s[r], v4.w * s[r]};
#pragma unroll
            for (int p = 0; p < 3; p++) {
                const u32 part = f8_pair(v[0], v[1]) | (f8_pair(v[2], v[3]) << 16);
                u32 h01, h23;  // the codes back as f16 pairs (exact)
                d2_fp8_pairs_cvt(part, h01, h23);
                v[0] -= f16lo_to_f32(h01);  // exact: what this part left
                v[1] -= f16hi_to_f32(h01);
                v[2] -= f16lo_to_f32(h23);
                v[3] -= f16hi_to_f32(h23);
                *(u32*)(piece + 16 * (3 * r + p)) = part;
            }
        }
#pragma unroll
        for (int n = 3 * R; n < 8; n++) *(u32*)(piece + 16 * n) = 0u;
    }
    __syncthreads();
}

// One block's walk over its tiles (KS: blocks of a cluster splitting K, 1: no cluster;
// NM 2: a SwiGLU pair, each chunk of w1 followed by the same chunk of w3; MANY: the tiles
// of several products, `many`).
template <int R, int KS, int S, int NM = 1, bool MANY = false>
struct F8wg {
    const F8Args& a;
    const WgManyArgs* many;  // MANY: the products
    u8* act;
    float* red;      // [NM][WG_TILE][9]
    float* part_sm;  // [2][NM][R][WG_TILE]
    float* red_max;
    float* inv_s;
    const WgTensorMap* map;
    const WgTensorMap* map3;  // NM 2: w3's
    const float* scales3;     // NM 2: w3's scales
    float limit;              // NM 2: the SwiGLU clamp
    u32 ring_base, act_base, bar_base;  // ring slots 1024-byte aligned; S mbarriers of 8 bytes
    int tid, lane, warp, rank, K, KB, kbase, chunks, items;
    // Request side (thread 0): chunk after chunk of the block's tiles (each matrix's).
    int requested = 0, req_t, req_c = 0, req_m = 0, req_slot = 0;
    // Multiply side.
    int group, group_end;
    float acc[NM][4] = {};
    float sets[4][4] = {};
    int t, c = 0, m = 0, slot = 0, buf = 0;
    u32 phase = 0;  // parity of the current slot's mbarrier phase
    const float* scale_row;   // the current tile's scales of this block's K part
    const float* scale_row3;  // NM 2: the same of w3
    float next_sc;            // the scale of the chunk the next step multiplies

    // MANY: the product tile `tt` of the walk belongs to.
    __device__ __forceinline__ int product_of(int tt) const {
        int p = 0;
        if constexpr (MANY) {
#pragma unroll
            for (int i = 1; i < WG_MANY_MAX; i++) p += i < many->count && tt >= many->first[i];
        }
        return p;
    }
    // The scales of tile `tt`'s row of 128-row blocks, from this block's K part on.
    __device__ __forceinline__ const float* scale_row_of(int tt) const {
        if constexpr (MANY) {
            const int p = product_of(tt);
            return many->scales[p] + (long long)((tt - many->first[p]) >> 1) * (K / WG_KC) + kbase / WG_KC;
        }
        return a.scales + (long long)(tt >> 1) * (K / WG_KC) + kbase / WG_KC;
    }
    // Row r, output o of the current tile.
    __device__ __forceinline__ float* out_at(int r, int o) const {
        if constexpr (MANY) {
            const int p = product_of(t);
            return many->outs[p] + (long long)r * many->n[p] + (t - many->first[p]) * WG_TILE + o;
        }
        return a.out + (long long)r * a.out_stride + t * WG_TILE + o;
    }

    __device__ void request_next() {
        if (tid == 0 && requested < items) {
            const u32 bar = bar_base + 8 * req_slot;
            wg_mbar_expect(bar, WG_CHUNK);
            const WgTensorMap* mp = NM == 2 && req_m == 1 ? map3 : map;
            int y = req_t * WG_TILE;
            if constexpr (MANY) {
                const int p = product_of(req_t);
                mp = &many->maps[p];
                y = (req_t - many->first[p]) * WG_TILE;
            }
            wg_tma_load(ring_base + req_slot * WG_CHUNK, mp, kbase + req_c * WG_KC, y, bar);
            req_m++;
            if (req_m == NM) {
                req_m = 0;
                req_c++;
                req_t += req_c == chunks;
                req_c = req_c == chunks ? 0 : req_c;
            }
            req_slot = req_slot == S - 1 ? 0 : req_slot + 1;
            requested++;
        }
    }

    __device__ void stage() {
        wg_stage_activations<R>(act, a.x + (long long)group * K + kbase, a.x_stride, KB, inv_s, red_max);
    }

    // Adds the completed wgmmas (chunk scale `sc`) to the sums of matrix `mm` (indexed by
    // constants: a run-time index would put acc in local memory).
    __device__ __forceinline__ void retire(float sc, int mm) {
#pragma unroll
        for (int s = 0; s < 4; s++) wg_hold(sets[s]);
        auto add = [&](float (&ac)[4]) {
#pragma unroll
            for (int i = 0; i < 4; i++) ac[i] = fmaf(sets[0][i] + sets[1][i] + (sets[2][i] + sets[3][i]), sc, ac[i]);
        };
        if (NM == 2 && mm == 1) add(acc[NM - 1]);
        else add(acc[0]);
    }
    // A tile's output value from its matrices' sums (NM 2: SwiGLU of the pair).
    __device__ __forceinline__ float emit_value(const float (&v)[NM]) const {
        if (NM == 2) return d2_swiglu(v[0], v[NM - 1], limit);
        return v[0];
    }

    // The tile's sums to the output (through the cluster when K is split).
    __device__ void finish_tile() {
        // (Column n of the sums is part n % 3 of row n / 3.)
#pragma unroll
        for (int mm = 0; mm < NM; mm++) wg_sums_to_shared(red + mm * WG_TILE * 9, acc[mm]);
        __syncthreads();
        if (tid < WG_TILE * R) {
            const int o = tid & (WG_TILE - 1), r = tid / WG_TILE;
            float v[NM];
#pragma unroll
            for (int mm = 0; mm < NM; mm++) {
                const float* p = red + mm * WG_TILE * 9 + o * 9 + 3 * r;
                v[mm] = (p[0] + p[1] + p[2]) * inv_s[r];
                if (KS > 1) part_sm[((buf * NM + mm) * R + r) * WG_TILE + o] = v[mm];
            }
            if (KS == 1) *out_at(r, o) = emit_value(v);
        }
        if (KS > 1) {
            // Every block's part of the tile, then this block's rows of it summed in rank
            // order. The other buffer takes the next tile's parts: this one is read until
            // the blocks reach the next tile's cluster barrier.
            gr_cluster_sync();
            constexpr int SLICE = WG_TILE / KS;
            if (tid < SLICE * R) {
                const int o = rank * SLICE + tid % SLICE, r = tid / SLICE;
                float v[NM];
#pragma unroll
                for (int mm = 0; mm < NM; mm++) {
                    const u32 local = smem_addr(&part_sm[((buf * NM + mm) * R + r) * WG_TILE + o]);
                    v[mm] = 0.0f;
#pragma unroll
                    for (int s = 0; s < KS; s++) v[mm] += gr_cluster_load(local, s);
                }
                *out_at(r, o) = emit_value(v);
            }
            buf ^= 1;
        }
    }

    // One chunk of the block's walk (`more`: another chunk follows it).
    __device__ __forceinline__ void step(bool more) {
        __syncthreads();  // every thread is done with the slot of two chunks back
        request_next();
        wg_mbar_wait(bar_base + 8 * slot, phase);  // this chunk is in
        if (c == 0 && m == 0 && t * WG_TILE >= group_end) {
            // A new group's activations (the tile before waited for all its wgmmas).
            group = t * WG_TILE / a.g_out;
            group_end = (group + 1) * a.g_out;
            stage();
            wg_proxy_fence();
            __syncthreads();
        }
        // This chunk's scale was loaded a step ago; the next one's is requested now (its
        // latency would otherwise sit between the wgmmas' end and the sums).
        const float sc = next_sc;
        if (more) {
            // The next step: this chunk of w3 (a pair's first matrix done), else the next
            // chunk of w1 (or of the next tile, whose scale row follows when t is odd).
            const float* next = NM == 2 && m == 0 ? scale_row3 + c
                                : c + 1 < chunks      ? scale_row + c + 1
                                : MANY                ? scale_row_of(t + 1)
                                                      : scale_row + (t & 1 ? K / WG_KC : 0);
            next_sc = __ldg(next);
        }
        const u32 a_addr = ring_base + slot * WG_CHUNK;
        const u32 b_addr = act_base + c * (WG_KC * 8);
        wg_fence();
#pragma unroll
        for (int s = 0; s < 4; s++)
            wg_mma(sets[s], wg_desc(a_addr + s * 32, 16, 1024, 1), wg_desc(b_addr + s * 256, 128, 1024, 0));
        wg_commit();
        wg_wait<0>();
        retire(sc, m);
        if (NM == 2 && m == 0) {
            m = 1;
        } else if (c == chunks - 1) {
            m = 0;
            finish_tile();
            c = 0;
            t++;
            scale_row = scale_row_of(t);
            if (NM == 2) scale_row3 = scales3 + (long long)(t >> 1) * (K / WG_KC) + kbase / WG_KC;
        } else {
            m = 0;
            c++;
        }
        phase ^= slot == S - 1;
        slot = slot == S - 1 ? 0 : slot + 1;
    }
};

// ARGS: WgArgs (one matrix), WgPairArgs (a SwiGLU pair, NM 2) or WgManyArgs (MANY).
template <int R, int KS, int S, int NM, typename ARGS, bool MANY = false>
__device__ void f8wg_gemv(const ARGS& args) {
    const F8Args& a = args.a;
    extern __shared__ __align__(128) u8 wg_smem[];
    __shared__ float red[NM * WG_TILE * 9];
    __shared__ float part_sm[2 * NM * R * WG_TILE];
    __shared__ float red_max[(WG_THREADS / 32) * R];
    __shared__ float inv_s[R];
    __shared__ __align__(8) u64 bars[S];
    F8wg<R, KS, S, NM, MANY> b{a};
    if constexpr (MANY) {
        b.many = &args;
    } else {
        b.map = &args.map;
    }
    if constexpr (NM == 2) {
        b.map3 = &args.map3;
        b.scales3 = args.scales3;
        b.limit = args.limit;
    }
    // The ring's slots 1024-byte aligned (the 128-byte swizzle repeats every 8 rows of
    // 128 bytes; the host adds 1 KiB to the dynamic shared memory for this).
    const u32 base = smem_addr(wg_smem), aligned = (base + 1023) & ~1023u;
    b.ring_base = aligned;
    b.act = wg_smem + (aligned - base) + S * WG_CHUNK;
    b.act_base = smem_addr(b.act);
    b.bar_base = smem_addr(bars);
    b.red = red;
    b.part_sm = part_sm;
    b.red_max = red_max;
    b.inv_s = inv_s;
    b.tid = threadIdx.x;
    b.lane = b.tid & 31;
    b.warp = b.tid >> 5;
    b.rank = KS > 1 ? (int)(blockIdx.x % KS) : 0;
    const int cluster = blockIdx.x / KS, clusters = gridDim.x / KS;
    b.K = a.k;
    b.KB = a.k / KS;
    b.kbase = b.rank * b.KB;
    b.chunks = b.KB / WG_KC;
    const int t0 = (int)((long long)a.tiles * cluster / clusters);
    const int t1 = (int)((long long)a.tiles * (cluster + 1) / clusters);
    b.items = (t1 - t0) * b.chunks * NM;
    b.req_t = t0;
    if (b.tid == 0) {
        for (int i = 0; i < S; i++) wg_mbar_init(b.bar_base + 8 * i, 1);
#if __CUDA_ARCH__ >= 900
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
    }
    __syncthreads();
    // Weights never depend on the kernel before: their first chunks are requested before
    // waiting for it.
    for (int i = 0; i < S - 2; i++) b.request_next();
    pdl_begin();
    if (b.items == 0) return;  // every block of a cluster has the same tiles: none waits for this one
    b.group = a.g_out > 0 ? t0 * WG_TILE / a.g_out : 0;
    b.group_end = a.g_out > 0 ? (b.group + 1) * a.g_out : 1 << 30;  // first output row of the next group
    b.t = t0;
    b.scale_row = b.scale_row_of(t0);
    if constexpr (NM == 2) b.scale_row3 = args.scales3 + (long long)(t0 >> 1) * (b.K / WG_KC) + b.kbase / WG_KC;
    b.next_sc = __ldg(b.scale_row);
    b.stage();
    wg_proxy_fence();  // the staged parts are read by the wgmmas (the loop's barrier follows)
    for (int it = 0; it < b.items; it++) b.step(it + 1 < b.items);
    // No block leaves while another still reads its parts.
    if (KS > 1) gr_cluster_sync();
}

#if __CUDA_ARCH__ >= 900
#define WG_CLUSTER(KS) __cluster_dims__(KS, 1, 1)
#else
#define WG_CLUSTER(KS)
#endif

#define WG_KERNEL(NAME, R, KS, S, CLUSTER)                                                                     \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) CLUSTER NAME(const __grid_constant__ WgArgs args) { \
        f8wg_gemv<R, KS, S, 1>(args);                                                                                \
    }
#define WG_PAIR_KERNEL(NAME, R, KS, CLUSTER)                                                    \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) CLUSTER NAME(                   \
        const __grid_constant__ WgPairArgs args) {                                              \
        f8wg_gemv<R, KS, 4, 2>(args);                                                           \
    }

#define WG_MANY_KERNEL(NAME, R, KS, CLUSTER)                                                    \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) CLUSTER NAME(                   \
        const __grid_constant__ WgManyArgs args) {                                              \
        f8wg_gemv<R, KS, 4, 1, WgManyArgs, true>(args);                                         \
    }

// Every row count (1, 2) and K split (1, 2, 4, 8: blocks of a cluster) of one kind of
// kernel: KERNEL(NAME, R, KS, CLUSTER) for the names P r{1,2}_k{1,2,4,8}.
#define WG_EVERY_SPLIT(KERNEL, P)                \
    KERNEL(P##r1_k1, 1, 1, )                     \
    KERNEL(P##r1_k2, 1, 2, WG_CLUSTER(2))        \
    KERNEL(P##r1_k4, 1, 4, WG_CLUSTER(4))        \
    KERNEL(P##r1_k8, 1, 8, WG_CLUSTER(8))        \
    KERNEL(P##r2_k1, 2, 1, )                     \
    KERNEL(P##r2_k2, 2, 2, WG_CLUSTER(2))        \
    KERNEL(P##r2_k4, 2, 4, WG_CLUSTER(4))        \
    KERNEL(P##r2_k8, 2, 8, WG_CLUSTER(8))
#define WG_RING8(NAME, R, KS, CLUSTER) WG_KERNEL(NAME, R, KS, 8, CLUSTER)
#define WG_RING4(NAME, R, KS, CLUSTER) WG_KERNEL(NAME, R, KS, 4, CLUSTER)

// Plain products with a ring of 8 chunks (gemv_f8wg_*) and of 4 (gemv_f8wg_s4_*).
WG_EVERY_SPLIT(WG_RING8, gemv_f8wg_)
WG_EVERY_SPLIT(WG_RING4, gemv_f8wg_s4_)
// SwiGLU pairs (the shared expert's gate and up projections at decode), rings of 4.
WG_EVERY_SPLIT(WG_PAIR_KERNEL, gemv_f8wg_pair_)
// Several products of one input (a layer's wq_a and wkv at decode), rings of 4.
WG_EVERY_SPLIT(WG_MANY_KERNEL, gemv_f8wg_many_)
