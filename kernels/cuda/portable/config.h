// Tile shapes and shared-memory budget of the portable kernel family (mma.sync, BF16 compute,
// sm_80 / sm_90a / sm_120a). Host-compilable constexpr: kernel_table.h turns it into the table the
// planner reads through the CPU extension.
//
// Block = (token, head tile, split). Warps form a kHeadGroups x kDSplits grid: warp (g, c) owns
// head rows [16g, 16g+16) of the tile, holds their Q columns of k-range c in registers (A fragments
// of m16n8k16), computes the partial S = Q·Kᵀ over that k-range for the whole candidate tile, and
// owns output columns [c*d_v/kDSplits, (c+1)*d_v/kDSplits). The kDSplits partial scores of a head
// group are summed through shared memory in a fixed order, so every warp of the group holds the same
// S and runs the same online softmax; P then stays in registers as the A operand of O += P·V.
// Splitting d between warps is what lets Q (d_qk = 576) and O (d_v = 512) of 16 heads live in
// registers: one warp alone would need 144 + 256 of them.
#pragma once

#include "kernels/common/formats.h"
#include "kernels/cuda/loader_geometry.h"

namespace jsmla::cuda::portable {

// Largest dynamic shared memory per block on every target (sm_86/89/120 allow 99 KB; sm_80/90 more).
inline constexpr int kMaxSharedBytes = 99 * 1024;
// Split sizes must be multiples of this; it is a multiple of every format's candidate tile.
inline constexpr int kSplitGranule = 32;

// Candidates gathered per tile: 32 rows, or 16 for the 1088-wide dots3_swa rows (same bytes per tile).
constexpr int candidate_tile(FormatId id) { return format_traits(id).d_qk > 576 ? 16 : 32; }

// b is a positive multiple of a (a function, so no "% 0" is ever spelled out for formats without groups).
constexpr bool divides(int a, int b) { return a > 0 && b % a == 0; }

struct WarpGrid {
  int head_groups;  // 16-head row groups per block
  int d_splits;     // warps sharing one row group, each with 1/d_splits of d_qk and of d_v
};

// The warp grid of a head tile; {0, 0} where the tile does not fit a format's rows (which tiles are
// instantiated is declared once, in kernels/cuda/generate_kernels.py).
constexpr WarpGrid warp_grid(FormatId id, int heads_per_block) {
  const bool wide = format_traits(id).d_qk > 576;
  switch (heads_per_block) {
    case 16: return {1, 4};
    case 32: return wide ? WarpGrid{2, 4} : WarpGrid{0, 0};
    case 64: return wide ? WarpGrid{0, 0} : WarpGrid{4, 2};
    default: return {0, 0};
  }
}

template <FormatId kFormat, int kHeadTileValue>
struct PortableConfig {
  static constexpr FormatTraits kF = format_traits(kFormat);
  static constexpr int kHeadTile = kHeadTileValue;
  static constexpr WarpGrid kGrid = warp_grid(kFormat, kHeadTile);
  static constexpr int kHeadGroups = kGrid.head_groups;
  static constexpr int kDSplits = kGrid.d_splits;
  static constexpr int kWarps = kHeadGroups * kDSplits;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kCandidateTile = candidate_tile(kFormat);
  static constexpr int kMinSplitSize = 0;  // every split (kernel_table.h: choose_family)
  static constexpr int kLaneSlices = 1;    // one block per (token, head tile, split)
  static constexpr int kDqk = kF.d_qk;
  static constexpr int kDv = kF.d_v;
  static constexpr int kKStepsPerWarp = kDqk / 16 / kDSplits;  // m16n8k16 k-steps of S per warp
  static constexpr int kDvPerWarp = kDv / kDSplits;            // output columns per warp
  static constexpr int kScoreTiles = kCandidateTile / 8;       // n8 tiles of S per warp
  static constexpr int kOutTiles = kDvPerWarp / 8;             // n8 tiles of O per warp

  using Geometry = LoaderGeometry<kFormat, kCandidateTile, kThreads>;
  static constexpr int kTilePitch = Geometry::kTilePitch;

  // Shared memory, in bytes: the BF16 KV tile (K; V is its first d_v lanes), the raw staging rows of
  // the next tile, one scale slot per thread, the partial-score exchange, and one additive score bias
  // per candidate row (0 or -inf for a masked row); for arbitrary FP32 scales, the per-row mantissa
  // factors of the tile (TileLoader::write_factors).
  static constexpr int kTileBytes = kCandidateTile * kTilePitch * 2;
  static constexpr int kStageBytes = kCandidateTile * Geometry::kStagedRowBytes;
  static constexpr int kScaleSlotsBytes = Geometry::kScaleRecordBytes > 0 ? kThreads * Geometry::kScaleSlotBytes : 0;
  static constexpr int kExchangeFloatsPerWarp = kScoreTiles * 4 * 32;
  static constexpr int kExchangeBytes = kDSplits > 1 ? kWarps * kExchangeFloatsPerWarp * 4 : 0;
  static constexpr int kBiasBytes = kCandidateTile * 4;
  static constexpr bool kExactScales = Geometry::kExactScales;
  static constexpr int kFactorBytes = Geometry::kFactorFloats * 4;
  // m16n8k16 k-steps per scale group of K (exact scales only).
  static constexpr int kGroupKSteps = kExactScales ? kF.group_size / 16 : 1;

  static constexpr int kTileOffset = 0;
  static constexpr int kStageOffset = kTileOffset + kTileBytes;
  static constexpr int kScaleSlotsOffset = kStageOffset + kStageBytes;
  static constexpr int kExchangeOffset = kScaleSlotsOffset + kScaleSlotsBytes;
  static constexpr int kBiasOffset = kExchangeOffset + kExchangeBytes;
  static constexpr int kFactorOffset = kBiasOffset + kBiasBytes;
  static constexpr int kSharedBytes = kFactorOffset + kFactorBytes;

  static_assert(kHeadGroups > 0, "head tile not instantiated for this format (see warp_grid)");
  static_assert(kHeadTile == 16 * kHeadGroups, "a head group is one m16 row block");
  static_assert(kDqk % (16 * kDSplits) == 0, "each warp's k-range must be whole k16 steps");
  static_assert(kDv % (16 * kDSplits) == 0, "each warp's output columns must be whole n16 pairs");
  static_assert(kCandidateTile % 16 == 0, "P·V consumes candidates in k16 steps");
  static_assert(kSplitGranule % kCandidateTile == 0, "the split granule must be whole candidate tiles");
  static_assert(kThreads <= 256, "__launch_bounds__ assumes at most 256 threads (<= 255 registers each)");
  static_assert(kTileOffset % 16 == 0 && kStageOffset % 16 == 0 && kScaleSlotsOffset % 16 == 0 &&
                    kExchangeOffset % 16 == 0 && kBiasOffset % 16 == 0 && kFactorOffset % 16 == 0,
                "shared-memory regions must be 16-byte aligned (cp.async, ldmatrix, vector stores)");
  static_assert(!kExactScales || (kF.group_size % 16 == 0 && divides(kF.group_size, kDvPerWarp)),
                "exact scales: whole k16 steps per group, and each warp's output columns whole groups");
  static_assert(Geometry::kStagedRowBytes % 16 == 0, "staged rows must stay 16-byte aligned");
  static_assert(kSharedBytes <= kMaxSharedBytes, "shared memory exceeds the 99 KB portable budget");
};

}  // namespace jsmla::cuda::portable
