// Decode products on tensor cores: out[r, o] = Σ_k x[r, k] · W[o, k] for up to 8 rows,
// with W in its stored format. The batch is the mma's n = 8 dimension, so 1 row and 8
// rows cost the same weight stream; the SIMT gemv spends an FMA per weight per row and
// an f32 activation load per weight from L1, which is what bounds it.
//
// One mma.m16n8k16 (f32 accumulate) multiplies 16 weight rows by 8 activation rows over
// 16 inputs. Each thread builds its A fragment straight from the weight bytes it loads
// (no shared memory for weights): the 16 inputs of an mma are a permutation of the
// physical ones, chosen so that thread t of a quad owns 16 consecutive inputs per
// 64-input step (one 16-byte FP8 load, one 8-byte FP4 load per row) and supplies the
// activations of the same inputs as its B fragment, so the products are unchanged.
//
// Weights: BF16 -> bf16 mma with activations split into bf16 hi + lo; FP8 e4m3 -> f16 by
// bit placement (exact, value·2^-8), f16 mma, the 128×128 block scale applied per step
// to the step's partial; FP4 e2m1 -> f16 (value·2^-14) times its per-32 scale as an f16
// (exact for scale exponents in [-23, 1], which the host checks), f16 mma. f16
// activations are the rows scaled by a power of two that puts their largest value
// below 2^14, split into hi + lo (~22 bits), staged once per block in shared memory.
//
// Blocks: 64 outputs (4 groups of 16) × KB = 512 inputs; warps are 4 output groups × 2
// input halves. Grid (N / 64, K / 512): with more than one input block, each block
// writes its partial and the last of an output block's K blocks (by ticket) sums them in
// K order, so results do not depend on scheduling. DUAL (SwiGLU pairs) runs w1 and w3
// over the same activations and applies the clamped SwiGLU to the sums.
//
// Expert groups (the MoE decode step): blockIdx.z is an index into the list of experts
// that received rows; rows are x[offsets[e] ..+ counts[e]] (at most 8 per launch part)
// and weights come from wtab[4e ..] (w, w3, scales, scales3).

#define TC_KB 512
#define TC_OUT 64

__device__ __forceinline__ void mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16x(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// FP8 pairs as f16x2 (·2^-8): bytes (0, 1) and (2, 3) of q, each pair = consecutive inputs.
__device__ __forceinline__ void fp8x4_f16pairs(u32 q, u32* p01, u32* p23) {
    // Spread bytes so that each f16 half takes one: (b0, b1) -> halves of p01.
    const u32 s01 = __byte_perm(q, 0, 0x4140);  // [b0, 0, b1, 0] little-endian bytes -> b0 | b1 << 16
    const u32 s23 = __byte_perm(q, 0, 0x4342);
    *p01 = ((s01 << 8) & 0x80008000u) | ((s01 << 7) & 0x3f803f80u);
    *p23 = ((s23 << 8) & 0x80008000u) | ((s23 << 7) & 0x3f803f80u);
}

// FP4 byte pair (nibbles n0 = low, n1 = high of byte b: consecutive inputs) as f16x2
// (·2^-14) for the bytes of q: out[i] = f16x2(nibble 2i, nibble 2i + 1).
__device__ __forceinline__ void fp4x8_f16pairs(u32 q, u32* out) {
    // Byte i into both halves' low nibbles: low half gets the low nibble, high half
    // (shifted down by 4) the high nibble.
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 b = __byte_perm(q, 0, 0x4440 + i);  // byte i at bits 0-7, zero elsewhere
        const u32 t = b | (b << 12);                  // low nibble at 0-3, high nibble at 16-19
        out[i] = ((t << 9) & 0x0e000e00u) | ((t << 12) & 0x80008000u);
    }
}

// One row's stored bytes for 16 consecutive inputs (bf16: 32 bytes; FP8: 16; FP4: 8 and
// the group's scale byte), loaded before they are needed so a warp has all its loads in
// flight at once.
template <int WT>
struct RowRaw {
    uint4 a, b;  // bf16 uses both; FP8 a; FP4 a.x, a.y
    u32 s;       // FP4 scale byte
};

template <int WT>
__device__ __forceinline__ void tc_load_raw(RowRaw<WT>& r, const void* w, const void* scales, long long row, int K, int k,
                                            bool live) {
    if (!live) {
        r.a = make_uint4(0u, 0u, 0u, 0u);
        r.b = r.a;
        r.s = 127u;
        return;
    }
    if (WT == 1) {
        const uint4* p = (const uint4*)((const u16*)w + row * K + k);
        r.a = __ldg(p);
        r.b = __ldg(p + 1);
    } else if (WT == 2) {
        r.a = __ldg((const uint4*)((const u8*)w + row * K + k));
    } else {
        const uint2 q = __ldg((const uint2*)((const u8*)w + row * (K / 2) + k / 2));
        r.a = make_uint4(q.x, q.y, 0u, 0u);
        r.s = __ldg((const u8*)scales + row * (K / 32) + k / 32);
    }
}

// The 16 inputs as 8 packed pairs (bf16x2 or f16x2; see the file comment).
template <int WT>
__device__ __forceinline__ void tc_pairs(const RowRaw<WT>& r, u32* pairs) {
    if (WT == 1) {
        pairs[0] = r.a.x; pairs[1] = r.a.y; pairs[2] = r.a.z; pairs[3] = r.a.w;
        pairs[4] = r.b.x; pairs[5] = r.b.y; pairs[6] = r.b.z; pairs[7] = r.b.w;
    } else if (WT == 2) {
        fp8x4_f16pairs(r.a.x, &pairs[0], &pairs[1]);
        fp8x4_f16pairs(r.a.y, &pairs[2], &pairs[3]);
        fp8x4_f16pairs(r.a.z, &pairs[4], &pairs[5]);
        fp8x4_f16pairs(r.a.w, &pairs[6], &pairs[7]);
    } else {
        fp4x8_f16pairs(r.a.x, &pairs[0]);
        fp4x8_f16pairs(r.a.y, &pairs[4]);
        // The 16 inputs lie in one group of 32: scale them by 2^(s+14) as f16 (exact for
        // the scale range the host allows), so the mma sees value·2^s.
        const u32 f = ((r.s - 127u + 14u + 15u) & 0x1fu) << 10;  // f16 2^(s-127+14)
        const u32 f2 = f | (f << 16);
#pragma unroll
        for (int i = 0; i < 8; i++) pairs[i] = hmul2(pairs[i], f2);
    }
}

// Steps of 64 inputs a warp takes per block: TC_KB / 2 inputs (its half) / 64.
#define TC_STEPS (TC_KB / 2 / 64)

// One warp's loads: rows o0 + g and o0 + g + 8 of W, its steps of 64 inputs from k_lo
// (steps past k_hi are not loaded).
template <int WT>
struct WarpLoads {
    RowRaw<WT> r0[TC_STEPS], r1[TC_STEPS];
};

template <int WT>
__device__ __forceinline__ void tc_warp_load(WarpLoads<WT>& l, const void* w, const void* scales, long long o0, int N,
                                             int K, int kbase, int k_lo, int k_hi) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int st = 0; st < TC_STEPS; st++) {
        const int k = k_lo + 64 * st;
        tc_load_raw<WT>(l.r0[st], w, scales, o0 + g, K, kbase + k + 16 * t, k < k_hi && o0 + g < N);
        tc_load_raw<WT>(l.r1[st], w, scales, o0 + g + 8, K, kbase + k + 16 * t, k < k_hi && o0 + g + 8 < N);
    }
}

// The warp's products over its loaded steps, B from the block's staged activations
// (pairs of 16-bit values, [8][KB/2] per half). acc: the thread's 4 accumulators
// (outputs g, g + 8 × batch columns 2t, 2t + 1).
template <int WT>
__device__ __forceinline__ void tc_warp_mma(float* acc, const WarpLoads<WT>& l, const void* scales, long long o0, int K,
                                            int kbase, int k_lo, int k_hi, const u32* xs_hi, const u32* xs_lo) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int st = 0; st < TC_STEPS; st++) {
        const int k = k_lo + 64 * st;
        if (k >= k_hi) break;
        u32 w0[8], w1[8];
        tc_pairs<WT>(l.r0[st], w0);
        tc_pairs<WT>(l.r1[st], w1);
        // Activations of batch row g, the same 16 inputs: 8 pairs of hi and of lo.
        const uint4* ph = (const uint4*)(xs_hi + g * (TC_KB / 2) + (k + 16 * t) / 2);
        const uint4* pl = (const uint4*)(xs_lo + g * (TC_KB / 2) + (k + 16 * t) / 2);
        const uint4 h0 = ph[0], h1 = ph[1], l0 = pl[0], l1 = pl[1];
        const u32 xh[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        const u32 xl[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        float* dst = WT == 2 ? part : acc;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            // Logical k (2t, 2t+1) <- this thread's inputs 4j, 4j+1; (2t+8, 2t+9) <- 4j+2, 4j+3.
            const u32 a[4] = {w0[2 * j], w1[2 * j], w0[2 * j + 1], w1[2 * j + 1]};
            if (WT == 1) {
                mma_bf16x(dst, a, xh[2 * j], xh[2 * j + 1]);
                mma_bf16x(dst, a, xl[2 * j], xl[2 * j + 1]);
            } else {
                mma_f16(dst, a, xh[2 * j], xh[2 * j + 1]);
                mma_f16(dst, a, xl[2 * j], xl[2 * j + 1]);
            }
        }
        if (WT == 2) {
            // One 128×128 scale block covers the warp's 16 rows and these 64 inputs.
            const int kk = kbase + k;
            const float s = ((const float*)scales)[(o0 / 128) * ((K + 127) / 128) + kk / 128] * FP8_F16_SCALE;
#pragma unroll
            for (int i = 0; i < 4; i++) acc[i] = fmaf(part[i], s, acc[i]);
        }
    }
}

// Stage rows [0, rows) of x[:, kbase .. kbase + TC_KB) as 16-bit hi/lo pairs; rows past
// `rows` are zero. f16 (WT 2, 3): each row scaled by 2^-e so its largest value is below
// 2^14; `row_scale[r]` = 2^e multiplies the row's results back. bf16 (WT 1): unscaled.
// One pass: thread i loads pair i of every row (all loads in flight together), the row
// maxima are reduced from those registers, then the pairs are converted and stored.
template <int WT>
__device__ void tc_stage_x(const float* x, int x_stride, int rows, int kbase, int kn, u32* xs_hi, u32* xs_lo,
                           float* row_scale) {
    __shared__ float rmax[8][8];  // [warp][row]
    const int p = threadIdx.x, warp = p >> 5, lane = p & 31;
    const bool in = 2 * p < kn;
    float2 v[8];
#pragma unroll
    for (int r = 0; r < 8; r++)
        v[r] = (r < rows && in) ? *(const float2*)(x + (long long)r * x_stride + kbase + 2 * p) : make_float2(0.f, 0.f);
    if (WT != 1) {
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const float m = warp_max(fmaxf(fabsf(v[r].x), fabsf(v[r].y)));
            if (lane == 0) rmax[warp][r] = m;
        }
        __syncthreads();
        if (p < 8) {
            float m = 0.0f;
            for (int wi = 0; wi < 8; wi++) m = fmaxf(m, rmax[wi][p]);
            float sc = 1.0f;
            if (m > 0.0f && m <= 3.0e38f) {
                // 2^e with max·2^-e < 2^14: e = exponent(max) - 13 (kept a normal float).
                const int e = max(-126, min(127, (int)((__float_as_uint(m) >> 23) & 0xff) - 127 - 13));
                sc = __uint_as_float((u32)(e + 127) << 23);
            }
            row_scale[p] = sc;
        }
    } else if (p < 8) {
        row_scale[p] = 1.0f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 8; r++) {
        u32 hi, lo;
        if (WT == 1) {
            const float h0 = round_bf16(v[r].x), h1 = round_bf16(v[r].y);
            hi = (u32)f2bf(v[r].x) | ((u32)f2bf(v[r].y) << 16);
            lo = (u32)f2bf(v[r].x - h0) | ((u32)f2bf(v[r].y - h1) << 16);
        } else {
            const float inv = 1.0f / row_scale[r];  // a power of two: exact
            const float a = v[r].x * inv, b = v[r].y * inv;
            hi = pack_f16x2(a, b);
            lo = pack_f16x2(a - f16lo_to_f32(hi), b - f16hi_to_f32(hi));
        }
        xs_hi[r * (TC_KB / 2) + p] = hi;
        xs_lo[r * (TC_KB / 2) + p] = lo;
    }
    __syncthreads();
}

// The body for one (weights, rows) product; `out_rows` rows of out start at `out`.
template <int WT, bool DUAL>
__device__ void tc_body(float* out, const float* x, const void* w, const void* w3, const void* scales,
                        const void* scales3, int rows, int N, int K, int x_stride, int out_stride, int g_out,
                        float limit, float* partials, u32* tickets, int ticket_base) {
    __shared__ __align__(16) u32 xs_hi[8 * (TC_KB / 2)];
    __shared__ __align__(16) u32 xs_lo[8 * (TC_KB / 2)];
    __shared__ float row_scale[8];
    __shared__ float red[2][DUAL ? 2 : 1][TC_OUT][8];
    __shared__ u32 last;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long ob = (long long)blockIdx.x * TC_OUT;
    const int kbase = blockIdx.y * TC_KB, kn = min(TC_KB, K - kbase);
    const float* xb = x + (ob / g_out) * K;
    const int og = warp & 3, kh = warp >> 2;
    const long long o0 = ob + og * 16;
    const int half = kn / 2;  // kn is a multiple of 128
    const int k_lo = kh * half, k_hi = (kh + 1) * half;
    // Weight loads first: they do not depend on the activations, so their latency
    // overlaps the staging below and, in a plain product, the end of the kernel before
    // (the wait for it comes after them; a grouped MoE launch has waited already, as its
    // weight table comes from the kernel before).
    WarpLoads<WT> l0, l3;
    tc_warp_load<WT>(l0, w, scales, o0, N, K, kbase, k_lo, k_hi);
    if (DUAL) tc_warp_load<WT>(l3, w3, scales3, o0, N, K, kbase, k_lo, k_hi);
    pdl_begin();
    tc_stage_x<WT>(xb, x_stride, rows, kbase, kn, xs_hi, xs_lo, row_scale);

    float acc[4] = {0.f, 0.f, 0.f, 0.f}, acc3[4] = {0.f, 0.f, 0.f, 0.f};
    tc_warp_mma<WT>(acc, l0, scales, o0, K, kbase, k_lo, k_hi, xs_hi, xs_lo);
    if (DUAL) tc_warp_mma<WT>(acc3, l3, scales3, o0, K, kbase, k_lo, k_hi, xs_hi, xs_lo);

    // Accumulator i: output row o0 + g + 8·(i / 2), batch column 2t + (i % 2).
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int orow = og * 16 + g + 8 * (i / 2), col = 2 * t + (i % 2);
        red[kh][0][orow][col] = acc[i];
        if (DUAL) red[kh][DUAL ? 1 : 0][orow][col] = acc3[i];
    }
    __syncthreads();
    // Block partial (two input halves in order), scaled back per row.
    const int KS = gridDim.y;
    for (int i = threadIdx.x; i < TC_OUT * 8; i += blockDim.x) {
        const int orow = i / 8, col = i % 8;
        if (col >= rows || ob + orow >= N) continue;
        float v = (red[0][0][orow][col] + red[1][0][orow][col]) * row_scale[col];
        float v3 = DUAL ? (red[0][DUAL ? 1 : 0][orow][col] + red[1][DUAL ? 1 : 0][orow][col]) * row_scale[col] : 0.f;
        if (KS == 1) {
            if (DUAL) {
                const float a = fminf(v, limit), b = fminf(fmaxf(v3, -limit), limit);
                v = a / (1.0f + expf(-a)) * b;
            }
            out[(long long)col * out_stride + ob + orow] = v;
        } else {
            // partials[(ks, col, o)] (and the w3 sums after all of them).
            const long long at = ((long long)blockIdx.y * 8 + col) * N + ob + orow;
            partials[at] = v;
            if (DUAL) partials[(long long)KS * 8 * N + at] = v3;
        }
    }
    if (KS == 1) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 prev = atomicAdd(&tickets[ticket_base + blockIdx.x], 1u);
        last = prev == (u32)(KS - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < TC_OUT * 8; i += blockDim.x) {
        const int orow = i / 8, col = i % 8;
        if (col >= rows || ob + orow >= N) continue;
        float v = 0.f, v3 = 0.f;
        for (int ks = 0; ks < KS; ks++) {
            const long long at = ((long long)ks * 8 + col) * N + ob + orow;
            v += __ldcg(&partials[at]);
            if (DUAL) v3 += __ldcg(&partials[(long long)KS * 8 * N + at]);
        }
        if (DUAL) {
            const float a = fminf(v, limit), b = fminf(fmaxf(v3, -limit), limit);
            v = a / (1.0f + expf(-a)) * b;
        }
        out[(long long)col * out_stride + ob + orow] = v;
    }
    // Leave the ticket at zero for the next launch.
    if (threadIdx.x == 0) tickets[ticket_base + blockIdx.x] = 0u;
}

#define TC_GEMV_KERNEL(WT, DUAL, NAME)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                         \
        float* out, const float* x, const void* w, const void* w3, const void* scales, const void* scales3,          \
        int rows, int N, int K, int x_stride, int out_stride, int g_out, float limit, float* partials, u32* tickets) { \
        tc_body<WT, DUAL>(out, x, w, w3, scales, scales3, rows, N, K, x_stride, out_stride, g_out, limit, partials,  \
                          tickets, 0);                                                                              \
    }

TC_GEMV_KERNEL(1, false, tcgemv_bf16)
TC_GEMV_KERNEL(2, false, tcgemv_fp8)
TC_GEMV_KERNEL(3, false, tcgemv_fp4)
TC_GEMV_KERNEL(1, true, tcswiglu_bf16)
TC_GEMV_KERNEL(2, true, tcswiglu_fp8)
TC_GEMV_KERNEL(3, true, tcswiglu_fp4)

// The MoE decode step's grouped products: blockIdx.z indexes `active` (the experts that
// received rows, in expert order, `*n_active` of them); each expert's rows (at most 8 a
// launch part, `part` selects which 8) are x[offsets[e] + 8·part ..]. Partials and
// tickets are per (active slot, output block).
#define TC_MOE_KERNEL(WT, DUAL, NAME)                                                                                \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                          \
        float* out, const float* x, const u64* wtab, const int* counts, const int* offsets, const int* active,        \
        const int* n_active, int part, int N, int K, float limit, float* partials, u32* tickets) { pdl_begin();        \
        const int slot = blockIdx.z;                                                                                  \
        if (slot >= *n_active) return;                                                                                \
        const int e = active[slot], r0 = 8 * part, cnt = counts[e] - r0;                                              \
        if (cnt <= 0) return;                                                                                         \
        const u64* t = wtab + 4 * e;                                                                                  \
        const long long off = offsets[e] + r0;                                                                        \
        tc_body<WT, DUAL>(out + off * N, x + off * K, (const void*)t[0], (const void*)t[1], (const void*)t[2],        \
                          (const void*)t[3], min(cnt, 8), N, K, K, N, N, limit,                                        \
                          partials + (long long)slot * gridDim.y * 8 * N * (DUAL ? 2 : 1), tickets,                   \
                          slot * gridDim.x);                                                                          \
    }

TC_MOE_KERNEL(1, false, tcmoe_down_bf16)
TC_MOE_KERNEL(2, false, tcmoe_down_fp8)
TC_MOE_KERNEL(3, false, tcmoe_down_fp4)
TC_MOE_KERNEL(1, true, tcmoe_swiglu_bf16)
TC_MOE_KERNEL(2, true, tcmoe_swiglu_fp8)
TC_MOE_KERNEL(3, true, tcmoe_swiglu_fp4)
