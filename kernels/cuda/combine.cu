// Host entry of the split-K combine kernel (combine.cuh): picks the block shape and launches it.
#include "kernels/cuda/combine.h"

#include "kernels/cuda/combine.cuh"

namespace jsmla::cuda {
namespace {

// Blocks of the narrow shape (256 threads) one SM holds at once by thread count.
constexpr int kNarrowBlocksPerSm = 2048 / (kNarrowCombineLanes * kNarrowCombineGroups);

template <int kDv>
cudaError_t launch_shape(const CombineParams& p, int sm_count, cudaLaunchConfig_t config) {
  const int64_t rows = p.num_tokens * p.num_heads;
  constexpr int kSlices = kDv / (4 * kNarrowCombineLanes);
  // Few rows (a small batch): slices of a row on separate blocks, as long as they fit one wave.
  if (rows * kSlices <= static_cast<int64_t>(sm_count) * kNarrowBlocksPerSm) {
    config.gridDim = dim3(static_cast<unsigned>(rows), kSlices);
    config.blockDim = dim3(kNarrowCombineLanes * kNarrowCombineGroups);
    return cudaLaunchKernelEx(&config, combine_splits_kernel<kDv, kNarrowCombineLanes, kNarrowCombineGroups>, p);
  }
  config.gridDim = dim3(static_cast<unsigned>(rows), 1);
  config.blockDim = dim3(kWideCombineLanes<kDv>);
  return cudaLaunchKernelEx(&config, combine_splits_kernel<kDv, kWideCombineLanes<kDv>, 1>, p);
}

}  // namespace

cudaError_t launch_combine(const CombineParams& p, int d_v, int sm_count, bool dependent, cudaStream_t stream) {
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
    case 512: return launch_shape<512>(p, sm_count, config);
    case 1024: return launch_shape<1024>(p, sm_count, config);
    default: return cudaErrorInvalidValue;
  }
}

int combine_max_splits() { return kCombineMaxSplits; }

}  // namespace jsmla::cuda
