// The CUDA backward's workspace layout (host- and device-compilable, no CUDA headers): the CPU
// extension exposes its size so that the trace-time lowering sizes the workspace result as the handler
// checks it, and the launch carves the buffer by the same offsets.
#pragma once

#include <cstdint>

namespace jsmla::cuda {

// The workspace of one backward call, carved from one buffer in this order, each part 16-byte aligned:
//   sink_terms    double [T, H]          every row's sink term, summed afterwards in token order
//   d_rows        double [T, H]          D of every row (the cache gradient recomputes the weights with it)
//   the cache gradient only (a bf16 main cache): n = T * topk candidate positions,
//   keys          uint64 [2][n]          (gradient group, slot) of each position, or kNoKey when masked
//   pairs         int32  [2][n]          the positions t * topk + j, radix-sorted by key (stable)
//   row_range     int32  [2][G * slots]  [first, last) of each output row's run in the sorted pairs (the
//                                        tensor-core path advances `first` chunk by chunk)
//   and for the tensor-core path, per chunk of Tc tokens (the call's chunk_tokens, planned at trace time
//   by chunk_tokens() below):
//   weights       bf16   [Tc, H, P]      P_j of every row and position (P = topk rounded up to 64)
//   coefficients  bf16   [Tc, H, P]      c_j = sm_scale P_j (dP_j - D + dl)
//   partials      bf16   [Tc * topk, d_qk]  each position's Σ_h c_j q_h + P_j dO_h, rounded once
//   accumulator   fp32   [G * slots, d_qk]  the output rows' running sums (only with more than one chunk)
//   sort_temp     bytes                  the sort's scratch (at most sort_temp_bound(n))
struct BackwardWorkspace {
  // By default the tensor-core cache gradient's per-chunk parts stay within this many bytes (or one
  // token's worth).
  static constexpr int64_t kChunkBudgetBytes = int64_t{1} << 32;
  static constexpr int kPositionPitchGranule = 64;  // the partials kernel's candidate tile
  // Bytes of one lane of a partial row (bf16): the partial rows are the cache gradient's largest traffic
  // (written once, read once), and one rounding per position stays far inside the gradient's bound.
  static constexpr int64_t kPartialBytes = 2;

  static constexpr int64_t align(int64_t bytes) { return (bytes + 15) / 16 * 16; }
  // An upper bound of the radix sort's scratch for n keys (two buffers given: only its histograms and
  // tile states); the handler checks the sort's own figure against it.
  static constexpr int64_t sort_temp_bound(int64_t n) { return (int64_t{1} << 20) + n; }
  static constexpr int64_t row_bytes(int64_t num_tokens, int64_t num_heads) {
    return align(num_tokens * num_heads * static_cast<int64_t>(sizeof(double)));
  }
  // Positions per (row, head) in weights/coefficients: whole candidate tiles, 128-byte aligned rows.
  static constexpr int64_t position_pitch(int64_t topk) {
    return (topk + kPositionPitchGranule - 1) / kPositionPitchGranule * kPositionPitchGranule;
  }
  static constexpr int64_t chunk_bytes_per_token(int64_t num_heads, int64_t topk, int64_t d_qk) {
    return 2 * num_heads * position_pitch(topk) * 2 + topk * d_qk * kPartialBytes;
  }
  // Tokens per chunk of the tensor-core cache gradient whose parts fit `budget` bytes (at least 1, at most T).
  static constexpr int64_t chunk_tokens(int64_t num_tokens, int64_t num_heads, int64_t topk, int64_t d_qk,
                                        int64_t budget = kChunkBudgetBytes) {
    const int64_t per_token = chunk_bytes_per_token(num_heads, topk, d_qk);
    const int64_t fit = per_token > 0 ? budget / per_token : num_tokens;
    return fit < 1 ? 1 : (fit < num_tokens ? fit : (num_tokens > 0 ? num_tokens : 1));
  }

  struct Layout {
    int64_t sink_terms, d_rows, keys0, keys1, pairs0, pairs1, row_first, row_last;
    int64_t weights, coefficients, partials, accumulator, sort_temp, total;
    int64_t chunk_tokens;  // Tc (0 without a cache gradient)
  };

  // The offsets of every part. `d_qk`: the main format's width; `chunk_tokens` in [1, T] (the tensor-core
  // parts are laid out for every bf16 cache gradient; a device the tensor-core kernel cannot run on leaves
  // them unused).
  static constexpr Layout layout(int64_t num_tokens, int64_t num_heads, int64_t topk, int64_t gradient_groups,
                                 int64_t num_slots, bool cache_gradient, int64_t d_qk, int64_t chunk_tokens) {
    Layout l{};
    int64_t cursor = 0;
    auto take = [&cursor](int64_t bytes) {
      const int64_t at = cursor;
      cursor += align(bytes);
      return at;
    };
    l.sink_terms = take(num_tokens * num_heads * 8);
    l.d_rows = take(num_tokens * num_heads * 8);
    if (cache_gradient) {
      const int64_t n = num_tokens * topk;
      const int64_t rows = gradient_groups * num_slots;
      l.keys0 = take(n * 8);
      l.keys1 = take(n * 8);
      l.pairs0 = take(n * 4);
      l.pairs1 = take(n * 4);
      l.row_first = take(rows * 4);
      l.row_last = take(rows * 4);
      l.chunk_tokens = chunk_tokens;
      const int64_t weights = l.chunk_tokens * num_heads * position_pitch(topk) * 2;
      l.weights = take(weights);
      l.coefficients = take(weights);
      l.partials = take(l.chunk_tokens * topk * d_qk * kPartialBytes);
      l.accumulator = take(l.chunk_tokens < num_tokens ? rows * d_qk * 4 : 0);
      l.sort_temp = take(sort_temp_bound(n));
    }
    l.total = cursor;
    return l;
  }
  static constexpr int64_t bytes(int64_t num_tokens, int64_t num_heads, int64_t topk, int64_t gradient_groups,
                                 int64_t num_slots, bool cache_gradient, int64_t d_qk, int64_t chunk_tokens) {
    return layout(num_tokens, num_heads, topk, gradient_groups, num_slots, cache_gradient, d_qk, chunk_tokens).total;
  }
};

}  // namespace jsmla::cuda
