// Host entry of the split-K combine kernel (combine.cuh): picks the block shape and launches it.
#include "kernels/cuda/combine.h"

#include "kernels/cuda/combine.cuh"

namespace jsmla::cuda {
namespace {

template <int kDv>
cudaError_t launch_shape(const CombineParams& p, cudaLaunchConfig_t config) {
  const int64_t rows = p.num_tokens * p.num_heads;
  // Many splits (a small batch's plan): slices of a row on separate blocks of several split groups.
  // The shape depends on num_splits alone, never on T, so a batch-invariant plan (fixed splits) merges
  // every row in the same order at every batch size.
  if (p.num_splits > kNarrowCombineGroups) {
    config.gridDim = dim3(static_cast<unsigned>(rows), kDv / (4 * kNarrowCombineLanes));
    config.blockDim = dim3(kNarrowCombineLanes * kNarrowCombineGroups);
    return cudaLaunchKernelEx(&config, combine_splits_kernel<kDv, kNarrowCombineLanes, kNarrowCombineGroups>, p);
  }
  config.gridDim = dim3(static_cast<unsigned>(rows), 1);
  config.blockDim = dim3(kWideCombineLanes<kDv>);
  return cudaLaunchKernelEx(&config, combine_splits_kernel<kDv, kWideCombineLanes<kDv>, 1>, p);
}

}  // namespace

cudaError_t launch_combine(const CombineParams& p, int d_v, bool dependent, cudaStream_t stream) {
  if (p.num_tokens * p.num_heads == 0) return cudaSuccess;
  if (p.num_splits < 1 || p.num_splits > kCombineMaxSplits) return cudaErrorInvalidValue;
  cudaLaunchConfig_t config = {};
  config.dynamicSmemBytes = static_cast<size_t>(p.num_splits) * sizeof(float);
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = dependent ? 1 : 0;
  switch (d_v) {
    case 512: return launch_shape<512>(p, config);
    case 1024: return launch_shape<1024>(p, config);
    default: return cudaErrorInvalidValue;
  }
}

int combine_max_splits() { return kCombineMaxSplits; }

}  // namespace jsmla::cuda
