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

// In a quad of lanes (q = lane % 4) holding v[k] = element (q, k) of a 4 × 4 matrix, leaves v[k] =
// element (k, q): swaps the off-diagonal 2 × 2 blocks (xor 2), then the off-diagonal elements of each
// block (xor 1), each stage two shuffles with lane-selected operands (no dynamically indexed registers).
JSMLA_DEVICE void quad_transpose(uint32_t (&v)[4], int quad_lane) {
  const bool high = quad_lane & 2;
#pragma unroll
  for (int o = 0; o < 2; ++o) {  // positions whose high bit differs from the lane's
    const uint32_t received = __shfl_xor_sync(0xffffffffu, high ? v[o] : v[2 + o], 2);
    if (high) v[o] = received; else v[2 + o] = received;
  }
  const bool low = quad_lane & 1;
#pragma unroll
  for (int o = 0; o < 2; ++o) {  // positions whose low bit differs from the lane's
    const uint32_t received = __shfl_xor_sync(0xffffffffu, low ? v[2 * o] : v[2 * o + 1], 1);
    if (low) v[2 * o] = received; else v[2 * o + 1] = received;
  }
}

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
  // Hp + r its P; positions [first, first + 64), eight 16-byte units a row. A thread copies the units
  // thread + 128·i; which of its rows belong to heads with weight is read from lse once per block.
  constexpr int kAUnits = rows * 8 / 128;  // 16-byte units a thread copies per tile
  static_assert(rows * 8 % 128 == 0 && kAUnits <= 32, "a thread's units of a tile fit one 32-bit mask");
  auto a_unit = [&](int i, int& r, int& u) {
    r = (thread + 128 * i) / 8;
    u = (thread + 128 * i) % 8;
  };
  uint32_t active_units = 0;
#pragma unroll
  for (int i = 0; i < kAUnits; ++i) {
    int r, u;
    a_unit(i, r, u);
    if (head_active(r < padded_heads ? r : r - padded_heads)) active_units |= 1u << i;
  }
  auto load_a = [&](int32_t first, int buffer) {
    uint8_t* const base = &smem.a[group][buffer][0][0];
#pragma unroll
    for (int i = 0; i < kAUnits; ++i) {
      int r, u;
      a_unit(i, r, u);
      const bool is_c = r < padded_heads;
      const int h = is_c ? r : r - padded_heads;
      uint8_t* to = base + swizzled_unit(r, u);
      if (active_units >> i & 1) {
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

    // Each position's partial row, rounded once to bf16 (kPartialBytes). The m64nN accumulators give a
    // thread rows 16·warp + lane/4 and + 8, columns 8j + 2·(lane % 4); a 4 × 4 transpose within each quad
    // of lanes (two xor-shuffle stages) hands lane q of the quad the eight columns of j = 4g + q, so every
    // store is 16 bytes and a quad writes 64 contiguous bytes of a row.
    const int32_t position_a = first + 16 * warp + lane / 4;
    const int32_t position_b = position_a + 8;
    const int quad_lane = lane % 4;
    uint16_t* const row_a = launch.partials + (chunk_token * a.main.topk + position_a) * Cfg::kDqk + column0;
    uint16_t* const row_b = launch.partials + (chunk_token * a.main.topk + position_b) * Cfg::kDqk + column0;
    static_assert(Shape::kColumns % 32 == 0, "whole quads of 8-column groups per block");
#pragma unroll
    for (int g = 0; g < Shape::kColumns / 32; ++g) {
      uint32_t va[4], vb[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        va[k] = pack_bf16x2(acc[4 * (4 * g + k)], acc[4 * (4 * g + k) + 1]);
        vb[k] = pack_bf16x2(acc[4 * (4 * g + k) + 2], acc[4 * (4 * g + k) + 3]);
      }
      quad_transpose(va, quad_lane);
      quad_transpose(vb, quad_lane);
      const int column = 8 * (4 * g + quad_lane);
      if (position_a < length) *reinterpret_cast<uint4*>(row_a + column) = make_uint4(va[0], va[1], va[2], va[3]);
      if (position_b < length) *reinterpret_cast<uint4*>(row_b + column) = make_uint4(vb[0], vb[1], vb[2], vb[3]);
    }
  }
  cp_async_wait_all();  // nothing stays in flight past the block's end
#endif
}

}  // namespace jsmla::cuda::backward
