// CUDA XLA FFI handler of the backward target (the CPU handler's operands and results, plus a workspace
// result sized at trace time): decodes the call (ffi/backward_args.h, shared with the CPU handler) and
// launches kernels/cuda/backward.h on XLA's stream. It allocates nothing, never synchronises and reads
// no device data on the host.
#include "ffi/cuda_handlers.h"

#include <cuda_runtime.h>

#include <string>

#include "ffi/backward_args.h"
#include "kernels/cuda/backward.h"
#include "kernels/cuda/backward_workspace.h"

namespace jsmla::ffi_glue {
namespace {

ffi::Error SparseMlaBackwardCuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::AnyBuffer kv_cache,
                                 ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> topk_length,
                                 ffi::Buffer<ffi::F32> attn_sink, ffi::AnyBuffer extra_kv_cache,
                                 ffi::Buffer<ffi::S32> extra_indices, ffi::Buffer<ffi::S32> extra_topk_length,
                                 ffi::Buffer<ffi::S32> valid_tokens, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::BF16> out,
                                 ffi::Buffer<ffi::BF16> d_out, ffi::Buffer<ffi::F32> d_lse,
                                 ffi::Result<ffi::Buffer<ffi::BF16>> d_q,
                                 ffi::Result<ffi::Buffer<ffi::BF16>> d_kv_cache,
                                 ffi::Result<ffi::Buffer<ffi::F32>> d_attn_sink, int32_t kv_format,
                                 int32_t extra_kv_format, float sm_scale, int64_t page_size, int64_t num_pages,
                                 int64_t page_stride, int64_t row_stride, int64_t extra_page_size,
                                 int64_t extra_num_pages, int64_t extra_page_stride, int64_t extra_row_stride,
                                 int64_t gradient_groups, int64_t chunk_tokens,
                                 ffi::Result<ffi::Buffer<ffi::U8>> workspace) {  // bound last (after the attributes)
  const FormatTraits* format = nullptr;
  BackwardParams params;
  ffi::Error error = decode_backward(
      kv_format, extra_kv_format, sm_scale, {page_size, num_pages, page_stride, row_stride},
      {extra_page_size, extra_num_pages, extra_page_stride, extra_row_stride}, q, kv_cache, indices, topk_length,
      attn_sink, extra_kv_cache, extra_indices, extra_topk_length, valid_tokens, lse, out, d_out, d_lse, d_q, d_kv_cache,
      d_attn_sink, gradient_groups, chunk_tokens, &format, &params);
  if (error.failure()) return error;
  const AttentionParams& a = params.forward;
  const bool cache_gradient = params.d_kv_cache != nullptr;
  const int64_t num_slots = a.main.cache.num_slots();
  const int64_t needed = cuda::BackwardWorkspace::bytes(a.num_tokens, a.num_heads, a.main.topk,
                                                         params.gradient_groups, num_slots, cache_gradient, format->d_qk,
                                                         params.chunk_tokens);
  if (static_cast<int64_t>(workspace->size_bytes()) < needed ||
      reinterpret_cast<uintptr_t>(workspace->untyped_data()) % 16 != 0) {
    return ffi::Error::InvalidArgument("workspace: the CUDA backward needs " + std::to_string(needed) +
                                       " bytes, 16-byte aligned, got " + std::to_string(workspace->size_bytes()));
  }
  if (a.num_tokens * ((a.num_heads + 3) / 4) > INT32_MAX) {
    return ffi::Error::InvalidArgument("q: T * ceil(H / 4) must stay within the CUDA grid limit (2^31 - 1)");
  }
  if (cache_gradient && (a.num_tokens * a.main.topk > INT32_MAX || params.gradient_groups * num_slots > INT32_MAX)) {
    return ffi::Error::InvalidArgument(
        "d_kv_cache: the CUDA cache gradient needs T * topk and gradient groups * slots below 2^31, got " +
        std::to_string(a.num_tokens * a.main.topk) + " and " + std::to_string(params.gradient_groups * num_slots));
  }
  const FormatTraits& extra = a.extra.topk > 0 ? kFormatTable[static_cast<int>(a.extra.format)] : *format;
  if (cudaError_t e = cuda::launch_backward(*format, extra, params, workspace->untyped_data(),
                                            static_cast<int64_t>(workspace->size_bytes()), stream);
      e != cudaSuccess) {
    return ffi::Error::Internal(std::string("sparse_mla backward kernel: ") + cudaGetErrorName(e) + " (" +
                                cudaGetErrorString(e) + ")");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jsmla::ffi_glue

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmlaSparseMlaBackwardCuda, jsmla::ffi_glue::SparseMlaBackwardCuda,
                              jsmla::ffi_glue::bind_backward(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>(),  // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});
