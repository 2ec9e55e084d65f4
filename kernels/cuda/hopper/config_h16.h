// Tile shapes and shared-memory layout of the Hopper family's 16-head tile (sm_90a), for plans of
// 16 heads a block (tensor-parallel shards). Host-compilable constexpr, included by config.h as the
// HopperConfig<format, 16> specialisation, so kernel_table.h and the planner see it like the 64-head
// tile.
//
// With 16 heads the MMAs are small and converting the gathered rows is the work, so the block gives
// two warpgroups to the conversion and one to the MMAs, and computes the products transposed: the
// candidates are the wgmma M dimension (64 a tile), the heads its N.
// Block = (token, 16-head tile, split), 3 warpgroups:
//   warpgroups 0 and 1, the producers: each gathers one 32-row half of every 64-candidate tile with
//     cp.async into its own staging rows (one stage: a thread copies its staged units into registers
//     and refills its staging rows with the next tile's before it converts), converts them
//     (FP8 or FP4 × scale → BF16) into a two-buffer BF16 tile in the 128-byte swizzled layout;
//   warpgroup 2, the consumer: Sᵀ = K·Qᵀ (wgmma m64n16k16, K and Q from shared memory, both K-major),
//     the online softmax per head column (tile maxima exchanged between its four warps through shared
//     memory), Pᵀ (BF16, 16 × 64) into shared memory, and Oᵀ[d_v, 16] += Vᵀ·Pᵀ (8 wgmma m64n16k16 per
//     k16 step, V = the same tile read MN-major), left in flight behind the next tile's Sᵀ.
// Named barriers: full[b] (producers → consumer), empty[b] (consumer → producers), and one among the
// consumer's warps (Q loaded, tile maxima exchanged, P written, the final sums).
#pragma once

#include "kernels/common/formats.h"
#include "kernels/cuda/loader_geometry.h"

namespace jsmla::cuda::hopper {

// Formats the 16-head tile serves: 512/576-wide FP8 or FP4 rows with power-of-two, E4M3 or UE8M0
// scales (the producers' conversion is exact in BF16). BF16 rows and arbitrary FP32 scales stay on the
// portable family's 16-head tile.
constexpr bool hopper_h16_format(FormatId id) {
  const FormatTraits f = format_traits(id);
  const bool exact_scales = f.scale_kind == ScaleKind::kFp32 && !f.pow2_scales;
  return (f.d_qk == 512 || f.d_qk == 576) && f.d_v == 512 && f.layout != Layout::kBf16 && f.quant_bits > 0 &&
         !exact_scales;
}

template <FormatId kFormat>
struct HopperH16Config {
  static constexpr FormatTraits kF = format_traits(kFormat);
  static constexpr bool kTransposed = true;  // Sᵀ and Oᵀ: candidates and d_v are wgmma M, the heads N
  static constexpr int kHeadTile = 16;       // wgmma N
  static constexpr int kCandidateTile = 64;  // wgmma M of Sᵀ, four k16 steps of Oᵀ
  // Splits shorter than a tile stay on the portable 16-head tile: half of every tile would be masked
  // rows (H200, T = 1, H = 16, 64 splits of 32: 11.4-11.6 µs here against 10.6-11.1 there).
  static constexpr int kMinSplitSize = kCandidateTile;
  static constexpr int kLaneSlices = 1;  // one block per (token, head tile, split)
  static constexpr int kRoundRows = 32;      // rows of a tile one producer warpgroup converts (4 threads a row)
  static constexpr int kProducerGroups = 2;
  static constexpr int kProducerThreads = 128 * kProducerGroups;
  static constexpr int kConsumerThreads = 128;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kDqk = kF.d_qk;
  static constexpr int kDv = kF.d_v;
  static constexpr int kKSteps = kDqk / 16;             // k16 steps of Sᵀ
  static constexpr int kDvBlocks = kDv / 64;            // m64 blocks of Oᵀ
  static constexpr int kOutRegisters = kDvBlocks * 8;   // FP32 accumulators of Oᵀ per thread (m64n16: 8)
  static constexpr int kAtomBytes = 128;                // one swizzle row: 64 BF16 values

  // One producer warpgroup's geometry: a 32-row round with 4 threads a row.
  using Geometry = LoaderGeometry<kFormat, kRoundRows, 128>;
  static constexpr int kStages = 2;  // tile buffers, score-bias rows, P buffers and scale-slot sets

  // Shared memory, in bytes (offsets from a 1024-byte aligned base):
  //   Q [kDqk/64 column blocks][16 heads][128 B], swizzled (the K-major B of Sᵀ);
  //   kStages BF16 KV tiles [kDqk/64][64 candidates][128 B], swizzled (K-major A of Sᵀ, MN-major A of Oᵀ);
  //   kStages P buffers [16 heads][64 candidates] BF16, one 128-byte swizzle row per head (K-major B of Oᵀ);
  //   each producer warpgroup's staging rows (one stage), kStages sets of per-thread scale slots,
  //   kStages score-bias rows, the four warps' tile maxima per head. After the last tile the first tile
  //   buffer holds the output rows [16][kOutPitch] FP32 on their way to global memory.
  static constexpr int kQBytes = kHeadTile * kDqk * 2;
  static constexpr int kQBlockBytes = kHeadTile * kAtomBytes;
  static constexpr int kTileBytes = kCandidateTile * kDqk * 2;
  static constexpr int kTileBlockBytes = kCandidateTile * kAtomBytes;
  static constexpr int kPBytes = kHeadTile * kCandidateTile * 2;
  static constexpr int kScaleSlotsBytes = Geometry::kScaleRecordBytes > 0 ? kProducerThreads * Geometry::kScaleSlotBytes : 0;
  static constexpr int kBiasBytes = kCandidateTile * 4;
  static constexpr int kExchangeBytes = 4 * kHeadTile * 4;  // [consumer warp][head]
  // Staged rows an odd multiple of 64 bytes apart where they fit (hopper/config.h: bank groups).
  static constexpr int kPaddedPitch = (Geometry::kStagedRowBytes + 64 + 127) / 128 * 128 - 64;
  static constexpr bool fits(int pitch) {
    return kQBytes + kStages * kTileBytes + kStages * kPBytes + kProducerGroups * kRoundRows * pitch +
               kStages * kScaleSlotsBytes + kStages * kBiasBytes + kExchangeBytes + 1024 <=
           227 * 1024;
  }
  static constexpr int kStagePitch = fits(kPaddedPitch) ? kPaddedPitch : Geometry::kStagedRowBytes;
  static constexpr int kStageBytes = kRoundRows * kStagePitch;  // one producer warpgroup's rows
  // The output rows staged for coalesced stores: 4 floats of padding put a warp's 32 scalar stores
  // (8 columns × 4 heads 2 apart) into 32 different banks.
  static constexpr int kOutPitch = kDv + 4;

  static constexpr int kQOffset = 0;
  static constexpr int kTileOffset = kQOffset + kQBytes;
  static constexpr int kPOffset = kTileOffset + kStages * kTileBytes;
  static constexpr int kStageOffset = kPOffset + kStages * kPBytes;
  static constexpr int kScaleSlotsOffset = kStageOffset + kProducerGroups * kStageBytes;
  static constexpr int kBiasOffset = kScaleSlotsOffset + kStages * kScaleSlotsBytes;
  static constexpr int kExchangeOffset = kBiasOffset + kStages * kBiasBytes;
  static constexpr int kUsedBytes = kExchangeOffset + kExchangeBytes;
  static constexpr int kSharedBytes = kUsedBytes + 1024;  // slack to align the base to 1024 bytes

  // Named barriers (0 is __syncthreads).
  static constexpr int kFullBarrier = 1;             // + tile buffer: producers arrive, the consumer waits
  static constexpr int kEmptyBarrier = 1 + kStages;  // + tile buffer: the consumer arrives, producers wait
  static constexpr int kConsumerBarrier = 1 + 2 * kStages;  // the consumer's four warps

  static_assert(hopper_h16_format(kFormat), "format not served by the Hopper 16-head tile");
  static_assert(kDqk % 64 == 0 && kDv % 64 == 0, "rows must be whole 64-column swizzle blocks");
  static_assert(kCandidateTile == kProducerGroups * kRoundRows, "each producer warpgroup converts one round of a tile");
  static_assert(kCandidateTile == 64, "a tile is one wgmma M of Sᵀ");
  static_assert(Geometry::kThreadsPerRow == 4, "a producer warpgroup covers 32 rows with 4 threads a row");
  static_assert(kStagePitch >= Geometry::kStagedRowBytes && kStagePitch % 16 == 0, "staged rows must not overlap");
  static_assert(kQOffset % 1024 == 0 && kTileOffset % 1024 == 0 && kTileBytes % 1024 == 0 && kQBlockBytes % 1024 == 0 &&
                    kTileBlockBytes % 1024 == 0 && kPOffset % 1024 == 0 && kPBytes % 1024 == 0,
                "128-byte swizzled operands must start on 1024-byte boundaries");
  static_assert(kStageOffset % 16 == 0 && kStageBytes % 16 == 0 && kScaleSlotsOffset % 16 == 0 &&
                    kBiasOffset % 16 == 0 && kExchangeOffset % 16 == 0,
                "staging, scale slots, bias and exchange rows must be 16-byte aligned");
  static_assert(kHeadTile * kOutPitch * 4 <= kTileBytes && (kOutPitch * 4) % 16 == 0,
                "the output rows fit the first tile buffer, each 16-byte aligned");
  static_assert(kSharedBytes <= 227 * 1024, "shared memory exceeds the sm_90 per-block limit");
  static_assert(kEmptyBarrier + kStages <= kConsumerBarrier && kConsumerBarrier < 16, "sm_90 has 16 named barriers");
  // 384 threads, one block an SM: 168 registers each, enough for both roles without reallocation.
  static_assert(65536 / kThreads / 8 * 8 >= 160, "both roles run within the launch's registers");
};

}  // namespace jsmla::cuda::hopper
