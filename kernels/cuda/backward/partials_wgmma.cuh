// The cache gradient's partial rows on wgmma (sm_90a): the same products as cache_partials_kernel
// (mma_kernel.cuh),
//   partial[p] = Σ_h c_j(t, h) q(t, h) + P_j(t, h) dO(t, h)   (dO's columns past d_v count as zero),
// per block (token, kColumns of d_qk's columns) as [64 positions × 2·128] · [2·128 × kColumns] wgmmas
// (heads past H are zero rows). Shapes and shared memory: BackwardMmaConfig::PartialsWgmma (mma_config.h).
// Both operands are MN-major in shared memory (A = c, P as the q-gradient kernel wrote them: positions
// contiguous; B = q, dO: columns contiguous), so the copies from global memory keep 16-byte units whole
// and only move them to their swizzled place. Each warpgroup takes the tiles 2·s + group: the next tile's
// copies are in flight while this tile's k16 wgmmas run, and its epilogue (FP32 → BF16 stores of the
// partial rows) overlaps the other warpgroup's wgmmas. Rows of heads without weight on candidates are
// zeros; a padding token's block writes nothing; positions past the row's length are not written.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/backward/mma_config.h"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/hopper/wgmma.cuh"
#include "kernels/cuda/launch_params.h"

namespace jsmla::cuda::backward {

// Byte offset of the 16-byte unit holding elements [8u, 8u + 8) of row `row` in a 64-element block of
// 128-byte swizzled rows (unit u of row r sits at u ^ (r % 8)).
JSMLA_DEVICE int swizzled_unit(int row, int unit) { return row * 128 + ((unit ^ (row % 8)) * 16); }

template <class Cfg>
__global__ void __launch_bounds__(Cfg::PartialsWgmma::kThreads, 1)
    cache_partials_wgmma_kernel(const __grid_constant__ BackwardMmaLaunch launch) {
#if JSMLA_HOPPER_DEVICE
  using namespace hopper;
  using Shape = typename Cfg::PartialsWgmma;
  using Smem = typename Shape::SharedMemory;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023));
  const BackwardParams& p = launch.p;
  const AttentionParams& a = p.forward;
  const int64_t chunk_token = blockIdx.x / Shape::kColumnBlocks;
  const int64_t token = launch.first_token + chunk_token;
  const int column0 = static_cast<int>(blockIdx.x % Shape::kColumnBlocks) * Shape::kColumns;
  if (token >= valid_token_count(a.valid_tokens, a.num_tokens)) return;  // the whole block: no barrier skipped
  const int num_heads = a.num_heads;
  // k is always kMaxHeads twice over (heads past H zero rows): a constant count of k16 steps, unrolled,
  // keeps the wgmmas pipelined (ptxas serialises wgmmas in a loop of run-time length, C7520); the
  // dispatcher sends H ≤ 64 to the mma.sync kernel, where that padding would cost more than it saves.
  constexpr int padded_heads = kMaxHeads;
  constexpr int rows = Shape::kRows;
  const int64_t row0 = token * num_heads;
  auto head_active = [&](int h) { return h < num_heads && isfinite(p.lse[row0 + h]); };

  // B: row r < Hp is q of head r, row Hp + r dO of head r (the block's columns; zeros past d_v).
  constexpr int kBUnits = Shape::kColumns / 8;
  for (int i = threadIdx.x; i < rows * kBUnits; i += Shape::kThreads) {
    const int r = i / kBUnits;
    const int u = i % kBUnits;
    const int column = column0 + 8 * u;
    const bool is_q = r < padded_heads;
    const int h = is_q ? r : r - padded_heads;
    uint8_t* to = &smem.b[u / 8][0][0] + swizzled_unit(r, u % 8);
    if (head_active(h) && (is_q || (p.d_out != nullptr && column < Cfg::kDv))) {
      cp_async_16(to, is_q ? a.q + (row0 + h) * Cfg::kDqk + column : p.d_out + (row0 + h) * Cfg::kDv + column);
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
    }
  }
  cp_async_commit();

  const int group = threadIdx.x / 128;
  const int thread = threadIdx.x % 128;
  const int32_t length = a.main.row_length(token);
  const int64_t chunk_rows = chunk_token * num_heads;
  // A of the tile at `first` into this warpgroup's buffer `buffer`: row r < Hp is c of head r, row
  // Hp + r its P; positions [first, first + 64), eight 16-byte units a row.
  auto load_a = [&](int32_t first, int buffer) {
    uint8_t* const base = &smem.a[group][buffer][0][0];
    for (int i = thread; i < rows * 8; i += 128) {
      const int r = i / 8;
      const int u = i % 8;
      const bool is_c = r < padded_heads;
      const int h = is_c ? r : r - padded_heads;
      uint8_t* to = base + swizzled_unit(r, u);
      if (head_active(h)) {
        cp_async_16(to, (is_c ? launch.coefficients : launch.weights) + (chunk_rows + h) * launch.position_pitch +
                            first + 8 * u);
      } else {
        *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
      }
    }
  };
  constexpr int kStep = Shape::kGroups * Shape::kTile;  // positions between a warpgroup's tiles
  const int32_t first0 = group * Shape::kTile;
  if (first0 < length) load_a(first0, 0);
  cp_async_commit();  // (an empty group where this warpgroup has no tile)
  cp_async_wait_pending<1>();  // B (this thread's copies)
  fence_proxy_async_shared();  // B's copies and zero rows, visible to wgmma
  __syncthreads();             // B complete for both warpgroups

  const int warp = thread / 32;
  const int lane = thread % 32;
  const SmemDescriptor b_descriptor = smem_descriptor(&smem.b[0][0][0], Shape::kBlockBytes, 1024);
  float acc[Shape::kAccumulators];
  int buffer = 0;
  for (int32_t first = first0; first < length; first += kStep, buffer ^= 1) {
    if (first + kStep < length) {
      load_a(first + kStep, buffer ^ 1);  // that buffer's wgmmas finished before the barrier below, last tile
      cp_async_commit();
      cp_async_wait_pending<1>();  // this tile's copies (this thread's)
    } else {
      cp_async_wait_all();
    }
    fence_proxy_async_shared();
    named_barrier_sync(1 + group, 128);  // this tile's A complete for the warpgroup

    const SmemDescriptor a_descriptor = smem_descriptor(&smem.a[group][buffer][0][0], Shape::kBlockBytes, 1024);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < rows / 16; ++ks) {
      // k rows [16 ks, 16 ks + 16): two 8-row groups of 1024 bytes in every 64-element block.
      wgmma_ss_mn(acc, a_descriptor.offset(ks * 2048), b_descriptor.offset(ks * 2048), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(acc);
    named_barrier_sync(1 + group, 128);  // every warp's wgmmas done: this buffer may take the tile after next

    // Each position's partial row, rounded once to bf16 (kPartialBytes): thread rows 16·warp + lane/4 and
    // + 8, columns 8j + 2·(lane % 4) of the accumulators' m64nN layout.
    const int32_t position_a = first + 16 * warp + lane / 4;
    const int32_t position_b = position_a + 8;
    const int column = column0 + 2 * (lane % 4);
    uint16_t* const row_a = launch.partials + (chunk_token * a.main.topk + position_a) * Cfg::kDqk + column;
    uint16_t* const row_b = launch.partials + (chunk_token * a.main.topk + position_b) * Cfg::kDqk + column;
#pragma unroll
    for (int j = 0; j < Shape::kColumns / 8; ++j) {
      if (position_a < length) *reinterpret_cast<uint32_t*>(row_a + 8 * j) = pack_bf16x2(acc[4 * j], acc[4 * j + 1]);
      if (position_b < length) *reinterpret_cast<uint32_t*>(row_b + 8 * j) = pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
  cp_async_wait_all();  // nothing stays in flight past the block's end
#endif
}

}  // namespace jsmla::cuda::backward
