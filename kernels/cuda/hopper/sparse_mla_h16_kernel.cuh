// The Hopper family's 16-head kernel (config_h16.h: the warpgroup roles and the shared-memory layout).
// Like the 64-head kernel it serves both plan variants: decode splits write their partial state to
// the split workspace (merged by combine.cuh), prefill writes out/lse with the sink folded in.
//
// Producer warpgroup g (rows [32 g, 32 g + 32) of every 64-candidate tile), per tile i (b = i % 2):
//   wait for its own cp.async of tile i; copy its staged units into registers; issue the gather of
//   tile i + 1 into the same staging rows (and scale slot set b ^ 1); read the indices of tile i + 2;
//   wait empty[b] (the consumer is done with tile i - 2); convert into tile buffer b;
//   arrive full[b].
// Consumer, per tile: wait full[b]; fence.proxy.async (wgmma.cuh); issue Sᵀ = K·Qᵀ (kDqk/16 wgmmas)
//   behind the previous tile's Oᵀ; wait for that Oᵀ and arrive empty for the previous buffer; wait for
//   Sᵀ; the softmax per head (the four warps' tile maxima meet in shared memory); Pᵀ into P buffer b;
//   Oᵀ += Vᵀ·Pᵀ (4 k16 steps × 8 m64 blocks), left in flight. The conversion of tile i + 1 and the
//   gather of tile i + 2 overlap the consumer's work on tile i.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/candidate_tiles.cuh"
#include "kernels/cuda/hopper/config.h"
#include "kernels/cuda/hopper/wgmma.cuh"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/load_tile.cuh"
#include "kernels/cuda/online_softmax.cuh"
#include "kernels/cuda/phase_clock.cuh"
#include "kernels/cuda/softmax_merge.cuh"

namespace jsmla::cuda::hopper {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    sparse_mla_hopper_h16_kernel(const __grid_constant__ SplitKvParams p) {
#if JSMLA_HOPPER_DEVICE
  using Loader = TileLoaderOf<typename Cfg::Geometry>;
  constexpr int kN = Cfg::kCandidateTile;  // candidates of a tile: wgmma M of Sᵀ
  constexpr int kH = Cfg::kHeadTile;       // heads: wgmma N
  static_assert(kH == 16, "a thread's accumulator columns are four heads of an m64n16 tile (column() below)");
  static_assert(Cfg::kConsumerThreads == 128 && Cfg::kExchangeBytes == 4 * kH * 4,
                "one consumer warpgroup: four warps of 16 accumulator rows, the exchange one row per warp");
  static_assert(kN * 2 == Cfg::kAtomBytes && Cfg::kPBytes == kH * Cfg::kAtomBytes,
                "a head's P row is one 128-byte swizzle row of the tile's 64 candidates");
  static_assert(Cfg::kOutRegisters == 8 * Cfg::kDvBlocks, "Oᵀ is one m64n16 accumulator block per 64 d_v lanes");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* const smem = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
  uint8_t* const q_smem = smem + Cfg::kQOffset;
  float* const score_bias = reinterpret_cast<float*>(smem + Cfg::kBiasOffset);  // [kStages][kN]
  auto tile_buffer = [&](int b) { return smem + Cfg::kTileOffset + b * Cfg::kTileBytes; };

  // JSMLA_PHASE_CLOCKS (phase_clock.cuh): the marks of producer thread 0 (role 0) and consumer thread 0
  // (role 1), from here.
  PhaseClock clock(threadIdx.x == 0 || threadIdx.x == Cfg::kProducerThreads);
  // The split merge queued after a decode launch may start its blocks now.
  allow_dependent_launch();
  const AttentionParams& a = p.attn;
  const BlockCoordinates coordinates(p);
  const int64_t token = coordinates.token;
  const int head_begin = coordinates.head_tile * kH;
  const int num_heads = a.num_heads;

  const int64_t valid_count = valid_token_count(a.valid_tokens, a.num_tokens);  // loaded first
  // The producer's first two tiles' indices, read beside the valid-token count and the lengths
  // (candidate_tiles.cuh: EarlyIndex).
  EarlyIndex early[2];
  if (threadIdx.x < Cfg::kProducerThreads) {
    read_first_indices<kN>(p, coordinates,
                           threadIdx.x / 128 * Cfg::kRoundRows + (threadIdx.x % 128) / Loader::kThreadsPerRow, early);
  }
  const CandidateTiles<kN> tiles = split_tiles<kN>(p, coordinates);
  // (Behind the first loads, which need the coordinates too, except the count's.)
  clock.mark_after(PhaseClock::kCoordinates,
                   static_cast<uint32_t>(coordinates.token) ^ coordinates.split ^ coordinates.head_tile);
  if (token >= valid_count) {
    write_padding_rows<Cfg::kDv>(p, token, head_begin, kH, threadIdx.x, Cfg::kThreads);
    return;
  }
  clock.mark_start();  // the valid-token count and the lengths have arrived

  if (threadIdx.x < Cfg::kProducerThreads) {
    // ------------------------------------------------------------------ producer warpgroups
    const int group = threadIdx.x / 128;
    const int load_row = (threadIdx.x % 128) / Loader::kThreadsPerRow;  // row of the warpgroup's round
    const int load_sub = threadIdx.x % Loader::kThreadsPerRow;
    const int tile_row = group * Cfg::kRoundRows + load_row;
    uint8_t* const staged_row = smem + Cfg::kStageOffset + group * Cfg::kStageBytes + load_row * Cfg::kStagePitch;
    auto scale_slot = [&](int b) {
      return smem + Cfg::kScaleSlotsOffset + b * Cfg::kScaleSlotsBytes + threadIdx.x * Loader::kScaleSlotBytes;
    };
    auto read_row = [&](int tile_index) {
      return read_pending_row<Loader::kF.dual_cache>(a, tiles, token, tile_index, tile_row);
    };
    // Starts the copies of a row into the staging row and scale slot set b; one commit group.
    auto issue_row = [&](const PendingRow& row, int b) {
      const bool valid = pending_valid<Loader::kF.dual_cache>(a, row);
      if (valid) Loader::issue(pending_cache<Loader::kF.dual_cache>(a, row), row.index, staged_row, scale_slot(b), load_sub);
      cp_async_commit();
      return valid;
    };
    clock.mark_after(PhaseClock::kFirstIndex, static_cast<uint32_t>(early[0].index));
    bool valid = issue_row(pending_row_from<Loader::kF.dual_cache>(a, tiles, token, 0, tile_row, early[0]), 0);
    clock.mark(0);  // tile 0's indices read, its copies issued
    PendingRow pending = pending_row_from<Loader::kF.dual_cache>(a, tiles, token, 1, tile_row, early[1]);
    for (int i = 0; i < tiles.count; ++i) {
      const int b = i & (Cfg::kStages - 1);
      cp_async_wait_all();  // this thread's copies of tile i have landed (only this thread reads them)
      clock.mark(1 + 2 * i);
      uint4 units[Loader::kUnitsPerThread];
      Loader::load_staged(staged_row, load_sub, units);
      // The staging row is refilled with tile i + 1 behind these loads (the copies' writes land a
      // global round trip after loads the shared-memory pipe serves in order); tile i's scales stay
      // in slot set b for the conversion.
      const bool next_valid = issue_row(pending, b ^ 1);
      pending = read_row(i + 2);
      if (i >= Cfg::kStages) named_barrier_sync(Cfg::kEmptyBarrier + b, Cfg::kThreads);
      uint8_t* const tile = tile_buffer(b);
      Loader::convert_loaded(valid, units, scale_slot(b), load_sub, [&](int dim, uint4 values) {
        *reinterpret_cast<uint4*>(tile + swizzled_offset(tile_row, dim, kN)) = values;
      });
      if (load_sub == 0) score_bias[b * kN + tile_row] = valid ? 0.0f : -INFINITY;
      named_barrier_arrive(Cfg::kFullBarrier + b, Cfg::kThreads);
      clock.mark(2 + 2 * i);  // tile i converted
      valid = next_valid;
    }
    cp_async_wait_all();
    clock.store(p, 0);
    return;
  }

  // --------------------------------------------------------------------- consumer warpgroup
  const int consumer_thread = threadIdx.x - Cfg::kProducerThreads;  // 0 .. 127
  const int warp = consumer_thread / 32;  // candidate rows [16 warp, 16 warp + 16) of a tile, d_v rows likewise
  const int lane = threadIdx.x % 32;
  const int quad = lane % 4;

  // Q of the 16 heads → shared memory (rows past H are zero), every chunk's cp.async in flight at once.
  {
    copy_q_rows<kH, Cfg::kDqk, Cfg::kConsumerThreads>(q_smem, a.q, token, num_heads, head_begin, consumer_thread);
    fence_proxy_async_shared();
    named_barrier_sync(Cfg::kConsumerBarrier, Cfg::kConsumerThreads);
  }
  clock.mark(0);  // Q in shared memory

  // The accumulators of m64n16 (the m16n8 layout of epilogue.cuh per warp): acc[4j + e + 2r] is row
  // 16 warp + lane/4 + 8r, column 8j + 2 quad + e. Columns are heads: this thread's four heads are
  // column(k) for k = 2j + e; rows are a tile's candidates (Sᵀ) or d_v lanes of an m64 block (Oᵀ).
  auto column = [&](int k) { return 8 * (k / 2) + 2 * quad + (k % 2); };
  float* const exchange = reinterpret_cast<float*>(smem + Cfg::kExchangeOffset);  // [warp][head]
  float row_max[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};  // per head, log2 domain
  float row_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};                      // this thread's candidates only
  float out_acc[Cfg::kOutRegisters];                                // Oᵀ: block mb at [8 mb, 8 mb + 8)
#pragma unroll
  for (int i = 0; i < Cfg::kOutRegisters; ++i) out_acc[i] = 0.0f;
  auto out_block = [&](int mb) -> float (&)[8] { return *reinterpret_cast<float(*)[8]>(out_acc + 8 * mb); };
  // Tile j's buffer goes back to the producers (when it will be refilled) once Oᵀ has read it.
  auto release = [&](int j) {
    if (j + Cfg::kStages < tiles.count) named_barrier_arrive(Cfg::kEmptyBarrier + (j & (Cfg::kStages - 1)), Cfg::kThreads);
  };
  const SmemDescriptor q_descriptor = smem_descriptor(q_smem, 16, 1024);

  // As in the 64-head kernel, the last Oᵀ is waited for inside this branch (ptxas C7515).
  if (tiles.count > 0) {
    for (int i = 0; i < tiles.count; ++i) {
      const int b = i & (Cfg::kStages - 1);
      const uint8_t* const tile = tile_buffer(b);
      named_barrier_sync(Cfg::kFullBarrier + b, Cfg::kThreads);
      fence_proxy_async_shared();  // the producers' stores to the tile (wgmma.cuh)
      clock.mark(i < 4 ? 1 + 3 * i : -1);  // tile i in its buffer (the first four tiles)
      // Sᵀ = K·Qᵀ: k-step ks reads columns [16 ks, 16 ks + 16) of the tile and of Q.
      float score[8];
      const SmemDescriptor k_descriptor = smem_descriptor(tile, 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < Cfg::kKSteps; ++ks) {
        const uint32_t k_offset = (ks / 4) * Cfg::kTileBlockBytes + (ks % 4) * 32;
        const uint32_t q_offset = (ks / 4) * Cfg::kQBlockBytes + (ks % 4) * 32;
        wgmma_m64n16k16_ss<0>(score, k_descriptor.offset(k_offset), q_descriptor.offset(q_offset), ks > 0 ? 1 : 0);
      }
      wgmma_commit();
      if (i > 0) {
        wgmma_wait<1>();  // the previous tile's Oᵀ is done: its buffer goes back
        release(i - 1);
      }
      wgmma_wait_all();
      fence_registers(score);
      fence_registers(out_acc);
      clock.mark(i < 4 ? 2 + 3 * i : -1);  // Sᵀ of tile i

      // Online softmax per head column in the log2 domain (RunningSoftmax's rules: the max moves only
      // past kMaxLag; masked candidates get -inf through score_bias; a head that has seen only masked
      // candidates keeps max -inf and zeros).
      const float score_scale = a.sm_scale * kLog2e;
      const float bias[2] = {score_bias[b * kN + 16 * warp + lane / 4], score_bias[b * kN + 16 * warp + lane / 4 + 8]};
      float tile_max[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int at = 4 * (k / 2) + (k % 2);
        score[at] = score[at] * score_scale + bias[0];
        score[at + 2] = score[at + 2] * score_scale + bias[1];
        tile_max[k] = fmaxf(score[at], score[at + 2]);
#pragma unroll
        for (int offset = 4; offset < 32; offset *= 2) {
          tile_max[k] = fmaxf(tile_max[k], __shfl_xor_sync(0xffffffffu, tile_max[k], offset));
        }
      }
      if (lane < 4) {
#pragma unroll
        for (int k = 0; k < 4; ++k) exchange[warp * kH + column(k)] = tile_max[k];
      }
      named_barrier_sync(Cfg::kConsumerBarrier, Cfg::kConsumerThreads);
      float rescale[4];
      bool moved = false;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int h = column(k);
        const float block_max = fmaxf(fmaxf(exchange[h], exchange[kH + h]), fmaxf(exchange[2 * kH + h], exchange[3 * kH + h]));
        const float new_max = block_max > row_max[k] + RunningSoftmax::kMaxLag ? block_max : row_max[k];
        const float subtract = new_max == -INFINITY ? 0.0f : new_max;
        rescale[k] = fast_exp2(row_max[k] - subtract);
        moved |= rescale[k] != 1.0f;
        row_max[k] = new_max;
        const int at = 4 * (k / 2) + (k % 2);
        score[at] = fast_exp2(score[at] - subtract);
        score[at + 2] = fast_exp2(score[at + 2] - subtract);
        row_sum[k] = row_sum[k] * rescale[k] + (score[at] + score[at + 2]);
      }
      if (moved) {
#pragma unroll
        for (int i2 = 0; i2 < Cfg::kOutRegisters; ++i2) out_acc[i2] *= rescale[2 * ((i2 % 8) / 4) + (i2 % 2)];
      }
      // Pᵀ (BF16) into P buffer b: row h holds head h's 64 candidates, the 8-candidate chunk c at c ^ (h % 8).
      uint8_t* const p_rows = smem + Cfg::kPOffset + b * Cfg::kPBytes;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int h = column(k);
        const int at = 4 * (k / 2) + (k % 2);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int c = 16 * warp + lane / 4 + 8 * r;
          *reinterpret_cast<uint16_t*>(p_rows + h * 128 + (((c / 8) ^ (h % 8)) * 16) + (c % 8) * 2) =
              static_cast<uint16_t>(pack_bf16x2(score[at + 2 * r], 0.0f) & 0xffffu);
        }
      }
      fence_proxy_async_shared();
      named_barrier_sync(Cfg::kConsumerBarrier, Cfg::kConsumerThreads);
      clock.mark(i < 4 ? 3 + 3 * i : -1);  // Pᵀ of tile i written
      // Oᵀ += Vᵀ·Pᵀ: k16 step kk reads candidates [16 kk, 16 kk + 16) of the tile (MN-major: the d_v
      // lanes of block mb contiguous) and of P.
      const SmemDescriptor v_descriptor = smem_descriptor(tile, Cfg::kTileBlockBytes, 1024);
      const SmemDescriptor p_descriptor = smem_descriptor(p_rows, 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
#pragma unroll
        for (int mb = 0; mb < Cfg::kDvBlocks; ++mb) {
          wgmma_m64n16k16_ss<1>(out_block(mb), v_descriptor.offset(mb * Cfg::kTileBlockBytes + kk * 16 * Cfg::kAtomBytes),
                                p_descriptor.offset(kk * 32), 1);
        }
      }
      wgmma_commit();
    }
    wgmma_wait_all();
    fence_registers(out_acc);
  }
  clock.mark(13);  // the last Oᵀ

  // ---- epilogue: the heads' sums over the block, then the rows through shared memory ----
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) row_sum[k] += __shfl_xor_sync(0xffffffffu, row_sum[k], offset);
  }
  named_barrier_sync(Cfg::kConsumerBarrier, Cfg::kConsumerThreads);  // the last tile maxima are read
  if (lane < 4) {
#pragma unroll
    for (int k = 0; k < 4; ++k) exchange[warp * kH + column(k)] = row_sum[k];
  }
  named_barrier_sync(Cfg::kConsumerBarrier, Cfg::kConsumerThreads);
  const bool write_final = p.workspace.partial_out == nullptr;
  float* const out_rows = reinterpret_cast<float*>(tile_buffer(0));  // [kH][kOutPitch]: every wgmma is done
  RowFinish finish[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int h = column(k);
    const float sum = ((exchange[h] + exchange[kH + h]) + exchange[2 * kH + h]) + exchange[3 * kH + h];
    finish[k] = head_begin + h < num_heads ? finish_row(row_max[k], sum, write_final, a.attn_sink, head_begin + h)
                                           : RowFinish{0.0f, -INFINITY};
  }
#pragma unroll
  for (int i = 0; i < Cfg::kOutRegisters; ++i) {
    const int k = 2 * ((i % 8) / 4) + (i % 2);
    const int d = 64 * (i / 8) + 16 * warp + lane / 4 + 8 * ((i % 4) / 2);
    out_rows[column(k) * Cfg::kOutPitch + d] = out_acc[i] * finish[k].factor;
  }
  named_barrier_sync(Cfg::kConsumerBarrier, Cfg::kConsumerThreads);
  clock.mark(14);  // the output rows in shared memory
  const int heads = min(kH, num_heads - head_begin);
  // BF16 rows in 16-byte runs (8 values a store), into out or into this split's partial rows.
  constexpr int kChunks = Cfg::kDv / 8;
  for (int c = consumer_thread; c < heads * kChunks; c += Cfg::kConsumerThreads) {
    const int h = c / kChunks;
    const int d = (c % kChunks) * 8;
    const float4 x = *reinterpret_cast<const float4*>(out_rows + h * Cfg::kOutPitch + d);
    const float4 y = *reinterpret_cast<const float4*>(out_rows + h * Cfg::kOutPitch + d + 4);
    uint16_t* const row =
        write_final ? a.out + (token * num_heads + head_begin + h) * Cfg::kDv
                    : p.workspace.partial_out +
                          SplitWorkspace::row(coordinates.split, token, head_begin + h, a.num_tokens, num_heads) * Cfg::kDv;
    *reinterpret_cast<uint4*>(row + d) =
        make_uint4(pack_bf16x2(x.x, x.y), pack_bf16x2(x.z, x.w), pack_bf16x2(y.x, y.y), pack_bf16x2(y.z, y.w));
  }
  if (warp == 0 && lane < 4) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int head = head_begin + column(k);
      if (head >= num_heads) continue;
      if (write_final) {
        a.lse[token * num_heads + head] = finish[k].lse;
      } else {
        p.workspace.partial_lse[SplitWorkspace::row(coordinates.split, token, head, a.num_tokens, num_heads)] =
            finish[k].lse;
      }
    }
  }
  clock.mark(15);  // every store issued
  clock.store(p, 1);
#else
  __trap();  // no sm_90a code in this build: the host never launches it (hopper::compiled())
#endif  // JSMLA_HOPPER_DEVICE
}

}  // namespace jsmla::cuda::hopper
