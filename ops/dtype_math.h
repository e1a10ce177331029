// Element conversions and single-rounding float arithmetic shared by the CPU and the CUDA kernels.
//
// Every kernel computes in fp32 and rounds once into its output dtype. The helpers here are the only
// arithmetic the kernels use, so the CPU build (which the tests run) checks the same operations, in the same
// order, that the GPU runs. Two rules keep both bit-identical with the pure-torch reference:
//  * no fused multiply-add: the reference multiplies and adds in separate, separately rounded torch ops, so
//    device code uses the explicit round-to-nearest intrinsics (which nvcc never contracts) and host code is
//    compiled with -ffp-contract=off;
//  * bf16 is rounded to nearest-even with NaN mapped to a quiet NaN, as c10::BFloat16 does.
// No torch header is included: the CUDA kernels are compiled (and compile-checked) without torch.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define DSA_HD __host__ __device__ __forceinline__
#else
#define DSA_HD inline
#endif

namespace dsa {

// bf16 travels as its raw 16 bits: the kernels never depend on a bf16 class of torch or of CUDA.
typedef uint16_t bf16_bits;

DSA_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
#endif
}

DSA_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
#endif
}

DSA_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

DSA_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

DSA_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

DSA_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

DSA_HD float bf16_to_float(bf16_bits h) { return bits_float(static_cast<uint32_t>(h) << 16); }

DSA_HD bf16_bits float_to_bf16(float f) {
    uint32_t u = float_bits(f);
    // Written as a select (not an early return) so that the host compiler vectorises loops over it.
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return static_cast<bf16_bits>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

// Loads and stores of the two floating dtypes the ops accept, by storage type.
DSA_HD float load_float(const float* p, int64_t i) { return p[i]; }
DSA_HD float load_float(const bf16_bits* p, int64_t i) { return bf16_to_float(p[i]); }
DSA_HD void store_float(float* p, int64_t i, float v) { p[i] = v; }
DSA_HD void store_float(bf16_bits* p, int64_t i, float v) { p[i] = float_to_bf16(v); }

// |x| as the bits of a float: for every non-NaN float, comparing these as unsigned integers orders them as
// |x| does, and any NaN compares above +inf. An integer max over them is an absmax that also flags NaN.
DSA_HD uint32_t abs_bits(const float* p, int64_t i) { return float_bits(p[i]) & 0x7FFFFFFFu; }
DSA_HD uint32_t abs_bits(const bf16_bits* p, int64_t i) { return (static_cast<uint32_t>(p[i]) << 16) & 0x7FFFFFFFu; }

}  // namespace dsa
