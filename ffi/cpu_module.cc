// The CPU extension module: the FFI handler capsules (forward and backward) and their target names, the
// C++ format table (for the layout test) and the CUDA kernel tables (kernels/cuda/kernel_table.h) as plain
// data, so the planner can plan for CUDA on a host without a GPU or a CUDA build.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ffi/cpu_handlers.h"
#include "ffi/target_name.h"
#include "kernels/common/contract.h"
#include "kernels/common/formats.h"
#include "kernels/cuda/backward_workspace.h"
#include "kernels/cuda/combine_shape.h"
#include "kernels/cuda/kernel_table.h"

namespace nb = nanobind;

namespace {

nb::dict format_entry(const jsmla::FormatTraits& f) {
  nb::dict d;
  d["id"] = static_cast<int>(f.id);
  d["layout"] = static_cast<int>(f.layout);
  d["scale_kind"] = static_cast<int>(f.scale_kind);
  d["d_qk"] = f.d_qk;
  d["d_v"] = f.d_v;
  d["bytes_per_token"] = f.bytes_per_token;
  d["quant_dim"] = f.quant_dim;
  d["quant_bits"] = f.quant_bits;
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

const char* family_name(jsmla::cuda::Family family) {
  return family == jsmla::cuda::Family::kHopper ? "hopper" : "portable";
}

nb::dict kernel_tables() {
  namespace cuda = jsmla::cuda;
  using jsmla::Variant;
  nb::dict variants;
  variants["reference"] = static_cast<int>(Variant::kReference);
  variants["decode"] = static_cast<int>(Variant::kDecode);
  variants["prefill"] = static_cast<int>(Variant::kPrefill);
  nb::list kernels;
  for (const cuda::KernelShape& k : cuda::kKernelShapes) {
    nb::dict entry;
    entry["family"] = family_name(k.family);
    entry["kv_format"] = static_cast<int>(k.format);
    entry["heads_per_block"] = k.heads_per_block;
    entry["threads"] = k.threads;
    entry["candidate_tile"] = k.candidate_tile;
    entry["shared_bytes"] = k.shared_bytes;
    entry["cluster_blocks"] = k.cluster_blocks;
    kernels.append(entry);
  }
  nb::dict d;
  d["variants"] = variants;
  d["min_heads"] = jsmla::kMinHeads;
  d["max_heads"] = jsmla::kMaxHeads;
  d["min_topk"] = jsmla::kMinTopk;
  d["split_granule"] = cuda::kSplitGranule;
  d["min_compute_capability"] = cuda::kMinComputeCapability;
  d["hopper_compute_capability"] = cuda::kHopperComputeCapability;
  d["kernels"] = kernels;
  return d;
}

}  // namespace

NB_MODULE(_cpu_ext, m) {
  m.doc() = "jax_sparse_mla CPU XLA FFI handlers and kernel tables";
  m.attr("FORWARD_TARGET") = jsmla::ffi_glue::kTargetName;
  m.attr("BACKWARD_TARGET") = jsmla::ffi_glue::kBackwardTargetName;
  m.def("registrations", []() {
    nb::dict d;
    d[jsmla::ffi_glue::kTargetName] = nb::capsule(reinterpret_cast<void*>(JsmlaSparseMlaCpu));
    d[jsmla::ffi_glue::kBackwardTargetName] = nb::capsule(reinterpret_cast<void*>(JsmlaSparseMlaBackwardCpu));
    return d;
  });
  m.def("format_table", []() {
    nb::list table;
    for (const auto& f : jsmla::kFormatTable) table.append(format_entry(f));
    return table;
  });
  m.def("kernel_tables", &kernel_tables, "The CUDA kernel tables and call-contract limits as plain data.");
  m.def(
      "workspace_bytes",
      [](int64_t num_splits, int64_t num_tokens, int64_t num_heads, int64_t d_v) {
        return jsmla::cuda::SplitWorkspace::bytes(num_splits, num_tokens, num_heads, d_v);
      },
      nb::arg("num_splits"), nb::arg("num_tokens"), nb::arg("num_heads"), nb::arg("d_v"),
      "Bytes of a decode call's split workspace.");
  m.def(
      "backward_workspace_bytes",
      [](int64_t num_tokens, int64_t num_heads, int64_t topk, int64_t gradient_groups, int64_t num_slots,
         bool cache_gradient, int64_t d_qk, int64_t chunk_tokens) {
        return jsmla::cuda::BackwardWorkspace::bytes(num_tokens, num_heads, topk, gradient_groups, num_slots,
                                                     cache_gradient, d_qk, chunk_tokens);
      },
      nb::arg("num_tokens"), nb::arg("num_heads"), nb::arg("topk"), nb::arg("gradient_groups"), nb::arg("num_slots"),
      nb::arg("cache_gradient"), nb::arg("d_qk"), nb::arg("chunk_tokens"), "Bytes of the CUDA backward call's workspace.");
  m.def(
      "backward_chunk_tokens",
      [](int64_t num_tokens, int64_t num_heads, int64_t topk, int64_t d_qk, int64_t budget_bytes) {
        return jsmla::cuda::BackwardWorkspace::chunk_tokens(num_tokens, num_heads, topk, d_qk, budget_bytes);
      },
      nb::arg("num_tokens"), nb::arg("num_heads"), nb::arg("topk"), nb::arg("d_qk"), nb::arg("budget_bytes"),
      "Tokens per chunk of the CUDA tensor-core cache gradient within budget_bytes.");
  m.attr("BACKWARD_CHUNK_BUDGET_BYTES") = jsmla::cuda::BackwardWorkspace::kChunkBudgetBytes;
  m.def(
      "kernel_family",
      [](int format_id, int heads_per_block, int64_t split_size, int capability, int max_shared_bytes,
         bool hopper_compiled) {
        if (format_id < 0 || format_id >= jsmla::kNumFormats) throw nb::value_error("unknown format id");
        return family_name(jsmla::cuda::choose_family(static_cast<jsmla::FormatId>(format_id), heads_per_block,
                                                      split_size, capability, max_shared_bytes, hopper_compiled,
                                                      jsmla::cuda::hopper_allowed_by_environment()));
      },
      nb::arg("format_id"), nb::arg("heads_per_block"), nb::arg("split_size"), nb::arg("capability"),
      nb::arg("max_shared_bytes"), nb::arg("hopper_compiled"),
      "The CUDA family that runs a plan's (format, head tile, split size) on a device, as the CUDA handler "
      "chooses it (JSMLA_CUDA_FAMILY read now).");
  m.def(
      "decode_positions",
      [](int64_t main_topk, int32_t window, int64_t extra_topk) {
        return jsmla::cuda::decode_positions(main_topk, window, extra_topk);
      },
      nb::arg("main_topk"), nb::arg("window"), nb::arg("extra_topk"),
      "Candidate positions a CUDA decode plan's splits must cover (kernels/cuda/kernel_table.h).");
  m.def(
      "row_conversion",
      [](int format_id) {
        if (format_id < 0 || format_id >= jsmla::kNumFormats) throw nb::value_error("unknown format id");
        switch (jsmla::row_conversion(jsmla::format_traits(static_cast<jsmla::FormatId>(format_id)))) {
          case jsmla::RowConversion::kConverted: return "converted";
          case jsmla::RowConversion::kExactScales: return "exact_scales";
          case jsmla::RowConversion::kDirect: return "direct";
        }
        return "converted";
      },
      nb::arg("format_id"), "How the CUDA kernels turn a format's rows into MMA operands (kernels/common/formats.h).");
  m.def(
      "combine_shape",
      [](int64_t rows, int num_splits, int d_v, int sm_count) {
        switch (jsmla::cuda::choose_combine_shape(rows, num_splits, d_v, sm_count)) {
          case jsmla::cuda::CombineShape::kNarrow: return "narrow";
          case jsmla::cuda::CombineShape::kWarp: return "warp";
          case jsmla::cuda::CombineShape::kWide: return "wide";
        }
        return "wide";
      },
      nb::arg("rows"), nb::arg("num_splits"), nb::arg("d_v"), nb::arg("sm_count"),
      "The block shape of the split-K combine of `rows` (token, head) rows over `num_splits` splits on "
      "`sm_count` SMs, as the CUDA launch chooses it.");
}
