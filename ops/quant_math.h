// Per-block arithmetic of symmetric absmax quantization, shared by the CPU and the CUDA kernels.
//
// A block of `block_size` consecutive values gets one fp32 scale s; each value x becomes the integer
// q = round_half_even(x / s), |q| <= QMAX (127 for int8, 7 for int4), and dequantizes to q * s.
//
// The scale is absmax / QMAX, nudged by one ulp where needed so that two properties hold for every finite
// block, subnormal and near-FLT_MAX ones included:
//  * s * QMAX >= absmax, so |x / s| <= QMAX and no value is clipped: |x - q*s| <= s/2 (plus fp32 rounding);
//  * s * QMAX is finite, so dequantizing never overflows to inf.
// A block holding inf or NaN gets s = NaN and q = 0: every value of it dequantizes to NaN (see docs/ops.md).
// A block of zeros gets s = 0 and q = 0.
#pragma once

#include "dtype_math.h"

namespace dsa {

static const uint32_t kInfBits = 0x7F800000u;
static const uint32_t kQuietNaNBits = 0x7FC00000u;
static const uint32_t kMaxFiniteBits = 0x7F7FFFFFu;

template <int BITS>
struct Quant {
    static_assert(BITS == 8 || BITS == 4, "8 or 4 bits");
    static constexpr int qmax = BITS == 8 ? 127 : 7;
};

// The scale of a block from the integer max of its abs_bits() (see dtype_math.h).
DSA_HD float block_scale(uint32_t absmax_bits, int qmax_int) {
    if (absmax_bits >= kInfBits) return bits_float(kQuietNaNBits);
    const float qmax = static_cast<float>(qmax_int);
    const float absmax = bits_float(absmax_bits);
    float s = div_rn(absmax, qmax);
    // One ulp up (s >= 0 here, so the next float up is the next bit pattern): this also lifts a scale that
    // underflowed to 0 for a nonzero subnormal block to the smallest subnormal.
    if (mul_rn(s, qmax) < absmax) s = bits_float(float_bits(s) + 1u);
    // One ulp down where s * QMAX overflowed (absmax within QMAX ulps of FLT_MAX). x / s may then exceed QMAX
    // by a relative 2^-23, which still rounds to QMAX.
    if (float_bits(mul_rn(s, qmax)) > kMaxFiniteBits) s = bits_float(float_bits(s) - 1u);
    return s;
}

// Round to nearest, ties to even, for |v| < 2^22: adding and removing 1.5 * 2^23 leaves no fraction bits.
// Plain additions, so the host compiler vectorises it without SSE4.1's round instruction.
DSA_HD float round_half_even(float v) {
    const float magic = 12582912.0f;  // 1.5 * 2^23
    return sub_rn(add_rn(v, magic), magic);
}

// The integer of one value of a block whose scale s is finite and > 0. The clamp is a guard only: the scale's
// construction already keeps |x / s| <= QMAX.
DSA_HD int quantize_value(float x, float s, int qmax_int) {
    const float qmax = static_cast<float>(qmax_int);
    float v = round_half_even(div_rn(x, s));
    v = v > qmax ? qmax : v;
    v = v < -qmax ? -qmax : v;
    return static_cast<int>(v);
}

DSA_HD float dequantize_value(int q, float s) { return mul_rn(static_cast<float>(q), s); }

// int4: two's-complement nibbles, element 2i in the low nibble of byte i, element 2i+1 in the high one.
DSA_HD uint8_t pack_nibbles(int lo, int hi) {
    return static_cast<uint8_t>((static_cast<unsigned>(lo) & 0xFu) | ((static_cast<unsigned>(hi) & 0xFu) << 4));
}
DSA_HD int low_nibble(uint8_t b) { return static_cast<int>((b & 0xFu) ^ 0x8u) - 8; }
DSA_HD int high_nibble(uint8_t b) { return static_cast<int>((b >> 4) ^ 0x8u) - 8; }

}  // namespace dsa
