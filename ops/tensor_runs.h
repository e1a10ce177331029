// A tensor seen as equally spaced runs of contiguous elements, for the host side of the layout ops.
//
// Every strided view the engine hands to pack/unpack is of this shape: a parameter's [rows, atom] columns of
// a [rows, width] shard buffer are `rows` runs of `atom` elements, `width` apart. Such a view is copied run
// by run, without a contiguous temporary; any other layout is staged through one.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace dsa {

struct Runs {
    int64_t rows = 0, cols = 0, stride = 0;  // elements
    bool ok = false;                         // false: not expressible as runs
};

inline Runs as_runs(const at::Tensor& t) {
    Runs r;
    if (t.numel() == 0) {
        r.ok = true;
        return r;
    }
    // Collapse from the innermost dimension: a dimension merges into the one inside it when its stride steps
    // exactly over it. Size-1 dimensions carry no layout and are dropped.
    std::vector<std::pair<int64_t, int64_t>> dims;  // (size, stride), innermost first
    for (int64_t d = t.dim() - 1; d >= 0; --d) {
        const int64_t size = t.size(d), stride = t.stride(d);
        if (size == 1) continue;
        if (!dims.empty() && stride == dims.back().first * dims.back().second) {
            dims.back().first *= size;
        } else {
            dims.emplace_back(size, stride);
        }
    }
    if (dims.empty()) dims.emplace_back(1, 1);
    if (dims.size() > 2 || dims[0].second != 1) return r;
    r.cols = dims[0].first;
    r.rows = dims.size() == 2 ? dims[1].first : 1;
    r.stride = dims.size() == 2 ? dims[1].second : r.cols;
    r.ok = true;
    return r;
}

// Runs of a tensor that is not expressible as runs are read from (or written to) a contiguous stand-in.
inline Runs contiguous_runs(int64_t numel) {
    Runs r;
    r.rows = 1, r.cols = numel, r.stride = numel, r.ok = true;
    return r;
}

}  // namespace dsa
