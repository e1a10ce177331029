// Type-erased entry points of the CUDA kernels (cuda_kernels.cu), for the torch glue in cuda_ops.cpp.
//
// No torch type crosses this boundary: cuda_kernels.cu is compiled by nvcc without torch's headers (quick to
// build, and compile-checked on machines without a GPU). Pointers are device pointers; every function only
// enqueues work on `stream` and returns the launch's error code.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace dsa {
namespace cuda {

enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1 };

// A layout op is a table of segments: contiguous runs of its output, each fed by one contiguous run of one input.
// The host writes one entry per run (not per tile), so its work grows with the number of runs, never with the
// bytes; the kernel cuts every segment into tiles of a fixed size, one thread block per tile, and finds a
// block's segment by a binary search over `first_tile` (the running count of tiles before the segment).
static const int64_t kCopyTileBytes = 8 * 1024;
static const int64_t kFillTileElements = 4 * 1024;

struct CopySegment {
    const char* src;
    char* dst;
    int64_t bytes;       // > 0
    int64_t first_tile;  // tiles of the segments before this one
};

struct FillSegment {
    const void* src;     // gradient elements, from this segment's first one; nullptr: zeros (the padding)
    void* dst;           // bucket elements, of the bucket's dtype
    int64_t len;         // elements, > 0
    int64_t first_tile;
    int32_t src_type;    // DType of the gradient
    int32_t unused;
};

// Tiles a segment of `size` bytes (copy) or elements (fill) is cut into.
inline int64_t copy_tiles(int64_t bytes) { return (bytes + kCopyTileBytes - 1) / kCopyTileBytes; }
inline int64_t fill_tiles(int64_t len) { return (len + kFillTileElements - 1) / kFillTileElements; }

cudaError_t copy_segments(const CopySegment* segments, int64_t count, int64_t tiles, cudaStream_t stream);
cudaError_t fill_segments(const FillSegment* segments, int64_t count, int64_t tiles, DType bucket_type, float scale,
                          bool accumulate, cudaStream_t stream);
cudaError_t quantize(DType x_type, const void* x, int64_t n, int bits, int64_t block_size, void* q, float* scales,
                     cudaStream_t stream);
cudaError_t dequantize(DType out_type, const void* q, const float* scales, void* out, int64_t n, int bits,
                       int64_t block_size, cudaStream_t stream);
cudaError_t dequantize_reduce(DType out_type, const uint8_t* chunks, int64_t chunk_stride, const float* scales,
                              int64_t scale_stride, int64_t k, void* out, int64_t n, int bits, int64_t block_size,
                              cudaStream_t stream);

}  // namespace cuda
}  // namespace dsa
