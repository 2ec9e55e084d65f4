// The CUDA extension module: the FFI handler capsule plus the compiled kernel constants, which
// jax_sparse_mla/cuda_config.py mirrors for the planner (a test compares the two).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ffi/cuda_handlers.h"
#include "kernels/cuda/hopper/registry.h"
#include "kernels/cuda/portable/registry.h"

namespace nb = nanobind;

namespace {

// One dict per kernel of a family's table.
nb::list kernel_list(const jsmla::cuda::KernelInfo* begin, const jsmla::cuda::KernelInfo* end) {
  nb::list kernels;
  for (const jsmla::cuda::KernelInfo* k = begin; k != end; ++k) {
    nb::dict entry;
    entry["kv_format"] = static_cast<int>(k->format);
    entry["heads_per_block"] = k->heads_per_block;
    entry["threads"] = k->threads;
    entry["candidate_tile"] = k->candidate_tile;
    entry["shared_bytes"] = k->shared_bytes;
    kernels.append(entry);
  }
  return kernels;
}

nb::dict kernel_configs() {
  namespace portable = jsmla::cuda::portable;
  namespace hopper = jsmla::cuda::hopper;
  nb::dict variants;
  variants["decode"] = portable::kVariantDecode;
  variants["prefill"] = portable::kVariantPrefill;
  nb::dict d;
  d["family"] = "portable";
  d["variants"] = variants;
  d["split_granule"] = portable::split_granule();
  d["min_compute_capability"] = portable::kMinComputeCapability;
  d["kernels"] = kernel_list(portable::kernels_begin(), portable::kernels_end());
  nb::dict hopper_family;
  hopper_family["compiled"] = hopper::compiled();
  hopper_family["compute_capability"] = hopper::kComputeCapability;
  hopper_family["kernels"] = kernel_list(hopper::kernels_begin(), hopper::kernels_end());
  d["hopper"] = hopper_family;
  return d;
}

}  // namespace

NB_MODULE(_cuda_ext, m) {
  m.doc() = "jax_sparse_mla CUDA XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_sparse_mla_fwd_v1"] = nb::capsule(reinterpret_cast<void*>(JsmlaSparseMlaCuda));
    return d;
  });
  m.def("handler_invocations", &jsmla::ffi_glue::cuda_handler_invocations,
        "How many times the CUDA handler ran on the host (command-buffer replays do not run it).");
  m.def("kernel_configs", &kernel_configs,
        "The compiled constants of the portable and Hopper families (mirrored by jax_sparse_mla.cuda_config).");
}
