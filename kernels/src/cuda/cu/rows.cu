// Row-wise ops: embedding gather, row gather, RMSNorm, RoPE, scaling, bf16 rounding,
// and the activation split used by tensor-core products.

extern "C" __global__ void embed_f32(float* out, const float* table, const u32* tokens, int rows, int cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    int r = (int)(i / cols), c = (int)(i % cols);
    out[i] = table[(long long)tokens[r] * cols + c];
}

extern "C" __global__ void embed_bf16(float* out, const u16* table, const u32* tokens, int rows, int cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    int r = (int)(i / cols), c = (int)(i % cols);
    out[i] = bf2f(table[(long long)tokens[r] * cols + c]);
}

extern "C" __global__ void gather_rows(float* out, const float* src, const u32* idx, int rows, int width) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * width) return;
    int r = (int)(i / width), c = (int)(i % width);
    out[i] = src[(long long)idx[r] * width + c];
}

// One block per row: x * rsqrt(mean(x²) + eps), times weight when given.
extern "C" __global__ void rms_norm(float* x, const float* weight, int dim, float eps) {
    float* row = x + (long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += row[c] * row[c];
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float v = row[c] * inv;
        row[c] = weight ? weight[c] * v : v;
    }
}

// x[rows, heads, head_dim]: one thread per (row, head, pair) of the last 2*pairs dims.
extern "C" __global__ void rope(float* x, const u32* positions, int rows, int heads, int head_dim, RopeParams p,
                                int inverse) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)rows * heads * p.pairs;
    if (i >= total) return;
    int j = (int)(i % p.pairs);
    long long rh = i / p.pairs;
    int r = (int)(rh / heads);
    float* head = x + rh * head_dim + (head_dim - 2 * p.pairs);
    rope_pair(&head[2 * j], &head[2 * j + 1], (float)positions[r], p.inv_freq[j], p.attention_factor, inverse != 0);
}

extern "C" __global__ void scale_f32(float* x, long long n, float f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= f;
}

extern "C" __global__ void round_to_bf16(float* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = round_bf16(x[i]);
}

// x[rows, dim] -> each row as an fp8 entry reads back (one warp per row: the block
// scales are warp reductions), so attention over this step's rows sees what the ring
// and pages will hold.
extern "C" __global__ void round_to_fp8(float* x, int rows, int dim, int tail) {
    const long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    if (r >= rows) return;
    entry_store_warp(x + r * dim, nullptr, x + r * dim, DTYPE_FP8, dim, tail, 0);
}

// x[rows, k] -> hi[rows, k] = bf16(x), lo[rows, k] = bf16(x - hi): two bf16 operands
// whose sum carries ~16 mantissa bits, so bf16 tensor-core products of each against
// bf16 weights, accumulated, come close to the f32 product.
extern "C" __global__ void split_bf16(u16* hi, u16* lo, const float* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    u16 h = f2bf(v);
    hi[i] = h;
    lo[i] = f2bf(v - bf2f(h));
}

// Dequantise FP8 e4m3 weights [rows, cols] with one f32 scale per 128x128 block to bf16.
extern "C" __global__ void fp8_to_bf16(u16* out, const u8* q, const float* scales, int rows, int cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    int r = (int)(i / cols), c = (int)(i % cols);
    int sc = (cols + 127) / 128;
    out[i] = f2bf(fp8_to_f32(q[i]) * scales[(r / 128) * sc + c / 128]);
}

extern "C" __global__ void embed_fp8(float* out, const u8* q, const float* scales, const u32* tokens, int rows,
                                     int cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    int r = (int)(i / cols), c = (int)(i % cols);
    long long t = tokens[r];
    out[i] = fp8_to_f32(q[t * cols + c]) * scales[(t / 128) * ((cols + 127) / 128) + c / 128];
}
