// Greedy readout of a step's logits: per row of logits[rows, vocab], the token the host's
// greedy sampler picks and its log-probability, so a greedy sequence's step reads back
// 8 bytes instead of its vocab's logits (516 KB a row for V4).
//
// The token is the first index of the largest value, NaN values skipped (the host's
// `argmax` walks the row keeping the first strict maximum; a row that starts with NaN
// keeps index 0). The log-probability is the host's `log_softmax` at that index:
// l - m - ln Σ exp(l_j - m) with m the largest non-NaN value, each difference and the
// sum in f64 (an f64 sum in another order differs from the host's by far less than an
// f32 step).
//
// Two launches, so a row is read by many SMs (one block a row took 24 µs for a 32K
// vocabulary at batch 1, most of it one SM's f64 exponentials): `greedy_parts` gives
// each block (part, row) a contiguous slice of the row and writes the slice's best
// (value, index) and Σ exp(l_j - m_part) (f64); `greedy_finish` (a warp a row) takes the
// best over the parts (larger value, then smaller index: the first maximum of the row),
// rescales each part's sum to the row's maximum, Σ_p s_p · exp(m_p - m), and writes
// out[2r] the token, out[2r + 1] the log-probability's f32 bits.

// The better of two (value, index) candidates: larger value, then smaller index.
__device__ __forceinline__ void rd_better(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

// One part's result: best value and index, and the sum of exponentials below it.
struct GreedyPart {
    float best;
    int at;
    double sum;
};

__device__ __forceinline__ void rd_warp_best(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        rd_better(v, i, v2, i2);
    }
}

// grid (parts, rows), 256 threads; part p covers [p·span, min((p + 1)·span, vocab)).
extern "C" __global__ void __launch_bounds__(256) greedy_parts(const float* logits, int vocab, int span,
                                                               GreedyPart* parts) {
    pdl_begin();
    __shared__ float s_v[8];
    __shared__ int s_i[8];
    __shared__ double s_sum[8];
    const int p = blockIdx.x, r = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* x = logits + (long long)r * vocab;
    const int lo = p * span, hi = min(lo + span, vocab);
    float best = NEG_INF;
    int at = 0x7fffffff;
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) rd_better(best, at, x[j], j);
    rd_warp_best(best, at);
    if (lane == 0) {
        s_v[warp] = best;
        s_i[warp] = at;
    }
    __syncthreads();
    best = NEG_INF;
    at = 0x7fffffff;
    for (int w = 0; w < 8; w++) rd_better(best, at, s_v[w], s_i[w]);
    // A slice of -inf (and NaN) values has no finite maximum: its -inf values add 0 (as
    // they do below a finite one), its NaN values NaN.
    const double m = (double)best;
    double sum = 0.0;
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const float v = x[j];
        if (v != NEG_INF) sum += exp((double)v - m);
    }
    sum = warp_sum(sum);
    if (lane == 0) s_sum[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < 8; w++) total += s_sum[w];
        parts[(long long)r * gridDim.x + p] = GreedyPart{best, at, total};
    }
}

// grid rows, 32 threads: the row's token and log-probability from its `n_parts` parts.
extern "C" __global__ void __launch_bounds__(32) greedy_finish(const float* logits, int vocab,
                                                               const GreedyPart* parts, int n_parts, u32* out) {
    pdl_begin();
    const int r = blockIdx.x, lane = threadIdx.x;
    const GreedyPart* row = parts + (long long)r * n_parts;
    float best = NEG_INF;
    int at = 0x7fffffff;
    for (int p = lane; p < n_parts; p += 32) rd_better(best, at, row[p].best, row[p].at);
    rd_warp_best(best, at);
    const double m = (double)best;
    double total = 0.0;
    for (int p = lane; p < n_parts; p += 32) {
        // A part without a finite maximum adds its sum as it is (0, or NaN).
        const GreedyPart q = row[p];
        total += q.best == NEG_INF ? q.sum : q.sum * exp((double)q.best - m);
    }
    total = warp_sum(total);
    if (lane == 0) {
        const float* x = logits + (long long)r * vocab;
        // Every value NaN or -inf: the host keeps index 0; so does a row starting with NaN.
        const int token = (isnan(x[0]) || at == 0x7fffffff) ? 0 : at;
        const float lp = (float)((double)x[token] - m - log(total));
        out[2 * r] = (u32)token;
        out[2 * r + 1] = __float_as_uint(lp);
    }
}
