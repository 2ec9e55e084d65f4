// Parameter structs shared by every kernel family. Plain data: no XLA or Python types.
#pragma once

#include <cstdint>

#include "cache_view.h"

namespace jsmla {

struct AttentionParams {
  const uint16_t* q = nullptr;  // bf16 bits, [num_tokens, num_heads, d_qk], dense
  int64_t num_tokens = 0;
  int32_t num_heads = 0;
  CandidateList main;
  CandidateList extra;              // extra.topk == 0 when there is no extra cache
  const float* attn_sink = nullptr; // [num_heads] or nullptr
  const int32_t* valid_tokens = nullptr;  // [1] or nullptr (= num_tokens); clamped to [0, num_tokens]
  float sm_scale = 1.0f;
  uint16_t* out = nullptr;  // bf16 bits, [num_tokens, num_heads, d_v]
  float* lse = nullptr;     // [num_tokens, num_heads], natural log, includes the sink
};

}  // namespace jsmla
