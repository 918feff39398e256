// The KV checksum (kernels/src/kv_checksum.rs) summed where the bytes are: the partial
// sum of each byte range of one buffer, so a transfer's sender and receiver prove what
// landed without copying GPU memory to the host. Word i of a range (its bytes 8i..8i+8,
// little endian, zero past the end) adds fmix64(word + i * KV_WORD_KEY) modulo 2^64;
// the host finishes each sum with the length. Addition is associative and commutative
// on u64, so any split over threads and blocks (atomicAdd) gives the reference's value.

#define KV_WORD_KEY 0x9E3779B97F4A7C15ull

__device__ __forceinline__ u64 kv_fmix64(u64 k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

// ranges: [n][3] u64 (byte offset from base, byte length, index of the range's first word
// in what is checksummed), offsets and lengths multiples of 4 (the host checks; other
// ranges are summed on the host). Grid (blocks per range, n); out[n] must be zero before
// the launch.
extern "C" __global__ void kv_checksum(const u8* __restrict__ base, const u64* __restrict__ ranges,
                                       u64* __restrict__ out) {
    pdl_begin();
    const int r = blockIdx.y;
    const u64 off = ranges[3 * r], len = ranges[3 * r + 1], first = ranges[3 * r + 2];
    const u64 words = (len + 7) / 8;
    const u8* p = base + off;
    const bool aligned8 = ((off | (u64)base) & 7) == 0;
    u64 acc = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x) {
        u64 w;
        if (aligned8 && 8 * i + 8 <= len) {
            w = __ldg((const unsigned long long*)(p + 8 * i));
        } else {
            // 8i < len and len is a multiple of 4, so the low half is always inside.
            const u32* q = (const u32*)(p + 8 * i);
            const u64 lo = __ldg(q);
            const u64 hi = 8 * i + 8 <= len ? (u64)__ldg(q + 1) : 0ull;
            w = lo | (hi << 32);
        }
        acc += kv_fmix64(w + (first + i) * KV_WORD_KEY);
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, s);
    if ((threadIdx.x & (WARP - 1)) == 0 && acc != 0) atomicAdd((unsigned long long*)&out[r], (unsigned long long)acc);
}
