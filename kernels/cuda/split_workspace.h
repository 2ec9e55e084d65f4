// The one layout of split-K partial results, shared by every CUDA kernel family and the combine kernel.
//
// The workspace of a decode call is float32 and holds, in this order:
//   partial_out[num_splits][T][H][d_v]  each split's output normalised by its own sum of exp(s_j)
//                                       (zeros for a split with no valid candidate);
//   partial_lse[num_splits][T][H]       natural log of that split's sum of exp(s_j), without the sink
//                                       (-inf for a split with no valid candidate).
// Total bytes: num_splits * T * H * (d_v + 1) * 4; the planner sizes the workspace output with bytes()
// (through the CPU extension).
// Rows t >= valid_tokens are neither written nor read.
#pragma once

#include <cstdint>

#include "kernels/common/formats.h"

namespace jsmla::cuda {

struct SplitWorkspace {
  float* partial_out = nullptr;
  float* partial_lse = nullptr;

  static constexpr int64_t bytes(int64_t num_splits, int64_t num_tokens, int64_t num_heads, int64_t d_v) {
    return num_splits * num_tokens * num_heads * (d_v + 1) * static_cast<int64_t>(sizeof(float));
  }

  static SplitWorkspace carve(void* base, int64_t num_splits, int64_t num_tokens, int64_t num_heads, int64_t d_v) {
    SplitWorkspace w;
    w.partial_out = static_cast<float*>(base);
    w.partial_lse = w.partial_out + num_splits * num_tokens * num_heads * d_v;
    return w;
  }

  // Index of (split, token, head) in partial_lse; times d_v, the row start in partial_out.
  static JSMLA_HD int64_t row(int64_t split, int64_t token, int64_t head, int64_t num_tokens, int64_t num_heads) {
    return (split * num_tokens + token) * num_heads + head;
  }
};

}  // namespace jsmla::cuda
