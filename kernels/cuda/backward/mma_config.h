// Tile shapes and shared memory of the tensor-core backward kernel (mma_kernel.cuh). Host-compilable
// constexpr: the backward's dispatcher (kernels/cuda/backward.cu) compares the shared memory an instance
// needs with what the device allows a block.
#pragma once

#include <cstdint>

#include "kernels/common/contract.h"
#include "kernels/common/formats.h"
#include "kernels/cuda/backward/mma_launch.h"
#include "kernels/cuda/backward_workspace.h"
#include "kernels/cuda/loader_geometry.h"

namespace jsmla::cuda::backward {

// The largest shared memory a block may have on sm_90 (sm_80: 163 KB, sm_86/89/120: 99 KB; there the
// SIMT kernel runs instead).
inline constexpr int kMaxSharedBytes = 227 * 1024;

template <FormatId kFormatValue>
struct BackwardMmaConfig {
  static constexpr FormatId kFormat = kFormatValue;
  static constexpr FormatTraits kF = format_traits(kFormat);
  static constexpr int kHeadTile = 64;
  static constexpr int kHeadGroups = 4;   // m16 row blocks of the head tile
  static constexpr int kHalves = 2;       // warps per row block: candidate halves of S, column halves of d_q
  static constexpr int kWarps = kHeadGroups * kHalves;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kCandidateTile = 32;
  static constexpr int kDqk = kF.d_qk;
  static constexpr int kDv = kF.d_v;
  static constexpr int kScoreColumns = kCandidateTile / kHalves;  // S columns per warp
  static constexpr int kScoreTiles = kScoreColumns / 8;           // their n8 tiles
  static constexpr int kDqColumns = kDqk / kHalves;               // d_q columns per warp
  static constexpr int kDqTiles = kDqColumns / 8;                 // their n8 tiles (accumulators / 4)

  using Geometry = LoaderGeometry<kFormat, kCandidateTile, kThreads>;
  static constexpr int kTilePitch = Geometry::kTilePitch;  // BF16 elements between rows of the KV tile
  // Rows of Q, dO and c in shared memory: 16 bytes more than the data, so that the 8 rows one ldmatrix
  // phase reads fall into 8 different 16-byte bank groups (as the KV tile's, loader_geometry.h).
  static constexpr int kQPitch = kDqk + 8;
  static constexpr int kDoPitch = kDv + 8;
  static constexpr int kCPitch = kCandidateTile + 8;

  // Shared memory: one struct, sized by sizeof.
  struct SharedMemory {
    uint16_t q[kHeadTile][kQPitch];
    uint16_t d_out[kHeadTile][kDoPitch];
    uint16_t tile[kCandidateTile][kTilePitch];    // BF16 K of the current tile (V: its first d_v lanes)
    uint16_t c[kHeadTile][kCPitch];               // c of the current tile, BF16
    alignas(16) uint8_t stage[kCandidateTile * Geometry::kStagedRowBytes];  // raw rows of the next tile
    alignas(16) uint8_t scale_slots[Geometry::kScaleRecordBytes > 0 ? kThreads * Geometry::kScaleSlotBytes : 16];
    float score_bias[kCandidateTile];             // 0, or -inf for a masked candidate
    float lse2[kHeadTile];                        // lse·log2(e); +inf for a row without weight on candidates
    float d_term[kHeadTile];                      // D - dlse of the row
  };
  static constexpr int kSharedBytes = static_cast<int>(sizeof(SharedMemory));

  static_assert(mma_backward_serves(kF), "the tensor-core backward does not serve this format (mma_launch.h)");
  static_assert(kDqk % (16 * kHalves) == 0 && kDv % 16 == 0, "S, dP and d_q must be whole k16 steps / n16 pairs");
  static_assert(kDqTiles % 2 == 0 && kScoreTiles % 2 == 0, "B fragments are loaded for pairs of n8 tiles");
  static_assert(kCandidateTile % 16 == 0, "c·K consumes candidates in k16 steps");
  static_assert(kHeadTile == 16 * kHeadGroups, "a head group is one m16 row block");
  static_assert(!Geometry::kExactScales, "the BF16 tile must hold K exactly scaled (no mantissa factors)");
  static_assert((kQPitch * 2) % 16 == 0 && ((kQPitch * 2) / 16) % 8 == 1 && ((kDoPitch * 2) / 16) % 8 == 1 &&
                    (kDoPitch * 2) % 16 == 0 && (kCPitch * 2) % 16 == 0 && ((kCPitch * 2) / 16) % 2 == 1,
                "ldmatrix rows must be 16-byte aligned and spread over the bank groups");
  static_assert(Geometry::kStagedRowBytes % 16 == 0, "staged rows must stay 16-byte aligned");
  static_assert(kSharedBytes <= kMaxSharedBytes, "shared memory exceeds the 227 KB a block may have on sm_90");
  // 144 d_q accumulators (d_qk 576) plus the S and dP fragments must fit the 255 registers a thread of a
  // 256-thread block may have.
  static_assert(kThreads == 256 && kDqTiles * 4 <= 144, "the d_q accumulators must fit the register budget");

  // The partials kernel (a bf16 cache's gradient): block = (token, half of d_qk's columns), 8 warps in a
  // 2 × 4 grid over 64 candidate positions × the half's columns (a warp: 32 positions, two m16 blocks, ×
  // a quarter of the columns, so each B fragment serves two MMAs); the products' k-dimension is the heads
  // twice over (c against q, then P against dO), padded to 16, at most 2 × kMaxHeads. Two A buffers: the
  // next tile's copies overlap this tile's products.
  struct Partials {
    static constexpr int kTile = BackwardWorkspace::kPositionPitchGranule;  // candidate positions per step
    static constexpr int kSpan = kDqk / 2;                                  // columns per block
    static constexpr int kPositionWarps = 2;
    static constexpr int kColumnWarps = 4;
    static constexpr int kRowBlocks = kTile / kPositionWarps / 16;          // m16 blocks of a warp
    static constexpr int kColumnsPerWarp = kSpan / kColumnWarps;
    static constexpr int kTiles = kColumnsPerWarp / 8;                      // n8 tiles of a warp
    static constexpr int kRows = 2 * kMaxHeads;                             // k: q's heads, then dO's
    static constexpr int kBPitch = kSpan + 8;
    static constexpr int kAPitch = kTile + 8;
    struct SharedMemory {
      uint16_t b[kRows][kBPitch];     // q, then dO, of the token's heads: the half's columns
      uint16_t a[2][kRows][kAPitch];  // c, then P, of a tile's positions: this tile's and the next's
    };
    static constexpr int kSharedBytes = static_cast<int>(sizeof(SharedMemory));
    static_assert(kPositionWarps * kColumnWarps * 32 == kThreads, "every warp takes one block of the grid");
    static_assert(kRowBlocks * 16 * kPositionWarps == kTile, "whole m16 blocks of positions per warp");
    static_assert(kColumnsPerWarp % 8 == 0 && (kColumnsPerWarp * 2) % 16 == 0,
                  "whole n8 tiles per warp, 16-byte aligned ldmatrix rows");
    static_assert((kBPitch * 2) % 16 == 0 && ((kBPitch * 2) / 16) % 2 == 1 && (kAPitch * 2) % 16 == 0 &&
                      ((kAPitch * 2) / 16) % 2 == 1,
                  "ldmatrix rows must be 16-byte aligned and spread over the bank groups");
    static_assert(kSharedBytes <= kMaxSharedBytes, "the partials kernel's shared memory exceeds 227 KB");
    static_assert(kRowBlocks * kTiles * 4 <= 96, "the accumulators must leave registers for the fragments");
  };

  // The partials kernel on wgmma (sm_90a; partials_wgmma.cuh): block = (token, kColumns of d_qk's
  // columns), two warpgroups, each taking every other 64-position tile (wgmma M = 64 positions, N =
  // kColumns, k = the heads twice over, as above). Both operands sit in shared memory MN-major in the
  // 128-byte swizzled layout (64-element blocks of 128-byte rows, one row per k): B = q then dO of the
  // token's heads (the block's columns), loaded once; A = c then P of a tile's 64 positions, two buffers
  // per warpgroup (the next tile's copies overlap this tile's wgmmas).
  struct PartialsWgmma {
    static constexpr int kTile = 64;                             // positions per warpgroup step
    static constexpr int kGroups = 2;                            // warpgroups
    static constexpr int kThreads = 128 * kGroups;
    static constexpr int kColumns = kDqk % 192 == 0 ? 192 : 128;  // wgmma N
    static constexpr int kColumnBlocks = kDqk / kColumns;         // blocks per token
    static constexpr int kRows = 2 * kMaxHeads;                   // k rows: q's heads, then dO's
    static constexpr int kAtomBytes = 128;                        // one swizzled row: 64 BF16 values
    static constexpr int kBlockBytes = kRows * kAtomBytes;        // one 64-element block of an operand
    static constexpr int kAccumulators = kColumns / 2;            // FP32 a thread (m64nN / 128 threads)
    struct SharedMemory {
      alignas(1024) uint8_t b[kColumns / 64][kRows][kAtomBytes];
      alignas(1024) uint8_t a[kGroups][2][kRows][kAtomBytes];
    };
    // The dynamic shared memory is aligned to 1024 bytes by hand (up to 1008 bytes of padding).
    static constexpr int kSharedBytes = static_cast<int>(sizeof(SharedMemory)) + 1024;
    static_assert(kDqk % kColumns == 0 && kColumns % 64 == 0, "whole 64-column swizzle blocks per block");
    static_assert(kTile == 64, "one wgmma M (64 positions) per warpgroup step, one swizzle block of A");
    static_assert(kBlockBytes % 1024 == 0, "128-byte swizzled operands start on 1024-byte boundaries");
    static_assert(BackwardWorkspace::kPositionPitchGranule % kTile == 0,
                  "positions are padded to whole tiles: a tile never reads past a row's position pitch");
    static_assert(kSharedBytes <= kMaxSharedBytes, "the wgmma partials kernel's shared memory exceeds 227 KB");
    static_assert(kAccumulators == 64 || kAccumulators == 96, "the wgmma shapes written: m64n128, m64n192");
  };
};

}  // namespace jsmla::cuda::backward
