// CUDA XLA FFI handler: decodes the call (shared with the CPU handler), checks that the baked-in plan
// fits these buffers and this device, selects the kernel (family, format, head tile) and launches on
// XLA's stream. It allocates nothing, never synchronises and reads no device data on the host, so XLA
// may capture it in a command buffer.
#include "ffi/cuda_handlers.h"

#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "ffi/attention_args.h"
#include "kernels/common/contract.h"
#include "kernels/cuda/combine.h"
#include "kernels/cuda/registry.h"

namespace jsmla::ffi_glue {
namespace {

using cuda::Family;
using cuda::KernelInfo;

// Host-side executions of the handler. Replays of an XLA command buffer (CUDA graph) that captured
// the launches do not run the handler, which tests observe through this counter.
std::atomic<int64_t> handler_invocations{0};

ffi::Error cuda_error(const char* what, cudaError_t error) {
  if (error == cudaErrorNoKernelImageForDevice || error == cudaErrorInvalidDeviceFunction) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(what) + ": this GPU architecture has no jax_sparse_mla kernel image (" +
                          cudaGetErrorName(error) + "); rebuild with its architecture in JSMLA_CUDA_ARCHS");
  }
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                              ")");
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

// The planner's decisions for one call (the plan attributes).
struct PlanAttributes {
  int32_t variant;
  int32_t num_splits;
  int32_t split_size;
  int32_t heads_per_block;
  bool decode() const { return variant == static_cast<int32_t>(Variant::kDecode); }
};

// ------------------------------------------------------------------------------ plan checks

// The head tiles of a format: its portable tiles, then its Hopper-only tiles (marked: sm_90 only).
std::string head_tiles_text(FormatId format) {
  std::string text;
  for (const cuda::KernelShape& k : cuda::kKernelShapes) {
    if (k.format == format && (k.family == Family::kPortable || cuda::hopper_only(format, k.heads_per_block))) {
      text += (text.empty() ? "" : ", ") + std::to_string(k.heads_per_block) +
              (k.family == Family::kHopper ? " (sm_90 only)" : "");
    }
  }
  return text;
}

// The kernels gather rows with 16-byte cp.async: every row and page start must be aligned.
ffi::Error check_cache_alignment(const char* name, const CacheView& view) {
  if (view.num_pages == 0) return ffi::Error::Success();
  if (!aligned16(view.base) || view.page_stride % 16 != 0 || view.row_stride % 16 != 0) {
    return ffi::Error::InvalidArgument(std::string(name) + ": the CUDA kernels need 16-byte aligned rows and pages, got " +
                                       "page_stride=" + std::to_string(view.page_stride) +
                                       " row_stride=" + std::to_string(view.row_stride));
  }
  return ffi::Error::Success();
}

// Checks the plan attributes against the format and the buffers of this call.
ffi::Error check_plan(const FormatTraits& f, const AttentionParams& a, const PlanAttributes& plan,
                      const void* workspace, int64_t workspace_bytes) {
  if (plan.variant != static_cast<int32_t>(Variant::kDecode) && plan.variant != static_cast<int32_t>(Variant::kPrefill)) {
    return ffi::Error::InvalidArgument("variant: the CUDA target runs decode (" +
                                       std::to_string(static_cast<int32_t>(Variant::kDecode)) + ") or prefill (" +
                                       std::to_string(static_cast<int32_t>(Variant::kPrefill)) + "), got " +
                                       std::to_string(plan.variant));
  }
  if (a.extra.topk > 0 && a.extra.format != f.id) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "extra_kv_format: the CUDA kernels read the extra cache in the main cache's format; format " +
                          std::to_string(static_cast<int>(a.extra.format)) + " with main format " +
                          std::to_string(static_cast<int>(f.id)) + " has no CUDA kernel");
  }
  if (cuda::find_shape(Family::kPortable, f.id, plan.heads_per_block) < 0 && !cuda::hopper_only(f.id, plan.heads_per_block)) {
    return ffi::Error::InvalidArgument("heads_per_block: expected one of {" + head_tiles_text(f.id) +
                                       "} for kv_format " + std::to_string(static_cast<int>(f.id)) + ", got " +
                                       std::to_string(plan.heads_per_block));
  }
  const int64_t positions = cuda::decode_positions(a.main.topk, f.max_candidates, a.extra.topk);
  if (plan.decode() && (plan.num_splits < 1 || plan.num_splits > cuda::combine_max_splits() || plan.split_size < 1 ||
                        plan.split_size % cuda::kSplitGranule != 0 ||
                        static_cast<int64_t>(plan.num_splits) * plan.split_size < positions)) {
    return ffi::Error::InvalidArgument(
        "num_splits/split_size: decode needs 1 <= num_splits <= " + std::to_string(cuda::combine_max_splits()) +
        " and split_size a positive multiple of " + std::to_string(cuda::kSplitGranule) +
        " with num_splits * split_size >= the candidate positions read (topk + extra_topk, the main list cut "
        "at the format's window without an extra list) = " +
        std::to_string(positions) + ", got num_splits=" + std::to_string(plan.num_splits) +
        " split_size=" + std::to_string(plan.split_size));
  }
  if (ffi::Error error = check_cache_alignment("kv_cache", a.main.cache); error.failure()) return error;
  if (a.extra.topk > 0) {
    if (ffi::Error error = check_cache_alignment("extra_kv_cache", a.extra.cache); error.failure()) return error;
  }
  if (!aligned16(a.q) || !aligned16(a.out)) {
    return ffi::Error::InvalidArgument("q/out: the CUDA kernels need 16-byte aligned q and out");
  }
  const int64_t head_tiles = (a.num_heads + plan.heads_per_block - 1) / plan.heads_per_block;
  const int64_t blocks = a.num_tokens * head_tiles * (plan.decode() ? plan.num_splits : 1);
  if (blocks > INT32_MAX || a.num_tokens * a.num_heads > INT32_MAX) {
    return ffi::Error::InvalidArgument("q/num_splits: T * head tiles * num_splits = " + std::to_string(blocks) +
                                       " and T * H = " + std::to_string(a.num_tokens * a.num_heads) +
                                       " blocks must stay within the CUDA grid limit (2^31 - 1)");
  }
  if (plan.decode()) {
    const int64_t needed = cuda::SplitWorkspace::bytes(plan.num_splits, a.num_tokens, a.num_heads, f.d_v);
    if (workspace_bytes < needed || !aligned16(workspace)) {
      return ffi::Error::InvalidArgument("workspace: decode with num_splits=" + std::to_string(plan.num_splits) +
                                         " needs " + std::to_string(needed) + " bytes, 16-byte aligned, got " +
                                         std::to_string(workspace_bytes));
    }
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------- kernel selection

// JSMLA_CUDA_FAMILY is read once per process.
bool hopper_allowed() {
  static const bool allowed = cuda::hopper_allowed_by_environment();
  return allowed;
}

// What the launches depend on besides the kernel: the compute capability (major * 10 + minor) and the
// SM count of the current device.
struct DeviceFacts {
  int capability = 0;
  int sm_count = 0;
};

// The kernel that runs the plan on the current device (no device data is read): the family
// cuda::choose_family picks, for the plan's format, head tile and split size; fills `facts`.
ffi::Error select_kernel(const FormatTraits& f, int32_t heads_per_block, int64_t split_size, const KernelInfo** kernel,
                         DeviceFacts* facts) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return cuda_error("cudaGetDevice", e);
  int major = 0, minor = 0, max_shared = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&facts->sm_count, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return cuda_error("cudaDeviceGetAttribute", e);
  facts->capability = 10 * major + minor;
  if (facts->capability < cuda::kMinComputeCapability) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "jax_sparse_mla: no CUDA kernel for compute capability " + std::to_string(major) + "." +
                          std::to_string(minor) + " (the kernels need sm_" +
                          std::to_string(cuda::kMinComputeCapability) + " or newer)");
  }
  const Family family =
      cuda::choose_family(f.id, heads_per_block, split_size, facts->capability, max_shared, cuda::hopper_compiled(),
                          hopper_allowed());
  *kernel = cuda::find_kernel(family, f.id, heads_per_block);
  if (*kernel == nullptr) {  // a Hopper-only head tile where the Hopper family does not run
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "heads_per_block: head tile " + std::to_string(heads_per_block) + " of kv_format " +
                          std::to_string(static_cast<int>(f.id)) +
                          " runs on the Hopper kernels only (an sm_90 GPU, a build with sm_90a code, "
                          "JSMLA_CUDA_FAMILY not 'portable'); plan for this device instead");
  }
  if ((*kernel)->shape.shared_bytes > max_shared) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "heads_per_block: the kernel needs " + std::to_string((*kernel)->shape.shared_bytes) +
                          " bytes of shared memory per block, this device allows " + std::to_string(max_shared));
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------- launch

// Candidate positions per split: the decode plan's split size, or a prefill plan's whole list.
int64_t positions_per_split(const PlanAttributes& plan, const AttentionParams& a) {
  return plan.decode() ? plan.split_size : static_cast<int64_t>(a.main.topk) + a.extra.topk;
}

// Compute capability from which the split merge is launched as the split kernel's programmatic
// dependent (its blocks start while the split kernel finishes).
constexpr int kDependentLaunchCapability = 90;

// The split kernel (or the single pass), then for decode the merge of the splits into out/lse.
ffi::Error launch(const KernelInfo& kernel, const FormatTraits& f, const PlanAttributes& plan,
                  const DeviceFacts& device, cuda::SplitKvParams& params, void* workspace, cudaStream_t stream) {
  const AttentionParams& a = params.attn;
  params.num_head_tiles = (a.num_heads + plan.heads_per_block - 1) / plan.heads_per_block;
  params.num_splits = plan.decode() ? plan.num_splits : 1;
  params.split_size = static_cast<int32_t>(positions_per_split(plan, a));
  if (plan.decode()) {
    params.workspace = cuda::SplitWorkspace::carve(workspace, plan.num_splits, a.num_tokens, a.num_heads, f.d_v);
  }
  if (cudaError_t e = kernel.launch(params, stream); e != cudaSuccess) return cuda_error("sparse_mla kernel", e);
  if (!plan.decode()) return ffi::Error::Success();
  cuda::CombineParams combine;
  combine.workspace = params.workspace;
  combine.num_splits = plan.num_splits;
  combine.num_tokens = a.num_tokens;
  combine.num_heads = a.num_heads;
  combine.attn_sink = a.attn_sink;
  combine.valid_tokens = a.valid_tokens;
  combine.out = a.out;
  combine.lse = a.lse;
  if (cudaError_t e = cuda::launch_combine(combine, f.d_v, device.sm_count,
                                           device.capability >= kDependentLaunchCapability, stream);
      e != cudaSuccess) {
    return cuda_error("sparse_mla combine kernel", e);
  }
  return ffi::Error::Success();
}

ffi::Error SparseMlaCuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::AnyBuffer kv_cache,
                         ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> topk_length,
                         ffi::Buffer<ffi::F32> attn_sink, ffi::AnyBuffer extra_kv_cache,
                         ffi::Buffer<ffi::S32> extra_indices, ffi::Buffer<ffi::S32> extra_topk_length,
                         ffi::Buffer<ffi::S32> valid_tokens, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                         ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                         int32_t kv_format, int32_t extra_kv_format, float sm_scale, int64_t page_size,
                         int64_t num_pages, int64_t page_stride,
                         int64_t row_stride, int64_t extra_page_size, int64_t extra_num_pages,
                         int64_t extra_page_stride, int64_t extra_row_stride, int32_t variant, int32_t num_splits,
                         int32_t split_size, int32_t heads_per_block) {
  handler_invocations.fetch_add(1, std::memory_order_relaxed);
  const FormatTraits* format = nullptr;
  cuda::SplitKvParams params;
  ffi::Error error = decode_attention(
      kv_format, extra_kv_format, sm_scale, {page_size, num_pages, page_stride, row_stride},
      {extra_page_size, extra_num_pages, extra_page_stride, extra_row_stride}, q, kv_cache, indices, topk_length,
      attn_sink, extra_kv_cache, extra_indices, extra_topk_length, valid_tokens, out, lse, &format, &params.attn);
  if (error.failure()) return error;
  const PlanAttributes plan{variant, num_splits, split_size, heads_per_block};
  void* const workspace_data = workspace->untyped_data();
  const int64_t workspace_bytes = static_cast<int64_t>(workspace->size_bytes());
  if (error = check_plan(*format, params.attn, plan, workspace_data, workspace_bytes); error.failure()) return error;
  const KernelInfo* kernel = nullptr;
  DeviceFacts device;
  if (error = select_kernel(*format, heads_per_block, positions_per_split(plan, params.attn), &kernel, &device);
      error.failure()) {
    return error;
  }
  if (params.attn.num_tokens == 0) return ffi::Error::Success();  // never launch an empty grid
  return launch(*kernel, *format, plan, device, params, workspace_data, stream);
}

}  // namespace

int64_t cuda_handler_invocations() { return handler_invocations.load(std::memory_order_relaxed); }

}  // namespace jsmla::ffi_glue

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmlaSparseMlaCuda, jsmla::ffi_glue::SparseMlaCuda,
                              jsmla::ffi_glue::bind_attention(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
