// The tensor-core backward kernel: the gradient of q (mma.sync m16n8k16, BF16 operands, FP32
// accumulators; sm_80 / sm_90a / sm_120a), FlashAttention-style from the forward's lse and the row terms
// D = <dO, out> (kernels/cuda/backward.cu computes them first). Per candidate j of a row,
//   P_j = exp(sm_scale <q, K_j> - lse),  dP_j = <dO, V_j>,  c_j = sm_scale P_j (dP_j - D + dlse),
//   d_q = Σ_j c_j K_j.
//
// Block = (token, 64-head tile), 8 warps in a 4 × 2 grid: warp (g, h) owns head rows [16g, 16g + 16).
// Per 32-candidate tile it computes S and dP for its rows and candidates [16h, 16h + 16), writes c (as
// BF16) into shared memory, and after a barrier adds c·K over the whole tile into its half of d_q's
// columns [h·d_qk/2, (h + 1)·d_qk/2), which stays in registers for the whole row. Q and dO of the 64
// heads stay in shared memory; the candidate rows are gathered and dequantized into a BF16 tile by
// the forward kernels' TileLoader (cp.async into a staging area, converted by the thread that copied),
// the gather of tile i+1 in flight during the MMAs of tile i (tile shapes and shared memory: mma_config.h):
//   S, dP (tile i) → c → barrier → d_q += c·K (tile i) → barrier → convert tile i+1, gather tile i+2 →
//   barrier.
// Every sum runs in a fixed order (the MMAs' k-order, the tiles in candidate order): the same inputs give
// the same bits. Masked candidates are zero-filled and never read; padding rows, heads past H and rows
// with a non-finite lse get a zero d_q (their q and dO are never read).
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/backward/mma_config.h"
#include "kernels/cuda/backward/partials_wgmma.cuh"
#include "kernels/cuda/candidate_tiles.cuh"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/launch_utils.h"
#include "kernels/cuda/load_tile.cuh"
#include "kernels/cuda/softmax_merge.cuh"

namespace jsmla::cuda::backward {

// Copies `rows` rows of `width` BF16 values (16-byte units) from global row `first` of `source` (row
// length `width`) into shared rows of pitch `pitch`; rows where `keep(r)` is false are zero-filled and
// their bytes never read.
template <int kWidth, int kPitch, int kThreads, class Keep>
JSMLA_DEVICE void copy_rows(uint16_t* shared, const uint16_t* source, int rows, Keep&& keep) {
  constexpr int kUnits = kWidth / 8;
  for (int i = threadIdx.x; i < rows * kUnits; i += kThreads) {
    const int r = i / kUnits;
    const int u = i % kUnits;
    uint16_t* to = shared + r * kPitch + 8 * u;
    if (source != nullptr && keep(r)) {
      cp_async_16(to, source + static_cast<int64_t>(r) * kWidth + 8 * u);
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
    }
  }
}

// S += Q·Kᵀ over kSSteps k16 steps and dP += dO·Vᵀ over the first kDpSteps of them (V is K's first d_v
// lanes, so each B fragment of K serves both products): the warp's 16 rows of Q and dO at q_lane and
// d_out_lane (row-major, this lane's ldmatrix row addresses), the tile's rows at k_lane (kPitch elements
// apart, not transposed), 8·kTiles columns.
template <int kSSteps, int kDpSteps, int kPitch, int kTiles>
JSMLA_DEVICE void scores_and_weight_gradients(float (&score)[kTiles][4], float (&d_weight)[kTiles][4],
                                              const uint16_t* q_lane, const uint16_t* d_out_lane,
                                              const uint16_t* k_lane) {
  static_assert(kTiles % 2 == 0, "B fragments are loaded for pairs of n8 tiles");
  static_assert(kDpSteps <= kSSteps, "V is a prefix of K");
#pragma unroll 4
  for (int ks = 0; ks < kSSteps; ++ks) {
    uint32_t q_fragment[4], d_out_fragment[4];
    ldmatrix_x4(q_fragment, q_lane + 16 * ks);
    if (ks < kDpSteps) ldmatrix_x4(d_out_fragment, d_out_lane + 16 * ks);
#pragma unroll
    for (int pair = 0; pair < kTiles / 2; ++pair) {
      uint32_t b[4];
      ldmatrix_x4(b, k_lane + pair * 16 * kPitch + 16 * ks);
      mma_bf16_16816(score[2 * pair], q_fragment, b[0], b[1]);
      mma_bf16_16816(score[2 * pair + 1], q_fragment, b[2], b[3]);
      if (ks < kDpSteps) {
        mma_bf16_16816(d_weight[2 * pair], d_out_fragment, b[0], b[1]);
        mma_bf16_16816(d_weight[2 * pair + 1], d_out_fragment, b[2], b[3]);
      }
    }
  }
}

// Positions `position` and `position + 1` (those before `end`) of chunk row `chunk_row`'s P and c.
JSMLA_DEVICE void store_position_pair(const BackwardMmaLaunch& launch, int64_t chunk_row, bool head_exists,
                                      int32_t position, int32_t end, uint32_t weights, uint32_t coefficients) {
  if (!head_exists || position >= end) return;
  const int64_t at = chunk_row * launch.position_pitch + position;
  if (position + 1 < end) {  // position is even and the pitch a multiple of 64: a 4-byte aligned pair
    *reinterpret_cast<uint32_t*>(launch.weights + at) = weights;
    *reinterpret_cast<uint32_t*>(launch.coefficients + at) = coefficients;
  } else {
    launch.weights[at] = static_cast<uint16_t>(weights & 0xffffu);
    launch.coefficients[at] = static_cast<uint16_t>(coefficients & 0xffffu);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) backward_mma_kernel(const __grid_constant__ BackwardMmaLaunch launch) {
  using Loader = TileLoaderOf<typename Cfg::Geometry>;
  using Smem = typename Cfg::SharedMemory;
  constexpr int kN = Cfg::kCandidateTile;
  constexpr int kPitch = Cfg::kTilePitch;
  constexpr bool kDual = Loader::kF.dual_cache;
  extern __shared__ __align__(128) uint8_t smem_bytes[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_bytes);

  const BackwardParams& p = launch.p;
  const AttentionParams& a = p.forward;
  const int num_heads = a.num_heads;
  const int head_tiles = (num_heads + Cfg::kHeadTile - 1) / Cfg::kHeadTile;
  const int64_t token = launch.first_token + blockIdx.x / head_tiles;
  const int head_begin = static_cast<int>(blockIdx.x % head_tiles) * Cfg::kHeadTile;
  const bool padding = token >= valid_token_count(a.valid_tokens, a.num_tokens);

  // Row metadata, and whether any row of the tile has weight on its candidates.
  bool active = false;
  if (threadIdx.x < Cfg::kHeadTile) {
    const int h = head_begin + threadIdx.x;
    const int64_t row = token * num_heads + h;
    const float lse = h < num_heads ? p.lse[row] : -INFINITY;
    active = h < num_heads && !padding && isfinite(lse);
    const float d_lse = active && p.d_lse != nullptr ? p.d_lse[row] : 0.0f;
    smem.lse2[threadIdx.x] = active ? lse * kLog2e : INFINITY;
    smem.d_term[threadIdx.x] = active ? static_cast<float>(launch.d_rows[row] - static_cast<double>(d_lse)) : 0.0f;
  }
  const bool any_active = __syncthreads_or(active);  // also: the metadata is written

  // Q and dO of the tile's rows (an inactive row's are zeros, never read).
  auto row_active = [&](int r) { return isfinite(smem.lse2[r]); };
  const int64_t first_row = token * num_heads + head_begin;
  const int rows = min(Cfg::kHeadTile, num_heads - head_begin);
  copy_rows<Cfg::kDqk, Cfg::kQPitch, Cfg::kThreads>(&smem.q[0][0], a.q + first_row * Cfg::kDqk, Cfg::kHeadTile,
                                                    [&](int r) { return r < rows && row_active(r); });
  copy_rows<Cfg::kDv, Cfg::kDoPitch, Cfg::kThreads>(&smem.d_out[0][0],
                                                    p.d_out != nullptr ? p.d_out + first_row * Cfg::kDv : nullptr,
                                                    Cfg::kHeadTile, [&](int r) { return r < rows && row_active(r); });
  cp_async_commit();

  // The token's candidate positions (main list, then extra); none when no row has weight on them.
  const int64_t positions = any_active ? static_cast<int64_t>(a.main.topk) + a.extra.topk : 0;
  const CandidateTiles<kN> tiles(a, token, 0, positions);

  // ---- loader role: row `load_row` of every tile, units `load_sub` + k*kThreadsPerRow ----
  const int load_row = threadIdx.x / Loader::kThreadsPerRow;
  const int load_sub = threadIdx.x % Loader::kThreadsPerRow;
  uint8_t* const staged_row = smem.stage + load_row * Loader::kStagedRowBytes;
  uint8_t* const scale_slot = smem.scale_slots + threadIdx.x * Loader::kScaleSlotBytes;
  uint16_t* const tile_row = &smem.tile[load_row][0];
  auto read_row = [&](int tile_index) { return read_pending_row<kDual>(a, tiles, token, tile_index, load_row); };
  auto issue_row = [&](const PendingRow& row) {
    const bool valid = pending_valid<kDual>(a, row);
    if (valid) Loader::issue(pending_cache<kDual>(a, row), row.index, staged_row, scale_slot, load_sub);
    cp_async_commit();
    return valid;
  };
  auto convert_row = [&](bool valid) {
    cp_async_wait_all();
    Loader::convert(valid, staged_row, scale_slot, tile_row, load_sub);
    if (load_sub == 0) smem.score_bias[load_row] = valid ? 0.0f : -INFINITY;
  };

  bool staged_valid = issue_row(read_row(0));
  PendingRow pending = read_row(1);
  if (tiles.count > 0) convert_row(staged_valid);
  cp_async_wait_all();  // Q and dO (also when there is no tile)
  staged_valid = issue_row(pending);
  __syncthreads();

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = warp % Cfg::kHeadGroups;
  const int half = warp / Cfg::kHeadGroups;
  const int row_a = 16 * group + lane / 4;  // accumulator rows lane/4 and lane/4 + 8 of the warp's 16
  const int row_b = row_a + 8;
  const float lse2_a = smem.lse2[row_a], lse2_b = smem.lse2[row_b];
  const float d_term_a = smem.d_term[row_a], d_term_b = smem.d_term[row_b];
  const float score_scale = a.sm_scale * kLog2e;

  float d_q[Cfg::kDqTiles][4];
#pragma unroll
  for (int i = 0; i < Cfg::kDqTiles; ++i) d_q[i][0] = d_q[i][1] = d_q[i][2] = d_q[i][3] = 0.0f;

  // ldmatrix row addresses. A operands (Q, dO, c; row-major): matrices (r0-7,k0-7) (r8-15,k0-7)
  // (r0-7,k8-15) (r8-15,k8-15). K as B of S and dP (not transposed): (n0-7,k0-7) (n0-7,k8-15)
  // (n8-15,k0-7) (n8-15,k8-15). K as B of c·K (transposed): (k0-7,n0-7) (k8-15,n0-7) (k0-7,n8-15)
  // (k8-15,n8-15).
  const int a_row = 16 * group + lane % 8 + ((lane / 8) % 2) * 8;
  const int a_col = (lane / 16) * 8;
  const uint16_t* const q_lane = &smem.q[a_row][a_col];
  const uint16_t* const d_out_lane = &smem.d_out[a_row][a_col];
  const uint16_t* const c_lane = &smem.c[a_row][a_col];
  const uint16_t* const k_lane = &smem.tile[Cfg::kScoreColumns * half + lane % 8 + (lane / 16) * 8][((lane / 8) % 2) * 8];
  const uint16_t* const kt_lane = &smem.tile[lane % 8 + ((lane / 8) % 2) * 8][Cfg::kDqColumns * half + (lane / 16) * 8];

  for (int tile_index = 0; tile_index < tiles.count; ++tile_index) {
    pending = read_row(tile_index + 2);

    // S = Q·Kᵀ and dP = dO·Vᵀ for the warp's 16 rows × 16 candidates.
    float score[Cfg::kScoreTiles][4];
    float d_weight[Cfg::kScoreTiles][4];
#pragma unroll
    for (int i = 0; i < Cfg::kScoreTiles; ++i) {
      score[i][0] = score[i][1] = score[i][2] = score[i][3] = 0.0f;
      d_weight[i][0] = d_weight[i][1] = d_weight[i][2] = d_weight[i][3] = 0.0f;
    }
    scores_and_weight_gradients<Cfg::kDqk / 16, Cfg::kDv / 16, kPitch>(score, d_weight, q_lane, d_out_lane, k_lane);

    // c = sm_scale·P·(dP - D + dlse), P = 2^(S·scale·log2e + bias - lse·log2e): 0 for a masked candidate
    // (bias -inf) and for a row without weight (lse2 +inf).
#pragma unroll
    for (int i = 0; i < Cfg::kScoreTiles; ++i) {
      const int column = Cfg::kScoreColumns * half + 8 * i + 2 * (lane % 4);
      const float bias0 = smem.score_bias[column], bias1 = smem.score_bias[column + 1];
      const float p0 = fast_exp2(score[i][0] * score_scale + bias0 - lse2_a);
      const float p1 = fast_exp2(score[i][1] * score_scale + bias1 - lse2_a);
      const float p2 = fast_exp2(score[i][2] * score_scale + bias0 - lse2_b);
      const float p3 = fast_exp2(score[i][3] * score_scale + bias1 - lse2_b);
      const float s = a.sm_scale;
      const uint32_t c_a = pack_bf16x2(s * p0 * (d_weight[i][0] - d_term_a), s * p1 * (d_weight[i][1] - d_term_a));
      const uint32_t c_b = pack_bf16x2(s * p2 * (d_weight[i][2] - d_term_b), s * p3 * (d_weight[i][3] - d_term_b));
      *reinterpret_cast<uint32_t*>(&smem.c[row_a][column]) = c_a;
      *reinterpret_cast<uint32_t*>(&smem.c[row_b][column]) = c_b;
      if (launch.partials != nullptr && tile_index < tiles.first_count) {
        // A bf16 cache's gradient: P and c of the chunk's main-list positions, for the partials kernel.
        const int32_t position = tiles.begin(tile_index) + column;
        const int32_t end = tiles.end(tile_index);
        const uint32_t p_a = pack_bf16x2(p0, p1), p_b = pack_bf16x2(p2, p3);
        const int64_t chunk_row = (token - launch.first_token) * num_heads + head_begin;
        store_position_pair(launch, chunk_row + row_a, head_begin + row_a < num_heads, position, end, p_a, c_a);
        store_position_pair(launch, chunk_row + row_b, head_begin + row_b < num_heads, position, end, p_b, c_b);
      }
    }
    __syncthreads();  // c of the whole tile is written

    // d_q += c·K over the tile's candidates, the warp's half of the columns.
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t c_fragment[4];
      ldmatrix_x4(c_fragment, c_lane + 16 * kk);
#pragma unroll
      for (int pair = 0; pair < Cfg::kDqTiles / 2; ++pair) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, kt_lane + kk * 16 * kPitch + pair * 16);
        mma_bf16_16816(d_q[2 * pair], c_fragment, b[0], b[1]);
        mma_bf16_16816(d_q[2 * pair + 1], c_fragment, b[2], b[3]);
      }
    }

    __syncthreads();  // the tile and c are no longer read
    if (tile_index + 1 < tiles.count) {
      convert_row(staged_valid);
      staged_valid = issue_row(pending);
    }
    __syncthreads();  // tile i+1 is converted
  }
  cp_async_wait_all();  // nothing stays in flight past the block's end

  // ---- epilogue: d_q of every existing head of the tile (zeros for a row without weight) ----
  if (p.d_q == nullptr) return;
  const int head_a = head_begin + row_a;
  const int head_b = head_begin + row_b;
  const int column0 = Cfg::kDqColumns * half + 2 * (lane % 4);
#pragma unroll
  for (int i = 0; i < Cfg::kDqTiles; ++i) {
    const int column = column0 + 8 * i;
    if (head_a < num_heads) {
      *reinterpret_cast<uint32_t*>(p.d_q + (token * num_heads + head_a) * Cfg::kDqk + column) =
          pack_bf16x2(d_q[i][0], d_q[i][1]);
    }
    if (head_b < num_heads) {
      *reinterpret_cast<uint32_t*>(p.d_q + (token * num_heads + head_b) * Cfg::kDqk + column) =
          pack_bf16x2(d_q[i][2], d_q[i][3]);
    }
  }
}

// A bf16 cache's gradient, per candidate position p = (t, j) of a chunk's tokens:
//   partial[p] = Σ_h c_j(t, h) q(t, h) + P_j(t, h) dO(t, h)   (dO's columns past d_v count as zero)
// as one product [64 positions × 2·Hp] · [2·Hp × d_qk/2] per step and block, Hp = H rounded up to 16:
// A = (c, P) of the tile's positions (kept [k][position] as the backward kernel wrote them, so its
// fragments come from ldmatrix.trans), B = (q, dO) of the token's heads, loaded once. Rows of heads
// without weight on candidates are zeros (their P and c were never written), a padding token's block
// writes nothing; positions past the row's length are not written (no sort key names them).
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) cache_partials_kernel(const __grid_constant__ BackwardMmaLaunch launch) {
  using Shape = typename Cfg::Partials;
  using Smem = typename Shape::SharedMemory;
  extern __shared__ __align__(128) uint8_t smem_bytes[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_bytes);
  const BackwardParams& p = launch.p;
  const AttentionParams& a = p.forward;
  const int64_t chunk_token = blockIdx.x / 2;
  const int64_t token = launch.first_token + chunk_token;
  const int column0 = static_cast<int>(blockIdx.x % 2) * Shape::kSpan;
  if (token >= valid_token_count(a.valid_tokens, a.num_tokens)) return;  // the whole block: no barrier skipped
  const int num_heads = a.num_heads;
  const int padded_heads = (num_heads + 15) / 16 * 16;
  const int64_t row0 = token * num_heads;
  auto head_active = [&](int h) { return h < num_heads && isfinite(p.lse[row0 + h]); };

  // B: row r < Hp is q of head r, row Hp + r dO of head r (the half's columns; zeros past d_v).
  constexpr int kUnits = Shape::kSpan / 8;
  for (int i = threadIdx.x; i < 2 * padded_heads * kUnits; i += Cfg::kThreads) {
    const int r = i / kUnits;
    const int column = column0 + 8 * (i % kUnits);
    const bool is_q = r < padded_heads;
    const int h = is_q ? r : r - padded_heads;
    uint16_t* to = &smem.b[r][column - column0];
    const bool keep = head_active(h) && (is_q || (p.d_out != nullptr && column < Cfg::kDv));
    if (keep) {
      cp_async_16(to, is_q ? a.q + (row0 + h) * Cfg::kDqk + column : p.d_out + (row0 + h) * Cfg::kDv + column);
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
    }
  }
  cp_async_commit();

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = warp % Shape::kPositionWarps;    // positions [32 group, 32 group + 32) of the tile
  const int quarter = warp / Shape::kPositionWarps;  // columns [quarter · kColumnsPerWarp, ...) of the span
  constexpr int kGroupPositions = 16 * Shape::kRowBlocks;
  const uint16_t* const a_lane =
      &smem.a[0][lane % 8 + 8 * (lane / 16)][kGroupPositions * group + 8 * ((lane / 8) % 2)];
  const uint16_t* const b_lane =
      &smem.b[lane % 8 + ((lane / 8) % 2) * 8][quarter * Shape::kColumnsPerWarp + (lane / 16) * 8];
  const int k_steps = 2 * padded_heads / 16;
  const int32_t length = a.main.row_length(token);
  const int64_t chunk_rows = chunk_token * num_heads;

  // A of the tile at `first` into buffer `buffer`: row r < Hp is c of head r, row Hp + r its P; positions
  // [first, first + 64). The copies of the next tile are in flight while the block multiplies this one.
  auto load_a = [&](int32_t first, int buffer) {
    constexpr int kAUnits = Shape::kTile / 8;
    for (int i = threadIdx.x; i < 2 * padded_heads * kAUnits; i += Cfg::kThreads) {
      const int r = i / kAUnits;
      const int u = i % kAUnits;
      const bool is_c = r < padded_heads;
      const int h = is_c ? r : r - padded_heads;
      uint16_t* to = &smem.a[buffer][r][8 * u];
      if (head_active(h)) {
        const uint16_t* from = (is_c ? launch.coefficients : launch.weights) +
                               (chunk_rows + h) * launch.position_pitch + first + 8 * u;
        cp_async_16(to, from);
      } else {
        *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
      }
    }
    cp_async_commit();
  };
  if (length > 0) load_a(0, 0);

  int buffer = 0;
  for (int32_t first = 0; first < length; first += Shape::kTile, buffer ^= 1) {
    if (first + Shape::kTile < length) {
      load_a(first + Shape::kTile, buffer ^ 1);
      cp_async_wait_pending<1>();  // all but the next tile's copies: this tile's A (and, the first time, B)
    } else {
      cp_async_wait_all();
    }
    __syncthreads();  // A (and, the first time, B) landed for every thread

    float acc[Shape::kRowBlocks][Shape::kTiles][4];
#pragma unroll
    for (int m = 0; m < Shape::kRowBlocks; ++m) {
#pragma unroll
      for (int i = 0; i < Shape::kTiles; ++i) acc[m][i][0] = acc[m][i][1] = acc[m][i][2] = acc[m][i][3] = 0.0f;
    }
    const uint16_t* const a_tile = a_lane + buffer * (Shape::kRows * Shape::kAPitch);
    for (int ks = 0; ks < k_steps; ++ks) {
      uint32_t a_fragment[Shape::kRowBlocks][4];
#pragma unroll
      for (int m = 0; m < Shape::kRowBlocks; ++m) ldmatrix_x4_trans(a_fragment[m], a_tile + 16 * ks * Shape::kAPitch + 16 * m);
      const uint16_t* const b_step = b_lane + 16 * ks * Shape::kBPitch;
#pragma unroll
      for (int pair = 0; pair < Shape::kTiles / 2; ++pair) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, b_step + pair * 16);
#pragma unroll
        for (int m = 0; m < Shape::kRowBlocks; ++m) {
          mma_bf16_16816(acc[m][2 * pair], a_fragment[m], b[0], b[1]);
          mma_bf16_16816(acc[m][2 * pair + 1], a_fragment[m], b[2], b[3]);
        }
      }
      if constexpr (Shape::kTiles % 2 == 1) {  // the last n8 tile alone
        uint32_t b[2];
        ldmatrix_x2_trans(b, b_step + (Shape::kTiles - 1) * 8);
#pragma unroll
        for (int m = 0; m < Shape::kRowBlocks; ++m) mma_bf16_16816(acc[m][Shape::kTiles - 1], a_fragment[m], b[0], b[1]);
      }
    }

    // Each position's partial row, rounded once to bf16 (kPartialBytes).
    const int column = column0 + quarter * Shape::kColumnsPerWarp + 2 * (lane % 4);
#pragma unroll
    for (int m = 0; m < Shape::kRowBlocks; ++m) {
      const int32_t position_a = first + kGroupPositions * group + 16 * m + lane / 4;
      const int32_t position_b = position_a + 8;
      uint16_t* const row_a = launch.partials + (chunk_token * a.main.topk + position_a) * Cfg::kDqk + column;
      uint16_t* const row_b = launch.partials + (chunk_token * a.main.topk + position_b) * Cfg::kDqk + column;
#pragma unroll
      for (int i = 0; i < Shape::kTiles; ++i) {
        if (position_a < length) *reinterpret_cast<uint32_t*>(row_a + 8 * i) = pack_bf16x2(acc[m][i][0], acc[m][i][1]);
        if (position_b < length) *reinterpret_cast<uint32_t*>(row_b + 8 * i) = pack_bf16x2(acc[m][i][2], acc[m][i][3]);
      }
    }
    __syncthreads();  // this buffer is no longer read: the tile after next may land in it
  }
  cp_async_wait_all();  // (no tile: B's copies) nothing stays in flight past the block's end
}

// Raises `kernel`'s dynamic shared-memory limit once per device.
template <class Kernel>
cudaError_t allow_shared_bytes(Kernel* kernel, int bytes, DeviceOnce& raised) {
  return raised.run([&] { return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); });
}

template <class Cfg>
cudaError_t launch_backward_mma(const BackwardMmaLaunch& launch, cudaStream_t stream) {
  static DeviceOnce backward_raised;
  auto* kernel = &backward_mma_kernel<Cfg>;
  if (const cudaError_t error = allow_shared_bytes(kernel, Cfg::kSharedBytes, backward_raised); error != cudaSuccess) {
    return error;
  }
  const AttentionParams& a = launch.p.forward;
  const int64_t blocks = launch.chunk_tokens * ((a.num_heads + Cfg::kHeadTile - 1) / Cfg::kHeadTile);
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSharedBytes, stream>>>(launch);
  if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  if constexpr (Cfg::kF.layout == Layout::kBf16) {  // only a bf16 cache has a gradient
    if (launch.partials != nullptr && launch.wgmma_partials) {
      using Shape = typename Cfg::PartialsWgmma;
      static DeviceOnce wgmma_raised;
      auto* partials = &cache_partials_wgmma_kernel<Cfg>;
      if (const cudaError_t error = allow_shared_bytes(partials, Shape::kSharedBytes, wgmma_raised); error != cudaSuccess) {
        return error;
      }
      partials<<<static_cast<unsigned>(Shape::kColumnBlocks * launch.chunk_tokens), Shape::kThreads, Shape::kSharedBytes,
                 stream>>>(launch);
      return cudaGetLastError();
    }
    if (launch.partials != nullptr) {
      static DeviceOnce partials_raised;
      auto* partials = &cache_partials_kernel<Cfg>;
      constexpr int kBytes = Cfg::Partials::kSharedBytes;
      if (const cudaError_t error = allow_shared_bytes(partials, kBytes, partials_raised); error != cudaSuccess) {
        return error;
      }
      partials<<<static_cast<unsigned>(2 * launch.chunk_tokens), Cfg::kThreads, kBytes, stream>>>(launch);
      return cudaGetLastError();
    }
  }
  return cudaSuccess;
}

}  // namespace jsmla::cuda::backward
