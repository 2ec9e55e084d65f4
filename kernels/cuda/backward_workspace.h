// The CUDA backward's workspace layout (host- and device-compilable, no CUDA headers): the CPU
// extension exposes its size so that the trace-time lowering sizes the workspace result as the handler
// checks it.
#pragma once

#include <cstdint>

namespace jsmla::cuda {

// The workspace of one backward call, carved from one buffer in this order, each part 16-byte aligned:
//   sink_terms  double [T, H]          every row's sink term, summed afterwards in token order
//   d_rows      double [T, H]          D of every row (the cache gradient recomputes the weights with it)
//   the cache gradient only (a bf16 main cache): n = T * topk candidate positions,
//   keys        uint64 [2][n]          (gradient group, slot) of each position, or kNoKey when masked
//   pairs       int32  [2][n]          the positions t * topk + j, radix-sorted by key (stable)
//   row_range   int32  [2][G * slots]  [first, last) of each output row's run in the sorted pairs
//   sort_temp   bytes                  the sort's scratch (at most kSortTempBytes(n))
struct BackwardWorkspace {
  static constexpr int64_t align(int64_t bytes) { return (bytes + 15) / 16 * 16; }
  // An upper bound of the radix sort's scratch for n keys (two buffers given: only its histograms and
  // tile states); the handler checks the sort's own figure against it.
  static constexpr int64_t sort_temp_bound(int64_t n) { return (int64_t{1} << 20) + n; }
  static constexpr int64_t row_bytes(int64_t num_tokens, int64_t num_heads) {
    return align(num_tokens * num_heads * static_cast<int64_t>(sizeof(double)));
  }
  static constexpr int64_t bytes(int64_t num_tokens, int64_t num_heads, int64_t topk, int64_t gradient_groups,
                                 int64_t num_slots, bool cache_gradient) {
    int64_t total = 2 * row_bytes(num_tokens, num_heads);
    if (cache_gradient) {
      const int64_t n = num_tokens * topk;
      total += 2 * align(n * 8) + 2 * align(n * 4) + 2 * align(gradient_groups * num_slots * 4) + sort_temp_bound(n);
    }
    return total;
  }
};

}  // namespace jsmla::cuda
