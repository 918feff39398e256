// Routed FP4 experts of small decode batches on Hopper's warpgroup instruction (wgmma,
// sm_90a): kernels/src/cuda/moe_wgmma.rs plans and launches them; docs/cuda.md
// ("wgmoe") says when they run.
//
// Why: the segment kernels before these (decode2_segments.cu) unpack every e2m1 nibble
// to f16 and scale it by its group's scale before a warp-level mma: ~19 instructions for
// 8 weights, ~430 warp instructions for each 2 KB a warp multiplies, which keeps the
// routed experts of a batch-1 step at ~40% of the copy bandwidth (issue-bound). Here the
// nibbles become e4m3 codes by a few bit operations (below: 7 for 8 weights, no multiply)
// and wgmma takes them from registers; the group scale multiplies the instruction's f32
// result instead of every weight, because one wgmma (k = 32 inputs) is exactly one FP4
// scale group. About 300 warp instructions for the same 2 KB (the SASS of the loop;
// kernels/src/cuda/NOTES-decode.md has the count and the profile).
//
// e2m1 → e4m3: a nibble s.e1 e0.m read as the e4m3 byte s.000 e1 e0.m00 (sign to bit 7,
// the three magnitude bits to bits 4..2) is the same value times 2^-6, exactly, for the
// normal codes (exponent bias 7 against 1) and the subnormal one (0.5 becomes 2^-7) alike.
// The 2^6 is given back with the activations' scale at a unit's end.
//
// Layout (a unit is one segment — up to R = 2 or 4 list positions of one expert, moe_lists
// cuts the lists so — times one tile of 64 output rows; a block is one warpgroup):
// - Weights: warp w multiplies rows 16w..16w+15 of the tile, and copies exactly those
//   rows itself (`cp.async`, 16 bytes a copy) into a ring of S slots, a slot one chunk of
//   256 inputs (128 bytes a row, 16-byte pieces swizzled by row so that the fragment
//   loads below are free of bank conflicts) plus the rows' 8 scale bytes. A warp only
//   waits for its own copies (no block barrier a chunk); S - 1 chunks are in flight (S in
//   the pipelined `_p_` kernels, which load and convert a chunk's fragments a step early).
// - A fragments (cute's register layout for 8-bit wgmma): lane (g = lane/4, t = lane%4)
//   holds rows g and g + 8, logical inputs 4t..4t+3 and 16+4t..16+4t+3 of the k-step.
//   It reads the 4 bytes 4t..4t+3 of each row's 16-byte scale group (inputs 8t..8t+7):
//   the even inputs' codes become logical 4t..4t+3, the odd ones' 16+4t..16+4t+3. The
//   activations are staged in the same order, so the products are unchanged.
// - B (activations): the segment's rows as three e4m3 parts each (gemv_f8wg.cu's
//   scheme: a power of two per row over the block's inputs, parts in n = 3r..3r+2, the
//   rest of the instruction's 8 (R = 2) or 16 (R = 4) columns zero) in the canonical
//   layout without swizzle (8-column blocks 256 bytes apart a k-step); staged by the
//   block when its segment changes, then fenced for the async proxy once.
// - Sums: each wgmma writes fresh registers, multiplied by the group's scale (2^(s-127))
//   and added in f32. A unit's sums meet in shared memory; with a K split (a cluster of
//   KS blocks, one K part each) block s then sums rows [s·64/KS, (s+1)·64/KS) of the tile
//   over the ranks in rank order (gemv_f8wg.cu's scheme), so results do not depend on
//   scheduling. Gate/up (DUAL) applies SwiGLU there and writes h (f32, a row per list
//   position); the down kernel writes y per list position for moe_combine_rows.

#define WM_TILE 64
#define WM_KC 256                          // inputs of a chunk: 8 scale groups
#define WM_ROW_BYTES (WM_KC / 2)           // 128 bytes of a row's chunk
#define WM_WEIGHTS (WM_TILE * WM_ROW_BYTES)  // 8 KiB
#define WM_SLOT (WM_WEIGHTS + WM_TILE * 8)   // + the 64 rows' 8 scale bytes
// List positions of a segment R: 2 (the instruction's n = 8 columns, three e4m3 parts a
// row in 6 of them) or 4 (n = 16, 12 used: an expert with 3-4 of a batch's rows streamed
// once instead of twice, the `_r4` kernels). WM_N(R): the columns.
#define WM_N(R) ((R) == 2 ? 8 : 16)

// Arguments (a #[repr(C)] struct on the host side: pointers first).
struct WgMoeArgs {
    float* out;            // gate/up: h [pos][N]; down: y [pos][N]
    const float* x;        // gate/up: the batch rows [row][K]; down: h [pos][K]
    const u64* wtab;       // (w, w3, s, s3) per expert
    const int* segs;       // [3][max_segs]: first list position, positions, expert
    const int* n_seg;      // segments in use
    const int* list_rows;  // gate/up: the batch row of each list position
    int N, K, tiles, max_segs;
    float limit;           // SwiGLU clamp
    unsigned pad;          // zero (the host's struct has no undefined padding bytes)
};

// Eight e2m1 nibbles (inputs 8t..8t+7 of a group, low nibble first) → e4m3 codes times
// 2^-6: the even inputs' in `even`, the odd ones' in `odd` (byte i: input 8t + 2i, + 1).
__device__ __forceinline__ void wm_e2m1_codes(u32 w, u32& even, u32& odd) {
    even = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);
    odd = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);
}

// D = A · B (64 × 8 × 32, e4m3, f32; D's old values are not read), A from registers.
__device__ __forceinline__ void wm_mma(float (&d)[4], const u32 (&a)[4], u64 db) {
#if WG_AVAILABLE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(0));
#else
    __trap();
#endif
}

// D = A · B (64 × 16 × 32, e4m3, f32; D's old values are not read), A from registers.
__device__ __forceinline__ void wm_mma(float (&d)[8], const u32 (&a)[4], u64 db) {
#if WG_AVAILABLE
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(0));
#else
    __trap();
#endif
}

// A unit's sums (N columns: the accumulator layout of m64nNk32, 8-column block j in
// registers 4j..4j+3) into `rd` (64 rows × N + 1), then zeroed.
template <int N>
__device__ __forceinline__ void wm_sums_to_shared(float* rd, float (&acc)[N / 2]) {
    const int lane = threadIdx.x & 31, row = (threadIdx.x >> 5) * 16 + (lane >> 2), q = lane & 3;
#pragma unroll
    for (int j = 0; j < N / 8; j++) {
        rd[row * (N + 1) + 8 * j + 2 * q] = acc[4 * j];
        rd[row * (N + 1) + 8 * j + 2 * q + 1] = acc[4 * j + 1];
        rd[(row + 8) * (N + 1) + 8 * j + 2 * q] = acc[4 * j + 2];
        rd[(row + 8) * (N + 1) + 8 * j + 2 * q + 1] = acc[4 * j + 3];
    }
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc[i] = 0.0f;
}

// wg_hold for N sums: their reads are tied to after the wait.
template <int N>
__device__ __forceinline__ void wm_hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i += 4) asm volatile("" : "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])::"memory");
}

// 2^(s - 127) of the ue8m0 byte `b` of `word` (b a constant after unrolling: the byte
// moved into the exponent field by one permute and a shift).
__device__ __forceinline__ float wm_scale(u32 word, int b) {
    return __uint_as_float(__byte_perm(word, 0u, 0x0444u | (b << 12)) >> 1);
}

// Column n of a k-step's piece: 8-column blocks of 256 bytes, 16 bytes a column.
__device__ __forceinline__ int wm_col(int n) { return (n >> 3) * 256 + 16 * (n & 7); }

// Four scaled inputs as three e4m3 parts (what each part left, as gemv_f8wg.cu's staging)
// in columns n0, n0 + 1, n0 + 2 of `piece`.
__device__ __forceinline__ void wm_parts(float (&v)[4], u8* piece, int n0) {
#pragma unroll
    for (int p = 0; p < 3; p++) {
        const u32 part = f8_pair(v[0], v[1]) | (f8_pair(v[2], v[3]) << 16);
        u32 h01, h23;
        d2_fp8_pairs_cvt(part, h01, h23);
        v[0] -= f16lo_to_f32(h01);
        v[1] -= f16hi_to_f32(h01);
        v[2] -= f16lo_to_f32(h23);
        v[3] -= f16hi_to_f32(h23);
        *(u32*)(piece + wm_col(n0 + p)) = part;
    }
}

// The segment's rows (src[r]: a row of x, or -1 for none) over inputs [kbase, kbase + KB)
// into `act` in the fragments' input order (see the top; a k-step is WM_N(R) / 8 blocks of
// 256 bytes), 1 / s_r into inv_s. Starts and ends with a barrier; the caller fences the
// async proxy.
template <int R>
__device__ void wm_stage(u8* act, const float* x, int K, const int (&src)[R], int kbase, int KB, float* inv_s,
                         float* red_max) {
    constexpr int N = WM_N(R);
    const int tid = threadIdx.x;
    __syncthreads();  // the unit before has read inv_s and its wgmmas have read act
    float m[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        m[r] = 0.0f;
        if (src[r] < 0) continue;
        const float* xr = x + (long long)src[r] * K + kbase;
        for (int k = 4 * tid; k < KB; k += 4 * WG_THREADS) {
            const float4 v = *(const float4*)(xr + k);
            m[r] = fmaxf(m[r], fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
    }
    float s[R];
    wg_row_scales<R>(m, red_max, s, inv_s);
    // A thread takes eighths of groups: inputs 8j..8j+7 of group q are logical 4j..4j+3
    // (even ones) and 16+4j..16+4j+3 (odd ones) of k-step q, 256 bytes a k-step, the
    // second 16 logical inputs 128 bytes after the first, column n at 16n.
    for (int e = tid; e < KB / 8; e += WG_THREADS) {
        u8* piece = act + (e >> 2) * (32 * N) + 4 * (e & 3);
#pragma unroll
        for (int r = 0; r < R; r++) {
            float even[4] = {0.0f, 0.0f, 0.0f, 0.0f}, odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (src[r] >= 0) {
                const float* xr = x + (long long)src[r] * K + kbase + 8 * e;
                const float4 a = *(const float4*)xr, b = *(const float4*)(xr + 4);
                even[0] = a.x * s[r];
                odd[0] = a.y * s[r];
                even[1] = a.z * s[r];
                odd[1] = a.w * s[r];
                even[2] = b.x * s[r];
                odd[2] = b.y * s[r];
                even[3] = b.z * s[r];
                odd[3] = b.w * s[r];
            }
            wm_parts(even, piece, 3 * r);
            wm_parts(odd, piece + 128, 3 * r);
        }
#pragma unroll
        for (int n = 3 * R; n < N; n++) {
            *(u32*)(piece + wm_col(n)) = 0u;
            *(u32*)(piece + 128 + wm_col(n)) = 0u;
        }
    }
    __syncthreads();
}

// A walk over a block's steps (chunk-major, then the matrices of a chunk): the step's
// unit (counted from the block's first), chunk and matrix, and for the request side the
// unit's addresses for this lane.
template <int NM>
struct WmWalk {
    int u = 0, c = 0, mat = 0, left = 0, lane_row = 0;
    const u8* w[NM];
    const u8* s[NM];
    // To the next step; true when that starts the next unit.
    __device__ __forceinline__ bool next(int chunks) {
        if (++mat < NM) return false;
        mat = 0;
        if (++c < chunks) return false;
        c = 0;
        u++;
        return true;
    }
};

template <bool DUAL, int KS, int S, bool PIPE, int R>
__device__ void wm_body(const WgMoeArgs& a) {
    constexpr int NM = DUAL ? 2 : 1, N = WM_N(R), NA = N / 2;  // NA: sums a thread a wgmma
    extern __shared__ __align__(128) u8 wm_smem[];
    __shared__ float red[2][NM][WM_TILE * (N + 1)];
    __shared__ float part_sm[2][NM][R][WM_TILE];
    __shared__ float red_max[(WG_THREADS / 32) * R];
    __shared__ float inv_s[R];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int rank = KS > 1 ? (int)(blockIdx.x % KS) : 0;
    const int cluster = blockIdx.x / KS, clusters = gridDim.x / KS;
    const int KB = a.K / KS, kbase = rank * KB, chunks = KB / WM_KC, per = chunks * NM;
    u8* act = wm_smem + S * WM_SLOT;
    const u32 ring = smem_addr(wm_smem);
    pdl_begin();  // the segments and the activations come from the kernels before
    const long long units = (long long)*a.n_seg * a.tiles;
    const int u0 = (int)(units * cluster / clusters), u1 = (int)(units * (cluster + 1) / clusters);
    const int steps = (u1 - u0) * per;  // a step: one chunk of one matrix
    if (steps == 0) return;             // the same for every block of a cluster

    // The request side walks the steps (a step: one chunk of one matrix; chunk-major,
    // w1 then w3) with counters; a lane copies rows lane/8 + 4j (j = 0..3) of its warp's
    // 16, 16-byte piece lane % 8, and lanes 0-15 one row's 8 scale bytes each. The unit's
    // addresses are found once a unit (two dependent loads), not once a step.
    WmWalk<NM> req;
    req.lane_row = lane >> 3;
    const int piece = lane & 7;
    u32 dst[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int r = req.lane_row + 4 * j;
        dst[j] = warp * 16 * WM_ROW_BYTES + r * WM_ROW_BYTES + ((piece ^ (r & 7)) << 4);
    }
    const u32 dst_scale = WM_WEIGHTS + (warp * 16 + (lane & 15)) * 8;
    const long long row_bytes = a.K / 2, rows4 = 4 * row_bytes;
    auto unit_addresses = [&](int u) {
        const u64* e = a.wtab + 4 * a.segs[2 * a.max_segs + u / a.tiles];
        const long long row0 = (long long)(u % a.tiles) * WM_TILE + warp * 16;
#pragma unroll
        for (int m = 0; m < NM; m++) {
            req.w[m] = (const u8*)e[m] + (row0 + req.lane_row) * row_bytes + kbase / 2 + piece * 16;
            req.s[m] = (const u8*)e[2 + m] + (row0 + (lane & 15)) * (a.K / 32) + kbase / 32;
        }
    };
    req.left = steps;
    unit_addresses(u0);
    int req_slot = 0;
    auto request = [&]() {
        if (req.left > 0) {
            const u32 slot = ring + req_slot * WM_SLOT;
            const int mat = req.mat;
            const u8* src = (mat == 0 ? req.w[0] : req.w[NM - 1]) + req.c * WM_ROW_BYTES;
#pragma unroll
            for (int j = 0; j < 4; j++) cp_async<16>(slot + dst[j], src + j * rows4);
            if (lane < 16) cp_async<8>(slot + dst_scale, (mat == 0 ? req.s[0] : req.s[NM - 1]) + req.c * 8);
            req.left--;
            if (req.next(chunks) && req.left > 0) unit_addresses(u0 + req.u);
        }
        req_slot = req_slot == S - 1 ? 0 : req_slot + 1;
        cp_async_commit();  // one group a step, empty past the end, so the waits count steps
    };
    for (int i = 0; i < S - 1; i++) request();

    auto segment_rows = [&](int s, int (&src)[R]) {
        const int p0 = a.segs[s], len = a.segs[a.max_segs + s];
#pragma unroll
        for (int r = 0; r < R; r++) src[r] = r < len ? (DUAL ? a.list_rows[p0 + r] : p0 + r) : -1;
    };

    float acc[NM][NA];
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int i = 0; i < NA; i++) acc[m][i] = 0.0f;
    int staged = -1, buf = 0;
    float d[8][NA] = {};  // each wgmma's result (written, never read, by the instruction)

    // The unit's sums to the output (through the cluster when K is split).
    auto finish = [&](int u) {
#pragma unroll
        for (int m = 0; m < NM; m++) wm_sums_to_shared<N>(red[buf][m], acc[m]);
        __syncthreads();
        const int s = u / a.tiles, p0 = a.segs[s], len = a.segs[a.max_segs + s];
        const long long o0 = (long long)(u % a.tiles) * WM_TILE;
        auto emit = [&](int r, int o, const float (&v)[NM]) {
            if (r >= len) return;
            float* dst = a.out + (long long)(p0 + r) * a.N + o0 + o;
            *dst = DUAL ? d2_swiglu(v[0], v[NM - 1], a.limit) : v[0];
        };
        for (int item = tid; item < WM_TILE * R; item += WG_THREADS) {
            const int o = item & (WM_TILE - 1), r = item / WM_TILE;
            // The parts' sum, the activations' scale and the codes' 2^-6 undone.
            const float unscale = inv_s[r] * 64.0f;
            float v[NM];
#pragma unroll
            for (int m = 0; m < NM; m++) {
                const float* p = red[buf][m] + o * (N + 1) + 3 * r;
                v[m] = (p[0] + p[1] + p[2]) * unscale;
                if (KS > 1) part_sm[buf][m][r][o] = v[m];
            }
            if (KS == 1) emit(r, o, v);
        }
        if (KS > 1) {
            gr_cluster_sync();
            constexpr int SLICE = WM_TILE / KS;
            for (int item = tid; item < SLICE * R; item += WG_THREADS) {
                const int o = rank * SLICE + item % SLICE, r = item / SLICE;
                float v[NM];
#pragma unroll
                for (int m = 0; m < NM; m++) {
                    const u32 local = smem_addr(&part_sm[buf][m][r][o]);
                    v[m] = 0.0f;
#pragma unroll
                    for (int k = 0; k < KS; k++) v[m] += gr_cluster_load(local, k);
                }
                emit(r, o, v);
            }
        }
        // The other buffers take the next unit: these are read until every thread has
        // passed the next unit's barrier.
        buf ^= 1;
    };

    // A step's A fragments (its codes as e4m3) and its rows' scale bytes, from its slot.
    struct Frags {
        u32 f[8][4];
        uint2 lo, hi;
    };
    auto load = [&](Frags& F, int slot_i) {
        const u8* slot = wm_smem + slot_i * WM_SLOT;
        const u8* wr = slot + (warp * 16 + g) * WM_ROW_BYTES + 4 * t;
#pragma unroll
        for (int q = 0; q < 8; q++) {
            const int off = (q ^ g) << 4;  // rows g and g + 8 share the swizzle
            wm_e2m1_codes(*(const u32*)(wr + off), F.f[q][0], F.f[q][2]);
            wm_e2m1_codes(*(const u32*)(wr + 8 * WM_ROW_BYTES + off), F.f[q][1], F.f[q][3]);
        }
        F.lo = *(const uint2*)(slot + WM_WEIGHTS + (warp * 16 + g) * 8);
        F.hi = *(const uint2*)(slot + WM_WEIGHTS + (warp * 16 + g + 8) * 8);
    };
    // Each group's result times its scale (rows g and g + 8), into the matrix's sums
    // (indexed by constants: a run-time index would put acc in local memory).
    auto scaled = [&](const Frags& F, float (&ac)[NA]) {
#pragma unroll
        for (int q = 0; q < 8; q++) {
            const u32 w_lo = q < 4 ? F.lo.x : F.lo.y, w_hi = q < 4 ? F.hi.x : F.hi.y;
            const float lo = wm_scale(w_lo, q & 3), hi = wm_scale(w_hi, q & 3);
#pragma unroll
            for (int j = 0; j < NA; j += 4) {  // rows g (registers j, j + 1) and g + 8
                ac[j] = fmaf(d[q][j], lo, ac[j]);
                ac[j + 1] = fmaf(d[q][j + 1], lo, ac[j + 1]);
                ac[j + 2] = fmaf(d[q][j + 2], hi, ac[j + 2]);
                ac[j + 3] = fmaf(d[q][j + 3], hi, ac[j + 3]);
            }
        }
    };

    WmWalk<NM> at;  // the multiply side's step
    int i = 0, slot_i = 0;
    // One step over the fragments `cur` (PIPE: loaded a step earlier, and the next step's
    // loaded into `nxt` while the tensor core works on these). False after the last.
    auto step = [&](Frags& cur, Frags& nxt) -> bool {
        const int u = u0 + at.u, c = at.c, mat = at.mat;
        if (c == 0 && mat == 0 && u / a.tiles != staged) {
            staged = u / a.tiles;
            int src[R];
            segment_rows(staged, src);
            wm_stage<R>(act, a.x, a.K, src, kbase, KB, inv_s, red_max);
            wg_proxy_fence();
            __syncthreads();
        }
        if (!PIPE) {
            request();  // step i + S - 1 into the slot of step i - 1, which this warp has finished
            cp_async_wait<S - 1>();
            __syncwarp();
            load(cur, slot_i);
            slot_i = slot_i == S - 1 ? 0 : slot_i + 1;
        }
        const u32 b_addr = smem_addr(act) + c * (WM_KC * N);
        wg_fence();
#pragma unroll
        for (int q = 0; q < 8; q++) wm_mma(d[q], cur.f[q], wg_desc(b_addr + q * (32 * N), 128, 256, 0));
        wg_commit();
        if (PIPE && i + 1 < steps) {
            request();  // step i + S into the slot of step i, whose fragments are in `cur`
            cp_async_wait<S - 1>();
            __syncwarp();
            load(nxt, slot_i);
            slot_i = slot_i == S - 1 ? 0 : slot_i + 1;
        }
        wg_wait<0>();
#pragma unroll
        for (int q = 0; q < 8; q++) wm_hold(d[q]);
        if (mat == 0) scaled(cur, acc[0]);
        else scaled(cur, acc[NM - 1]);
        if (at.next(chunks)) finish(u);
        return ++i < steps;
    };
    Frags fa, fb;
    if (PIPE) {
        request();  // step S - 1: S steps in flight
        cp_async_wait<S - 1>();
        __syncwarp();
        load(fa, 0);
        slot_i = 1;
    }
    while (step(fa, fb) && step(fb, fa)) {
    }
    cp_async_wait<0>();
    // No block leaves while another still reads its parts.
    if (KS > 1) gr_cluster_sync();
}

#define WM_KERNEL(NAME, DUAL, KS, PIPE, CLUSTER, R)                                                  \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) CLUSTER NAME(const WgMoeArgs a) {         \
        wm_body<DUAL, KS, 4, PIPE, R>(a);                                                            \
    }

// Gate/up and down, K split over clusters of 1, 2 or 4; `_p_`: the next step's fragments
// converted while the tensor core works (the default; SLUICE_CUDA_MOE_WGMMA_PIPE=0 runs
// the others); `_p_r4_`: those with segments of 4 list positions.
#define WM_KERNELS(P, PIPE, R)                                   \
    WM_KERNEL(wgmoe_##P##swiglu_k1, true, 1, PIPE, , R)           \
    WM_KERNEL(wgmoe_##P##swiglu_k2, true, 2, PIPE, WG_CLUSTER(2), R) \
    WM_KERNEL(wgmoe_##P##swiglu_k4, true, 4, PIPE, WG_CLUSTER(4), R) \
    WM_KERNEL(wgmoe_##P##down_k1, false, 1, PIPE, , R)            \
    WM_KERNEL(wgmoe_##P##down_k2, false, 2, PIPE, WG_CLUSTER(2), R)  \
    WM_KERNEL(wgmoe_##P##down_k4, false, 4, PIPE, WG_CLUSTER(4), R)

WM_KERNELS(, false, 2)
WM_KERNELS(p_, true, 2)
WM_KERNELS(p_r4_, true, 4)
