// Scalar conversions shared by the CPU kernel and simple device code paths.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "formats.h"

namespace jsmla {

JSMLA_HD float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

JSMLA_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

JSMLA_HD float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }
// The two BF16 values of a 32-bit word (the low half first in memory): as floats.
JSMLA_HD float bf16_low_to_float(uint32_t word) { return bits_to_float(word << 16); }
JSMLA_HD float bf16_high_to_float(uint32_t word) { return bits_to_float(word & 0xffff0000u); }

// Round-to-nearest-even; NaN stays NaN.
JSMLA_HD uint16_t float_to_bf16(float f) {
  const uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7f/0xff are NaN.
JSMLA_HD float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exponent = (b >> 3) & 0xfu;
  const uint32_t mantissa = b & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return bits_to_float(sign | 0x7fc00000u);
  if (exponent == 0) {
    // Subnormal: mantissa/8 * 2^-6, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// FP4 e2m1 (the low 4 bits of `code`): 1 sign, 2 exponent, 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2,
// 3, 4, 6 (no infinities or NaN).
JSMLA_HD float fp4_e2m1_to_float(uint8_t code) {
  const uint32_t magnitude_code = code & 0x7u;
  const uint32_t exponent = magnitude_code >> 1;
  const float magnitude = exponent == 0 ? 0.5f * static_cast<float>(magnitude_code & 1u)
                                        : bits_to_float((exponent + 126u) << 23 | (magnitude_code & 1u) << 22);
  return (code & 0x8u) ? -magnitude : magnitude;
}

// UE8M0: 2^(b-127); 255 is NaN. Selects, not branches: the GPU loaders decode several scales a row.
JSMLA_HD float ue8m0_to_float(uint8_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 23;
  bits = b == 0 ? 0x00400000u : bits;    // 2^-127 (subnormal)
  bits = b == 0xffu ? 0x7fc00000u : bits;
  return bits_to_float(bits);
}

JSMLA_HD float load_fp32_le(const uint8_t* p) {
  const uint32_t bits = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                        (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
  return bits_to_float(bits);
}

JSMLA_HD uint16_t load_u16_le(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<uint16_t>(p[1]) << 8));
}

// Scale of group g of a row whose scales start at `scales`.
JSMLA_HD float group_scale(const FormatTraits& f, const uint8_t* scales, int g) {
  switch (f.scale_kind) {
    case ScaleKind::kFp32: return load_fp32_le(scales + 4 * g);
    case ScaleKind::kE4m3: return fp8_e4m3_to_float(scales[g]);
    default: return ue8m0_to_float(scales[g]);
  }
}

// Quantized lane i (< quant_dim) of a (data) row, before its group's scale: an FP8 byte, or a nibble of the
// FP4 bytes (lane 2i in the low nibble of byte i).
JSMLA_HD float quantized_lane(const FormatTraits& f, const uint8_t* row, int i) {
  if (f.quant_bits == 4) {
    const uint8_t pair = row[i / 2];
    return fp4_e2m1_to_float(i % 2 ? static_cast<uint8_t>(pair >> 4) : static_cast<uint8_t>(pair & 0xfu));
  }
  return fp8_e4m3_to_float(row[i]);
}

}  // namespace jsmla
