// The sizes of gathering one candidate tile (host- and device-compilable constexpr, no CUDA headers):
// how a candidate row is staged as 16-byte units, how many loader threads share a row, the row's scale
// record and, for arbitrary FP32 scales, the per-row factor block. The kernel configs size their shared
// memory from it, and the CPU extension compiles the same configs to give the planner the kernel
// tables; the device half of the loader (load_tile.cuh) derives from it.
#pragma once

#include "kernels/common/formats.h"

namespace jsmla::cuda {

// Bytes of the scale record one row needs: all FP32 scales of an inline row, or the footer scale row.
constexpr int scale_record_bytes(const FormatTraits& f) {
  if (f.scale_kind == ScaleKind::kNone) return 0;
  return f.layout == Layout::kFooter ? f.scale_row_bytes : f.num_groups * f.scale_bytes();
}

// Thread `tid` of kThreads loader threads owns row tid / kThreadsPerRow of a kCandidateTile-row tile and
// units sub, sub + kThreadsPerRow, ... of it, where a unit is 16 staged bytes: 16 FP8 values, 32 FP4
// values (two per byte) or 8 BF16 values. kLaneSlices > 1: the geometry of one lane slice of every row
// (formats.h: lane_slice), which block of a cluster gathers which slice being a run-time value.
template <FormatId kFormatValue, int kCandidateTileValue, int kThreadsValue, int kLaneSlicesValue = 1>
struct LoaderGeometry {
  static constexpr FormatId kFormat = kFormatValue;
  static constexpr int kLaneSlices = kLaneSlicesValue;
  static constexpr FormatTraits kF = lane_slice(format_traits(kFormat), kLaneSlices);
  static constexpr int kCandidateTile = kCandidateTileValue;
  static constexpr int kThreads = kThreadsValue;
  static constexpr int kThreadsPerRow = kThreads / kCandidateTile;
  static constexpr int kQuantUnits = kF.quant_bytes() / 16;
  static constexpr int kValuesPerQuantUnit = kF.quant_bits > 0 ? 16 * 8 / kF.quant_bits : 0;
  static constexpr int kBf16Units = kF.bf16_dim * 2 / 16;
  static constexpr int kUnits = kQuantUnits + kBf16Units;
  static constexpr int kUnitsPerThread = (kUnits + kThreadsPerRow - 1) / kThreadsPerRow;
  static constexpr int kStagedRowBytes = kUnits * 16;
  static constexpr int kScaleRecordBytes = scale_record_bytes(kF);
  // One thread's private copy of its row's scale record (whole 16-byte cp.async units).
  static constexpr int kScaleSlotBytes = (kScaleRecordBytes + 15) / 16 * 16;
  // Scales that are not powers of two: their mantissas are applied in FP32 by the kernel.
  static constexpr bool kExactScales = row_conversion(kF) == RowConversion::kExactScales;
  static constexpr int kNumGroups = kF.num_groups;
  // Per-row factors of kExactScales (floats): mantissa[g][row], then ratio[g][row] = m_g / m_{g+1}
  // (m_G = 1: the unscaled BF16 lanes after the last group).
  static constexpr int kFactorFloats = kExactScales ? 2 * kNumGroups * kCandidateTile : 0;
  // BF16 elements between consecutive rows of an unswizzled tile: d_qk plus 16 bytes, so that the 8
  // rows one ldmatrix phase reads fall into 8 different 16-byte bank groups.
  static constexpr int kTilePitch = kF.d_qk + 8;

  static_assert(kF.quant_bits == 0 || kF.quant_bits == 8 || kF.quant_bits == 4, "FP8 or FP4 quantized lanes");
  static_assert(kLaneSlices == 1 || splits_into_lane_slices(format_traits(kFormat), kLaneSlices),
                "lane slices are whole FP8 scale groups of the rows' V lanes");
  static_assert(kThreads % kCandidateTile == 0, "every tile row needs the same number of loader threads");
  static_assert(kF.quant_bytes() % 16 == 0 && (2 * kF.bf16_dim) % 16 == 0, "payload must split into 16-byte units");
  static_assert(kF.bf16_offset % 16 == 0, "the BF16 lanes of a row must be 16-byte aligned for cp.async");
  static_assert(kF.layout != Layout::kInline || kF.scale_offset % 16 == 0, "inline scales must be 16-byte aligned");
  // An FP8 unit (16 values) lies inside one scale group; an FP4 unit (32 values) is two words of 8
  // values per group of 16, each word inside one group.
  static_assert(kF.group_size == 0 || (kF.quant_bits == 8 && kF.group_size % 16 == 0) ||
                    (kF.quant_bits == 4 && kF.group_size == 16),
                "a quantized unit's 8-value words must each lie inside one scale group");
  static_assert(kF.quant_bits != 4 || (kF.scale_kind == ScaleKind::kE4m3 && kF.layout == Layout::kFooter),
                "FP4 lanes carry E4M3 group scales in a footer scale row");
  static_assert(kScaleRecordBytes == 0 || kScaleRecordBytes == 8 || kScaleRecordBytes % 16 == 0,
                "scale records are copied with one 8-byte or whole 16-byte cp.async units");
  static_assert(kScaleSlotBytes <= 32, "a scale slot is at most two 16-byte units (shared-memory budgets)");
  static_assert(!kExactScales || (kF.layout == Layout::kInline && kScaleRecordBytes == 4 * kNumGroups),
                "exact FP32 scales: every group's scale is in the thread's scale slot");
  static_assert((kTilePitch * 2) % 16 == 0 && ((kTilePitch * 2) / 16) % 8 == 1,
                "tile rows must start 16-byte aligned and rotate through the 8 bank groups");
};

}  // namespace jsmla::cuda
