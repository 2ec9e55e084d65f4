// The FFI target name both handlers register under. A changed operand or attribute contract gets a new
// name, so that exported programs keep loading; jax_sparse_mla/_ffi.py takes it from the extensions'
// registrations().
#pragma once

namespace jsmla::ffi_glue {

inline constexpr const char kTargetName[] = "jax_sparse_mla_fwd_v2";

}  // namespace jsmla::ffi_glue
