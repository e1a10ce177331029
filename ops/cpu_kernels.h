// The CPU kernels (cpu_layout.cpp, cpu_quant.cpp, cpu_zeropp.cpp), declared for registration.cpp. Kept apart from
// torch/library.h, the heaviest header of the build, which only registration.cpp compiles.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dsa {

void pack_cpu(at::TensorList srcs, const at::Tensor& out);
void unpack_cpu(const at::Tensor& flat, at::TensorList outs);
void unpack_gathered_cpu(const at::Tensor& recv, at::TensorList outs, at::IntArrayRef atoms, int64_t group_size,
                         int64_t rows);
void bucket_add_cpu(const at::Tensor& bucket, at::TensorList grads, at::IntArrayRef atoms, int64_t group_size,
                    int64_t rows, double scale, bool accumulate);
void quantize_cpu(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t bits,
                  int64_t block_size);
void dequantize_cpu(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& out, int64_t bits,
                    int64_t block_size);
void dequantize_reduce_cpu(const at::Tensor& chunks, const at::Tensor& scales, const at::Tensor& out, int64_t bits,
                           int64_t block_size);
// cpu_zeropp.cpp: DeepSpeed ZeRO++'s quantizer contract.
void zeropp_quantize_cpu(const at::Tensor& x, const at::Tensor& q, const at::Tensor& params, int64_t groups,
                         int64_t bits, int64_t pipeline, int64_t nodes, int64_t devices_per_node);
void zeropp_dequantize_cpu(const at::Tensor& q, const at::Tensor& params, const at::Tensor& out, int64_t groups,
                           int64_t bits);
void zeropp_quantized_reduction_cpu(const at::Tensor& q, const at::Tensor& params, const at::Tensor& out_q,
                                    const at::Tensor& out_params, int64_t in_groups, int64_t out_groups, int64_t bits,
                                    int64_t devices_per_node);

}  // namespace dsa
