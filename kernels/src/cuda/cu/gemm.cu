// Tensor-core products for prefill-sized batches, out[rows, N] = x[rows, K] · Wᵀ, with W
// kept in its checkpoint format and dequantised tile by tile into shared memory as bf16
// (exact: every FP8 or FP4 value times its power-of-two block scale is a bf16 value), so
// no dequantised copy of a weight ever exists in device memory.
//
// x is f32. SPLIT multiplies both bf16 parts of x ≈ hi + lo (hi = bf16(x), lo =
// bf16(x − hi): ~16 mantissa bits) into the one f32 accumulator, which keeps the result
// near the f32 product the CPU reference computes; without SPLIT only hi is used.
//
// Tiles: a block computes BM = 64 rows × BN = 128 outputs, stepping K by BK = 32; its 8
// warps are 2 (rows) × 4 (outputs), each 32 × 32 = 2 × 4 tiles of mma.m16n8k16 (bf16 in,
// f32 accumulate). Each step's global loads are issued into registers before the
// current tile's products and stored (converted) into the other shared-memory buffer
// after them: one barrier a step. Shared-memory rows are padded to 40 bf16 so the
// ldmatrix row addresses of a warp fall in distinct banks.
//
// Weights (WT): 1 = bf16; 2 = FP8 e4m3, one f32 scale per 128×128 block; 3 = FP4 e2m1
// packed two per byte (low nibble first), one ue8m0 byte per 32 inputs of a row.
//
// Which rows: with `tiles` null, block row y covers rows y·BM … of one product over W
// (`w0`, `s0`). Otherwise tiles[y] = (group, first row, rows) picks a run of rows
// (grouped experts: the rows routed to one expert, gathered in expert order) and the
// group's weight from wtab[2·group] (weights, scales). Block-diagonal products (`g_out`
// outputs per group, the attention output projection) read x at column (n0 / g_out)·K;
// g_out is a multiple of BN there. Requires K % 32 == 0 and 16-byte aligned x rows.

#define GEMM_BM 64
#define GEMM_BN 128
#define GEMM_BK 32
#define GEMM_LD 40  // padded shared-memory row, bf16 elements (80 bytes)

__device__ __forceinline__ u32 pack_bf16x2(float lo_k, float hi_k) {
    return (u32)f2bf(lo_k) | ((u32)f2bf(hi_k) << 16);
}

__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* p) {
    u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// bf16 bits of an exact bf16 value held in an f32 (the value is exact, so truncation
// is the conversion).
__device__ __forceinline__ u32 bf16_bits_exact(float v) { return __float_as_uint(v) >> 16; }

// One thread's share of a step's weight tile: rows n0 + t/2, inputs k0 + (t%2)·16 … +16,
// as 8 bf16x2 words.
template <int WT>
struct WeightLoad {
    uint4 raw[2];  // bf16: 32 bytes; FP8: 16 bytes; FP4: 8 bytes
    float scale;
};

template <int WT>
__device__ __forceinline__ void load_w(WeightLoad<WT>& l, const void* w, const void* scales, int row, bool live, int K,
                                       int k) {
    if (!live) {
        l.raw[0] = make_uint4(0, 0, 0, 0);
        l.raw[1] = make_uint4(0, 0, 0, 0);
        l.scale = 0.0f;
        return;
    }
    if (WT == 1) {
        const uint4* p = (const uint4*)((const u16*)w + (long long)row * K + k);
        l.raw[0] = __ldg(p);
        l.raw[1] = __ldg(p + 1);
    } else if (WT == 2) {
        l.raw[0] = __ldg((const uint4*)((const u8*)w + (long long)row * K + k));
        l.scale = ((const float*)scales)[(row / 128) * ((K + 127) / 128) + k / 128];
    } else {
        const uint2 q = __ldg((const uint2*)((const u8*)w + (long long)row * (K / 2) + k / 2));
        l.raw[0] = make_uint4(q.x, q.y, 0, 0);
        l.scale = ue8m0_to_f32(__ldg((const u8*)scales + (long long)row * (K / 32) + k / 32));
    }
}

template <int WT>
__device__ __forceinline__ void store_w(const WeightLoad<WT>& l, u16* dst) {
    u32 words[8];
    if (WT == 1) {
        words[0] = l.raw[0].x; words[1] = l.raw[0].y; words[2] = l.raw[0].z; words[3] = l.raw[0].w;
        words[4] = l.raw[1].x; words[5] = l.raw[1].y; words[6] = l.raw[1].z; words[7] = l.raw[1].w;
    } else if (WT == 2) {
        const u32 q[4] = {l.raw[0].x, l.raw[0].y, l.raw[0].z, l.raw[0].w};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 b = q[i / 2] >> (16 * (i % 2));
            words[i] = bf16_bits_exact(fp8_to_f32(b & 0xffu) * l.scale) |
                       (bf16_bits_exact(fp8_to_f32((b >> 8) & 0xffu) * l.scale) << 16);
        }
    } else {
        const u32 q[2] = {l.raw[0].x, l.raw[0].y};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 b = q[i / 4] >> (8 * (i % 4));
            words[i] = bf16_bits_exact(e2m1_to_f32(b) * l.scale) | (bf16_bits_exact(e2m1_to_f32(b >> 4) * l.scale) << 16);
        }
    }
    uint4* d = (uint4*)dst;
    d[0] = make_uint4(words[0], words[1], words[2], words[3]);
    d[1] = make_uint4(words[4], words[5], words[6], words[7]);
}

template <int WT, bool SPLIT>
__device__ void gemm_body(float* out, int out_stride, const float* x, int x_stride, const void* w, const void* scales,
                          int row0, int nrows, int N, int K, int g_out) {
    __shared__ __align__(16) u16 xs_hi[2][GEMM_BM * GEMM_LD];
    __shared__ __align__(16) u16 xs_lo[SPLIT ? 2 : 1][SPLIT ? GEMM_BM * GEMM_LD : 8];
    __shared__ __align__(16) u16 ws[2][GEMM_BN * GEMM_LD];

    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int wm = warp >> 2, wn = warp & 3;  // warp's 32-row, 32-output sub-tile
    const int n0 = blockIdx.x * GEMM_BN;
    const float* xb = x + (long long)row0 * x_stride + (long long)(n0 / g_out) * K;

    // Loads of one step: x rows t/4 (8 floats at (t%4)·8), weight row t/2 (16 inputs).
    const int xr = t >> 2, xk = (t & 3) * 8;
    const bool xlive = xr < nrows;
    const int wr = t >> 1, wk = (t & 1) * 16;
    const bool wlive = n0 + wr < N;
    float4 xa, xc;
    WeightLoad<WT> wl;
    auto load = [&](int k0) {
        if (xlive) {
            const float4* p = (const float4*)(xb + (long long)xr * x_stride + k0 + xk);
            xa = p[0];
            xc = p[1];
        } else {
            xa = make_float4(0.f, 0.f, 0.f, 0.f);
            xc = xa;
        }
        load_w<WT>(wl, w, scales, n0 + wr, wlive, K, k0 + wk);
    };
    auto store = [&](int buf) {
        const float v[8] = {xa.x, xa.y, xa.z, xa.w, xc.x, xc.y, xc.z, xc.w};
        u32 hi[4], lo[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float h0 = round_bf16(v[2 * i]), h1 = round_bf16(v[2 * i + 1]);
            hi[i] = bf16_bits_exact(h0) | (bf16_bits_exact(h1) << 16);
            if (SPLIT) lo[i] = pack_bf16x2(v[2 * i] - h0, v[2 * i + 1] - h1);
        }
        *(uint4*)&xs_hi[buf][xr * GEMM_LD + xk] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        if (SPLIT) *(uint4*)&xs_lo[buf][xr * GEMM_LD + xk] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        store_w<WT>(wl, &ws[buf][wr * GEMM_LD + wk]);
    };

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    const int steps = K / GEMM_BK;
    load(0);
    store(0);
    __syncthreads();
    for (int s = 0; s < steps; s++) {
        const int buf = s & 1;
        if (s + 1 < steps) load((s + 1) * GEMM_BK);
#pragma unroll
        for (int kk = 0; kk < GEMM_BK; kk += 16) {
            // A fragments (rows wm·32 + i·16 …): matrices (rows 0-7, 8-15) × (k 0-7, 8-15).
            u32 ahi[2][4], alo[2][4];
            const int ar = lane & 15, ak = kk + (lane >> 4) * 8;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int r = wm * 32 + i * 16 + ar;
                ldmatrix_x4(ahi[i], &xs_hi[buf][r * GEMM_LD + ak]);
                if (SPLIT) ldmatrix_x4(alo[i], &xs_lo[buf][r * GEMM_LD + ak]);
            }
            // B fragments (outputs wn·32 + j·8 …), two n8 tiles per ldmatrix.x4:
            // matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
            u32 b[4][2];
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {
                const int q = lane >> 3;
                const int n = wn * 32 + jj * 16 + (lane & 7) + (q >> 1) * 8;
                u32 r4[4];
                ldmatrix_x4(r4, &ws[buf][n * GEMM_LD + kk + (q & 1) * 8]);
                b[2 * jj][0] = r4[0];
                b[2 * jj][1] = r4[1];
                b[2 * jj + 1][0] = r4[2];
                b[2 * jj + 1][1] = r4[3];
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    mma_bf16(acc[i][j], ahi[i], b[j][0], b[j][1]);
                    if (SPLIT) mma_bf16(acc[i][j], alo[i], b[j][0], b[j][1]);
                }
        }
        if (s + 1 < steps) store(buf ^ 1);
        __syncthreads();
    }

    // Accumulator (i, j): rows wm·32 + i·16 + lane/4 (+8), outputs wn·32 + j·8 + (lane%4)·2 (+1).
    const int gr = lane >> 2, gc = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = wm * 32 + i * 16 + gr + half * 8;
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

// out and x strides in floats.
#define GEMM_KERNEL(WT, SPLIT, NAME)                                                                               \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                           \
        NAME(float* out, int out_stride, const float* x, int x_stride, const void* w0, const void* s0,             \
             const u64* wtab, const int* tiles, int rows, int N, int K, int g_out) {                                \
        int group = 0, row0 = blockIdx.y * GEMM_BM, nrows = min(GEMM_BM, rows - row0);                             \
        const void* w = w0;                                                                                        \
        const void* s = s0;                                                                                        \
        if (tiles) {                                                                                               \
            group = tiles[3 * blockIdx.y];                                                                         \
            row0 = tiles[3 * blockIdx.y + 1];                                                                      \
            nrows = tiles[3 * blockIdx.y + 2];                                                                     \
            w = (const void*)wtab[2 * group];                                                                      \
            s = (const void*)wtab[2 * group + 1];                                                                  \
        }                                                                                                          \
        gemm_body<WT, SPLIT>(out, out_stride, x, x_stride, w, s, row0, nrows, N, K, g_out);                        \
    }

GEMM_KERNEL(1, true, gemm_bf16)
GEMM_KERNEL(2, true, gemm_fp8)
GEMM_KERNEL(3, true, gemm_fp4)

// bf16 activations only (x rounded to bf16, one product per tile): the speed of the
// tiles without the split, for the benchmark's table (not used by the engine).
GEMM_KERNEL(1, false, gemm_bf16_hi)
GEMM_KERNEL(2, false, gemm_fp8_hi)
GEMM_KERNEL(3, false, gemm_fp4_hi)
