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

// Layout ops are cut into units of at most this many bytes / elements, one thread block each.
static const int64_t kCopyUnitBytes = 64 * 1024;
static const int64_t kFillUnitElements = 16 * 1024;

struct CopyUnit {
    const char* src;
    char* dst;
    int64_t bytes;
};

struct FillUnit {
    const void* src;   // gradient elements, from this unit's first one
    void* dst;         // bucket elements, of the bucket's dtype
    int64_t len;       // elements of the bucket this unit writes
    int64_t valid;     // of which the first `valid` come from the gradient, the rest is padding
    int32_t src_type;  // DType of the gradient
};

cudaError_t copy_units(const CopyUnit* units, int64_t count, cudaStream_t stream);
cudaError_t fill_units(const FillUnit* units, int64_t count, DType bucket_type, float scale, bool accumulate,
                       cudaStream_t stream);
cudaError_t quantize(DType x_type, const void* x, int64_t n, int bits, int64_t block_size, void* q, float* scales,
                     cudaStream_t stream);
cudaError_t dequantize(DType out_type, const void* q, const float* scales, void* out, int64_t n, int bits,
                       int64_t block_size, cudaStream_t stream);
cudaError_t dequantize_reduce(DType out_type, const uint8_t* chunks, int64_t chunk_stride, const float* scales,
                              int64_t scale_stride, int64_t k, void* out, int64_t n, int bits, int64_t block_size,
                              cudaStream_t stream);

}  // namespace cuda
}  // namespace dsa
