// CPU XLA FFI handler: decodes the call and runs the C++ CPU kernel.
#include "ffi/cpu_handlers.h"

#include "ffi/attention_args.h"
#include "kernels/common/contract.h"
#include "kernels/cpu/sparse_mla_cpu.h"

namespace jsmla::ffi_glue {
namespace {

ffi::Error SparseMlaCpu(ffi::Buffer<ffi::BF16> q, ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> indices,
                        ffi::Buffer<ffi::S32> topk_length, ffi::Buffer<ffi::F32> attn_sink,
                        ffi::AnyBuffer extra_kv_cache, ffi::Buffer<ffi::S32> extra_indices,
                        ffi::Buffer<ffi::S32> extra_topk_length, ffi::Buffer<ffi::S32> valid_tokens,
                        ffi::Result<ffi::Buffer<ffi::BF16>> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                        ffi::Result<ffi::Buffer<ffi::U8>> /*workspace*/, int32_t kv_format,
                        int32_t extra_kv_format, float sm_scale,
                        int64_t page_size, int64_t num_pages, int64_t page_stride, int64_t row_stride,
                        int64_t extra_page_size, int64_t extra_num_pages, int64_t extra_page_stride,
                        int64_t extra_row_stride, int32_t variant, int32_t /*num_splits*/, int32_t /*split_size*/,
                        int32_t /*heads_per_block*/) {
  if (variant != static_cast<int32_t>(Variant::kReference)) {
    return ffi::Error::InvalidArgument("variant: the CPU target runs only the reference variant (" +
                                       std::to_string(static_cast<int32_t>(Variant::kReference)) + "), got " +
                                       std::to_string(variant));
  }
  const FormatTraits* format = nullptr;
  AttentionParams params;
  ffi::Error error = decode_attention(
      kv_format, extra_kv_format, sm_scale, {page_size, num_pages, page_stride, row_stride},
      {extra_page_size, extra_num_pages, extra_page_stride, extra_row_stride}, q, kv_cache, indices, topk_length,
      attn_sink, extra_kv_cache, extra_indices, extra_topk_length, valid_tokens, out, lse, &format, &params);
  if (error.failure()) return error;
  CpuKernelOptions options;
  if (const std::string problem = cpu_kernel_options_from_environment(&options); !problem.empty()) {
    return ffi::Error::InvalidArgument(problem);
  }
  sparse_mla_cpu(*format, params, options);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jsmla::ffi_glue

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmlaSparseMlaCpu, jsmla::ffi_glue::SparseMlaCpu,
                              jsmla::ffi_glue::bind_attention(xla::ffi::Ffi::Bind()));
