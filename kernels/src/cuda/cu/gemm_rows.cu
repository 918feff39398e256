// Products of 9-32 decode rows over BF16 weights on the tensor cores, out[r, o] =
// Σ_k x[r, k] · W[o, k], the f32 activations split inside the kernel into bf16 hi + lo
// (`split_bf16`'s bits: the split cuBLAS path's precision) and both parts multiplied into
// one f32 accumulator. One launch where the cuBLAS path took three to four (the split,
// the stacked product, often cuBLAS's split-K reduce, the sum of the halves), each a few
// microseconds of a decode step's serial chain. Opt-in (`SLUICE_CUDA_GEMM_ROWS`): on the
// H200 it is slower than the cuBLAS path (kernels/src/cuda/NOTES-decode.md "BF16 products
// of 9-32 rows in one launch").
//
// Block: 128 weight rows (`GR_BN`) × all rows of the batch (up to 32), 8 warps: 4 groups
// of 32 weight rows × 2 halves of 16 batch rows. It walks its K range in chunks of 128
// inputs, the weight's 128 rows × 256 bytes double-buffered in shared memory by cp.async
// (the next chunk requested while this one is multiplied), and a thread reads its 16
// activations of a chunk from global memory one chunk ahead into registers and splits
// them (rows past the batch are zeros) into padded hi and lo bf16 tiles; then every 16
// inputs a warp loads its 2 weight fragments and its 2 batch tiles' hi and lo fragments
// with ldmatrix and issues 8 mma.m16n8k16 (hi then lo into the same accumulator). The
// first chunk's weight copies are requested before `griddepcontrol.wait` (weights do not
// depend on the kernel before).
//
// Split K (`gemm_rows_bf16_k{2,4,8}`, sm_90): the KS blocks of an output block form a
// thread-block cluster, each over a contiguous run of chunks. Each leaves its partial
// tile in its own shared memory; after a cluster barrier each block sums a slice of the
// tile over the KS blocks' shared memory (distributed shared memory), in rank order, so
// the result does not depend on scheduling and no partial goes through global memory.
// Block-diagonal products (`g_out` outputs a group, a multiple of 128) read x at column
// (o / g_out) · K.

#define GR_BN 128
#define GR_BK 128
#define GR_ROWS 32
#define GR_STAGES 2
#define GR_LD 136  // padded bf16 row of a weight or split tile (272 bytes): ldmatrix rows in distinct banks

// Shared memory: GR_STAGES weight tiles, then the split tiles (hi, lo; the barrier that
// opens a chunk orders their reuse). 85 KiB: two blocks an SM.
#define GR_STAGE_BYTES (GR_BN * GR_LD * 2)
#define GR_SPLIT_BYTES (GR_ROWS * GR_LD * 2)
#define GR_SMEM (GR_STAGES * GR_STAGE_BYTES + 2 * GR_SPLIT_BYTES)

// Pointers first, so both sides lay it out without padding (`GrArgs` in gemm_rows.rs).
struct GrArgs {
    float* out;
    const float* x;
    const u16* w;
    int rows, n, k, x_stride, out_stride, g_out;
};

// Thread-block clusters (sm_90): a barrier of every thread of the cluster whose shared-
// memory writes before it are seen by every block after it, and a load from the shared
// memory of the cluster's block `rank` at the address `local` has in this block.
__device__ __forceinline__ void gr_cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ float gr_cluster_load(u32 local, int rank) {
#if __CUDA_ARCH__ >= 900
    u32 remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    __trap();
    return 0.0f;
#endif
}

// A thread's copy requests: 8 of a chunk's 2,048 16-byte weight pieces, rows
// tid / 16 + 16·i at piece tid % 16, from a source that moves on by a chunk as chunks are
// issued (in order); rows past N are zero-filled (their sources are never read).
struct GrCopies {
    const u16* base;  // the weight (the source named for zero-filled pieces)
    const u16* w;     // piece 0 of the next chunk
    long long step;   // 16 rows, in elements
    u32 dst;          // piece 0's offset within a stage
    int live;         // pieces whose row is below N
};

__device__ __forceinline__ void gr_copies_init(GrCopies& c, const GrArgs& a, int o_blk, int c0) {
    const int row = threadIdx.x >> 4, piece = threadIdx.x & 15;
    c.base = a.w;
    c.w = a.w + (long long)(o_blk + row) * a.k + c0 * GR_BK + piece * 8;
    c.step = 16LL * a.k;
    c.dst = 2 * (row * GR_LD + piece * 8);
    c.live = min(8, max(0, (a.n - o_blk - row + 15) / 16));
}

// The next chunk's weight pieces into the stage at shared address `stage`.
__device__ __forceinline__ void gr_copy_w(GrCopies& c, u32 stage) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const bool live = i < c.live;
        cp16_at(stage + c.dst + i * (16 * GR_LD * 2), live ? c.w + i * c.step : c.base, live);
    }
    c.w += GR_BK;
}

// A thread's 16 activations of a chunk (row tid / 8, inputs 16·(tid % 8) ..), read from
// global memory (L2: the kernel before just wrote them) a chunk ahead of their split;
// zeros for rows past the batch.
__device__ __forceinline__ void gr_load_x(float4* v, const float* p, bool live) {
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = live ? __ldcg((const float4*)p + j) : make_float4(0.f, 0.f, 0.f, 0.f);
}

// Two values as bf16 hi and lo pairs (round to nearest even, the first value in the low
// half): hi = bf16(v), lo = bf16(v - hi), `split_bf16`'s values for finite inputs.
__device__ __forceinline__ void gr_split2(float v0, float v1, u32& hi, u32& lo) {
    hi = bf16x2_rn(v0, v1);
    const float h0 = __uint_as_float(hi << 16), h1 = __uint_as_float(hi & 0xffff0000u);
    lo = bf16x2_rn(v0 - h0, v1 - h1);
}

template <int KS>
__device__ __forceinline__ void gr_body(const GrArgs& a) {
    extern __shared__ __align__(16) unsigned char gr_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int o_blk = blockIdx.x * GR_BN;
    const int chunks = a.k / GR_BK;
    // gridDim.y == KS: blockIdx.y is the block's rank in its cluster.
    const int c0 = (int)((long long)blockIdx.y * chunks / KS);
    const int nc = (int)((long long)(blockIdx.y + 1) * chunks / KS) - c0;
    const long long xcol = a.g_out > 0 ? (long long)(o_blk / a.g_out) * a.k : 0;

    // The first chunk's weights before the wait for the kernel before (they do not depend
    // on it), its activations after.
    GrCopies cps;
    gr_copies_init(cps, a, o_blk, c0);
    const u32 smem0 = smem_addr(gr_smem);
    gr_copy_w(cps, smem0);
    cp_commit();
    pdl_begin();
    const int x_row = tid >> 3, x_col = (tid & 7) * 16;
    const bool x_live = x_row < a.rows;
    const float* xp = a.x + (x_live ? (long long)x_row * a.x_stride + xcol + c0 * GR_BK + x_col : 0);
    float4 xv[4];
    gr_load_x(xv, xp, x_live);

    const int wm = warp & 3, wn = warp >> 2;
    // Batch tiles of this warp holding rows (warp-uniform): 0, 1 or 2.
    const int tiles = min(2, max(0, (a.rows - wn * 16 + 7) / 8));
    float acc[2][2][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int t = 0; t < 2; t++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[m][t][i] = 0.0f;
    u16* hi = (u16*)(gr_smem + GR_STAGES * GR_STAGE_BYTES);
    u16* lo = hi + GR_ROWS * GR_LD;
    // ldmatrix row addresses (bytes): weight fragments (rows 0-15 of a 16-row tile,
    // inputs 0 or 8), batch fragments (two 8-row tiles, inputs 0 or 8).
    const u32 a_off = 2 * ((wm * 32 + (lane & 15)) * GR_LD + (lane >> 4) * 8);
    const u32 b_off = 2 * ((wn * 16 + (lane & 7) + ((lane >> 4) << 3)) * GR_LD + ((lane >> 3) & 1) * 8);
    const u32 hsm = smem_addr(hi) + b_off, lsm = smem_addr(lo) + b_off;

    for (int i = 0; i < nc; i++) {
        const u32 stage = smem0 + (i & 1) * GR_STAGE_BYTES;
        cp_wait<0>();
        // Chunk i in every thread's view; every warp done with chunk i - 1 (its stage and
        // the split tiles are free).
        __syncthreads();
        if (i + 1 < nc) gr_copy_w(cps, smem0 + ((i + 1) & 1) * GR_STAGE_BYTES);
        cp_commit();
        {
            // Split this chunk's 16 activations of the thread, then read the next chunk's.
            u32 h[8], l[8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                gr_split2(xv[j].x, xv[j].y, h[2 * j], l[2 * j]);
                gr_split2(xv[j].z, xv[j].w, h[2 * j + 1], l[2 * j + 1]);
            }
            uint4* ph = (uint4*)(hi + x_row * GR_LD + x_col);
            uint4* pl = (uint4*)(lo + x_row * GR_LD + x_col);
            ph[0] = make_uint4(h[0], h[1], h[2], h[3]);
            ph[1] = make_uint4(h[4], h[5], h[6], h[7]);
            pl[0] = make_uint4(l[0], l[1], l[2], l[3]);
            pl[1] = make_uint4(l[4], l[5], l[6], l[7]);
            xp += GR_BK;
            if (i + 1 < nc) gr_load_x(xv, xp, x_live);
        }
        __syncthreads();  // the split tiles are whole
        if (tiles == 0) continue;
        const u32 wsm = stage + a_off;
#pragma unroll
        for (int ks = 0; ks < GR_BK / 16; ks++) {
            u32 af[2][4], bh[4], bl[4];
            ldmatrix_x4_at(af[0], wsm + 2 * ks * 16);
            ldmatrix_x4_at(af[1], wsm + 2 * (16 * GR_LD + ks * 16));
            ldmatrix_x4_at(bh, hsm + 2 * ks * 16);
            ldmatrix_x4_at(bl, lsm + 2 * ks * 16);
#pragma unroll
            for (int m = 0; m < 2; m++) {
                mma_bf16(acc[m][0], af[m], bh[0], bh[1]);
                mma_bf16(acc[m][0], af[m], bl[0], bl[1]);
                if (tiles == 2) {
                    mma_bf16(acc[m][1], af[m], bh[2], bh[3]);
                    mma_bf16(acc[m][1], af[m], bl[2], bl[3]);
                }
            }
        }
    }

    // Without a K split the accumulators are the outputs; with one, the block's partial
    // tile [32 rows][128 outputs] over the (now idle) ring.
    float* part = (float*)gr_smem;
    const int g = lane >> 2, q = lane & 3;
    if (KS > 1) __syncthreads();
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int t = 0; t < 2; t++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                // Accumulator i of tile (m, t): weight row wm·32 + 16m + g + 8·(i / 2) of the
                // block (the output o_blk + that without a split), batch row wn·16 + 8t + 2q +
                // (i % 2), with g = lane / 4, q = lane % 4.
                const int o = (KS > 1 ? 0 : o_blk) + wm * 32 + 16 * m + g + 8 * (i >> 1);
                const int r = wn * 16 + 8 * t + 2 * q + (i & 1);
                if (KS > 1) part[r * GR_BN + o] = acc[m][t][i];
                else if (r < a.rows && o < a.n) a.out[(long long)r * a.out_stride + o] = acc[m][t][i];
            }
    if (KS == 1) return;
    gr_cluster_sync();
    // This block's slice of the tile, summed over the cluster's blocks in rank order.
    const int entries = a.rows * GR_BN, from = blockIdx.y * entries / KS, to = (blockIdx.y + 1) * entries / KS;
    const u32 part_sm = smem_addr(part);
    for (int e = from + tid; e < to; e += blockDim.x) {
        const int r = e / GR_BN, o = o_blk + e % GR_BN;
        float parts[KS];
#pragma unroll
        for (int s = 0; s < KS; s++) parts[s] = gr_cluster_load(part_sm + 4 * e, s);
        float v = 0.0f;
#pragma unroll
        for (int s = 0; s < KS; s++) v += parts[s];
        if (o < a.n) a.out[(long long)r * a.out_stride + o] = v;
    }
    // Every block's shared memory stays until the others have read it.
    gr_cluster_sync();
}

// Cluster dimensions only where clusters exist; the host launches KS > 1 on sm_90+.
#if __CUDA_ARCH__ >= 900
#define GR_CLUSTER(KS) __cluster_dims__(1, KS, 1)
#else
#define GR_CLUSTER(KS)
#endif

#define GR_KERNEL(KS, NAME) \
    extern "C" __global__ void __launch_bounds__(256, 2) GR_CLUSTER(KS) NAME(const GrArgs a) { gr_body<KS>(a); }

GR_KERNEL(1, gemm_rows_bf16_k1)
GR_KERNEL(2, gemm_rows_bf16_k2)
GR_KERNEL(4, gemm_rows_bf16_k4)
GR_KERNEL(8, gemm_rows_bf16_k8)
