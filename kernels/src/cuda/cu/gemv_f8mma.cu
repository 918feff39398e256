// FP8 products of one or two decode rows on the FP8 tensor cores (mma.m16n8k32 with e4m3
// operands), the weights streamed through shared memory. kernels/src/cuda/gemv_f8mma.rs
// plans them; docs/cuda.md ("gemv_f8mma") says when they run.
//
// Why another FP8 gemv: the v2 kernels (decode2.cu) read each weight row as 64-byte
// pieces, a quad of threads each, and convert every code to f16 for an f16 mma; they
// reached 45-52% of the copy bandwidth at one row. Here
// - the weights go to shared memory by cp.async (the bytes in flight are held there, not
//   in registers), each warp copying the slice of every chunk it multiplies (64 or 128
//   contiguous bytes of each of 16 rows) and waiting for its own copies only: no barrier
//   of the block paces the chunks, one a tile sums the warps' parts;
// - the stored e4m3 codes are the mma's A operand as they are: ldmatrix gives each thread
//   its fragment straight from the staged rows (`ldmatrix_x4{,_at}` of gemm.cu, `mma_e4m3`
//   of gemm_f8.cu; each activation part is read back for the next by `d2_fp8_pairs_cvt`
//   of decode2.cu: this file comes after them in the program), and the only conversion
//   of the weights is the one ptxas emits for the e4m3 mma (one unpack instruction a
//   pair);
// - the first chunks of a block are requested before `griddepcontrol.wait`: weights are
//   never written by the kernel before, so their loads overlap that kernel's tail.
//
// Activations: each row r is scaled by a power of two s_r (its largest magnitude lands in
// [128, 256)) and written as three e4m3 parts, x·s = hi + mid + lo with each part the e4m3
// rounding of what the parts before left (relative error ~2^-12 of each value, an
// absolute floor of 2^-10 / s_r), into columns 3r, 3r+1, 3r+2 of the mma's n; the
// columns' sums are added and divided by s_r at the end. The FP8 block scale (one per 128
// rows × 128 inputs) multiplies a warp's partial sum of each 64 inputs in f32. (On sm_90
// ptxas turns each e4m3 mma into f16 unpacks and two f16 mmas: the products are exact,
// summed in f32.)
//
// Work: a tile is 16 output rows (N % 16 == 0); a block takes a contiguous run of tiles
// (one block an SM) and streams each as chunks of 16 rows × KC inputs through a ring
// of STAGES chunks (rows padded by 16 bytes: ldmatrix reads of 8 rows hit 8 different
// bank groups). Warp w takes inputs [KC/16 · w, KC/16 · (w + 1)) of every chunk: two
// mmas for each 64 of them, then its partial times its scale block's scale. Sixteen
// warps, so that the loop body's dependent instructions (one block an SM: the ring takes
// the shared memory) are spread over four warps a scheduler. A tile's warps add their
// sums through shared memory in warp order.
// Grouped products (wo_a: group g of output rows reads x[:, g·K .. g·K + K]) re-stage the
// activations when a block's tile moves into the next group.

#define F8_WARPS 16

// `F8Args` in gemv_f8mma.rs (pointers first).
struct F8Args {
    float* out;
    const float* x;
    const u8* w;
    const float* scales;
    int rows;
    int n;
    int k;
    int x_stride;
    int out_stride;
    int g_out;  // output rows of a group (grouped products), 0 for plain products
    int tiles;
    int pad;    // zero (the host's struct has no undefined padding bytes)
};

// Two f32 values as e4m3 codes, `lo` in the low byte (round to nearest even, saturating).
__device__ __forceinline__ u32 f8_pair(float lo, float hi) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// Rows 0..R-1 of x (K values from `x`, rows `x_stride` apart) as three e4m3 parts each into
// `act` (part p of row r: row 3r + p, K + 16 bytes a row), and 1 / s_r into inv_s.
// Ends with a barrier.
template <int R>
__device__ void f8_stage_activations(u8* act, const float* x, int x_stride, int K, float* inv_s, float* red_max) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float m[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        m[r] = 0.0f;
        for (int k = 4 * tid; k < K; k += 4 * 32 * F8_WARPS) {
            const float4 v = *(const float4*)(x + (long long)r * x_stride + k);
            m[r] = fmaxf(m[r], fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
        m[r] = warp_max(m[r]);
        if (lane == 0) red_max[warp * R + r] = m[r];
    }
    __syncthreads();
    float s[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        float mm = 0.0f;
#pragma unroll
        for (int w = 0; w < F8_WARPS; w++) mm = fmaxf(mm, red_max[w * R + r]);
        int e = 0;
        frexpf(mm, &e);  // mm = f · 2^e, f in [0.5, 1): mm · 2^(8 - e) in [128, 256)
        const bool usable = mm > 0.0f && mm < 3.0e38f;
        s[r] = usable ? ldexpf(1.0f, 8 - e) : 1.0f;
        if (tid == 0) inv_s[r] = usable ? ldexpf(1.0f, e - 8) : 1.0f;
    }
    for (int k = 4 * tid; k < K; k += 4 * 32 * F8_WARPS) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float4 v4 = *(const float4*)(x + (long long)r * x_stride + k);
            float v[4] = {v4.x * s[r], v4.y * s[r], v4.z * s[r], v4.w * s[r]};
            u32 part[3];
#pragma unroll
            for (int p = 0; p < 3; p++) {
                part[p] = f8_pair(v[0], v[1]) | (f8_pair(v[2], v[3]) << 16);
                u32 h01, h23;  // the codes back as f16 pairs (exact; decode2.cu's conversion)
                d2_fp8_pairs_cvt(part[p], h01, h23);
                v[0] -= f16lo_to_f32(h01);  // exact: what this part left
                v[1] -= f16hi_to_f32(h01);
                v[2] -= f16lo_to_f32(h23);
                v[3] -= f16hi_to_f32(h23);
            }
#pragma unroll
            for (int p = 0; p < 3; p++) *(u32*)(act + (3 * r + p) * (K + 16) + k) = part[p];
        }
    }
    __syncthreads();
}

// The sums of a finished tile (`red[buf]`, written by every warp) to the output rows.
template <int R>
__device__ __forceinline__ void f8_tile_out(const F8Args& a, const float (*red)[16][8], const float* inv_s, int tile) {
    const int tid = threadIdx.x;
    if (tid < 16 * R) {
        const int row = tid & 15, r = tid >> 4;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < F8_WARPS; w++) sum += red[w][row][3 * r] + red[w][row][3 * r + 1] + red[w][row][3 * r + 2];
        a.out[(long long)r * a.out_stride + tile * 16 + row] = sum * inv_s[r];
    }
}

// KC: inputs of a chunk (K must be a multiple); STAGES: chunks in the ring.
template <int R, int KC, int STAGES>
__device__ void f8mma_gemv(const F8Args& a) {
    constexpr int ROW = KC + 16;                   // a staged row, padded (see above)
    constexpr int CHUNK = 16 * ROW;
    constexpr int WARP_INPUTS = KC / F8_WARPS;     // a warp's inputs of a chunk (64 or 128)
    constexpr int PIECES = KC / (32 * F8_WARPS);   // 16-byte copies a thread a chunk
    extern __shared__ __align__(128) u8 f8_smem[];
    __shared__ float red[2][F8_WARPS][16][8];
    __shared__ float red_max[F8_WARPS * R];
    __shared__ float inv_s[R];
    u8* ring = f8_smem;
    u8* act = f8_smem + STAGES * CHUNK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int K = a.k, chunks = K / KC;
    const int t0 = (int)((long long)a.tiles * blockIdx.x / gridDim.x);
    const int t1 = (int)((long long)a.tiles * (blockIdx.x + 1) / gridDim.x);
    const int items = (t1 - t0) * chunks;
    const u32 ring_base = smem_addr(ring);

    // The request side walks the block's chunks in order, 16 rows × KC bytes each, into
    // ring slots 0, 1, … STAGES - 1, 0, … Each warp copies the part of a chunk it
    // multiplies (its WARP_INPUTS bytes of each of the 16 rows: PIECES 16-byte copies a
    // thread, a row's part from WARP_INPUTS / 16 neighbouring lanes), so it waits for its
    // own copies only and no barrier of the block paces the chunks. Offsets are computed
    // once: the loop body must stay short (its chain of dependent instructions is what a
    // warp spends a chunk on).
    u32 src_off[PIECES], dst_off[PIECES];
#pragma unroll
    for (int q = 0; q < PIECES; q++) {
        const int piece = q * 32 + lane, row = piece / (WARP_INPUTS / 16);
        const int col = WARP_INPUTS * warp + (piece % (WARP_INPUTS / 16)) * 16;
        src_off[q] = (u32)(row * K + col);
        dst_off[q] = ring_base + row * ROW + col;
    }
    const long long next_tile = (long long)16 * K - (long long)(chunks - 1) * KC;
    const u8* req = a.w + (long long)t0 * 16 * K;
    int requested = 0, req_c = 0, req_slot = 0;
    auto request_next = [&]() {
        if (requested < items) {
            const u32 slot = req_slot * CHUNK;
#pragma unroll
            for (int q = 0; q < PIECES; q++) cp_async<16>(dst_off[q] + slot, req + src_off[q]);
            req_c++;
            req += req_c == chunks ? next_tile : KC;
            req_c = req_c == chunks ? 0 : req_c;
            req_slot = req_slot == STAGES - 1 ? 0 : req_slot + 1;
            requested++;
        }
        cp_async_commit();  // empty groups too: every thread counts the same groups
    };
    for (int i = 0; i < STAGES - 1; i++) request_next();
    pdl_begin();
    if (items == 0) return;

    const int g_out = a.g_out;
    int group = g_out > 0 ? t0 * 16 / g_out : 0;
    int group_end = g_out > 0 ? (group + 1) * g_out : 1 << 30;  // first output row of the next group
    f8_stage_activations<R>(act, a.x + (long long)group * K, a.x_stride, K, inv_s, red_max);

    // ldmatrix addresses. A (16 rows × 32 inputs): lanes 0-15 name rows 0-15 at inputs
    // 0-15 (a0, a1), lanes 16-31 the same rows at inputs 16-31 (a2, a3). B (the parts as
    // 8 rows of n × 64 inputs, two k-steps): matrix j = lane / 8 holds inputs 16j .. +16;
    // rows of n past the 3R parts read part 0 (their columns of the product are unused).
    const u32 a_lane = ring_base + (lane & 15) * ROW + 16 * (lane >> 4) + WARP_INPUTS * warp;
    const int n_row = (lane & 7) < 3 * R ? (lane & 7) : 0;
    const u8* b_lane = act + n_row * (K + 16) + 16 * (lane >> 3) + WARP_INPUTS * warp;

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int t = t0, c = 0, slot = 0, buf = 0;
    const int warp_block = warp * WARP_INPUTS / 128;  // this warp's 128-input scale block in a chunk
    float scale = __ldg(a.scales + (long long)(t0 >> 3) * (K / 128) + warp_block);
    for (int it = 0; it < items; it++) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();  // this warp's part of chunk `it` is in; its lanes are done with the previous slot
        request_next();
        if (c == 0 && t * 16 >= group_end) {
            // A new group's activations: every warp has read the old ones (it passed the
            // barrier at the end of the last tile), and the tile written out there read the
            // old scales before the staging's first barrier (thread 0 writes them after it).
            group = t * 16 / g_out;
            group_end = (group + 1) * g_out;
            f8_stage_activations<R>(act, a.x + (long long)group * K, a.x_stride, K, inv_s, red_max);
        }
        // The next chunk's scale (its tile's 128-row block, its own 128 inputs).
        const int nt = c + 1 == chunks ? t + 1 : t, nc = c + 1 == chunks ? 0 : c + 1;
        const float next_scale =
            it + 1 < items ? __ldg(a.scales + (long long)(nt >> 3) * (K / 128) + nc * (KC / 128) + warp_block) : 0.0f;
        u32 b[WARP_INPUTS / 8];
#pragma unroll
        for (int j = 0; j < WARP_INPUTS / 64; j++) ldmatrix_x4(b + 4 * j, (const u16*)(b_lane + c * KC + 64 * j));
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const u32 a_addr = a_lane + slot * CHUNK;
#pragma unroll
        for (int step = 0; step < WARP_INPUTS / 32; step++) {
            u32 af[4];
            ldmatrix_x4_at(af, a_addr + 32 * step);
            mma_e4m3(part, af, b[2 * step], b[2 * step + 1]);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) acc[i] = fmaf(part[i], scale, acc[i]);
        scale = next_scale;

        if (c == chunks - 1) {
            // The tile's sums: thread (g, q) holds rows g and g + 8, columns 2q and 2q + 1;
            // summed over the warps once every warp has written them. The next tile's go to
            // the other buffer: this one is read until the threads writing out reach the
            // next tile's barrier, which every warp passes before writing here again.
            const int g = lane >> 2, q = lane & 3;
            if (2 * q < 3 * R) {
                red[buf][warp][g][2 * q] = acc[0];
                red[buf][warp][g][2 * q + 1] = acc[1];
                red[buf][warp][g + 8][2 * q] = acc[2];
                red[buf][warp][g + 8][2 * q + 1] = acc[3];
            }
#pragma unroll
            for (int i = 0; i < 4; i++) acc[i] = 0.0f;
            __syncthreads();
            f8_tile_out<R>(a, red[buf], inv_s, t);
            buf ^= 1;
        }
        c++;
        if (c == chunks) {
            c = 0;
            t++;
        }
        slot = slot == STAGES - 1 ? 0 : slot + 1;
    }
    cp_async_wait<0>();
}

// Chunks of 1024 inputs in a ring of six, and of 2048 in a ring of four (`_w`: half the
// loop's waits, copy requests and scale loads a byte; gemv_f8mma.rs).
extern "C" __global__ void __launch_bounds__(F8_WARPS * 32, 1) gemv_f8mma_r1(F8Args a) { f8mma_gemv<1, 1024, 6>(a); }
extern "C" __global__ void __launch_bounds__(F8_WARPS * 32, 1) gemv_f8mma_r2(F8Args a) { f8mma_gemv<2, 1024, 6>(a); }
extern "C" __global__ void __launch_bounds__(F8_WARPS * 32, 1) gemv_f8mma_w_r1(F8Args a) { f8mma_gemv<1, 2048, 4>(a); }
extern "C" __global__ void __launch_bounds__(F8_WARPS * 32, 1) gemv_f8mma_w_r2(F8Args a) { f8mma_gemv<2, 2048, 4>(a); }
