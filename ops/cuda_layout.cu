// CUDA kernels of the layout ops (pack, unpack, the gather's unpack, the bucket fill), without torch.
//
// The host hands a table of segments (cuda_kernels.h); each thread block takes one tile of one segment. Within a
// tile, the output is written in aligned 16-byte words, and only the few bytes before the first aligned word and
// after the last one (a narrow edge of under 16 bytes) go element by element. Inputs are read 16 bytes at a time
// from wherever they start (cuda_vector.cuh), so a run whose source and destination are aligned differently still
// moves in wide words. The per-value arithmetic of the fill is dtype_math.h's, as on the CPU.
#include <cuda_runtime.h>

#include "cuda_kernels.h"
#include "cuda_vector.cuh"
#include "dtype_math.h"

namespace dsa {
namespace cuda {
namespace {

const int kCopyThreads = 128;
const int kCopyWordsPerThread = static_cast<int>(kCopyTileBytes / 16 / kCopyThreads);  // in flight per thread
const int kFillThreads = 256;
const int kFillGroup = 8;  // elements per wide step: 16 or 32 bytes of either dtype
const int kFillGroupsPerThread = static_cast<int>(kFillTileElements / kFillGroup / kFillThreads);

static_assert(kCopyTileBytes % (16 * kCopyThreads) == 0, "a copy tile is whole 16-byte words for every thread");
static_assert(kFillTileElements % (kFillGroup * kFillThreads) == 0, "a fill tile is whole groups for every thread");

// The segment holding `tile`: the last one whose first tile is <= tile. Thread 0 searches, the block shares it.
template <class Segment>
__device__ Segment segment_of_tile(const Segment* segments, int64_t count, int64_t tile) {
    __shared__ int64_t found;
    if (threadIdx.x == 0) {
        int64_t lo = 0, hi = count - 1;
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) >> 1;
            if (segments[mid].first_tile <= tile) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        found = lo;
    }
    __syncthreads();
    return segments[found];
}

__global__ void __launch_bounds__(kCopyThreads) copy_segments_kernel(const CopySegment* segments, int64_t count) {
    const int64_t tile = blockIdx.x;
    const CopySegment seg = segment_of_tile(segments, count, tile);
    const int64_t begin = (tile - seg.first_tile) * kCopyTileBytes;
    const int64_t len = seg.bytes - begin < kCopyTileBytes ? seg.bytes - begin : kCopyTileBytes;
    const char* src = seg.src + begin;
    char* dst = seg.dst + begin;

    // Narrow edges: under 16 bytes each, one byte per thread.
    const int64_t head = len < bytes_to_alignment(dst) ? len : bytes_to_alignment(dst);
    const int64_t words = (len - head) >> 4;
    const int64_t tail = head + (words << 4);
    if (threadIdx.x < head) dst[threadIdx.x] = src[threadIdx.x];
    if (tail + threadIdx.x < len) dst[tail + threadIdx.x] = src[tail + threadIdx.x];

    // Body: every load of the thread issued before its first store.
    const char* from = src + head;
    char* to = dst + head;
    uint4 v[kCopyWordsPerThread];
#pragma unroll
    for (int k = 0; k < kCopyWordsPerThread; ++k) {
        const int64_t w = threadIdx.x + static_cast<int64_t>(k) * kCopyThreads;
        if (w < words) v[k] = load16(from + (w << 4));
    }
#pragma unroll
    for (int k = 0; k < kCopyWordsPerThread; ++k) {
        const int64_t w = threadIdx.x + static_cast<int64_t>(k) * kCopyThreads;
        if (w < words) store16(to + (w << 4), v[k]);
    }
}

// Eight consecutive elements, as fp32, from wherever they start.
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
    const uint4 a = load16(reinterpret_cast<const char*>(p));
    const uint4 b = load16(reinterpret_cast<const char*>(p) + 16);
    f[0] = bits_float(a.x), f[1] = bits_float(a.y), f[2] = bits_float(a.z), f[3] = bits_float(a.w);
    f[4] = bits_float(b.x), f[5] = bits_float(b.y), f[6] = bits_float(b.z), f[7] = bits_float(b.w);
}

__device__ __forceinline__ void split_bf16(uint32_t pair, float& even, float& odd) {
    even = bf16_to_float(static_cast<bf16_bits>(pair & 0xFFFFu));  // little-endian: the lower address is low
    odd = bf16_to_float(static_cast<bf16_bits>(pair >> 16));
}

__device__ __forceinline__ void load8(const bf16_bits* p, float (&f)[8]) {
    const uint4 a = load16(reinterpret_cast<const char*>(p));
    split_bf16(a.x, f[0], f[1]), split_bf16(a.y, f[2], f[3]), split_bf16(a.z, f[4], f[5]), split_bf16(a.w, f[6], f[7]);
}

// Eight elements to a 16-byte-aligned destination, rounded once each (dtype_math.h).
__device__ __forceinline__ void store8(float* p, const float (&f)[8]) {
    store16(reinterpret_cast<char*>(p),
            make_uint4(float_bits(f[0]), float_bits(f[1]), float_bits(f[2]), float_bits(f[3])));
    store16(reinterpret_cast<char*>(p) + 16,
            make_uint4(float_bits(f[4]), float_bits(f[5]), float_bits(f[6]), float_bits(f[7])));
}

__device__ __forceinline__ uint32_t join_bf16(float even, float odd) {
    return static_cast<uint32_t>(float_to_bf16(even)) | (static_cast<uint32_t>(float_to_bf16(odd)) << 16);
}

__device__ __forceinline__ void store8(bf16_bits* p, const float (&f)[8]) {
    store16(reinterpret_cast<char*>(p),
            make_uint4(join_bf16(f[0], f[1]), join_bf16(f[2], f[3]), join_bf16(f[4], f[5]), join_bf16(f[6], f[7])));
}

// One element, as cpu_layout.cpp's fill_piece computes it: fp32(g) * scale, then + fp32(bucket) when accumulating,
// one rounding into the bucket's dtype; zero for padding (a segment without a source) when copying.
template <class D, class S, bool ACCUMULATE>
__device__ __forceinline__ void fill_one(const S* src, D* dst, int64_t i, float scale) {
    float v = src != nullptr ? mul_rn(load_float(src, i), scale) : 0.0f;
    if (ACCUMULATE) v = add_rn(load_float(dst, i), v);
    store_float(dst, i, v);
}

template <class D, class S, bool ACCUMULATE>
__device__ void fill_tile(const S* src, D* dst, int64_t len, float scale) {
    const int64_t aligned_at = bytes_to_alignment(dst) / static_cast<int64_t>(sizeof(D));  // elements
    const int64_t head = len < aligned_at ? len : aligned_at;
    const int64_t groups = (len - head) / kFillGroup;
    const int64_t tail = head + groups * kFillGroup;
    if (threadIdx.x < head) fill_one<D, S, ACCUMULATE>(src, dst, threadIdx.x, scale);
    if (tail + threadIdx.x < len) fill_one<D, S, ACCUMULATE>(src, dst, tail + threadIdx.x, scale);

    const S* from = src != nullptr ? src + head : nullptr;
    D* to = dst + head;
    float v[kFillGroupsPerThread][kFillGroup];
#pragma unroll
    for (int k = 0; k < kFillGroupsPerThread; ++k) {
        const int64_t g = threadIdx.x + static_cast<int64_t>(k) * kFillThreads;
        if (g < groups) {
            if (from != nullptr) {
                load8(from + g * kFillGroup, v[k]);
            } else {
#pragma unroll
                for (int e = 0; e < kFillGroup; ++e) v[k][e] = 0.0f;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < kFillGroupsPerThread; ++k) {
        const int64_t g = threadIdx.x + static_cast<int64_t>(k) * kFillThreads;
        if (g < groups) {
            float old[kFillGroup];
            if (ACCUMULATE) load8(to + g * kFillGroup, old);
#pragma unroll
            for (int e = 0; e < kFillGroup; ++e) {
                float x = from != nullptr ? mul_rn(v[k][e], scale) : 0.0f;
                if (ACCUMULATE) x = add_rn(old[e], x);
                v[k][e] = x;
            }
            store8(to + g * kFillGroup, v[k]);
        }
    }
}

template <class D, bool ACCUMULATE>
__global__ void __launch_bounds__(kFillThreads) fill_segments_kernel(const FillSegment* segments, int64_t count,
                                                                     float scale) {
    const int64_t tile = blockIdx.x;
    const FillSegment seg = segment_of_tile(segments, count, tile);
    const int64_t begin = (tile - seg.first_tile) * kFillTileElements;
    const int64_t len = seg.len - begin < kFillTileElements ? seg.len - begin : kFillTileElements;
    D* dst = static_cast<D*>(seg.dst) + begin;
    if (seg.src_type == kFloat32) {
        const float* src = seg.src != nullptr ? static_cast<const float*>(seg.src) + begin : nullptr;
        fill_tile<D, float, ACCUMULATE>(src, dst, len, scale);
    } else {
        const bf16_bits* src = seg.src != nullptr ? static_cast<const bf16_bits*>(seg.src) + begin : nullptr;
        fill_tile<D, bf16_bits, ACCUMULATE>(src, dst, len, scale);
    }
}

}  // namespace

cudaError_t copy_segments(const CopySegment* segments, int64_t count, int64_t tiles, cudaStream_t stream) {
    if (count > 0 && tiles > 0) {
        if (tiles > 0x7FFFFFFF) return cudaErrorInvalidValue;
        copy_segments_kernel<<<static_cast<unsigned>(tiles), kCopyThreads, 0, stream>>>(segments, count);
    }
    return cudaGetLastError();
}

cudaError_t fill_segments(const FillSegment* segments, int64_t count, int64_t tiles, DType bucket_type, float scale,
                          bool accumulate, cudaStream_t stream) {
    if (count > 0 && tiles > 0) {
        if (tiles > 0x7FFFFFFF) return cudaErrorInvalidValue;
        const unsigned grid = static_cast<unsigned>(tiles);
        if (bucket_type == kFloat32) {
            accumulate ? fill_segments_kernel<float, true><<<grid, kFillThreads, 0, stream>>>(segments, count, scale)
                       : fill_segments_kernel<float, false><<<grid, kFillThreads, 0, stream>>>(segments, count, scale);
        } else {
            accumulate
                ? fill_segments_kernel<bf16_bits, true><<<grid, kFillThreads, 0, stream>>>(segments, count, scale)
                : fill_segments_kernel<bf16_bits, false><<<grid, kFillThreads, 0, stream>>>(segments, count, scale);
        }
    }
    return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dsa
