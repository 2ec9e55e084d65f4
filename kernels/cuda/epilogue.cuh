// The output side of a block, shared by both kernel families: rescaling the output accumulators when
// a running max moved, and storing a thread's two accumulator rows at the end — BF16 out and lse with
// the sink folded in (a block that covers a token's whole candidate list) or its FP32 partial state (a
// split of a decode call; layout in split_workspace.h).
// Accumulators are in the m16n8 layout that mma.sync and wgmma share: acc[4j .. 4j+3] hold
// (r0, c), (r0, c + 1), (r1, c), (r1, c + 1) with c = 8j + 2 (lane % 4), where r0 = lane / 4 and
// r1 = lane / 4 + 8 are the thread's rows of a 16-row block.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/online_softmax.cuh"
#include "kernels/cuda/softmax_merge.cuh"

namespace jsmla::cuda {

// Multiplies row r of the accumulators by rescale[r].
template <int kCount>
JSMLA_DEVICE void rescale_rows(float (&acc)[kCount], const float (&rescale)[2]) {
  static_assert(kCount % 4 == 0, "accumulators come in whole m16n8 fragments");
#pragma unroll
  for (int c = 0; c < kCount; c += 4) {
    acc[c + 0] *= rescale[0];
    acc[c + 1] *= rescale[0];
    acc[c + 2] *= rescale[1];
    acc[c + 3] *= rescale[1];
  }
}

// Stores the thread's rows (query heads `heads[0]`, `heads[1]`; heads past H are skipped) of output
// columns column_first + 8j, + 1 for every fragment j of `acc`, normalised by the softmax.
// `writes_lse`: this thread stores the rows' lse (one thread per row among those sharing it).
template <int kDv, int kCount>
JSMLA_DEVICE void store_rows(const SplitKvParams& p, int64_t token, int split, const int (&heads)[2], int column_first,
                             bool writes_lse, const RunningSoftmax& softmax, const float (&acc)[kCount]) {
  static_assert(kCount % 4 == 0, "accumulators come in whole m16n8 fragments");
  const AttentionParams& a = p.attn;
  const bool write_final = p.workspace.partial_out == nullptr;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int head = heads[r];
    if (head >= a.num_heads) continue;
    const RowFinish finish = finish_row(softmax.row_max[r], softmax.row_sum[r], write_final, a.attn_sink, head);
    if (write_final) {
      uint16_t* out = a.out + (token * a.num_heads + head) * kDv + column_first;
#pragma unroll
      for (int j = 0; j < kCount / 4; ++j) {
        *reinterpret_cast<uint32_t*>(out + 8 * j) =
            pack_bf16x2(acc[4 * j + 2 * r] * finish.factor, acc[4 * j + 2 * r + 1] * finish.factor);
      }
      if (writes_lse) a.lse[token * a.num_heads + head] = finish.lse;
    } else {
      const int64_t row = SplitWorkspace::row(split, token, head, a.num_tokens, a.num_heads);
      float* out = p.workspace.partial_out + row * kDv + column_first;
#pragma unroll
      for (int j = 0; j < kCount / 4; ++j) {
        *reinterpret_cast<float2*>(out + 8 * j) =
            make_float2(acc[4 * j + 2 * r] * finish.factor, acc[4 * j + 2 * r + 1] * finish.factor);
      }
      if (writes_lse) p.workspace.partial_lse[row] = finish.lse;
    }
  }
}

}  // namespace jsmla::cuda
