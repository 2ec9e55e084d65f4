// Plain parameter structs of the CUDA kernels (no XLA or Python types): filled by ffi/cuda_handlers.cu
// or by a standalone test, passed by value to the kernels.
#pragma once

#include <cstdint>

#include "kernels/common/params.h"
#include "kernels/cuda/split_workspace.h"

// Compile-time diagnostic (benchmarks/ab_tree.sh NAME=1; default 0): kernels that mark their phases
// (phase_clock.cuh) store each block's clock marks into SplitKvParams::phase_clocks when it is set (the
// standalone check's --profile-small; the FFI handlers leave it null).
#ifndef JSMLA_PHASE_CLOCKS
#define JSMLA_PHASE_CLOCKS 0
#endif

namespace jsmla::cuda {

// One attention launch. Candidate position j of token t runs over the main list (j < main.topk) then
// the extra list; split s of a token covers positions [s*split_size, (s+1)*split_size).
struct SplitKvParams {
  AttentionParams attn;
  int32_t num_head_tiles = 0;  // ceil(H / head tile)
  int32_t num_splits = 1;      // 1 when the kernel writes out/lse directly
  int32_t split_size = 0;      // candidate positions per split
  // Decode: where each split's partial state goes. Null: the single split writes out/lse itself
  // (the prefill variant), folding in the sink.
  SplitWorkspace workspace;
#if JSMLA_PHASE_CLOCKS
  // [block][role][PhaseClock::kRecord] (phase_clock.cuh), or null: no marks stored.
  long long* phase_clocks = nullptr;
#endif
};

// Merging the splits of a decode call into out/lse.
struct CombineParams {
  SplitWorkspace workspace;
  int32_t num_splits = 0;
  int64_t num_tokens = 0;
  int32_t num_heads = 0;
  const float* attn_sink = nullptr;        // [H] or nullptr
  const int32_t* valid_tokens = nullptr;   // [1] or nullptr (= num_tokens)
  uint16_t* out = nullptr;                 // bf16 bits [T, H, d_v]
  float* lse = nullptr;                    // [T, H]
};

// Rows t >= this count are padding; read on the device only.
JSMLA_HD int64_t valid_token_count(const int32_t* valid_tokens, int64_t num_tokens) {
  if (valid_tokens == nullptr) return num_tokens;
  const int64_t v = valid_tokens[0];
  return v < 0 ? 0 : (v > num_tokens ? num_tokens : v);
}

}  // namespace jsmla::cuda
