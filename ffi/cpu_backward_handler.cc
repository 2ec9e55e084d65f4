// CPU XLA FFI handler of the backward target: decodes the call and runs the C++ CPU backward kernel on
// JSMLA_CPU_THREADS threads (read as for the forward kernel) or, when that variable is unset or empty,
// on as many threads as the hardware has. The CPU kernel recomputes each row's D exactly (it leaves the
// forward's out, which the call carries for the CUDA kernels, unread).
#include <string>

#include "ffi/backward_args.h"
#include "ffi/cpu_handlers.h"
#include "kernels/cpu/sparse_mla_cpu.h"
#include "kernels/cpu/sparse_mla_cpu_bwd.h"

namespace jsmla::ffi_glue {
namespace {

ffi::Error SparseMlaBackwardCpu(ffi::Buffer<ffi::BF16> q, ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> indices,
                                ffi::Buffer<ffi::S32> topk_length, ffi::Buffer<ffi::F32> attn_sink,
                                ffi::AnyBuffer extra_kv_cache, ffi::Buffer<ffi::S32> extra_indices,
                                ffi::Buffer<ffi::S32> extra_topk_length, ffi::Buffer<ffi::S32> valid_tokens,
                                ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::BF16> out, ffi::Buffer<ffi::BF16> d_out,
                                ffi::Buffer<ffi::F32> d_lse,
                                ffi::Result<ffi::Buffer<ffi::BF16>> d_q,
                                ffi::Result<ffi::Buffer<ffi::BF16>> d_kv_cache,
                                ffi::Result<ffi::Buffer<ffi::F32>> d_attn_sink, int32_t kv_format,
                                int32_t extra_kv_format, float sm_scale,
                                int64_t page_size, int64_t num_pages, int64_t page_stride, int64_t row_stride,
                                int64_t extra_page_size, int64_t extra_num_pages, int64_t extra_page_stride,
                                int64_t extra_row_stride, int64_t gradient_groups,
                                int64_t chunk_tokens) {
  const FormatTraits* format = nullptr;
  BackwardParams params;
  ffi::Error error = decode_backward(
      kv_format, extra_kv_format, sm_scale, {page_size, num_pages, page_stride, row_stride},
      {extra_page_size, extra_num_pages, extra_page_stride, extra_row_stride}, q, kv_cache, indices, topk_length,
      attn_sink, extra_kv_cache, extra_indices, extra_topk_length, valid_tokens, lse, out, d_out, d_lse, d_q, d_kv_cache,
      d_attn_sink, gradient_groups, chunk_tokens, &format, &params);
  if (error.failure()) return error;
  CpuKernelOptions options;  // the forward's environment settings: one parser, one error text
  if (const std::string problem = cpu_kernel_options_from_environment(&options); !problem.empty()) {
    return ffi::Error::InvalidArgument(problem);
  }
  sparse_mla_cpu_backward(*format, params, options.num_threads);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jsmla::ffi_glue

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmlaSparseMlaBackwardCpu, jsmla::ffi_glue::SparseMlaBackwardCpu,
                              jsmla::ffi_glue::bind_backward(xla::ffi::Ffi::Bind()));
