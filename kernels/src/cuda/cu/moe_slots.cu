// Routed BF16 experts of a decode batch as cuBLAS batched products (moe_cublas.rs): each
// expert gets a slot of R rows (R bounds the rows any expert receives), its routed rows
// gathered there in list order and the rest zero. With bf16 activations (the reference's)
// a row is its bf16 rounding (`halves` 1); split activations (`halves` 2) stack hi rows
// (0..R) over lo rows (R..2R) so one product per expert streams its weight once. Slots
// are [n_exp, halves·R, width]; `counts` and `offsets` are moe_lists' (rows per expert,
// first list position), `list_rows` the row of each list position.

// Four columns a thread (widths are multiples of 4, moe_cublas.rs checks): 16-byte loads
// of f32, 8-byte stores of bf16. A thread an element took ~7 µs a launch at batch 32 on
// flash-bench (4,096 blocks, a 2-byte store each).
#define SLOT_VEC 4

// Group i of n_exp slots of R rows × width / 4 groups of 4 columns: its expert e, slot
// row s and first column c.
struct SlotAt {
    int e, s, c;
};
__device__ __forceinline__ SlotAt slot_at(long long i, int slot_rows, int width) {
    const int groups = width / SLOT_VEC;
    return SlotAt{(int)(i / ((long long)groups * slot_rows)), (int)((i / groups) % slot_rows),
                  (int)(i % groups) * SLOT_VEC};
}

// Four values as bf16 (round to nearest even) in one 8-byte word; `v` keeps what the
// rounding left.
__device__ __forceinline__ uint2 slot_bf16x4(float4& v) {
    const u16 a = f2bf(v.x), b = f2bf(v.y), c = f2bf(v.z), d = f2bf(v.w);
    v = make_float4(v.x - bf2f(a), v.y - bf2f(b), v.z - bf2f(c), v.w - bf2f(d));
    return make_uint2((u32)a | ((u32)b << 16), (u32)c | ((u32)d << 16));
}

// x[rows, d] f32 → xs[n_exp, halves·R, d] bf16: each expert's rows rounded (and with
// halves 2 what the rounding left below them).
extern "C" __global__ void moe_slots_split(u16* xs, const float* x, const int* counts, const int* offsets,
                                           const int* list_rows, int n_exp, int slot_rows, int d, int halves) {
    pdl_begin();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_exp * slot_rows * (d / SLOT_VEC)) return;
    const auto [e, s, c] = slot_at(i, slot_rows, d);
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (s < counts[e]) v = *(const float4*)(x + (long long)list_rows[offsets[e] + s] * d + c);
    const long long at = ((long long)e * halves * slot_rows + s) * d + c;
    *(uint2*)(xs + at) = slot_bf16x4(v);
    if (halves == 2) *(uint2*)(xs + at + (long long)slot_rows * d) = slot_bf16x4(v);
}

// SwiGLU of one value pair.
__device__ __forceinline__ float slot_swiglu(float gate, float up, float limit) {
    const float a = fminf(gate, limit);
    const float b = fminf(fmaxf(up, -limit), limit);
    return a / (1.0f + expf(-a)) * b;
}

// gu = [2][n_exp, halves·R, inter] f32 (gate products, then up products, of each half):
// h = silu(min(gate, limit)) · clamp(up, ±limit) per routed slot row, written as the down
// product's activations hs[n_exp, halves·R, inter] as x was (rows past the count zero).
extern "C" __global__ void moe_slots_swiglu(u16* hs, const float* gu, const int* counts, int n_exp,
                                            int slot_rows, int inter, float limit, int halves) {
    pdl_begin();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long per_expert = (long long)slot_rows * inter;
    if (i >= n_exp * per_expert / SLOT_VEC) return;
    const auto [e, s, c] = slot_at(i, slot_rows, inter);
    const long long at = ((long long)e * halves * slot_rows + s) * inter + c;
    const long long lo = (long long)slot_rows * inter;
    float4 h = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (s < counts[e]) {
        const float* up = gu + (long long)n_exp * halves * per_expert;
        float4 g = *(const float4*)(gu + at), u = *(const float4*)(up + at);
        if (halves == 2) {
            const float4 g2 = *(const float4*)(gu + at + lo), u2 = *(const float4*)(up + at + lo);
            g = make_float4(g.x + g2.x, g.y + g2.y, g.z + g2.z, g.w + g2.w);
            u = make_float4(u.x + u2.x, u.y + u2.y, u.z + u2.z, u.w + u2.w);
        }
        h = make_float4(slot_swiglu(g.x, u.x, limit), slot_swiglu(g.y, u.y, limit), slot_swiglu(g.z, u.z, limit),
                        slot_swiglu(g.w, u.w, limit));
    }
    *(uint2*)(hs + at) = slot_bf16x4(h);
    if (halves == 2) *(uint2*)(hs + at + lo) = slot_bf16x4(h);
}

// ys[n_exp, halves·R, d] f32 (down products of each half) → y[n, d] in list order.
extern "C" __global__ void moe_slots_out(float* y, const float* ys, const int* counts, const int* offsets,
                                         int n_exp, int slot_rows, int d, int halves) {
    pdl_begin();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_exp * slot_rows * (d / SLOT_VEC)) return;
    const auto [e, s, c] = slot_at(i, slot_rows, d);
    if (s >= counts[e]) return;
    const long long at = ((long long)e * halves * slot_rows + s) * d + c;
    float4 v = *(const float4*)(ys + at);
    if (halves == 2) {
        const float4 w = *(const float4*)(ys + at + (long long)slot_rows * d);
        v = make_float4(v.x + w.x, v.y + w.y, v.z + w.z, v.w + w.w);
    }
    *(float4*)(y + (long long)(offsets[e] + s) * d + c) = v;
}
