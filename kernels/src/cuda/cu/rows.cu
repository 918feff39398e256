// Row-wise ops: embedding gather, row gather, RMSNorm, RoPE, scaling, bf16 rounding,
// and the activation split used by tensor-core products.

extern "C" __global__ void embed_f32(float* out, const float* table, const u32* tokens, int rows, int cols) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    int r = (int)(i / cols), c = (int)(i % cols);
    out[i] = table[(long long)tokens[r] * cols + c];
}

extern "C" __global__ void embed_bf16(float* out, const u16* table, const u32* tokens, int rows, int cols) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    int r = (int)(i / cols), c = (int)(i % cols);
    out[i] = bf2f(table[(long long)tokens[r] * cols + c]);
}

// embed_bf16 eight columns a thread (cols a multiple of 8): a block's threads share a row
// (grid (rows, ceil(cols / 8 / blockDim))), a 16-byte load and two 16-byte stores each
// (a value a thread was ~160 µs of an 8K prefill, three times its bytes' time).
extern "C" __global__ void embed_bf16_8(float* out, const u16* table, const u32* tokens, int rows, int cols) {
    pdl_begin();
    const int r = blockIdx.x, c8 = blockIdx.y * blockDim.x + threadIdx.x;
    if (r >= rows || 8 * c8 >= cols) return;
    const uint4 v = reinterpret_cast<const uint4*>(table + (long long)tokens[r] * cols)[c8];
    float4* o = reinterpret_cast<float4*>(out + (long long)r * cols) + 2 * c8;
    o[0] = make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xffff0000u));
    o[1] = make_float4(__uint_as_float(v.z << 16), __uint_as_float(v.z & 0xffff0000u), __uint_as_float(v.w << 16),
                       __uint_as_float(v.w & 0xffff0000u));
}

extern "C" __global__ void gather_rows(float* out, const float* src, const u32* idx, int rows, int width) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * width) return;
    int r = (int)(i / width), c = (int)(i % width);
    // An empty list entry (0xffffffff: moe_lists under expert parallelism) is a zero row.
    const u32 from = idx[r];
    out[i] = from == 0xffffffffu ? 0.0f : src[(long long)from * width + c];
}

// gather_rows four values a thread (width a multiple of 4, 16-byte aligned rows): a
// block's threads share an output row (grid (rows, ceil(width / 4 / blockDim))), so no
// 64-bit division a value and 16-byte accesses (an 8K prefill's copy of the embedding
// into its 4 streams, 512 MB written, ran at ~25% of the copy bandwidth a value a thread).
extern "C" __global__ void gather_rows4(float* out, const float* src, const u32* idx, int rows, int width) {
    pdl_begin();
    const int r = blockIdx.x, c4 = blockIdx.y * blockDim.x + threadIdx.x;
    if (r >= rows || 4 * c4 >= width) return;
    const u32 from = idx[r];
    reinterpret_cast<float4*>(out + (long long)r * width)[c4] =
        from == 0xffffffffu ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                            : reinterpret_cast<const float4*>(src + (long long)from * width)[c4];
}

// One block per row: x * rsqrt(mean(x²) + eps), times weight when given.
extern "C" __global__ void rms_norm(float* x, const float* weight, int dim, float eps) {
    pdl_begin();
    block_rms_norm_row(x + (long long)blockIdx.x * dim, weight, dim, eps);
}

// x[rows, heads, head_dim]: one thread per (row, head, pair) of the last 2*pairs dims.
extern "C" __global__ void rope(float* x, const u32* positions, int rows, int heads, int head_dim, RopeParams p,
                                int inverse) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)rows * heads * p.pairs;
    if (i >= total) return;
    int j = (int)(i % p.pairs);
    long long rh = i / p.pairs;
    int r = (int)(rh / heads);
    float* head = x + rh * head_dim + (head_dim - 2 * p.pairs);
    rope_pair(&head[2 * j], &head[2 * j + 1], (float)positions[r], p.inv_freq[j], p.attention_factor, inverse != 0);
}

// RMSNorm of each head (times `weight` when given), RoPE on its last 2·pairs values,
// then, for round_dtype DTYPE_BF16 / DTYPE_FP8, the values an entry of that format reads
// back (round_to): what a layer's q and new KV entry go through, in one pass instead of
// three launches (each ~3 µs at decode sizes, latency, not bytes). A warp per (row,
// head); head_dim = 128·V with V ≤ HNR_MAX_V, lane l holding the 16-byte chunks l + 32·i.
// An FP8 block (FP8_BLOCK = 64 values) is chunk i of one half-warp, so its scale is a
// 16-lane maximum; the host checks that the FP8 part is whole blocks.
#define HNR_MAX_V 8
// Head w (row w / heads) of x by the calling warp.
__device__ __forceinline__ void hnr_head(float* x, const float* weight, const u32* positions, long long w, int heads,
                                         int head_dim, float eps, const RopeParams& p, int round_dtype, int tail) {
    const int lane = threadIdx.x & 31, V = head_dim >> 7;
    float4* h = reinterpret_cast<float4*>(x + w * head_dim);
    const float4* w4 = reinterpret_cast<const float4*>(weight);
    float4 v[HNR_MAX_V];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < HNR_MAX_V; i++)
        if (i < V) {
            v[i] = h[lane + 32 * i];
            ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
        }
    const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)head_dim + eps);
    const float pos = (float)positions[w / heads];
    const int r0 = head_dim - 2 * p.pairs, n8 = head_dim - tail;
#pragma unroll
    for (int i = 0; i < HNR_MAX_V; i++) {
        if (i >= V) break;
        const int c = lane + 32 * i, d0 = 4 * c;
        float4 a = rms_scale4(v[i], inv, w4, c);
        if (d0 >= r0) rope_pair(&a.x, &a.y, pos, p.inv_freq[(d0 - r0) >> 1], p.attention_factor, false);
        if (d0 + 2 >= r0) rope_pair(&a.z, &a.w, pos, p.inv_freq[(d0 + 2 - r0) >> 1], p.attention_factor, false);
        if (round_dtype == DTYPE_FP8) {
            // Every lane takes part in the half-warp maximum; lanes past the FP8 part
            // (the BF16 tail) do not use it.
            float m = fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w)));
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            if (d0 < n8) {
                const float scale = ue8m0_scale(fp8_scale_byte(m));
                a.x = fp8_to_f32(f2fp8(__fdiv_rn(a.x, scale))) * scale;
                a.y = fp8_to_f32(f2fp8(__fdiv_rn(a.y, scale))) * scale;
                a.z = fp8_to_f32(f2fp8(__fdiv_rn(a.z, scale))) * scale;
                a.w = fp8_to_f32(f2fp8(__fdiv_rn(a.w, scale))) * scale;
            }
        }
        if (round_dtype == DTYPE_BF16 || (round_dtype == DTYPE_FP8 && d0 >= n8)) {
            a.x = round_bf16(a.x);
            a.y = round_bf16(a.y);
            a.z = round_bf16(a.z);
            a.w = round_bf16(a.w);
        }
        h[c] = a;
    }
}

extern "C" __global__ void head_norm_rope(float* x, const float* weight, const u32* positions, int rows, int heads,
                                          int head_dim, float eps, RopeParams p, int round_dtype, int tail) {
    pdl_begin();
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    if (w >= (long long)rows * heads) return;  // whole warps: blockDim.x is a multiple of 32
    hnr_head(x, weight, positions, w, heads, head_dim, eps, p, round_dtype, tail);
}

// head_norm_rope of two tensors at the same positions with the same RoPE in one launch
// (a layer's q heads, then its new KV entry: two one-warp-a-head kernels of ~4-6 µs a
// decode step each): the first rows·heads warps take x, the next rows·heads2 x2.
extern "C" __global__ void head_norm_rope2(float* x, const float* weight, int heads, int round_dtype, int tail,
                                           float* x2, const float* weight2, int heads2, int round_dtype2, int tail2,
                                           const u32* positions, int rows, int head_dim, float eps, RopeParams p) {
    pdl_begin();
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP, n1 = (long long)rows * heads;
    if (w < n1) {
        hnr_head(x, weight, positions, w, heads, head_dim, eps, p, round_dtype, tail);
    } else if (w - n1 < (long long)rows * heads2) {
        hnr_head(x2, weight2, positions, w - n1, heads2, head_dim, eps, p, round_dtype2, tail2);
    }
}

extern "C" __global__ void scale_f32(float* x, long long n, float f) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= f;
}

extern "C" __global__ void round_to_bf16(float* x, long long n) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = round_bf16(x[i]);
}

// x[rows, dim] -> each row as an fp8 entry reads back (one warp per row: the block
// scales are warp reductions), so attention over this step's rows sees what the ring
// and pages will hold.
// A warp per (row, FP8 block) and one per row's bf16 tail: a warp per row walked its
// blocks one after another, each waiting on its loads (x is written in place, so the
// loads of the next block could not be issued early), ~7 µs for one 512-wide row.
extern "C" __global__ void round_to_fp8(float* x, int rows, int dim, int tail) {
    pdl_begin();
    const int n8 = dim - tail, nb = (n8 + FP8_BLOCK - 1) / FP8_BLOCK;
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    if (w >= (long long)rows * (nb + 1)) return;
    float* row = x + (w / (nb + 1)) * dim;
    const int b = (int)(w % (nb + 1));
    if (b < nb) {
        entry_fp8_block_warp(row, nullptr, row, n8, tail, b);
        return;
    }
    entry_fp8_tail_warp(row, nullptr, row, n8, tail, 0);
}

extern "C" __global__ void embed_fp8(float* out, const u8* q, const float* scales, const u32* tokens, int rows,
                                     int cols) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    int r = (int)(i / cols), c = (int)(i % cols);
    long long t = tokens[r];
    out[i] = fp8_to_f32(q[t * cols + c]) * scales[(t / 128) * ((cols + 127) / 128) + c / 128];
}

extern "C" __global__ void embed_fp4(float* out, const u8* packed, const u8* scales, const u32* tokens, int rows,
                                     int cols) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    int r = (int)(i / cols), c = (int)(i % cols);
    long long t = tokens[r];
    const u8 byte = packed[(t * cols + c) / 2];
    out[i] = e2m1_to_f32(c % 2 == 0 ? byte : byte >> 4) * ue8m0_scale(scales[t * ((cols + 31) / 32) + c / 32]);
}
