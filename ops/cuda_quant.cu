// CUDA kernels of block quantization (quantize, dequantize, the dequantize-and-sum of a reduction), without torch.
//
// Quantize: one warp per quantization block; the block's values in 16-byte loads (several in flight per lane,
// kept in registers when the block fits), its max by warp shuffles, then the codes written in words of 2 to 8
// bytes. Dequantize: each thread turns one word of codes into 16 bytes of output. Where an address or the block
// size does not allow the wide words (checked once per block or per launch), the same arithmetic runs value by
// value. The per-value arithmetic is quant_math.h's and dtype_math.h's, as on the CPU.
#include <cuda_runtime.h>

#include "cuda_kernels.h"
#include "cuda_vector.cuh"
#include "quant_math.h"

namespace dsa {
namespace cuda {
namespace {

const int kThreads = 256;
const int kWarps = kThreads / 32;
const int kInFlight = 4;  // wide loads per lane issued before their first use

// Values per 16-byte word of T, and bytes of their codes.
template <class T>
struct Wide {
    static constexpr int values = 16 / static_cast<int>(sizeof(T));  // 4 fp32, 8 bf16
};
template <class T, int BITS>
struct CodeWord {
    static constexpr int bytes = Wide<T>::values * BITS / 8;  // 2, 4 or 8
};

template <int BYTES>
__device__ __forceinline__ void store_code_word(uint8_t* p, uint64_t v) {
    if (BYTES == 8) {
        *reinterpret_cast<uint2*>(p) = make_uint2(static_cast<uint32_t>(v), static_cast<uint32_t>(v >> 32));
    } else if (BYTES == 4) {
        *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(v);
    } else {
        *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(v);
    }
}

template <int BYTES>
__device__ __forceinline__ uint64_t load_code_word(const uint8_t* p) {
    if (BYTES == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        return static_cast<uint64_t>(v.x) | (static_cast<uint64_t>(v.y) << 32);
    } else if (BYTES == 4) {
        return *reinterpret_cast<const uint32_t*>(p);
    } else {
        return *reinterpret_cast<const uint16_t*>(p);
    }
}

// The values of one 16-byte word as fp32.
__device__ __forceinline__ void unpack_word(const uint4& w, float (&f)[4]) {
    f[0] = bits_float(w.x), f[1] = bits_float(w.y), f[2] = bits_float(w.z), f[3] = bits_float(w.w);
}
__device__ __forceinline__ void unpack_word(const uint4& w, float (&f)[8]) {
    const uint32_t pairs[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        f[2 * k] = bf16_to_float(static_cast<bf16_bits>(pairs[k] & 0xFFFFu));
        f[2 * k + 1] = bf16_to_float(static_cast<bf16_bits>(pairs[k] >> 16));
    }
}

// Max of abs_bits over one word: |x| as bits, so NaN compares above inf (dtype_math.h).
template <class T>
__device__ __forceinline__ uint32_t word_abs_max(const uint4& w) {
    float f[Wide<T>::values];
    unpack_word(w, f);
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < Wide<T>::values; ++k) {
        const uint32_t a = float_bits(f[k]) & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

// The codes of one word, packed as the output stores them (int8: a byte each; int4: quant_math.h's nibbles).
template <class T, int BITS>
__device__ __forceinline__ uint64_t encode_word(const uint4& w, float s, bool usable) {
    constexpr int qmax = Quant<BITS>::qmax;
    float f[Wide<T>::values];
    unpack_word(w, f);
    uint64_t out = 0;
#pragma unroll
    for (int k = 0; k < Wide<T>::values; k += 2) {
        const int a = usable ? quantize_value(f[k], s, qmax) : 0;
        const int b = usable ? quantize_value(f[k + 1], s, qmax) : 0;
        if (BITS == 8) {
            out |= static_cast<uint64_t>(static_cast<uint8_t>(static_cast<int8_t>(a))) << (8 * k);
            out |= static_cast<uint64_t>(static_cast<uint8_t>(static_cast<int8_t>(b))) << (8 * (k + 1));
        } else {
            out |= static_cast<uint64_t>(pack_nibbles(a, b)) << (4 * k);
        }
    }
    return out;
}

__device__ __forceinline__ uint32_t warp_all_max(uint32_t m) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, m, offset);
        m = other > m ? other : m;
    }
    return m;
}

template <class T, int BITS>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const T* x, int64_t n, int64_t block_size, uint8_t* q,
                                                           float* scales) {
    constexpr int V = Wide<T>::values;
    constexpr int QB = CodeWord<T, BITS>::bytes;
    constexpr int qmax = Quant<BITS>::qmax;
    const int lane = threadIdx.x & 31;
    const int64_t blocks = (n + block_size - 1) / block_size;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); b < blocks; b += warps) {
        const int64_t begin = b * block_size;
        const int64_t len = n - begin < block_size ? n - begin : block_size;
        const T* xb = x + begin;
        uint8_t* qb = q + (BITS == 8 ? begin : begin / 2);  // block_size is even for int4
        const bool wide = aligned_to(xb, 16) && aligned_to(qb, QB);
        const int64_t words = wide ? len / V : 0;
        const int64_t rest = words * V;  // the values past the whole words go one by one
        const bool fits = words <= 32 * kInFlight;
        const uint4* xw = reinterpret_cast<const uint4*>(xb);

        // Pass 1: the block's max. The load loops are written out in both passes on purpose: the same loops
        // factored into helpers taking the word arrays by reference measured 0.65 of a copy against 0.75
        // (quantize8 fp32, 64 MiB, one H200, same machine, one run each).
        uint4 held[kInFlight] = {};
        uint32_t m = 0;
        if (fits) {
#pragma unroll
            for (int k = 0; k < kInFlight; ++k) {
                if (lane + 32 * k < words) held[k] = xw[lane + 32 * k];
            }
#pragma unroll
            for (int k = 0; k < kInFlight; ++k) {
                if (lane + 32 * k < words) {
                    const uint32_t a = word_abs_max<T>(held[k]);
                    m = a > m ? a : m;
                }
            }
        } else {
            for (int64_t w0 = lane; w0 < words; w0 += 32 * kInFlight) {
                uint4 t[kInFlight] = {};
#pragma unroll
                for (int k = 0; k < kInFlight; ++k) {
                    if (w0 + 32 * k < words) t[k] = xw[w0 + 32 * k];
                }
#pragma unroll
                for (int k = 0; k < kInFlight; ++k) {
                    if (w0 + 32 * k < words) {
                        const uint32_t a = word_abs_max<T>(t[k]);
                        m = a > m ? a : m;
                    }
                }
            }
        }
        for (int64_t i = rest + lane; i < len; i += 32) {
            const uint32_t a = abs_bits(xb, i);
            m = a > m ? a : m;
        }
        m = warp_all_max(m);
        const float s = block_scale(m, qmax);  // every lane computes the same scale
        if (lane == 0) scales[b] = s;
        const bool usable = s > 0.0f;  // false for a zero block and for a non-finite one (s = NaN)

        // Pass 2: the codes, from the registers when the block fit, else read again (from the cache).
        if (fits) {
#pragma unroll
            for (int k = 0; k < kInFlight; ++k) {
                const int64_t w = lane + 32 * k;
                if (w < words) store_code_word<QB>(qb + w * QB, encode_word<T, BITS>(held[k], s, usable));
            }
        } else {
            for (int64_t w0 = lane; w0 < words; w0 += 32 * kInFlight) {
                uint4 t[kInFlight] = {};
#pragma unroll
                for (int k = 0; k < kInFlight; ++k) {
                    if (w0 + 32 * k < words) t[k] = xw[w0 + 32 * k];
                }
#pragma unroll
                for (int k = 0; k < kInFlight; ++k) {
                    const int64_t w = w0 + 32 * k;
                    if (w < words) store_code_word<QB>(qb + w * QB, encode_word<T, BITS>(t[k], s, usable));
                }
            }
        }
        if (BITS == 8) {
            int8_t* codes = reinterpret_cast<int8_t*>(qb);
            for (int64_t i = rest + lane; i < len; i += 32) {
                codes[i] = static_cast<int8_t>(usable ? quantize_value(load_float(xb, i), s, qmax) : 0);
            }
        } else {
            for (int64_t p = rest / 2 + lane; p < (len + 1) / 2; p += 32) {  // rest is even
                const int lo = usable ? quantize_value(load_float(xb, 2 * p), s, qmax) : 0;
                const int hi = usable && 2 * p + 1 < len ? quantize_value(load_float(xb, 2 * p + 1), s, qmax) : 0;
                qb[p] = pack_nibbles(lo, hi);
            }
        }
    }
}

// The block of value i: a shift where the block size is a power of two (block_shift >= 0), else a division.
__device__ __forceinline__ int64_t block_of(int64_t i, int64_t block_size, int block_shift) {
    return block_shift >= 0 ? (i >> block_shift) : i / block_size;
}

// Value i of a quantized chunk, dequantized.
template <int BITS>
__device__ __forceinline__ float value_at(const uint8_t* q, const float* scales, int64_t i, int64_t block_size,
                                          int block_shift) {
    const float s = scales[block_of(i, block_size, block_shift)];
    if (BITS == 8) return dequantize_value(static_cast<int8_t>(q[i]), s);
    const uint8_t byte = q[i / 2];
    return dequantize_value((i & 1) ? high_nibble(byte) : low_nibble(byte), s);
}

// Code k of a word of codes.
template <int BITS>
__device__ __forceinline__ int code_of(uint64_t word, int k) {
    if (BITS == 8) return static_cast<int8_t>(static_cast<uint8_t>(word >> (8 * k)));
    const uint8_t byte = static_cast<uint8_t>(word >> (8 * (k / 2)));
    return (k & 1) ? high_nibble(byte) : low_nibble(byte);
}

__device__ __forceinline__ void store_word(float* p, const float (&f)[4]) {
    store16(reinterpret_cast<char*>(p), make_uint4(float_bits(f[0]), float_bits(f[1]), float_bits(f[2]),
                                                   float_bits(f[3])));
}
__device__ __forceinline__ void store_word(bf16_bits* p, const float (&f)[8]) {
    uint32_t pairs[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        pairs[k] = static_cast<uint32_t>(float_to_bf16(f[2 * k])) |
                   (static_cast<uint32_t>(float_to_bf16(f[2 * k + 1])) << 16);
    }
    store16(reinterpret_cast<char*>(p), make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]));
}

// The fp32 sum over chunks 0..k-1 of their dequantized values, from +0 in chunk order (as the CPU); k = 1 with
// one chunk is plain dequantization, rounded once into the output dtype.
template <class D, int BITS>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t* chunks, int64_t chunk_stride,
                                                             const float* scales, int64_t scale_stride, int64_t k,
                                                             D* out, int64_t n, int64_t block_size, int block_shift,
                                                             bool wide, bool sum) {
    constexpr int V = Wide<D>::values;
    constexpr int QB = CodeWord<D, BITS>::bytes;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    const int64_t words = wide ? n / V : 0;
    for (int64_t w0 = first; w0 < words; w0 += stride * 2) {
        float acc[2][V];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#pragma unroll
            for (int e = 0; e < V; ++e) acc[u][e] = 0.0f;
        }
        for (int64_t j = 0; j < k; ++j) {
            uint64_t codes[2] = {0, 0};
            float s[2] = {0.0f, 0.0f};
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int64_t w = w0 + u * stride;
                if (w < words) {
                    codes[u] = load_code_word<QB>(chunks + j * chunk_stride + w * QB);
                    s[u] = scales[j * scale_stride + block_of(w * V, block_size, block_shift)];
                }
            }
#pragma unroll
            for (int u = 0; u < 2; ++u) {
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    const float v = dequantize_value(code_of<BITS>(codes[u], e), s[u]);
                    acc[u][e] = sum ? add_rn(acc[u][e], v) : v;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            if (w0 + u * stride < words) store_word(out + (w0 + u * stride) * V, acc[u]);
        }
    }
    for (int64_t i = words * V + first; i < n; i += stride) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            const float v = value_at<BITS>(chunks + j * chunk_stride, scales + j * scale_stride, i, block_size,
                                           block_shift);
            acc = sum ? add_rn(acc, v) : v;
        }
        store_float(out, i, acc);
    }
}

template <class T, int BITS>
void launch_quantize(const void* x, int64_t n, int64_t block_size, void* q, float* scales, cudaStream_t stream) {
    const int64_t blocks = (n + block_size - 1) / block_size;
    const int64_t grid = (blocks + kWarps - 1) / kWarps;
    quantize_kernel<T, BITS><<<static_cast<unsigned>(grid > (1 << 20) ? (1 << 20) : grid), kThreads, 0, stream>>>(
        static_cast<const T*>(x), n, block_size, static_cast<uint8_t*>(q), scales);
}

int shift_of(int64_t block_size) {
    if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return -1;
    int shift = 0;
    while ((int64_t(1) << shift) < block_size) ++shift;
    return shift;
}

template <class D, int BITS>
void launch_dequantize(const uint8_t* chunks, int64_t chunk_stride, const float* scales, int64_t scale_stride,
                       int64_t k, void* out, int64_t n, int64_t block_size, bool sum, cudaStream_t stream) {
    constexpr int V = Wide<D>::values;
    constexpr int QB = CodeWord<D, BITS>::bytes;
    // The wide words need every chunk's codes aligned to a code word and a whole word in one quantization block.
    const bool wide = reinterpret_cast<uintptr_t>(out) % 16 == 0 && reinterpret_cast<uintptr_t>(chunks) % QB == 0 &&
                      (k <= 1 || chunk_stride % QB == 0) && block_size % V == 0;
    const int64_t words = wide ? n / V : 0;
    const int64_t work = words / 2 > n - words * V ? words / 2 : n - words * V;
    int64_t grid = (work + kThreads - 1) / kThreads;
    grid = grid < 1 ? 1 : (grid > (1 << 20) ? (1 << 20) : grid);
    dequantize_kernel<D, BITS><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
        chunks, chunk_stride, scales, scale_stride, k, static_cast<D*>(out), n, block_size, shift_of(block_size),
        wide, sum);
}

template <class D>
void dispatch_dequantize(int bits, const uint8_t* chunks, int64_t chunk_stride, const float* scales,
                         int64_t scale_stride, int64_t k, void* out, int64_t n, int64_t block_size, bool sum,
                         cudaStream_t stream) {
    if (bits == 8) {
        launch_dequantize<D, 8>(chunks, chunk_stride, scales, scale_stride, k, out, n, block_size, sum, stream);
    } else {
        launch_dequantize<D, 4>(chunks, chunk_stride, scales, scale_stride, k, out, n, block_size, sum, stream);
    }
}

}  // namespace

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
        const uint8_t* codes = static_cast<const uint8_t*>(q);
        out_type == kFloat32
            ? dispatch_dequantize<float>(bits, codes, 0, scales, 0, 1, out, n, block_size, false, stream)
            : dispatch_dequantize<bf16_bits>(bits, codes, 0, scales, 0, 1, out, n, block_size, false, stream);
    }
    return cudaGetLastError();
}

cudaError_t dequantize_reduce(DType out_type, const uint8_t* chunks, int64_t chunk_stride, const float* scales,
                              int64_t scale_stride, int64_t k, void* out, int64_t n, int bits, int64_t block_size,
                              cudaStream_t stream) {
    if (n > 0) {
        out_type == kFloat32 ? dispatch_dequantize<float>(bits, chunks, chunk_stride, scales, scale_stride, k, out, n,
                                                          block_size, true, stream)
                             : dispatch_dequantize<bf16_bits>(bits, chunks, chunk_stride, scales, scale_stride, k,
                                                              out, n, block_size, true, stream);
    }
    return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dsa
