// CUDA kernels of the ops, without torch: the per-value arithmetic is quant_math.h's and dtype_math.h's, the
// same the CPU kernels run, so the CPU tests check what the GPU computes; this file only maps it onto threads.
#include <cuda_runtime.h>

#include "cuda_kernels.h"
#include "quant_math.h"

namespace dsa {
namespace cuda {
namespace {

const int kThreads = 256;

// Threads for a grid-stride loop over `count` items: enough blocks to fill the device, no more than needed.
unsigned grid_for(int64_t count) {
    const int64_t blocks = (count + kThreads - 1) / kThreads;
    return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > (1 << 20) ? (1 << 20) : blocks));
}

template <class W>
__device__ void copy_words(const char* src, char* dst, int64_t bytes) {
    const W* s = reinterpret_cast<const W*>(src);
    W* d = reinterpret_cast<W*>(dst);
    for (int64_t i = threadIdx.x; i < bytes / static_cast<int64_t>(sizeof(W)); i += blockDim.x) d[i] = s[i];
}

// One block per unit, in the widest word both pointers and the length are aligned to.
__global__ void copy_units_kernel(const CopyUnit* units) {
    const CopyUnit u = units[blockIdx.x];
    const uint64_t align = reinterpret_cast<uint64_t>(u.src) | reinterpret_cast<uint64_t>(u.dst) |
                           static_cast<uint64_t>(u.bytes);
    if ((align & 15) == 0) {
        copy_words<uint4>(u.src, u.dst, u.bytes);
    } else if ((align & 3) == 0) {
        copy_words<uint32_t>(u.src, u.dst, u.bytes);
    } else if ((align & 1) == 0) {
        copy_words<uint16_t>(u.src, u.dst, u.bytes);
    } else {
        copy_words<uint8_t>(u.src, u.dst, u.bytes);
    }
}

template <class S>
__device__ float load_scaled(const void* src, int64_t i, float scale) {
    return mul_rn(load_float(static_cast<const S*>(src), i), scale);
}

// Same operations as cpu_layout.cpp's fill_piece: fp32(g) * scale, then + fp32(bucket) when accumulating,
// one rounding into the bucket's dtype; padding zeroed when copying, left as is when accumulating.
template <class D, bool ACCUMULATE>
__global__ void fill_units_kernel(const FillUnit* units, float scale) {
    const FillUnit u = units[blockIdx.x];
    D* dst = static_cast<D*>(u.dst);
    for (int64_t i = threadIdx.x; i < u.len; i += blockDim.x) {
        if (i < u.valid) {
            float v = u.src_type == kFloat32 ? load_scaled<float>(u.src, i, scale)
                                             : load_scaled<bf16_bits>(u.src, i, scale);
            if (ACCUMULATE) v = add_rn(load_float(dst, i), v);
            store_float(dst, i, v);
        } else if (!ACCUMULATE) {
            store_float(dst, i, 0.0f);
        }
    }
}

__device__ uint32_t warp_max(uint32_t m) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const uint32_t other = __shfl_down_sync(0xFFFFFFFFu, m, offset);
        m = other > m ? other : m;
    }
    return m;
}

// One thread block per quantization block (grid-stride over blocks): max of abs_bits, the scale from
// quant_math.h, then every value.
template <class T, int BITS>
__global__ void quantize_kernel(const T* x, int64_t n, int64_t block_size, void* q, float* scales) {
    __shared__ uint32_t partial[kThreads / 32];
    __shared__ float scale;
    const int qmax = Quant<BITS>::qmax;
    const int64_t blocks = (n + block_size - 1) / block_size;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
        const int64_t begin = b * block_size;
        const int64_t len = n - begin < block_size ? n - begin : block_size;
        const T* xb = x + begin;
        uint32_t m = 0;
        for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
            const uint32_t a = abs_bits(xb, i);
            m = a > m ? a : m;
        }
        m = warp_max(m);
        if (lane == 0) partial[warp] = m;
        __syncthreads();
        if (warp == 0) {
            m = lane < kThreads / 32 ? partial[lane] : 0u;
            m = warp_max(m);
            if (lane == 0) {
                scale = block_scale(m, qmax);
                scales[b] = scale;
            }
        }
        __syncthreads();
        const float s = scale;
        const bool usable = s > 0.0f;  // false for a zero block and for a non-finite one (s = NaN)
        if (BITS == 8) {
            int8_t* qb = static_cast<int8_t*>(q) + begin;
            for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
                qb[i] = static_cast<int8_t>(usable ? quantize_value(load_float(xb, i), s, qmax) : 0);
            }
        } else {
            uint8_t* qb = static_cast<uint8_t*>(q) + begin / 2;  // block_size is even
            for (int64_t p = threadIdx.x; p < (len + 1) / 2; p += blockDim.x) {
                const int lo = usable ? quantize_value(load_float(xb, 2 * p), s, qmax) : 0;
                const int hi = usable && 2 * p + 1 < len ? quantize_value(load_float(xb, 2 * p + 1), s, qmax) : 0;
                qb[p] = pack_nibbles(lo, hi);
            }
        }
        __syncthreads();  // `partial` and `scale` are reused by the next block
    }
}

// Value i of a quantized chunk, dequantized.
template <int BITS>
__device__ float value_at(const void* q, const float* scales, int64_t i, int64_t block_size) {
    const float s = scales[i / block_size];
    if (BITS == 8) return dequantize_value(static_cast<const int8_t*>(q)[i], s);
    const uint8_t byte = static_cast<const uint8_t*>(q)[i / 2];
    return dequantize_value((i & 1) ? high_nibble(byte) : low_nibble(byte), s);
}

template <class D, int BITS>
__global__ void dequantize_kernel(const void* q, const float* scales, D* out, int64_t n, int64_t block_size) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        store_float(out, i, value_at<BITS>(q, scales, i, block_size));
    }
}

// Same order as the CPU: fp32 sum over chunks 0..k-1 from +0, one rounding into the output dtype.
template <class D, int BITS>
__global__ void dequantize_reduce_kernel(const uint8_t* chunks, int64_t chunk_stride, const float* scales,
                                         int64_t scale_stride, int64_t k, D* out, int64_t n, int64_t block_size) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            acc = add_rn(acc, value_at<BITS>(chunks + j * chunk_stride, scales + j * scale_stride, i, block_size));
        }
        store_float(out, i, acc);
    }
}

template <class D, int BITS>
void launch_dequantize(const void* q, const float* scales, void* out, int64_t n, int64_t block_size,
                       cudaStream_t stream) {
    dequantize_kernel<D, BITS><<<grid_for(n), kThreads, 0, stream>>>(q, scales, static_cast<D*>(out), n, block_size);
}

template <class D, int BITS>
void launch_dequantize_reduce(const uint8_t* chunks, int64_t chunk_stride, const float* scales,
                              int64_t scale_stride, int64_t k, void* out, int64_t n, int64_t block_size,
                              cudaStream_t stream) {
    dequantize_reduce_kernel<D, BITS><<<grid_for(n), kThreads, 0, stream>>>(
        chunks, chunk_stride, scales, scale_stride, k, static_cast<D*>(out), n, block_size);
}

template <class T, int BITS>
void launch_quantize(const void* x, int64_t n, int64_t block_size, void* q, float* scales, cudaStream_t stream) {
    const int64_t blocks = (n + block_size - 1) / block_size;
    const unsigned grid = static_cast<unsigned>(blocks > (1 << 20) ? (1 << 20) : blocks);
    quantize_kernel<T, BITS><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), n, block_size, q, scales);
}

}  // namespace

cudaError_t copy_units(const CopyUnit* units, int64_t count, cudaStream_t stream) {
    if (count > 0) copy_units_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(units);
    return cudaGetLastError();
}

cudaError_t fill_units(const FillUnit* units, int64_t count, DType bucket_type, float scale, bool accumulate,
                       cudaStream_t stream) {
    if (count > 0) {
        const unsigned grid = static_cast<unsigned>(count);
        if (bucket_type == kFloat32) {
            accumulate ? fill_units_kernel<float, true><<<grid, kThreads, 0, stream>>>(units, scale)
                       : fill_units_kernel<float, false><<<grid, kThreads, 0, stream>>>(units, scale);
        } else {
            accumulate ? fill_units_kernel<bf16_bits, true><<<grid, kThreads, 0, stream>>>(units, scale)
                       : fill_units_kernel<bf16_bits, false><<<grid, kThreads, 0, stream>>>(units, scale);
        }
    }
    return cudaGetLastError();
}

cudaError_t quantize(DType x_type, const void* x, int64_t n, int bits, int64_t block_size, void* q, float* scales,
                     cudaStream_t stream) {
    if (n > 0) {
        if (x_type == kFloat32) {
            bits == 8 ? launch_quantize<float, 8>(x, n, block_size, q, scales, stream)
                      : launch_quantize<float, 4>(x, n, block_size, q, scales, stream);
        } else {
            bits == 8 ? launch_quantize<bf16_bits, 8>(x, n, block_size, q, scales, stream)
                      : launch_quantize<bf16_bits, 4>(x, n, block_size, q, scales, stream);
        }
    }
    return cudaGetLastError();
}

cudaError_t dequantize(DType out_type, const void* q, const float* scales, void* out, int64_t n, int bits,
                       int64_t block_size, cudaStream_t stream) {
    if (n > 0) {
        if (out_type == kFloat32) {
            bits == 8 ? launch_dequantize<float, 8>(q, scales, out, n, block_size, stream)
                      : launch_dequantize<float, 4>(q, scales, out, n, block_size, stream);
        } else {
            bits == 8 ? launch_dequantize<bf16_bits, 8>(q, scales, out, n, block_size, stream)
                      : launch_dequantize<bf16_bits, 4>(q, scales, out, n, block_size, stream);
        }
    }
    return cudaGetLastError();
}

cudaError_t dequantize_reduce(DType out_type, const uint8_t* chunks, int64_t chunk_stride, const float* scales,
                              int64_t scale_stride, int64_t k, void* out, int64_t n, int bits, int64_t block_size,
                              cudaStream_t stream) {
    if (n > 0) {
        if (out_type == kFloat32) {
            bits == 8 ? launch_dequantize_reduce<float, 8>(chunks, chunk_stride, scales, scale_stride, k, out, n,
                                                          block_size, stream)
                      : launch_dequantize_reduce<float, 4>(chunks, chunk_stride, scales, scale_stride, k, out, n,
                                                          block_size, stream);
        } else {
            bits == 8 ? launch_dequantize_reduce<bf16_bits, 8>(chunks, chunk_stride, scales, scale_stride, k, out,
                                                              n, block_size, stream)
                      : launch_dequantize_reduce<bf16_bits, 4>(chunks, chunk_stride, scales, scale_stride, k, out,
                                                              n, block_size, stream);
        }
    }
    return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dsa
