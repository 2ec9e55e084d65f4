// CUDA XLA FFI handler: decodes the call (shared with the CPU handler), checks that the baked-in plan
// fits these buffers and this device, and launches on XLA's stream. It allocates nothing, never
// synchronises and reads no device data on the host, so XLA may capture it in a command buffer.
#include "ffi/cuda_handlers.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

// nvcc's front end flags the XLA FFI headers (exhaustive switches without a trailing return,
// always_inline on non-inline functions); they are fine under the host compilers XLA supports.
#pragma nv_diag_suppress 940
#pragma nv_diag_suppress 2473
#include "ffi/attention_args.h"
#pragma nv_diag_default 940
#pragma nv_diag_default 2473
#include "kernels/cuda/combine.h"
#include "kernels/cuda/hopper/registry.h"
#include "kernels/cuda/portable/registry.h"

namespace jsmla::ffi_glue {
namespace {

namespace portable = jsmla::cuda::portable;
namespace hopper = jsmla::cuda::hopper;
using cuda::KernelInfo;

// Host-side executions of the handler. Replays of an XLA command buffer (CUDA graph) that captured
// the launches do not run the handler, which tests observe through this counter.
std::atomic<int64_t> handler_invocations{0};

using portable::kVariantDecode;
using portable::kVariantPrefill;

ffi::Error cuda_error(const char* what, cudaError_t error) {
  if (error == cudaErrorNoKernelImageForDevice || error == cudaErrorInvalidDeviceFunction) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(what) + ": this GPU architecture has no jax_sparse_mla kernel image (" +
                          cudaGetErrorName(error) + "); rebuild with its architecture in JSMLA_CUDA_ARCHS");
  }
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                              ")");
}

std::string format_heads_text(FormatId format) {
  std::string text;
  for (const KernelInfo* k = portable::kernels_begin(); k != portable::kernels_end(); ++k) {
    if (k->format == format) text += (text.empty() ? "" : ", ") + std::to_string(k->heads_per_block);
  }
  return text;
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

// The portable kernels gather rows with 16-byte cp.async: every row and page start must be aligned.
ffi::Error check_cache_alignment(const char* name, const CacheView& view) {
  if (view.num_pages == 0) return ffi::Error::Success();
  if (!aligned16(view.base) || view.page_stride % 16 != 0 || view.row_stride % 16 != 0) {
    return ffi::Error::InvalidArgument(std::string(name) + ": the CUDA kernels need 16-byte aligned rows and pages, got " +
                                       "page_stride=" + std::to_string(view.page_stride) +
                                       " row_stride=" + std::to_string(view.row_stride));
  }
  return ffi::Error::Success();
}

// Device properties the plan must fit; queried on the current device (no device data is read).
struct DeviceFacts {
  int capability = 0;  // major * 10 + minor
  int max_shared = 0;  // opt-in shared memory per block
};
ffi::Error check_device(const KernelInfo& kernel, int32_t min_sm_count, DeviceFacts* facts) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return cuda_error("cudaGetDevice", e);
  int major = 0, minor = 0, sm_count = 0, max_shared = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return cuda_error("cudaDeviceGetAttribute", e);
  const int capability = 10 * major + minor;
  if (capability < portable::kMinComputeCapability) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "jax_sparse_mla: no CUDA kernel for compute capability " + std::to_string(major) + "." +
                          std::to_string(minor) + " (the kernels need sm_80 or newer)");
  }
  if (min_sm_count > sm_count) {
    return ffi::Error::InvalidArgument("min_sm_count: the plan assumes at least " + std::to_string(min_sm_count) +
                                       " SMs, this device has " + std::to_string(sm_count) + "; re-plan for it");
  }
  if (kernel.shared_bytes > max_shared) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "heads_per_block: the kernel needs " + std::to_string(kernel.shared_bytes) +
                          " bytes of shared memory per block, this device allows " + std::to_string(max_shared));
  }
  facts->capability = capability;
  facts->max_shared = max_shared;
  return ffi::Error::Success();
}

// JSMLA_CUDA_FAMILY=portable keeps sm_90 GPUs on the portable kernels (for comparisons and tests);
// unset or "auto" lets them run the Hopper kernels. Read once per process.
bool hopper_allowed() {
  static const bool allowed = [] {
    const char* value = std::getenv("JSMLA_CUDA_FAMILY");
    return value == nullptr || std::strcmp(value, "portable") != 0;
  }();
  return allowed;
}

// The kernel that runs a plan on this device: the Hopper kernel for the same format and head tile
// when the device is an sm_90 GPU and the build carries sm_90a code, the portable kernel otherwise.
// Both serve the same plans (variants, split sizes, workspace layout).
const KernelInfo* select_kernel(const KernelInfo* portable_kernel, const DeviceFacts& facts) {
  const KernelInfo* fast = hopper::find_kernel(portable_kernel->format, portable_kernel->heads_per_block);
  if (fast != nullptr && hopper::compiled() && hopper_allowed() && facts.capability == hopper::kComputeCapability &&
      fast->shared_bytes <= facts.max_shared) {
    return fast;
  }
  return portable_kernel;
}

ffi::Error SparseMlaCuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::AnyBuffer kv_cache,
                         ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> topk_length,
                         ffi::Buffer<ffi::F32> attn_sink, ffi::AnyBuffer extra_kv_cache,
                         ffi::Buffer<ffi::S32> extra_indices, ffi::Buffer<ffi::S32> extra_topk_length,
                         ffi::Buffer<ffi::S32> valid_tokens, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                         ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                         int32_t kv_format, float sm_scale, int64_t page_size, int64_t num_pages, int64_t page_stride,
                         int64_t row_stride, int64_t extra_page_size, int64_t extra_num_pages,
                         int64_t extra_page_stride, int64_t extra_row_stride, int32_t variant, int32_t num_splits,
                         int32_t split_size, int32_t heads_per_block, int32_t min_sm_count) {
  handler_invocations.fetch_add(1, std::memory_order_relaxed);
  const FormatTraits* format = nullptr;
  cuda::SplitKvParams params;
  ffi::Error error = decode_attention(
      kv_format, sm_scale, {page_size, num_pages, page_stride, row_stride},
      {extra_page_size, extra_num_pages, extra_page_stride, extra_row_stride}, q, kv_cache, indices, topk_length,
      attn_sink, extra_kv_cache, extra_indices, extra_topk_length, valid_tokens, out, lse, &format, &params.attn);
  if (error.failure()) return error;
  const AttentionParams& a = params.attn;

  if (variant != kVariantDecode && variant != kVariantPrefill) {
    return ffi::Error::InvalidArgument("variant: the CUDA target runs decode (1) or prefill (2), got " +
                                       std::to_string(variant));
  }
  const KernelInfo* kernel = portable::find_kernel(format->id, heads_per_block);
  if (kernel == nullptr) {
    return ffi::Error::InvalidArgument("heads_per_block: expected one of {" + format_heads_text(format->id) +
                                       "} for kv_format " + std::to_string(kv_format) + ", got " +
                                       std::to_string(heads_per_block));
  }
  const int64_t total_candidates = static_cast<int64_t>(a.main.topk) + a.extra.topk;
  const bool decode = variant == kVariantDecode;
  if (decode) {
    const int granule = portable::split_granule();
    if (num_splits < 1 || split_size < 1 || split_size % granule != 0 ||
        static_cast<int64_t>(num_splits) * split_size < total_candidates) {
      return ffi::Error::InvalidArgument(
          "num_splits/split_size: decode needs num_splits >= 1 and split_size a positive multiple of " +
          std::to_string(granule) + " with num_splits * split_size >= topk + extra_topk = " +
          std::to_string(total_candidates) + ", got num_splits=" + std::to_string(num_splits) +
          " split_size=" + std::to_string(split_size));
    }
  }
  if (error = check_cache_alignment("kv_cache", a.main.cache); error.failure()) return error;
  if (a.extra.topk > 0) {
    if (error = check_cache_alignment("extra_kv_cache", a.extra.cache); error.failure()) return error;
  }
  if (reinterpret_cast<uintptr_t>(a.q) % 4 != 0 || !aligned16(a.out)) {
    return ffi::Error::InvalidArgument("q/out: the CUDA kernels need 4-byte aligned q and 16-byte aligned out");
  }
  DeviceFacts facts;
  if (error = check_device(*kernel, min_sm_count, &facts); error.failure()) return error;
  kernel = select_kernel(kernel, facts);

  const int64_t num_tokens = a.num_tokens;
  if (num_tokens == 0) return ffi::Error::Success();
  params.num_head_tiles = (a.num_heads + heads_per_block - 1) / heads_per_block;
  params.num_splits = decode ? num_splits : 1;
  params.split_size = decode ? split_size : static_cast<int32_t>(total_candidates);
  const int64_t blocks = num_tokens * params.num_head_tiles * params.num_splits;
  if (blocks > INT32_MAX || num_tokens * a.num_heads > INT32_MAX) {
    return ffi::Error::InvalidArgument("q/num_splits: T * head tiles * num_splits = " + std::to_string(blocks) +
                                       " and T * H = " + std::to_string(num_tokens * a.num_heads) +
                                       " blocks must stay within the CUDA grid limit (2^31 - 1)");
  }

  if (decode) {
    const int64_t needed = cuda::SplitWorkspace::bytes(num_splits, num_tokens, a.num_heads, format->d_v);
    const int64_t given = static_cast<int64_t>(workspace->size_bytes());
    if (given < needed || !aligned16(workspace->untyped_data())) {
      return ffi::Error::InvalidArgument("workspace: decode with num_splits=" + std::to_string(num_splits) +
                                         " needs " + std::to_string(needed) +
                                         " bytes (num_splits*T*H*(d_v+1)*4, 16-byte aligned), got " +
                                         std::to_string(given));
    }
    params.workspace =
        cuda::SplitWorkspace::carve(workspace->untyped_data(), num_splits, num_tokens, a.num_heads, format->d_v);
  }

  if (cudaError_t e = kernel->launch(params, stream); e != cudaSuccess) return cuda_error("sparse_mla kernel", e);
  if (decode) {
    cuda::CombineParams combine;
    combine.workspace = params.workspace;
    combine.num_splits = num_splits;
    combine.num_tokens = num_tokens;
    combine.num_heads = a.num_heads;
    combine.attn_sink = a.attn_sink;
    combine.valid_tokens = a.valid_tokens;
    combine.out = a.out;
    combine.lse = a.lse;
    if (cudaError_t e = cuda::launch_combine(combine, format->d_v, stream); e != cudaSuccess) {
      return cuda_error("sparse_mla combine kernel", e);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

int64_t cuda_handler_invocations() { return handler_invocations.load(std::memory_order_relaxed); }

}  // namespace jsmla::ffi_glue

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmlaSparseMlaCuda, jsmla::ffi_glue::SparseMlaCuda,
                              jsmla::ffi_glue::bind_attention(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
