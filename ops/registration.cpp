// The ops' schemas, in the torch.ops.ds_asynchzp namespace, and their CPU kernels' registration. The CUDA
// kernels register in cuda_ops.cpp (built only where CUDA is present). Every op writes into outputs its caller
// allocated (the Python wrappers in ds_asynchzp/ops/api.py), so none of them allocates, and the (a!)
// annotations tell torch which arguments they mutate.
#include <torch/library.h>

#include "cpu_kernels.h"

TORCH_LIBRARY(ds_asynchzp, m) {
    m.def("pack(Tensor[] srcs, Tensor(a!) out) -> ()");
    m.def("unpack(Tensor flat, Tensor(a!)[] outs) -> ()");
    m.def("unpack_gathered(Tensor recv, Tensor(a!)[] outs, int[] atoms, int group_size, int rows) -> ()");
    m.def("bucket_add(Tensor(a!) bucket, Tensor[] grads, int[] atoms, int group_size, int rows, float scale, "
          "bool accumulate) -> ()");
    m.def("quantize(Tensor x, Tensor(a!) q, Tensor(b!) scales, int bits, int block_size) -> ()");
    m.def("dequantize(Tensor q, Tensor scales, Tensor(a!) out, int bits, int block_size) -> ()");
    m.def("dequantize_reduce(Tensor chunks, Tensor scales, Tensor(a!) out, int bits, int block_size) -> ()");
    // DeepSpeed ZeRO++'s quantizer contract (cpu_zeropp.cpp; CPU only).
    m.def("zeropp_quantize(Tensor x, Tensor(a!) q, Tensor(b!) params, int groups, int bits, int pipeline, "
          "int nodes, int devices_per_node) -> ()");
    m.def("zeropp_dequantize(Tensor q, Tensor params, Tensor(a!) out, int groups, int bits) -> ()");
    m.def("zeropp_quantized_reduction(Tensor q, Tensor params, Tensor(a!) out_q, Tensor(b!) out_params, "
          "int in_groups, int out_groups, int bits, int devices_per_node) -> ()");
}

TORCH_LIBRARY_IMPL(ds_asynchzp, CPU, m) {
    m.impl("pack", &dsa::pack_cpu);
    m.impl("unpack", &dsa::unpack_cpu);
    m.impl("unpack_gathered", &dsa::unpack_gathered_cpu);
    m.impl("bucket_add", &dsa::bucket_add_cpu);
    m.impl("quantize", &dsa::quantize_cpu);
    m.impl("dequantize", &dsa::dequantize_cpu);
    m.impl("dequantize_reduce", &dsa::dequantize_reduce_cpu);
    m.impl("zeropp_quantize", &dsa::zeropp_quantize_cpu);
    m.impl("zeropp_dequantize", &dsa::zeropp_dequantize_cpu);
    m.impl("zeropp_quantized_reduction", &dsa::zeropp_quantized_reduction_cpu);
}
