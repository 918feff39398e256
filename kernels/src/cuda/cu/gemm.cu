// Tensor-core products for prefill-sized batches, out[rows, N] = x[rows, K] · Wᵀ, with W
// kept in its checkpoint format and dequantised tile by tile into shared memory as bf16
// (exact: every FP8 or FP4 value times its power-of-two block scale is a bf16 value), so
// no dequantised copy of a weight ever exists in device memory.
//
// x is f32. `split_bf16` first writes its two bf16 parts (hi = bf16(x), lo = bf16(x − hi):
// ~16 mantissa bits together) once per product; SPLIT kernels multiply both into the
// one f32 accumulator, which keeps the result near the f32 product the CPU reference
// computes; the `_hi` variants use hi alone (the benchmark's measure of the tiles).
//
// Tiles: a block computes BM = 128 rows × BN = 128 outputs, stepping K by BK = 32 through
// STAGES = 3 shared-memory stages filled by cp.async (x hi/lo tiles and the weight
// tile's stored bytes; rows past the end are zero-filled). A step waits for its stage,
// dequantises its weight bytes into one bf16 tile (bf16 weights are used in place),
// then its 8 warps (2 × 4, each 64 rows × 32 outputs = 4 × 4 mma.m16n8k16) multiply.
// Shared-memory rows are padded to 40 bf16 so ldmatrix's row addresses fall in
// distinct banks.
//
// Weights (WT): 1 = bf16; 2 = FP8 e4m3, one f32 scale per 128×128 block; 3 = FP4 e2m1
// packed two per byte (low nibble first), one ue8m0 byte per 32 inputs of a row.
//
// Which rows: with `tiles` null, block row y covers rows y·BM … of one product over W
// (`w0`, `s0`). Otherwise tiles[y] = (group, first row, rows) picks a run of rows
// (grouped experts: the rows routed to one expert, gathered in expert order) and the
// group's weight from wtab[2·group] (weights, scales). Block-diagonal products (`g_out`
// outputs per group, the attention output projection) read x at column (n0 / g_out)·K;
// g_out is a multiple of BN there. Requires K % 32 == 0 and x rows of whole 16 bytes.

#define GEMM_BM 128
#define GEMM_BN 128
#define GEMM_BK 32
#define GEMM_LD 40  // padded shared-memory row, 16-bit elements (80 bytes)
#define GEMM_STAGES 3

// x[rows, cols] (rows x_stride floats apart) -> hi, lo [rows, cols] bf16, contiguous.
extern "C" __global__ void split_bf16(u16* hi, u16* lo, const float* x, int rows, int cols, int x_stride) {
    pdl_begin();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    const int r = (int)(i / cols), c = (int)(i % cols);
    const float v = x[(long long)r * x_stride + c];
    const u16 h = f2bf(v);
    hi[i] = h;
    lo[i] = f2bf(v - bf2f(h));
}

// x rounded once to bf16, 8 columns a thread: grid (ceil(cols / 8 / 256), rows ≤ 65,535;
// rows past it looped). Needs cols % 8 == 0, x 16-byte aligned, x_stride % 4 == 0
// (`cublas_bf16::round_rows` checks; else `round_bf16_rows`). A thread an element with a
// 64-bit division and 2-byte stores ran at about a third of the copy rate (an 8K
// prefill's calls ~16 ms).
extern "C" __global__ void round_bf16_rows8(u16* out, const float* x, int rows, int cols, int x_stride) {
    pdl_begin();
    const int c = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (c >= cols) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* src = x + (long long)r * x_stride + c;
        const float4 a = *(const float4*)src, b = *(const float4*)(src + 4);
        *(uint4*)(out + (long long)r * cols + c) =
            make_uint4((u32)f2bf(a.x) | ((u32)f2bf(a.y) << 16), (u32)f2bf(a.z) | ((u32)f2bf(a.w) << 16),
                       (u32)f2bf(b.x) | ((u32)f2bf(b.y) << 16), (u32)f2bf(b.z) | ((u32)f2bf(b.w) << 16));
    }
}

// Rows picked by a list and rounded once to bf16 (the routed rows of BF16 experts in
// expert order): out[r] = bf16(src[idx[r]]), 8 columns a thread; an entry of 0xffffffff
// is a zero row. width a multiple of 8, src 16-byte aligned.
extern "C" __global__ void gather_rows_bf16(u16* out, const float* src, const u32* idx, int rows, int width) {
    pdl_begin();
    const int c = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (c >= width) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const u32 from = idx[r];
        uint4 o = make_uint4(0u, 0u, 0u, 0u);
        if (from != 0xffffffffu) {
            const float* s = src + (long long)from * width + c;
            const float4 a = *(const float4*)s, b = *(const float4*)(s + 4);
            o = make_uint4((u32)f2bf(a.x) | ((u32)f2bf(a.y) << 16), (u32)f2bf(a.z) | ((u32)f2bf(a.w) << 16),
                           (u32)f2bf(b.x) | ((u32)f2bf(b.y) << 16), (u32)f2bf(b.z) | ((u32)f2bf(b.w) << 16));
        }
        *(uint4*)(out + (long long)r * width + c) = o;
    }
}

// x rounded once to bf16 (cuBLAS products with the reference model's bf16 activations), a
// thread an element: any shape.
extern "C" __global__ void round_bf16_rows(u16* out, const float* x, int rows, int cols, int x_stride) {
    pdl_begin();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    const int r = (int)(i / cols), c = (int)(i % cols);
    out[i] = f2bf(x[(long long)r * x_stride + c]);
}

// out[r] = halves[r] + halves[rows + r]: the hi and lo products of a stacked cuBLAS
// product (split activations, the weight streamed once), `n` outputs a row.
extern "C" __global__ void sum_split_halves(float* out, int out_stride, const float* halves, int rows, int n) {
    pdl_begin();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * n) return;
    const int r = (int)(i / n), c = (int)(i % n);
    out[(long long)r * out_stride + c] = halves[i] + halves[i + (long long)rows * n];
}

// Four 8×8 b16 matrices from shared memory at a shared-space address (callers that keep
// addresses as u32 skip the conversion), or at a generic pointer.
__device__ __forceinline__ void ldmatrix_x4_at(u32* r, u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* p) { ldmatrix_x4_at(r, (u32)__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, zero-filled when `live` is false (cp.async, L2 only), to a
// shared-space address (callers that keep addresses as u32 skip the conversion) or a
// generic pointer.
__device__ __forceinline__ void cp16_at(u32 s, const void* gmem, bool live) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(live ? 16 : 0));
}
__device__ __forceinline__ void cp16(void* smem, const void* gmem, bool live) {
    cp16_at((u32)__cvta_generic_to_shared(smem), gmem, live);
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// bf16 bits of an exact bf16 value held in an f32 (truncation is the conversion).
__device__ __forceinline__ u32 bf16_pair_exact(float lo, float hi) {
    return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
}

// Bytes of one stage's weight tile as stored (rows of BK inputs).
template <int WT>
__device__ constexpr int w_row_bytes() { return WT == 1 ? 2 * GEMM_BK : WT == 2 ? GEMM_BK : GEMM_BK / 2; }

// Shared-memory layout per stage: x hi, x lo (BM rows × LD), weight bytes as stored
// (bf16: BN rows × LD, others BN × row bytes); then one dequantised weight tile.
template <int WT, bool SPLIT>
struct GemmSmem {
    static constexpr int X = GEMM_BM * GEMM_LD * 2;  // bytes of one x tile
    static constexpr int W = WT == 1 ? GEMM_BN * GEMM_LD * 2 : GEMM_BN * w_row_bytes<WT>();
    static constexpr int STAGE = X * (SPLIT ? 2 : 1) + W;
    static constexpr int DEQ = WT == 1 ? 0 : GEMM_BN * GEMM_LD * 2;
    static constexpr int TOTAL = STAGE * GEMM_STAGES + DEQ;
};

template <int WT, bool SPLIT>
__device__ void gemm_body(float* out, int out_stride, const u16* xh, const u16* xl, int x_cols, const void* w,
                          const void* scales, int row0, int nrows, int N, int K, int g_out) {
    typedef GemmSmem<WT, SPLIT> L;
    extern __shared__ __align__(16) unsigned char smem[];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int wm = warp >> 2, wn = warp & 3;  // warp's 64-row, 32-output sub-tile
    const int n0 = blockIdx.x * GEMM_BN;
    const long long xcol = (long long)(n0 / g_out) * K;
    const int steps = K / GEMM_BK;

    auto stage_x = [&](int s, int which) { return (u16*)(smem + s * L::STAGE + which * L::X); };
    auto stage_w = [&](int s) { return smem + s * L::STAGE + L::X * (SPLIT ? 2 : 1); };
    u16* deq = (u16*)(smem + GEMM_STAGES * L::STAGE);

    // Issue the copies of step `k_step` into stage `s`.
    auto issue = [&](int k_step, int s) {
        const int k0 = k_step * GEMM_BK;
        // x: BM rows × 64 bytes per part = 4 chunks of 16 a row; 256 threads, 2 passes.
#pragma unroll
        for (int pass = 0; pass < 2; pass++) {
            const int c = t + pass * 256, r = c >> 2, q = c & 3;
            const bool live = r < nrows;
            const long long off = (long long)(row0 + (live ? r : 0)) * x_cols + xcol + k0 + q * 8;
            cp16(stage_x(s, 0) + r * GEMM_LD + q * 8, xh + off, live);
            if (SPLIT) cp16(stage_x(s, 1) + r * GEMM_LD + q * 8, xl + off, live);
        }
        // Weights: BN rows of w_row_bytes.
        constexpr int RB = w_row_bytes<WT>(), CHUNKS = GEMM_BN * RB / 16;
        for (int c = t; c < CHUNKS; c += 256) {
            const int r = c / (RB / 16), q = c % (RB / 16);
            const bool live = n0 + r < N;
            const long long row = n0 + (live ? r : 0);
            const unsigned char* src;
            if (WT == 1) src = (const unsigned char*)w + (row * K + k0) * 2 + q * 16;
            else if (WT == 2) src = (const unsigned char*)w + row * K + k0 + q * 16;
            else src = (const unsigned char*)w + row * (K / 2) + k0 / 2 + q * 16;
            unsigned char* dst = WT == 1 ? stage_w(s) + r * GEMM_LD * 2 + q * 16 : stage_w(s) + r * RB + q * 16;
            cp16(dst, src, live);
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < GEMM_STAGES - 1; s++) {
        if (s < steps) issue(s, s);
        cp_commit();
    }
    for (int step = 0; step < steps; step++) {
        const int s = step % GEMM_STAGES;
        cp_wait<GEMM_STAGES - 2>();
        __syncthreads();  // stage s visible to all; everyone is done with step - 1
        // Refill the stage step - 1 used (copies overlap this step's work).
        if (step + GEMM_STAGES - 1 < steps) issue(step + GEMM_STAGES - 1, (step + GEMM_STAGES - 1) % GEMM_STAGES);
        cp_commit();
        const u16* wt;
        if (WT == 1) {
            wt = (const u16*)stage_w(s);
        } else {
            // Dequantise: thread t takes row t / 2, inputs (t % 2)·16 .. +16.
            const int r = t >> 1, kk = (t & 1) * 16, k0 = step * GEMM_BK;
            const unsigned char* raw = stage_w(s) + r * w_row_bytes<WT>();
            float v[16];
            float sc;
            const long long row = n0 + r;
            if (WT == 2) {
                const uint4 q = *(const uint4*)(raw + kk);
                fp8x4_scaled(q.x, v);
                fp8x4_scaled(q.y, v + 4);
                fp8x4_scaled(q.z, v + 8);
                fp8x4_scaled(q.w, v + 12);
                sc = row < N ? ((const float*)scales)[(row / 128) * ((K + 127) / 128) + k0 / 128] * FP8_F16_SCALE : 0.f;
            } else {
                const uint2 q = *(const uint2*)(raw + kk / 2);
                fp4x8_scaled(q.x, v);
                fp4x8_scaled(q.y, v + 8);
                sc = row < N ? ue8m0_scale(((const u8*)scales)[row * (K / 32) + k0 / 32]) * FP4_F16_SCALE : 0.f;
            }
            u32 p[8];
#pragma unroll
            for (int i = 0; i < 8; i++) p[i] = bf16_pair_exact(v[2 * i] * sc, v[2 * i + 1] * sc);
            uint4* d = (uint4*)(deq + r * GEMM_LD + kk);
            d[0] = make_uint4(p[0], p[1], p[2], p[3]);
            d[1] = make_uint4(p[4], p[5], p[6], p[7]);
            __syncthreads();
            wt = deq;
        }
        const u16* ah = stage_x(s, 0);
        const u16* al = stage_x(s, 1);
#pragma unroll
        for (int kk = 0; kk < GEMM_BK; kk += 16) {
            u32 b[4][2];
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {
                const int q = lane >> 3;
                const int n = wn * 32 + jj * 16 + (lane & 7) + (q >> 1) * 8;
                u32 r4[4];
                ldmatrix_x4(r4, wt + n * GEMM_LD + kk + (q & 1) * 8);
                b[2 * jj][0] = r4[0];
                b[2 * jj][1] = r4[1];
                b[2 * jj + 1][0] = r4[2];
                b[2 * jj + 1][1] = r4[3];
            }
            const int ar = lane & 15, ak = kk + (lane >> 4) * 8;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = wm * 64 + i * 16 + ar;
                u32 a[4];
                ldmatrix_x4(a, ah + r * GEMM_LD + ak);
#pragma unroll
                for (int j = 0; j < 4; j++) mma_bf16(acc[i][j], a, b[j][0], b[j][1]);
                if (SPLIT) {
                    ldmatrix_x4(a, al + r * GEMM_LD + ak);
#pragma unroll
                    for (int j = 0; j < 4; j++) mma_bf16(acc[i][j], a, b[j][0], b[j][1]);
                }
            }
        }
    }
    cp_wait<0>();

    // Accumulator (i, j): rows wm·64 + i·16 + lane/4 (+8), outputs wn·32 + j·8 + (lane%4)·2 (+1).
    const int gr = lane >> 2, gc = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = wm * 64 + i * 16 + gr + half * 8;
            if (r >= nrows) continue;
            float* o = out + (long long)(row0 + r) * out_stride;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int n = n0 + wn * 32 + j * 8 + gc;
                if (n < N) o[n] = acc[i][j][2 * half];
                if (n + 1 < N) o[n + 1] = acc[i][j][2 * half + 1];
            }
        }
}

// out stride in floats; xh/xl rows of x_cols bf16 (the split activations).
#define GEMM_KERNEL(WT, SPLIT, NAME)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                          \
        NAME(float* out, int out_stride, const u16* xh, const u16* xl, int x_cols, const void* w0, const void* s0, \
             const u64* wtab, const int* tiles, int rows, int N, int K, int g_out) { pdl_begin();                  \
        int group = 0, row0 = blockIdx.y * GEMM_BM, nrows = min(GEMM_BM, rows - row0);                            \
        const void* w = w0;                                                                                       \
        const void* s = s0;                                                                                       \
        if (tiles) {                                                                                              \
            group = tiles[3 * blockIdx.y];                                                                        \
            row0 = tiles[3 * blockIdx.y + 1];                                                                     \
            nrows = tiles[3 * blockIdx.y + 2];                                                                    \
            w = (const void*)wtab[2 * group];                                                                     \
            s = (const void*)wtab[2 * group + 1];                                                                 \
        }                                                                                                         \
        gemm_body<WT, SPLIT>(out, out_stride, xh, xl, x_cols, w, s, row0, nrows, N, K, g_out);                    \
    }

GEMM_KERNEL(1, true, gemm_bf16)
GEMM_KERNEL(2, true, gemm_fp8)
GEMM_KERNEL(3, true, gemm_fp4)
// bf16 activations only (hi alone, one product per tile): the speed of the tiles
// without the split, for the benchmark's table (not used by the engine).
GEMM_KERNEL(1, false, gemm_bf16_hi)
GEMM_KERNEL(2, false, gemm_fp8_hi)
GEMM_KERNEL(3, false, gemm_fp4_hi)
