// The CUDA extension module: the FFI handler capsules (forward and backward), the handler's invocation count (for the
// command-buffer tests) and whether this build carries the Hopper family's sm_90a code.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ffi/cuda_handlers.h"
#include "ffi/target_name.h"
#include "kernels/cuda/registry.h"

namespace nb = nanobind;

NB_MODULE(_cuda_ext, m) {
  m.doc() = "jax_sparse_mla CUDA XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d[jsmla::ffi_glue::kTargetName] = nb::capsule(reinterpret_cast<void*>(JsmlaSparseMlaCuda));
    d[jsmla::ffi_glue::kBackwardTargetName] = nb::capsule(reinterpret_cast<void*>(JsmlaSparseMlaBackwardCuda));
    return d;
  });
  m.def("handler_invocations", &jsmla::ffi_glue::cuda_handler_invocations,
        "How many times the CUDA handler ran on the host (command-buffer replays do not run it).");
  m.def("hopper_compiled", &jsmla::cuda::hopper_compiled,
        "Whether this build carries the Hopper family's sm_90a code.");
}
