// hc_post_mix_rows with the mixing product on the tensor cores (hc.rs `post_mix_rows`;
// SLUICE_CUDA_HC_POST_MIX_TC=0 keeps hc_rows.cu's CUDA-core kernel). The streams'
// update is hc_post's, value for value (hc_post_value: the same bits); the 24 logits'
// part sums are a [rows, 16 K] × [16 K, 24] product in f32 precision made of three TF32
// products (`mma.m16n8k8`: hi·hi + hi·lo + lo·hi, each operand split into its TF32
// rounding and the rounding of the rest: ~22 bits of each, the dropped lo·lo ~2⁻²² of a
// term), the sum of squares beside them on the CUDA cores.
//
// Why: the CUDA-core kernel fed each value's 24 weights from shared memory (96 bytes a
// value, 12.9 GB for an 8K prefill's call) and shared memory's bandwidth, not the
// streams' 1.2 GB, bounded it (~527 µs where the bytes take ~290). Here a warp's 16 rows
// share each weight fragment. An earlier form loaded each lane's values straight into
// registers in the mma's layout (a row's 4 lanes: 32 bytes of a row an access, one step
// in flight) and waited on its loads (720–880 µs, docs/perf.md); here each warp copies
// its rows by `cp.async` in 128-byte pieces (4 rows an instruction) into a ring of two
// units in shared memory, the next unit in flight while one is computed, and reads the
// fragments from there.
//
// A warp takes 16 rows at a time (a tile; lane (g, t) = (lane / 4, lane % 4) holds rows g
// and g + 8, the mma's rows); a unit is a tile's 32 columns of each stream and of the
// sub-block's output (5 × 16 rows × 128 bytes), a row's 16-byte piece p at position
// p ^ 4 (odd rows) so that the lanes' fragment reads of two rows fall on distinct banks.
// A unit is computed in two groups of 16 columns, lane t's 4 contiguous ones (4t … 4t + 3:
// one 16-byte read a row and array). The product's K is permuted to match (the sum does
// not depend on the order of its terms, only the rounding does): of a group's 16 columns
// of a stream, k8 tile h takes columns 4t + 2h and 4t + 2h + 1 as its k = t and t + 4.
// The part's f32 weights sit in shared memory in that order, [group][stream][n tile][lane]
// [4] (a lane's b fragments for both tiles in one 16-byte read), split as they are read.
// grid (hidden / HPT_COLS parts, rows / HPT_ROWS), HPT_THREADS threads, HPT_SMEM bytes of
// dynamic shared memory (one block an SM).
#define HPT_THREADS 256
#define HPT_WARPS (HPT_THREADS / 32)
#define HPT_ROWS 512   // rows a block: each warp 4 tiles of 16
#define HPT_COLS 128   // columns of each stream a part holds (hc_post_mix_rows' parts)
#define HPT_N 24       // V4's logits: (2 + 4) · 4, 3 n tiles of 8
#define HPT_WFLOATS (HPT_COLS * 4 * HPT_N)
#define HPT_UNIT (5 * 16 * 128)  // bytes of a unit: 4 streams and the output, 16 rows, 32 columns
#define HPT_SMEM (HPT_WFLOATS * 4 + HPT_WARPS * 2 * HPT_UNIT)

__device__ __forceinline__ u32 hpt_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// x as hi + lo, each a TF32 value.
__device__ __forceinline__ void hpt_split(float x, u32& hi, u32& lo) {
    hi = hpt_tf32(x);
    lo = hpt_tf32(x - __uint_as_float(hi));
}
__device__ __forceinline__ void hpt_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Row r's post (4) and comb (16) coefficients, zeros past the end.
__device__ __forceinline__ void hpt_coefficients(const float* __restrict__ post, const float* __restrict__ comb, int r,
                                                 int rows, float (&p)[4], float (&c)[16]) {
    const bool live = r < rows;
    const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    *(float4*)&p[0] = live ? __ldg((const float4*)(post + (long long)r * 4)) : z;
#pragma unroll
    for (int i = 0; i < 4; i++) *(float4*)&c[4 * i] = live ? __ldg((const float4*)(comb + (long long)r * 16) + i) : z;
}

template <int WT>
__device__ __forceinline__ void hc_post_mix_rows_tc_body(float* streams, const float* src, int copies,
                                                         const float* __restrict__ out,
                                                         const float* __restrict__ post,
                                                         const float* __restrict__ comb, int rows, int d,
                                                         const void* __restrict__ w, float* __restrict__ partials) {
    extern __shared__ __align__(128) float hpt_w[];
    const int part = blockIdx.x, parts = gridDim.x, x0 = part * HPT_COLS;
    const long long K = 4LL * d;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // The part's weights (static: before waiting for the kernel before): 16-byte pieces
    // (4 columns of one logit and stream), read along the columns.
    for (int e = threadIdx.x; e < HPT_WFLOATS / 4; e += HPT_THREADS) {
        const int pt = e & 3, grp = (e >> 2) & 7, k = (e >> 5) & 3, n = e >> 7;
        const long long at = n * K + (long long)k * d + x0 + 16 * grp + 4 * pt;
        const int dst = (((grp * 4 + k) * 3 + (n >> 3)) * 32 + (n & 7) * 4 + pt) * 4;
        if (WT == 0) {
            cp_async<16>(smem_addr(hpt_w + dst), (const float*)w + at);
        } else {
            const u16* wb = (const u16*)w + at;
            *(float4*)(hpt_w + dst) = make_float4(bf2f(wb[0]), bf2f(wb[1]), bf2f(wb[2]), bf2f(wb[3]));
        }
    }
    cp_async_commit();
    pdl_wait();
    u8* ring = (u8*)(hpt_w + HPT_WFLOATS) + warp * 2 * HPT_UNIT;
    // The streams before the update: `streams` itself, or with `copies` the rows of `src`
    // (`[rows, d]`, every stream of a row that row).
    const long long src_row = copies ? d : K, src_stream = copies ? 0 : d;
    const int wrow0 = blockIdx.y * HPT_ROWS + warp * (HPT_ROWS / HPT_WARPS);
    const int tiles = max(0, min(HPT_ROWS / HPT_WARPS / 16, (rows - wrow0 + 15) / 16));
    const int units = tiles * (HPT_COLS / 32);
    // Unit u (tile u / 4, columns 32 (u % 4) of the part) into ring slot u % 2: 640 pieces,
    // 20 a lane, a row's 8 in 8 lanes. A dead row copies the last row (its coefficients are
    // zeros and the mma's rows do not mix, so what it holds reaches no stored value).
    auto issue = [&](int u) {
        if (u < units) {
            const u32 slot = smem_addr(ring + (u & 1) * HPT_UNIT);
            const int r0 = wrow0 + (u >> 2) * 16, c0 = x0 + (u & 3) * 32;
#pragma unroll 4
            for (int j = 0; j < 20; j++) {
                const int pc = lane + 32 * j, ar = pc >> 3, p = pc & 7, a = ar >> 4, r = ar & 15;
                const long long row = min(r0 + r, rows - 1);
                const float* from = a < 4 ? src + row * src_row + a * src_stream + c0 + 4 * p
                                          : out + row * d + c0 + 4 * p;
                cp_async<16>(slot + ((ar * 8 + (p ^ ((r & 1) << 2))) << 4), from);
            }
        }
        cp_async_commit();  // one group a unit, empty past the end, so the waits count units
    };
    issue(0);
    cp_async_wait<1>();  // the weights (this thread's pieces)
    __syncthreads();     // everyone's
    float acc[3][4], ssa = 0.0f, ssb = 0.0f;
    float pa[4], ca[16], pb[4], cb[16];
    for (int u = 0; u < units; u++) {
        issue(u + 1);
        const int chunk = u & 3, r0 = wrow0 + (u >> 2) * 16, ra = r0 + g, rb = r0 + g + 8;
        if (chunk == 0) {
            hpt_coefficients(post, comb, ra, rows, pa, ca);
            hpt_coefficients(post, comb, rb, rows, pb, cb);
#pragma unroll
            for (int q = 0; q < 3; q++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[q][e] = 0.0f;
            ssa = ssb = 0.0f;
        }
        cp_async_wait<1>();  // unit u (this lane's pieces)
        __syncwarp();        // and the other lanes'
        const float4* slot = (const float4*)(ring + (u & 1) * HPT_UNIT);
        const bool la = ra < rows, lb = rb < rows;
#pragma unroll
        for (int m = 0; m < 2; m++) {
            const int pos = (4 * m + t) ^ ((g & 1) << 2), col = x0 + chunk * 32 + 16 * m + 4 * t;
            float va[4][4], vb[4][4], oa[4], ob[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                *(float4*)&va[k][0] = slot[(k * 16 + g) * 8 + pos];
                *(float4*)&vb[k][0] = slot[(k * 16 + g + 8) * 8 + pos];
            }
            *(float4*)&oa[0] = slot[(64 + g) * 8 + pos];
            *(float4*)&ob[0] = slot[(64 + g + 8) * 8 + pos];
            // The update, hc_post's (dead rows' values 0: their zero coefficients).
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float olda[4] = {va[0][i], va[1][i], va[2][i], va[3][i]};
                const float oldb[4] = {vb[0][i], vb[1][i], vb[2][i], vb[3][i]};
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    va[k][i] = hc_post_value(pa[k], oa[i], ca + k, 4, olda, 4);
                    vb[k][i] = hc_post_value(pb[k], ob[i], cb + k, 4, oldb, 4);
                    ssa += va[k][i] * va[k][i];
                    ssb += vb[k][i] * vb[k][i];
                }
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                if (la) *(float4*)(streams + (long long)ra * K + (long long)k * d + col) = *(const float4*)&va[k][0];
                if (lb) *(float4*)(streams + (long long)rb * K + (long long)k * d + col) = *(const float4*)&vb[k][0];
            }
            const float4* wg = (const float4*)hpt_w + ((chunk * 2 + m) * 4) * 3 * 32 + lane;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                u32 ah[4], al[4], bh[4], bl[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    hpt_split(va[k][e], ah[e], al[e]);
                    hpt_split(vb[k][e], bh[e], bl[e]);
                }
#pragma unroll
                for (int q = 0; q < 3; q++) {
                    const float4 wv = wg[(k * 3 + q) * 32];
                    const float wf[4] = {wv.x, wv.y, wv.z, wv.w};
                    u32 wh[4], wl[4];
#pragma unroll
                    for (int e = 0; e < 4; e++) hpt_split(wf[e], wh[e], wl[e]);
                    // k tile h: columns 4t + 2h, 4t + 2h + 1; the small terms first.
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int e = 2 * h;
                        hpt_mma(acc[q], al[e], bl[e], al[e + 1], bl[e + 1], wh[e], wh[e + 1]);
                        hpt_mma(acc[q], ah[e], bh[e], ah[e + 1], bh[e + 1], wl[e], wl[e + 1]);
                        hpt_mma(acc[q], ah[e], bh[e], ah[e + 1], bh[e + 1], wh[e], wh[e + 1]);
                    }
                }
            }
        }
        __syncwarp();  // every lane done with the slot before the next issue refills it
        if (chunk == 3) {
            // The sums of squares over the row's 4 lanes; the part's sums out as hc_post_mix
            // leaves them (24 logits, zeros, the sum of squares in slot 31).
#pragma unroll
            for (int mm = 1; mm < 4; mm <<= 1) {
                ssa += __shfl_xor_sync(0xffffffffu, ssa, mm);
                ssb += __shfl_xor_sync(0xffffffffu, ssb, mm);
            }
            float* da = partials + ((long long)ra * parts + part) * HC_MIX_SLOTS;
            float* db = partials + ((long long)rb * parts + part) * HC_MIX_SLOTS;
#pragma unroll
            for (int q = 0; q < 3; q++) {
                if (la) *(float2*)(da + 8 * q + 2 * t) = make_float2(acc[q][0], acc[q][1]);
                if (lb) *(float2*)(db + 8 * q + 2 * t) = make_float2(acc[q][2], acc[q][3]);
            }
            if (t == 0) {
                if (la) *(float4*)(da + 24) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (la) *(float4*)(da + 28) = make_float4(0.0f, 0.0f, 0.0f, ssa);
                if (lb) *(float4*)(db + 24) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (lb) *(float4*)(db + 28) = make_float4(0.0f, 0.0f, 0.0f, ssb);
            }
        }
    }
    cp_async_wait<0>();
    pdl_launch_dependents();
}
extern "C" __global__ void __launch_bounds__(HPT_THREADS, 1)
    hc_post_mix_rows_tc_f32(float* streams, const float* src, int copies, const float* out, const float* post,
                            const float* comb, int rows, int d, const void* w, float* partials) {
    hc_post_mix_rows_tc_body<0>(streams, src, copies, out, post, comb, rows, d, w, partials);
}
extern "C" __global__ void __launch_bounds__(HPT_THREADS, 1)
    hc_post_mix_rows_tc_bf16(float* streams, const float* src, int copies, const float* out, const float* post,
                             const float* comb, int rows, int d, const void* w, float* partials) {
    hc_post_mix_rows_tc_body<1>(streams, src, copies, out, post, comb, rows, d, w, partials);
}
