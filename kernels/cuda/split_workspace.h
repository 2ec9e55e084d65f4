// The one layout of split-K partial results, shared by every CUDA kernel family and the combine kernel.
//
// The workspace of a decode call holds, in this order:
//   partial_out[num_splits][T][H][d_v]  BF16: each split's output normalised by its own sum of exp(s_j)
//                                       (zeros for a split with no valid candidate), rounded once —
//                                       a convex combination of V rows, so its rounding is that of the
//                                       BF16 output, and half the bytes of FP32 to write and read back;
//   partial_lse[num_splits][T][H]       float32: natural log of that split's sum of exp(s_j), without
//                                       the sink (-inf for a split with no valid candidate).
// Total bytes: num_splits * T * H * (2 d_v + 4); the planner sizes the workspace output with bytes()
// (through the CPU extension).
// Rows t >= valid_tokens are neither written nor read.
#pragma once

#include <cstdint>

#include "kernels/common/formats.h"

namespace jsmla::cuda {

struct SplitWorkspace {
  uint16_t* partial_out = nullptr;  // BF16 bits
  float* partial_lse = nullptr;

  static constexpr int64_t bytes(int64_t num_splits, int64_t num_tokens, int64_t num_heads, int64_t d_v) {
    return num_splits * num_tokens * num_heads * (d_v * static_cast<int64_t>(sizeof(uint16_t)) + static_cast<int64_t>(sizeof(float)));
  }

  // partial_lse starts 16-byte aligned when base is (d_v is a multiple of 8 in every format).
  static SplitWorkspace carve(void* base, int64_t num_splits, int64_t num_tokens, int64_t num_heads, int64_t d_v) {
    SplitWorkspace w;
    w.partial_out = static_cast<uint16_t*>(base);
    w.partial_lse = reinterpret_cast<float*>(w.partial_out + num_splits * num_tokens * num_heads * d_v);
    return w;
  }

  // Index of (split, token, head) in partial_lse; times d_v, the row start in partial_out.
  static JSMLA_HD int64_t row(int64_t split, int64_t token, int64_t head, int64_t num_tokens, int64_t num_heads) {
    return (split * num_tokens + token) * num_heads + head;
  }
};

}  // namespace jsmla::cuda
