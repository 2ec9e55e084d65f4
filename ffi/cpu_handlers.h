// CPU XLA FFI handler symbols.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JsmlaSparseMlaCpu(XLA_FFI_CallFrame* call_frame);
