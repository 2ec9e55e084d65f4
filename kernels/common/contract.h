// Facts of the FFI call contract that the planner, both handlers and the kernels share: the values of
// the `variant` attribute and the head-count envelope. Host- and device-compilable constexpr data; the
// Python package reads it from the CPU extension (jax_sparse_mla/kernel_tables.py), so nothing here is
// typed twice.
#pragma once

#include <cstdint>

namespace jsmla {

// Values of the `variant` plan attribute. Part of the attribute contract: append, never renumber.
enum class Variant : int32_t {
  kReference = 0,  // the CPU kernel: one pass, no workspace
  kDecode = 1,     // CUDA split-K over the candidate list, then the split merge, through the workspace
  kPrefill = 2,    // CUDA single pass per (token, head tile), no workspace
};

// Query heads per call (per shard): the CUDA kernels' head tiles cover at most two 64-head tiles.
inline constexpr int32_t kMinHeads = 1;
inline constexpr int32_t kMaxHeads = 128;
// Index row width: every row has at least one position.
inline constexpr int32_t kMinTopk = 1;

}  // namespace jsmla
