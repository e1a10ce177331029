// Wide memory access for the CUDA kernels: 16-byte loads from any address, and the alignment tests that pick a
// kernel's wide path. Device code only; the arithmetic on the loaded values is dtype_math.h's.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace dsa {
namespace cuda {

__device__ __forceinline__ bool aligned_to(const void* p, unsigned bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// Bytes from `p` up to the next 16-byte boundary (0 when p is aligned).
__device__ __forceinline__ int64_t bytes_to_alignment(const void* p) {
    return static_cast<int64_t>((16u - (reinterpret_cast<uintptr_t>(p) & 15u)) & 15u);
}

// Reads byte `offset` onwards of the 32-byte window (a, b), as 16 bytes. Four cases so that every register index
// is a compile-time constant (a run-time index would move the window to local memory).
template <int WORD>
__device__ __forceinline__ uint4 window_at(const uint32_t (&w)[8], unsigned bits) {
    uint4 out;
    out.x = __funnelshift_r(w[WORD + 0], w[WORD + 1], bits);
    out.y = __funnelshift_r(w[WORD + 1], w[WORD + 2], bits);
    out.z = __funnelshift_r(w[WORD + 2], w[WORD + 3], bits);
    out.w = __funnelshift_r(w[WORD + 3], w[WORD + 4], bits);
    return out;
}

// 16 bytes starting at `p`, which need not be aligned: two aligned 16-byte loads and a funnel shift when it is
// not. Each aligned word read holds at least one of the 16 bytes asked for, so the read stays inside the
// allocation that holds them (device allocations are 16-byte granular). Neighbouring threads read the same
// aligned words, which the L1 cache serves: device-memory traffic stays one pass.
__device__ __forceinline__ uint4 load16(const char* p) {
    const unsigned shift = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) & 15u);
    const uint4* base = reinterpret_cast<const uint4*>(p - shift);
    const uint4 a = base[0];
    if (shift == 0) return a;
    const uint4 b = base[1];
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    const unsigned bits = (shift & 3u) * 8u;
    switch (shift >> 2) {
        case 0: return window_at<0>(w, bits);
        case 1: return window_at<1>(w, bits);
        case 2: return window_at<2>(w, bits);
        default: return window_at<3>(w, bits);
    }
}

__device__ __forceinline__ void store16(char* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

}  // namespace cuda
}  // namespace dsa
