// Host entry of the split-K combine kernel (combine.cuh).
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/launch_params.h"

namespace jsmla::cuda {

// Merges p.num_splits partial states into out/lse on `stream`. d_v must be 512 or 1024.
cudaError_t launch_combine(const CombineParams& p, int d_v, cudaStream_t stream);

}  // namespace jsmla::cuda
