// Gathering one tile of candidate KV rows into shared memory as BF16: the per-format half of every
// CUDA kernel. Addresses come from CacheView, validity from CandidateList (kernels/common).
//
// Two steps per tile, both done by every thread of the block on the same bytes, so a thread only
// ever reads staging bytes its own cp.async wrote (no barrier between landing and conversion):
//   issue():   16-byte cp.async of the row's payload (quantized lanes, then BF16 lanes) into a staging
//              row, plus the row's scale record into the thread's private scale slot;
//   convert(): staging → BF16 tile row, FP8 × scale computed in FP32 and rounded to BF16 once, FP4 ×
//              E4M3 scale computed exactly in BF16 (a product of a 2-bit and a 4-bit significand); a
//              masked row is zero-filled and its payload never read.
// Arbitrary FP32 scales (kExactScales: glm_*) are never rounded to 16 bits: a scale s = 2^e · m
// (m in [1, 2)) is split, the tile holds FP8 × 2^e (exact in BF16), and the kernel applies the
// mantissas m in FP32 — to the partial scores per group of K lanes and to P per group of V lanes —
// from the per-row factors write_factors() leaves in shared memory.
// Which thread loads which bytes, and every size: loader_geometry.h.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/common/cache_view.h"
#include "kernels/common/numeric.h"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/loader_geometry.h"

namespace jsmla::cuda {

template <FormatId kFormat, int kCandidateTile, int kThreads, int kLaneSlices = 1>
struct TileLoader : LoaderGeometry<kFormat, kCandidateTile, kThreads, kLaneSlices> {
  using Geometry = LoaderGeometry<kFormat, kCandidateTile, kThreads, kLaneSlices>;
  using Geometry::kBf16Units;
  using Geometry::kExactScales;
  using Geometry::kF;
  using Geometry::kFactorFloats;
  using Geometry::kNumGroups;
  using Geometry::kQuantUnits;
  using Geometry::kScaleRecordBytes;
  using Geometry::kThreadsPerRow;
  using Geometry::kUnits;
  using Geometry::kUnitsPerThread;

  // Whether lane slice `slice` gathers unit `unit` of a row: every quantized unit of its own lanes; the
  // BF16 units in slice 0 only, or (kSplitTrailing) each slice its kBf16Units / kLaneSlices consecutive
  // ones. The units a slice does not gather stay as they are in its staging area.
  template <bool kSplitTrailing>
  static JSMLA_DEVICE bool slice_gathers(int unit, int slice) {
    if (kLaneSlices == 1 || unit < kQuantUnits) return true;
    if constexpr (kSplitTrailing) return (unit - kQuantUnits) / (kBf16Units / kLaneSlices) == slice;
    return slice <= 0;  // slice 0 (written as the test it replaced, which keeps the SASS unchanged)
  }

  // Starts the copies of this thread's units of one candidate row (slot must be valid). kLaneSlices > 1:
  // of lane slice `slice` of the row (its quantized bytes and the BF16 units slice_gathers gives it) and
  // the whole scale record (slice s's scales start s * kSliceScaleBytes into the slot).
  template <bool kSplitTrailing = false>
  static JSMLA_DEVICE void issue(const CacheView& cache, int64_t slot, uint8_t* staged_row, uint8_t* scale_slot,
                                 int sub, int slice = 0) {
    const uint8_t* row = cache.data_row(slot);
    const uint8_t* const trailing = row;  // the BF16 lanes' offset is from the row's start
    if constexpr (kLaneSlices > 1) row += slice * kF.quant_bytes();  // this slice's quantized lanes
#pragma unroll
    for (int i = 0; i < kUnitsPerThread; ++i) {
      const int unit = sub + i * kThreadsPerRow;
      if (!slice_gathers<kSplitTrailing>(unit, slice)) continue;
      if (unit < kUnits) {
        // (Without the split only slice 0, whose row is not moved, gathers the BF16 lanes.)
        const uint8_t* source = unit < kQuantUnits ? row + 16 * unit
                                                   : (kSplitTrailing ? trailing : row) + kF.bf16_offset +
                                                         16 * (unit - kQuantUnits);
        cp_async_16(staged_row + 16 * unit, source);
      }
    }
    constexpr FormatTraits format = kF;  // a device-side copy: CacheView takes the traits by reference
    if constexpr (kScaleRecordBytes == 8) {
      cp_async_8(scale_slot, cache.scales(format, slot));
    } else {
#pragma unroll
      for (int offset = 0; offset < kScaleRecordBytes; offset += 16) {
        cp_async_16(scale_slot + offset, cache.scales(format, slot) + offset);
      }
    }
  }

  // Bytes from a scale slot that issue() filled to the scales of lane slice 1 (0 without slices).
  static constexpr int kSliceScaleBytes = kLaneSlices > 1 ? kNumGroups * kF.scale_bytes() : 0;

  // Writes this thread's units of one tile row: dequantized when `valid`, zeros otherwise.
  static JSMLA_DEVICE void convert(bool valid, const uint8_t* staged_row, const uint8_t* scale_slot,
                                   uint16_t* tile_row, int sub) {
    convert_into(valid, staged_row, scale_slot, sub,
                 [&](int first_dim, uint4 values) { *reinterpret_cast<uint4*>(tile_row + first_dim) = values; });
  }

  // The same for any tile layout: store(first_dim, values) writes the 8 BF16 values of K lanes
  // [first_dim, first_dim + 8) of the row (first_dim is a multiple of 8).
  template <class Store>
  static JSMLA_DEVICE void convert_into(bool valid, const uint8_t* staged_row, const uint8_t* scale_slot, int sub,
                                        Store&& store) {
#pragma unroll
    for (int i = 0; i < kUnitsPerThread; ++i) {
      const int unit = sub + i * kThreadsPerRow;
      if (unit >= kUnits) continue;
      if constexpr (kQuantUnits > 0) {
        if (unit < kQuantUnits) {
          if (!valid) {
            store_zero_quant_unit(unit, store);
            continue;
          }
          convert_quant_unit(*reinterpret_cast<const uint4*>(staged_row + 16 * unit), scale_slot, unit, store);
          continue;
        }
      }
      store(kF.quant_dim + 8 * (unit - kQuantUnits),
            valid ? *reinterpret_cast<const uint4*>(staged_row + 16 * unit) : make_uint4(0, 0, 0, 0));
    }
  }

  // Every thread of a row converts the same units of each kind (its quantized units come first).
  static constexpr bool kUniformUnits = kUnits % kThreadsPerRow == 0 && kQuantUnits % kThreadsPerRow == 0;

  // Whether unit `unit` (the thread's i-th) exists and is quantized: decided at compile time where the
  // units divide evenly between a row's threads, per thread otherwise (dsv4_nvfp4: 14 FP4 + 8 BF16).
  static JSMLA_DEVICE bool has_unit(int unit) { return kUnits % kThreadsPerRow == 0 || unit < kUnits; }
  static JSMLA_DEVICE bool quant_unit(int i, int unit) {
    if constexpr (kUniformUnits) return i < kQuantUnits / kThreadsPerRow;
    return unit < kQuantUnits;
  }

  // convert_into for a thread that owns a whole row's worth of units and spare registers: the valid
  // test and the choice of FP8 conversion (bit_path_scale for all of the thread's groups) are made
  // once, and the staged units are loaded kBatch at a time before they are converted, so their
  // shared-memory loads are in flight together.
  template <int kBatch, class Store>
  static JSMLA_DEVICE void convert_batched(bool valid, const uint8_t* staged_row, const uint8_t* scale_slot, int sub,
                                           Store&& store) {
    if (!valid) {
      store_zero_units(sub, store);
      return;
    }
    if (bit_path_row(scale_slot, sub)) {
      convert_staged<kBatch, true>(staged_row, scale_slot, sub, store);
    } else {
      convert_staged<kBatch, false>(staged_row, scale_slot, sub, store);
    }
  }

  // convert_batched in two steps, for a thread that refills its staging row before it converts:
  // load_staged copies all of the thread's staged units of a row into registers, convert_loaded
  // converts them (the scale slot is read then, so it must still hold the row's record).
  static JSMLA_DEVICE void load_staged(const uint8_t* staged_row, int sub, uint4 (&units)[kUnitsPerThread]) {
    load_units(staged_row, sub, 0, kUnitsPerThread, units);
  }
  template <class Store>
  static JSMLA_DEVICE void convert_loaded(bool valid, const uint4 (&units)[kUnitsPerThread], const uint8_t* scale_slot,
                                          int sub, Store&& store) {
    if (!valid) {
      store_zero_units(sub, store);
      return;
    }
    if (bit_path_row(scale_slot, sub)) {
      convert_units<true>(units, 0, kUnitsPerThread, scale_slot, sub, store);
    } else {
      convert_units<false>(units, 0, kUnitsPerThread, scale_slot, sub, store);
    }
  }

  // kExactScales only: writes row `row`'s mantissas and ratios (1 for a masked row, whose tile row
  // is zero) into `factors` (kFactorFloats floats); called by one thread per row.
  static JSMLA_DEVICE void write_factors(bool valid, const uint8_t* scale_slot, float* factors, int row) {
    static_assert(kExactScales, "only formats with arbitrary FP32 scales carry mantissa factors");
    float next = 1.0f;
#pragma unroll
    for (int g = kNumGroups - 1; g >= 0; --g) {
      const float mantissa = valid ? mantissa_of(group_scale_of(scale_slot, g)) : 1.0f;
      factors[g * kCandidateTile + row] = mantissa;
      factors[(kNumGroups + g) * kCandidateTile + row] = mantissa / next;
      next = mantissa;
    }
  }

  // s = power_of_two_part(s) * mantissa_of(s) exactly, mantissa in [1, 2), for every normal s; zero,
  // subnormal, infinite and NaN scales keep s whole in the tile (mantissa 1).
  static JSMLA_DEVICE float power_of_two_part(float s) {
    const uint32_t bits = __float_as_uint(s);
    const uint32_t exponent = bits & 0x7f800000u;
    return exponent == 0u || exponent == 0x7f800000u ? s : __uint_as_float(bits & 0xff800000u);
  }
  static JSMLA_DEVICE float mantissa_of(float s) {
    const uint32_t bits = __float_as_uint(s);
    const uint32_t exponent = bits & 0x7f800000u;
    return exponent == 0u || exponent == 0x7f800000u ? 1.0f : __uint_as_float((bits & 0x007fffffu) | 0x3f800000u);
  }

 private:
  // Zeros for every unit of this thread (a masked row).
  template <class Store>
  static JSMLA_DEVICE void store_zero_units(int sub, Store& store) {
#pragma unroll
    for (int i = 0; i < kUnitsPerThread; ++i) {
      const int unit = sub + i * kThreadsPerRow;
      if (!has_unit(unit)) continue;
      if (quant_unit(i, unit)) {
        store_zero_quant_unit(unit, store);
      } else {
        store(kF.quant_dim + 8 * (unit - kQuantUnits), make_uint4(0, 0, 0, 0));
      }
    }
  }

  // Whether all of this thread's FP8 units take the bit path (FP4 has one exact conversion).
  static JSMLA_DEVICE bool bit_path_row(const uint8_t* scale_slot, int sub) {
    static_assert(kUniformUnits || kF.quant_bits != 8, "the FP8 path choice needs every thread's units known");
    bool bit_path = kF.quant_bits == 8;
    if constexpr (kF.quant_bits == 8) {
      constexpr int kQuantPerThread = kQuantUnits / kThreadsPerRow;
#pragma unroll
      for (int i = 0; i < kQuantPerThread; ++i) bit_path &= bit_path_unit(scale_slot, sub + i * kThreadsPerRow);
    }
    return bit_path;
  }

  // The thread's staged units i in [first, first + count) into units[i - first] (first and count are
  // constants once the callers' loops are unrolled).
  static JSMLA_DEVICE void load_units(const uint8_t* staged_row, int sub, int first, int count, uint4* units) {
#pragma unroll
    for (int j = 0; j < count; ++j) {
      const int unit = sub + (first + j) * kThreadsPerRow;
      if (first + j < kUnitsPerThread && has_unit(unit)) units[j] = *reinterpret_cast<const uint4*>(staged_row + 16 * unit);
    }
  }

  // Converts units[i - first] for the thread's units i in [first, first + count), all FP8 units on one path.
  template <bool kBitPath, class Store>
  static JSMLA_DEVICE void convert_units(const uint4* units, int first, int count, const uint8_t* scale_slot, int sub,
                                         Store& store) {
#pragma unroll
    for (int j = 0; j < count; ++j) {
      const int i = first + j;
      const int unit = sub + i * kThreadsPerRow;
      if (i >= kUnitsPerThread || !has_unit(unit)) continue;
      if (quant_unit(i, unit)) {
        if constexpr (kF.quant_bits == 4) {
          dequantize_fp4_unit(units[j], scale_slot, unit, store);
        } else {
          const float scale = kBitPath ? bit_path_unit_scale(scale_slot, unit) : unit_scale(scale_slot, unit);
          dequantize_fp8_unit<kBitPath>(units[j], scale, unit, store);
        }
      } else {
        store(kF.quant_dim + 8 * (unit - kQuantUnits), units[j]);
      }
    }
  }

  // The staged units of convert_batched, kBatch loads at a time.
  template <int kBatch, bool kBitPath, class Store>
  static JSMLA_DEVICE void convert_staged(const uint8_t* staged_row, const uint8_t* scale_slot, int sub, Store& store) {
#pragma unroll
    for (int first = 0; first < kUnitsPerThread; first += kBatch) {
      uint4 staged[kBatch];
      load_units(staged_row, sub, first, kBatch, staged);
      convert_units<kBitPath>(staged, first, kBatch, scale_slot, sub, store);
    }
  }

  // Zeros for the K lanes of quantized unit `unit`.
  template <class Store>
  static JSMLA_DEVICE void store_zero_quant_unit(int unit, Store& store) {
#pragma unroll
    for (int half = 0; half < Geometry::kValuesPerQuantUnit / 8; ++half) {
      store(Geometry::kValuesPerQuantUnit * unit + 8 * half, make_uint4(0, 0, 0, 0));
    }
  }

  // Stores the dequantized values of quantized unit `unit` (FP8: K lanes [16 unit, 16 unit + 16); FP4:
  // [32 unit, 32 unit + 32)).
  template <class Store>
  static JSMLA_DEVICE void convert_quant_unit(uint4 packed, const uint8_t* scale_slot, int unit, Store& store) {
    if constexpr (kF.quant_bits == 4) {
      dequantize_fp4_unit(packed, scale_slot, unit, store);
    } else {
      convert_fp8_unit(packed, scale_slot, unit, store);
    }
  }

  template <class Store>
  static JSMLA_DEVICE void convert_fp8_unit(uint4 fp8, const uint8_t* scale_slot, int unit, Store& store) {
    if (bit_path_unit(scale_slot, unit)) {
      dequantize_fp8_unit<true>(fp8, bit_path_unit_scale(scale_slot, unit), unit, store);
    } else {
      dequantize_fp8_unit<false>(fp8, unit_scale(scale_slot, unit), unit, store);
    }
  }

 public:
  // Whether FP8 unit `unit` takes the bit path (bit_path_scale of its unit_scale). A UE8M0 byte b is
  // tested as an integer: 2^(b-127) is a bit-path scale exactly for b in [1, 134] (b = 0 is the
  // subnormal 2^-127, b = 255 NaN, b > 134 above 2^7).
  static JSMLA_DEVICE bool bit_path_unit(const uint8_t* scale_slot, int unit) {
    if constexpr (kF.scale_kind == ScaleKind::kUe8m0) {
      return static_cast<uint32_t>(scale_slot[scale_group(unit)]) - 1u <= 133u;
    } else {
      return bit_path_scale(unit_scale(scale_slot, unit));
    }
  }
  // unit_scale of a unit on the bit path (bit_path_unit holds): a UE8M0 byte in [1, 134] is 2^(b-127)
  // bit for bit as b << 23, without ue8m0_to_float's cases.
  static JSMLA_DEVICE float bit_path_unit_scale(const uint8_t* scale_slot, int unit) {
    if constexpr (kF.scale_kind == ScaleKind::kUe8m0) {
      return __uint_as_float(static_cast<uint32_t>(scale_slot[scale_group(unit)]) << 23);
    } else {
      return unit_scale(scale_slot, unit);
    }
  }
  // The scale group of FP8 unit `unit` (16 lanes).
  static JSMLA_DEVICE int scale_group(int unit) { return kF.group_size > 0 ? (16 * unit) / kF.group_size : 0; }

  // The scale the tile applies to FP8 unit `unit`: its group's scale (its power-of-two part for
  // kExactScales).
  static JSMLA_DEVICE float unit_scale(const uint8_t* scale_slot, int unit) {
    static_assert(kQuantUnits == 0 || kF.group_size > 0, "FP8 lanes come in scale groups");
    static_assert(kF.quant_bits != 4, "an FP4 unit spans two scale groups (dequantize_fp4_unit)");
    const float scale = group_scale_of(scale_slot, scale_group(unit));
    if constexpr (kExactScales) return power_of_two_part(scale);
    return scale;
  }

  // FP4 unit × its two groups' E4M3 scales → 32 BF16 values (four stores of 8; word w of the unit holds
  // K lanes [32 unit + 8 w, + 8), in group 2 unit + w / 2). Every e2m1 value times an E4M3 scale is
  // exact in BF16, so one BF16 multiply gives the FP32 product's bits (NaN scales give NaN).
  template <class Store>
  static JSMLA_DEVICE void dequantize_fp4_unit(uint4 fp4, const uint8_t* scale_slot, int unit, Store& store) {
    const uint32_t low_scale = bf16x2_broadcast_high(__float_as_uint(group_scale_of(scale_slot, 2 * unit)));
    const uint32_t high_scale = bf16x2_broadcast_high(__float_as_uint(group_scale_of(scale_slot, 2 * unit + 1)));
    store(32 * unit, fp4x8_to_bf16x8(fp4.x, low_scale));
    store(32 * unit + 8, fp4x8_to_bf16x8(fp4.y, low_scale));
    store(32 * unit + 16, fp4x8_to_bf16x8(fp4.z, high_scale));
    store(32 * unit + 24, fp4x8_to_bf16x8(fp4.w, high_scale));
  }

  // Scales the bit path serves: zero and the powers of two up to 2^7 in magnitude, for which it gives
  // the same bits as the FP32 path (scale · 2^120 is then a normal BF16, and every e4m3 value times it
  // is exact in BF16). Any other scale, NaN and infinity included, takes the FP32 path.
  static JSMLA_DEVICE bool bit_path_scale(float scale) {
    const uint32_t bits = __float_as_uint(scale);
    return (bits & 0x007fffffu) == 0u && (bits & 0x7fffffffu) <= 0x43000000u;
  }

  // FP8 unit × scale → 16 BF16 values, stored as two 8-value halves (first_dim 16 unit, 16 unit + 8).
  // kBitPath (bit_path_scale(scale) must hold): each e4m3 byte is moved into the BF16 bit fields with
  // integer operations (prmt, shift, and), which reads it as value · 2^-120 (subnormals included), and
  // one BF16 multiply by scale · 2^120 restores it: 4 full-rate instructions per pair of values, no
  // conversion instructions. The e4m3 NaN codes become ±480 · scale on this path (nothing is promised
  // for non-finite referenced payloads: docs/formats.md, non-finite values); the FP32 path keeps them NaN.
  template <bool kBitPath, class Store>
  static JSMLA_DEVICE void dequantize_fp8_unit(uint4 fp8, float scale, int unit, Store& store) {
    if constexpr (kBitPath) {
      const uint32_t multiplier = bf16x2_broadcast_high(__float_as_uint(scale * 0x1p120f));
      store(16 * unit, make_uint4(bit_pair(fp8.x, kLowPair, multiplier), bit_pair(fp8.x, kHighPair, multiplier),
                                  bit_pair(fp8.y, kLowPair, multiplier), bit_pair(fp8.y, kHighPair, multiplier)));
      store(16 * unit + 8, make_uint4(bit_pair(fp8.z, kLowPair, multiplier), bit_pair(fp8.z, kHighPair, multiplier),
                                      bit_pair(fp8.w, kLowPair, multiplier), bit_pair(fp8.w, kHighPair, multiplier)));
    } else {
      store(16 * unit, make_uint4(fp8x2_to_bf16x2(fp8.x, scale), fp8x2_to_bf16x2(fp8.x >> 16, scale),
                                  fp8x2_to_bf16x2(fp8.y, scale), fp8x2_to_bf16x2(fp8.y >> 16, scale)));
      store(16 * unit + 8, make_uint4(fp8x2_to_bf16x2(fp8.z, scale), fp8x2_to_bf16x2(fp8.z >> 16, scale),
                                      fp8x2_to_bf16x2(fp8.w, scale), fp8x2_to_bf16x2(fp8.w >> 16, scale)));
    }
  }

 private:
  // prmt selectors: bytes 0, 1 (resp. 2, 3) of a word, each sign-extended to a 16-bit lane.
  static constexpr uint32_t kLowPair = 0x9180u;
  static constexpr uint32_t kHighPair = 0xb3a2u;

  // Two e4m3 bytes of `word` (picked by `selector`) times the BF16 pair `multiplier`, as a BF16 pair.
  // After the sign extension a lane is s…s eeee mmm; shifted left by 4 and masked it is the BF16
  // pattern s 0000 eeee mmm 0000, i.e. the e4m3 value times 2^-120.
  static JSMLA_DEVICE uint32_t bit_pair(uint32_t word, uint32_t selector, uint32_t multiplier) {
    uint32_t spread;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(spread) : "r"(word), "r"(selector));
    const uint32_t scaled_down = (spread << 4) & 0x87f087f0u;
    uint32_t product;
    // x · m + (-0) is exactly the rounded product, signed zeros included.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(product) : "r"(scaled_down), "r"(multiplier), "r"(0x80008000u));
    return product;
  }

  // The BF16 pair (h, h) of the high half h of a float whose low half is zero.
  static JSMLA_DEVICE uint32_t bf16x2_broadcast_high(uint32_t float_bits) {
    uint32_t pair;
    asm("prmt.b32 %0, %1, 0, 0x3232;" : "=r"(pair) : "r"(float_bits));
    return pair;
  }

  // BF16 bits of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7): their low bytes and
  // their high bytes, four codes per word (code c in byte c % 4 of word c / 4).
  static constexpr uint32_t kFp4LowBytes0 = 0xc0800000u, kFp4LowBytes1 = 0xc0804000u;
  static constexpr uint32_t kFp4HighBytes0 = 0x3f3f3f00u, kFp4HighBytes1 = 0x40404040u;

  // The 8 e2m1 values of `word` (value i in nibble i) times the BF16 pair `scale`, four values at a
  // time: the magnitude codes index the byte tables with prmt; the signs come from prmt's sign
  // replication (the sign of value 2k + 1 is bit 7 of byte k of `word`, that of value 2k bit 7 of byte
  // k of word << 4) and go into bit 7 of the four high bytes before the interleave, so that one prmt
  // and one lop3 sign four values rather than two (this conversion sets the FP4 producers' pace).
  static JSMLA_DEVICE uint4 fp4x8_to_bf16x8(uint32_t word, uint32_t scale) {
    const uint32_t shifted = word << 4;
    uint32_t pairs[4];
    const uint32_t codes = word & 0x77777777u;  // magnitude codes; prmt reads a selector's low 16 bits
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t half_codes = codes >> (16 * half);
      uint32_t low, high, signs;
      asm("prmt.b32 %0, %1, %2, %3;" : "=r"(low) : "r"(kFp4LowBytes0), "r"(kFp4LowBytes1), "r"(half_codes));
      asm("prmt.b32 %0, %1, %2, %3;" : "=r"(high) : "r"(kFp4HighBytes0), "r"(kFp4HighBytes1), "r"(half_codes));
      // Byte i ← 0xff where value 4 half + i is negative: bytes 2 half, 2 half + 1 of shifted (even
      // values) and of word (odd values), replicated.
      asm("prmt.b32 %0, %1, %2, %3;" : "=r"(signs) : "r"(word), "r"(shifted), "r"(half == 0 ? 0x9d8cu : 0xbfaeu));
      high |= signs & 0x80808080u;  // the BF16 high bytes with their signs
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        uint32_t lanes;  // BF16 lanes (value 4 half + 2 pair, + 1): bytes low, high, low, high
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(lanes) : "r"(low), "r"(high), "r"(pair == 0 ? 0x5140u : 0x7362u));
        uint32_t product;
        // x · s + (-0) is exactly the product, signed zeros included.
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(product) : "r"(lanes), "r"(scale), "r"(0x80008000u));
        pairs[2 * half + pair] = product;
      }
    }
    return make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
  }

 public:
  // The scale of group `group` of the row whose scale record is in `scale_slot`.
  static JSMLA_DEVICE float group_scale_of(const uint8_t* scale_slot, int group) {
    if constexpr (kF.scale_kind == ScaleKind::kFp32) {
      return reinterpret_cast<const float*>(scale_slot)[group];
    } else if constexpr (kF.scale_kind == ScaleKind::kE4m3) {
      // The conversion instruction: e4m3 → FP16 → FP32 is exact for every code (subnormals included),
      // NaN stays NaN; fp8_e4m3_to_float's cases would be branches in the producer.
      const __half_raw scale = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(scale_slot[group]), __NV_E4M3);
      return __half2float(__half(scale));
    } else {
      return ue8m0_to_float(scale_slot[group]);
    }
  }

 private:
  // Two e4m3 values (the low 16 bits) times `scale`, in FP32, rounded once to a BF16 pair.
  static JSMLA_DEVICE uint32_t fp8x2_to_bf16x2(uint32_t packed, float scale) {
    const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(packed & 0xffffu), __NV_E4M3);
    const float2 values = __half22float2(__half2(pair));
    return pack_bf16x2(values.x * scale, values.y * scale);
  }
};

// The loader of a kernel config's tile geometry (config.h sizes shared memory from the geometry alone).
template <class Geometry>
using TileLoaderOf = TileLoader<Geometry::kFormat, Geometry::kCandidateTile, Geometry::kThreads, Geometry::kLaneSlices>;

}  // namespace jsmla::cuda
