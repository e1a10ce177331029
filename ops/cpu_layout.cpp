// CPU kernels of the layout ops: pack, unpack, unpack_gathered (the parameter gather's transpose into atom
// order) and bucket_add (the gradient bucket's transposed, padded, scaled fill). Shapes and layouts are
// specified by ds_asynchzp/ops/reference.py; the wrappers in ds_asynchzp/ops/api.py validate arguments and
// allocate outputs, the checks here only guard memory safety.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_segments.h"
#include "dtype_math.h"
#include "tensor_runs.h"

namespace dsa {
namespace {

struct ByteSeg {
    int64_t begin, len;  // elements, in the op's virtual output range
    const char* src;
    char* dst;
};

// memcpy in pieces of at most this many bytes: above about 3/4 of the last-level cache per call, glibc's memcpy
// switches to non-temporal stores, measured 35% slower than cached stores here when two threads copy at once.
const int64_t kMemcpyPiece = int64_t(1) << 20;

void copy_segments(const std::vector<ByteSeg>& segs, int64_t total, int64_t es) {
    for_each_piece(segs, total, grain_elements(es), [es](const ByteSeg& s, int64_t offset, int64_t count) {
        const char* from = s.src + offset * es;
        char* to = s.dst + offset * es;
        for (int64_t done = 0, bytes = count * es; done < bytes; done += kMemcpyPiece) {
            std::memcpy(to + done, from + done, static_cast<size_t>(std::min(kMemcpyPiece, bytes - done)));
        }
    });
}

void check_cpu(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu(), "ds_asynchzp ops: ", what, " must be a CPU tensor");
}

}  // namespace

void pack_cpu(at::TensorList srcs, const at::Tensor& out) {
    check_cpu(out, "out");
    TORCH_CHECK(out.is_contiguous(), "pack: out must be contiguous");
    const int64_t es = out.element_size();
    char* dst = static_cast<char*>(out.data_ptr());
    std::vector<at::Tensor> keep;  // contiguous copies of sources that are not row runs
    std::vector<ByteSeg> segs;
    int64_t pos = 0;
    for (const at::Tensor& t : srcs) {
        check_cpu(t, "srcs");
        TORCH_CHECK(t.scalar_type() == out.scalar_type(), "pack: every source must have out's dtype");
        if (t.numel() == 0) continue;
        Runs r = as_runs(t);
        const char* base;
        if (r.ok) {
            base = static_cast<const char*>(t.data_ptr());
        } else {
            keep.push_back(t.contiguous());
            base = static_cast<const char*>(keep.back().data_ptr());
            r = contiguous_runs(t.numel());
        }
        TORCH_CHECK(pos + t.numel() <= out.numel(), "pack: the sources hold more elements than out");
        for (int64_t row = 0; row < r.rows; ++row) {
            segs.push_back({pos, r.cols, base + row * r.stride * es, dst + pos * es});
            pos += r.cols;
        }
    }
    TORCH_CHECK(pos == out.numel(), "pack: the sources hold ", pos, " elements, out ", out.numel());
    copy_segments(segs, pos, es);
}

void unpack_cpu(const at::Tensor& flat, at::TensorList outs) {
    check_cpu(flat, "flat");
    TORCH_CHECK(flat.is_contiguous(), "unpack: flat must be contiguous");
    const int64_t es = flat.element_size();
    const char* src = static_cast<const char*>(flat.data_ptr());
    std::vector<std::pair<at::Tensor, at::Tensor>> staged;  // (out, contiguous stand-in written first)
    std::vector<ByteSeg> segs;
    int64_t pos = 0;
    for (const at::Tensor& t : outs) {
        check_cpu(t, "outs");
        TORCH_CHECK(t.scalar_type() == flat.scalar_type(), "unpack: every output must have flat's dtype");
        if (t.numel() == 0) continue;
        Runs r = as_runs(t);
        char* base;
        if (r.ok) {
            base = static_cast<char*>(t.data_ptr());
        } else {
            staged.emplace_back(t, t.contiguous());
            base = static_cast<char*>(staged.back().second.data_ptr());
            r = contiguous_runs(t.numel());
        }
        TORCH_CHECK(pos + t.numel() <= flat.numel(), "unpack: the outputs hold more elements than flat");
        for (int64_t row = 0; row < r.rows; ++row) {
            segs.push_back({pos, r.cols, src + pos * es, base + row * r.stride * es});
            pos += r.cols;
        }
    }
    TORCH_CHECK(pos == flat.numel(), "unpack: the outputs hold ", pos, " elements, flat ", flat.numel());
    copy_segments(segs, pos, es);
    for (auto& pair : staged) pair.first.copy_(pair.second);
}

void unpack_gathered_cpu(const at::Tensor& recv, at::TensorList outs, at::IntArrayRef atoms, int64_t group_size,
                         int64_t rows) {
    check_cpu(recv, "recv");
    TORCH_CHECK(recv.is_contiguous(), "unpack_gathered: recv must be contiguous");
    TORCH_CHECK(static_cast<int64_t>(outs.size()) == static_cast<int64_t>(atoms.size()),
                "unpack_gathered: one atom size per output");
    const int64_t es = recv.element_size(), d = group_size;
    int64_t width = 0;
    for (int64_t a : atoms) width += rows * a;
    TORCH_CHECK(recv.numel() == d * width, "unpack_gathered: recv must hold group_size * rows * sum(atoms)");
    const char* src = static_cast<const char*>(recv.data_ptr());
    std::vector<std::pair<at::Tensor, at::Tensor>> staged;
    std::vector<ByteSeg> segs;
    int64_t pos = 0, column = 0;
    for (size_t k = 0; k < outs.size(); ++k) {
        const at::Tensor& t = outs[k];
        const int64_t a = atoms[k], n = t.numel();
        check_cpu(t, "outs");
        TORCH_CHECK(t.scalar_type() == recv.scalar_type(), "unpack_gathered: every output must have recv's dtype");
        TORCH_CHECK(n <= rows * d * a, "unpack_gathered: output ", k, " is larger than its gathered atoms");
        char* base;
        if (t.is_contiguous()) {
            base = static_cast<char*>(t.data_ptr());
        } else {
            staged.emplace_back(t, t.contiguous());
            base = static_cast<char*>(staged.back().second.data_ptr());
        }
        // Atom t*d + j of the parameter is member j's row t: recv[j, column + t*a : column + (t+1)*a].
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < d; ++j) {
                const int64_t first = (r * d + j) * a;
                const int64_t len = std::min(a, n - first);
                if (len <= 0) continue;
                segs.push_back({pos, len, src + (j * width + column + r * a) * es, base + first * es});
                pos += len;
            }
        }
        column += rows * a;
    }
    copy_segments(segs, pos, es);
    for (auto& pair : staged) pair.first.copy_(pair.second);
}

namespace {

struct FillSeg {
    int64_t begin, len;  // elements of the bucket
    const void* src;     // the gradient, from the element this segment starts at
    int64_t valid;       // elements of len that come from the gradient; the rest is padding
    at::ScalarType src_type;
};

template <class S, class D, bool ACCUMULATE>
void fill_piece(const S* src, D* dst, int64_t valid, int64_t count, float scale) {
    for (int64_t i = 0; i < valid; ++i) {
        float v = mul_rn(load_float(src, i), scale);
        if (ACCUMULATE) v = add_rn(load_float(dst, i), v);
        store_float(dst, i, v);
    }
    // Copying writes the padding's zeros; accumulating adds zeros, so it leaves the padding untouched.
    if (!ACCUMULATE) {
        for (int64_t i = valid; i < count; ++i) store_float(dst, i, 0.0f);
    }
}

template <class D, bool ACCUMULATE>
void fill(const FillSeg& s, int64_t offset, int64_t count, D* bucket, float scale) {
    D* dst = bucket + s.begin + offset;
    const int64_t valid = std::max<int64_t>(0, std::min(count, s.valid - offset));
    if (s.src_type == at::kFloat) {
        fill_piece<float, D, ACCUMULATE>(static_cast<const float*>(s.src) + offset, dst, valid, count, scale);
    } else {
        fill_piece<bf16_bits, D, ACCUMULATE>(static_cast<const bf16_bits*>(s.src) + offset, dst, valid, count,
                                             scale);
    }
}

template <class D>
void fill_bucket(const std::vector<FillSeg>& segs, int64_t total, D* bucket, float scale, bool accumulate) {
    const int64_t grain = grain_elements(sizeof(D) + sizeof(float));
    if (accumulate) {
        for_each_piece(segs, total, grain, [&](const FillSeg& g, int64_t offset, int64_t count) {
            fill<D, true>(g, offset, count, bucket, scale);
        });
    } else {
        for_each_piece(segs, total, grain, [&](const FillSeg& g, int64_t offset, int64_t count) {
            fill<D, false>(g, offset, count, bucket, scale);
        });
    }
}

bool is_float_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

}  // namespace

void bucket_add_cpu(const at::Tensor& bucket, at::TensorList grads, at::IntArrayRef atoms, int64_t group_size,
                    int64_t rows, double scale, bool accumulate) {
    check_cpu(bucket, "bucket");
    TORCH_CHECK(bucket.is_contiguous(), "bucket_add: bucket must be contiguous");
    TORCH_CHECK(is_float_type(bucket.scalar_type()), "bucket_add: bucket must be fp32 or bf16");
    TORCH_CHECK(grads.size() == atoms.size(), "bucket_add: one atom size per gradient");
    const int64_t d = group_size;
    int64_t width = 0;
    for (int64_t a : atoms) width += rows * a;
    TORCH_CHECK(bucket.numel() == d * width, "bucket_add: bucket must hold group_size * rows * sum(atoms)");
    std::vector<at::Tensor> keep;
    std::vector<const void*> src(grads.size());
    for (size_t k = 0; k < grads.size(); ++k) {
        const at::Tensor& g = grads[k];
        check_cpu(g, "grads");
        TORCH_CHECK(is_float_type(g.scalar_type()), "bucket_add: gradients must be fp32 or bf16");
        TORCH_CHECK(g.numel() <= rows * d * atoms[k], "bucket_add: gradient ", k, " is larger than its atoms");
        if (g.is_contiguous()) {
            src[k] = g.data_ptr();
        } else {
            keep.push_back(g.contiguous());
            src[k] = keep.back().data_ptr();
        }
    }
    // Bucket row i (member i) holds, per gradient, its atoms i + r*d for r < rows: atom (r*d + i) of gradient
    // k lands at column offset_k + r*a_k. Walked in bucket order so the segments are sorted.
    std::vector<FillSeg> segs;
    for (int64_t i = 0; i < d; ++i) {
        int64_t column = 0;
        for (size_t k = 0; k < grads.size(); ++k) {
            const int64_t a = atoms[k], n = grads[k].numel();
            const int64_t es = grads[k].element_size();
            for (int64_t r = 0; r < rows && a > 0; ++r) {
                const int64_t first = (r * d + i) * a;
                const int64_t valid = std::max<int64_t>(0, std::min(a, n - first));
                const char* from = static_cast<const char*>(src[k]) + (valid > 0 ? first * es : 0);
                segs.push_back({i * width + column + r * a, a, from, valid, grads[k].scalar_type()});
            }
            column += rows * a;
        }
    }
    const float s = static_cast<float>(scale);
    if (bucket.scalar_type() == at::kFloat) {
        fill_bucket(segs, d * width, static_cast<float*>(bucket.data_ptr()), s, accumulate);
    } else {
        fill_bucket(segs, d * width, static_cast<bf16_bits*>(bucket.data_ptr()), s, accumulate);
    }
}

}  // namespace dsa
