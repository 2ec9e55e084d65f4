// Tile shapes and shared-memory layout of the Hopper kernel family (sm_90a: wgmma, register
// reallocation, 227 KB of shared memory per block). Host-compilable constexpr: kernel_table.h turns
// it into the table the planner reads through the CPU extension.
//
// Block = (token, 64-head tile, split), 3 warpgroups:
//   warpgroup 0, the producer: gathers candidate rows with cp.async into a two-stage staging area and
//     converts them (FP8 or FP4 × scale → BF16) into a two-buffer BF16 KV tile of 32 candidates in the
//     128-byte swizzled layout wgmma reads; BF16 rows are copied straight into two 64-candidate tile
//     buffers (no staging area, so the wider tiles fit);
//   warpgroup 1, the scorer: S = Q·Kᵀ for all 64 heads and the tile's candidates (wgmma m64n32k16 or
//     m64n64k16, Q and K from shared memory), the online softmax in registers, P (BF16) into shared
//     memory with the rows' rescale factors, and O[:, first half of d_v] += P·V (wgmma m64n256k16, P
//     from registers, V = the same tile read N-major);
//   warpgroup 2: O[:, second half of d_v] += P·V with P from shared memory, its accumulators rescaled
//     by the scorer's factors. Its P·V of tile i overlaps the scorer's S of tile i + 1.
// Named barriers hand tiles over: full[b] (producer → scorer), p_ready (scorer → warpgroup 2), p_free
// (warpgroup 2 → scorer, with one P buffer) and empty[b] (both → producer).
#pragma once

#include "kernels/common/formats.h"
#include "kernels/cuda/hopper/config_h16.h"
#include "kernels/cuda/loader_geometry.h"

// Compile-time knob for A/B timing (benchmarks/ab_tree.sh): 1 (the default) splits the trailing BF16
// lanes (the rope) of a lane-sliced row between the blocks of a cluster, each gathering and multiplying
// its half (0.97x the cluster tile's time against 0); 0 leaves them all to block 0 (the other blocks' Q
// and tile hold zeros there).
#ifndef JSMLA_LANE_SLICE_ROPE_SPLIT
#define JSMLA_LANE_SLICE_ROPE_SPLIT 1
#endif

namespace jsmla::cuda::hopper {

// Shared memory per block on sm_90 (opt-in maximum).
inline constexpr int kMaxSharedBytes = 227 * 1024;

// Blocks a (token, 64-head tile, split) takes: 1, or for rows whose V (d_v = 1024) a block's registers
// do not hold, a cluster of 2 that splits every row's lanes (formats.h: lane_slice) — block r gathers and
// converts slice r of every row (FP8 lanes [512 r, 512 r + 512), and its half of the BF16 rope lanes:
// JSMLA_LANE_SLICE_ROPE_SPLIT),
// computes the scores over its lanes, adds the other block's (exchanged through distributed shared
// memory every tile: both blocks then hold the same scores bit for bit and run the same softmax) and
// accumulates O over its slice's 512 V lanes, its half of the output columns.
constexpr int hopper_lane_slices(FormatId id) {
  const FormatTraits f = format_traits(id);
  return f.d_v == 1024 && splits_into_lane_slices(f, 2) ? 2 : 1;
}

// Formats the family serves: 512/576-wide FP8, FP4 or BF16 rows (or such lane slices of wider FP8 rows)
// with power-of-two, E4M3, UE8M0 or arbitrary FP32 scales (the latter in groups that tile each
// consumer's half of d_v, and whole rows only).
constexpr bool hopper_format(FormatId id) {
  const int slices = hopper_lane_slices(id);
  const FormatTraits f = lane_slice(format_traits(id), slices);
  const bool exact_scales = row_conversion(f) == RowConversion::kExactScales;
  return (f.d_qk == 512 || f.d_qk == 576) && f.d_v == 512 &&
         (!exact_scales || (slices == 1 && f.group_size % 16 == 0 && 256 % f.group_size == 0));
}

template <FormatId kFormat, int kHeadTileValue>
struct HopperConfig {
  // Blocks of a cluster, each serving one lane slice of every row (hopper_lane_slices); kF is the
  // slice's traits (the format's own for one block), kRowDqk and kRowDv the format's row widths (Q's
  // and the output's row strides).
  static constexpr int kLaneSlices = hopper_lane_slices(kFormat);
  static constexpr FormatTraits kF = lane_slice(format_traits(kFormat), kLaneSlices);
  static constexpr int kRowDqk = format_traits(kFormat).d_qk;
  static constexpr int kRowDv = format_traits(kFormat).d_v;
  static constexpr bool kTransposed = false;  // S = Q·Kᵀ with the heads as wgmma M (config_h16.h: the other way)
  static constexpr int kHeadTile = kHeadTileValue;  // wgmma M
  // BF16 rows need no conversion: the producer copies them straight into the swizzled tile buffers,
  // and without a staging area two 64-candidate tiles fit (wide tiles: half the hand-overs per
  // candidate, S as m64n64). Every other format is staged raw and converted into two 32-candidate tiles.
  static constexpr bool kDirectTiles = row_conversion(kF) == RowConversion::kDirect;
  static constexpr bool kWideTiles = kDirectTiles;
  static constexpr int kCandidateTile = kWideTiles ? 64 : 32;  // wgmma N of S, k16 steps of P·V
  static constexpr int kMinSplitSize = 0;  // every split (kernel_table.h: choose_family)
  static constexpr int kRoundRows = 32;  // rows a producer pass covers (4 threads a row)
  static constexpr int kRounds = kCandidateTile / kRoundRows;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerGroups = 2;
  static constexpr int kThreads = kProducerThreads + 128 * kConsumerGroups;
  static constexpr int kProducerRegisters = 104;
  static constexpr int kConsumerRegisters = 200;
  static constexpr int kDqk = kF.d_qk;
  static constexpr int kDv = kF.d_v;
  static constexpr int kDvPerGroup = kDv / kConsumerGroups;  // wgmma N of P·V
  static constexpr int kKSteps = kDqk / 16;                  // k16 steps of S (all the scorer's)
  // Lane slices: whether the blocks split the trailing BF16 lanes (JSMLA_LANE_SLICE_ROPE_SPLIT), and then
  // the k16 steps of the quantized lanes and each block's share of the trailing ones.
  static constexpr bool kSplitTrailingLanes = kLaneSlices > 1 && JSMLA_LANE_SLICE_ROPE_SPLIT;
  static constexpr int kQuantKSteps = kF.quant_dim / 16;
  static constexpr int kTrailingKSteps = (kKSteps - kQuantKSteps) / kLaneSlices;
  static constexpr int kOutRegisters = kDvPerGroup / 2;      // FP32 accumulators of O per thread
  static constexpr int kAtomBytes = 128;                     // one swizzle row: 64 BF16 values

  // The producer's geometry: a round of rows (a tile is kRounds rounds).
  using Geometry = LoaderGeometry<kFormat, kRoundRows, kProducerThreads, kLaneSlices>;
  static constexpr int kStages = 2;  // tile buffers (and score-bias rows)
  // P buffers (with their rows of rescale factors): two let the scorer write tile i + 1's P while the
  // second consumer reads tile i's; a 64-candidate tile leaves room for one, which the second consumer
  // hands back (p_free) once its P·V has read it.
  static constexpr int kPBuffers = kWideTiles ? 1 : 2;
  // Staged units a producer thread loads before converting them (bounded by its registers).
  static constexpr int kConvertBatch = 10;
  // Arbitrary FP32 scales (glm_*): the tile holds FP8 × 2^e, and the consumers apply each candidate's
  // mantissas in FP32 — to each scale group's partial scores, to P once per group of V columns, so a
  // consumer's half of d_v runs as kPVariants m64n(256 / kPVariants) wgmmas, each with its own P.
  static constexpr bool kExactScales = Geometry::kExactScales;
  static constexpr int kGroupKSteps = kExactScales ? kF.group_size / 16 : 0;   // k16 steps per scale group
  static constexpr int kPVariants = kExactScales ? kDvPerGroup / kF.group_size : 1;
  // The scorer leaves its P·V of tile i in flight behind S of tile i + 1 (its A fragments then live
  // across the tile) where the registers allow: not beside a 64-candidate tile's scores.
  // Nor beside arbitrary scales: their scale groups' partial scores take those registers.
  static constexpr bool kScorerPVInFlight = !kWideTiles && !kExactScales;

  // Shared memory, in bytes (offsets from a 1024-byte aligned base):
  //   Q [kDqk/64 column blocks][64 heads][128 B], swizzled;
  //   kStages BF16 KV tiles [kDqk/64][kCandidateTile candidates][128 B], swizzled;
  //   kPBuffers P buffers [kPVariants][64 heads][kCandidateTile] BF16 in the 64- or 128-byte swizzled
  //   layout (K-major A of wgmma; one swizzle row per head): the second consumer's P, one variant per
  //   scale group of its columns;
  //   two staging areas of raw rows and their per-thread scale slots (none for direct tiles), kStages
  //   score-bias rows, kPBuffers rows of rescale factors, the final row maxima and sums, two stages of
  //   per-candidate mantissas and ratios (exact scales only; the ratios serve the portable family);
  //   lane slices only: two score-exchange buffers (by tile parity), which the other block of the
  //   cluster writes its partial scores into, and their two transaction barriers.
  static constexpr int kQBytes = kHeadTile * kDqk * 2;
  static constexpr int kQBlockBytes = kHeadTile * kAtomBytes;          // one 64-column block of Q
  static constexpr int kTileBytes = kCandidateTile * kDqk * 2;
  static constexpr int kTileBlockBytes = kCandidateTile * kAtomBytes;  // one 64-column block of a tile
  static constexpr int kPRowBytes = kCandidateTile * 2;                // one 64- or 128-byte swizzle row
  static constexpr int kPBytes = kHeadTile * kPRowBytes;  // one P variant of one buffer
  static constexpr int kScaleSlotsBytes = Geometry::kScaleRecordBytes > 0 ? kProducerThreads * Geometry::kScaleSlotBytes : 0;
  static constexpr int kBiasBytes = kCandidateTile * 4;
  static constexpr int kRescaleBytes = kHeadTile * 4;                  // one factor per head row
  static constexpr int kFinalBytes = 2 * kHeadTile * 4;                // max and sum per head row
  static constexpr int kFactorBytes = Geometry::kFactorFloats * 4;     // one stage's mantissas and ratios
  // One exchange buffer: the scorer's kCandidateTile / 2 partial scores a thread, as float4 runs
  // [run][scorer thread] (a warp's 16-byte stores of one run are contiguous).
  static constexpr int kExchangeBytes = kLaneSlices > 1 ? 128 * (kCandidateTile / 2) * 4 : 0;
  static constexpr int kExchangeBarrierBytes = kLaneSlices > 1 ? 2 * 8 : 0;
  // Staged rows preferably sit an odd multiple of 64 bytes apart: a warp's cp.async (and later its
  // shared-memory loads) covers 8 rows × 64 contiguous bytes, which then fall into alternating halves
  // of the 32 banks, 4 wavefronts per instruction (a pitch that is a multiple of 128 bytes puts all 8
  // rows on the same 16 banks, 4 times the wavefronts).
  static constexpr int kPaddedPitch = (Geometry::kStagedRowBytes + 64 + 127) / 128 * 128 - 64;
  static constexpr bool fits(int pitch) {
    return kQBytes + kStages * kTileBytes + kPBuffers * kPVariants * kPBytes + 2 * kCandidateTile * pitch +
               2 * kScaleSlotsBytes + kStages * kBiasBytes + kPBuffers * kRescaleBytes + kFinalBytes +
               2 * kFactorBytes + 2 * kExchangeBytes + kExchangeBarrierBytes + 1024 <=
           kMaxSharedBytes;
  }
  static constexpr int kStagePitch = kDirectTiles ? 0 : fits(kPaddedPitch) ? kPaddedPitch : Geometry::kStagedRowBytes;
  static constexpr int kStageBytes = kCandidateTile * kStagePitch;

  static constexpr int kQOffset = 0;
  static constexpr int kTileOffset = kQOffset + kQBytes;
  static constexpr int kPOffset = kTileOffset + kStages * kTileBytes;
  static constexpr int kStageOffset = kPOffset + kPBuffers * kPVariants * kPBytes;
  static constexpr int kScaleSlotsOffset = kStageOffset + 2 * kStageBytes;
  static constexpr int kBiasOffset = kScaleSlotsOffset + 2 * kScaleSlotsBytes;
  static constexpr int kRescaleOffset = kBiasOffset + kStages * kBiasBytes;
  static constexpr int kFinalOffset = kRescaleOffset + kPBuffers * kRescaleBytes;
  static constexpr int kFactorOffset = kFinalOffset + kFinalBytes;
  static constexpr int kExchangeOffset = kFactorOffset + 2 * kFactorBytes;
  static constexpr int kExchangeBarrierOffset = kExchangeOffset + 2 * kExchangeBytes;
  static constexpr int kUsedBytes = kExchangeBarrierOffset + kExchangeBarrierBytes;
  static constexpr int kSharedBytes = kUsedBytes + 1024;  // slack to align the base to 1024 bytes

  // Named barriers (0 is __syncthreads).
  static constexpr int kScorerThreads = 128;
  static constexpr int kFullBarrier = 1;                   // + tile buffer: producer arrives, scorer waits
  static constexpr int kEmptyBarrier = 1 + kStages;        // + tile buffer: both consumers arrive, producer waits
  static constexpr int kQBarrier = 1 + 2 * kStages;        // consumers only: Q is in shared memory
  static constexpr int kFinalBarrier = kQBarrier;          // consumers only, after the last tile: the final row
                                                           // maxima and sums are written (the Q barrier's id, long done)
  static constexpr int kPReadyBarrier = kQBarrier + 1;     // + P buffer: scorer and warpgroup 2 both wait (two-sided);
                                                           // with one P buffer the scorer only arrives
  static constexpr int kPFreeBarrier = kPReadyBarrier + kPBuffers;  // one P buffer: warpgroup 2 arrives, scorer waits

  static_assert(hopper_format(kFormat), "format not served by the Hopper family");
  static_assert(kHeadTile == 64, "a head tile is one wgmma M of 64 rows");
  static_assert(kDqk % 64 == 0 && kDv % 64 == 0, "rows must be whole 64-column swizzle blocks");
  static_assert(kDvPerGroup == 256, "one m64n256k16 wgmma per k16 step covers a consumer's half of d_v");
  static_assert(kCandidateTile % 16 == 0 && kCandidateTile % 8 == 0, "P·V consumes candidates in k16 steps");
  static_assert(Geometry::kThreadsPerRow * 16 == 64, "a warp stages 8 rows × 64 bytes per cp.async (kPaddedPitch)");
  static_assert(kCandidateTile % kRoundRows == 0 && kRoundRows * 4 == kProducerThreads,
                "a tile is whole producer rounds of 4 threads a row");
  static_assert(kDirectTiles || (kStagePitch >= Geometry::kStagedRowBytes && kStagePitch % 16 == 0),
                "staged rows must not overlap");
  static_assert(!kDirectTiles || (Geometry::kQuantUnits == 0 && Geometry::kScaleRecordBytes == 0 && !kExactScales &&
                                  kF.bf16_offset == 0),
                "direct tiles: a row is its BF16 lanes, unit u being lanes [8u, 8u + 8)");
  static_assert((kStages & (kStages - 1)) == 0 && kStages >= 2, "tile buffers are taken by i & (kStages - 1)");
  static_assert(!kExactScales || (kF.group_size > 0 && kDvPerGroup % (kF.group_size > 0 ? kF.group_size : 1) == 0 &&
                                  kF.group_size % 16 == 0 &&
                                  kF.quant_dim == kF.d_v && kF.layout == Layout::kInline),
                "exact scales: whole groups per consumer half and per k16 step, the groups spanning V");
  static_assert(kQOffset % 1024 == 0 && kTileOffset % 1024 == 0 && kTileBytes % 1024 == 0 &&
                    kQBlockBytes % 1024 == 0 && kTileBlockBytes % 1024 == 0,
                "128-byte swizzled operands must start on 1024-byte boundaries");
  static_assert(kPOffset % 1024 == 0 && kPBytes % (8 * kPRowBytes) == 0 && (kPRowBytes == 64 || kPRowBytes == 128),
                "P buffers are whole 64- or 128-byte swizzle atoms (8 rows) on aligned boundaries");
  static_assert(kStageOffset % 16 == 0 && kStageBytes % 16 == 0 && kScaleSlotsOffset % 16 == 0 &&
                    kBiasOffset % 16 == 0 && kRescaleOffset % 16 == 0 && kFinalOffset % 16 == 0 &&
                    kFactorOffset % 16 == 0,
                "staging, scale slots, bias and row factors must be 16-byte aligned");
  // setmaxnreg moves registers between the warpgroups of a block: the block keeps what it was launched
  // with (65536 / kThreads per thread, in steps of 8), and an increase waits until decreases have
  // released enough, so asking for more than that total deadlocks.
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static_assert(kProducerThreads * kProducerRegisters + 128 * kConsumerGroups * kConsumerRegisters <=
                    kThreads * kLaunchRegisters,
                "register reallocation must fit the registers the block is launched with");
  static_assert(kProducerRegisters % 8 == 0 && kConsumerRegisters % 8 == 0, "setmaxnreg takes multiples of 8");
  static_assert(kSharedBytes <= kMaxSharedBytes, "shared memory exceeds the sm_90 per-block limit");
  static_assert(kCandidateTile == 32 || kCandidateTile == 64, "the score accumulators are one m64n32 or m64n64 tile");
  static_assert(!kWideTiles || kDirectTiles, "64-candidate tiles need the shared memory a staging area would take");
  static_assert(kConsumerGroups == 2, "a scorer and a second P·V warpgroup, one half of d_v each");
  static_assert(kLaneSlices == 1 || (kLaneSlices == 2 && !kExactScales && !kWideTiles && kScorerPVInFlight &&
                                     kF.bf16_dim > 0 && kRowDv == kLaneSlices * kDv),
                "lane slices: a two-block cluster of staged FP8 rows with power-of-two scales (one S chain "
                "to exchange), the BF16 lanes in every slice's traits (gathered by slice 0, or split between the "
                "slices), each block one slice's columns of the output");
  static_assert(kExchangeOffset % 16 == 0 && kExchangeBarrierOffset % 8 == 0,
                "exchange buffers take 16-byte stores, transaction barriers are 8-byte words");
  static_assert(kPFreeBarrier < 16, "sm_90 has 16 named barriers");
  static_assert(!kSplitTrailingLanes || ((kKSteps - kQuantKSteps) % kLaneSlices == 0 &&
                                         Geometry::kBf16Units % kLaneSlices == 0 && kF.quant_dim % 16 == 0),
                "split trailing lanes: each block's share is whole k16 steps and whole 16-byte units");
};

// 16 heads a block: the transposed tile of config_h16.h.
template <FormatId kFormat>
struct HopperConfig<kFormat, 16> : HopperH16Config<kFormat> {};

}  // namespace jsmla::cuda::hopper
