// CPU XLA FFI handler symbols.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JsmlaSparseMlaCpu(XLA_FFI_CallFrame* call_frame);
// The backward target (ffi/cpu_backward_handler.cc).
extern "C" XLA_FFI_Error* JsmlaSparseMlaBackwardCpu(XLA_FFI_CallFrame* call_frame);
