// CUDA XLA FFI handler symbols: the forward and the backward target.
#pragma once

#include <cstdint>

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JsmlaSparseMlaCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JsmlaSparseMlaBackwardCuda(XLA_FFI_CallFrame* call_frame);

namespace jsmla::ffi_glue {
// Number of times the CUDA handler has run on the host (command-buffer replays do not count).
int64_t cuda_handler_invocations();
}  // namespace jsmla::ffi_glue
