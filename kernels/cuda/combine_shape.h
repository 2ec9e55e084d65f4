// The split-K combine's block shapes and the rule that picks one for a call (plain C++, no CUDA): the
// launch (combine.cu) and the planner's cost model (through the CPU extension) both read it, so the
// model times the shape that runs. The shapes are described in combine.cuh; every shape sums in the
// same order, so the choice changes the speed only.
#pragma once

#include <cstdint>

namespace jsmla::cuda {

// Splits one merge reads (its shared memory holds a weight per split); the handler checks plans against it.
inline constexpr int kCombineMaxSplits = 4096;

// Merge groups of the summation order (combine.cuh); the narrow shape has one thread group per merge group.
inline constexpr int kMergeGroups = 8;

// The narrow shape: float4 lanes of a row slice, thread groups, and threads per SM it is compiled for
// (8 loads in flight a thread, 64 registers).
inline constexpr int kNarrowCombineLanes = 32;
inline constexpr int kNarrowCombineGroups = kMergeGroups;
inline constexpr int kNarrowThreadsPerSm = 1024;

// The warp shape: rows (warps) a block, and the float4 partial loads a lane may hold in flight (128
// registers; more spill).
inline constexpr int kWarpCombineRows = 8;
inline constexpr int kWarpCombineLoads = 32;

// The wide shape's float4 lanes (a whole row of d_v columns a block).
template <int kDv>
inline constexpr int kWideCombineLanes = kDv / 4;

enum class CombineShape { kNarrow, kWarp, kWide };

// Slices of a row the narrow shape spreads over separate blocks.
constexpr int narrow_combine_slices(int d_v) { return d_v / (4 * kNarrowCombineLanes); }

// Splits whose loads a warp-shape lane holds in registers: the warp shape serves at most this many.
constexpr int warp_combine_max_splits(int d_v) {
  return kWarpCombineLoads / (d_v / 128) < kMergeGroups ? kWarpCombineLoads / (d_v / 128) : kMergeGroups;
}

// The shape of a merge of `rows` (token, head) rows over `num_splits` splits on `sm_count` SMs:
//  * few rows (a small batch): narrow — slices of a row on separate blocks, as long as they fit two
//    waves (beyond that a block per row is faster; at T = 2 H = 128 with 22 splits the slices are);
//  * many rows, at most one split per merge group (and per lane's registers): warp — a row a warp, every
//    split's loads in flight, no block barrier;
//  * otherwise wide: a block per row, a thread walking all the splits.
constexpr CombineShape choose_combine_shape(int64_t rows, int num_splits, int d_v, int sm_count) {
  constexpr int kNarrowBlocksPerSm = kNarrowThreadsPerSm / (kNarrowCombineLanes * kNarrowCombineGroups);
  if (rows * narrow_combine_slices(d_v) <= 2 * static_cast<int64_t>(sm_count) * kNarrowBlocksPerSm) {
    return CombineShape::kNarrow;
  }
  return num_splits <= warp_combine_max_splits(d_v) ? CombineShape::kWarp : CombineShape::kWide;
}

static_assert(warp_combine_max_splits(512) == kMergeGroups && warp_combine_max_splits(1024) == 4,
              "the warp shape's instances (combine.cu) cover 2, 4 and 8 splits at d_v 512, 2 and 4 at 1024");

}  // namespace jsmla::cuda
