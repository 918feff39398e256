// The FP8 tensor-core variant of the grouped FP4 expert GEMM, measured against the BF16
// one (gemm.cu) by the benchmark's kernel table: out[rows, N] = x[rows, K] · Wᵀ with
// W in FP4 e2m1 (two per byte, low nibble first) and one ue8m0 scale per 32 inputs of a
// row, x quantised to e4m3 with one power-of-two scale per 32 inputs of a row
// (`quant_e4m3_rows`, once per product).
//
// Every e2m1 value is exact in e4m3, so a weight tile becomes e4m3 bytes by a table
// lookup (no multiply); with K steps of 32 — one scale block of both operands — each
// step's mma.m16n8k32.e4m3 sums go into a zeroed fragment that is scaled by the row's
// activation scale times the output's weight scale and added to the f32 accumulator.
// What this costs in accuracy: the activations keep e4m3's 3 mantissa bits (the BF16
// path keeps 8, or ~16 split); docs/perf.md has the measured error and speed of both.
//
// Tiles as gemm.cu: BM = 128 rows × BN = 128 outputs a block, BK = 32, 3 cp.async
// stages (x bytes, x scales, weight bytes), 8 warps of 64 rows × 32 outputs. Shared rows
// are padded to 48 bytes so ldmatrix row addresses fall in distinct banks. Requires
// K % 32 == 0; plain products or tiles of one expert's rows (no block-diagonal groups).

#define F8_LD 48  // padded shared-memory row of 32 e4m3 bytes

// x[rows, cols] f32 (rows x_stride apart) -> q[rows, cols] e4m3 and s[rows, cols / 32]
// f32 power-of-two scales (the smallest with |x| / s <= 448 in the block). One thread
// per 32-value block.
extern "C" __global__ void quant_e4m3_rows(u8* q, float* s, const float* x, int rows, int cols, int x_stride) {
    pdl_begin();
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int nb = cols / 32;
    if (b >= (long long)rows * nb) return;
    const int r = (int)(b / nb), c0 = (int)(b % nb) * 32;
    const float* xr = x + (long long)r * x_stride + c0;
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xr[i]));
    const float scale = ue8m0_scale(fp8_scale_byte(amax));
    u32 w[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        w[i] = f2fp8(__fdiv_rn(xr[4 * i], scale)) | f2fp8(__fdiv_rn(xr[4 * i + 1], scale)) << 8 |
               f2fp8(__fdiv_rn(xr[4 * i + 2], scale)) << 16 | f2fp8(__fdiv_rn(xr[4 * i + 3], scale)) << 24;
    }
    uint4* o = (uint4*)(q + (long long)r * cols + c0);
    o[0] = make_uint4(w[0], w[1], w[2], w[3]);
    o[1] = make_uint4(w[4], w[5], w[6], w[7]);
    s[b] = scale;
}

// Four e2m1 codes (nibbles 0-3 of `c`) -> four e4m3 bytes: magnitudes by byte permute
// from {0, .5, 1, 1.5 | 2, 3, 4, 6}, sign bits moved from bit 3 of each nibble to bit 7.
__device__ __forceinline__ u32 e2m1x4_to_e4m3(u32 c) {
    const u32 mag = __byte_perm(0x3c383000u, 0x4c484440u, c & 0x7777u);
    const u32 s = c & 0x8888u;
    return mag | (s & 0x8u) << 4 | (s & 0x80u) << 8 | (s & 0x800u) << 12 | (s & 0x8000u) << 16;
}

__device__ __forceinline__ void mma_e4m3(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 4 bytes global -> shared (cp.async.ca; zero-filled when `live` is false).
__device__ __forceinline__ void cp4(void* smem, const void* gmem, bool live) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(live ? 4 : 0));
}

// Shared memory per stage: x bytes (BM × F8_LD), x scales (BM floats), weight bytes as
// stored (BN × 16); then one e4m3 weight tile (BN × F8_LD) and its scales (BN floats).
#define F8_X (GEMM_BM * F8_LD)
#define F8_XS (GEMM_BM * 4)
#define F8_W (GEMM_BN * GEMM_BK / 2)
#define F8_STAGE (F8_X + F8_XS + F8_W)

__device__ void gemm_f8_body(float* out, int out_stride, const u8* xq, const float* xs, const void* w,
                             const void* scales, int row0, int nrows, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    const int n0 = blockIdx.x * GEMM_BN;
    const int steps = K / GEMM_BK;
    auto sx = [&](int s) { return smem + s * F8_STAGE; };
    auto sxs = [&](int s) { return (float*)(smem + s * F8_STAGE + F8_X); };
    auto sw = [&](int s) { return smem + s * F8_STAGE + F8_X + F8_XS; };
    u8* deq = smem + GEMM_STAGES * F8_STAGE;
    float* wsc = (float*)(deq + GEMM_BN * F8_LD);

    auto issue = [&](int k_step, int s) {
        const int k0 = k_step * GEMM_BK;
        {  // x: BM rows × 2 chunks of 16 bytes, one per thread.
            const int r = t >> 1, q = t & 1;
            const bool live = r < nrows;
            const long long off = (long long)(row0 + (live ? r : 0)) * K + k0 + q * 16;
            cp16(sx(s) + r * F8_LD + q * 16, xq + off, live);
        }
        if (t < GEMM_BM) {  // the rows' scales of this step
            const bool live = t < nrows;
            cp4(sxs(s) + t, xs + (long long)(row0 + (live ? t : 0)) * (K / 32) + k_step, live);
        }
        if (t < GEMM_BN) {  // weights: BN rows of 16 bytes
            const bool live = n0 + t < N;
            const long long row = n0 + (live ? t : 0);
            cp16(sw(s) + t * 16, (const unsigned char*)w + row * (K / 2) + k0 / 2, live);
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
    const int gr = lane >> 2, gc = (lane & 3) * 2;
    for (int step = 0; step < steps; step++) {
        const int s = step % GEMM_STAGES;
        cp_wait<GEMM_STAGES - 2>();
        __syncthreads();
        if (step + GEMM_STAGES - 1 < steps) issue(step + GEMM_STAGES - 1, (step + GEMM_STAGES - 1) % GEMM_STAGES);
        cp_commit();
        {  // FP4 -> e4m3 bytes: thread t takes row t / 2, inputs (t % 2)·16 .. +16.
            const int r = t >> 1, half = t & 1;
            const uint2 q = *(const uint2*)(sw(s) + r * 16 + half * 8);
            const uint4 v = make_uint4(e2m1x4_to_e4m3(q.x & 0xffffu), e2m1x4_to_e4m3(q.x >> 16),
                                       e2m1x4_to_e4m3(q.y & 0xffffu), e2m1x4_to_e4m3(q.y >> 16));
            *(uint4*)(deq + r * F8_LD + half * 16) = v;
            if (half == 0) {
                const long long row = n0 + r;
                wsc[r] = row < N ? ue8m0_scale(((const u8*)scales)[row * (K / 32) + step]) : 0.f;
            }
        }
        __syncthreads();
        const u8* a_tile = sx(s);
        const float* xsc = sxs(s);
        u32 b[4][2];
#pragma unroll
        for (int jj = 0; jj < 2; jj++) {
            const int q = lane >> 3;
            const int n = wn * 32 + jj * 16 + (lane & 7) + (q >> 1) * 8;
            u32 r4[4];
            ldmatrix_x4(r4, (const u16*)(deq + n * F8_LD + (q & 1) * 16));
            b[2 * jj][0] = r4[0];
            b[2 * jj][1] = r4[1];
            b[2 * jj + 1][0] = r4[2];
            b[2 * jj + 1][1] = r4[3];
        }
        float ws[4][2];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            ws[j][0] = wsc[wn * 32 + j * 8 + gc];
            ws[j][1] = wsc[wn * 32 + j * 8 + gc + 1];
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = wm * 64 + i * 16 + (lane & 15);
            u32 a[4];
            ldmatrix_x4(a, (const u16*)(a_tile + r * F8_LD + (lane >> 4) * 16));
            const float xa = xsc[wm * 64 + i * 16 + gr], xb = xsc[wm * 64 + i * 16 + gr + 8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float c[4] = {0.f, 0.f, 0.f, 0.f};
                mma_e4m3(c, a, b[j][0], b[j][1]);
                acc[i][j][0] += c[0] * (xa * ws[j][0]);
                acc[i][j][1] += c[1] * (xa * ws[j][1]);
                acc[i][j][2] += c[2] * (xb * ws[j][0]);
                acc[i][j][3] += c[3] * (xb * ws[j][1]);
            }
        }
    }
    cp_wait<0>();
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

// The launch as gemm.cu's (grid: N / BN × row tiles), x given quantised (xq, xs).
extern "C" __global__ void __launch_bounds__(256, 1)
    gemm_fp4_f8(float* out, int out_stride, const u8* xq, const float* xs, const void* w0, const void* s0,
                const u64* wtab, const int* tiles, int rows, int N, int K) {
    pdl_begin();
    int row0 = blockIdx.y * GEMM_BM, nrows = min(GEMM_BM, rows - row0);
    const void* w = w0;
    const void* s = s0;
    if (tiles) {
        const int group = tiles[3 * blockIdx.y];
        row0 = tiles[3 * blockIdx.y + 1];
        nrows = tiles[3 * blockIdx.y + 2];
        w = (const void*)wtab[2 * group];
        s = (const void*)wtab[2 * group + 1];
    }
    gemm_f8_body(out, out_stride, xq, xs, w, s, row0, nrows, N, K);
}
