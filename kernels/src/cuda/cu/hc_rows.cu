// The mHC boundary of a prefill's rows (V4's 4 streams × 4096; hc.rs `post_mix_rows`):
// `hc_post_mix_rows` updates the streams and takes the next mixing product's part sums
// in one pass, `hc_weights_rows` turns a row's part sums into its mixing weights (the
// sigmoids and the Sinkhorn rounds, 16 lanes a row), and `hc_collapse_rows` collapses
// the streams with those weights and norms the result. `hc_pre_finish_rows` does the
// last two in one block a row (the first sub-block's, whose product cuBLAS takes).
//
// Why the weights apart: in one block a row, the norm's block sum waited for the warp
// running the Sinkhorn rounds (a chain of ~40 dependent shuffle steps), and that chain,
// not the 64 KiB a row, bounded the kernel (an 8K prefill's call ~305 µs where its bytes
// take ~150). Apart, the rounds of all rows run at once in a few µs and the collapse is
// a pass over memory.

#define HCR_THREADS 256
#define HCR_HC 4
#define HCR_COLS 4  // float4 columns of a stream a thread: hidden = 4 · HCR_THREADS · HCR_COLS
#define HCR_PIECES (HCR_HC * HCR_COLS)

// A row's collapse with its pre weights (hc_collapse's sums: thread t holds float4s
// t + 256u of the row, stream j, columns t + 256k at u = 4j + k) and, fused, the
// sub-block's input norm (block_rms_norm_row's), stored; with `rounded`, also rounded
// once to bf16 there (round_bf16_rows8's rounding of the same values).
__device__ __forceinline__ void hcr_collapse_store(const float4 (&v)[HCR_PIECES], const float* pre_s, int r, int d,
                                                   float* collapsed, const float* out_norm, float out_eps,
                                                   u16* rounded) {
    const int t = threadIdx.x;
    float4 o[HCR_COLS];
    float oss = 0.0f;
#pragma unroll
    for (int k = 0; k < HCR_COLS; k++) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int j = 0; j < HCR_HC; j++) {
            const float4 x = v[j * HCR_COLS + k];
            acc.x += pre_s[j] * x.x;
            acc.y += pre_s[j] * x.y;
            acc.z += pre_s[j] * x.z;
            acc.w += pre_s[j] * x.w;
        }
        o[k] = acc;
        oss += acc.x * acc.x + acc.y * acc.y + acc.z * acc.z + acc.w * acc.w;
    }
    float4* out4 = reinterpret_cast<float4*>(collapsed + (long long)r * d);
    const float onv = out_norm ? 1.0f / sqrtf(block_sum(oss) / (float)d + out_eps) : 1.0f;
    const float4* w4 = reinterpret_cast<const float4*>(out_norm);
#pragma unroll
    for (int k = 0; k < HCR_COLS; k++) {
        const int col = t + HCR_THREADS * k;
        const float4 y = out_norm ? rms_scale4(o[k], onv, w4, col) : o[k];
        out4[col] = y;
        if (rounded)
            reinterpret_cast<uint2*>(rounded + (long long)r * d)[col] =
                make_uint2((u32)f2bf(y.x) | ((u32)f2bf(y.y) << 16), (u32)f2bf(y.z) | ((u32)f2bf(y.w) << 16));
    }
}

// hc_pre_finish of a prefill-sized batch (a block of HCR_THREADS a row) of V4's shape:
// the row's streams read once into registers. hc_pre_finish reads them for the sum of
// squares, again for the collapse and the collapsed row again for its norm — the same
// elements by the same thread each time, so the sums here are those, in the same order,
// and the outputs the same bits; only the passes over memory go. The product comes in
// `mix`, or, with `partials` (hc_post_mix_rows', where hc.rs does not take the weights
// apart), as part sums added as hc_pre_finish adds them.
extern "C" __global__ void __launch_bounds__(HCR_THREADS)
    hc_pre_finish_rows(const float* streams, const float* mix, F80 base, float s_pre, float s_post, float s_comb,
                       int hc, int d, int iters, float norm_eps, float hc_eps, float* collapsed, float* post,
                       float* comb, const float* out_norm, float out_eps, const float* partials, int parts) {
    pdl_begin();
    const int r = blockIdx.x, t = threadIdx.x, width = HCR_HC * d;
    const float4* s4 = reinterpret_cast<const float4*>(streams + (long long)r * width);
    __shared__ float pre_s[HC_MAX];
    __shared__ float c[HC_MAX * HC_MAX];
    __shared__ float mix_s[HC_MIX_SLOTS];
    float4 v[HCR_PIECES];
#pragma unroll
    for (int u = 0; u < HCR_PIECES; u++) v[u] = s4[t + HCR_THREADS * u];
    float inv;
    const float* m;
    if (partials) {
        hc_add_parts(partials, r, parts, mix_s);
        inv = 1.0f / sqrtf(mix_s[HC_SUMSQ_SLOT] / (float)width + norm_eps);
        m = mix_s;
    } else {
        float ss = 0.0f;
#pragma unroll
        for (int u = 0; u < HCR_PIECES; u++)
            ss += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
        inv = 1.0f / sqrtf(block_sum(ss) / (float)width + norm_eps);
        m = mix + (long long)r * (2 + hc) * hc;
    }
    hc_pre_weights(m, inv, base, s_pre, s_post, s_comb, hc, iters, hc_eps, pre_s, c, post + r * hc,
                   comb + (long long)r * hc * hc);
    hcr_collapse_store(v, pre_s, r, d, collapsed, out_norm, out_eps, nullptr);
}

// A row's mixing weights from hc_post_mix_rows' part sums (`partials[r, parts, 32]`, the
// sum of squares in slot 31), 16 lanes a row (two rows a warp), V4's 4 streams: lane l
// adds slots l and l + 16 over the parts in hc_add_parts' order (as 8 warps add them:
// parts w, w + 8, … each, then those sums in w order), so the sums are the same bits as
// hc_pre_finish_rows' and so is everything after them: pre (lanes 0–3, into `pre`, which
// hc_collapse_rows reads), post (lanes 4–7) and the Sinkhorn projection of the 16 comb
// logits, lane i holding element i (hc_sinkhorn_lanes on the row's 16 lanes).
// grid ceil(rows / 16), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
    hc_weights_rows(const float* partials, int parts, F80 base, float s_pre, float s_post, float s_comb, int width,
                    int iters, float norm_eps, float hc_eps, float* pre, float* post, float* comb, int rows) {
    pdl_begin();
    const int l = threadIdx.x & 15, r = blockIdx.x * 16 + (threadIdx.x >> 4);
    const bool live = r < rows;
    float m0 = 0.0f, m1 = 0.0f;
    if (live) {
        const float* q = partials + (long long)r * parts * HC_MIX_SLOTS + l;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            float v0 = 0.0f, v1 = 0.0f;
#pragma unroll 4
            for (int i = w; i < parts; i += 8) {
                v0 += q[(long long)i * HC_MIX_SLOTS];
                v1 += q[(long long)i * HC_MIX_SLOTS + 16];
            }
            m0 += v0;
            m1 += v1;
        }
    }
    const float inv = 1.0f / sqrtf(__shfl_sync(0xffffffffu, m1, 15, 16) / (float)width + norm_eps);
    if (live && l < HCR_HC) pre[(long long)r * HCR_HC + l] = sigmoidf_(m0 * inv * s_pre + base.v[l]) + hc_eps;
    if (live && l >= HCR_HC && l < 2 * HCR_HC)
        post[(long long)r * HCR_HC + l - HCR_HC] = 2.0f * sigmoidf_(m0 * inv * s_post + base.v[l]);
    // Comb logit i is slot 8 + i: lane 8 + i's first value for i < 8, lane i - 8's second after.
    const float first = m0 * inv * s_comb + base.v[l];
    const float second = l < 8 ? m1 * inv * s_comb + base.v[l + 16] : 0.0f;
    const float from_first = __shfl_sync(0xffffffffu, first, (l + 8) & 15, 16);
    const float from_second = __shfl_sync(0xffffffffu, second, (l + 8) & 15, 16);
    const float c = hc_sinkhorn_lanes<HCR_HC, 16>(l < 8 ? from_first : from_second, HCR_HC, iters, hc_eps);
    if (live) comb[(long long)r * HCR_HC * HCR_HC + l] = c;
}

// The collapse and norm of hc_pre_finish_rows with the row's pre weights from
// hc_weights_rows: no barrier but the norm's, so the kernel is a pass over the streams.
// grid rows, HCR_THREADS threads.
// With `copies`, `streams` is `[rows, d]`: every stream of a row is that row (a step's
// first sub-block, whose streams are the embedding's copies), read once; the sums are
// those of the row's copies made and collapsed. With `rounded`, the collapsed rows are
// also stored rounded to bf16 there, for the products that read them so.
extern "C" __global__ void __launch_bounds__(HCR_THREADS)
    hc_collapse_rows(const float* streams, const float* pre, int d, float* collapsed, const float* out_norm,
                     float out_eps, int copies, u16* rounded) {
    pdl_begin();
    const int r = blockIdx.x, t = threadIdx.x;
    float4 v[HCR_PIECES];
    if (copies) {
        const float4* x4 = reinterpret_cast<const float4*>(streams + (long long)r * d);
#pragma unroll
        for (int k = 0; k < HCR_COLS; k++) {
            const float4 x = x4[t + HCR_THREADS * k];
#pragma unroll
            for (int j = 0; j < HCR_HC; j++) v[j * HCR_COLS + k] = x;
        }
    } else {
        const float4* s4 = reinterpret_cast<const float4*>(streams + (long long)r * HCR_HC * d);
#pragma unroll
        for (int u = 0; u < HCR_PIECES; u++) v[u] = s4[t + HCR_THREADS * u];
    }
    const float4 p = *reinterpret_cast<const float4*>(pre + (long long)r * HCR_HC);
    const float pre_s[HCR_HC] = {p.x, p.y, p.z, p.w};
    hcr_collapse_store(v, pre_s, r, d, collapsed, out_norm, out_eps, rounded);
}

// hc_post and the next sub-block's mixing product for a prefill's rows (hc_post_mix is
// for decode batches: its blocks hold a weight slice for a few rows and fold each row's
// sums across the block at every row). Here a warp takes 4 rows at a time, 8 lanes a row,
// a lane 4 columns of each stream a step (a row's 128 bytes a stream in one access of 8
// lanes: 4 lines an instruction; a lane a row touched 32): it updates them as hc_post does
// (the same rounding steps: the streams are bit for bit hc_post's) and adds each updated
// value times its 24 weights into its own sums, folded over the row's 8 lanes once the
// row's part is done. The part's weights sit in shared memory as [stream][column][logit],
// a column's 24 in 6 16-byte chunks at chunk 7x + x/4 (`hpr_at`): the 8 columns 4 apart
// that a warp reads at once start on chunks 29g + const, distinct mod 8, so on distinct
// banks (a plain stride of 28 floats put them on two). The sums go to partials[r, part,
// 32] as hc_post_mix leaves them (the sum of squares in slot 31), which hc_weights_rows
// (or hc_pre_finish_rows) adds in a fixed order.
// One pass over the streams where hc_post, the mixing product (cuBLAS's f32 GEMM, its 24
// outputs in a tile of 64 or more) and the pre-mix read them three times. An 8K
// prefill's call takes ~530 µs where hc_post's pass over the same bytes takes ~370; most
// stalls wait on the weights' shared-memory loads (Nsight Compute). hc_rows_tc.cu's
// kernel, the product on the tensor cores with the rows staged by `cp.async`, replaced
// it by default (~357 µs; SLUICE_CUDA_HC_POST_MIX_TC=0 keeps this one). Tried and slower
// (docs/perf.md): the product on the tensor cores with each lane loading its fragments'
// values itself (`mma.m16n8k16` on bf16 hi + lo, ~585 µs; TF32, ~720–880 µs) and a lane
// a column of two rows, each weight read serving both (~660 µs).
// grid (hidden / HPR_COLS parts, rows / HPR_ROWS), HPR_THREADS threads, HPR_SMEM bytes of
// dynamic shared memory.
#define HPR_THREADS 256
#define HPR_ROWS 256     // rows a block: each warp 32, 4 at a time
#define HPR_COLS 128     // columns of each stream a block's part holds
#define HPR_N 24         // V4's logits: (2 + 4) · 4
#define HPR_KCHUNKS (7 * HPR_COLS + HPR_COLS / 4)  // 16-byte chunks a stream's weights take
#define HPR_SMEM (4 * HPR_KCHUNKS * 16)
__device__ __forceinline__ int hpr_at(int k, int x) { return 4 * (k * HPR_KCHUNKS + 7 * x + (x >> 2)); }
// acc[n] += w[n] · v for a column's 24 weights (6 16-byte chunks from `w`, hpr_at's place).
__device__ __forceinline__ void hpr_add_weighted(float (&acc)[HPR_N], const float* w, float v) {
    const float4* wk = (const float4*)w;
#pragma unroll
    for (int q = 0; q < HPR_N / 4; q++) {
        const float4 wv = wk[q];
        acc[4 * q] += wv.x * v;
        acc[4 * q + 1] += wv.y * v;
        acc[4 * q + 2] += wv.z * v;
        acc[4 * q + 3] += wv.w * v;
    }
}
// A row's part sums over its 8 lanes (lanes 8 apart hold other rows), folded in a fixed
// order, written by the row's first lane (`write`) as hc_post_mix leaves them: the 24
// logits, zeros, the sum of squares `ss` (folded like them) in slot 31.
__device__ __forceinline__ void hpr_fold_store(float (&acc)[HPR_N], float ss, bool write, float* dst_row) {
#pragma unroll
    for (int m = 1; m < 8; m <<= 1) {
#pragma unroll
        for (int n = 0; n < HPR_N; n++) acc[n] += __shfl_xor_sync(0xffffffffu, acc[n], m);
        ss += __shfl_xor_sync(0xffffffffu, ss, m);
    }
    if (write) {
        float4* dst = (float4*)dst_row;
#pragma unroll
        for (int q = 0; q < HPR_N / 4; q++) dst[q] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
        dst[6] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        dst[7] = make_float4(0.0f, 0.0f, 0.0f, ss);
    }
}
template <int WT>
__device__ __forceinline__ void hc_post_mix_rows_body(float* streams, const float* src, int copies,
                                                      const float* __restrict__ out,
                                                      const float* __restrict__ post,
                                                      const float* __restrict__ comb, int rows, int d,
                                                      const void* __restrict__ w, float* __restrict__ partials) {
    extern __shared__ __align__(16) float hpr_w[];
    const int part = blockIdx.x, parts = gridDim.x, x0 = part * HPR_COLS;
    const long long K = 4LL * d;
    // The part's weights (static: read before waiting for the kernel before), coalesced
    // along the columns.
    for (int e = threadIdx.x; e < HPR_N * 4 * HPR_COLS; e += HPR_THREADS) {
        const int x = e % HPR_COLS, nk = e / HPR_COLS, k = nk % 4, n = nk / 4;
        const long long at = n * K + (long long)k * d + x0 + x;
        hpr_w[hpr_at(k, x) + n] = WT == 0 ? ((const float*)w)[at] : bf2f(((const u16*)w)[at]);
    }
    __syncthreads();
    // The next kernel (the rows' finish) is let in only as blocks finish (below): placed
    // early, its waiting blocks held registers this kernel's later blocks needed.
    pdl_wait();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane >> 3, col = 4 * (lane & 7);
    const int rbeg = blockIdx.y * HPR_ROWS + warp * 32, rend = min(rows, rbeg + 32);
    // A row's post and comb, and a step's values (4 columns of each stream of row r from
    // column xs of the part, and the sub-block output's): each step's loads are issued
    // before the step before is computed (the next rows' post and comb after the last
    // step, under the fold of the row's sums), so a warp has the next step's bytes in
    // flight while it computes. Loading at the top of each step left the warp with
    // nothing in flight for its ~650 instructions, and the kernel ran at about half the
    // copy bandwidth.
    auto load_mix = [&](int r, float (&p)[4], float (&c)[16]) {
        const bool live = r < rend;
#pragma unroll
        for (int k = 0; k < 4; k++) p[k] = live ? post[(long long)r * 4 + k] : 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) c[i] = live ? comb[(long long)r * 16 + i] : 0.0f;
    };
    // The streams before the update: `streams` itself, or with `copies` the rows of `src`
    // (`[rows, d]`), every stream of a row that row (the embedding's copies, never made).
    const long long src_row = copies ? d : K, src_stream = copies ? 0 : d;
    auto load_step = [&](int r, int xs, float (&a)[4][4], float (&ob)[4]) {
        if (r < rend) {
            const float* s = src + (long long)r * src_row + x0 + col + xs;
#pragma unroll
            for (int k = 0; k < 4; k++) *(float4*)&a[k][0] = *(const float4*)(s + k * src_stream);
            *(float4*)&ob[0] = __ldg((const float4*)(out + (long long)r * d + x0 + col + xs));
        }
    };
    float p[4], c[16], a[4][4], ob[4];
    if (rbeg < rend) {
        load_mix(rbeg + sub, p, c);
        load_step(rbeg + sub, 0, a, ob);
    }
    for (int r0 = rbeg; r0 < rend; r0 += 4) {
        const int r = r0 + sub;
        const bool live = r < rend;
        float acc[HPR_N], ss = 0.0f;
#pragma unroll
        for (int n = 0; n < HPR_N; n++) acc[n] = 0.0f;
        float* s = streams + (long long)r * K + x0 + col;
#pragma unroll 1
        for (int xs = 0; xs < HPR_COLS; xs += 32) {
            const bool last = xs + 32 == HPR_COLS;
            float na[4][4], nob[4];
            load_step(last ? r + 4 : r, last ? 0 : xs + 32, na, nob);
            if (live) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float old[4] = {a[0][i], a[1][i], a[2][i], a[3][i]};
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        const float v = hc_post_value(p[k], ob[i], c + k, 4, old, 4);
                        a[k][i] = v;
                        ss += v * v;
                        hpr_add_weighted(acc, hpr_w + hpr_at(k, xs + col + i), v);
                    }
                }
#pragma unroll
                for (int k = 0; k < 4; k++) *(float4*)(s + (long long)k * d + xs) = *(const float4*)&a[k][0];
            }
#pragma unroll
            for (int k = 0; k < 4; k++)
#pragma unroll
                for (int i = 0; i < 4; i++) a[k][i] = na[k][i];
#pragma unroll
            for (int i = 0; i < 4; i++) ob[i] = nob[i];
        }
        // The next rows' post and comb (this row's are done with), in flight under the fold.
        load_mix(r + 4, p, c);
        // The row's 8 lanes' sums, folded in a fixed order; its first lane writes them.
        hpr_fold_store(acc, ss, live && col == 0, partials + ((long long)r * parts + part) * HC_MIX_SLOTS);
    }
    pdl_launch_dependents();
}
extern "C" __global__ void __launch_bounds__(HPR_THREADS, 2)
    hc_post_mix_rows_f32(float* streams, const float* src, int copies, const float* out, const float* post,
                         const float* comb, int rows, int d, const void* w, float* partials) {
    hc_post_mix_rows_body<0>(streams, src, copies, out, post, comb, rows, d, w, partials);
}
extern "C" __global__ void __launch_bounds__(HPR_THREADS, 2)
    hc_post_mix_rows_bf16(float* streams, const float* src, int copies, const float* out, const float* post,
                          const float* comb, int rows, int d, const void* w, float* partials) {
    hc_post_mix_rows_body<1>(streams, src, copies, out, post, comb, rows, d, w, partials);
}

// The mixing product of a step's first sub-block for a prefill's rows, whose 4 streams
// are copies of the row (the embedding; hc.rs `pre_of_copies`): the product of the
// copies is Σ_k W[n, k·d + c] · x[c] = x[c] · Σ_k W[n, k·d + c], so a block sums its
// part's weights over the streams as it stages them (k in order) and the pass reads the
// row alone — a quarter of the bytes and of hc_post_mix_rows' products, where cuBLAS's
// product and the finish read the 4 streams' copies. Lanes, rows and weights as in
// hc_post_mix_rows (the summed weights where its stream 0's sit); the part sums go to
// partials[r, part, 32] as it leaves them, the sum of squares of the 4 copies (4 · Σ x²,
// exact) in slot 31, for hc_weights_rows.
// grid (hidden / HPR_COLS parts, rows / HPR_ROWS), HPR_THREADS threads, HPR_SMEM bytes.
template <int WT>
__device__ __forceinline__ void hc_mix_copies_rows_body(const float* __restrict__ x, int rows, int d,
                                                        const void* __restrict__ w, float* __restrict__ partials) {
    extern __shared__ __align__(16) float hpr_w[];
    const int part = blockIdx.x, parts = gridDim.x, x0 = part * HPR_COLS;
    const long long K = 4LL * d;
    for (int e = threadIdx.x; e < HPR_N * HPR_COLS; e += HPR_THREADS) {
        const int c = e % HPR_COLS, n = e / HPR_COLS;
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const long long at = n * K + (long long)k * d + x0 + c;
            sum += WT == 0 ? ((const float*)w)[at] : bf2f(((const u16*)w)[at]);
        }
        hpr_w[hpr_at(0, c) + n] = sum;
    }
    __syncthreads();
    pdl_wait();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane >> 3, col = 4 * (lane & 7);
    const int rbeg = blockIdx.y * HPR_ROWS + warp * 32, rend = min(rows, rbeg + 32);
    for (int r0 = rbeg; r0 < rend; r0 += 4) {
        const int r = r0 + sub;
        const bool live = r < rend;
        float4 v[HPR_COLS / 32];
#pragma unroll
        for (int st = 0; st < HPR_COLS / 32; st++)
            v[st] = live ? __ldg((const float4*)(x + (long long)r * d + x0 + col + 32 * st))
                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float acc[HPR_N], ss = 0.0f;
#pragma unroll
        for (int n = 0; n < HPR_N; n++) acc[n] = 0.0f;
#pragma unroll
        for (int st = 0; st < HPR_COLS / 32; st++) {
            const float vals[4] = {v[st].x, v[st].y, v[st].z, v[st].w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float val = vals[i];
                ss += val * val;
                hpr_add_weighted(acc, hpr_w + hpr_at(0, 32 * st + col + i), val);
            }
        }
        // The copies' sum of squares: 4 times the row's (exact).
        hpr_fold_store(acc, 4.0f * ss, live && col == 0, partials + ((long long)r * parts + part) * HC_MIX_SLOTS);
    }
    pdl_launch_dependents();
}
extern "C" __global__ void __launch_bounds__(HPR_THREADS)
    hc_mix_copies_rows_f32(const float* x, int rows, int d, const void* w, float* partials) {
    hc_mix_copies_rows_body<0>(x, rows, d, w, partials);
}
extern "C" __global__ void __launch_bounds__(HPR_THREADS)
    hc_mix_copies_rows_bf16(const float* x, int rows, int d, const void* w, float* partials) {
    hc_mix_copies_rows_body<1>(x, rows, d, w, partials);
}
