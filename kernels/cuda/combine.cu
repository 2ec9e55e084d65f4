// Host entry of the split-K combine kernel (combine.cuh): picks the block shape and the loads in flight,
// and launches it. Every choice here changes the speed only: all shapes sum in one order.
#include "kernels/cuda/combine.h"

#include "kernels/cuda/combine.cuh"

namespace jsmla::cuda {
namespace {

// The most partial loads in flight of any instantiation below (a thread's batch of split weights).
constexpr int kMaxSplitsInFlight = 16;

// An instantiation: its shape, a thread's loads in flight and the threads per SM it is compiled for
// (its register budget: 65536 / threads per SM).
template <int kDv, int kLanes, int kGroups, int kSplitsInFlight, int kThreadsPerSm, bool kFewSplits = false>
cudaError_t launch_instance(const CombineParams& p, cudaLaunchConfig_t config) {
  constexpr int kThreads = kLanes * kGroups;
  static_assert(kSplitsInFlight <= kMaxSplitsInFlight && kMaxSplitsInFlight % kSplitsInFlight == 0,
                "the padded weights cover every batch of split weights");
  static_assert(kThreadsPerSm % kThreads == 0 && kThreadsPerSm <= 2048, "whole blocks within an SM's threads");
  config.blockDim = dim3(kThreads);
  return cudaLaunchKernelEx(&config, combine_splits_kernel<kDv, kLanes, kGroups, kSplitsInFlight,
                                                           kThreadsPerSm / kThreads, kFewSplits>, p);
}

template <int kDv>
cudaError_t launch_shape(const CombineParams& p, int sm_count, cudaLaunchConfig_t config) {
  const int64_t rows = p.num_tokens * p.num_heads;
  switch (choose_combine_shape(rows, p.num_splits, kDv, sm_count)) {
    case CombineShape::kNarrow:
      config.gridDim = dim3(static_cast<unsigned>(rows), narrow_combine_slices(kDv));
      return launch_instance<kDv, kNarrowCombineLanes, kNarrowCombineGroups, 8, kNarrowThreadsPerSm>(p, config);
    case CombineShape::kWarp:
      config.gridDim = dim3(static_cast<unsigned>((rows + kWarpCombineRows - 1) / kWarpCombineRows));
      config.blockDim = dim3(32 * kWarpCombineRows);
      config.dynamicSmemBytes = 0;
      if (p.num_splits <= 2) return cudaLaunchKernelEx(&config, combine_rows_by_warp_kernel<kDv, kWarpCombineRows, 2>, p);
      if (p.num_splits <= 4) return cudaLaunchKernelEx(&config, combine_rows_by_warp_kernel<kDv, kWarpCombineRows, 4>, p);
      return cudaLaunchKernelEx(&config,
                                combine_rows_by_warp_kernel<kDv, kWarpCombineRows, warp_combine_max_splits(kDv)>, p);
    case CombineShape::kWide:
      break;
  }
  // Wide: one block per row, a thread walking all the splits (its loads in flight).
  config.gridDim = dim3(static_cast<unsigned>(rows), 1);
  constexpr int kLanes = kWideCombineLanes<kDv>;
  if constexpr (warp_combine_max_splits(kDv) < kMergeGroups) {  // d_v = 1024: 5 to 8 splits, one per merge group
    if (p.num_splits <= kMergeGroups) return launch_instance<kDv, kLanes, 1, 8, 1024, true>(p, config);
  }
  return launch_instance<kDv, kLanes, 1, 16, 512>(p, config);
}

}  // namespace

cudaError_t launch_combine(const CombineParams& p, int d_v, int sm_count, bool dependent, cudaStream_t stream) {
  if (p.num_tokens * p.num_heads == 0) return cudaSuccess;
  if (p.num_splits < 1 || p.num_splits > kCombineMaxSplits) return cudaErrorInvalidValue;
  cudaLaunchConfig_t config = {};
  // The split weights, padded to whole runs of kMaxSplitsInFlight: the merge loop reads a batch's
  // weights after its `s < num_splits` test, and the compiler may load them as one vector (LDS.128)
  // that runs past the last split (compute-sanitizer memcheck flagged it with three splits).
  config.dynamicSmemBytes =
      static_cast<size_t>((p.num_splits + kMaxSplitsInFlight - 1) / kMaxSplitsInFlight * kMaxSplitsInFlight) *
      sizeof(float);
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = dependent ? 1 : 0;
  switch (d_v) {
    case 512: return launch_shape<512>(p, sm_count, config);
    case 1024: return launch_shape<1024>(p, sm_count, config);
    default: return cudaErrorInvalidValue;
  }
}

int combine_max_splits() { return kCombineMaxSplits; }

}  // namespace jsmla::cuda
