// Manifold-constrained hyper-connections. The mixing logits come from an unweighted
// RMSNorm of the flattened streams followed by a product; the norm is one scalar per
// row, so the product runs on the raw streams (gemv/cuBLAS) and the kernels here scale
// its result by 1/rms before the sigmoids and the Sinkhorn projection.

#define HC_MAX 8
// hc_post_mix's values a row and part: the mixing logits in [0, 31), the sum of squares
// of the updated streams in slot 31.
#define HC_MIX_SLOTS 32
#define HC_SUMSQ_SLOT 31

// Biases travel by value: (2 + hc) * hc <= 80 for hc <= 8.
struct F80 {
    float v[80];
};

// out[i] = Σ_j pre[j] · s[j·d + i] over the block's threads, in j order; four outputs a
// thread with 16-byte loads when d is a multiple of 4.
__device__ __forceinline__ void hc_collapse(const float* s, const float* pre, int hc, int d, float* out) {
    if ((d & 3) == 0) {
        for (int i = threadIdx.x; i < (d >> 2); i += blockDim.x) {
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int j = 0; j < hc; j++) {
                const float4 v = reinterpret_cast<const float4*>(s + (long long)j * d)[i];
                acc.x += pre[j] * v.x;
                acc.y += pre[j] * v.y;
                acc.z += pre[j] * v.z;
                acc.w += pre[j] * v.w;
            }
            reinterpret_cast<float4*>(out)[i] = acc;
        }
        return;
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < hc; j++) acc += pre[j] * s[j * d + i];
        out[i] = acc;
    }
}

// Sinkhorn projection of the hc × hc logits in shared `c` by the whole block (hc² > 32,
// beyond one warp: hc_sinkhorn_lanes below otherwise): the first hc² threads hold an
// element each, the rest keep step at the barriers; the result goes to `comb`.
__device__ __forceinline__ void hc_sinkhorn(float* c, int hc, int iters, float hc_eps, float* comb) {
    const int j = threadIdx.x / hc, k = threadIdx.x % hc;
    const bool mine = threadIdx.x < hc * hc;
    // Row softmax + eps.
    float v = 0.0f;
    if (mine) {
        float mx = NEG_INF;
        for (int q = 0; q < hc; q++) mx = fmaxf(mx, c[j * hc + q]);
        float sum = 0.0f;
        for (int q = 0; q < hc; q++) sum += expf(c[j * hc + q] - mx);
        v = expf(c[j * hc + k] - mx) / sum + hc_eps;
    }
    __syncthreads();
    if (mine) c[threadIdx.x] = v;
    __syncthreads();
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            if (mine) {
                float sum = 0.0f;
                for (int q = 0; q < hc; q++) sum += c[j * hc + q];
                v = c[threadIdx.x] / (sum + hc_eps);
            }
            __syncthreads();
            if (mine) c[threadIdx.x] = v;
            __syncthreads();
        }
        if (mine) {
            float sum = 0.0f;
            for (int q = 0; q < hc; q++) sum += c[q * hc + k];
            v = c[threadIdx.x] / (sum + hc_eps);
        }
        __syncthreads();
        if (mine) c[threadIdx.x] = v;
        __syncthreads();
    }
    if (mine) comb[threadIdx.x] = c[threadIdx.x];
}

// The hc values of lanes first, first + step, … (a row: step 1; a column: step hc) into
// v, by shuffles every lane takes part in; lanes counted within each W-lane segment of
// the warp. N = HC when hc is fixed at compile time (the loops unroll and the shuffles
// issue together), else HC_MAX with hc bounding it.
template <int N, int W = 32>
__device__ __forceinline__ void hc_gather(float c, int hc, int first, int step, float* v) {
#pragma unroll
    for (int q = 0; q < N; q++)
        if (q < hc) v[q] = __shfl_sync(0xffffffffu, c, first + q * step, W);
}

// c / (Σ of v's hc values in index order + eps): one row or column normalisation.
template <int N>
__device__ __forceinline__ float hc_normalised(float c, int hc, const float* v, float hc_eps) {
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < N; q++)
        if (q < hc) s += v[q];
    return c / (s + hc_eps);
}

// The Sinkhorn projection by one warp with the matrix in registers: lane j·hc + k holds
// logit c[j][k] (lanes past hc² hold lane 0's and their results are not used). Row
// softmax + eps, then `iters` rounds of column and (from the second round) row
// normalisation, each sum taken over the row or column in index order, as the CPU does.
// Every lane must call it. HC > 0 fixes hc at compile time so the loops unroll and a
// sum's shuffles issue together: the rounds are a chain of dependent steps (20 rounds ×
// 2 sums), and with hc a run-time value they took ~10 µs of a decode step's pre-mix.
// W < 32 (hc² ≤ W): each W-lane segment of the warp projects its own matrix.
template <int HC, int W = 32>
__device__ __forceinline__ float hc_sinkhorn_lanes(float c, int hc_rt, int iters, float hc_eps) {
    constexpr int N = HC > 0 ? HC : HC_MAX;
    const int hc = HC > 0 ? HC : hc_rt;
    const int lane = threadIdx.x & (W - 1);
    const int l = lane < hc * hc ? lane : 0;
    const int j = l / hc, k = l % hc;
    float v[N];
    hc_gather<N, W>(c, hc, j * hc, 1, v);
    float mx = NEG_INF;
#pragma unroll
    for (int q = 0; q < N; q++)
        if (q < hc) mx = fmaxf(mx, v[q]);
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < N; q++)
        if (q < hc) sum += expf(v[q] - mx);
    c = expf(c - mx) / sum + hc_eps;
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            hc_gather<N, W>(c, hc, j * hc, 1, v);
            c = hc_normalised<N>(c, hc, v, hc_eps);
        }
        hc_gather<N, W>(c, hc, k, hc, v);
        c = hc_normalised<N>(c, hc, v, hc_eps);
    }
    return c;
}

// hc_sinkhorn_lanes with hc fixed where V4's value (4) is the one given.
__device__ __forceinline__ float hc_sinkhorn_warp(float c, int hc, int iters, float hc_eps) {
    return hc == 4 ? hc_sinkhorn_lanes<4>(c, hc, iters, hc_eps) : hc_sinkhorn_lanes<0>(c, hc, iters, hc_eps);
}

// A row's mixing weights once its sum of squares is known (1/rms = `inv`): pre (into
// shared `pre_s`, visible to the block on return) and post (`post_r`), and the hc × hc
// mixing matrix, one element per thread of the first hc² threads, which run the
// Sinkhorn rounds in step (each row or column sum taken in index order by every thread
// of it, the same operations as one thread doing it all) into `comb_r` — unless a second
// block of the row runs them (gridDim.y = 2).
__device__ __forceinline__ void hc_pre_weights(const float* m, float inv, const F80& base, float s_pre, float s_post,
                                               float s_comb, int hc, int iters, float hc_eps, float* pre_s, float* c,
                                               float* post_r, float* comb_r) {
    const bool mine = threadIdx.x < hc * hc;
    if (threadIdx.x < hc) {
        pre_s[threadIdx.x] = sigmoidf_(m[threadIdx.x] * inv * s_pre + base.v[threadIdx.x]) + hc_eps;
        post_r[threadIdx.x] = 2.0f * sigmoidf_(m[hc + threadIdx.x] * inv * s_post + base.v[hc + threadIdx.x]);
    }
    if (mine) c[threadIdx.x] = m[2 * hc + threadIdx.x] * inv * s_comb + base.v[2 * hc + threadIdx.x];
    __syncthreads();
    if (gridDim.y == 2) {
        // The second block of the row runs the rounds.
    } else if (hc * hc <= WARP) {
        // The rounds fit the first warp (registers and shuffles, no barrier) while the
        // other warps go on to the collapse, which needs only pre_s.
        if (threadIdx.x < WARP) {
            const float v = hc_sinkhorn_warp(c[mine ? threadIdx.x : 0], hc, iters, hc_eps);
            if (mine) comb_r[threadIdx.x] = v;
        }
    } else {
        hc_sinkhorn(c, hc, iters, hc_eps, comb_r);
    }
}

// Row r's part sums (`partials[r, part, HC_MIX_SLOTS]`, hc_post_mix's or
// hc_post_mix_rows') into mix_s: each warp adds every nw-th part of each slot, its loads
// in flight together (a thread a slot walking the parts waited for each), then the warps'
// sums are added in warp order — a fixed order. Every thread of the block calls it.
__device__ __forceinline__ void hc_add_parts(const float* partials, int r, int parts, float* mix_s) {
    __shared__ float by_warp[32][HC_MIX_SLOTS];
    const int slot = threadIdx.x & 31, wp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float* q = partials + (long long)r * parts * HC_MIX_SLOTS + slot;
    float v = 0.0f;
#pragma unroll 4
    for (int i = wp; i < parts; i += nw) v += q[(long long)i * HC_MIX_SLOTS];
    by_warp[wp][slot] = v;
    __syncthreads();
    if (threadIdx.x < HC_MIX_SLOTS) {
        float t = 0.0f;
        for (int w = 0; w < nw; w++) t += by_warp[w][threadIdx.x];
        mix_s[threadIdx.x] = t;
    }
    __syncthreads();
}

// One block per row (blockIdx.y 0). mix[rows, (2+hc)*hc] = W · streams (un-normalised),
// or, with `partials`, hc_post_mix's part sums of it and of the row's squares.
// With gridDim.y = 2 (hc² ≤ 32, decode batches) a second block of the row runs the
// Sinkhorn rounds in its first warp, and the first block only the sigmoids, the collapse
// and the norm: in one block the norm's barriers waited for the warp doing the rounds (a
// decode row's kernel 10.5 → 7.8 µs on the H200). Both blocks take the row's sum of
// squares (the same code, so the same value).
extern "C" __global__ void hc_pre_finish(const float* streams, const float* mix, F80 base, float s_pre,
                                         float s_post, float s_comb, int hc, int d, int iters, float norm_eps,
                                         float hc_eps, float* collapsed, float* post, float* comb,
                                         const float* out_norm, float out_eps, const float* partials, int parts) {
    pdl_begin();
    const int r = blockIdx.x;
    const int width = hc * d;
    const float* s = streams + (long long)r * width;
    __shared__ float pre_s[HC_MAX];
    __shared__ float c[HC_MAX * HC_MAX];
    __shared__ float mix_s[HC_MIX_SLOTS];
    float ss;
    const float* m;
    if (partials) {
        // hc_post_mix left the product and the sum of squares in parts (the same order in
        // both blocks of the row, so the same value).
        hc_add_parts(partials, r, parts, mix_s);
        ss = mix_s[HC_SUMSQ_SLOT];
        m = mix_s;
    } else {
        ss = block_sum(thread_sumsq(s, width));
        m = mix + (long long)r * (2 + hc) * hc;
    }
    const float inv = 1.0f / sqrtf(ss / (float)width + norm_eps);
    float* comb_r = comb + (long long)r * hc * hc;
    if (blockIdx.y == 1) {
        if (threadIdx.x < WARP) {
            const int l = threadIdx.x < hc * hc ? threadIdx.x : 0;
            const float v = hc_sinkhorn_warp(m[2 * hc + l] * inv * s_comb + base.v[2 * hc + l], hc, iters, hc_eps);
            if (threadIdx.x < hc * hc) comb_r[threadIdx.x] = v;
        }
        return;
    }
    hc_pre_weights(m, inv, base, s_pre, s_post, s_comb, hc, iters, hc_eps, pre_s, c, post + r * hc, comb_r);
    float* out = collapsed + (long long)r * d;
    hc_collapse(s, pre_s, hc, d, out);
    // The sub-block's input RMSNorm, fused: the block holds the row it just wrote.
    if (out_norm) block_rms_norm_row(out, out_norm, d, out_eps);
}

// One updated stream value: p · o + Σ_j c[j·stride] · old[j] in j order, every rounding
// step spelled out (hc_post and hc_post_mix must agree bit for bit whatever the compiler
// would contract).
__device__ __forceinline__ float hc_post_value(float p, float o, const float* c, int stride, const float* old,
                                               int hc) {
    float v = __fmul_rn(p, o);
    for (int j = 0; j < hc; j++) v = __fmaf_rn(c[j * stride], old[j], v);
    return v;
}

// One column x of a row's hc streams updated in place (old values read first).
template <int HC>
__device__ __forceinline__ void hc_post_column(float* s, float o, const float* p, const float* c, int d, int x) {
    float old[HC];
#pragma unroll
    for (int j = 0; j < HC; j++) old[j] = s[j * d + x];
#pragma unroll
    for (int k = 0; k < HC; k++) s[k * d + x] = hc_post_value(p[k], o, c + k, HC, old, HC);
}

// streams[r, k, :] = post[r, k] · out[r, :] + Σ_j comb[r, j, k] · streams[r, j, :].
// grid (columns / 256, up to 65,535 rows, looped), 256 threads. V4's hc = 4 is compiled
// with the streams' old values in registers; other counts (test models) index them at
// run time, from the thread's stack.
extern "C" __global__ void hc_post(float* streams, const float* out, const float* post, const float* comb, int rows,
                                   int hc, int d) {
    pdl_begin();
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    if (x >= d) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        float* s = streams + (long long)r * hc * d;
        const float o = out[(long long)r * d + x];
        const float* p = post + (long long)r * hc;
        const float* c = comb + (long long)r * hc * hc;
        if (hc == 4) {
            hc_post_column<4>(s, o, p, c, d, x);
            continue;
        }
        float old[HC_MAX];
        for (int j = 0; j < hc; j++) old[j] = s[j * d + x];
        for (int k = 0; k < hc; k++) s[k * d + x] = hc_post_value(p[k], o, c + k, hc, old, hc);
    }
}

// Final collapse: out[r, :] = Σ_j (sigmoid(mix_j/rms · scale + base_j) + eps) · streams[r, j, :].
extern "C" __global__ void hc_head_finish(const float* streams, const float* mix, F80 base, float scale,
                                          int hc, int d, float norm_eps, float hc_eps, float* out) {
    pdl_begin();
    const int r = blockIdx.x;
    const int width = hc * d;
    const float* s = streams + (long long)r * width;
    __shared__ float pre_s[HC_MAX];
    const float ss = block_sum(thread_sumsq(s, width));
    const float inv = 1.0f / sqrtf(ss / (float)width + norm_eps);
    if (threadIdx.x < hc) pre_s[threadIdx.x] = sigmoidf_(mix[r * hc + threadIdx.x] * inv * scale + base.v[threadIdx.x]) + hc_eps;
    __syncthreads();
    hc_collapse(s, pre_s, hc, d, out + (long long)r * d);
}

// One halving step of mix_rows_body's warp reduction over v[0, 2H): the lanes with bit
// `off` set keep v[H, 2H), the others v[0, H), each adding its partner's copy, into v[0, H).
template <int H>
__device__ __forceinline__ void mix_fold(float* v, int lane, int off) {
    const bool up = lane & off;
#pragma unroll
    for (int j = 0; j < H; j++) {
        const float send = up ? v[j] : v[j + H];
        const float keep = up ? v[j + H] : v[j];
        v[j] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
}

// A warp's T sums (T a multiple of 32, v[0, T) in each lane) by halving exchanges: each
// step a lane keeps half of its values and adds its partner's copy of them, so after five
// steps each lane holds T / 32 finished sums in v[0, T / 32), those of slots
// base .. base + T / 32, base returned (a lane with bit b set keeps the upper half at the
// step of b). The pairs are warp_sum's (xor 16, 8, 4, 2, 1), so the sums are bit for bit
// the same.
template <int T>
__device__ __forceinline__ int warp_fold_sums(float* v, int lane) {
    static_assert(T % 32 == 0, "the halving reduction needs a multiple of 32 values");
    mix_fold<T / 2>(v, lane, 16);
    mix_fold<T / 4>(v, lane, 8);
    mix_fold<T / 8>(v, lane, 4);
    mix_fold<T / 16>(v, lane, 2);
    mix_fold<T / 32>(v, lane, 1);
    int base = 0;
#pragma unroll
    for (int b = 16, h = T / 2; b >= 1; b >>= 1, h >>= 1)
        if (lane & b) base += h;
    return base;
}

// The mixing product for many rows: out[r, n] = Σ_k W[n, k] · x[r, k] with few outputs
// (N ≤ MAXN, e.g. 24) and long rows (hc · hidden). A block of 256 threads takes ROWS
// rows and all N outputs, so the small weight (L2-resident) is read once per ROWS rows
// instead of once per output tile as a general GEMM would tile it. Decode-sized batches
// (few row blocks) also split K over blockIdx.y `parts`: 16 blocks for 64 rows each read
// the whole 1.5 MB weight alone (~160 µs a call); each part's block leaves its sums in
// `partials` and the last one of a row block (by ticket) adds them in part order.
template <int ROWS, int MAXN, int WT>
__device__ void mix_rows_body(float* out, const float* x, const void* w, int rows, int N, int K, float* partials,
                              u32* tickets) {
    const int r0 = blockIdx.x * ROWS;
    const int parts = gridDim.y, part = blockIdx.y;
    const int span = (K + parts - 1) / parts;
    const int k_lo = part * span, k_hi = min(K, k_lo + span);
    float acc[ROWS][MAXN];
#pragma unroll
    for (int i = 0; i < ROWS; i++)
#pragma unroll
        for (int n = 0; n < MAXN; n++) acc[i][n] = 0.0f;
    for (int k = k_lo + threadIdx.x; k < k_hi; k += blockDim.x) {
        float xv[ROWS];
#pragma unroll
        for (int i = 0; i < ROWS; i++) xv[i] = r0 + i < rows ? x[(long long)(r0 + i) * K + k] : 0.0f;
#pragma unroll
        for (int n = 0; n < MAXN; n++) {
            if (n < N) {
                const float wv = WT == 0 ? ((const float*)w)[(long long)n * K + k] : bf2f(((const u16*)w)[(long long)n * K + k]);
#pragma unroll
                for (int i = 0; i < ROWS; i++) acc[i][n] += wv * xv[i];
            }
        }
    }
    __shared__ float red[8][ROWS * MAXN];
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    // The warp's sums of all ROWS·MAXN accumulators (93 shuffles for 96 values, where a
    // warp_sum each took 480).
    constexpr int T = ROWS * MAXN;
    float* v = &acc[0][0];
    const int base = warp_fold_sums<T>(v, lane);
#pragma unroll
    for (int j = 0; j < T / 32; j++) red[wp][base + j] = v[j];
    __syncthreads();
    for (int t = threadIdx.x; t < ROWS * MAXN; t += blockDim.x) {
        const int i = t / MAXN, n = t % MAXN;
        if (n < N && r0 + i < rows) {
            float s = 0.0f;
            for (int q = 0; q < (int)(blockDim.x >> 5); q++) s += red[q][t];
            if (parts == 1) out[(long long)(r0 + i) * N + n] = s;
            else partials[((long long)part * rows + r0 + i) * N + n] = s;
        }
    }
    if (parts == 1) return;
    __shared__ u32 last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&tickets[blockIdx.x], 1u) == (u32)(parts - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int t = threadIdx.x; t < ROWS * MAXN; t += blockDim.x) {
        const int i = t / MAXN, n = t % MAXN;
        if (n < N && r0 + i < rows) {
            float s = 0.0f;
#pragma unroll 8
            for (int q = 0; q < parts; q++) s += __ldcg(&partials[((long long)q * rows + r0 + i) * N + n]);
            out[(long long)(r0 + i) * N + n] = s;
        }
    }
    if (threadIdx.x == 0) tickets[blockIdx.x] = 0u;
}

extern "C" __global__ void __launch_bounds__(256) mix_rows_f32(float* out, const float* x, const void* w, int rows,
                                                               int N, int K, float* partials, u32* tickets) {
    pdl_begin();
    mix_rows_body<4, 24, 0>(out, x, w, rows, N, K, partials, tickets);
}
extern "C" __global__ void __launch_bounds__(256) mix_rows_bf16(float* out, const float* x, const void* w, int rows,
                                                                int N, int K, float* partials, u32* tickets) {
    pdl_begin();
    mix_rows_body<4, 24, 1>(out, x, w, rows, N, K, partials, tickets);
}

// hc_post, and of the updated row the next sub-block's mixing product and sum of squares
// in parts (decode rows, V4's hc = 4: 24 logits and the sum fit a warp's 32 slots):
// block (part, r) takes 64 columns x of every stream. Its slice of the mixing weight
// (the 64 columns k·d + x of each logit's row: 24 KB in f32) goes to shared memory by
// cp.async, every copy issued at once (plain loads were each waited for before the next:
// the compiler interleaved them with their multiply-adds); meanwhile each thread updates
// its column as hc_post does (the same rounding steps, so the streams are bit for bit
// hc_post's), then multiplies it into the slice. The block's 32 sums go to
// partials[r, part, :], which hc_pre_finish adds in a fixed order. One launch and one pass
// over the row where hc_post, the mixing product and hc_pre_finish's sum of squares took
// three (docs/cuda.md "What runs where").
#define HC_POST_MIX_COLS 64
// Most rows a block takes (hc.rs: `post_mix_rows_per_block`): 512 threads.
#define HC_POST_MIX_ROWS_MAX 8
// Block (part, g) takes rows g·per_block .. of `rows` side by side, 64 threads (two warps)
// a row, from the one copy of its weight slice: at one row a block a batch of 32 rows
// copied the 24 KB slices 32 times (48 MB from L2, ~11 µs a launch on the H200), and a
// block walking its rows one after another paid each row's load-to-store chain and two
// block barriers in turn (~10 µs a launch at 4 rows a block). Each row's sums are the same
// either way.
template <int WT, int HC>
__device__ void hc_post_mix_body(float* __restrict__ streams, const float* __restrict__ out,
                                 const float* __restrict__ post, const float* __restrict__ comb, int d,
                                 const void* __restrict__ w, float* __restrict__ partials, int rows,
                                 int per_block) {
    constexpr int N = (2 + HC) * HC;
    static_assert(N < HC_MIX_SLOTS, "the logits and the sum of squares fill one warp's 32 slots");
    constexpr int ELEM = WT == 0 ? 4 : 2;
    constexpr int PIECES = HC_POST_MIX_COLS * ELEM / 16;  // 16-byte copies a (logit, stream) row
    __shared__ __align__(16) unsigned char wsm[N * HC * HC_POST_MIX_COLS * ELEM];
    const int part = blockIdx.x, parts = gridDim.x;
    const int x0 = part * HC_POST_MIX_COLS, tx = threadIdx.x % HC_POST_MIX_COLS;
    const long long K = (long long)HC * d;
    const unsigned char* wb = (const unsigned char*)w;
    for (int c = threadIdx.x; c < N * HC * PIECES; c += blockDim.x) {
        const int nk = c / PIECES, piece = c % PIECES, n = nk / HC, k = nk % HC;
        const long long col = n * K + (long long)k * d + x0;
        cp_async<16>(smem_addr(wsm + (nk * HC_POST_MIX_COLS * ELEM + piece * 16)), wb + col * ELEM + piece * 16);
    }
    cp_async_commit();
    __shared__ float red[HC_POST_MIX_ROWS_MAX * HC_POST_MIX_COLS / 32][HC_MIX_SLOTS];
    const int r = blockIdx.y * per_block + threadIdx.x / HC_POST_MIX_COLS;
    const bool live = r < rows;
    float acc[HC_MIX_SLOTS];
#pragma unroll
    for (int n = 0; n < HC_MIX_SLOTS; n++) acc[n] = 0.0f;
    float* s = streams + (long long)r * HC * d;
    const int x = x0 + tx;
    float v[HC];
    if (live) {
        float old[HC];
#pragma unroll
        for (int j = 0; j < HC; j++) old[j] = s[j * d + x];
        const float o = out[(long long)r * d + x];
        const float* pr = post + r * HC;
        const float* cr = comb + r * HC * HC;
#pragma unroll
        for (int k = 0; k < HC; k++) {
            v[k] = hc_post_value(pr[k], o, cr + k, HC, old, HC);
            acc[HC_SUMSQ_SLOT] += v[k] * v[k];
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    if (live) {
#pragma unroll
        for (int n = 0; n < N; n++)
#pragma unroll
            for (int k = 0; k < HC; k++) {
                const int at = (n * HC + k) * HC_POST_MIX_COLS + tx;
                const float wv = WT == 0 ? ((const float*)wsm)[at] : bf2f(((const u16*)wsm)[at]);
                acc[n] += wv * v[k];
            }
#pragma unroll
        for (int k = 0; k < HC; k++) s[k * d + x] = v[k];
    }
    // The warp's 32 sums: lane L ends with slot L's (the base of 32 values is the lane).
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    warp_fold_sums<HC_MIX_SLOTS>(acc, lane);
    red[wp][lane] = acc[0];
    __syncthreads();
    // The row's first warp adds its warps' sums in warp order.
    constexpr int ROW_WARPS = HC_POST_MIX_COLS / 32;
    if (live && tx < HC_MIX_SLOTS) {
        float sum = 0.0f;
#pragma unroll
        for (int q = 0; q < ROW_WARPS; q++) sum += red[wp + q][tx];
        partials[((long long)r * parts + part) * HC_MIX_SLOTS + tx] = sum;
    }
}

// V4's four streams (24 logits); other hc take hc_post and hc_pre apart.
extern "C" __global__ void __launch_bounds__(HC_POST_MIX_ROWS_MAX * HC_POST_MIX_COLS) hc_post_mix_f32(float* streams, const float* out, const float* post,
                                                                  const float* comb, int d, const void* w,
                                                                  float* partials, int rows, int per_block) {
    pdl_begin();
    hc_post_mix_body<0, 4>(streams, out, post, comb, d, w, partials, rows, per_block);
}
extern "C" __global__ void __launch_bounds__(HC_POST_MIX_ROWS_MAX * HC_POST_MIX_COLS) hc_post_mix_bf16(float* streams, const float* out, const float* post,
                                                                   const float* comb, int d, const void* w,
                                                                   float* partials, int rows, int per_block) {
    pdl_begin();
    hc_post_mix_body<1, 4>(streams, out, post, comb, d, w, partials, rows, per_block);
}
