// The CPU extension module: FFI handler capsules plus the C++ format table (for the layout test).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ffi/cpu_handlers.h"
#include "kernels/common/formats.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule handler_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict format_entry(const jsmla::FormatTraits& f) {
  nb::dict d;
  d["id"] = static_cast<int>(f.id);
  d["layout"] = static_cast<int>(f.layout);
  d["scale_kind"] = static_cast<int>(f.scale_kind);
  d["d_qk"] = f.d_qk;
  d["d_v"] = f.d_v;
  d["bytes_per_token"] = f.bytes_per_token;
  d["fp8_dim"] = f.fp8_dim;
  d["bf16_dim"] = f.bf16_dim;
  d["group_size"] = f.group_size;
  d["num_groups"] = f.num_groups;
  d["data_row_bytes"] = f.data_row_bytes;
  d["scale_offset"] = f.scale_offset;
  d["scale_row_bytes"] = f.scale_row_bytes;
  d["bf16_offset"] = f.bf16_offset;
  d["max_candidates"] = f.max_candidates;
  d["pow2_scales"] = f.pow2_scales;
  d["dual_cache"] = f.dual_cache;
  return d;
}

}  // namespace

NB_MODULE(_cpu_ext, m) {
  m.doc() = "jax_sparse_mla CPU XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_sparse_mla_fwd_v1"] = handler_capsule(JsmlaSparseMlaCpu);
    return d;
  });
  m.def("format_table", []() {
    nb::list table;
    for (const auto& f : jsmla::kFormatTable) table.append(format_entry(f));
    return table;
  });
}
