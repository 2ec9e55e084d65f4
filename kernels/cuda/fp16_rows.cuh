// FP16 rows scaled by a power of two: how the Hopper 64-head tile holds rows with arbitrary FP32 scales
// when JSMLA_HOPPER_FP16_SCALED_TILE is on (hopper/config.h: kFp16Tile). A row of K (or of Q) is
// stored as its values times 2^-E rounded once to FP16, E chosen from the row's largest magnitude so
// that every value is below 2^15 (FP16's largest finite value is 65504) and the largest at least
// 2^14 (values 2^28 times smaller still keep FP16's full precision). The factor 2^E goes back in FP32:
// onto the scores and P (sparse_mla_kernel.cuh). The loader (load_tile.cuh: convert_fp16_row) and
// the kernel's Q pass share these pieces.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/device_utils.cuh"

namespace jsmla::cuda::fp16_rows {

// The exponent of a masked candidate (no row): below every row's E, and never turned into a factor.
inline constexpr int kNoExponent = -(1 << 20);
// E's range: 2^-E and 2^E are both normal floats.
inline constexpr int kMinExponent = -126;
inline constexpr int kMaxExponent = 126;
// A row's largest value times 2^-E lies in [2^kTopExponent, 2^(kTopExponent + 1)).
inline constexpr int kTopExponent = 14;

// E of a row whose largest magnitude has the float bits `max_bits` (non-negative; infinity and NaN
// give the largest E, zero and subnormals the smallest).
JSMLA_DEVICE int row_exponent(uint32_t max_bits) {
  const int exponent = static_cast<int>(min(max_bits >> 23, 255u)) - 127;
  return max(kMinExponent, min(kMaxExponent, exponent - kTopExponent));
}

// 2^e for e in [kMinExponent, kMaxExponent] (a normal float, built from its exponent field).
JSMLA_DEVICE float power_of_two(int e) { return __uint_as_float(static_cast<uint32_t>(e + 127) << 23); }

// 2^d for d <= 0, zero below 2^-126 (the factor of a value d binades below the largest).
JSMLA_DEVICE float power_of_two_below(int d) { return d < kMinExponent ? 0.0f : power_of_two(d); }

// The larger magnitude of the two BF16 values of a word, as float bits.
JSMLA_DEVICE uint32_t bf16x2_max_bits(uint32_t word) {
  const uint32_t magnitudes = word & 0x7fff7fffu;
  return max(magnitudes >> 16, magnitudes & 0xffffu) << 16;
}

// Two floats rounded once to an FP16 pair (lo in the low half).
JSMLA_DEVICE uint32_t pack_f16x2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Two BF16 values (a word) times `factor`, rounded once to an FP16 pair.
JSMLA_DEVICE uint32_t bf16x2_to_f16x2(uint32_t word, float factor) {
  return pack_f16x2(__uint_as_float(word << 16) * factor, __uint_as_float(word & 0xffff0000u) * factor);
}

// Eight BF16 values times `factor` as eight FP16 values.
JSMLA_DEVICE uint4 bf16x8_to_f16x8(uint4 values, float factor) {
  return make_uint4(bf16x2_to_f16x2(values.x, factor), bf16x2_to_f16x2(values.y, factor),
                    bf16x2_to_f16x2(values.z, factor), bf16x2_to_f16x2(values.w, factor));
}

// The largest magnitude of eight BF16 values, as float bits.
JSMLA_DEVICE uint32_t bf16x8_max_bits(uint4 values) {
  return max(max(bf16x2_max_bits(values.x), bf16x2_max_bits(values.y)),
             max(bf16x2_max_bits(values.z), bf16x2_max_bits(values.w)));
}

// The maximum of `value` over the four lanes of a quad (lanes 4k .. 4k + 3 of a full warp).
JSMLA_DEVICE uint32_t quad_max(uint32_t value) {
  value = max(value, __shfl_xor_sync(0xffffffffu, value, 1));
  return max(value, __shfl_xor_sync(0xffffffffu, value, 2));
}
JSMLA_DEVICE int quad_max(int value) {
  value = max(value, __shfl_xor_sync(0xffffffffu, value, 1));
  return max(value, __shfl_xor_sync(0xffffffffu, value, 2));
}

}  // namespace jsmla::cuda::fp16_rows
