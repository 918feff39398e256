// Routed BF16 experts of a decode batch as cuBLAS batched products (moe_cublas.rs): each
// expert gets a slot of R rows (R bounds the rows any expert receives), its routed rows
// gathered there in list order and the rest zero; split activations stack hi rows
// (0..R) over lo rows (R..2R) so one product per expert streams its weight once. Slots
// are [n_exp, 2R, width]; `counts` and `offsets` are moe_lists' (rows per expert, first
// list position), `list_rows` the row of each list position.

// Element i of n_exp slots of R rows × width: its expert e, slot row s and column c.
struct SlotAt {
    int e, s, c;
};
__device__ __forceinline__ SlotAt slot_at(long long i, int slot_rows, int width) {
    return SlotAt{(int)(i / ((long long)width * slot_rows)), (int)((i / width) % slot_rows), (int)(i % width)};
}

// x[rows, d] f32 → xs[n_exp, 2R, d] bf16 hi / lo halves of each expert's rows.
extern "C" __global__ void moe_slots_split(u16* xs, const float* x, const int* counts, const int* offsets,
                                           const int* list_rows, int n_exp, int slot_rows, int d) {
    pdl_begin();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_exp * slot_rows * d) return;
    const auto [e, s, c] = slot_at(i, slot_rows, d);
    float v = 0.0f;
    if (s < counts[e]) v = x[(long long)list_rows[offsets[e] + s] * d + c];
    const u16 h = f2bf(v);
    const long long at = ((long long)e * 2 * slot_rows + s) * d + c;
    xs[at] = h;
    xs[at + (long long)slot_rows * d] = f2bf(v - bf2f(h));
}

// gu = [2][n_exp, 2R, inter] f32 (gate products, then up products, hi and lo halves):
// h = silu(min(gate, limit)) · clamp(up, ±limit) per routed slot row, written as the down
// product's split activations hs[n_exp, 2R, inter] (rows past the count zero).
extern "C" __global__ void moe_slots_swiglu(u16* hs, const float* gu, const int* counts, int n_exp,
                                            int slot_rows, int inter, float limit) {
    pdl_begin();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long per_expert = (long long)slot_rows * inter;
    if (i >= n_exp * per_expert) return;
    const auto [e, s, c] = slot_at(i, slot_rows, inter);
    const long long at = ((long long)e * 2 * slot_rows + s) * inter + c;
    const long long lo = (long long)slot_rows * inter;
    float h = 0.0f;
    if (s < counts[e]) {
        const float* up = gu + (long long)n_exp * 2 * per_expert;
        const float a = fminf(gu[at] + gu[at + lo], limit);
        const float b = fminf(fmaxf(up[at] + up[at + lo], -limit), limit);
        h = a / (1.0f + expf(-a)) * b;
    }
    const u16 hh = f2bf(h);
    hs[at] = hh;
    hs[at + lo] = f2bf(h - bf2f(hh));
}

// ys[n_exp, 2R, d] f32 (down products, hi and lo halves) → y[n, d] in list order.
extern "C" __global__ void moe_slots_out(float* y, const float* ys, const int* counts, const int* offsets,
                                         int n_exp, int slot_rows, int d) {
    pdl_begin();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_exp * slot_rows * d) return;
    const auto [e, s, c] = slot_at(i, slot_rows, d);
    if (s >= counts[e]) return;
    const long long at = ((long long)e * 2 * slot_rows + s) * d + c;
    y[(long long)(offsets[e] + s) * d + c] = ys[at] + ys[at + (long long)slot_rows * d];
}
