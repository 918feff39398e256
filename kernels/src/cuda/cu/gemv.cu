// Few-row products y = x · Wᵀ (decode: 1–8 rows), bound by streaming the weights once.
// A block of 8 warps covers `opb` outputs; each output's K is split over 8/opb warps,
// lanes stride over 16-byte weight chunks, and every weight chunk is used for all rows
// before the next one is loaded. Activations stay f32 and accumulation is f32, so the
// result matches the CPU's widened-bf16 dot products to rounding.
//
// Grouped products (the attention output's block-diagonal projection) read x at
// column (o / g_out) * K; plain products pass g_out = N.
//
// WT: 0 = f32 weights, 1 = bf16, 2 = FP8 e4m3 with one f32 scale per 128x128 block,
// 3 = FP4 e2m1 packed two per byte (low nibble first) with one ue8m0 byte per 32 inputs.
// DUAL: also read a second weight (w3) and emit the clamped SwiGLU of the pair.

template <int WT>
__device__ constexpr int chunk_elems() { return WT == 3 ? 32 : WT == 2 ? 16 : 8; }

// Load chunk `c` (chunk_elems<WT>() weights) of row `o` as f32 in `wf`, up to the factor
// returned (the chunk's block scale, with the FP8/FP4 decoding's power of two folded
// in; 1 for f32/bf16): the caller multiplies each row's partial sum once. `scales`
// points to f32 block scales (FP8) or ue8m0 bytes (FP4).
template <int WT>
__device__ __forceinline__ float load_chunk(const void* w, const void* scales, int o, int K, int c, float* wf) {
    if (WT == 0) {
        const float4* p = (const float4*)((const float*)w + (long long)o * K) + 2 * c;
        float4 a = __ldg(p), b = __ldg(p + 1);
        wf[0] = a.x; wf[1] = a.y; wf[2] = a.z; wf[3] = a.w;
        wf[4] = b.x; wf[5] = b.y; wf[6] = b.z; wf[7] = b.w;
        return 1.0f;
    } else if (WT == 1) {
        uint4 q = __ldg((const uint4*)((const u16*)w + (long long)o * K) + c);
        wf[0] = __uint_as_float(q.x << 16); wf[1] = __uint_as_float(q.x & 0xffff0000u);
        wf[2] = __uint_as_float(q.y << 16); wf[3] = __uint_as_float(q.y & 0xffff0000u);
        wf[4] = __uint_as_float(q.z << 16); wf[5] = __uint_as_float(q.z & 0xffff0000u);
        wf[6] = __uint_as_float(q.w << 16); wf[7] = __uint_as_float(q.w & 0xffff0000u);
        return 1.0f;
    } else if (WT == 2) {
        uint4 q = __ldg((const uint4*)((const u8*)w + (long long)o * K) + c);
        fp8x4_scaled(q.x, wf);
        fp8x4_scaled(q.y, wf + 4);
        fp8x4_scaled(q.z, wf + 8);
        fp8x4_scaled(q.w, wf + 12);
        return ((const float*)scales)[(o / 128) * ((K + 127) / 128) + (c * 16) / 128] * FP8_F16_SCALE;
    } else {
        // 32 inputs = 16 bytes = exactly one scale group (K is a multiple of 32 here).
        uint4 q = __ldg((const uint4*)((const u8*)w + (long long)o * (K / 2)) + c);
        fp4x8_scaled(q.x, wf);
        fp4x8_scaled(q.y, wf + 8);
        fp4x8_scaled(q.z, wf + 16);
        fp4x8_scaled(q.w, wf + 24);
        return ue8m0_scale(__ldg((const u8*)scales + (long long)o * (K / 32) + c)) * FP4_F16_SCALE;
    }
}

template <int WT>
__device__ __forceinline__ float load_one(const void* w, const void* scales, int o, int K, int k) {
    long long i = (long long)o * K + k;
    if (WT == 0) return ((const float*)w)[i];
    if (WT == 1) return bf2f(((const u16*)w)[i]);
    if (WT == 2) return fp8_to_f32(((const u8*)w)[i]) * ((const float*)scales)[(o / 128) * ((K + 127) / 128) + k / 128];
    const u8 byte = ((const u8*)w)[i / 2];
    const int groups = (K + 31) / 32;
    return e2m1_to_f32(k % 2 == 0 ? byte : byte >> 4) * ue8m0_scale(((const u8*)scales)[(long long)o * groups + k / 32]);
}

template <int R, int WT, bool DUAL>
__device__ void gemv_body(float* out, const float* x, const void* w, const void* w3, const void* scales,
                          const void* scales3, int rows, int N, int K, int x_stride, int out_stride, int g_out,
                          int opb, int vec, float limit, int blk) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wpo = 8 / opb;
    const int o = blk * opb + warp / wpo;
    const int gl = (warp % wpo) * 32 + lane, stride = wpo * 32;
    float acc[R], acc3[R];
#pragma unroll
    for (int r = 0; r < R; r++) { acc[r] = 0.0f; acc3[r] = 0.0f; }
    if (o < N) {
        const float* xb = x + (long long)(o / g_out) * K;
        if (vec) {
            constexpr int CE = chunk_elems<WT>();
            const int nch = K / CE;
#pragma unroll 2
            for (int c = gl; c < nch; c += stride) {
                float wf[CE], wf3[CE];
                const float s = load_chunk<WT>(w, scales, o, K, c, wf);
                const float s3 = DUAL ? load_chunk<WT>(w3, scales3, o, K, c, wf3) : 0.0f;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    if (r < rows) {
                        const float4* xp = (const float4*)(xb + (long long)r * x_stride + c * CE);
                        float p = 0.0f, p3 = 0.0f;
#pragma unroll
                        for (int q = 0; q < CE / 4; q++) {
                            float4 a = xp[q];
                            p += wf[4 * q] * a.x + wf[4 * q + 1] * a.y + wf[4 * q + 2] * a.z + wf[4 * q + 3] * a.w;
                            if (DUAL)
                                p3 += wf3[4 * q] * a.x + wf3[4 * q + 1] * a.y + wf3[4 * q + 2] * a.z + wf3[4 * q + 3] * a.w;
                        }
                        acc[r] = WT >= 2 ? fmaf(p, s, acc[r]) : acc[r] + p;
                        if (DUAL) acc3[r] = WT >= 2 ? fmaf(p3, s3, acc3[r]) : acc3[r] + p3;
                    }
                }
            }
        } else {
            for (int k = gl; k < K; k += stride) {
                float wv = load_one<WT>(w, scales, o, K, k);
                float wv3 = DUAL ? load_one<WT>(w3, scales3, o, K, k) : 0.0f;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    if (r < rows) {
                        float xv = xb[(long long)r * x_stride + k];
                        acc[r] += wv * xv;
                        if (DUAL) acc3[r] += wv3 * xv;
                    }
                }
            }
        }
    }
    __shared__ float red[8][R];
    __shared__ float red3[8][R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        float s = warp_sum(acc[r]);
        float s3 = DUAL ? warp_sum(acc3[r]) : 0.0f;
        if (lane == 0) {
            red[warp][r] = s;
            if (DUAL) red3[warp][r] = s3;
        }
    }
    __syncthreads();
    if (threadIdx.x < opb * R) {
        int ob = threadIdx.x / R, r = threadIdx.x % R;
        int o2 = blk * opb + ob;
        if (o2 < N && r < rows) {
            float s = 0.0f, s3 = 0.0f;
            for (int sl = 0; sl < wpo; sl++) {
                s += red[ob * wpo + sl][r];
                if (DUAL) s3 += red3[ob * wpo + sl][r];
            }
            if (DUAL) {
                float g = fminf(s, limit);
                float u = fminf(fmaxf(s3, -limit), limit);
                s = g / (1.0f + expf(-g)) * u;
            }
            out[(long long)r * out_stride + o2] = s;
        }
    }
}

#define GEMV_KERNEL(R, WT, DUAL, NAME)                                                                             \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                        \
        float* out, const float* x, const void* w, const void* w3, const void* scales, const void* scales3,         \
        int rows, int N, int K, int x_stride, int out_stride, int g_out, int opb, int vec, float limit) {           \
        pdl_begin();                                                                                                \
        gemv_body<R, WT, DUAL>(out, x, w, w3, scales, scales3, rows, N, K, x_stride, out_stride, g_out, opb, vec,  \
                               limit, blockIdx.x);                                                                  \
    }

// KERNEL for 1, 2, 4 and 8 rows, named BASE_r1 … BASE_r8.
#define FOR_EACH_R(KERNEL, WT, DUAL, BASE) \
    KERNEL(1, WT, DUAL, BASE##_r1)         \
    KERNEL(2, WT, DUAL, BASE##_r2)         \
    KERNEL(4, WT, DUAL, BASE##_r4)         \
    KERNEL(8, WT, DUAL, BASE##_r8)

// ... for every weight format: plain products as PLAIN_{f32,bf16,fp8,fp4}_rN, SwiGLU pairs
// as PAIR_{f32,bf16,fp8,fp4}_rN.
#define FOR_EACH_FORMAT(KERNEL, PLAIN, PAIR)       \
    FOR_EACH_R(KERNEL, 0, false, PLAIN##_f32)      \
    FOR_EACH_R(KERNEL, 1, false, PLAIN##_bf16)     \
    FOR_EACH_R(KERNEL, 2, false, PLAIN##_fp8)      \
    FOR_EACH_R(KERNEL, 3, false, PLAIN##_fp4)      \
    FOR_EACH_R(KERNEL, 0, true, PAIR##_f32)        \
    FOR_EACH_R(KERNEL, 1, true, PAIR##_bf16)       \
    FOR_EACH_R(KERNEL, 2, true, PAIR##_fp8)        \
    FOR_EACH_R(KERNEL, 3, true, PAIR##_fp4)

FOR_EACH_FORMAT(GEMV_KERNEL, gemv, swiglu)

// Several BF16 products of the same activations x[rows, K] in one launch: a layer's
// projections of its hidden state (wq_a, wkv, the compressors', the indexer's weights)
// are 0.3-8 MB each, and at one or two rows each launch alone is mostly its ramp and
// tail. Product i owns blocks first[i] .. first[i+1]-1 and writes its own contiguous
// output; every output is computed exactly as the one-product kernel computes it with
// the same `opb`.
#define GEMV_MANY_MAX 8
struct GemvMany {
    const void* w[GEMV_MANY_MAX];
    float* out[GEMV_MANY_MAX];
    int n[GEMV_MANY_MAX];
    int first[GEMV_MANY_MAX];
    int count;
};

#define GEMV_MANY_KERNEL(R)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        gemv_many_bf16_r##R(GemvMany t, const float* x, int rows, int K, int opb, int vec) {                      \
        pdl_begin();                                                                                              \
        /* The product this block belongs to, with constant indices (no local copy of t). */                    \
        const void* w = t.w[0];                                                                                   \
        float* out = t.out[0];                                                                                    \
        int n = t.n[0], first = 0;                                                                                \
        _Pragma("unroll") for (int i = 1; i < GEMV_MANY_MAX; i++) {                                               \
            if (i < t.count && (int)blockIdx.x >= t.first[i]) {                                                   \
                w = t.w[i];                                                                                       \
                out = t.out[i];                                                                                   \
                n = t.n[i];                                                                                       \
                first = t.first[i];                                                                               \
            }                                                                                                     \
        }                                                                                                         \
        gemv_body<R, 1, false>(out, x, w, nullptr, nullptr, nullptr, rows, n, K, K, n, n, opb, vec, 0.0f,          \
                               (int)blockIdx.x - first);                                                          \
    }

GEMV_MANY_KERNEL(1)
GEMV_MANY_KERNEL(2)

// The outputs of chunked_products.rs' batched cuBLAS call moved into their products' rows:
// chunk i's sums are `rows × 64` f32 at `sums + i·rows·64` (row-major), product p owns
// chunks t.first[p] .. t.first[p] + t.n[p] / 64 and its output is dense [rows, t.n[p]].
// A thread a float4 of the sums (read and written whole; t.w is not read).
extern "C" __global__ void products_from_chunks(GemvMany t, const float* sums, int rows, int chunks) {
    pdl_begin();
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long long)chunks * rows * 16) return;
    const int q = (int)(e & 15);
    const long long chunk_row = e >> 4;
    const int r = (int)(chunk_row % rows), i = (int)(chunk_row / rows);
    // The product holding chunk i, with constant indices into t (no local copy of it).
    float* out = t.out[0];
    int n = t.n[0], first = t.first[0];
#pragma unroll
    for (int p = 1; p < GEMV_MANY_MAX; p++)
        if (p < t.count && i >= t.first[p]) {
            out = t.out[p];
            n = t.n[p];
            first = t.first[p];
        }
    const float4 v = reinterpret_cast<const float4*>(sums)[e];
    reinterpret_cast<float4*>(out + (long long)r * n + (long long)(i - first) * 64)[q] = v;
}

// Grouped expert products for a decode batch routed on the device: blockIdx.y is the
// expert, whose rows are x[offsets[e] .. + counts[e]] (gathered in expert order) and
// whose weights `wtab[4e..4e+4]` point to (w, w3, scales, scales3). Experts nothing was
// routed to return at once, so the host never learns the routing.
template <int R, int WT, bool DUAL>
__device__ void moe_gemv_body(float* out, const float* x, const u64* wtab, const int* counts, const int* offsets,
                              int N, int K, int opb, int vec, float limit) {
    const int e = blockIdx.y, cnt = counts[e];
    if (cnt == 0) return;
    const int off = offsets[e];
    const u64* t = wtab + 4 * e;
    for (int r0 = 0; r0 < cnt; r0 += R) {
        gemv_body<R, WT, DUAL>(out + (long long)(off + r0) * N, x + (long long)(off + r0) * K, (const void*)t[0],
                               (const void*)t[1], (const void*)t[2], (const void*)t[3], min(R, cnt - r0), N, K, K, N,
                               N, opb, vec, limit, blockIdx.x);
        __syncthreads();
    }
}

#define MOE_GEMV_KERNEL(R, WT, DUAL, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        NAME(float* out, const float* x, const u64* wtab, const int* counts, const int* offsets, int N, int K, \
             int opb, int vec, float limit) { pdl_begin();                                                      \
        moe_gemv_body<R, WT, DUAL>(out, x, wtab, counts, offsets, N, K, opb, vec, limit);                      \
    }

FOR_EACH_FORMAT(MOE_GEMV_KERNEL, moe_down, moe_swiglu)
