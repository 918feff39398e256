// Routed experts of decode batches of 9-64 rows (v2; the 1-8 row kernels are at the end
// of decode2.cu). Those kernels run every active expert over every row of the batch,
// which is free while the batch fits one mma's n (8 rows) but not beyond: the first
// version instead ran the batch in launches of 8 rows, each streaming every expert its
// 8 rows chose, so a 64-row layer streamed ~380 experts where ~200 distinct ones were
// chosen (62% of the step's kernel time). Here a unit is (segment, output tile): a
// segment is up to 4·NB consecutive list positions of one expert (`moe_lists` cuts each
// expert's run into segments), so each chosen expert is streamed once per projection
// whatever the batch, and the mma's n holds only rows that chose it.
//
// Activations cannot stay in shared memory for a block's life (every segment has its
// own rows), so they are staged once in global memory in the layout the mma fragments
// read (f16 hi + lo halves in d2_place order, as the down kernel of decode2.cu reads h)
// and each round loads the thread's fragments from L2 beside the weights.

// x[rows, K] (f32) -> xb[row][hi, lo][K] as f16 halves in d2_place<3> order, every row
// divided by the power of two xscale[row] that puts its maximum under 2^14 (as
// d2_stage_x, with one scale a row instead of one a warp's slice). A block a row (a warp
// a row took ~6.5 µs at batch 1, walking 4096 inputs twice).
extern "C" __global__ void __launch_bounds__(256) d2_rows_f16(u16* xb, float* xscale, const float* x, int rows, int K) {
    pdl_begin();
    __shared__ float wmax[8];
    const int r = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (r >= rows) return;
    const float* xr = x + (long long)r * K;
    float m = 0.0f;
    for (int i = 4 * threadIdx.x; i < K; i += 4 * blockDim.x) {
        const float4 v = *(const float4*)(xr + i);
        m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    m = warp_max(m);
    if (lane == 0) wmax[warp] = m;
    __syncthreads();
    m = wmax[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, wmax[w]);
    const float s = d2_pow2_scale(m);
    if (threadIdx.x == 0) xscale[r] = s;
    const float inv = 1.0f / s;  // a power of two: exact
    u16* hi = xb + (long long)r * 2 * K;
    for (int gi = threadIdx.x; gi < K / 8; gi += blockDim.x) {
        const float4 u0 = *(const float4*)(xr + 8 * gi), u1 = *(const float4*)(xr + 8 * gi + 4);
        const float v[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
        u32 h[4], l[4];
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const float a = v[d2_source<3>(2 * p)] * inv, b = v[d2_source<3>(2 * p + 1)] * inv;
            h[p] = pack_f16x2(a, b);
            l[p] = pack_f16x2(a - f16lo_to_f32(h[p]), b - f16hi_to_f32(h[p]));
        }
        *(uint4*)(hi + 8 * gi) = make_uint4(h[0], h[1], h[2], h[3]);
        *(uint4*)(hi + K + 8 * gi) = make_uint4(l[0], l[1], l[2], l[3]);
    }
}

// Arguments of the segment kernels (a #[repr(C)] struct on the host side: pointers first).
struct D2SegArgs {
    void* out;             // gate/up: h as f16 halves [pos][hi, lo][N] (d2_place order); down: y [pos][N] (f32)
    const u16* xb;         // inputs as f16 halves: gate/up [batch row][hi, lo][K]; down [pos][hi, lo][K]
    const float* xscale;   // gate/up: the power of two each batch row of xb was divided by
    const u64* wtab;       // (w, w3, s, s3) per expert
    const int* segs;       // [3][max_segs]: first list position, rows, expert
    const int* n_seg;      // segments in use
    const int* list_rows;  // gate/up: the batch row of each list position
    int N, K, tiles, max_segs;
    float limit;           // SwiGLU clamp
    float h_scale;         // gate/up: h is multiplied by this before the split; down: its inverse
};

// A unit: its segment's list positions, weights and output tile, and the rows of xb
// whose fragments this thread loads (one per column block; -1: past the segment).
template <int NB>
struct D2SegUnit {
    D2Mat m;
    long long o0;
    int p0, len;
    int src[NB];
};

// DUAL: gate/up (w1/w3 pair, SwiGLU into h); otherwise the down projection into y.
// Segments of up to 4·NB rows; 8 warps split K; one barrier a unit.
template <bool DUAL, int NB>
__device__ void d2_seg_body(const D2SegArgs& A) {
    constexpr int WT = 3, NM = DUAL ? 2 : 1, MT = 1, Q = D2F<WT>::Q, RT = 16, RK = D2F<WT>::RK, V = D2F<WT>::V;
    __shared__ float red[2][NM][D2_WARPS][RT][8];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int TR = A.K / RK;
    const int kr0 = warp * TR / D2_WARPS, rw = (warp + 1) * TR / D2_WARPS - kr0;
    const int units = *A.n_seg * A.tiles;
    const int ol = threadIdx.x % RT, r = threadIdx.x / RT;  // the output this thread sums
    float acc[NM][MT][NB][4];
#pragma unroll
    for (int a = 0; a < NM; a++)
#pragma unroll
        for (int c = 0; c < NB; c++)
#pragma unroll
            for (int d = 0; d < 4; d++) acc[a][0][c][d] = 0.0f;
    int parity = 0;

    auto unit_of = [&](int u) {
        D2SegUnit<NB> x;
        const int s = u / A.tiles;
        x.p0 = A.segs[s];
        x.len = A.segs[A.max_segs + s];
        const u64* e = A.wtab + 4 * A.segs[2 * A.max_segs + s];
        x.m.w = (const u8*)e[0];
        x.m.w3 = (const u8*)e[1];
        x.m.s = (const u8*)e[2];
        x.m.s3 = (const u8*)e[3];
        if (!DUAL) {
            x.m.w3 = x.m.w;
            x.m.s3 = x.m.s;
        }
        x.o0 = (long long)(u % A.tiles) * RT;
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            const int sr = 4 * nb + g / 2;
            x.src[nb] = sr < x.len ? (DUAL ? A.list_rows[x.p0 + sr] : x.p0 + sr) : -1;
        }
        return x;
    };
    // After a unit's last round: the warps' sums to shared memory, one barrier, then the
    // warp-order sum of output (ol, r) and its store.
    auto finish = [&](const D2SegUnit<NB>& un) {
#pragma unroll
        for (int mat = 0; mat < NM; mat++)
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
                red[parity][mat][warp][g][4 * nb + t] = acc[mat][0][nb][0] + acc[mat][0][nb][1];
                red[parity][mat][warp][g + 8][4 * nb + t] = acc[mat][0][nb][2] + acc[mat][0][nb][3];
#pragma unroll
                for (int d = 0; d < 4; d++) acc[mat][0][nb][d] = 0.0f;
            }
        __syncthreads();
        const long long o = un.o0 + ol;
        if (r < un.len && o < A.N) {
            float v = 0.0f, v3 = 0.0f;
            for (int w = 0; w < D2_WARPS; w++) {
                v += red[parity][0][w][ol][r];
                if (DUAL) v3 += red[parity][NM - 1][w][ol][r];
            }
            const long long p = un.p0 + r;
            if (DUAL) {
                const float s = A.xscale[A.list_rows[p]];
                const float h = d2_swiglu(v * s, v3 * s, A.limit) * A.h_scale;
                const u32 hh = pack_f16x2(h, 0.0f);
                const u32 hl = pack_f16x2(h - f16lo_to_f32(hh), 0.0f);
                u16* hb = (u16*)A.out + p * 2 * A.N + (o & ~7ll) + d2_place<3>((int)(o & 7));
                hb[0] = (u16)(hh & 0xffffu);
                hb[A.N] = (u16)(hl & 0xffffu);
            } else {
                ((float*)A.out)[p * A.N + o] = v * A.h_scale;
            }
        }
        parity ^= 1;
    };

    int u = blockIdx.x;
    if (u >= units) return;
    if (rw == 0) {  // K has fewer rounds than warps: this warp only takes part in the sums
        for (; u < units; u += gridDim.x) finish(unit_of(u));
        return;
    }
    struct Raw {
        D2Raw<WT, NM, MT> w;
        uint4 b[NB][Q];
    };
    // Round j of a unit: the weights (d2_load) and the thread's activation fragments:
    // column g of block nb is segment row 4·nb + g / 2, half g % 2.
    auto load = [&](Raw& x, const D2SegUnit<NB>& un, int j) {
        d2_load<WT, NM, MT>(x.w, un.m, (u32)un.o0, A.N, A.K, kr0 + j);
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            const uint4* src =
                (const uint4*)(A.xb + ((long long)un.src[nb] * 2 + (g & 1)) * A.K + (long long)(kr0 + j) * RK + V * t);
#pragma unroll
            for (int q = 0; q < Q; q++) x.b[nb][q] = un.src[nb] >= 0 ? __ldg(src + q) : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    D2SegUnit<NB> un = unit_of(u);
    int j = 0;
    Raw ra, rb;
    load(ra, un, 0);
    // One round: prefetch the next (unit, round), multiply this one, finish the unit
    // after its last round. False when the block has no more rounds.
    auto step = [&](const Raw& cur, Raw& nxt) -> bool {
        int nu = u, nj = j + 1;
        D2SegUnit<NB> nun = un;
        if (nj == rw) {
            nj = 0;
            nu = u + gridDim.x;
            if (nu < units) nun = unit_of(nu);
        }
        const bool more = nu < units;
        if (more) load(nxt, nun, nj);
        u32 bq[NB][4 * Q];
        d2_unpack_b<NB, Q>(bq, cur.b);
        d2_mma<WT, NM, MT, NB>(acc, cur.w, bq);
        if (j == rw - 1) finish(un);
        u = nu;
        j = nj;
        un = nun;
        return more;
    };
    while (step(ra, rb) && step(rb, ra)) {
    }
}

#define D2SEG_KERNEL(NAME, SWIGLU, NB)                                          \
    extern "C" __global__ void __launch_bounds__(D2_THREADS) NAME(D2SegArgs a) { \
        pdl_begin();                                                             \
        d2_seg_body<SWIGLU, NB>(a);                                              \
    }

D2SEG_KERNEL(d2seg_swiglu_fp4_n1, true, 1)
D2SEG_KERNEL(d2seg_swiglu_fp4_n2, true, 2)
D2SEG_KERNEL(d2seg_down_fp4_n1, false, 1)
D2SEG_KERNEL(d2seg_down_fp4_n2, false, 2)
