// The running (online) softmax of one thread's two accumulator rows, shared by every CUDA kernel
// family. Scores sit in the m16n8 accumulator layout that mma.sync and wgmma share: a thread holds
// rows lane/4 and lane/4 + 8 of a 16-row block, and score[j] = {(r0, c), (r0, c + 1), (r1, c),
// (r1, c + 1)} with c = 8j + 2(lane % 4).
#pragma once

#include <cmath>

#include "kernels/cuda/device_utils.cuh"

namespace jsmla::cuda {

// Exact scales: multiplies this thread's score columns (the m16n8 layout above) by per-candidate factors,
// `column_factor[c]` for column c.
template <int kTiles>
JSMLA_DEVICE void scale_score_columns(float (&score)[kTiles][4], const float* column_factor, int lane) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    const float2 f = *reinterpret_cast<const float2*>(column_factor + 8 * i + 2 * (lane % 4));
    score[i][0] *= f.x;
    score[i][1] *= f.y;
    score[i][2] *= f.x;
    score[i][3] *= f.y;
  }
}

struct RunningSoftmax {
  // A row's running max moves only when a tile's max exceeds it by more than kMaxLag (log2 domain).
  // Until then P = 2^(s - max) stays below 2^kMaxLag — harmless for the FP32 sums and accumulators and
  // for P in BF16 (same relative precision) — and the output accumulators need no rescale: after the
  // first tiles almost none do. The final normalisation divides by the sum taken with the same max.
  static constexpr float kMaxLag = 8.0f;

  float row_max[2] = {-INFINITY, -INFINITY};  // in the log2 domain
  float row_sum[2] = {0.0f, 0.0f};            // this thread's columns only until finish()

  // Turns a tile of raw scores into P = 2^(s·scale + bias - max) in place (bias: 0 or -inf per
  // column, read from `bias` at the column index), updates the running max (see kMaxLag) and sum, and
  // returns in `rescale` the factor each row's output accumulators must be multiplied by (exactly 1
  // when the max did not move). A row that has seen only masked candidates keeps max -inf and
  // everything at zero.
  template <int kTiles>
  JSMLA_DEVICE void update(float (&score)[kTiles][4], const float* bias, float score_scale, int lane,
                           float (&rescale)[2]) {
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const float2 b = *reinterpret_cast<const float2*>(bias + 8 * i + 2 * (lane % 4));
      score[i][0] = score[i][0] * score_scale + b.x;
      score[i][1] = score[i][1] * score_scale + b.y;
      score[i][2] = score[i][2] * score_scale + b.x;
      score[i][3] = score[i][3] * score_scale + b.y;
      tile_max[0] = fmaxf(tile_max[0], fmaxf(score[i][0], score[i][1]));
      tile_max[1] = fmaxf(tile_max[1], fmaxf(score[i][2], score[i][3]));
    }
    float subtract[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float new_max = tile_max[r] > row_max[r] + kMaxLag ? tile_max[r] : row_max[r];
      subtract[r] = new_max == -INFINITY ? 0.0f : new_max;
      rescale[r] = fast_exp2(row_max[r] - subtract[r]);
      row_max[r] = new_max;
      row_sum[r] *= rescale[r];
    }
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      score[i][0] = fast_exp2(score[i][0] - subtract[0]);
      score[i][1] = fast_exp2(score[i][1] - subtract[0]);
      score[i][2] = fast_exp2(score[i][2] - subtract[1]);
      score[i][3] = fast_exp2(score[i][3] - subtract[1]);
      row_sum[0] += score[i][0] + score[i][1];
      row_sum[1] += score[i][2] + score[i][3];
    }
  }

  // Most tiles leave the running maxima unchanged (every factor exactly 1): the output rescale can
  // then be skipped with bit-identical results. Warp-uniform.
  JSMLA_DEVICE static bool needs_rescale(const float (&rescale)[2]) {
    return __any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f);
  }

  // Sums each row over the four threads that share it (call once, after the last tile).
  JSMLA_DEVICE void finish() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    }
  }
};

}  // namespace jsmla::cuda
