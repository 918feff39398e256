// Greedy readout of a step's logits: per row of logits[rows, vocab], the token the host's
// greedy sampler picks and its log-probability, so a greedy sequence's step reads back
// 8 bytes instead of its vocab's logits (516 KB a row for V4).
//
// The token is the first index of the largest value, NaN values skipped (the host's
// `argmax` walks the row keeping the first strict maximum; a row that starts with NaN
// keeps index 0). The log-probability is the host's `log_softmax` at that index:
// l - m - ln Σ exp(l_j - m) with m the largest non-NaN value, each difference and the
// sum in f64 (an f64 sum in another order differs from the host's by far less than an
// f32 step). One block of 1,024 threads a row; out[2r] the token, out[2r + 1] the
// log-probability's f32 bits.

// The better of two (value, index) candidates: larger value, then smaller index.
__device__ __forceinline__ void rd_better(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

extern "C" __global__ void __launch_bounds__(1024) greedy_rows(const float* logits, int vocab, u32* out) {
    pdl_begin();
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    __shared__ double s_sum[32];
    const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* x = logits + (long long)r * vocab;
    float best = NEG_INF;
    int at = 0x7fffffff;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) rd_better(best, at, x[j], j);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, best, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, at, o);
        rd_better(best, at, v2, i2);
    }
    if (lane == 0) {
        s_v[warp] = best;
        s_i[warp] = at;
    }
    __syncthreads();
    best = NEG_INF;
    at = 0x7fffffff;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) rd_better(best, at, s_v[w], s_i[w]);
    // Every value NaN or -inf: the host keeps index 0; so does a row starting with NaN.
    const int token = (isnan(x[0]) || at == 0x7fffffff) ? 0 : at;
    const double m = (double)best;
    double sum = 0.0;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) sum += exp((double)x[j] - m);
    sum = warp_sum(sum);
    if (lane == 0) s_sum[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) total += s_sum[w];
        const float lp = (float)((double)x[token] - m - log(total));
        out[2 * r] = (u32)token;
        out[2 * r + 1] = __float_as_uint(lp);
    }
}
