// Manifold-constrained hyper-connections. The mixing logits come from an unweighted
// RMSNorm of the flattened streams followed by a product; the norm is one scalar per
// row, so the product runs on the raw streams (gemv/cuBLAS) and the kernels here scale
// its result by 1/rms before the sigmoids and the Sinkhorn projection.

#define HC_MAX 8

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

// Sinkhorn projection of the hc × hc logits in shared `c` (row softmax + eps, then
// `iters` rounds of column and row normalisation), by the first hc² threads, the rest of
// the participating threads keeping step; the result goes to `comb`. ONE_WARP: only the
// first warp takes part (hc² ≤ 32) and syncs with __syncwarp; otherwise the whole block.
template <bool ONE_WARP>
__device__ __forceinline__ void hc_sync() {
    if (ONE_WARP)
        __syncwarp();
    else
        __syncthreads();
}

template <bool ONE_WARP>
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
    hc_sync<ONE_WARP>();
    if (mine) c[threadIdx.x] = v;
    hc_sync<ONE_WARP>();
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            if (mine) {
                float sum = 0.0f;
                for (int q = 0; q < hc; q++) sum += c[j * hc + q];
                v = c[threadIdx.x] / (sum + hc_eps);
            }
            hc_sync<ONE_WARP>();
            if (mine) c[threadIdx.x] = v;
            hc_sync<ONE_WARP>();
        }
        if (mine) {
            float sum = 0.0f;
            for (int q = 0; q < hc; q++) sum += c[q * hc + k];
            v = c[threadIdx.x] / (sum + hc_eps);
        }
        hc_sync<ONE_WARP>();
        if (mine) c[threadIdx.x] = v;
        hc_sync<ONE_WARP>();
    }
    if (mine) comb[threadIdx.x] = c[threadIdx.x];
}

// One block per row. mix[rows, (2+hc)*hc] = W · streams (un-normalised).
extern "C" __global__ void hc_pre_finish(const float* streams, const float* mix, F80 base, float s_pre,
                                         float s_post, float s_comb, int hc, int d, int iters, float norm_eps,
                                         float hc_eps, float* collapsed, float* post, float* comb) {
    const int r = blockIdx.x;
    const int width = hc * d;
    const float* s = streams + (long long)r * width;
    __shared__ float pre_s[HC_MAX];
    __shared__ float c[HC_MAX * HC_MAX];
    const float ss = block_sum(thread_sumsq(s, width));
    const float inv = 1.0f / sqrtf(ss / (float)width + norm_eps);
    const int mixn = (2 + hc) * hc;
    const float* m = mix + (long long)r * mixn;
    // The hc × hc mixing matrix, one element per thread of the first hc² threads, which
    // run the Sinkhorn rounds in step (each row or column sum taken in index order by
    // every thread of it, the same operations as one thread doing it all).
    const bool mine = threadIdx.x < hc * hc;
    if (threadIdx.x < hc) {
        pre_s[threadIdx.x] = sigmoidf_(m[threadIdx.x] * inv * s_pre + base.v[threadIdx.x]) + hc_eps;
        post[r * hc + threadIdx.x] = 2.0f * sigmoidf_(m[hc + threadIdx.x] * inv * s_post + base.v[hc + threadIdx.x]);
    }
    if (mine) c[threadIdx.x] = m[2 * hc + threadIdx.x] * inv * s_comb + base.v[2 * hc + threadIdx.x];
    __syncthreads();
    float* comb_r = comb + (long long)r * hc * hc;
    if (hc * hc <= WARP) {
        // The rounds fit the first warp, which syncs alone (a block-wide barrier a round
        // cost more than the rest of the kernel at decode sizes) while the other warps
        // go on to the collapse, which needs only pre_s.
        if (threadIdx.x < WARP) hc_sinkhorn<true>(c, hc, iters, hc_eps, comb_r);
    } else {
        hc_sinkhorn<false>(c, hc, iters, hc_eps, comb_r);
    }
    hc_collapse(s, pre_s, hc, d, collapsed + (long long)r * d);
}

// streams[r, k, :] = post[r, k] · out[r, :] + Σ_j comb[r, j, k] · streams[r, j, :].
extern "C" __global__ void hc_post(float* streams, const float* out, const float* post, const float* comb, int rows,
                                   int hc, int d) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * d) return;
    int r = (int)(i / d), x = (int)(i % d);
    float* s = streams + (long long)r * hc * d;
    float old[HC_MAX];
    for (int j = 0; j < hc; j++) old[j] = s[j * d + x];
    const float o = out[i];
    const float* c = comb + (long long)r * hc * hc;
    for (int k = 0; k < hc; k++) {
        float v = post[r * hc + k] * o;
        for (int j = 0; j < hc; j++) v += c[j * hc + k] * old[j];
        s[k * d + x] = v;
    }
}

// Final collapse: out[r, :] = Σ_j (sigmoid(mix_j/rms · scale + base_j) + eps) · streams[r, j, :].
extern "C" __global__ void hc_head_finish(const float* streams, const float* mix, F80 base, float scale,
                                          int hc, int d, float norm_eps, float hc_eps, float* out) {
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

// The mixing product for many rows: out[r, n] = Σ_k W[n, k] · x[r, k] with few outputs
// (N ≤ MAXN, e.g. 24) and long rows (hc · hidden). A block of 256 threads takes ROWS
// rows and all N outputs, so the small weight (L2-resident) is read once per ROWS rows
// instead of once per output tile as a general GEMM would tile it.
template <int ROWS, int MAXN, int WT>
__device__ void mix_rows_body(float* out, const float* x, const void* w, int rows, int N, int K) {
    const int r0 = blockIdx.x * ROWS;
    float acc[ROWS][MAXN];
#pragma unroll
    for (int i = 0; i < ROWS; i++)
#pragma unroll
        for (int n = 0; n < MAXN; n++) acc[i][n] = 0.0f;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
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
#pragma unroll
    for (int i = 0; i < ROWS; i++)
#pragma unroll
        for (int n = 0; n < MAXN; n++) {
            const float v = warp_sum(acc[i][n]);
            if (lane == 0) red[wp][i * MAXN + n] = v;
        }
    __syncthreads();
    for (int t = threadIdx.x; t < ROWS * MAXN; t += blockDim.x) {
        const int i = t / MAXN, n = t % MAXN;
        if (n < N && r0 + i < rows) {
            float s = 0.0f;
            for (int q = 0; q < (int)(blockDim.x >> 5); q++) s += red[q][t];
            out[(long long)(r0 + i) * N + n] = s;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) mix_rows_f32(float* out, const float* x, const void* w, int rows,
                                                               int N, int K) {
    mix_rows_body<4, 24, 0>(out, x, w, rows, N, K);
}
extern "C" __global__ void __launch_bounds__(256) mix_rows_bf16(float* out, const float* x, const void* w, int rows,
                                                                int N, int K) {
    mix_rows_body<4, 24, 1>(out, x, w, rows, N, K);
}

// Decode-sized mHC pre-mix (up to HC_SPLIT_ROWS rows). One block per row spent ~14 µs on
// a 16K-wide row of streams (its loads, a block-wide norm, then 20 Sinkhorn rounds behind
// it) after a 24-block gemv for the mixing product; here the product and the sums of
// squares are split over blocks of HC_SLICE inputs, and the last block (by ticket) adds
// the parts in block order and runs, one warp per row, the sigmoids and the Sinkhorn
// rounds in registers (row and column sums by shuffles, in index order, as the CPU
// sums). It writes `pre` for hc_collapse_rows, the second launch.
#define HC_SLICE 256
#define HC_SPLIT_ROWS 8
#define HC_SPLIT_NP 32

template <int WT>
__device__ __forceinline__ void hc_load8(const void* w, long long at, float* out) {
    if (WT == 0) {
        const float4 a = *reinterpret_cast<const float4*>((const float*)w + at);
        const float4 b = *reinterpret_cast<const float4*>((const float*)w + at + 4);
        out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
        out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
    } else {
        const uint4 q = *reinterpret_cast<const uint4*>((const u16*)w + at);
        const u32 p[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            out[2 * i] = bf2f((u16)(p[i] & 0xffffu));
            out[2 * i + 1] = bf2f((u16)(p[i] >> 16));
        }
    }
}

template <int WT>
__device__ void hc_mix_split_body(const float* streams, const void* w, F80 base, float s_pre, float s_post,
                                  float s_comb, int rows, int hc, int K, int iters, float norm_eps, float hc_eps,
                                  float* partials, u32* ticket, float* pre, float* post, float* comb) {
    const int N = (2 + hc) * hc, NP = N + 1;  // the mixing outputs, then the sum of squares
    const int P = gridDim.x;
    const long long k0 = (long long)blockIdx.x * HC_SLICE;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ float xs[HC_SPLIT_ROWS][HC_SLICE];
    __shared__ float red[HC_SPLIT_ROWS][HC_SLICE / WARP];
    for (int r = 0; r < rows; r++) {
        const float v = streams[(long long)r * K + k0 + threadIdx.x];
        xs[r][threadIdx.x] = v;
        const float sq = warp_sum(v * v);
        if (lane == 0) red[r][warp] = sq;
    }
    __syncthreads();
    float* part = partials + (long long)blockIdx.x * rows * NP;
    if (threadIdx.x < rows) {
        float s = 0.0f;
        for (int q = 0; q < HC_SLICE / WARP; q++) s += red[threadIdx.x][q];
        part[threadIdx.x * NP + N] = s;
    }
    // Warp `warp` takes outputs warp, warp + 8, …; each lane 8 consecutive inputs.
    for (int n = warp; n < N; n += HC_SLICE / WARP) {
        float wv[8];
        hc_load8<WT>(w, (long long)n * K + k0 + lane * 8, wv);
        for (int r = 0; r < rows; r++) {
            const float4 a = *reinterpret_cast<const float4*>(&xs[r][lane * 8]);
            const float4 b = *reinterpret_cast<const float4*>(&xs[r][lane * 8 + 4]);
            float acc = wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w;
            acc += wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
            acc = warp_sum(acc);
            if (lane == 0) part[r * NP + n] = acc;
        }
    }
    __shared__ u32 last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == (u32)(P - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    __shared__ float tot[HC_SPLIT_ROWS][HC_SPLIT_NP];
    for (int i = threadIdx.x; i < rows * NP; i += blockDim.x) {
        float s = 0.0f;
        for (int q = 0; q < P; q++) s += __ldcg(&partials[(long long)q * rows * NP + i]);
        tot[i / NP][i % NP] = s;
    }
    if (threadIdx.x == 0) *ticket = 0u;
    __syncthreads();
    if (warp >= rows) return;
    const int r = warp;
    const float inv = 1.0f / sqrtf(tot[r][N] / (float)K + norm_eps);
    if (lane < hc) {
        pre[r * hc + lane] = sigmoidf_(tot[r][lane] * inv * s_pre + base.v[lane]) + hc_eps;
        post[r * hc + lane] = 2.0f * sigmoidf_(tot[r][hc + lane] * inv * s_post + base.v[hc + lane]);
    }
    // Lane j·hc + k holds c[j][k] (lanes past hc² mirror lane 0 and write nothing).
    const int hh = hc * hc;
    const int l = lane < hh ? lane : 0;
    const int j = l / hc, k = l % hc;
    float c = tot[r][2 * hc + l] * inv * s_comb + base.v[2 * hc + l];
    float mx = NEG_INF;
    for (int q = 0; q < hc; q++) mx = fmaxf(mx, __shfl_sync(0xffffffffu, c, j * hc + q));
    float sum = 0.0f;
    for (int q = 0; q < hc; q++) sum += expf(__shfl_sync(0xffffffffu, c, j * hc + q) - mx);
    c = expf(c - mx) / sum + hc_eps;
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            float s = 0.0f;
            for (int q = 0; q < hc; q++) s += __shfl_sync(0xffffffffu, c, j * hc + q);
            c = c / (s + hc_eps);
        }
        float s = 0.0f;
        for (int q = 0; q < hc; q++) s += __shfl_sync(0xffffffffu, c, q * hc + k);
        c = c / (s + hc_eps);
    }
    if (lane < hh) comb[(long long)r * hh + lane] = c;
}

extern "C" __global__ void __launch_bounds__(HC_SLICE)
    hc_mix_split_f32(const float* streams, const void* w, F80 base, float s_pre, float s_post, float s_comb, int rows,
                     int hc, int K, int iters, float norm_eps, float hc_eps, float* partials, u32* ticket, float* pre,
                     float* post, float* comb) {
    hc_mix_split_body<0>(streams, w, base, s_pre, s_post, s_comb, rows, hc, K, iters, norm_eps, hc_eps, partials,
                         ticket, pre, post, comb);
}
extern "C" __global__ void __launch_bounds__(HC_SLICE)
    hc_mix_split_bf16(const float* streams, const void* w, F80 base, float s_pre, float s_post, float s_comb, int rows,
                      int hc, int K, int iters, float norm_eps, float hc_eps, float* partials, u32* ticket, float* pre,
                      float* post, float* comb) {
    hc_mix_split_body<1>(streams, w, base, s_pre, s_post, s_comb, rows, hc, K, iters, norm_eps, hc_eps, partials,
                         ticket, pre, post, comb);
}

// out[r, i] = Σ_j pre[r, j] · streams[r, j, i] (in j order), four outputs a thread:
// grid (rows, d / 4 / blockDim.x rounded up); d a multiple of 4.
extern "C" __global__ void hc_collapse_rows(const float* streams, const float* pre, int hc, int d, float* out) {
    const int r = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= (d >> 2)) return;
    const float* s = streams + (long long)r * hc * d;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int j = 0; j < hc; j++) {
        const float p = pre[r * hc + j];
        const float4 v = reinterpret_cast<const float4*>(s + (long long)j * d)[i];
        acc.x += p * v.x;
        acc.y += p * v.y;
        acc.z += p * v.z;
        acc.w += p * v.w;
    }
    reinterpret_cast<float4*>(out + (long long)r * d)[i] = acc;
}
