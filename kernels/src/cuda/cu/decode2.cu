// Decode products, second version (`SLUICE_CUDA_DECODE_KERNELS=v2`; the first version is
// tcgemv.cu / gemv.cu, kept beside it). kernels/src/cuda/NOTES-decode.md has the
// analysis, the floors and the predictions.
//
// Why a second version: the first tensor-core gemv gives every 256-thread block 64 rows
// × 512 inputs (16 KB of FP4, 32 KB of FP8) and then pays, per block, for staging 8 rows
// of activations (row maxima, three barriers), a split-K partial, a fence and a ticket:
// ~1 byte of FP4 per warp instruction (SASS counts), so the GPU runs out of issue slots
// long before it runs out of memory bandwidth. Here a block keeps its activations for
// its whole life and streams many weight rows through them:
//
// - Work unit: 16·MT output rows of one matrix (or of a w1/w3 pair) × all inputs of the
//   block's K part. The 8 warps split the K part into contiguous slices; each warp keeps
//   its slice of the activations in shared memory as f16 hi + lo pairs (converted once,
//   when the block starts, with a power-of-two scale per (warp, row) taken from the
//   slice's maximum — no block-wide reduction), and every unit the block takes reuses
//   them. Blocks loop over units (grid = what fits the GPU at once).
// - A round is 64 (FP8) or 128 (FP4) inputs of every row of the unit: one 16-byte load
//   per row and thread (a quad of 4 threads covers a row's round), dequantised in
//   registers straight into mma.m16n8k16 A fragments. The next round's loads (and, at a
//   unit's end, the next unit's first round) are issued before this round's products:
//   two register buffers, ping-pong.
// - The batch is the mma's n. Up to 4 rows, n holds (row, hi) and (row, lo) pairs, so
//   one mma per 16 inputs covers both halves of the split (the first version spends
//   two); 5-8 rows take two mmas (NB = 2 column blocks). Plain products of 9-16 and 17-32
//   rows take 2 and 4 column blocks of 8 rows with f16 activations alone (H = 1, see
//   d2_stage_x), so a decode batch of up to 32 rows streams each weight once instead of
//   once per 8 rows.
// - The inputs an mma step sees are a permutation of the physical ones (any permutation
//   works if the activations use the same): per 32-bit word of FP8 codes the pairs are
//   bytes (0, 1) and (2, 3), converted to f16 by the hardware (cvt.rn.f16x2.e4m3x2, two
//   instructions per 4 values; bit operations took 7), and per word of
//   FP4 nibbles the pairs are (j, j + 4), the layout in which one shift puts both
//   nibbles' sign bits on the f16 sign bits (Marlin's e2m1 decode): 15 ops and 4 f16
//   multiplies (the group scale) per 8 values. The activations are stored in that order.
// - A unit's sums: each warp's 16·MT × 8 accumulators, scaled by its activation scale,
//   go to shared memory (double-buffered: one barrier per unit) and are summed over the
//   warps in warp order, so results do not depend on scheduling. Small products split K
//   over blockIdx.y parts as well (so do the MoE's at 5-8 rows, whose activations would
//   otherwise leave room for one block an SM); then the last part's block (by ticket)
//   sums the parts in order, as the first version does.
//
// The MoE decode step (experts routed on the device) takes two launches per layer:
// d2moe_swiglu runs every active expert's w1/w3 over all rows of the batch (the mma's n
// is paid for anyway; no gather) and writes h = SwiGLU as f16 hi/lo pairs (a fixed scale
// from the clamp limit: |h| ≤ limit²), already permuted for the down kernel;
// d2moe_down gives each block an output tile and loops over the active experts in expert
// order, summing each row's weighted outputs as it goes (the combine, in list order),
// so no per-expert output and no combine launch.

#define D2_WARPS 8
#define D2_THREADS (D2_WARPS * 32)

// WT: 2 = FP8 weights, 3 = FP4.
template <int WT>
struct D2F {
    static constexpr int RK = WT == 3 ? 128 : 64;  // inputs of a row per round
    static constexpr int V = RK / 4;               // a thread's inputs per round
    static constexpr int Q = V / 8;                // 16-byte chunks of its f16 activations
};

// Input i (0..7) of an aligned group of 8 -> its place in the activation layout.
template <int WT>
__device__ __forceinline__ int d2_place(int i) {
    return WT == 3 ? 2 * (i & 3) + (i >> 2) : i;
}
// The inverse: which input of the group sits at place p.
template <int WT>
__device__ __forceinline__ int d2_source(int p) {
    return WT == 3 ? (p >> 1) + 4 * (p & 1) : p;
}

// 16 bytes that are read once: not kept in L1 (which holds activations and scales).
__device__ __forceinline__ uint4 d2_ld_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Four e4m3 codes -> f16 pairs (·2^-8) of bytes (0, 2) and (1, 3), by bit operations
// (the indexer's FP8 keys).
__device__ __forceinline__ void d2_fp8_pairs(u32 q, u32& p02, u32& p13) {
    p02 = ((q << 8) & 0x80008000u) | ((q << 7) & 0x3f803f80u);
    p13 = (q & 0x80008000u) | ((q >> 1) & 0x3f803f80u);
}

// Four e4m3 codes -> f16 pairs (exact) of bytes (0, 1) and (2, 3), by the hardware
// conversion (one instruction per pair, where d2_fp8_pairs takes ~3.5: the FP8 products
// were instruction-bound with it, 6% slower on a decode step's FP8 products).
__device__ __forceinline__ void d2_fp8_pairs_cvt(u32 q, u32& p01, u32& p23) {
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, lo;\n\tcvt.rn.f16x2.e4m3x2 %1, hi;\n\t}"
        : "=r"(p01), "=r"(p23)
        : "r"(q));
}

// Eight e2m1 nibbles -> f16 pairs (nibble j, nibble j + 4) for j = 0..3, each times f2
// (the group scale as f16x2, with the decode's 2^14 folded in).
__device__ __forceinline__ void d2_fp4_pairs(u32 q, u32 f2, u32* out) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const u32 s = q << (12 - 4 * j);                        // signs of j, j + 4 -> bits 15, 31
        const u32 m = j == 3 ? q >> 3 : q << (9 - 4 * j);       // magnitudes -> bits 9-11, 25-27
        out[j] = hmul2((s & 0x80008000u) | (m & 0x0e000e00u), f2);
    }
}

// f16x2 of 2^(s - 127 + 14) (s: ue8m0 byte; exact for the scales the host allows).
__device__ __forceinline__ u32 d2_fp4_scale(u32 s) {
    const u32 f = ((s - 127u + 14u + 15u) & 0x1fu) << 10;
    return f | (f << 16);
}

// One round's weight bytes for a thread: rows g, g + 8 of each m-tile of each matrix.
template <int WT, int NM, int MT>
struct D2Raw {
    uint4 a[NM][MT][2];
    u32 s[NM][MT][2];  // FP4: scale bytes
    float fs[NM][MT];  // FP8: the m-tile's block scale for this round's 128 inputs
};

// A matrix (or a w1/w3 pair) of a unit.
struct D2Mat {
    const u8* w;
    const u8* s;
    const u8* w3;
    const u8* s3;
};

// Round kr of rows o0 .. o0 + 16·MT of matrix m (N rows, K inputs; N·K bytes < 2^32, which
// the host checks): both formats read bytes kr·64 + 16·t of a row per round.
template <int WT, int NM, int MT>
__device__ __forceinline__ void d2_load(D2Raw<WT, NM, MT>& r, const D2Mat& m, u32 o0, u32 N, u32 K, u32 kr) {
    const u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 rb = WT == 2 ? K : K / 2, kb = kr * 64u + 16u * t;
#pragma unroll
    for (int mat = 0; mat < NM; mat++) {
        const u8* w = mat ? m.w3 : m.w;
        const u8* sc = mat ? m.s3 : m.s;
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u32 row = o0 + 16u * mt + g + 8u * h;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                u32 sb = 127u;
                if (row < N) {
                    v = d2_ld_stream(w + (row * rb + kb));
                    if (WT == 3) sb = __ldg(sc + (row * (K / 32u) + 4u * kr + t));
                }
                r.a[mat][mt][h] = v;
                r.s[mat][mt][h] = sb;
            }
            const u32 r0 = o0 + 16u * mt;
            r.fs[mat][mt] =
                WT == 2 && r0 < N ? __ldg((const float*)sc + ((r0 >> 7) * ((K + 127u) >> 7) + (kr >> 1))) : 0.0f;
        }
    }
}

// One round's products: acc[mat][mt][nb] += A(round) · B(nb) over the round's inputs;
// bq[nb] holds the thread's activation pairs of the round (see d2_stage_x).
template <int WT, int NM, int MT, int NB>
__device__ __forceinline__ void d2_mma(float (&acc)[NM][MT][NB][4], const D2Raw<WT, NM, MT>& r,
                                       const u32 (&bq)[NB][4 * D2F<WT>::Q]) {
#pragma unroll
    for (int mat = 0; mat < NM; mat++) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const uint4 a0 = r.a[mat][mt][0], a1 = r.a[mat][mt][1];
            const u32 w0[4] = {a0.x, a0.y, a0.z, a0.w}, w1[4] = {a1.x, a1.y, a1.z, a1.w};
            if (WT == 2) {
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    // Pairs of bytes (0, 1) and (2, 3): d2_place is the identity for FP8.
                    u32 p01a, p23a, p01b, p23b;
                    d2_fp8_pairs_cvt(w0[w], p01a, p23a);
                    d2_fp8_pairs_cvt(w1[w], p01b, p23b);
                    const u32 a[4] = {p01a, p01b, p23a, p23b};
#pragma unroll
                    for (int nb = 0; nb < NB; nb++) mma_f16(acc[mat][mt][nb], a, bq[nb][2 * w], bq[nb][2 * w + 1]);
                }
            } else {
                const u32 f0 = d2_fp4_scale(r.s[mat][mt][0]), f1 = d2_fp4_scale(r.s[mat][mt][1]);
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    u32 pa[4], pb[4];
                    d2_fp4_pairs(w0[w], f0, pa);
                    d2_fp4_pairs(w1[w], f1, pb);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const u32 a[4] = {pa[2 * h], pb[2 * h], pa[2 * h + 1], pb[2 * h + 1]};
                        const int s = 2 * w + h;
#pragma unroll
                        for (int nb = 0; nb < NB; nb++)
                            mma_f16(acc[mat][mt][nb], a, bq[nb][2 * s], bq[nb][2 * s + 1]);
                    }
                }
            }
        }
    }
}

// The power of two 2^e that puts max·2^-e under 2^14 (kept a normal float; 1 for a zero
// or non-finite max): activations divided by it split into f16 hi + lo halves without
// overflow and with ~22 bits kept.
__device__ __forceinline__ float d2_pow2_scale(float m) {
    if (!(m > 0.0f && m <= 3.0e38f)) return 1.0f;
    const int e = max(-126, min(127, (int)((__float_as_uint(m) >> 23) & 0xff) - 127 - 13));
    return __uint_as_float((u32)(e + 127) << 23);
}

// A round's activation fragments as the u32 operands d2_mma takes.
template <int NB, int Q>
__device__ __forceinline__ void d2_unpack_b(u32 (&bq)[NB][4 * Q], const uint4 (&b)[NB][Q]) {
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int q = 0; q < Q; q++) {
            bq[nb][4 * q] = b[nb][q].x;
            bq[nb][4 * q + 1] = b[nb][q].y;
            bq[nb][4 * q + 2] = b[nb][q].z;
            bq[nb][4 * q + 3] = b[nb][q].w;
        }
}

// Activation layout (shared memory for the products, global memory for the MoE h): per
// (column block nb, round, 16-byte chunk q) 32 uint4, one per lane (g = lane / 4 is the
// mma column, t = lane % 4 the quad position), holding 8 f16 of the thread's inputs in
// d2_place order. H = 2 (hi and lo halves, ~22 bits): column g of block nb is row
// 4·nb + g / 2, half g % 2. H = 1 (the 16- and 32-row kernels: f16 alone, 11 bits, still
// more than the bf16 activations the reference model computes its projections from):
// column g of block nb is row 8·nb + g.
//
// This warp converts rows [0, rows) of x over its slice (rounds kr0 .. kr0 + rw) into
// xs (its own region: nb blocks `blk` uint4 apart) and returns in sc[nb][j] the scale
// (the power of two its values were divided by) of the row of the thread's accumulator
// column 2t + j: row 4·nb + t for H = 2 (both columns), 8·nb + 2t + j for H = 1.
template <int WT, int NB, int H>
__device__ void d2_stage_x(uint4* xs, long long blk, const float* x, int x_stride, int rows, int kr0, int rw,
                           float (&sc)[NB][3 - H]) {
    constexpr int RK = D2F<WT>::RK, V = D2F<WT>::V, Q = D2F<WT>::Q;
    const int lane = threadIdx.x & 31, t = lane & 3;
    const int n = rw * RK;
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int j = 0; j < 3 - H; j++) sc[nb][j] = 1.0f;
    for (int r = 0; r < rows; r++) {
        const float* xr = x + (long long)r * x_stride + (long long)kr0 * RK;
        float m = 0.0f;
        for (int i = 4 * lane; i < n; i += 128) {
            const float4 v = *(const float4*)(xr + i);
            m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
        const float s = d2_pow2_scale(warp_max(m));  // as tc_stage_x
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int j = 0; j < 3 - H; j++)
                if (r == (H == 2 ? 4 * nb + t : 8 * nb + 2 * t + j)) sc[nb][j] = s;
        const float inv = 1.0f / s;  // a power of two: exact
        const int nb = r / (8 / H), ghi = H * (r % (8 / H));
        for (int gi = lane; gi < n / 8; gi += 32) {
            const int rr = (8 * gi) / RK, off = (8 * gi) % RK, tt = off / V, q = (off % V) / 8;
            const float4 u0 = *(const float4*)(xr + 8 * gi), u1 = *(const float4*)(xr + 8 * gi + 4);
            const float v[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
            u32 hi[4], lo[4];
#pragma unroll
            for (int p = 0; p < 4; p++) {
                const float a = v[d2_source<WT>(2 * p)] * inv, b = v[d2_source<WT>(2 * p + 1)] * inv;
                hi[p] = pack_f16x2(a, b);
                lo[p] = pack_f16x2(a - f16lo_to_f32(hi[p]), b - f16hi_to_f32(hi[p]));
            }
            uint4* d = xs + nb * blk + ((long long)rr * Q + q) * 32 + tt;
            d[4 * ghi] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
            if (H == 2) d[4 * (ghi + 1)] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        }
    }
    __syncwarp();
}

// The thread's activation pairs of round j from its warp's shared-memory region.
template <int WT, int NB>
__device__ __forceinline__ void d2_lds_b(u32 (&bq)[NB][4 * D2F<WT>::Q], const uint4* xs, long long blk, int j) {
    constexpr int Q = D2F<WT>::Q;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int q = 0; q < Q; q++) {
            const uint4 v = xs[nb * blk + ((long long)j * Q + q) * 32 + lane];
            bq[nb][4 * q] = v.x;
            bq[nb][4 * q + 1] = v.y;
            bq[nb][4 * q + 2] = v.z;
            bq[nb][4 * q + 3] = v.w;
        }
}

// Arguments of the products (a #[repr(C)] struct on the host side: pointers first).
struct D2Args {
    float* out;               // plain: out[r · out_stride + o]
    const float* x;           // x[r · x_stride + k]
    const u8* w;              // plain: weights and scales (w3/s3: the SwiGLU pair's up)
    const u8* s;
    const u8* w3;
    const u8* s3;
    const u64* wtab;          // MoE: (w1, w3, s1, s3) per expert
    const int* active;        // MoE: experts that received rows, in expert order
    const int* n_active;      // MoE: their number
    u16* hb;                  // MoE: h as f16 pairs [slot][row][hi, lo][N], d2_place order
    float* partials;          // K parts: [slot][part][8][N] (then the w3 sums)
    u32* tickets;             // K parts: one per (slot, tile), left at zero
    int rows, N, K, x_stride, out_stride;
    int tiles;                // units of 16·MT rows per matrix
    int parts;                // K parts (gridDim.y)
    int rw_max;               // most rounds a warp takes (shared-memory layout)
    float limit;              // SwiGLU clamp
    float h_scale;            // MoE: h is multiplied by this (2^-e) before the split
    int g_out;                // grouped plain product: output rows per group (0: one group);
                              // group g reads x[r · x_stride + g · K + k], and every block
                              // has one unit (grid = tiles), so it stages one group's x
    int pad;                  // zero (the host's struct has no undefined padding bytes)
};

__device__ __forceinline__ float d2_swiglu(float g, float u, float limit) {
    const float a = fminf(g, limit), b = fminf(fmaxf(u, -limit), limit);
    return a / (1.0f + expf(-a)) * b;
}

// Columns of a unit's sums and of the K parts' partials: a row per column, 8 for the
// 1-8 row kernels (H = 2), 8·NB for the 16- and 32-row ones (H = 1).
template <int NB, int H>
struct D2Cols {
    static constexpr int C = H == 2 ? 8 : 8 * NB;
};

// Shared memory: activations (NB × warps × rw_max × Q × 32 uint4), then the unit sums
// [2 (double buffer)][NM][warps][16·MT][C] floats (D2Cols).
template <int WT, int NM, int MT, int NB>
__device__ __forceinline__ float* d2_red(unsigned char* smem, int rw_max) {
    return (float*)(smem + (size_t)NB * D2_WARPS * rw_max * D2F<WT>::Q * 32 * 16);
}

// One unit's end: the warps' scaled sums to shared memory, one barrier, the warp-order
// sum, then the output (plain: out or a K part's partials and the ticket; MoE: h). Each
// thread takes (output, row) pairs i, i + 256, … of the unit's 16·MT × rows.
template <int WT, bool DUAL, int MT, int NB, int H, bool MOE>
__device__ __forceinline__ void d2_finish(const D2Args& A, float (&acc)[DUAL ? 2 : 1][MT][NB][4],
                                          const float (&sc)[NB][3 - H], float* red, int parity, long long o0, int slot) {
    constexpr int NM = DUAL ? 2 : 1, RT = 16 * MT, C = D2Cols<NB, H>::C;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float* buf = red + (size_t)parity * NM * D2_WARPS * RT * C;
#pragma unroll
    for (int mat = 0; mat < NM; mat++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
                float* row = buf + ((size_t)(mat * D2_WARPS + warp) * RT + 16 * mt + g) * C;
                if (H == 2) {
                    // Columns 2t, 2t + 1 are row 4·nb + t's hi and lo halves.
                    float* d = row + 4 * nb + t;
                    d[0] = (acc[mat][mt][nb][0] + acc[mat][mt][nb][1]) * sc[nb][0];
                    d[8 * C] = (acc[mat][mt][nb][2] + acc[mat][mt][nb][3]) * sc[nb][0];
                } else {
                    // Columns 2t, 2t + 1 are rows 8·nb + 2t, 8·nb + 2t + 1.
                    float* d = row + 8 * nb + 2 * t;
                    d[0] = acc[mat][mt][nb][0] * sc[nb][0];
                    d[1] = acc[mat][mt][nb][1] * sc[nb][3 - H - 1];
                    d[8 * C] = acc[mat][mt][nb][2] * sc[nb][0];
                    d[8 * C + 1] = acc[mat][mt][nb][3] * sc[nb][3 - H - 1];
                }
#pragma unroll
                for (int i = 0; i < 4; i++) acc[mat][mt][nb][i] = 0.0f;
            }
    __syncthreads();
    // Pairs a thread takes at most (1 up to 8 rows; the loops below then run once).
    constexpr int ITER = (RT * (8 / H) * NB + D2_THREADS - 1) / D2_THREADS;
    const int rows = A.rows, n = RT * rows;
    // The warp-order sum of pair i: output o0 + i % RT, row i / RT.
    auto unit_sum = [&](int i, float& v, float& v3) {
        const int ol = i % RT, r = i / RT;
        v = 0.0f;
        v3 = 0.0f;
        for (int w = 0; w < D2_WARPS; w++) {
            v += buf[((size_t)w * RT + ol) * C + r];
            if (DUAL) v3 += buf[((size_t)(D2_WARPS + w) * RT + ol) * C + r];
        }
    };
    // The unit's result: MoE h (SwiGLU, scaled, as f16 halves in d2_place order) or out.
    auto emit = [&](int r, long long o, float a, float a3) {
        if (MOE) {
            const float h = d2_swiglu(a, a3, A.limit) * A.h_scale;
            const u32 hh = pack_f16x2(h, 0.0f);
            const u32 hl = pack_f16x2(h - f16lo_to_f32(hh), 0.0f);
            const long long at = (((long long)slot * rows + r) * 2) * A.N + (o & ~7ll) + d2_place<3>((int)(o & 7));
            A.hb[at] = (u16)(hh & 0xffffu);
            A.hb[at + A.N] = (u16)(hl & 0xffffu);
        } else {
            A.out[(long long)r * A.out_stride + o] = DUAL ? d2_swiglu(a, a3, A.limit) : a;
        }
    };
    const int KS = A.parts;
    if (KS == 1) {
        #pragma unroll
    for (int it = 0; it < ITER; it++) {
        const int i = threadIdx.x + it * D2_THREADS;
        if (i >= n) break;
            const long long o = o0 + i % RT;
            if (o >= A.N) continue;
            float v, v3;
            unit_sum(i, v, v3);
            emit(i / RT, o, v, v3);
        }
        return;
    }
    // K parts: partials[slot][part][C][N] (then the w3 sums), one ticket per (slot, tile).
    float* pp = A.partials + (long long)slot * KS * C * A.N * NM;
    #pragma unroll
    for (int it = 0; it < ITER; it++) {
        const int i = threadIdx.x + it * D2_THREADS;
        if (i >= n) break;
        const long long o = o0 + i % RT;
        if (o >= A.N) continue;
        float v, v3;
        unit_sum(i, v, v3);
        const long long at = ((long long)blockIdx.y * C + i / RT) * A.N + o;
        pp[at] = v;
        if (DUAL) pp[(long long)KS * C * A.N + at] = v3;
    }
    __shared__ u32 last;
    __threadfence();
    __syncthreads();
    const int ticket = slot * A.tiles + (int)(o0 / RT);
    if (threadIdx.x == 0) last = atomicAdd(&A.tickets[ticket], 1u) == (u32)(KS - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    #pragma unroll
    for (int it = 0; it < ITER; it++) {
        const int i = threadIdx.x + it * D2_THREADS;
        if (i >= n) break;
        const int r = i / RT;
        const long long o = o0 + i % RT;
        if (o >= A.N) continue;
        float s = 0.0f, s3 = 0.0f;
        for (int ks = 0; ks < KS; ks++) {
            const long long at = ((long long)ks * C + r) * A.N + o;
            s += __ldcg(&pp[at]);
            if (DUAL) s3 += __ldcg(&pp[(long long)KS * C * A.N + at]);
        }
        emit(r, o, s, s3);
    }
    if (threadIdx.x == 0) A.tickets[ticket] = 0u;
}

// The products (plain: one matrix or pair, tiles × K parts; MoE: units (active slot,
// tile) of every active expert's w1/w3 pair); H: activation halves (d2_stage_x).
template <int WT, bool DUAL, int MT, int NB, int H, bool MOE>
__device__ void d2_body(const D2Args& A) {
    constexpr int NM = DUAL ? 2 : 1, Q = D2F<WT>::Q, RT = 16 * MT;
    extern __shared__ __align__(16) unsigned char d2_smem[];
    const int warp = threadIdx.x >> 5;
    const int units = MOE ? *A.n_active * A.tiles : A.tiles;
    if ((int)blockIdx.x >= units) return;
    const int TR = A.K / D2F<WT>::RK;
    const int pr0 = (int)blockIdx.y * TR / A.parts, pn = ((int)blockIdx.y + 1) * TR / A.parts - pr0;
    const int kr0 = pr0 + warp * pn / D2_WARPS, rw = pr0 + (warp + 1) * pn / D2_WARPS - kr0;
    const long long blk = (long long)D2_WARPS * A.rw_max * Q * 32;
    uint4* xs = (uint4*)d2_smem + (long long)warp * A.rw_max * Q * 32;
    float* red = d2_red<WT, NM, MT, NB>(d2_smem, A.rw_max);

    auto unit_mat = [&](int u, int& slot, long long& o0) {
        D2Mat m;
        if (MOE) {
            slot = u / A.tiles;
            o0 = (long long)(u % A.tiles) * RT;
            const u64* e = A.wtab + 4 * A.active[slot];
            m.w = (const u8*)e[0];
            m.w3 = (const u8*)e[1];
            m.s = (const u8*)e[2];
            m.s3 = (const u8*)e[3];
        } else {
            slot = 0;
            o0 = (long long)u * RT;
            m.w = A.w;
            m.s = A.s;
            m.w3 = A.w3;
            m.s3 = A.s3;
        }
        return m;
    };

    float acc[NM][MT][NB][4], part[NM][MT][NB][4];
#pragma unroll
    for (int a = 0; a < NM; a++)
#pragma unroll
        for (int b = 0; b < MT; b++)
#pragma unroll
            for (int c = 0; c < NB; c++)
#pragma unroll
                for (int d = 0; d < 4; d++) acc[a][b][c][d] = part[a][b][c][d] = 0.0f;
    float sc[NB][3 - H];
    int parity = 0;

    int u = blockIdx.x, slot;
    long long o0;
    D2Mat m = unit_mat(u, slot, o0);
    const float* x = A.g_out ? A.x + (o0 / A.g_out) * A.K : A.x;
    if (rw == 0) {
        d2_stage_x<WT, NB, H>(xs, blk, x, A.x_stride, A.rows, kr0, 0, sc);
        for (; u < units; u += gridDim.x) {
            m = unit_mat(u, slot, o0);
            d2_finish<WT, DUAL, MT, NB, H, MOE>(A, acc, sc, red, parity, o0, slot);
            parity ^= 1;
        }
        return;
    }
    D2Raw<WT, NM, MT> ra, rb;
    d2_load<WT, NM, MT>(ra, m, (u32)o0, A.N, A.K, kr0);
    d2_stage_x<WT, NB, H>(xs, blk, x, A.x_stride, A.rows, kr0, rw, sc);

    int j = 0;
    // One round: prefetch the next (unit, round) into `nxt`, multiply `cur`, finish the
    // unit after its last round. Returns false when the block has no more rounds.
    auto step = [&](const D2Raw<WT, NM, MT>& cur, D2Raw<WT, NM, MT>& nxt) -> bool {
        int nu = u, nj = j + 1, nslot = slot;
        long long no0 = o0;
        D2Mat nm = m;
        if (nj == rw) {
            nu = u + gridDim.x;
            nj = 0;
            if (nu < units) nm = unit_mat(nu, nslot, no0);
        }
        const bool more = nu < units;
        if (more) d2_load<WT, NM, MT>(nxt, nm, (u32)no0, A.N, A.K, kr0 + nj);
        u32 bq[NB][4 * Q];
        d2_lds_b<WT, NB>(bq, xs, blk, j);
        if (WT == 2) {
            d2_mma<WT, NM, MT, NB>(part, cur, bq);
            // Each FP8 block scale covers 128 inputs (two rounds) of the m-tile's rows.
            const int kr = kr0 + j;
            if ((kr & 1) || j == rw - 1) {
#pragma unroll
                for (int a = 0; a < NM; a++)
#pragma unroll
                    for (int b = 0; b < MT; b++)
#pragma unroll
                        for (int c = 0; c < NB; c++)
#pragma unroll
                            for (int d = 0; d < 4; d++) {
                                acc[a][b][c][d] = fmaf(part[a][b][c][d], cur.fs[a][b], acc[a][b][c][d]);
                                part[a][b][c][d] = 0.0f;
                            }
            }
        } else {
            d2_mma<WT, NM, MT, NB>(acc, cur, bq);
        }
        if (j == rw - 1) {
            d2_finish<WT, DUAL, MT, NB, H, MOE>(A, acc, sc, red, parity, o0, slot);
            parity ^= 1;
        }
        u = nu;
        j = nj;
        slot = nslot;
        o0 = no0;
        m = nm;
        return more;
    };
    while (step(ra, rb) && step(rb, ra)) {
    }
}

#define D2_KERNEL(NAME, WT, DUAL, MT, NB, H, MOE)                          \
    extern "C" __global__ void __launch_bounds__(D2_THREADS) NAME(D2Args a) { \
        pdl_begin();                                                          \
        d2_body<WT, DUAL, MT, NB, H, MOE>(a);                                 \
    }

D2_KERNEL(d2gemv_fp8_n1, 2, false, 2, 1, 2, false)
D2_KERNEL(d2gemv_fp8_n2, 2, false, 2, 2, 2, false)
D2_KERNEL(d2gemv_fp4_n1, 3, false, 2, 1, 2, false)
D2_KERNEL(d2gemv_fp4_n2, 3, false, 2, 2, 2, false)
// Plain products of 9-16 and 17-32 rows in one weight stream: 2 or 4 column blocks of 8
// rows with f16 activations alone (hi + lo pairs would double the mmas, which bound a
// 32-row launch: with pairs it took 101 µs where four 8-row launches take ~70).
D2_KERNEL(d2gemv_fp8_r16, 2, false, 2, 2, 1, false)
D2_KERNEL(d2gemv_fp8_r32, 2, false, 1, 4, 1, false)
D2_KERNEL(d2gemv_fp4_r16, 3, false, 2, 2, 1, false)
D2_KERNEL(d2swiglu_fp8_n1, 2, true, 1, 1, 2, false)
D2_KERNEL(d2swiglu_fp8_n2, 2, true, 1, 2, 2, false)
D2_KERNEL(d2swiglu_fp4_n1, 3, true, 1, 1, 2, false)
D2_KERNEL(d2swiglu_fp4_n2, 3, true, 1, 2, 2, false)
D2_KERNEL(d2moe_swiglu_fp4_n1, 3, true, 1, 1, 2, true)
D2_KERNEL(d2moe_swiglu_fp4_n2, 3, true, 1, 2, 2, true)

// The MoE down projection and the combine: out[r, o] = Σ over row r's (expert, weight)
// choices in expert order of weight · (h[slot(expert), r] · w2[expert][o]). A unit is an
// output tile of 16 rows; the block loops over the active experts, 8 warps splitting
// the inputs (the experts' intermediate width), and after each expert the reducing
// thread of (o, r) adds the expert's weighted output for every choice of row r that
// names it (a hash table may name one expert twice: both, in choice order).
struct D2DownArgs {
    float* out;           // [rows, N]
    const u16* hb;        // from d2moe_swiglu: [slot][row][hi, lo][K]
    const u64* wtab;      // (w2, -, s2, -) per expert
    const int* active;
    const int* n_active;
    const int* chosen;    // [rows, k] expert ids
    const float* weights; // [rows, k]
    int rows, N, K, k, tiles;
    float h_unscale;      // undoes D2Args::h_scale
};

template <int NB>
__device__ void d2_down_body(const D2DownArgs& A) {
    constexpr int WT = 3, NM = 1, MT = 1, Q = D2F<WT>::Q, RT = 16;
    __shared__ float red[2][D2_WARPS][RT][8];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int TR = A.K / D2F<WT>::RK;
    const int kr0 = warp * TR / D2_WARPS, rw = (warp + 1) * TR / D2_WARPS - kr0;
    const int n_act = *A.n_active;
    const int rows = A.rows;
    const int i = threadIdx.x;
    const bool mine = i < RT * rows;
    const int ol = i % RT, r = i / RT;
    float out_acc = 0.0f;
    float acc[NM][MT][NB][4];
#pragma unroll
    for (int c = 0; c < NB; c++)
#pragma unroll
        for (int d = 0; d < 4; d++) acc[0][0][c][d] = 0.0f;
    int parity = 0;

    // After the last round of (tile, slot): reduce, weigh, and after the last slot store.
    auto finish = [&](long long o0, int slot) {
        float(*buf)[RT][8] = red[parity];
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            buf[warp][g][4 * nb + t] = acc[0][0][nb][0] + acc[0][0][nb][1];
            buf[warp][g + 8][4 * nb + t] = acc[0][0][nb][2] + acc[0][0][nb][3];
#pragma unroll
            for (int d = 0; d < 4; d++) acc[0][0][nb][d] = 0.0f;
        }
        __syncthreads();
        parity ^= 1;
        if (mine) {
            float y = 0.0f;
            for (int w = 0; w < D2_WARPS; w++) y += buf[w][ol][r];
            y *= A.h_unscale;
            const int e = A.active[slot];
            for (int j = 0; j < A.k; j++)
                if (A.chosen[r * A.k + j] == e) out_acc += A.weights[r * A.k + j] * y;
            if (slot == n_act - 1) {
                if (o0 + ol < A.N) A.out[(long long)r * A.N + o0 + ol] = out_acc;
                out_acc = 0.0f;
            }
        }
    };

    if (n_act == 0) {
        for (int u = blockIdx.x; u < A.tiles; u += gridDim.x)
            if (mine && (long long)u * RT + ol < A.N) A.out[(long long)r * A.N + (long long)u * RT + ol] = 0.0f;
        return;
    }
    int u = blockIdx.x;
    if (u >= A.tiles) return;
    if (rw == 0) {
        for (; u < A.tiles; u += gridDim.x)
            for (int s = 0; s < n_act; s++) finish((long long)u * RT, s);
        return;
    }
    auto mat_of = [&](int slot) {
        const u64* e = A.wtab + 4 * A.active[slot];
        D2Mat m;
        m.w = (const u8*)e[0];
        m.s = (const u8*)e[2];
        m.w3 = m.w;
        m.s3 = m.s;
        return m;
    };
    // The thread's activations of a round: column g of block nb is row 4·nb + g / 2,
    // half g % 2; each lane reads its 4 chunks (64 bytes).
    struct Raw {
        D2Raw<WT, NM, MT> w;
        uint4 b[NB][Q];
    };
    auto load = [&](Raw& x, const D2Mat& m, long long o0, int slot, int j) {
        d2_load<WT, NM, MT>(x.w, m, (u32)o0, A.N, A.K, kr0 + j);
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            const int row = 4 * nb + g / 2;
            const uint4* src = (const uint4*)(A.hb + (((long long)slot * rows + row) * 2 + (g & 1)) * A.K +
                                              (long long)(kr0 + j) * D2F<WT>::RK + D2F<WT>::V * t);
#pragma unroll
            for (int q = 0; q < Q; q++) x.b[nb][q] = row < rows ? __ldg(src + q) : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    int slot = 0, j = 0;
    long long o0 = (long long)u * RT;
    D2Mat m = mat_of(0);
    Raw ra, rb;
    load(ra, m, o0, slot, 0);
    auto step = [&](const Raw& cur, Raw& nxt) -> bool {
        int nu = u, ns = slot, nj = j + 1;
        D2Mat nm = m;
        if (nj == rw) {
            nj = 0;
            ns = slot + 1;
            if (ns == n_act) {
                ns = 0;
                nu = u + gridDim.x;
            }
            if (nu < A.tiles) nm = mat_of(ns);
        }
        const bool more = nu < A.tiles;
        if (more) load(nxt, nm, (long long)nu * RT, ns, nj);
        u32 bq[NB][4 * Q];
        d2_unpack_b<NB, Q>(bq, cur.b);
        d2_mma<WT, NM, MT, NB>(acc, cur.w, bq);
        if (j == rw - 1) finish(o0, slot);
        u = nu;
        slot = ns;
        j = nj;
        o0 = (long long)u * RT;
        m = nm;
        return more;
    };
    while (step(ra, rb) && step(rb, ra)) {
    }
}

extern "C" __global__ void __launch_bounds__(D2_THREADS) d2moe_down_fp4_n1(D2DownArgs a) {
    pdl_begin();
    d2_down_body<1>(a);
}
extern "C" __global__ void __launch_bounds__(D2_THREADS) d2moe_down_fp4_n2(D2DownArgs a) {
    pdl_begin();
    d2_down_body<2>(a);
}
