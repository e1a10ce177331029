// CUDA kernels registered for the ops' CUDA dispatch key: tensors in, segment tables and launches out.
//
// Built only where CUDA is present, by the host compiler (the kernels themselves are in cuda_layout.cu and
// cuda_quant.cu). A layout op becomes a table with one entry per contiguous run of its output (cuda_kernels.h),
// built on the host in time that grows with the runs, not the bytes, and reused on the device when the same call
// comes again (cuda_tables.h); the quantization ops launch directly.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "cuda_kernels.h"
#include "cuda_tables.h"
#include "tensor_runs.h"

namespace dsa {
namespace {

using cuda::CopySegment;
using cuda::FillSegment;

DeviceTables& device_tables() {
    static DeviceTables* tables = new DeviceTables();  // never destroyed: CUDA may be gone at exit
    return *tables;
}

void check_launch(cudaError_t err, const char* op) {
    TORCH_CHECK(err == cudaSuccess, "ds_asynchzp ", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* what) {
    TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "ds_asynchzp ops: ", what, " must be on ", like.device());
}

cuda::DType dtype_of(const at::Tensor& t, const char* what) {
    if (t.scalar_type() == at::kFloat) return cuda::kFloat32;
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, "ds_asynchzp ops: ", what, " must be fp32 or bf16");
    return cuda::kBFloat16;
}

// A copy table under construction: one segment per run, numbered in tiles.
struct CopyTable {
    std::vector<CopySegment> segments;
    int64_t tiles = 0;

    void add(const char* src, char* dst, int64_t bytes) {
        if (bytes <= 0) return;
        segments.push_back({src, dst, bytes, tiles});
        tiles += cuda::copy_tiles(bytes);
    }

    void run(const char* op) const {
        if (segments.empty()) return;
        const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
        at::Tensor scratch;
        const void* table = device_tables().get(segments, stream, scratch);
        check_launch(cuda::copy_segments(static_cast<const CopySegment*>(table),
                                         static_cast<int64_t>(segments.size()), tiles, stream),
                     op);
    }
};

void pack_cuda(at::TensorList srcs, const at::Tensor& out) {
    c10::cuda::CUDAGuard guard(out.device());
    TORCH_CHECK(out.is_contiguous(), "pack: out must be contiguous");
    const int64_t es = out.element_size();
    char* dst = static_cast<char*>(out.data_ptr());
    std::vector<at::Tensor> keep;
    CopyTable table;
    int64_t pos = 0;
    for (const at::Tensor& t : srcs) {
        check_cuda(t, out, "srcs");
        TORCH_CHECK(t.scalar_type() == out.scalar_type(), "pack: every source must have out's dtype");
        if (t.numel() == 0) continue;
        TORCH_CHECK(pos + t.numel() <= out.numel(), "pack: the sources hold more elements than out");
        Runs r = as_runs(t);
        const char* base = static_cast<const char*>(t.data_ptr());
        if (!r.ok) {
            keep.push_back(t.contiguous());
            base = static_cast<const char*>(keep.back().data_ptr());
            r = contiguous_runs(t.numel());
        }
        for (int64_t row = 0; row < r.rows; ++row, pos += r.cols) {
            table.add(base + row * r.stride * es, dst + pos * es, r.cols * es);
        }
    }
    TORCH_CHECK(pos == out.numel(), "pack: the sources hold ", pos, " elements, out ", out.numel());
    table.run("pack");
}

void unpack_cuda(const at::Tensor& flat, at::TensorList outs) {
    c10::cuda::CUDAGuard guard(flat.device());
    TORCH_CHECK(flat.is_contiguous(), "unpack: flat must be contiguous");
    const int64_t es = flat.element_size();
    const char* src = static_cast<const char*>(flat.data_ptr());
    std::vector<std::pair<at::Tensor, at::Tensor>> staged;
    CopyTable table;
    int64_t pos = 0;
    for (const at::Tensor& t : outs) {
        check_cuda(t, flat, "outs");
        TORCH_CHECK(t.scalar_type() == flat.scalar_type(), "unpack: every output must have flat's dtype");
        if (t.numel() == 0) continue;
        TORCH_CHECK(pos + t.numel() <= flat.numel(), "unpack: the outputs hold more elements than flat");
        Runs r = as_runs(t);
        char* base = static_cast<char*>(t.data_ptr());
        if (!r.ok) {
            staged.emplace_back(t, t.contiguous());
            base = static_cast<char*>(staged.back().second.data_ptr());
            r = contiguous_runs(t.numel());
        }
        for (int64_t row = 0; row < r.rows; ++row, pos += r.cols) {
            table.add(src + pos * es, base + row * r.stride * es, r.cols * es);
        }
    }
    TORCH_CHECK(pos == flat.numel(), "unpack: the outputs hold ", pos, " elements, flat ", flat.numel());
    table.run("unpack");
    for (auto& pair : staged) pair.first.copy_(pair.second);
}

void unpack_gathered_cuda(const at::Tensor& recv, at::TensorList outs, at::IntArrayRef atoms, int64_t group_size,
                          int64_t rows) {
    c10::cuda::CUDAGuard guard(recv.device());
    TORCH_CHECK(recv.is_contiguous(), "unpack_gathered: recv must be contiguous");
    TORCH_CHECK(outs.size() == atoms.size(), "unpack_gathered: one atom size per output");
    const int64_t es = recv.element_size(), d = group_size;
    int64_t width = 0;
    for (int64_t a : atoms) width += rows * a;
    TORCH_CHECK(recv.numel() == d * width, "unpack_gathered: recv must hold group_size * rows * sum(atoms)");
    const char* src = static_cast<const char*>(recv.data_ptr());
    std::vector<std::pair<at::Tensor, at::Tensor>> staged;
    CopyTable table;
    int64_t column = 0;
    for (size_t k = 0; k < outs.size(); ++k) {
        const at::Tensor& t = outs[k];
        const int64_t a = atoms[k], n = t.numel();
        check_cuda(t, recv, "outs");
        TORCH_CHECK(t.scalar_type() == recv.scalar_type(), "unpack_gathered: every output must have recv's dtype");
        TORCH_CHECK(n <= rows * d * a, "unpack_gathered: output ", k, " is larger than its gathered atoms");
        char* base = static_cast<char*>(t.data_ptr());
        if (!t.is_contiguous()) {
            staged.emplace_back(t, t.contiguous());
            base = static_cast<char*>(staged.back().second.data_ptr());
        }
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < d; ++j) {
                const int64_t first = (r * d + j) * a, len = std::min(a, n - first);
                if (len > 0) table.add(src + (j * width + column + r * a) * es, base + first * es, len * es);
            }
        }
        column += rows * a;
    }
    table.run("unpack_gathered");
    for (auto& pair : staged) pair.first.copy_(pair.second);
}

void bucket_add_cuda(const at::Tensor& bucket, at::TensorList grads, at::IntArrayRef atoms, int64_t group_size,
                     int64_t rows, double scale, bool accumulate) {
    c10::cuda::CUDAGuard guard(bucket.device());
    TORCH_CHECK(bucket.is_contiguous(), "bucket_add: bucket must be contiguous");
    TORCH_CHECK(grads.size() == atoms.size(), "bucket_add: one atom size per gradient");
    const cuda::DType bucket_type = dtype_of(bucket, "bucket");
    const int64_t d = group_size, bes = bucket.element_size();
    int64_t width = 0;
    for (int64_t a : atoms) width += rows * a;
    TORCH_CHECK(bucket.numel() == d * width, "bucket_add: bucket must hold group_size * rows * sum(atoms)");
    std::vector<at::Tensor> keep;
    std::vector<const char*> src(grads.size());
    for (size_t k = 0; k < grads.size(); ++k) {
        check_cuda(grads[k], bucket, "grads");
        dtype_of(grads[k], "gradients");
        TORCH_CHECK(grads[k].numel() <= rows * d * atoms[k], "bucket_add: gradient ", k, " is larger than its atoms");
        keep.push_back(grads[k].contiguous());
        src[k] = static_cast<const char*>(keep.back().data_ptr());
    }
    char* out = static_cast<char*>(bucket.data_ptr());
    // One segment per (member, gradient, row): its valid elements, then (when copying) its padding as a segment
    // without a source, which the kernel fills with zeros. Accumulating leaves the padding as it is.
    std::vector<FillSegment> segments;
    int64_t tiles = 0;
    auto add = [&](const char* from, char* to, int64_t len, int32_t type) {
        if (len <= 0) return;
        segments.push_back({from, to, len, tiles, type, 0});
        tiles += cuda::fill_tiles(len);
    };
    for (int64_t i = 0; i < d; ++i) {
        int64_t column = 0;
        for (size_t k = 0; k < grads.size(); ++k) {
            const int64_t a = atoms[k], n = grads[k].numel(), es = grads[k].element_size();
            const int32_t type = dtype_of(grads[k], "gradients");
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t first = (r * d + i) * a;
                char* dst = out + (i * width + column + r * a) * bes;
                const int64_t valid = std::max<int64_t>(0, std::min(a, n - first));
                add(src[k] + first * es, dst, valid, type);
                if (!accumulate) add(nullptr, dst + valid * bes, a - valid, type);
            }
            column += rows * a;
        }
    }
    if (segments.empty()) return;
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
    at::Tensor scratch;
    const void* table = device_tables().get(segments, stream, scratch);
    check_launch(cuda::fill_segments(static_cast<const FillSegment*>(table), static_cast<int64_t>(segments.size()),
                                     tiles, bucket_type, static_cast<float>(scale), accumulate, stream),
                 "bucket_add");
}

void check_quant_args(int64_t bits, int64_t block_size) {
    TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
    TORCH_CHECK(block_size > 0 && (bits == 8 || block_size % 2 == 0), "block_size must be > 0 (and even for int4)");
}

void quantize_cuda(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t bits,
                   int64_t block_size) {
    c10::cuda::CUDAGuard guard(x.device());
    check_quant_args(bits, block_size);
    check_cuda(q, x, "q");
    check_cuda(scales, x, "scales");
    TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && scales.is_contiguous(), "quantize: contiguous tensors");
    const int64_t n = x.numel();
    TORCH_CHECK(q.numel() == (bits == 8 ? n : (n + 1) / 2) && q.element_size() == 1, "quantize: q has the wrong size");
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == (n + block_size - 1) / block_size,
                "quantize: scales must be fp32 with one value per block");
    check_launch(cuda::quantize(dtype_of(x, "x"), x.data_ptr(), n, static_cast<int>(bits), block_size, q.data_ptr(),
                                static_cast<float*>(scales.data_ptr()), c10::cuda::getCurrentCUDAStream()),
                 "quantize");
}

void dequantize_cuda(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& out, int64_t bits,
                     int64_t block_size) {
    c10::cuda::CUDAGuard guard(out.device());
    check_quant_args(bits, block_size);
    check_cuda(q, out, "q");
    check_cuda(scales, out, "scales");
    TORCH_CHECK(q.is_contiguous() && scales.is_contiguous() && out.is_contiguous(), "dequantize: contiguous tensors");
    const int64_t n = out.numel();
    TORCH_CHECK(q.element_size() == 1 && q.numel() >= (bits == 8 ? n : (n + 1) / 2), "dequantize: q is too small");
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() >= (n + block_size - 1) / block_size,
                "dequantize: too few fp32 scales");
    check_launch(cuda::dequantize(dtype_of(out, "out"), q.data_ptr(), static_cast<const float*>(scales.data_ptr()),
                                  out.data_ptr(), n, static_cast<int>(bits), block_size,
                                  c10::cuda::getCurrentCUDAStream()),
                 "dequantize");
}

void dequantize_reduce_cuda(const at::Tensor& chunks, const at::Tensor& scales, const at::Tensor& out, int64_t bits,
                            int64_t block_size) {
    c10::cuda::CUDAGuard guard(out.device());
    check_quant_args(bits, block_size);
    check_cuda(chunks, out, "chunks");
    check_cuda(scales, out, "scales");
    TORCH_CHECK(chunks.dim() == 2 && scales.dim() == 2 && chunks.size(0) == scales.size(0),
                "dequantize_reduce: chunks [k, bytes] and scales [k, blocks]");
    TORCH_CHECK(chunks.element_size() == 1 && scales.scalar_type() == at::kFloat,
                "dequantize_reduce: int8/uint8 chunks, fp32 scales");
    TORCH_CHECK((chunks.size(1) <= 1 || chunks.stride(1) == 1) && (scales.size(1) <= 1 || scales.stride(1) == 1),
                "dequantize_reduce: rows of chunks and scales must be contiguous");
    TORCH_CHECK(out.is_contiguous(), "dequantize_reduce: out must be contiguous");
    const int64_t n = out.numel();
    TORCH_CHECK(chunks.size(1) >= (bits == 8 ? n : (n + 1) / 2), "dequantize_reduce: chunks are too small for out");
    TORCH_CHECK(scales.size(1) >= (n + block_size - 1) / block_size, "dequantize_reduce: too few scales for out");
    check_launch(cuda::dequantize_reduce(dtype_of(out, "out"), static_cast<const uint8_t*>(chunks.data_ptr()),
                                         chunks.stride(0), static_cast<const float*>(scales.data_ptr()),
                                         scales.stride(0), chunks.size(0), out.data_ptr(), n, static_cast<int>(bits),
                                         block_size, c10::cuda::getCurrentCUDAStream()),
                 "dequantize_reduce");
}

}  // namespace
}  // namespace dsa

TORCH_LIBRARY_IMPL(ds_asynchzp, CUDA, m) {
    m.impl("pack", &dsa::pack_cuda);
    m.impl("unpack", &dsa::unpack_cuda);
    m.impl("unpack_gathered", &dsa::unpack_gathered_cuda);
    m.impl("bucket_add", &dsa::bucket_add_cuda);
    m.impl("quantize", &dsa::quantize_cuda);
    m.impl("dequantize", &dsa::dequantize_cuda);
    m.impl("dequantize_reduce", &dsa::dequantize_reduce_cuda);
}
