// Parameters of the backward pass (the vector-Jacobian product of the attention): the forward call's
// operands, its lse residual, the cotangents of its results and the gradients to write. Plain data: no
// XLA or Python types.
#pragma once

#include <cstdint>

#include "params.h"

namespace jsmla {

struct BackwardParams {
  // The forward call's operands (q, candidate lists, sink, valid_tokens, sm_scale). Its `out` and `lse`
  // pointers stay null: the backward reads the forward's results from `lse` and `out` below and writes
  // no output.
  AttentionParams forward;
  const float* lse = nullptr;       // [num_tokens, num_heads]: the forward's lse (natural log, sink included)
  // bf16 bits [num_tokens, num_heads, d_v]: the forward's out. The CUDA tensor-core path takes each row's
  // D = Σ_j P_j dP_j as <dO, out> from it; the CPU and SIMT kernels recompute D by a first sweep.
  const uint16_t* out = nullptr;
  const uint16_t* d_out = nullptr;  // bf16 bits [num_tokens, num_heads, d_v], or nullptr for a zero cotangent
  const float* d_lse = nullptr;     // [num_tokens, num_heads], or nullptr for a zero cotangent
  // Gradients; a null pointer means "not wanted" and skips the work that only it needs. The shared operands'
  // gradients come once per group of num_tokens / gradient_groups consecutive rows (a jax.vmap batch
  // element each when the batch is folded into rows); num_tokens is a multiple of gradient_groups.
  int64_t gradient_groups = 1;
  // Tokens per chunk of the CUDA tensor-core cache gradient (planned at trace time; ignored elsewhere).
  int64_t chunk_tokens = 1;
  uint16_t* d_q = nullptr;          // bf16 bits [num_tokens, num_heads, d_qk]
  uint16_t* d_kv_cache = nullptr;   // bf16 bits [gradient_groups, num_slots, d_qk]: a bf16 main cache's rows
  float* d_attn_sink = nullptr;     // [gradient_groups, num_heads]
};

}  // namespace jsmla
