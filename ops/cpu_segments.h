// How the CPU kernels split one op over threads.
//
// Every layout op (pack, unpack, the gather unpack, the bucket fill) is a list of segments: contiguous runs of
// its output, each fed by one contiguous run of one input. The segments tile a virtual output range [0, total)
// (virtual because the outputs may be several tensors), and the range, not the list, is what is split between
// threads: one huge tensor is shared by all threads, and thousands of small ones are not one task each.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace dsa {

// Seg must have `int64_t begin, len` (its place in the virtual output range); zero-length segments must not
// be in `segs`, and the segments must be sorted and contiguous. `fn(seg, offset, count)` handles elements
// [offset, offset + count) of one segment.
template <class Seg, class Fn>
void for_each_piece(const std::vector<Seg>& segs, int64_t total, int64_t grain, const Fn& fn) {
    if (total <= 0) return;
    at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
        auto it = std::upper_bound(segs.begin(), segs.end(), begin,
                                   [](int64_t value, const Seg& s) { return value < s.begin; });
        size_t k = static_cast<size_t>(it - segs.begin()) - 1;
        while (begin < end) {
            const Seg& s = segs[k];
            const int64_t offset = begin - s.begin;
            const int64_t count = std::min(s.len - offset, end - begin);
            fn(s, offset, count);
            begin += count;
            ++k;
        }
    });
}

// Elements per thread task: enough bytes that the fork costs nothing next to the copy.
inline int64_t grain_elements(int64_t element_size) {
    const int64_t bytes = int64_t(1) << 18;
    return std::max<int64_t>(1, bytes / std::max<int64_t>(1, element_size));
}

}  // namespace dsa
