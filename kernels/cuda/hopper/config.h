// Tile shapes and shared-memory layout of the Hopper kernel family (sm_90a: wgmma, register
// reallocation, 227 KB of shared memory per block). Host-compilable constexpr: kernel_table.h turns
// it into the table the planner reads through the CPU extension.
//
// Block = (token, 64-head tile, split), 3 warpgroups:
//   warpgroup 0, the producer: gathers candidate rows with cp.async into a two-stage staging area and
//     converts them (FP8 or FP4 × scale → BF16, or BF16 copies) into a two-buffer BF16 KV tile in the
//     128-byte swizzled layout wgmma reads;
//   warpgroups 1 and 2, the consumers: each computes a partial S = Q·Kᵀ for all 64 heads and the
//     tile's 32 candidates over its half of d_qk (wgmma m64n32k16, Q and K from shared memory), the two
//     partials are exchanged through shared memory and summed in one fixed order (both consumers hold
//     identical S), each runs the same online softmax in registers and accumulates O[:, its half of
//     d_v] += P·V (wgmma m64n256k16, P from registers, V = the same tile read N-major). Where the
//     exchange does not fit in shared memory (bf16_576), each consumer computes all of S instead.
// Named barriers hand tiles over: full[b] (producer → consumers) and empty[b] (consumers → producer).
#pragma once

#include "kernels/common/formats.h"
#include "kernels/cuda/loader_geometry.h"

namespace jsmla::cuda::hopper {

// Shared memory per block on sm_90 (opt-in maximum).
inline constexpr int kMaxSharedBytes = 227 * 1024;

// Formats the family serves: 512/576-wide FP8, FP4 or BF16 rows with power-of-two, E4M3 or no scales
// (arbitrary FP32 scales and the 1088-wide rows stay on the portable family).
constexpr bool hopper_format(FormatId id) {
  const FormatTraits f = format_traits(id);
  return (f.d_qk == 512 || f.d_qk == 576) && f.d_v == 512 && !(f.scale_kind == ScaleKind::kFp32 && !f.pow2_scales);
}

template <FormatId kFormat, int kHeadTileValue>
struct HopperConfig {
  static constexpr FormatTraits kF = format_traits(kFormat);
  static constexpr int kHeadTile = kHeadTileValue;  // wgmma M
  static constexpr int kCandidateTile = 32;   // wgmma N of S, 2 k16 steps of P·V
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerGroups = 2;
  static constexpr int kThreads = kProducerThreads + 128 * kConsumerGroups;
  static constexpr int kProducerRegisters = 104;
  static constexpr int kConsumerRegisters = 200;
  static constexpr int kDqk = kF.d_qk;
  static constexpr int kDv = kF.d_v;
  static constexpr int kDvPerGroup = kDv / kConsumerGroups;  // wgmma N of P·V
  static constexpr int kKSteps = kDqk / 16;                  // k16 steps of S
  static constexpr int kOutRegisters = kDvPerGroup / 2;      // FP32 accumulators of O per thread
  static constexpr int kAtomBytes = 128;                     // one swizzle row: 64 BF16 values

  using Geometry = LoaderGeometry<kFormat, kCandidateTile, kProducerThreads>;
  // Staged units a producer thread loads before converting them (bounded by its registers).
  static constexpr int kConvertBatch = 10;

  // Shared memory, in bytes (offsets from a 1024-byte aligned base):
  //   Q [kDqk/64 column blocks][64 heads][128 B], swizzled;
  //   two BF16 KV tiles [kDqk/64][32 candidates][128 B], swizzled;
  //   two staging areas of raw rows, two sets of per-thread scale slots, two score-bias rows.
  static constexpr int kQBytes = kHeadTile * kDqk * 2;
  static constexpr int kQBlockBytes = kHeadTile * kAtomBytes;          // one 64-column block of Q
  static constexpr int kTileBytes = kCandidateTile * kDqk * 2;
  static constexpr int kTileBlockBytes = kCandidateTile * kAtomBytes;  // one 64-column block of a tile
  static constexpr int kScaleSlotsBytes = Geometry::kScaleRecordBytes > 0 ? kProducerThreads * Geometry::kScaleSlotBytes : 0;
  static constexpr int kBiasBytes = kCandidateTile * 4;
  // Partial scores: [2 buffers][2 consumers][16 values][128 threads] floats.
  static constexpr int kExchangeBytes = 2 * kConsumerGroups * 16 * 128 * 4;
  // Staged rows preferably sit an odd multiple of 64 bytes apart: a warp's cp.async (and later its
  // shared-memory loads) covers 8 rows × 64 contiguous bytes, which then fall into alternating halves
  // of the 32 banks, 4 wavefronts per instruction (a pitch that is a multiple of 128 bytes puts all 8
  // rows on the same 16 banks, 4 times the wavefronts).
  static constexpr int kPaddedPitch = (Geometry::kStagedRowBytes + 64 + 127) / 128 * 128 - 64;
  static constexpr bool fits(int pitch, bool split_scores) {
    return kQBytes + 2 * kTileBytes + 2 * kCandidateTile * pitch + 2 * kScaleSlotsBytes + 2 * kBiasBytes +
               (split_scores ? kExchangeBytes : 0) + 1024 <=
           kMaxSharedBytes;
  }
  // Split S between the consumers (halves the Q·Kᵀ work and its shared-memory reads) when it fits, with
  // the padded pitch if that fits too.
  static constexpr bool kSplitScores = fits(Geometry::kStagedRowBytes, true);
  static constexpr int kStagePitch = fits(kPaddedPitch, kSplitScores) ? kPaddedPitch : Geometry::kStagedRowBytes;
  static constexpr int kStageBytes = kCandidateTile * kStagePitch;

  static constexpr int kQOffset = 0;
  static constexpr int kTileOffset = kQOffset + kQBytes;
  static constexpr int kStageOffset = kTileOffset + 2 * kTileBytes;
  static constexpr int kScaleSlotsOffset = kStageOffset + 2 * kStageBytes;
  static constexpr int kBiasOffset = kScaleSlotsOffset + 2 * kScaleSlotsBytes;
  static constexpr int kExchangeOffset = kBiasOffset + 2 * kBiasBytes;
  static constexpr int kUsedBytes = kExchangeOffset + (kSplitScores ? kExchangeBytes : 0);
  static constexpr int kSharedBytes = kUsedBytes + 1024;  // slack to align the base to 1024 bytes
  // k16 steps of S per consumer.
  static constexpr int kKStepsPerGroup = kSplitScores ? kKSteps / kConsumerGroups : kKSteps;

  // Named barriers (0 is __syncthreads).
  static constexpr int kFullBarrier = 1;   // + buffer
  static constexpr int kEmptyBarrier = 3;  // + buffer
  static constexpr int kQBarrier = 5;      // consumers only: Q is in shared memory
  static constexpr int kExchangeBarrier = 6;  // consumers only: both partial scores are written

  static_assert(hopper_format(kFormat), "format not served by the Hopper family");
  static_assert(kHeadTile == 64, "a head tile is one wgmma M of 64 rows");
  static_assert(kDqk % 64 == 0 && kDv % 64 == 0, "rows must be whole 64-column swizzle blocks");
  static_assert(kDvPerGroup == 256, "one m64n256k16 wgmma per k16 step covers a consumer's half of d_v");
  static_assert(kCandidateTile % 16 == 0 && kCandidateTile % 8 == 0, "P·V consumes candidates in k16 steps");
  static_assert(kProducerThreads % kCandidateTile == 0, "every tile row gets the same number of producer threads");
  static_assert(Geometry::kThreadsPerRow * 16 == 64, "a warp stages 8 rows × 64 bytes per cp.async (kPaddedPitch)");
  static_assert(kStagePitch >= Geometry::kStagedRowBytes && kStagePitch % 16 == 0, "staged rows must not overlap");
  static_assert(!Geometry::kExactScales, "arbitrary FP32 scales are not served by this family");
  static_assert(kQOffset % 1024 == 0 && kTileOffset % 1024 == 0 && kTileBytes % 1024 == 0 &&
                    kQBlockBytes % 1024 == 0 && kTileBlockBytes % 1024 == 0,
                "swizzled operands must start on 1024-byte boundaries");
  static_assert(kStageOffset % 16 == 0 && kStageBytes % 16 == 0 && kScaleSlotsOffset % 16 == 0 &&
                    kBiasOffset % 16 == 0 && kExchangeOffset % 16 == 0,
                "staging, scale slots and bias must be 16-byte aligned");
  // setmaxnreg moves registers between the warpgroups of a block: the block keeps what it was launched
  // with (65536 / kThreads per thread, in steps of 8), and an increase waits until decreases have
  // released enough, so asking for more than that total deadlocks.
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static_assert(kProducerThreads * kProducerRegisters + 128 * kConsumerGroups * kConsumerRegisters <=
                    kThreads * kLaunchRegisters,
                "register reallocation must fit the registers the block is launched with");
  static_assert(kProducerRegisters % 8 == 0 && kConsumerRegisters % 8 == 0, "setmaxnreg takes multiples of 8");
  static_assert(kSharedBytes <= kMaxSharedBytes, "shared memory exceeds the sm_90 per-block limit");
  static_assert(kCandidateTile == 32, "the score accumulators below are one m64n32 tile");
  static_assert(kConsumerGroups == 2 && kKSteps % kConsumerGroups == 0, "S splits into two whole k16 ranges");
};

}  // namespace jsmla::cuda::hopper
