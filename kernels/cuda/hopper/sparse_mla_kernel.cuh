// The Hopper sparse-MLA kernel of 64-head tiles (see config.h for the warpgroup roles; 16-head tiles:
// sparse_mla_h16_kernel.cuh, launched from here too). One template serves both
// plan variants, exactly like the portable family: decode splits write their partial state to the
// split workspace (merged by combine.cuh), prefill writes out/lse directly with the sink folded in.
//
// Producer, per candidate tile i (stage and buffer b = i % 2):
//   wait for its own cp.async of tile i; wait empty[b] (the consumers are done with tile i - 2);
//   convert staging b into tile buffer b; arrive full[b];
//   issue the gather of tile i + 2 into staging b; read the indices of tile i + 3.
// BF16 rows (direct tiles, 64 candidates, two buffers): wait for its own cp.async of tile i;
//   arrive full[b]; wait empty[b ^ 1] (the consumers are done with tile i - 1) and
//   gather tile i + 1 straight into that buffer; read the indices of tile i + 2.
// Scorer, per 32-candidate tile: wait full[b]; fence.proxy.async (for both consumers: warpgroup 2 reads
// the tile behind the scorer's p_ready, wgmma.cuh); issue S = Q·Kᵀ (kDqk/16 wgmmas) behind its P·V of
// the previous tile, wait for that P·V and arrive empty for the previous buffer, then wait for S; softmax;
// P and the rows' rescale factors into shared memory, meet warpgroup 2 at p_ready[b]; O[:, first half]
// += P·V (2 wgmmas, left in flight into the next tile; arbitrary scales: S in stages per scale group,
// and P·V waited for in the tile, config.h). Per 64-candidate tile (whose 32 scores a
// thread holds leave no registers for a P·V in flight): wait full[b]; S, wait; softmax; wait p_free
// (warpgroup 2 is done with the one P buffer); P and the factors; arrive p_ready; P·V (4 wgmmas),
// wait, arrive empty[b].
// Warpgroup 2, per tile: wait p_ready[b]; rescale; O[:, second half] += P·V (P from shared memory);
// arrive empty[b] (and p_free with one P buffer). The MMAs of tile i overlap the conversion of tile
// i + 1 and the gather of tile i + 2 (staged rows), or the gather of tile i + 1 (BF16 rows); warpgroup
// 2's P·V of tile i overlaps the scorer's S of tile i + 1 (32-candidate tiles).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/cuda/candidate_tiles.cuh"
#include "kernels/cuda/epilogue.cuh"
#include "kernels/cuda/hopper/config.h"
#include "kernels/cuda/hopper/sparse_mla_h16_kernel.cuh"
#include "kernels/cuda/hopper/wgmma.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/launch_utils.h"
#include "kernels/cuda/load_tile.cuh"
#include "kernels/cuda/online_softmax.cuh"
#include "kernels/cuda/phase_clock.cuh"
#include "kernels/cuda/softmax_merge.cuh"

namespace jsmla::cuda::hopper {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) sparse_mla_hopper_kernel(const __grid_constant__ SplitKvParams p) {
#if JSMLA_HOPPER_DEVICE
  using Loader = TileLoaderOf<typename Cfg::Geometry>;
  constexpr int kN = Cfg::kCandidateTile;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // Offset (not integer-cast) arithmetic keeps the pointer in the shared window, so the compiler emits
  // shared-memory instructions rather than generic ones.
  uint8_t* const smem = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
  uint8_t* const q_smem = smem + Cfg::kQOffset;
  float* const score_bias = reinterpret_cast<float*>(smem + Cfg::kBiasOffset);  // [2][kN]
  auto tile_buffer = [&](int b) { return smem + Cfg::kTileOffset + b * Cfg::kTileBytes; };
  // Exact scales: stage b's per-candidate mantissas [group][candidate] (then ratios, unused here).
  auto factors = [&](int b) { return reinterpret_cast<float*>(smem + Cfg::kFactorOffset + b * Cfg::kFactorBytes); };

  // JSMLA_PHASE_CLOCKS (phase_clock.cuh): the marks of thread 0 of the producer (role 0), the scorer
  // (role 1) and warpgroup 2 (role 2), from here; the producer's tiles for staged rows only.
  PhaseClock clock(threadIdx.x == 0 || threadIdx.x == Cfg::kProducerThreads ||
                   threadIdx.x == Cfg::kProducerThreads + Cfg::kScorerThreads);
  // The split merge queued after a decode launch may start its blocks now (it waits for this grid's
  // results before reading them).
  allow_dependent_launch();
  const AttentionParams& a = p.attn;
  // Lane slices (config.h): the blocks of a cluster share its (token, head tile, split), block `slice`
  // serving that lane slice of every row.
  constexpr int kSlices = Cfg::kLaneSlices;
  const int slice = kSlices > 1 ? static_cast<int>(cluster_rank()) : 0;
  const BlockCoordinates coordinates(p, blockIdx.x / kSlices);
  const int64_t token = coordinates.token;
  const int head_begin = coordinates.head_tile * Cfg::kHeadTile;
  const int num_heads = a.num_heads;

  const int64_t valid_count = valid_token_count(a.valid_tokens, a.num_tokens);  // loaded first
  // The staged producer's first two tiles' indices, read beside the valid-token count and the lengths
  // (candidate_tiles.cuh: EarlyIndex).
  EarlyIndex early[2];
  if (!Cfg::kDirectTiles && threadIdx.x < Cfg::kProducerThreads) {
    read_first_indices<kN>(p, coordinates, threadIdx.x / Loader::kThreadsPerRow, early);
  }
  const CandidateTiles<kN> tiles = split_tiles<kN>(p, coordinates);
  // (Behind the first loads, which need the coordinates too, except the count's.)
  clock.mark_after(PhaseClock::kCoordinates,
                   static_cast<uint32_t>(coordinates.token) ^ coordinates.split ^ coordinates.head_tile);
  if (token >= valid_count) {
    if (slice == 0) write_padding_rows<Cfg::kRowDv>(p, token, head_begin, Cfg::kHeadTile, threadIdx.x, Cfg::kThreads);
    return;
  }
  clock.mark_start();  // the valid-token count and the lengths have arrived

  // Lane slices: the score-exchange buffers [tile parity] (the other block stores its partial scores
  // into this block's, counted on this block's transaction barrier of that parity), initialised before
  // either block of the cluster goes on.
  auto exchange_buffer = [&](int x) { return reinterpret_cast<float*>(smem + Cfg::kExchangeOffset + x * Cfg::kExchangeBytes); };
  auto exchange_barrier = [&](int x) { return reinterpret_cast<uint64_t*>(smem + Cfg::kExchangeBarrierOffset) + x; };
  if constexpr (kSlices > 1) {
    if (threadIdx.x == 0) {
      transaction_barrier_init(exchange_barrier(0), 1);
      transaction_barrier_init(exchange_barrier(1), 1);
    }
    cluster_sync();
  }

  if (threadIdx.x < Cfg::kProducerThreads) {
    // ------------------------------------------------------------------ producer warpgroup
    decrease_registers<Cfg::kProducerRegisters>();
    const int load_row = threadIdx.x / Loader::kThreadsPerRow;
    const int load_sub = threadIdx.x % Loader::kThreadsPerRow;
    auto staged_row = [&](int b) { return smem + Cfg::kStageOffset + b * Cfg::kStageBytes + load_row * Cfg::kStagePitch; };
    auto scale_slot = [&](int b) {
      return smem + Cfg::kScaleSlotsOffset + b * Cfg::kScaleSlotsBytes + threadIdx.x * Loader::kScaleSlotBytes;
    };
    auto issue_row = [&](const PendingRow& row, int b) {
      const bool valid = pending_valid<Loader::kF.dual_cache>(a, row);
      if (valid) {
        Loader::template issue<Cfg::kSplitTrailingLanes>(pending_cache<Loader::kF.dual_cache>(a, row), row.index,
                                                          staged_row(b), scale_slot(b), load_sub, slice);
      }
      cp_async_commit();
      return valid;
    };
    if constexpr (Cfg::kDirectTiles) {
      // Starts the copies of this thread's units of its rows (one per round) straight into tile buffer b
      // (zeros for a masked row, whose bytes are never read) and writes the rows' score bias; one commit
      // group.
      constexpr int kRounds = Cfg::kRounds;
      using Rows = PendingRow[kRounds];
      auto read_rows = [&](Rows& rows, int tile_index) {
#pragma unroll
        for (int r = 0; r < kRounds; ++r) {
          rows[r] = read_pending_row<Loader::kF.dual_cache>(a, tiles, token, tile_index, r * Cfg::kRoundRows + load_row);
        }
      };
      auto issue_direct = [&](const Rows& rows, int b) {
        uint8_t* const tile = tile_buffer(b);
#pragma unroll
        for (int r = 0; r < kRounds; ++r) {
          const int row = r * Cfg::kRoundRows + load_row;
          const bool valid = pending_valid<Loader::kF.dual_cache>(a, rows[r]);
          const uint8_t* const source =
              valid ? pending_cache<Loader::kF.dual_cache>(a, rows[r]).data_row(rows[r].index) : nullptr;
#pragma unroll
          for (int u = 0; u < Loader::kUnitsPerThread; ++u) {
            const int unit = load_sub + u * Loader::kThreadsPerRow;
            if (unit >= Loader::kUnits) continue;
            uint8_t* const to = tile + swizzled_offset(row, 8 * unit, kN);
            if (valid) {
              cp_async_16(to, source + 16 * unit);
            } else {
              *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
            }
          }
          if (load_sub == 0) score_bias[b * kN + row] = valid ? 0.0f : -INFINITY;
        }
        cp_async_commit();
      };
      constexpr int kStages = Cfg::kStages;
      Rows pending;
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        read_rows(pending, s);
        issue_direct(pending, s);
      }
      read_rows(pending, kStages);
      for (int i = 0; i < tiles.count; ++i) {
        const int b = i & (kStages - 1);
        // In flight: tiles i .. i + kStages - 2 (one commit group each, empty past the end).
        cp_async_wait_pending<kStages - 2>();
        named_barrier_arrive(Cfg::kFullBarrier + b, Cfg::kProducerThreads + Cfg::kScorerThreads);
        if (i == 0) continue;
        const int refill = i - 1 + kStages;  // into tile i - 1's buffer, once both consumers are done with it
        if (refill < tiles.count) {
          named_barrier_sync(Cfg::kEmptyBarrier + ((i - 1) & (kStages - 1)), Cfg::kThreads);
          issue_direct(pending, (i - 1) & (kStages - 1));
        } else {
          cp_async_commit();  // keeps one group per tile
        }
        read_rows(pending, refill + 1);
      }
    } else {
      if constexpr (kSlices > 1) {
        // The BF16 units this block never gathers (Loader::slice_gathers) stay zero in its staging, so
        // the tile's columns there are zero (and, without the split, so is this block's Q there).
        if (Cfg::kSplitTrailingLanes || slice > 0) {
#pragma unroll
          for (int u = 0; u < Loader::kUnitsPerThread; ++u) {
            const int unit = load_sub + u * Loader::kThreadsPerRow;
            if (unit < Loader::kQuantUnits || unit >= Loader::kUnits ||
                Loader::template slice_gathers<Cfg::kSplitTrailingLanes>(unit, slice)) {
              continue;
            }
            for (int b = 0; b < 2; ++b) *reinterpret_cast<uint4*>(staged_row(b) + 16 * unit) = make_uint4(0, 0, 0, 0);
          }
        }
      }
      // Bit b: the row staged in buffer b is valid (a bit mask, not an array: stays in a register).
      clock.mark_after(PhaseClock::kFirstIndex, static_cast<uint32_t>(early[0].index));
      uint32_t staged_valid =
          issue_row(pending_row_from<Loader::kF.dual_cache>(a, tiles, token, 0, load_row, early[0]), 0) ? 1u : 0u;
      staged_valid |= issue_row(pending_row_from<Loader::kF.dual_cache>(a, tiles, token, 1, load_row, early[1]), 1) ? 2u : 0u;
      clock.mark(0);  // tiles 0 and 1: indices read, copies issued
      PendingRow pending = read_pending_row<Loader::kF.dual_cache>(a, tiles, token, 2, load_row);
      for (int i = 0; i < tiles.count; ++i) {
        const int b = i & 1;
        cp_async_wait_pending<1>();
        clock.mark(1 + 2 * i);  // tile i landed
        if (i >= 2) named_barrier_sync(Cfg::kEmptyBarrier + b, Cfg::kThreads);
        uint8_t* const tile = tile_buffer(b);
        const bool valid = (staged_valid >> b) & 1u;
        Loader::template convert_batched<Cfg::kConvertBatch>(valid, staged_row(b), scale_slot(b) + slice * Loader::kSliceScaleBytes, load_sub, [&](int dim, uint4 values) {
          *reinterpret_cast<uint4*>(tile + swizzled_offset(load_row, dim, kN)) = values;
        });
        if (load_sub == 0) {
          score_bias[b * kN + load_row] = valid ? 0.0f : -INFINITY;
          if constexpr (Cfg::kExactScales) Loader::write_factors(valid, scale_slot(b), factors(b), load_row);
        }
        named_barrier_arrive(Cfg::kFullBarrier + b, Cfg::kProducerThreads + Cfg::kScorerThreads);
        clock.mark(2 + 2 * i);  // tile i converted
        staged_valid = (staged_valid & ~(1u << b)) | (issue_row(pending, b) ? 1u << b : 0u);
        pending = read_pending_row<Loader::kF.dual_cache>(a, tiles, token, i + 3, load_row);
      }
    }
    cp_async_wait_pending<0>();
    clock.store(p, 0);
    return;
  }

  // -------------------------------------------------------------------- consumer warpgroups
  increase_registers<Cfg::kConsumerRegisters>();
  const int consumer_thread = threadIdx.x - Cfg::kProducerThreads;  // 0 .. 255
  const int warp = (consumer_thread % 128) / 32;                    // 16 head rows each
  const int lane = threadIdx.x % 32;

  // Q of the 64-head tile → shared memory (rows past H are zero). Every 16-byte chunk's cp.async is
  // in flight at once, so the load costs one round trip (the handler checks that q is 16-byte aligned).
  {
    constexpr int kConsumerThreads = 128 * Cfg::kConsumerGroups;
    copy_q_rows<Cfg::kHeadTile, Cfg::kDqk, kConsumerThreads, kSlices, Cfg::kRowDqk, Cfg::kSplitTrailingLanes>(
        q_smem, a.q, token, num_heads, head_begin, consumer_thread, slice);
    fence_proxy_async_shared();
    named_barrier_sync(Cfg::kQBarrier, kConsumerThreads);
  }
  clock.mark(0);  // Q in shared memory

  // The rest runs with the consumer's half of d_v as a compile-time constant: every shared-memory
  // descriptor is then a warp-uniform base plus constants, computed in uniform registers.
  float* const row_rescale = reinterpret_cast<float*>(smem + Cfg::kRescaleOffset);  // [kPBuffers][kHeadTile]
  float* const final_state = reinterpret_cast<float*>(smem + Cfg::kFinalOffset);    // [max, sum][kHeadTile]
  auto p_buffer = [&](int b, int v) { return smem + Cfg::kPOffset + (b * Cfg::kPVariants + v) * Cfg::kPBytes; };
  // P rows are one swizzle row each: 128 bytes (64 candidates, chunk c of row r at c ^ (r % 8)) or 64
  // bytes (32 candidates, chunk c of row r at c ^ ((r / 2) % 4)).
  constexpr Swizzle kPSwizzle = Cfg::kPRowBytes == 128 ? Swizzle::k128B : Swizzle::k64B;
  auto p_chunk = [](int row, int chunk) { return Cfg::kPRowBytes == 128 ? chunk ^ (row % 8) : chunk ^ ((row / 2) % 4); };
  // The A fragment of P for k16 step kk (m16n8k16 layout): exact scales multiply P by the mantissas of
  // scale group `scale_group` of the tile's candidates (stage b), in FP32 before the rounding to BF16.
  auto pack_p = [&](uint32_t (&fragment)[4], const float (&p)[kN / 8][4], int kk, int scale_group, int b) {
    float2 m_lo = make_float2(1.0f, 1.0f);
    float2 m_hi = m_lo;
    if constexpr (Cfg::kExactScales) {
      const float* mantissa = factors(b) + scale_group * kN + 16 * kk + 2 * (lane % 4);
      m_lo = *reinterpret_cast<const float2*>(mantissa);
      m_hi = *reinterpret_cast<const float2*>(mantissa + 8);
    }
    fragment[0] = pack_bf16x2(p[2 * kk][0] * m_lo.x, p[2 * kk][1] * m_lo.y);
    fragment[1] = pack_bf16x2(p[2 * kk][2] * m_lo.x, p[2 * kk][3] * m_lo.y);
    fragment[2] = pack_bf16x2(p[2 * kk + 1][0] * m_hi.x, p[2 * kk + 1][1] * m_hi.y);
    fragment[3] = pack_bf16x2(p[2 * kk + 1][2] * m_hi.x, p[2 * kk + 1][3] * m_hi.y);
  };
  const int rows[2] = {16 * warp + lane / 4, 16 * warp + lane / 4 + 8};  // this thread's head rows
  auto consume = [&](auto group_constant) {
    constexpr int group = decltype(group_constant)::value;  // 0: the scorer
    RunningSoftmax softmax;                                 // the scorer's; warpgroup 2 gets the result
    float out_acc[Cfg::kOutRegisters];
#pragma unroll
    for (int i = 0; i < Cfg::kOutRegisters; ++i) out_acc[i] = 0.0f;
    constexpr int kV = Cfg::kPVariants;
    constexpr int kVariantBlocks = Cfg::kDvPerGroup / kV / 64;  // 64-column tile blocks per P variant
    constexpr int kVariantRegisters = Cfg::kOutRegisters / kV;  // accumulators per P variant
    // The accumulators of variant v: columns [v, v + 1) · 256 / kV of this consumer's half.
    auto variant_acc = [&](int v) -> float (&)[kVariantRegisters] {
      return *reinterpret_cast<float(*)[kVariantRegisters]>(out_acc + v * kVariantRegisters);
    };
    auto pv_rs = [&](int v, const uint32_t (&p)[4], SmemDescriptor vd) {
      if constexpr (kV == 1) {
        wgmma_m64n256k16_rs(out_acc, p, vd);
      } else {
        static_assert(kV == 2, "P·V runs as one m64n256 or two m64n128 wgmmas per k16 step");
        wgmma_m64n128k16_rs(variant_acc(v), p, vd);
      }
    };
    auto pv_ss = [&](int v, SmemDescriptor pd, SmemDescriptor vd) {
      if constexpr (kV == 1) {
        wgmma_m64n256k16_ss(out_acc, pd, vd);
      } else {
        wgmma_m64n128k16_ss(variant_acc(v), pd, vd);
      }
    };

    // Tile j's buffer goes back to the producer (when it will be refilled) once this consumer's wgmmas
    // that read it are done.
    auto release = [&](int j) {
      if (j + Cfg::kStages < tiles.count) {
        named_barrier_arrive(Cfg::kEmptyBarrier + (j & (Cfg::kStages - 1)), Cfg::kThreads);
      }
    };
    // The scorer's A fragments of P: its P·V of tile i is left in flight into tile i + 1 (see below),
    // so they live across iterations.
    uint32_t p_fragment[kV][kN / 16][4];
    uint32_t (&p_registers)[kV * kN / 16 * 4] = reinterpret_cast<uint32_t (&)[kV * kN / 16 * 4]>(p_fragment);

    // The tiles (none for an empty split). The scorer's last P·V is waited for after the loop but
    // inside this branch: were the zero-tile path to join before that wait, ptxas would count its
    // zeroed accumulators as defined inside the P·V's pipeline stage and serialise every wgmma of the
    // kernel (C7515).
    if (tiles.count > 0) {
      for (int i = 0; i < tiles.count; ++i) {
        const int b = i & (Cfg::kStages - 1);  // tile buffer, full/empty barriers, score bias
        const int pb = i & (Cfg::kPBuffers - 1);  // P buffer, p_ready barrier, rescale factors
        const uint8_t* const tile = tile_buffer(b);
        const SmemDescriptor v_descriptor = smem_descriptor(
            tile + group * (Cfg::kDvPerGroup / 64) * Cfg::kTileBlockBytes, Cfg::kTileBlockBytes, 1024);
        if constexpr (group == 0) {
          named_barrier_sync(Cfg::kFullBarrier + b, Cfg::kProducerThreads + Cfg::kScorerThreads);
          fence_proxy_async_shared();  // the producers' stores to the tile (wgmma.cuh)
          clock.mark(i < 4 ? 1 + 3 * i : -1);  // tile i in its buffer (the first four tiles)
          // S = Q·Kᵀ, kDqk / 16 k-steps.
          float score[kN / 8][4];  // the m64nkN accumulators: score[j][r] as in online_softmax.cuh
          float (&score_registers)[kN / 2] = reinterpret_cast<float (&)[kN / 2]>(score);
          const SmemDescriptor q_descriptor = smem_descriptor(q_smem, 16, 1024);
          const SmemDescriptor k_descriptor = smem_descriptor(tile, 16, 1024);
          // k-step ks into `acc` (overwriting it unless `accumulate`): columns [16 ks, 16 ks + 16) of Q and
          // of the tile.
          auto score_step = [&](float (&acc)[kN / 2], int ks, int accumulate) {  // ks a constant once unrolled
            const uint32_t q_offset = (ks / 4) * Cfg::kQBlockBytes + (ks % 4) * 32;
            const uint32_t k_offset = (ks / 4) * Cfg::kTileBlockBytes + (ks % 4) * 32;
            wgmma_score_ss(acc, q_descriptor.offset(q_offset), k_descriptor.offset(k_offset), accumulate);
          };
          // Once the previous tile's P·V (left in flight) is done and no other wgmma is: its accumulators
          // and A fragments are free again.
          auto previous_pv_registers = [&] {
            fence_registers(out_acc);
            fence_registers(p_registers);
          };
          if constexpr (Cfg::kExactScales) {
            // Each scale group's partial scores times its candidates' mantissas m_g, added in group
            // order, then the unscaled BF16 lanes after the groups: stages that take turns in two
            // partial sums, two in flight (the scores themselves are never a wgmma accumulator: three
            // accumulators beside O do not fit the registers, and ptxas would serialise the wgmmas).
            constexpr int kGroups = Loader::kNumGroups;
            constexpr int kRestSteps = Cfg::kKSteps - kGroups * Cfg::kGroupKSteps;
            constexpr int kScoreStages = kGroups + (kRestSteps > 0 ? 1 : 0);
            static_assert(kScoreStages >= 2, "two partial sums take turns");
            float partial[2][kN / 2];
            auto issue_stage = [&](auto stage_constant) {
              constexpr int stage = decltype(stage_constant)::value;
              constexpr int first = stage * Cfg::kGroupKSteps;
              constexpr int last = stage < kGroups ? first + Cfg::kGroupKSteps : Cfg::kKSteps;
              wgmma_fence();
              static_for<last - first>([&](auto step) {
                score_step(partial[stage % 2], first + decltype(step)::value, decltype(step)::value > 0 ? 1 : 0);
              });
              wgmma_commit();
            };
            issue_stage(std::integral_constant<int, 0>{});
            issue_stage(std::integral_constant<int, 1>{});
            const int column = 2 * (lane % 4);
            static_for<kScoreStages>([&](auto stage_constant) {
              constexpr int stage = decltype(stage_constant)::value;
              if constexpr (stage + 1 < kScoreStages) {
                wgmma_wait<1>();
              } else {
                wgmma_wait_all();
              }
              float (&acc)[kN / 2] = partial[stage % 2];
              fence_registers(acc);
              if constexpr (stage < kGroups) {
                const float* const mantissa = factors(b) + stage * kN + column;
#pragma unroll
                for (int j = 0; j < kN / 8; ++j) {
                  const float2 m = *reinterpret_cast<const float2*>(mantissa + 8 * j);
                  const float f[4] = {m.x, m.y, m.x, m.y};
#pragma unroll
                  for (int r = 0; r < 4; ++r) {
                    score[j][r] = stage == 0 ? acc[4 * j + r] * f[r] : fmaf(acc[4 * j + r], f[r], score[j][r]);
                  }
                }
              } else {
#pragma unroll
                for (int r = 0; r < kN / 2; ++r) score_registers[r] += acc[r];
              }
              if constexpr (stage + 2 < kScoreStages) issue_stage(std::integral_constant<int, stage + 2>{});
            });
          } else {
            // S of this tile queues behind the previous tile's P·V on the tensor cores: its issue does
            // not wait for that P·V, and the previous buffer goes back as soon as the P·V is done.
            wgmma_fence();
            if constexpr (Cfg::kSplitTrailingLanes) {
              // The slice's quantized lanes, then its share of the trailing lanes (a run-time offset).
#pragma unroll
              for (int ks = 0; ks < Cfg::kQuantKSteps; ++ks) score_step(score_registers, ks, ks > 0 ? 1 : 0);
              const int first_trailing = Cfg::kQuantKSteps + slice * Cfg::kTrailingKSteps;
#pragma unroll
              for (int ks = 0; ks < Cfg::kTrailingKSteps; ++ks) score_step(score_registers, first_trailing + ks, 1);
            } else {
#pragma unroll
              for (int ks = 0; ks < Cfg::kKSteps; ++ks) score_step(score_registers, ks, ks > 0 ? 1 : 0);
            }
            wgmma_commit();
            if (Cfg::kScorerPVInFlight && i > 0) {
              wgmma_wait<1>();
              release(i - 1);
            }
            wgmma_wait_all();
            fence_registers(score_registers);
            if constexpr (Cfg::kScorerPVInFlight) previous_pv_registers();
            if constexpr (kSlices > 1) {
              // The other block's partial scores of this tile (its lanes) arrive in exchange buffer
              // i % 2 as this block's go into its: S = S_0 + S_1 in both blocks (an addition of two
              // terms gives the same bits in either order). A buffer is written again two tiles later,
              // after the other block has received this block's scores of the tile between, which it
              // sends only once it has read the buffer.
              constexpr int kRuns = kN / 8;  // float4 runs of a thread's scores
              const int x = i & 1;
              float* const theirs = exchange_buffer(x);
              uint64_t* const arrived = exchange_barrier(x);
              if (consumer_thread == 0) transaction_barrier_arrive_expect(arrived, Cfg::kExchangeBytes);
              const uint32_t other = static_cast<uint32_t>(slice ^ 1);
              const uint32_t remote = cluster_address(theirs, other);
              const uint32_t remote_barrier = cluster_address(arrived, other);
#pragma unroll
              for (int run = 0; run < kRuns; ++run) {
                store_remote_async(remote + (run * Cfg::kScorerThreads + consumer_thread) * 16,
                                   make_float4(score_registers[4 * run], score_registers[4 * run + 1],
                                               score_registers[4 * run + 2], score_registers[4 * run + 3]),
                                   remote_barrier);
              }
              transaction_barrier_wait(arrived, (i >> 1) & 1);
#pragma unroll
              for (int run = 0; run < kRuns; ++run) {
                const float4 other_scores =
                    *reinterpret_cast<const float4*>(theirs + 4 * (run * Cfg::kScorerThreads + consumer_thread));
                score_registers[4 * run] += other_scores.x;
                score_registers[4 * run + 1] += other_scores.y;
                score_registers[4 * run + 2] += other_scores.z;
                score_registers[4 * run + 3] += other_scores.w;
              }
            }
          }

          clock.mark(i < 4 ? 2 + 3 * i : -1);  // S of tile i
          // Online softmax in the log2 domain; masked candidates get -inf through score_bias.
          float rescale[2];
          softmax.update(score, score_bias + b * kN, a.sm_scale * kLog2e, lane, rescale);
          if (RunningSoftmax::needs_rescale(rescale)) rescale_rows(out_acc, rescale);
          // One P buffer: warpgroup 2 hands it back (with the rescale row) once its P·V of the previous
          // tile has read it.
          if constexpr (Cfg::kPBuffers == 1) {
            if (i > 0) named_barrier_sync(Cfg::kPFreeBarrier, 2 * Cfg::kScorerThreads);
          }
          if (lane % 4 == 0) {
            row_rescale[pb * Cfg::kHeadTile + rows[0]] = rescale[0];
            row_rescale[pb * Cfg::kHeadTile + rows[1]] = rescale[1];
          }
          // P (BF16): this consumer's variants as A fragments, warpgroup 2's into P buffer pb — one
          // swizzled row per head, the 8-column chunk j of row r at p_chunk(r, j). Exact scales: variant
          // v of consumer c is P times the candidates' mantissas of scale group c·kPVariants + v, in FP32
          // before the one rounding to BF16; otherwise there is one P.
#pragma unroll
          for (int v = 0; v < kV; ++v) {
#pragma unroll
            for (int kk = 0; kk < kN / 16; ++kk) {
              pack_p(p_fragment[v][kk], score, kk, v, b);
              uint32_t theirs[4];
              pack_p(theirs, score, kk, kV + v, b);
              uint8_t* const p_rows = p_buffer(pb, v);
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                const int chunk = 2 * kk + half;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                  const int row = rows[r];
                  *reinterpret_cast<uint32_t*>(p_rows + row * Cfg::kPRowBytes + p_chunk(row, chunk) * 16 +
                                               (lane % 4) * 4) = theirs[2 * half + r];
                }
              }
            }
          }
          fence_proxy_async_shared();
          if constexpr (Cfg::kPBuffers == 1) {
            named_barrier_arrive(Cfg::kPReadyBarrier, 2 * Cfg::kScorerThreads);
          } else {
            // A sync, not an arrive: warpgroup 2 is already waiting (its P·V of the previous tile is short
            // beside this S), and the handoff of row_rescale is then a plain two-sided barrier.
            named_barrier_sync(Cfg::kPReadyBarrier + pb, 2 * Cfg::kScorerThreads);
          }
          clock.mark(i < 4 ? 3 + 3 * i : -1);  // P of tile i handed to warpgroup 2
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kN / 16; ++kk) {
#pragma unroll
            for (int v = 0; v < kV; ++v) pv_rs(v, p_fragment[v][kk], v_descriptor.offset(kk * 16 * 128 + v * kVariantBlocks * Cfg::kTileBlockBytes));
          }
          wgmma_commit();
          if constexpr (!Cfg::kScorerPVInFlight) {
            wgmma_wait_all();
            previous_pv_registers();
            release(i);
          }  // otherwise left in flight: waited for in the next tile, after its S is issued
        } else {
          named_barrier_sync(Cfg::kPReadyBarrier + pb, 2 * Cfg::kScorerThreads);
          clock.mark(i < 6 ? 1 + 2 * i : -1);  // P of tile i ready (the first six tiles)
          float rescale[2] = {row_rescale[pb * Cfg::kHeadTile + rows[0]], row_rescale[pb * Cfg::kHeadTile + rows[1]]};
          if (RunningSoftmax::needs_rescale(rescale)) rescale_rows(out_acc, rescale);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kN / 16; ++kk) {
#pragma unroll
            for (int v = 0; v < kV; ++v) {
              const SmemDescriptor p_descriptor = smem_descriptor(p_buffer(pb, v), 16, 8 * Cfg::kPRowBytes, kPSwizzle);
              pv_ss(v, p_descriptor.offset(kk * 32),
                    v_descriptor.offset(kk * 16 * 128 + v * kVariantBlocks * Cfg::kTileBlockBytes));
            }
          }
          wgmma_commit();
          wgmma_wait_all();
          fence_registers(out_acc);
          clock.mark(i < 6 ? 2 + 2 * i : -1);  // P·V of tile i done
          release(i);
          if constexpr (Cfg::kPBuffers == 1) {
            if (i + 1 < tiles.count) named_barrier_arrive(Cfg::kPFreeBarrier, 2 * Cfg::kScorerThreads);
          }
        }
      }
      if constexpr (group == 0) {
        wgmma_wait_all();
        fence_registers(out_acc);
        fence_registers(p_registers);
      }
    }
    clock.mark(13);  // the last P·V

    // ---- epilogue: rows of this thread, columns of this consumer's half ----
    if constexpr (group == 0) {
      softmax.finish();
      if (lane % 4 == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          final_state[rows[r]] = softmax.row_max[r];
          final_state[Cfg::kHeadTile + rows[r]] = softmax.row_sum[r];
        }
      }
      named_barrier_arrive(Cfg::kFinalBarrier, 2 * Cfg::kScorerThreads);
    } else {
      named_barrier_sync(Cfg::kFinalBarrier, 2 * Cfg::kScorerThreads);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        softmax.row_max[r] = final_state[rows[r]];
        softmax.row_sum[r] = final_state[Cfg::kHeadTile + rows[r]];
      }
    }
    clock.mark(14);  // the rows' final max and sum known
    store_rows<Cfg::kRowDv>(p, token, coordinates.split, {head_begin + rows[0], head_begin + rows[1]},
                            slice * Cfg::kDv + group * Cfg::kDvPerGroup + 2 * (lane % 4),
                            slice == 0 && group == 0 && lane % 4 == 0, softmax, out_acc);
    clock.mark(15);  // every store issued
    clock.store(p, 1 + group);
  };
  if (consumer_thread < Cfg::kScorerThreads) {
    consume(std::integral_constant<int, 0>{});
  } else {
    consume(std::integral_constant<int, 1>{});
  }
#else
  __trap();  // no sm_90a code in this build: the host never launches it (hopper::compiled())
#endif  // JSMLA_HOPPER_DEVICE
}

// Launches one instantiation on `stream` (the caller has checked the plan, the buffers and that the
// current device is an sm_90 GPU and the library carries sm_90a code).
template <class Cfg>
cudaError_t launch_sparse_mla_hopper(const SplitKvParams& p, cudaStream_t stream) {
  static DeviceOnce shared_memory_raised;
  if constexpr (Cfg::kTransposed) {  // the 16-head tile (sparse_mla_h16_kernel.cuh)
    return launch_split_kv_grid(&sparse_mla_hopper_h16_kernel<Cfg>, Cfg::kThreads, Cfg::kSharedBytes,
                                shared_memory_raised, p, stream);
  } else {  // lane slices: clusters of kLaneSlices blocks, one per slice (config.h)
    return launch_split_kv_grid(&sparse_mla_hopper_kernel<Cfg>, Cfg::kThreads, Cfg::kSharedBytes, shared_memory_raised,
                                p, stream, Cfg::kLaneSlices);
  }
}

}  // namespace jsmla::cuda::hopper
