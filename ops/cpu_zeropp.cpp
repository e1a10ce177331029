// CPU kernels of DeepSpeed ZeRO++'s quantizer contract (what stock qwZ and qgZ call through
// deepspeed.ops.op_builder.QuantizerBuilder): grouped symmetric quantization of fp16 values, its inverse, the
// swizzled int4 quantization of qgZ's first all-to-all, and the fp16 sum and requantization of its second.
// The Python side (ds_asynchzp/ops/zeropp.py) checks arguments and allocates; ds_asynchzp/ops/reference.py
// holds the same arithmetic in plain torch, and is the specification these kernels are tested against.
//
// Arithmetic of one group (the CUDA kernels' semantics, computed here with IEEE single rounding, no fast math):
//   absmax  = max |x| over the group's fp16 values (NaN ignored), in fp32;
//   scale   = 2^bits / (2 * absmax), or 1 where absmax is 0;
//   code    = clamp(round_half_even(x * scale), -2^(bits-1), 2^(bits-1) - 1)   (NaN -> 0);
//   param   = 1 / scale, the fp32 value stored and sent per group;
//   value   = fp16(code * param) on dequantization.
// int4 codes pack two a byte, the EVEN element in the HIGH nibble (the opposite of cpu_quant.cpp's layout).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_kernels.h"
#include "quant_math.h"

namespace dsa {
namespace {

struct GroupCode {
    float scale;
    int qmin, qmax;

    GroupCode(float absmax, int bits)
        : scale(absmax == 0.0f ? 1.0f : static_cast<float>(1 << bits) / (2.0f * absmax)),
          qmin(-(1 << (bits - 1))), qmax((1 << (bits - 1)) - 1) {}

    int code(float x) const {
        float v = x * scale;
        if (v != v) return 0;
        // Clamped before rounding so that round_half_even's |v| < 2^22 holds; the result is the same.
        v = std::min(std::max(v, static_cast<float>(qmin) - 1.0f), static_cast<float>(qmax) + 1.0f);
        const int q = static_cast<int>(round_half_even(v));
        return std::min(std::max(q, qmin), qmax);
    }

    float param() const { return 1.0f / scale; }
};

// fp16 values of one group (as floats) -> codes at `out` (int8: one a byte; int4: two a byte), its param.
void quantize_group(const float* x, int64_t len, int bits, int8_t* out, float* param) {
    float absmax = 0.0f;
    for (int64_t i = 0; i < len; ++i) {
        const float a = std::fabs(x[i]);
        absmax = a > absmax ? a : absmax;  // a NaN never compares greater
    }
    const GroupCode g(absmax, bits);
    *param = g.param();
    if (bits == 8) {
        for (int64_t i = 0; i < len; ++i) out[i] = static_cast<int8_t>(g.code(x[i]));
    } else {
        for (int64_t i = 0; i < len / 2; ++i) {
            out[i] = static_cast<int8_t>(pack_nibbles(g.code(x[2 * i + 1]), g.code(x[2 * i])));
        }
    }
}

// Code i of a quantized run (int4: element 2k in the high nibble of byte k).
int code_at(const int8_t* q, int64_t i, int bits) {
    if (bits == 8) return q[i];
    const uint8_t b = static_cast<uint8_t>(q[i / 2]);
    return (i % 2) ? low_nibble(b) : high_nibble(b);
}

float to_half_value(float v) { return static_cast<float>(c10::Half(v)); }

void check_bits(int64_t bits) { TORCH_CHECK(bits == 8 || bits == 4, "zeropp: num_bits must be 8 or 4"); }

// Input group g of a swizzled quantization -> its output group: groups = W * pipeline * C, W = nodes * dpn;
// g = x + C * (y + pipeline * z) goes to x + C * (y * W + (z % dpn) * nodes + z / dpn).
int64_t swizzled_group(int64_t g, int64_t contiguous, int64_t pipeline, int64_t nodes, int64_t dpn) {
    const int64_t x = g % contiguous, y = (g / contiguous) % pipeline, z = g / (contiguous * pipeline);
    return x + contiguous * (y * nodes * dpn + (z % dpn) * nodes + z / dpn);
}

}  // namespace

void zeropp_quantize_cpu(const at::Tensor& x, const at::Tensor& q, const at::Tensor& params, int64_t groups,
                         int64_t bits, int64_t pipeline, int64_t nodes, int64_t devices_per_node) {
    check_bits(bits);
    TORCH_CHECK(x.scalar_type() == at::kHalf && x.is_contiguous() && x.device().is_cpu(),
                "zeropp quantize: x must be contiguous fp16 on CPU");
    TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && params.scalar_type() == at::kFloat &&
                    params.is_contiguous(), "zeropp quantize: int8 q and fp32 params, contiguous");
    const int64_t n = x.numel(), partitions = nodes * devices_per_node;
    TORCH_CHECK(groups > 0 && pipeline > 0 && partitions > 0 && groups % (partitions * pipeline) == 0 &&
                    n % groups == 0, "zeropp quantize: groups must divide numel and be a multiple of "
                                     "nodes * devices_per_node * pipeline");
    const int64_t len = n / groups, contiguous = groups / (partitions * pipeline);
    TORCH_CHECK(bits == 8 || len % 2 == 0, "zeropp quantize: int4 needs an even group length");
    TORCH_CHECK(q.numel() == n * bits / 8 && params.numel() == groups, "zeropp quantize: wrong output sizes");
    const c10::Half* xp = x.data_ptr<c10::Half>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* pp = params.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / len);
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
        std::vector<float> buf(static_cast<size_t>(len));
        for (int64_t g = g0; g < g1; ++g) {
            for (int64_t i = 0; i < len; ++i) buf[i] = static_cast<float>(xp[g * len + i]);
            const int64_t o = swizzled_group(g, contiguous, pipeline, nodes, devices_per_node);
            quantize_group(buf.data(), len, static_cast<int>(bits), qp + o * len * bits / 8, pp + o);
        }
    });
}

void zeropp_dequantize_cpu(const at::Tensor& q, const at::Tensor& params, const at::Tensor& out, int64_t groups,
                           int64_t bits) {
    check_bits(bits);
    TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && params.scalar_type() == at::kFloat &&
                    params.is_contiguous() && out.is_contiguous(), "zeropp dequantize: contiguous int8 q, fp32 params");
    TORCH_CHECK(out.scalar_type() == at::kHalf || out.scalar_type() == at::kFloat,
                "zeropp dequantize: out must be fp16 or fp32");
    const int64_t n = out.numel();
    TORCH_CHECK(groups > 0 && n % groups == 0 && params.numel() >= groups && q.numel() * 8 == n * bits,
                "zeropp dequantize: groups must divide the values, with a param per group");
    const int64_t len = n / groups;
    const int8_t* qp = q.data_ptr<int8_t>();
    const float* pp = params.data_ptr<float>();
    c10::Half* half_out = out.scalar_type() == at::kHalf ? out.data_ptr<c10::Half>() : nullptr;
    float* float_out = half_out == nullptr ? out.data_ptr<float>() : nullptr;
    at::parallel_for(0, groups, std::max<int64_t>(1, (int64_t(1) << 15) / len), [&](int64_t g0, int64_t g1) {
        for (int64_t i = g0 * len; i < g1 * len; ++i) {
            const float v = static_cast<float>(code_at(qp, i, static_cast<int>(bits))) * pp[i / len];
            if (half_out != nullptr) {
                half_out[i] = c10::Half(v);
            } else {
                float_out[i] = v;
            }
        }
    });
}

void zeropp_quantized_reduction_cpu(const at::Tensor& q, const at::Tensor& params, const at::Tensor& out_q,
                                    const at::Tensor& out_params, int64_t in_groups, int64_t out_groups, int64_t bits,
                                    int64_t devices_per_node) {
    check_bits(bits);
    TORCH_CHECK(q.scalar_type() == at::kChar && out_q.scalar_type() == at::kChar && q.is_contiguous() &&
                    out_q.is_contiguous() && params.scalar_type() == at::kFloat && params.is_contiguous() &&
                    out_params.scalar_type() == at::kFloat && out_params.is_contiguous(),
                "zeropp quantized_reduction: contiguous int8 codes and fp32 params");
    const int64_t d = devices_per_node;
    TORCH_CHECK(d > 0 && q.numel() % d == 0 && in_groups % d == 0 && params.numel() >= in_groups,
                "zeropp quantized_reduction: devices_per_node must divide the input and in_groups");
    const int64_t n = q.numel() / d * 8 / bits;  // values per input chunk
    const int64_t in_per_chunk = in_groups / d;
    TORCH_CHECK(in_per_chunk > 0 && out_groups > 0 && n % in_per_chunk == 0 && n % out_groups == 0,
                "zeropp quantized_reduction: in_groups / devices_per_node and out_groups must divide a chunk");
    const int64_t in_len = n / in_per_chunk, out_len = n / out_groups;
    TORCH_CHECK(bits == 8 || out_len % 2 == 0, "zeropp quantized_reduction: int4 needs an even group length");
    TORCH_CHECK(out_q.numel() * 8 == n * bits && out_params.numel() == out_groups,
                "zeropp quantized_reduction: wrong output sizes");
    const int8_t* qp = q.data_ptr<int8_t>();
    const float* pp = params.data_ptr<float>();
    int8_t* oq = out_q.data_ptr<int8_t>();
    float* op = out_params.data_ptr<float>();
    const int b = static_cast<int>(bits);
    const int64_t chunk_bytes = n * bits / 8;
    at::parallel_for(0, out_groups, std::max<int64_t>(1, (int64_t(1) << 14) / (out_len * d)),
                     [&](int64_t g0, int64_t g1) {
        std::vector<float> sums(static_cast<size_t>(out_len));
        for (int64_t g = g0; g < g1; ++g) {
            for (int64_t k = 0; k < out_len; ++k) {
                const int64_t i = g * out_len + k;
                float acc = 0.0f;
                // Chunks in rank order, each value and each partial sum rounded to fp16 (fp32 holds the sum of
                // two fp16 values closely enough that rounding it to fp16 is the correctly rounded fp16 sum).
                for (int64_t j = 0; j < d; ++j) {
                    const float v = to_half_value(static_cast<float>(code_at(qp + j * chunk_bytes, i, b)) *
                                                  pp[j * in_per_chunk + i / in_len]);
                    acc = to_half_value(acc + v);
                }
                sums[k] = acc;
            }
            quantize_group(sums.data(), out_len, b, oq + g * out_len * bits / 8, op + g);
        }
    });
}

}  // namespace dsa
