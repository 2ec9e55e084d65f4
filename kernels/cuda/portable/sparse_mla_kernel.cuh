// The portable sparse-MLA kernel (see config.h for the warp grid). One template serves both plan
// variants: decode (split s of a token writes its partial state to the split workspace, merged by
// combine.cuh) and prefill (one split per token writes out/lse directly, sink folded in).
//
// Pipeline per candidate tile i, with a single BF16 tile and a single staging area:
//   load the indices of tile i+2 (kept in flight across the MMAs)
//   S = Q·Kᵀ (tile i) → exchange partial S → mask → online softmax → O += P·V (tile i)
//   __syncthreads                                  (tile i and the exchange are free)
//   wait for the own staged bytes of tile i+1, convert them into the BF16 tile
//   issue the cp.async gather of tile i+2
//   __syncthreads                                  (tile i+1 is ready)
// so the gather of a tile overlaps the MMAs of the tile before it; the FP8 conversion runs between
// them, once per block for all heads of the tile.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/candidate_tiles.cuh"
#include "kernels/cuda/epilogue.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/launch_utils.h"
#include "kernels/cuda/load_tile.cuh"
#include "kernels/cuda/online_softmax.cuh"
#include "kernels/cuda/portable/config.h"
#include "kernels/cuda/softmax_merge.cuh"

namespace jsmla::cuda::portable {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) sparse_mla_portable_kernel(const __grid_constant__ SplitKvParams p) {
  using Loader = TileLoaderOf<typename Cfg::Geometry>;
  constexpr int kN = Cfg::kCandidateTile;
  constexpr int kPitch = Cfg::kTilePitch;
  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* const tile = reinterpret_cast<uint16_t*>(smem + Cfg::kTileOffset);
  uint8_t* const stage = smem + Cfg::kStageOffset;
  uint8_t* const scale_slots = smem + Cfg::kScaleSlotsOffset;
  float* const exchange = reinterpret_cast<float*>(smem + Cfg::kExchangeOffset);
  float* const score_bias = reinterpret_cast<float*>(smem + Cfg::kBiasOffset);
  float* const factors = reinterpret_cast<float*>(smem + Cfg::kFactorOffset);  // exact scales only

  // The split merge queued after a decode launch may start its blocks now (it waits for this grid's
  // results before reading them).
  allow_dependent_launch();
  const AttentionParams& a = p.attn;
  const BlockCoordinates coordinates(p);
  const int split = coordinates.split;
  const int64_t token = coordinates.token;
  const int head_begin = coordinates.head_tile * Cfg::kHeadTile;
  const int num_heads = a.num_heads;

  if (token >= valid_token_count(a.valid_tokens, a.num_tokens)) {
    write_padding_rows<Cfg::kDv>(p, token, head_begin, Cfg::kHeadTile, threadIdx.x, Cfg::kThreads);
    return;
  }

  const CandidateTiles<kN> tiles = split_tiles<kN>(p, coordinates);

  // ---- loader role: row `load_row` of every tile, units `load_sub` + k*kThreadsPerRow ----
  const int load_row = threadIdx.x / Loader::kThreadsPerRow;
  const int load_sub = threadIdx.x % Loader::kThreadsPerRow;
  uint8_t* const staged_row = stage + load_row * Loader::kStagedRowBytes;
  uint8_t* const scale_slot = scale_slots + threadIdx.x * Loader::kScaleSlotBytes;
  uint16_t* const tile_row = tile + load_row * kPitch;

  auto read_row = [&](int tile_index) { return read_pending_row<Loader::kF.dual_cache>(a, tiles, token, tile_index, load_row); };
  // Starts the gather of a row; returns whether it is valid (a masked row is never read).
  auto issue_row = [&](const PendingRow& row) {
    const bool valid = pending_valid<Loader::kF.dual_cache>(a, row);
    if (valid) Loader::issue(pending_cache<Loader::kF.dual_cache>(a, row), row.index, staged_row, scale_slot, load_sub);
    cp_async_commit();
    return valid;
  };
  auto convert_row = [&](bool valid) {
    cp_async_wait_all();
    Loader::convert(valid, staged_row, scale_slot, tile_row, load_sub);
    if (load_sub == 0) {
      score_bias[load_row] = valid ? 0.0f : -INFINITY;
      if constexpr (Cfg::kExactScales) Loader::write_factors(valid, scale_slot, factors, load_row);
    }
  };

  // ---- prologue: gather tile 0, load Q, convert tile 0, gather tile 1 ----
  bool staged_valid = issue_row(read_row(0));
  PendingRow pending = read_row(1);

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int head_group = warp % Cfg::kHeadGroups;
  const int d_split = warp / Cfg::kHeadGroups;
  // Rows lane/4 and lane/4 + 8 of the warp's 16 heads (m16n8 accumulator / A-fragment layout).
  const int head_a = head_begin + 16 * head_group + lane / 4;
  const int head_b = head_a + 8;

  uint32_t q_fragment[Cfg::kKStepsPerWarp][4];
  {
    const uint16_t* q_a = a.q + (token * num_heads + head_a) * Cfg::kDqk;
    const uint16_t* q_b = a.q + (token * num_heads + head_b) * Cfg::kDqk;
    const int k_first = d_split * Cfg::kKStepsPerWarp * 16 + 2 * (lane % 4);
#pragma unroll
    for (int ks = 0; ks < Cfg::kKStepsPerWarp; ++ks) {
      const int k = k_first + 16 * ks;
      q_fragment[ks][0] = head_a < num_heads ? load_global_u32(q_a + k) : 0u;
      q_fragment[ks][1] = head_b < num_heads ? load_global_u32(q_b + k) : 0u;
      q_fragment[ks][2] = head_a < num_heads ? load_global_u32(q_a + k + 8) : 0u;
      q_fragment[ks][3] = head_b < num_heads ? load_global_u32(q_b + k + 8) : 0u;
    }
  }

  if (tiles.count > 0) convert_row(staged_valid);
  staged_valid = issue_row(pending);
  __syncthreads();

  // ---- main loop ----
  const float score_scale = a.sm_scale * kLog2e;  // scores in the log2 domain
  RunningSoftmax softmax;                         // rows lane/4 and lane/4 + 8 of the warp's 16
  float out_acc[Cfg::kOutTiles][4];
  float (&out_registers)[Cfg::kOutTiles * 4] = reinterpret_cast<float (&)[Cfg::kOutTiles * 4]>(out_acc);
#pragma unroll
  for (int i = 0; i < Cfg::kOutTiles * 4; ++i) out_registers[i] = 0.0f;

  // ldmatrix row addresses. K (B of S, not transposed): matrices (n0-7,k0-7) (n0-7,k8-15) (n8-15,k0-7)
  // (n8-15,k8-15). V (B of P·V, transposed): (k0-7,n0-7) (k8-15,n0-7) (k0-7,n8-15) (k8-15,n8-15).
  const uint16_t* const k_lane =
      tile + (lane % 8 + (lane / 16) * 8) * kPitch + d_split * Cfg::kKStepsPerWarp * 16 + ((lane / 8) % 2) * 8;
  const uint16_t* const v_lane =
      tile + (lane % 8 + ((lane / 8) % 2) * 8) * kPitch + d_split * Cfg::kDvPerWarp + (lane / 16) * 8;

  for (int tile_index = 0; tile_index < tiles.count; ++tile_index) {
    pending = read_row(tile_index + 2);

    float score[Cfg::kScoreTiles][4];
#pragma unroll
    for (int i = 0; i < Cfg::kScoreTiles; ++i) score[i][0] = score[i][1] = score[i][2] = score[i][3] = 0.0f;
    const int ks_first = d_split * Cfg::kKStepsPerWarp;  // the warp's first global k-step
#pragma unroll
    for (int ks = 0; ks < Cfg::kKStepsPerWarp; ++ks) {
      if constexpr (Cfg::kExactScales) {
        // Leaving group g: S_g·(m_g/m_{g+1}), so that after the last group one multiply by its
        // mantissa gives Σ_g m_g·S_g (the BF16 lanes after the groups have m = 1).
        const int group = (ks_first + ks) / Cfg::kGroupKSteps;
        if (ks > 0 && (ks_first + ks) % Cfg::kGroupKSteps == 0 && group <= Loader::kNumGroups) {
          scale_score_columns(score, factors + (Loader::kNumGroups + group - 1) * kN, lane);
        }
      }
#pragma unroll
      for (int pair = 0; pair < Cfg::kScoreTiles / 2; ++pair) {
        uint32_t b[4];
        ldmatrix_x4(b, k_lane + pair * 16 * kPitch + ks * 16);
        mma_bf16_16816(score[2 * pair], q_fragment[ks], b[0], b[1]);
        mma_bf16_16816(score[2 * pair + 1], q_fragment[ks], b[2], b[3]);
      }
    }

    if constexpr (Cfg::kExactScales) {
      const int last_group = (ks_first + Cfg::kKStepsPerWarp - 1) / Cfg::kGroupKSteps;
      if (last_group < Loader::kNumGroups) scale_score_columns(score, factors + last_group * kN, lane);
    }

    if constexpr (Cfg::kDSplits > 1) {
      // Sum the head group's partial scores in d-split order: identical bits in every warp of the group.
      float* mine = exchange + warp * Cfg::kExchangeFloatsPerWarp;
#pragma unroll
      for (int i = 0; i < Cfg::kScoreTiles * 4; ++i) mine[i * 32 + lane] = score[i / 4][i % 4];
      named_barrier_sync(1 + head_group, 32 * Cfg::kDSplits);
#pragma unroll
      for (int i = 0; i < Cfg::kScoreTiles * 4; ++i) {
        const float own = score[i / 4][i % 4];
        float total = 0.0f;
#pragma unroll
        for (int c = 0; c < Cfg::kDSplits; ++c) {
          const float part = c == d_split
                                 ? own
                                 : exchange[(c * Cfg::kHeadGroups + head_group) * Cfg::kExchangeFloatsPerWarp + i * 32 + lane];
          total = c == 0 ? part : total + part;
        }
        score[i / 4][i % 4] = total;
      }
    }

    // Online softmax in the log2 domain; masked candidates get -inf through score_bias.
    float rescale[2];
    softmax.update(score, score_bias, score_scale, lane, rescale);
    if (RunningSoftmax::needs_rescale(rescale)) rescale_rows(out_registers, rescale);

    // P·V. Exact scales: the V lanes of group g are FP8·2^e in the tile, so P is multiplied by the
    // candidates' mantissas m_g (in FP32, before the one rounding to BF16), per group of the warp's columns.
    constexpr int kPGroups = Cfg::kExactScales ? Cfg::kDvPerWarp / Cfg::kF.group_size : 1;
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t p_fragment[kPGroups][4];
#pragma unroll
      for (int pg = 0; pg < kPGroups; ++pg) {
        float2 m_lo = make_float2(1.0f, 1.0f);
        float2 m_hi = m_lo;
        if constexpr (Cfg::kExactScales) {
          const float* mantissa = factors + (d_split * kPGroups + pg) * kN + 16 * kk + 2 * (lane % 4);
          m_lo = *reinterpret_cast<const float2*>(mantissa);
          m_hi = *reinterpret_cast<const float2*>(mantissa + 8);
        }
        p_fragment[pg][0] = pack_bf16x2(score[2 * kk][0] * m_lo.x, score[2 * kk][1] * m_lo.y);
        p_fragment[pg][1] = pack_bf16x2(score[2 * kk][2] * m_lo.x, score[2 * kk][3] * m_lo.y);
        p_fragment[pg][2] = pack_bf16x2(score[2 * kk + 1][0] * m_hi.x, score[2 * kk + 1][1] * m_hi.y);
        p_fragment[pg][3] = pack_bf16x2(score[2 * kk + 1][2] * m_hi.x, score[2 * kk + 1][3] * m_hi.y);
      }
#pragma unroll
      for (int pair = 0; pair < Cfg::kOutTiles / 2; ++pair) {
        constexpr int kColumnsPerPGroup = Cfg::kDvPerWarp / kPGroups;
        const int pg = (16 * pair) / kColumnsPerPGroup;
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_lane + kk * 16 * kPitch + pair * 16);
        mma_bf16_16816(out_acc[2 * pair], p_fragment[pg], b[0], b[1]);
        mma_bf16_16816(out_acc[2 * pair + 1], p_fragment[pg], b[2], b[3]);
      }
    }

    __syncthreads();
    if (tile_index + 1 < tiles.count) {
      convert_row(staged_valid);
      staged_valid = issue_row(pending);
    }
    __syncthreads();
  }

  // ---- epilogue ----
  softmax.finish();
  store_rows<Cfg::kDv>(p, token, split, {head_a, head_b}, d_split * Cfg::kDvPerWarp + 2 * (lane % 4),
                       d_split == 0 && lane % 4 == 0, softmax, out_registers);
}

// Launches one instantiation on `stream` (the caller has checked the plan and the buffers).
template <class Cfg>
cudaError_t launch_sparse_mla_portable(const SplitKvParams& p, cudaStream_t stream) {
  static DeviceOnce shared_memory_raised;
  return launch_split_kv_grid(&sparse_mla_portable_kernel<Cfg>, Cfg::kThreads, Cfg::kSharedBytes,
                              shared_memory_raised, p, stream);
}

}  // namespace jsmla::cuda::portable
