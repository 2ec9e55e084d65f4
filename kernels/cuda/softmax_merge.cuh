// Merging attention states (out normalised by its own sum, natural-log lse) and folding in the sink.
// Shared by the combine kernel and every single-pass epilogue, so the ±inf and empty-row rules
// (docs/semantics.md, empty rows) live in one place: no valid candidate and no sink → out 0,
// lse -inf; a sink alone → out 0, lse = sink; sink = +inf → out 0, lse +inf; sink = -inf → no
// effect. No NaN for finite inputs.
#pragma once

#include <cmath>

#include "kernels/cuda/device_utils.cuh"

namespace jsmla::cuda {

inline constexpr float kLn2 = 0.69314718055994530942f;
inline constexpr float kLog2e = 1.44269504088896340736f;

// log(exp(lse) + exp(sink)); either may be -inf, and sink = +inf dominates.
JSMLA_DEVICE float lse_with_sink(float lse, float sink) {
  if (sink == -INFINITY) return lse;
  if (lse == -INFINITY || sink == INFINITY) return sink;
  const float high = fmaxf(lse, sink);
  return high + log1pf(expf(fminf(lse, sink) - high));
}

// The factor of a partial state with log-sum-exp `part` inside a total with log-sum-exp `total`.
JSMLA_DEVICE float state_weight(float part, float total) {
  return (part == -INFINITY || total == INFINITY) ? 0.0f : expf(part - total);
}

// Natural-log sum of exp of a running softmax kept as (max in the log2 domain, sum of 2^(x - max)).
JSMLA_DEVICE float lse_from_log2_state(float max_log2, float sum) {
  return sum > 0.0f ? (max_log2 + log2f(sum)) * kLn2 : -INFINITY;
}

// The end of one head row of a block's running softmax: the factor its output accumulators are
// multiplied by and the lse it stores. A block that writes out/lse itself (write_final) folds in the
// sink; a split of a decode call stores its own normalised state for the combine kernel.
struct RowFinish {
  float factor;
  float lse;
};
JSMLA_DEVICE RowFinish finish_row(float max_log2, float sum, bool write_final, const float* attn_sink, int head) {
  const float split_lse = lse_from_log2_state(max_log2, sum);
  if (!write_final) return {sum > 0.0f ? 1.0f / sum : 0.0f, split_lse};
  const float sink = attn_sink != nullptr ? attn_sink[head] : -INFINITY;
  const float lse = lse_with_sink(split_lse, sink);
  return {sum > 0.0f ? state_weight(split_lse, lse) / sum : 0.0f, lse};
}

}  // namespace jsmla::cuda
