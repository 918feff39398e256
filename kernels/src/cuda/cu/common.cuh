// Shared helpers for every sluice kernel. The sources are concatenated into one NVRTC
// program (no include paths needed), so nothing here may assume a CUDA header.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32
#define NEG_INF (__int_as_float(0xff800000))

// Programmatic dependent launch (sm_90+; no-ops before). Every kernel is launched so that
// it may be placed on the SMs while the kernel before it in the stream is finishing
// (runtime.rs, `Gpu::launch_raw`), so every kernel starts with `pdl_begin()`, or calls
// `pdl_wait()` before it touches memory an earlier kernel writes or reads: the wait returns
// once the previous kernel has completed and its writes are visible. Waiting in every
// kernel is also what keeps the chain transitive (a kernel that did not wait could finish
// before its predecessor, and its successor would then not wait for that one).
// `pdl_launch_dependents()` lets the next kernel be placed once every block of this one
// has started (or left).
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Wait for the kernels before, then let the next one be placed.
__device__ __forceinline__ void pdl_begin() {
    pdl_wait();
    pdl_launch_dependents();
}

// bf16 <-> f32. Round to nearest even, NaN kept quiet: the same bits as the `half`
// crate produces on the CPU, so values stored on either device are interchangeable.
__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}
__device__ __forceinline__ float round_bf16(float f) { return bf2f(f2bf(f)); }
// Two f32 as a bf16 pair in one instruction, rounded to nearest even (f2bf's bits for
// finite values): `lo` in the low half.
__device__ __forceinline__ u32 bf16x2_rn(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// FP8 e4m3fn (no infinities; NaN is never produced by checkpoints we load).
__device__ __forceinline__ float fp8_to_f32(u32 b) {
    u32 s = (b & 0x80u) << 24;
    u32 e = (b >> 3) & 0xfu;
    u32 m = b & 7u;
    float v = e == 0 ? (float)m * (1.0f / 512.0f) : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return __uint_as_float(__float_as_uint(v) | s);
}

// Bytes 2h, 2h + 1 of a u32 of e4m3 codes as a bf16 pair (byte 2h in the low half), times
// `f`: each byte placed as sign to bit 15 and its seven other bits to 10..4 is the code's
// value times 2^-120 (e4m3's subnormals become bf16's), and one bf16x2 multiply by `f` (2^120
// times a power-of-two scale, in both halves; the -0 addend keeps -0) gives the value
// times the scale: exact when the product is a normal bf16 (3 significant bits fit 8).
// Four integer operations and a multiply for two codes where fp8_to_f32, a multiply and
// a rounding each take a dozen.
__device__ __forceinline__ u32 e4m3x2_bf16(u32 w, int h, u32 f) {
    const u32 u = __byte_perm(w, 0u, h ? 0x4342u : 0x4140u);
    const u32 v = ((u & 0x007F007Fu) << 4) | ((u & 0x00800080u) << 8);
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(f), "r"(0x80008000u));
    return r;
}

// FP4 e2m1 nibble (the low 4 bits of `nib`; bit 3 is the sign) as f32: magnitudes
// 0, 0.5, 1, 1.5, 2, 3, 4, 6. Codes 2..7 are 2^(e-1)·(1 + m/2) with e = code >> 1 and
// m = code & 1, i.e. f32 bits (code + 252) << 22; codes 0 and 1 are 0 and 0.5.
__device__ __forceinline__ float e2m1_to_f32(u32 nib) {
    const u32 m = nib & 7u;
    const u32 mag = m < 2u ? m * 0x3f000000u : (m + 252u) << 22;
    return __uint_as_float(mag | ((nib & 8u) << 28));
}

// Two f16 values packed in a u32 (low half first) as f32; exact (cvt.f32.f16 runs as a
// half-precision add on the FMA pipes, not the slow conversion unit).
__device__ __forceinline__ float f16lo_to_f32(u32 h) {
    float f;
    asm("{ .reg .b16 l, u; mov.b32 {l, u}, %1; cvt.f32.f16 %0, l; }" : "=f"(f) : "r"(h));
    return f;
}
__device__ __forceinline__ float f16hi_to_f32(u32 h) {
    float f;
    asm("{ .reg .b16 l, u; mov.b32 {l, u}, %1; cvt.f32.f16 %0, u; }" : "=f"(f) : "r"(h));
    return f;
}

// Stored FP8 / FP4 weights to f32 by bit placement, two values per 32-bit op (the ALU
// cost of decode gemv). Results are the stored values times a fixed power of two,
// folded into the block scale by the caller: FP8 e4m3 -> f16 bits sign<<15 | e,m <<7
// (value·2^-8: e4m3's bias 7 vs f16's 15; subnormals map to f16 subnormals exactly);
// FP4 e2m1 -> f16 bits sign<<15 | e,m << 9 (value·2^-14, code 1 a subnormal).
#define FP8_F16_SCALE 256.0f
#define FP4_F16_SCALE 16384.0f

// Four e4m3 codes (bytes of q, byte i = input i) -> out[0..4] (·2^-8).
__device__ __forceinline__ void fp8x4_scaled(u32 q, float* out) {
    const u32 h02 = ((q << 8) & 0x80008000u) | ((q << 7) & 0x3f803f80u);  // bytes 0, 2
    const u32 h13 = (q & 0x80008000u) | ((q >> 1) & 0x3f803f80u);         // bytes 1, 3
    out[0] = f16lo_to_f32(h02);
    out[2] = f16hi_to_f32(h02);
    out[1] = f16lo_to_f32(h13);
    out[3] = f16hi_to_f32(h13);
}

// Eight e2m1 nibbles (nibble i = input i, low nibble first) -> out[0..8] (·2^-14).
__device__ __forceinline__ void fp4x8_scaled(u32 q, float* out) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 t = q >> (4 * i);  // nibbles i and i + 4 at bits 0-3 and 16-19
        const u32 h = ((t << 9) & 0x0e000e00u) | ((t << 12) & 0x80008000u);
        out[i] = f16lo_to_f32(h);
        out[i + 4] = f16hi_to_f32(h);
    }
}

// Entry storage (pages, rings): 0 = f32, 1 = bf16, 2 = fp8 records. Offsets count
// storage elements (bytes of records for fp8), as the KV layout does.
#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_FP8 2
__device__ __forceinline__ int entry_elem_bytes(int dtype) { return dtype == DTYPE_F32 ? 4 : dtype == DTYPE_BF16 ? 2 : 1; }
__device__ __forceinline__ const u8* entry_at(const u8* base, int dtype, long long elem) {
    return base + elem * entry_elem_bytes(dtype);
}
__device__ __forceinline__ u8* entry_at(u8* base, int dtype, long long elem) {
    return base + elem * entry_elem_bytes(dtype);
}

// FP8 entry records, as kernels/src/kv_entry.rs writes them (the CPU side is the
// reference; the GPU parity tests compare bytes): for an entry of `dim` values whose last
// `tail` are kept in BF16, n8 = dim - tail FP8 e4m3fn codes (value / its 64-dim block's
// scale), then the tail as BF16, then one ue8m0 scale byte per block, zero-padded to 8
// bytes. n8 is even (asserted by the layout), so the BF16 tail is 2-byte aligned.
#define FP8_BLOCK 64
// ue8m0 byte -> scale 2^(b-127) (b = 0 is the subnormal 2^-127).
__device__ __forceinline__ float ue8m0_scale(u32 b) {
    return b == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(b << 23);
}
// The smallest power-of-two scale with amax / scale <= 448, as its ue8m0 byte: the
// ceiling of log2(amax / 448) read off the quotient's bits (IEEE division, as on the CPU).
__device__ __forceinline__ u32 fp8_scale_byte(float amax) {
    const u32 bits = __float_as_uint(__fdiv_rn(fmaxf(amax, 1e-30f), 448.0f));
    const int e = (int)((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0u ? 1 : 0);
    return (u32)min(max(e + 127, 0), 254);
}
// f32 -> e4m3fn, round to nearest even, saturating at ±448 (the hardware conversion);
// a zero result is +0 whatever the sign, as the CPU encoder writes it.
__device__ __forceinline__ u32 f2fp8(float v) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
    const u32 c = r & 0xffu;
    return (c & 0x7fu) == 0u ? 0u : c;
}

// Value d of the entry stored at `e` (pointer to its first byte).
__device__ __forceinline__ float entry_load(const u8* e, int dtype, int dim, int tail, int d) {
    if (dtype == DTYPE_F32) return ((const float*)e)[d];
    if (dtype == DTYPE_BF16) return bf2f(((const u16*)e)[d]);
    const int n8 = dim - tail;
    if (d >= n8) return bf2f(((const u16*)(e + n8))[d - n8]);
    return fp8_to_f32(e[d]) * ue8m0_scale(e[n8 + 2 * tail + d / FP8_BLOCK]);
}

// f32 and bf16 entries are stored value by value.
__device__ __forceinline__ void store_value(u8* e, int dtype, int d, float v) {
    if (dtype == DTYPE_F32) ((float*)e)[d] = v;
    else ((u16*)e)[d] = f2bf(v);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// FP8 block `b` (FP8_BLOCK values from b · FP8_BLOCK, of the n8 FP8 dims) of an entry by
// one warp: its power-of-two scale from the block's largest magnitude, the codes to `e`
// (with the scale byte) and/or what they decode to to `back`. Every lane must call it.
__device__ __forceinline__ void entry_fp8_block_warp(const float* x, u8* e, float* back, int n8, int tail, int b) {
    const int lane = threadIdx.x & 31;
    const int c0 = b * FP8_BLOCK + lane, c1 = c0 + WARP;
    const float v0 = c0 < n8 ? x[c0] : 0.0f, v1 = c1 < n8 ? x[c1] : 0.0f;
    const u32 sb = fp8_scale_byte(warp_max(fmaxf(fabsf(v0), fabsf(v1))));
    const float scale = ue8m0_scale(sb);
    const u32 q0 = f2fp8(__fdiv_rn(v0, scale)), q1 = f2fp8(__fdiv_rn(v1, scale));
    if (c0 < n8) {
        if (e) e[c0] = (u8)q0;
        if (back) back[c0] = fp8_to_f32(q0) * scale;
    }
    if (c1 < n8) {
        if (e) e[c1] = (u8)q1;
        if (back) back[c1] = fp8_to_f32(q1) * scale;
    }
    if (lane == 0 && e) e[n8 + 2 * tail + b] = (u8)sb;
}

// The rest of an FP8 entry after its blocks, by one warp: the bf16 tail and the zero
// padding up to `bytes`.
__device__ __forceinline__ void entry_fp8_tail_warp(const float* x, u8* e, float* back, int n8, int tail, int bytes) {
    const int lane = threadIdx.x & 31, nb = (n8 + FP8_BLOCK - 1) / FP8_BLOCK;
    for (int d = lane; d < tail; d += WARP) {
        const u16 h = f2bf(x[n8 + d]);
        if (e) ((u16*)(e + n8))[d] = h;
        if (back) back[n8 + d] = bf2f(h);
    }
    if (e)
        for (int p = n8 + 2 * tail + nb + lane; p < bytes; p += WARP) e[p] = 0;
}

// One warp stores the entry x[0..dim) at `e` (any dtype; `bytes` = the record's size),
// and when `back` is set writes there what reading the entry gives (x and back may be
// the same memory: each lane reads its values before writing them). Every lane of the
// warp must call it with the same arguments.
__device__ void entry_store_warp(const float* x, u8* e, float* back, int dtype, int dim, int tail, int bytes) {
    const int lane = threadIdx.x & 31;
    if (dtype != DTYPE_FP8) {
        // Loads of a pass issued together before its stores: `e` is a byte pointer, so the
        // compiler may not move a load of x past a store to it, and a loop of load-store
        // pairs waited on each load in turn (~10 µs a decode row of 512 values).
        constexpr int PASS = 16;
        for (int d0 = 0; d0 < dim; d0 += PASS * WARP) {
            float v[PASS];
#pragma unroll
            for (int u = 0; u < PASS; u++) {
                const int d = d0 + u * WARP + lane;
                v[u] = d < dim ? x[d] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < PASS; u++) {
                const int d = d0 + u * WARP + lane;
                if (d < dim) {
                    if (e) store_value(e, dtype, d, v[u]);
                    if (back) back[d] = dtype == DTYPE_F32 ? v[u] : round_bf16(v[u]);
                }
            }
        }
        return;
    }
    const int n8 = dim - tail, nb = (n8 + FP8_BLOCK - 1) / FP8_BLOCK;
    for (int b = 0; b < nb; b++) entry_fp8_block_warp(x, e, back, n8, tail, b);
    entry_fp8_tail_warp(x, e, back, n8, tail, bytes);
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// f32 for values, u32 for counts (exact at any size). It may be called again right away.
// This thread's share of Σ p[i]² over n values, the threads of a block striding through
// them: 16-byte loads when n is a multiple of 4 (p must then be 16-byte aligned, as the
// rows of every buffer the callers pass are), so a block covering a long row alone (a
// decode batch's few rows) waits on a quarter of the loads.
__device__ __forceinline__ float thread_sumsq(const float* p, int n) {
    float ss = 0.0f;
    if ((n & 3) == 0) {
        const float4* p4 = reinterpret_cast<const float4*>(p);
        for (int i = threadIdx.x; i < (n >> 2); i += blockDim.x) {
            const float4 v = p4[i];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) ss += p[i] * p[i];
    }
    return ss;
}

template <typename T>
__device__ T block_sum(T v) {
    __shared__ T part[32];
    __shared__ T total;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[w] = v;
    __syncthreads();
    if (w == 0) {
        int nw = blockDim.x >> 5;
        T s = lane < nw ? part[lane] : T(0);
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// Four values of a row times its RMSNorm factor `inv`, then times the weight's four at
// w4[c] when there is a weight (w4 null: none). block_rms_norm_row and head_norm_rope.
__device__ __forceinline__ float4 rms_scale4(float4 v, float inv, const float4* w4, int c) {
    v.x *= inv;
    v.y *= inv;
    v.z *= inv;
    v.w *= inv;
    if (w4) {
        const float4 w = w4[c];
        v.x *= w.x;
        v.y *= w.y;
        v.z *= w.z;
        v.w *= w.w;
    }
    return v;
}

// RMSNorm of one row by the whole block: row * rsqrt(mean(row²) + eps), times weight
// when given; 16-byte loads and stores when dim is a multiple of 4. Each thread touches
// the elements thread_sumsq (and hc_collapse) give it, stride blockDim.x, so a block that
// has just written the row itself needs no barrier beyond block_sum's.
__device__ __forceinline__ void block_rms_norm_row(float* row, const float* weight, int dim, float eps) {
    const float inv = 1.0f / sqrtf(block_sum(thread_sumsq(row, dim)) / (float)dim + eps);
    if ((dim & 3) == 0) {
        float4* r4 = reinterpret_cast<float4*>(row);
        const float4* w4 = reinterpret_cast<const float4*>(weight);
        for (int c = threadIdx.x; c < (dim >> 2); c += blockDim.x) r4[c] = rms_scale4(r4[c], inv, w4, c);
        return;
    }
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        const float v = row[c] * inv;
        row[c] = weight ? weight[c] * v : v;
    }
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// Rotary table passed by value: one frequency per rotated pair.
struct RopeParams {
    float inv_freq[64];
    float attention_factor;
    int pairs;
};

// Rotate one head's last 2*pairs values, interleaved pairs (2j, 2j+1), as the CPU does:
// the angle is an f32 product, cos/sin of that f32.
__device__ __forceinline__ void rope_pair(float* a, float* b, float pos, float inv_freq, float att, bool inverse) {
    float s, c;
    sincosf(pos * inv_freq, &s, &c);
    c *= att;
    s *= att;
    if (inverse) s = -s;
    float x = *a, y = *b;
    *a = x * c - y * s;
    *b = y * c + x * s;
}

// What the sequence-aware kernels know of a batch (see plan upload in devplan.rs):
// per sequence 8 ints.
#define SEQ_FIRST_ROW 0
#define SEQ_ROWS 1
#define SEQ_START 2
#define SEQ_SLOT 3
#define SEQ_PAGE_OFF 4
#define SEQ_NPAGES 5
#define SEQ_FINAL_UNTIL 6
#define SEQ_STRIDE 8

// Asynchronous global → shared copies (sm_80+): the bytes in flight are held by shared
// memory, not registers, so a thread can have many outstanding at once.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
template <int BYTES>
__device__ __forceinline__ void cp_async(u32 dst, const void* src) {
    if (BYTES == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
    else asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(BYTES) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
