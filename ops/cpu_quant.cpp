// CPU kernels of block quantization: quantize, dequantize and dequantize_reduce (the sum of k quantized
// chunks, as an all-to-all reduction receives them). The per-block and per-value arithmetic is quant_math.h's,
// the same the CUDA kernels run; this file only walks blocks, split between threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "cpu_kernels.h"
#include "quant_math.h"

namespace dsa {
namespace {

// Blocks per thread task: about 64 Ki values, so small blocks do not make tiny tasks.
int64_t block_grain(int64_t block_size) { return std::max<int64_t>(1, (int64_t(1) << 16) / block_size); }

template <class T>
uint32_t block_absmax_bits(const T* x, int64_t len) {
    uint32_t m = 0;
    for (int64_t i = 0; i < len; ++i) {
        const uint32_t a = abs_bits(x, i);
        m = a > m ? a : m;
    }
    return m;
}

template <class T, int BITS>
void quantize_blocks(const T* x, int64_t n, int64_t block_size, void* q, float* scales) {
    const int qmax = Quant<BITS>::qmax;
    const int64_t blocks = (n + block_size - 1) / block_size;
    at::parallel_for(0, blocks, block_grain(block_size), [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
            const int64_t begin = b * block_size, len = std::min(block_size, n - begin);
            const T* xb = x + begin;
            const float s = block_scale(block_absmax_bits(xb, len), qmax);
            scales[b] = s;
            if (BITS == 8) {
                int8_t* qb = static_cast<int8_t*>(q) + begin;
                if (!(s > 0.0f)) {  // zeros, or a non-finite block (s = NaN)
                    std::memset(qb, 0, static_cast<size_t>(len));
                    continue;
                }
                for (int64_t i = 0; i < len; ++i) {
                    qb[i] = static_cast<int8_t>(quantize_value(load_float(xb, i), s, qmax));
                }
            } else {
                uint8_t* qb = static_cast<uint8_t*>(q) + begin / 2;  // blocks start even: block_size is even
                const int64_t pairs = len / 2;
                if (!(s > 0.0f)) {
                    std::memset(qb, 0, static_cast<size_t>((len + 1) / 2));
                    continue;
                }
                for (int64_t p = 0; p < pairs; ++p) {
                    qb[p] = pack_nibbles(quantize_value(load_float(xb, 2 * p), s, qmax),
                                         quantize_value(load_float(xb, 2 * p + 1), s, qmax));
                }
                if (len % 2) qb[pairs] = pack_nibbles(quantize_value(load_float(xb, len - 1), s, qmax), 0);
            }
        }
    });
}

void check_quant_args(int64_t bits, int64_t block_size) {
    TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
    TORCH_CHECK(block_size > 0 && (bits == 8 || block_size % 2 == 0), "block_size must be > 0 (and even for int4)");
}

}  // namespace

void quantize_cpu(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t bits,
                  int64_t block_size) {
    check_quant_args(bits, block_size);
    TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scales.device().is_cpu(), "quantize: CPU tensors");
    TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && scales.is_contiguous(), "quantize: contiguous tensors");
    TORCH_CHECK(scales.scalar_type() == at::kFloat, "quantize: scales must be fp32");
    const int64_t n = x.numel();
    TORCH_CHECK(q.numel() == (bits == 8 ? n : (n + 1) / 2) && q.element_size() == 1, "quantize: q has the wrong size");
    TORCH_CHECK(scales.numel() == (n + block_size - 1) / block_size, "quantize: scales has the wrong size");
    if (n == 0) return;
    float* s = scales.data_ptr<float>();
    if (x.scalar_type() == at::kFloat) {
        const float* xp = x.data_ptr<float>();
        bits == 8 ? quantize_blocks<float, 8>(xp, n, block_size, q.data_ptr(), s)
                  : quantize_blocks<float, 4>(xp, n, block_size, q.data_ptr(), s);
    } else {
        TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quantize: x must be fp32 or bf16");
        const bf16_bits* xp = static_cast<const bf16_bits*>(x.data_ptr());
        bits == 8 ? quantize_blocks<bf16_bits, 8>(xp, n, block_size, q.data_ptr(), s)
                  : quantize_blocks<bf16_bits, 4>(xp, n, block_size, q.data_ptr(), s);
    }
}

namespace {

// Values [begin, begin + len) of one quantized chunk, dequantized with scale s, handed to sink(i, value).
template <int BITS, class Sink>
void dequantize_run(const void* q, int64_t begin, int64_t len, float s, const Sink& sink) {
    if (BITS == 8) {
        const int8_t* qb = static_cast<const int8_t*>(q) + begin;
        for (int64_t i = 0; i < len; ++i) sink(i, dequantize_value(qb[i], s));
    } else {
        const uint8_t* qb = static_cast<const uint8_t*>(q) + begin / 2;  // begin is even
        const int64_t pairs = len / 2;
        for (int64_t p = 0; p < pairs; ++p) {
            sink(2 * p, dequantize_value(low_nibble(qb[p]), s));
            sink(2 * p + 1, dequantize_value(high_nibble(qb[p]), s));
        }
        if (len % 2) sink(len - 1, dequantize_value(low_nibble(qb[pairs]), s));
    }
}

template <class D, int BITS>
void dequantize_blocks(const void* q, const float* scales, D* out, int64_t n, int64_t block_size) {
    const int64_t blocks = (n + block_size - 1) / block_size;
    at::parallel_for(0, blocks, block_grain(block_size), [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
            const int64_t begin = b * block_size, len = std::min(block_size, n - begin);
            D* ob = out + begin;
            dequantize_run<BITS>(q, begin, len, scales[b], [ob](int64_t i, float v) { store_float(ob, i, v); });
        }
    });
}

// Sums in fp32 over the chunks in order 0..k-1, one tile at a time so the running sums stay in L1, then rounds
// once into the output dtype.
template <class D, int BITS>
void dequantize_reduce_blocks(const uint8_t* chunks, int64_t chunk_stride, const float* scales,
                              int64_t scale_stride, int64_t k, D* out, int64_t n, int64_t block_size) {
    constexpr int64_t kTile = 1024;  // even, so int4 tiles start on a byte
    const int64_t blocks = (n + block_size - 1) / block_size;
    at::parallel_for(0, blocks, block_grain(block_size), [&](int64_t b0, int64_t b1) {
        float acc[kTile];
        for (int64_t b = b0; b < b1; ++b) {
            const int64_t block_begin = b * block_size, block_end = std::min(n, block_begin + block_size);
            for (int64_t begin = block_begin; begin < block_end; begin += kTile) {
                const int64_t len = std::min(kTile, block_end - begin);
                std::fill(acc, acc + len, 0.0f);
                for (int64_t j = 0; j < k; ++j) {
                    dequantize_run<BITS>(chunks + j * chunk_stride, begin, len, scales[j * scale_stride + b],
                                         [&acc](int64_t i, float v) { acc[i] = add_rn(acc[i], v); });
                }
                D* ob = out + begin;
                for (int64_t i = 0; i < len; ++i) store_float(ob, i, acc[i]);
            }
        }
    });
}

template <template <class, int> class Kernel, class... Args>
void by_out_type_and_bits(const at::Tensor& out, int64_t bits, Args... args) {
    TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out must be fp32 or bf16");
    if (out.scalar_type() == at::kFloat) {
        float* o = out.data_ptr<float>();
        bits == 8 ? Kernel<float, 8>::run(o, args...) : Kernel<float, 4>::run(o, args...);
    } else {
        bf16_bits* o = static_cast<bf16_bits*>(out.data_ptr());
        bits == 8 ? Kernel<bf16_bits, 8>::run(o, args...) : Kernel<bf16_bits, 4>::run(o, args...);
    }
}

template <class D, int BITS>
struct Dequantize {
    static void run(D* out, const void* q, const float* scales, int64_t n, int64_t block_size) {
        dequantize_blocks<D, BITS>(q, scales, out, n, block_size);
    }
};

template <class D, int BITS>
struct DequantizeReduce {
    static void run(D* out, const uint8_t* chunks, int64_t chunk_stride, const float* scales, int64_t scale_stride,
                    int64_t k, int64_t n, int64_t block_size) {
        dequantize_reduce_blocks<D, BITS>(chunks, chunk_stride, scales, scale_stride, k, out, n, block_size);
    }
};

}  // namespace

void dequantize_cpu(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& out, int64_t bits,
                    int64_t block_size) {
    check_quant_args(bits, block_size);
    TORCH_CHECK(q.device().is_cpu() && scales.device().is_cpu() && out.device().is_cpu(), "dequantize: CPU tensors");
    TORCH_CHECK(q.is_contiguous() && scales.is_contiguous() && out.is_contiguous(), "dequantize: contiguous tensors");
    TORCH_CHECK(scales.scalar_type() == at::kFloat && q.element_size() == 1, "dequantize: int8/uint8 q, fp32 scales");
    const int64_t n = out.numel();
    TORCH_CHECK(q.numel() >= (bits == 8 ? n : (n + 1) / 2), "dequantize: q is too small for out");
    TORCH_CHECK(scales.numel() >= (n + block_size - 1) / block_size, "dequantize: too few scales for out");
    if (n == 0) return;
    by_out_type_and_bits<Dequantize>(out, bits, static_cast<const void*>(q.data_ptr()),
                                     static_cast<const float*>(scales.data_ptr<float>()), n, block_size);
}

void dequantize_reduce_cpu(const at::Tensor& chunks, const at::Tensor& scales, const at::Tensor& out, int64_t bits,
                           int64_t block_size) {
    check_quant_args(bits, block_size);
    TORCH_CHECK(chunks.device().is_cpu() && scales.device().is_cpu() && out.device().is_cpu(),
                "dequantize_reduce: CPU tensors");
    TORCH_CHECK(chunks.dim() == 2 && scales.dim() == 2 && chunks.size(0) == scales.size(0),
                "dequantize_reduce: chunks [k, bytes] and scales [k, blocks]");
    TORCH_CHECK(chunks.element_size() == 1 && scales.scalar_type() == at::kFloat,
                "dequantize_reduce: int8/uint8 chunks, fp32 scales");
    TORCH_CHECK((chunks.size(1) <= 1 || chunks.stride(1) == 1) && (scales.size(1) <= 1 || scales.stride(1) == 1),
                "dequantize_reduce: rows of chunks and scales must be contiguous");
    TORCH_CHECK(out.is_contiguous(), "dequantize_reduce: out must be contiguous");
    const int64_t n = out.numel(), k = chunks.size(0);
    TORCH_CHECK(chunks.size(1) >= (bits == 8 ? n : (n + 1) / 2), "dequantize_reduce: chunks are too small for out");
    TORCH_CHECK(scales.size(1) >= (n + block_size - 1) / block_size, "dequantize_reduce: too few scales for out");
    if (n == 0) return;
    by_out_type_and_bits<DequantizeReduce>(out, bits, static_cast<const uint8_t*>(chunks.data_ptr()), chunks.stride(0),
                                           static_cast<const float*>(scales.data_ptr<float>()), scales.stride(0), k, n,
                                           block_size);
}

}  // namespace dsa
