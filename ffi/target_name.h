// The FFI target names: the forward and the backward, each registered by the CPU and the CUDA handler
// (the CUDA backward takes one more result, its workspace). A changed operand or attribute contract gets a new name, so that exported programs keep
// loading; jax_sparse_mla/_ffi.py takes them from the CPU extension.
#pragma once

namespace jsmla::ffi_glue {

inline constexpr const char kTargetName[] = "jax_sparse_mla_fwd_v2";
inline constexpr const char kBackwardTargetName[] = "jax_sparse_mla_bwd_v2";

}  // namespace jsmla::ffi_glue
